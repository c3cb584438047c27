"""One authenticated connection's byte plumbing over a blocking socket.

Sends are ``sendmsg([header, payload])`` straight from the block's memory (a
memoryview: no copy in user space); receives are ``recv_into`` a caller-given
memoryview, so a block payload lands directly in its destination slot. Calls
block the calling I/O thread only; the GIL is released inside the syscalls, so
several streams move data in parallel. Any socket failure or timeout becomes a
:class:`StreamError`; any bad header a :class:`FrameError`.

After the handshake :meth:`Channel.seal` gives the channel its two session
keys: from then on every frame sent is followed by its tag
(:meth:`send_frames`, :meth:`send_block`) and every control frame received is
checked (:meth:`recv_control`; a block's receiver checks with
:meth:`recv_tag` or :meth:`recv_block_mac`). A tag that does not verify is an :class:`IntegrityError`.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
import threading
from typing import Any

from kvfleet.agent.transfer.auth import TAG_BYTES, FrameSeal
from kvfleet.agent.transfer.errors import IntegrityError, StreamError
from kvfleet.agent.transfer.frames import HEADER_SIZE, Header, decode_body, decode_header

#: A MAC-covered block payload is received in pieces of at most this size, each
#: authenticated as soon as it is in, while the next piece arrives.
HASH_CHUNK = 1 << 20


class PeerClosed(StreamError):
    """The peer closed the connection cleanly, between two frames."""


class IdleTimeout(StreamError):
    """Nothing arrived within the timeout, between two frames."""


_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def _timeval(secs: float | None) -> bytes:
    """A ``struct timeval``; ``None`` (or 0) means no timeout."""
    s = 0.0 if secs is None else secs
    return struct.pack("ll", int(s), int((s - int(s)) * 1e6))


class Channel:
    """A framed, thread-safe-for-send wrapper around one connected socket."""

    def __init__(self, sock: socket.socket, *, max_block_bytes: int, timeout_s: float | None) -> None:
        self.sock = sock
        self.max_block_bytes = max_block_bytes
        self._send_lock = threading.Lock()
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._tag = bytearray(TAG_BYTES)
        self._tag_view = memoryview(self._tag)
        self.tx: FrameSeal | None = None  # tags what we send, after the handshake
        self.rx: FrameSeal | None = None  # checks what we receive
        self.closed = False
        self.settimeout(timeout_s)
        self._tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        if self._tcp:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def peer(self) -> str:
        try:
            name = self.sock.getpeername()
        except OSError:
            return "?"
        return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)

    def settimeout(self, timeout_s: float | None, send_timeout_s: float | None = -1.0) -> None:
        """Kernel-side timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket.

        Python's own socket timeouts poll before every call and split a
        ``MSG_WAITALL`` receive into many; kernel timeouts keep one syscall per
        block and still turn a stall into ``EAGAIN``. ``send_timeout_s``
        defaults to ``timeout_s``.
        """
        self.sock.settimeout(None)
        send = timeout_s if send_timeout_s == -1.0 else send_timeout_s
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout_s))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send))

    def seal(self, tx_key: bytes, rx_key: bytes) -> None:
        """Start tagging sent frames with ``tx_key`` and checking received ones with ``rx_key``."""
        self.tx, self.rx = FrameSeal(tx_key), FrameSeal(rx_key)

    # -- sending ------------------------------------------------------------
    def send(self, *parts: bytes | bytearray | memoryview) -> int:
        """Send all parts as one gather write (``sendmsg``), untagged (the handshake); returns bytes sent."""
        with self._send_lock:
            return self._send_locked(parts)

    def send_frames(self, *frames: bytes) -> int:
        """Whole frames (header + body, as ``encode_control`` gives them), each with its tag, in one write.

        Empty entries are skipped. The tags are taken under the send lock, so
        frames sent from several threads keep their counter order.
        """
        tx = self.tx
        assert tx is not None, "send_frames before the handshake"
        with self._send_lock:
            parts: list[bytes] = []
            for f in frames:
                if f:
                    parts += (f, tx.tag(f[:HEADER_SIZE], f[HEADER_SIZE:]))
            return self._send_locked(parts)

    def send_block(self, header: bytes, payload: memoryview, cover_payload: bool,
                   wire: bytes | None = None) -> int:
        """``header`` + ``payload`` + a tag over the header, and over the payload when
        ``cover_payload`` (the receiver asked for ``payload_mac``).

        ``wire`` replaces header + payload on the wire (fault injection: the
        tag still covers the real frame).
        """
        tx = self.tx
        assert tx is not None, "send_block before the handshake"
        with self._send_lock:
            # one write with the tag: a tag sent after the frame arrives late and stalls the receiver
            tag = tx.tag(header, payload if cover_payload else b"")
            return self._send_locked((header, payload, tag) if wire is None else (wire, tag))

    def _send_locked(self, parts: tuple[bytes | bytearray | memoryview, ...] | list[bytes]) -> int:
        """Gather-write ``parts``; the caller holds the send lock."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(len(v) for v in views)
        try:
            while views:
                n = self.sock.sendmsg(views)
                while n and views:
                    if n >= len(views[0]):
                        n -= len(views[0])
                        views.pop(0)
                    else:
                        views[0] = views[0][n:]
                        n = 0
        except BlockingIOError as exc:
            raise StreamError(f"send to {self.peer} timed out") from exc
        except (OSError, ValueError) as exc:
            raise StreamError(f"send to {self.peer} failed: {exc}") from exc
        return total

    # -- receiving ----------------------------------------------------------
    def quickack(self) -> None:
        """Ask the kernel to ACK at once instead of delaying (Linux ``TCP_QUICKACK``).

        The kernel leaves quick-ACK mode on its own, so the receiver re-arms it
        before each block: a delayed ACK must never hold back the sender's
        window while a block is streaming in. A no-op where unsupported.
        """
        if self._tcp and _QUICKACK is not None:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely or raise :class:`StreamError`."""
        got, n = 0, len(view)
        try:
            while got < n:
                r = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
                if r == 0:
                    if got == 0 and view is self._hdr_view:
                        raise PeerClosed(f"connection closed by {self.peer}")
                    raise StreamError(f"connection closed by {self.peer} ({got}/{n} bytes)")
                got += r
        except (TimeoutError, BlockingIOError) as exc:
            if got == 0 and view is self._hdr_view:
                raise IdleTimeout(f"nothing from {self.peer} within the timeout") from exc
            raise StreamError(f"receive from {self.peer} timed out ({got}/{n} bytes)") from exc
        except (OSError, ValueError) as exc:
            raise StreamError(f"receive from {self.peer} failed: {exc}") from exc

    def recv_header(self) -> Header:
        self.recv_into(self._hdr_view)
        return decode_header(self._hdr_view, self.max_block_bytes)

    def recv_payload(self, header: Header) -> bytes:
        buf = bytearray(header.length)
        if header.length:
            self.recv_into(memoryview(buf))
        return bytes(buf)

    def header_bytes(self) -> bytes:
        """The raw bytes of the header :meth:`recv_header` just read (what its tag covers)."""
        return bytes(self._hdr)

    def recv_block_mac(self, header: bytes, view: memoryview) -> bool:
        """Fill ``view`` like :meth:`recv_into`, authenticating each piece as it lands, then read the
        frame's tag; True when it verifies over ``header`` and the payload."""
        rx = self.rx
        assert rx is not None, "recv_block_mac before the handshake"
        mac = rx.begin(header)
        for off in range(0, len(view), HASH_CHUNK):
            part = view[off : off + HASH_CHUNK]
            self.recv_into(part)
            mac.update(part)
        self.recv_into(self._tag_view)
        return hmac.compare_digest(mac.tag(), bytes(self._tag))

    def recv_tag(self, header: bytes, rest: bytes | bytearray | memoryview = b"") -> bool:
        """Read the tag that follows a frame; True when it verifies over ``header`` and ``rest``."""
        rx = self.rx
        assert rx is not None, "recv_tag before the handshake"
        self.recv_into(self._tag_view)
        return rx.check(header, rest, self._tag_view)

    def recv_control(self) -> tuple[Header, Any]:
        """Receive one control frame (checking its tag once sealed) and decode its body."""
        h = self.recv_header()
        if self.rx is None:
            return h, decode_body(h, self.recv_payload(h))
        raw = self.header_bytes()
        payload = self.recv_payload(h)
        if not self.recv_tag(raw, payload):
            raise IntegrityError(f"{h.type.name} frame from {self.peer}: MAC mismatch (altered in transit or "
                                 "wrong session key)")
        return h, decode_body(h, payload)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
