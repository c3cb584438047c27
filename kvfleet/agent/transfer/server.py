"""The sending side: serve registered blocks by hash to authenticated peers.

One handshake thread accepts connections and runs every HELLO/AUTH exchange
on a selector (non-blocking sockets, no thread per unauthenticated
connection). It bounds what a peer without the secret can hold:

* a deadline for the whole exchange (``handshake_timeout_s``), however slowly
  its bytes arrive;
* an ``AUTH`` frame of at most :data:`~kvfleet.agent.transfer.auth.MAX_AUTH_BYTES`,
  judged from its header before any of its body is read;
* ``max_connections`` open connections (over it a new one is closed at once)
  and ``max_handshakes`` connections in the handshake (at it, the oldest is
  closed to make room, so idle connections cannot lock out real peers).

Each is counted in ``errors_total{kind}`` (``handshake_timeout``, ``frame``,
``max_connections``, ``max_handshakes``) and logged at most every few seconds.
Only an authenticated connection gets a thread of its own: it reads a control
frame (REQUEST, CREDIT, SHM_ATTACH) and then sends queued blocks in request
order while it holds credits; every frame it sends after ``AUTH_OK`` carries
a keyed MAC and every frame it reads must carry one (:mod:`.auth`). A peer
that fails the HMAC challenge is
rejected, logged and counted; a malformed frame closes only that connection
and is counted; neither ever stops the server.

Size: about 500 lines on purpose: the accept loop, the handshake selector and the per-connection sender
share the server's registry, limits and counters; the frame, MAC and handshake rules live in their own
modules (:mod:`.frames`, :mod:`.auth`, :mod:`.handshake`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from types import TracebackType
from typing import Any

from kvfleet.agent.publisher import PortInUseError
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
from kvfleet.agent.transfer.handshake import _close, _Handshake, _peer_name, _RateLog
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
        self.payload_mac = True  # the receiver's choice: tags cover BLOCK payloads

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
                self.ring = ShmRing.attach(self.server.settings.shm_dir, body.get("name"), body.get("slots"),
                                           body.get("slot_bytes"))
            elif h.type == FrameType.MC_ATTACH and self.backend == "mooncake" and self.ring is None:
                if not isinstance(body, dict) or self.server.mooncake is None:
                    raise FrameError("MC_ATTACH without a map body or without a mooncake engine")
                mc = self.server.mooncake
                ring = RegisteredRing(mc, body.get("slots"), body.get("slot_bytes"),
                                      self.server.settings.max_block_bytes)
                self.ring = ring
                self.ch.send_frames(encode_control(FrameType.MC_READY, {"rpc": mc.rpc, "addr": ring.addr}))
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
            self.ch.send_frames(encode_header(FrameType.MISSING, seq=seq, block_hash=bh))
            return
        view = memoryview(data).cast("B")
        # the payload stays on this host (shm) or moves by Mooncake: the tag covers the header
        if self.ring is not None:
            csum = s.checksum_of(bh, view)
            slot = self.sent_blocks % self.ring.slots
            self.ring.slot(slot, len(view))[:] = view
            self.ch.send_frames(encode_header(FrameType.SLOT_BLOCK, seq=seq, length=len(view), checksum_=csum,
                                              block_hash=bh, slot=slot))
        else:
            csum = s.checksum_of(bh, view)
            hdr = encode_header(FrameType.BLOCK, seq=seq, length=len(view), checksum_=csum, block_hash=bh)
            hook = s.fault_hook
            if hook is None:
                self.ch.send_block(hdr, view, self.payload_mac)
            else:  # the tag covers the real frame, whatever the hook puts on the wire
                wire, kill = hook(hdr, view)
                self.ch.send_block(hdr, view, self.payload_mac, wire=wire)
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
    the bytes sent instead of header + payload (the tag that follows still
    covers the real frame, as a man in the middle without the key would leave
    it), and whether to then drop the connection (fault injection for tests
    and drills).
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
            b for b in self.settings.backends if b in ("tcp", "shm")
            or (b == "mooncake" and mooncake_available())
        )
        self.mooncake: MooncakeEngine | None = None
        self.fault_hook: Any = None
        self.sent_blocks = 0
        self.accepted = 0
        self._sock: socket.socket | None = None
        self._port = 0
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._loop_thread: threading.Thread | None = None
        self._pending: OrderedDict[int, _Handshake] = OrderedDict()  # in accept order, i.e. deadline order
        self._accept_paused_until = 0.0
        self._ratelog = _RateLog(log)
        self._threads: list[threading.Thread] = []
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sums: dict[BlockHash, tuple[int, int]] = {}

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("server not started")
        return self._port

    @property
    def pending_handshakes(self) -> int:
        """Accepted connections that have not authenticated yet."""
        return len(self._pending)

    @property
    def connections(self) -> int:
        """Authenticated connections, each served by its own thread."""
        return len(self._conns)

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def checksum_of(self, bh: BlockHash, view: memoryview) -> int:
        """A block's xxh3 checksum, cached per (hash, length): blocks are content-addressed."""
        hit = self._sums.get(bh)
        if hit is None or hit[0] != len(view):
            hit = (len(view), checksum(view))
            if len(self._sums) > 65536:
                self._sums.clear()
            self._sums[bh] = hit
        return hit[1]

    def start(self) -> None:
        if "mooncake" in self.backends and self.mooncake is None:
            self.mooncake = MooncakeEngine(_te_hostname(self.host), self.settings.mooncake_protocol)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, self._want_port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(exc.errno, f"transfer port {self.host}:{self._want_port} is in use "
                                                    "(another process, or another container of this pod, "
                                                    "listens on it)") from exc
                raise
            sock.listen(max(128, min(self.settings.max_connections, 4096)))
            sock.setblocking(False)
            sel = selectors.DefaultSelector()
            wake_r, wake_w = socket.socketpair()
        except BaseException:
            sock.close()
            raise
        for w in (wake_r, wake_w):
            w.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, None)
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        self._sock, self._sel, self._wake_r, self._wake_w = sock, sel, wake_r, wake_w
        self._port = int(sock.getsockname()[1])
        t = threading.Thread(target=self._handshake_loop, name=f"kvfleet-xfer-accept-{self._port}",
                             daemon=True)
        self._loop_thread = t
        t.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for c in conns:
            c.stop()
        for t in threads:
            t.join(timeout=5)
        self.mooncake = None  # the engine shuts down with its last reference

    async def __aenter__(self) -> TransferServer:
        self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.stop()

    # -- the handshake loop: accept, HELLO, AUTH; one thread for every unauthenticated connection
    def _handshake_loop(self) -> None:
        sel = self._sel
        assert sel is not None and self._sock is not None
        try:
            while not self._stopping.is_set():
                try:
                    self._loop_once(sel)
                except Exception as exc:  # a bug: logged, the loop goes on
                    self.metrics.errors.labels("internal").inc()
                    log.exception("transfer: internal error in the handshake loop: %s", exc)
                    time.sleep(0.01)
        finally:
            for hs in list(self._pending.values()):
                self._forget(hs)
                hs.close()
            sel.close()
            for s in (self._sock, self._wake_r, self._wake_w):
                if s is not None:
                    s.close()

    def _loop_once(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        self._expire(now)
        wait = 1.0
        if self._pending:
            wait = min(wait, next(iter(self._pending.values())).deadline - now)
        if self._accept_paused_until:
            if now >= self._accept_paused_until:
                self._accept_paused_until = 0.0
                assert self._sock is not None
                sel.register(self._sock, selectors.EVENT_READ, None)
            else:
                wait = min(wait, self._accept_paused_until - now)
        for key, mask in sel.select(max(wait, 0.0)):
            if key.data is None:
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    key.fileobj.recv(64)  # type: ignore[union-attr]
            elif isinstance(key.data, _Handshake):
                self._advance(key.data, mask)

    def _accept(self) -> None:
        """Accept what is waiting (a bounded burst, so deadlines are still enforced under a flood)."""
        assert self._sock is not None and self._sel is not None
        for _ in range(64):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors or memory: pause accepting instead of spinning on a ready socket
                    self._ratelog.warning("accept", "transfer: cannot accept connections: %s", exc)
                    self._sel.unregister(self._sock)
                    self._accept_paused_until = time.monotonic() + 0.1
                    return
                continue  # e.g. ECONNABORTED: that connection only
            self.accepted += 1
            self._admit(sock, _peer_name(addr))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        assert self._sel is not None
        st = self.settings
        with self._lock:
            authenticated = len(self._conns)
        if authenticated + len(self._pending) >= st.max_connections:
            self._refuse(sock, peer, "max_connections", f"{st.max_connections} connections open")
            return
        if len(self._pending) >= st.max_handshakes:
            _, oldest = self._pending.popitem(last=False)
            self._sel.unregister(oldest.sock)
            self._refuse(oldest.sock, oldest.peer, "max_handshakes",
                         f"{st.max_handshakes} handshakes pending; the oldest makes room")
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce_s = auth.new_nonce()
            hello = {"nonce": nonce_s, "host": self.host_id, "backends": list(self.backends),
                     "max_block": st.max_block_bytes}
            hs = _Handshake(sock, peer, time.monotonic() + st.handshake_timeout_s, nonce_s,
                            encode_control(FrameType.HELLO, hello))
            hs.flush()
            self._sel.register(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if hs.out else 0), hs)
        except OSError:
            _close(sock)
            return
        self._pending[id(hs)] = hs

    def _refuse(self, sock: socket.socket, peer: str, kind: str, why: str) -> None:
        _close(sock)
        self.metrics.errors.labels(kind).inc()
        self._ratelog.warning(kind, "transfer: closed connection from %s: %s", peer, why)

    def _forget(self, hs: _Handshake) -> None:
        if self._pending.pop(id(hs), None) is not None and self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(hs.sock)

    def _expire(self, now: float) -> None:
        while self._pending:
            hs = next(iter(self._pending.values()))
            if hs.deadline > now:
                return
            self._forget(hs)
            hs.close()
            self.metrics.errors.labels("handshake_timeout").inc()
            self._ratelog.warning(
                "handshake_timeout", "transfer: closed connection from %s: no authentication within %.1f s",
                hs.peer, self.settings.handshake_timeout_s,
            )

    def _advance(self, hs: _Handshake, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                hs.flush()
                if not hs.out and self._sel is not None:
                    self._sel.modify(hs.sock, selectors.EVENT_READ, hs)
            if mask & selectors.EVENT_READ and hs.read():
                self._forget(hs)
                self._authenticated(hs)
        except PeerClosed:
            self._forget(hs)
            hs.close()
        except TransferError as exc:  # a malformed, oversized or unexpected frame
            self._forget(hs)
            hs.close()
            self.metrics.errors.labels(exc.kind).inc()
            self._ratelog.warning(exc.kind, "transfer: closing connection from %s: %s", hs.peer, exc)
        except OSError as exc:
            self._forget(hs)
            hs.close()
            if exc.errno in (errno.ECONNRESET, errno.EPIPE) and not hs.hdr:
                # connected and closed without a byte: a kubelet tcpSocket probe or a load balancer's check
                log.debug("transfer: %s closed before its AUTH (a TCP probe)", hs.peer)
                return
            self.metrics.errors.labels("stream").inc()
            self._ratelog.warning("stream", "transfer: connection from %s failed during the handshake: %s",
                                  hs.peer, exc)

    def _authenticated(self, hs: _Handshake) -> None:
        """Check the AUTH frame read in full; hand the connection to a thread of its own, or refuse it."""
        assert hs.header is not None
        try:
            nonce_c, backend, payload_mac = auth.check_auth(self.secret, hs.nonce_s, hs.header,
                                                            bytes(hs.body), self.backends)
        except AuthError as exc:
            self.metrics.auth_rejections.inc()
            self.metrics.errors.labels(exc.kind).inc()
            self._ratelog.warning("auth", "transfer: rejected peer %s: %s", hs.peer, exc)
            with contextlib.suppress(OSError):
                hs.sock.send(encode_control(FrameType.AUTH_FAIL))
            hs.close()
            return
        ok = encode_control(FrameType.AUTH_OK, {"mac": auth.mac(self.secret, b"s", hs.nonce_s, nonce_c)})
        # idle pooled connections may wait for the next REQUEST forever; a receiver
        # that stops draining blocks it holds credits for is cut off
        ch = Channel(hs.sock, max_block_bytes=self.settings.max_block_bytes, timeout_s=None)
        ch.settimeout(None, self.settings.stall_timeout_s)
        to_client, from_client = self._session_keys(hs.nonce_s, nonce_c, backend, payload_mac)
        ch.seal(to_client, from_client)
        conn = _Conn(self, ch)
        conn.backend = backend
        conn.payload_mac = payload_mac
        t = threading.Thread(target=self._serve, args=(conn, ok), name="kvfleet-xfer-conn", daemon=True)
        with self._lock:
            if self._stopping.is_set():
                ch.close()
                return
            self._conns.add(conn)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        try:
            t.start()
        except RuntimeError as exc:  # no thread to be had: that connection only
            with self._lock:
                self._conns.discard(conn)
            ch.close()
            self.metrics.errors.labels("internal").inc()
            self._ratelog.warning("internal", "transfer: cannot serve %s: %s", hs.peer, exc)

    def _session_keys(self, nonce_s: bytes, nonce_c: bytes, backend: str,
                      payload_mac: bool) -> tuple[bytes, bytes]:
        return auth.session_keys(self.secret, nonce_s, nonce_c, backend, payload_mac)

    # -- one thread per authenticated connection
    def _serve(self, conn: _Conn, auth_ok: bytes) -> None:
        ch = conn.ch
        try:
            ch.send(auth_ok)
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
