"""A server connection before it is authenticated, and what bounds it.

The server's one handshake thread drives every :class:`_Handshake` on a
selector (non-blocking socket, no thread of its own): it sends the HELLO and
reads the AUTH frame, whose header is judged before any of its body is read.
:class:`_RateLog` keeps refusals from flooding the log.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Any

from kvfleet.agent.transfer import auth
from kvfleet.agent.transfer.channel import PeerClosed
from kvfleet.agent.transfer.frames import HEADER_SIZE, Header


class _Handshake:
    """A connection between accept and a verified AUTH, driven by the handshake loop (no thread of its
    own)."""

    __slots__ = ("body", "deadline", "hdr", "header", "nonce_s", "out", "peer", "sock")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, nonce_s: bytes, hello: bytes) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.nonce_s = nonce_s
        self.out = memoryview(hello)  # what is left of the HELLO to send
        self.hdr = bytearray()
        self.header: Header | None = None
        self.body = bytearray()

    def flush(self) -> None:
        """Send what the socket takes of the HELLO (it fits an empty send buffer: normally all of it)."""
        while self.out:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            self.out = self.out[n:]

    def read(self) -> bool:
        """Read what has arrived of the AUTH frame, never past its end; True once it is complete.

        The header is judged before its body is read (:func:`auth.check_auth_header`),
        so an oversized or unexpected frame costs nothing. Raises
        :class:`PeerClosed`, :class:`FrameError` or :class:`OSError`.
        """
        while True:
            if self.header is None:
                need = HEADER_SIZE - len(self.hdr)
            else:
                need = self.header.length - len(self.body)
                if need == 0:
                    return True
            try:
                chunk = self.sock.recv(need)
            except (BlockingIOError, InterruptedError):
                return False
            if not chunk:
                raise PeerClosed(f"connection closed by {self.peer} during the handshake")
            if self.header is None:
                self.hdr += chunk
                if len(self.hdr) == HEADER_SIZE:
                    self.header = auth.check_auth_header(self.hdr)
            else:
                self.body += chunk

    def close(self) -> None:
        _close(self.sock)


def _close(sock: socket.socket) -> None:
    """FIN first (what the peer sent and we did not read would otherwise turn the close into a reset)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class _RateLog:
    """One warning per kind at most every ``every_s`` seconds to ``logger``, saying how many were not logged
    since."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        if quiet:
            self.log.warning(msg + " (and %d more since the last report)", *args, quiet)
        else:
            self.log.warning(msg, *args)


def _peer_name(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
