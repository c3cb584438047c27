"""The sending side: serve registered blocks by hash to authenticated peers.

One accept thread; per connection one thread that reads a control frame
(REQUEST, CREDIT, SHM_ATTACH) and then sends queued blocks in request order
while it holds credits. A peer that fails the HMAC challenge is
rejected, logged and counted; a malformed frame closes only that connection
and is counted; neither ever stops the server.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import deque
from types import TracebackType
from typing import Any

from kvfleet.agent.transfer import auth
from kvfleet.agent.transfer.channel import Channel, PeerClosed
from kvfleet.agent.transfer.errors import AuthError, FrameError, StreamError, TransferError
from kvfleet.agent.transfer.frames import (
    BlockHash,
    FrameType,
    checksum,
    decode_request,
    encode_control,
    encode_header,
)
from kvfleet.agent.transfer.metrics import TransferMetrics
from kvfleet.agent.transfer.mooncake import MooncakeEngine, RegisteredRing
from kvfleet.agent.transfer.mooncake import available as mooncake_available
from kvfleet.agent.transfer.shm import ShmRing
from kvfleet.agent.transfer.source import BlockSource
from kvfleet.agent.transfer.topology import local_host_id
from kvfleet.config.transfer import TransferSettings

log = logging.getLogger(__name__)


def _te_hostname(host: str) -> str:
    """The address a Transfer Engine advertises: the listen host, or this host's address for a wildcard."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return host


class _Conn:
    """One accepted connection's send queue, credits and (for shm / mooncake) staging ring."""

    def __init__(self, server: TransferServer, ch: Channel) -> None:
        self.server = server
        self.ch = ch
        self.backend = "tcp"
        self.queue: deque[tuple[int, BlockHash]] = deque()
        self.credits = 0
        self.done = False
        self.ring: ShmRing | RegisteredRing | None = None
        self.sent_blocks = 0

    # -- handshake ----------------------------------------------------------
    def handshake(self) -> None:
        s = self.server
        nonce_s = auth.new_nonce()
        hello = {"nonce": nonce_s, "host": s.host_id, "backends": list(s.backends), "max_block": s.settings.max_block_bytes}
        self.ch.send(encode_control(FrameType.HELLO, hello))
        h, body = self.ch.recv_control()
        if h.type != FrameType.AUTH or not isinstance(body, dict):
            raise FrameError(f"expected AUTH, got {h.type.name}")
        try:
            nonce_c = auth.check_nonce(body.get("nonce"))
            auth.verify(s.secret, b"c", nonce_s, nonce_c, body.get("mac"))
        except AuthError:
            with contextlib.suppress(TransferError):
                self.ch.send(encode_control(FrameType.AUTH_FAIL))
            raise
        backend = body.get("backend")
        if backend not in s.backends:
            raise FrameError(f"peer chose backend {backend!r} not offered")
        self.backend = str(backend)
        self.ch.send(encode_control(FrameType.AUTH_OK, {"mac": auth.mac(s.secret, b"s", nonce_s, nonce_c)}))

    # -- one loop per connection: read a control frame, then send what the credits allow
    def serve_loop(self) -> None:
        """Single-threaded per connection: no hand-off between a reader and a writer thread.

        While a block is being sent, the receiver's credit frames wait in the
        socket buffer; they are read right after.
        """
        while True:
            h, body = self.ch.recv_control()
            if h.type == FrameType.REQUEST:
                self.queue.extend(decode_request(body))
            elif h.type == FrameType.CREDIT:
                self.credits += h.seq
            elif h.type == FrameType.SHM_ATTACH and self.backend == "shm" and self.ring is None:
                if not isinstance(body, dict):
                    raise FrameError("SHM_ATTACH body must be a map")
                self.ring = ShmRing.attach(self.server.settings.shm_dir, body.get("name"), body.get("slots"), body.get("slot_bytes"))
            elif h.type == FrameType.MC_ATTACH and self.backend == "mooncake" and self.ring is None:
                if not isinstance(body, dict) or self.server.mooncake is None:
                    raise FrameError("MC_ATTACH without a map body or without a mooncake engine")
                mc = self.server.mooncake
                ring = RegisteredRing(mc, body.get("slots"), body.get("slot_bytes"), self.server.settings.max_block_bytes)
                self.ring = ring
                self.ch.send(encode_control(FrameType.MC_READY, {"rpc": mc.rpc, "addr": ring.addr}))
            else:
                raise FrameError(f"unexpected {h.type.name} frame from receiver")
            while self.queue and self.credits > 0 and (self.backend == "tcp" or self.ring is not None):
                seq, bh = self.queue.popleft()
                self.credits -= 1
                self.send_block(seq, bh)

    def send_block(self, seq: int, bh: BlockHash) -> None:
        s = self.server
        data = s.source.get_block(bh)
        if data is None:
            self.ch.send(encode_header(FrameType.MISSING, seq=seq, block_hash=bh))
            return
        view = memoryview(data).cast("B")
        csum = s.checksum_of(bh, view)
        if self.ring is not None:
            slot = self.sent_blocks % self.ring.slots
            self.ring.slot(slot, len(view))[:] = view
            self.ch.send(encode_header(FrameType.SLOT_BLOCK, seq=seq, length=len(view), checksum_=csum, block_hash=bh, slot=slot))
        else:
            hdr = encode_header(FrameType.BLOCK, seq=seq, length=len(view), checksum_=csum, block_hash=bh)
            hook = s.fault_hook
            if hook is None:
                self.ch.send(hdr, view)
            else:
                wire, kill = hook(hdr, view)
                self.ch.send(wire)
                if kill:
                    raise StreamError("connection killed by fault injection")
        self.sent_blocks += 1
        s.sent_blocks += 1
        s.metrics.moved(self.backend, "sent", len(view))

    def stop(self) -> None:
        self.done = True
        self.ch.close()
        if self.ring is not None:
            self.ring.close()


class TransferServer:
    """Serves blocks of a :class:`BlockSource` over tcp/shm/mooncake to peers holding the pool secret.

    ``async with TransferServer(source, secret) as srv:`` binds ``srv.port``
    (``port=0`` picks a free one). ``fault_hook(header, payload)``,
    when set, is called for every tcp BLOCK frame and returns ``(wire_bytes, kill)``:
    the bytes sent instead of header + payload, and whether to then drop the
    connection (fault injection for tests and drills).
    """

    def __init__(
        self,
        source: BlockSource,
        secret: bytes,
        *,
        host: str | None = None,
        port: int | None = None,
        settings: TransferSettings | None = None,
        metrics: TransferMetrics | None = None,
    ) -> None:
        if not secret:
            raise AuthError("empty transfer secret")
        self.settings = settings or TransferSettings()
        self.source = source
        self.secret = secret
        self.host = host if host is not None else self.settings.listen_host
        self._want_port = port if port is not None else self.settings.port
        self.metrics = metrics or TransferMetrics(link_capacity_bps=self.settings.link_capacity_gbps * 1e9)
        self.host_id = local_host_id(self.settings.host_id)
        self.backends = tuple(
            b for b in self.settings.backends if b in ("tcp", "shm") or (b == "mooncake" and mooncake_available())
        )
        self.mooncake: MooncakeEngine | None = None
        self.fault_hook: Any = None
        self.sent_blocks = 0
        self.accepted = 0
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._checksums: dict[BlockHash, tuple[int, int]] = {}

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("server not started")
        return int(self._sock.getsockname()[1])

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def checksum_of(self, bh: BlockHash, view: memoryview) -> int:
        """Checksums are cached per (hash, length): blocks are content-addressed."""
        hit = self._checksums.get(bh)
        if hit is not None and hit[0] == len(view):
            return hit[1]
        c = checksum(view)
        if len(self._checksums) > 65536:
            self._checksums.clear()
        self._checksums[bh] = (len(view), c)
        return c

    def start(self) -> None:
        if "mooncake" in self.backends and self.mooncake is None:
            self.mooncake = MooncakeEngine(_te_hostname(self.host), self.settings.mooncake_protocol)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._want_port))
        sock.listen(128)
        sock.settimeout(0.2)
        self._sock = sock
        t = threading.Thread(target=self._accept_loop, name=f"kvfleet-xfer-accept-{self.port}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.stop()
        for t in self._threads:
            t.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        self.mooncake = None  # the engine shuts down with its last reference

    async def __aenter__(self) -> TransferServer:
        self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                sock, _addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            t = threading.Thread(target=self._serve, args=(sock,), name="kvfleet-xfer-conn", daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, sock: socket.socket) -> None:
        ch = Channel(sock, max_block_bytes=self.settings.max_block_bytes, timeout_s=self.settings.handshake_timeout_s)
        conn = _Conn(self, ch)
        with self._lock:
            self._conns.add(conn)
        try:
            try:
                conn.handshake()
            except AuthError as exc:
                self.metrics.auth_rejections.inc()
                self.metrics.errors.labels(exc.kind).inc()
                log.warning("transfer: rejected peer %s: %s", ch.peer, exc)
                return
            # idle pooled connections may wait for the next REQUEST forever; a receiver
            # that stops draining blocks it holds credits for is cut off
            ch.settimeout(None, self.settings.stall_timeout_s)
            conn.serve_loop()
        except PeerClosed:
            pass
        except TransferError as exc:
            if not (self._stopping.is_set() or conn.done):
                self.metrics.errors.labels(exc.kind).inc()
                log.warning("transfer: closing connection from %s: %s", ch.peer, exc)
        except Exception as exc:  # a bug or a resource limit: that connection only, never the server
            self.metrics.errors.labels("internal").inc()
            log.exception("transfer: internal error on connection from %s: %s", ch.peer, exc)
        finally:
            conn.stop()
            with self._lock:
                self._conns.discard(conn)
