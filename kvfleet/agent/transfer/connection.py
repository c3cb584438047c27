"""Connections of the receiving side: handshake, one stream per connection, credit flow control, the pool.

:func:`_connect` opens and authenticates one connection (HELLO, AUTH with the
pool secret, AUTH_OK) and seals its channel with the session keys. A
:class:`_Stream` is one such connection with its own I/O thread (jobs run on
it one after another, kept while the stream is pooled) and its credits.

Flow control: every stream starts with ``window_blocks`` credits and gets one
back each time the consumer takes one of its blocks (sent in batches,
flushed before the consumer waits), so a slow consumer stops the sender
(bounded memory: streams × window blocks). Each stream sends its blocks in
sequence order, so the next block to deliver always has a credit: no
deadlock. A stream waiting on a consumer that holds all its credits is
*starved*, not stalled.

:class:`_Connections` holds what a client keeps between transfers: the pool
secret and settings, the peers' HELLO answers, idle authenticated streams per
(peer, backend) — checked for EOF before reuse — and the Mooncake engine.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvfleet.agent.transfer import auth
from kvfleet.agent.transfer.channel import Channel
from kvfleet.agent.transfer.errors import AuthError, FrameError, StreamError, TransferError
from kvfleet.agent.transfer.frames import BlockHash, FrameType, encode_control, encode_header
from kvfleet.agent.transfer.metrics import TransferMetrics
from kvfleet.agent.transfer.mooncake import MooncakeEngine, RegisteredRing
from kvfleet.agent.transfer.mooncake import available as mooncake_available
from kvfleet.agent.transfer.shm import ShmRing
from kvfleet.agent.transfer.topology import PeerInfo, choose_backends, local_host_id
from kvfleet.config.transfer import TransferSettings

#: ``alloc(seq, block_hash, length) -> writable buffer of exactly length bytes``;
#: called from I/O threads, so it must be thread-safe.
Allocator = Callable[[int, BlockHash, int], Any]
#: Backends with an implementation (``mooncake`` only where :func:`mooncake.available`; NIXL has none).
BACKENDS: tuple[str, ...] = ("shm", "mooncake", "tcp")
Peer = tuple[str, int] | str


def _default_alloc(seq: int, block_hash: BlockHash, length: int) -> memoryview:
    return memoryview(bytearray(length))


def _parse_peer(peer: Peer) -> tuple[str, int]:
    if isinstance(peer, tuple):
        return peer[0], int(peer[1])
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"peer must be 'host:port' or (host, port), got {peer!r}")
    return host.strip("[]"), int(port)


class _Stream:
    """One authenticated connection and the I/O thread receiving its blocks."""

    def __init__(self, ch: Channel, backend: str, index: int) -> None:
        self.ch = ch
        self.backend = backend
        self.index = index
        self.items: list[tuple[int, BlockHash]] = []
        self.ring: ShmRing | RegisteredRing | None = None
        self.remote: tuple[str, int] | None = None  # mooncake: the sender's engine rpc and ring address
        self.thread: threading.Thread | None = None
        self.jobs: queue.SimpleQueue[Callable[[_Stream], None] | None] = queue.SimpleQueue()
        self.idle = threading.Event()
        self.idle.set()
        self.closed = False
        self.granted = 0  # credits sent (event-loop thread)
        self.pending = 0  # credits earned by consumed blocks, not sent yet
        self.batch = 1
        self.received = 0  # blocks received (I/O thread)

    def credit(self, n: int = 1) -> None:
        if self.closed:
            return
        self.granted += n
        with contextlib.suppress(TransferError):
            self.ch.send_frames(encode_header(FrameType.CREDIT, seq=n))

    def give_back(self, batch: int) -> bool:
        """One consumed block's credit, sent in batches; True if some are still held back."""
        self.pending += 1
        if self.pending >= batch:
            self.flush()
        return self.pending > 0

    def flush(self) -> None:
        """Send held-back credits (before the consumer waits: else its next block may never come)."""
        if self.pending:
            n, self.pending = self.pending, 0
            self.credit(n)

    def alive(self) -> bool:
        """An idle connection is alive when nothing (not even EOF) is waiting on it."""
        if self.closed:
            return False
        try:
            readable, _w, _x = select.select([self.ch.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def starved(self) -> bool:
        """True when the sender holds no credit: silence is our consumer's doing, not a stall."""
        return self.granted - self.received <= 0

    def submit(self, job: Callable[[_Stream], None]) -> None:
        """Run ``job(self)`` on this stream's I/O thread (started once, kept while pooled)."""
        self.idle.clear()
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name=f"kvfleet-xfer-recv-{self.index}",
                                           daemon=True)
            self.thread.start()
        self.jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job(self)
            finally:
                self.idle.set()

    def close(self) -> None:
        self.closed = True
        self.ch.close()
        self.jobs.put(None)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)
        if self.ring is not None:
            self.ring.close()


def _connect(host: str, port: int, secret: bytes, local: PeerInfo, settings: TransferSettings,
             backend: str | None) -> tuple[Channel, PeerInfo, str]:
    """Connect and authenticate; ``backend=None`` picks the topology's first choice."""
    try:
        sock = socket.create_connection((host, port), timeout=settings.connect_timeout_s)
    except OSError as exc:
        raise StreamError(f"cannot connect to {host}:{port}: {exc}") from exc
    ch = Channel(sock, max_block_bytes=settings.max_block_bytes, timeout_s=settings.handshake_timeout_s)
    try:
        h, hello = ch.recv_control()
        if h.type != FrameType.HELLO or not isinstance(hello, dict):
            raise FrameError(f"expected HELLO, got {h.type.name}")
        nonce_s = auth.check_nonce(hello.get("nonce"))
        backends = hello.get("backends")
        remote = PeerInfo(str(hello.get("host", "")),
                          tuple(str(b) for b in backends) if isinstance(backends, list) else ())
        if backend is None:
            choice = choose_backends(local, remote)
            if not choice:
                raise StreamError(
                    f"no common backend with {host}:{port} (ours {local.backends}, theirs {remote.backends})")
            backend = choice[0]
        nonce_c = auth.new_nonce()
        payload_mac = settings.payload_mac
        ch.send(encode_control(FrameType.AUTH, {
            "nonce": nonce_c, "mac": auth.mac(secret, b"c", nonce_s, nonce_c), "backend": backend,
            "payload_mac": payload_mac,
        }))
        h, body = ch.recv_control()
        if h.type == FrameType.AUTH_FAIL:
            raise AuthError(f"{host}:{port} rejected our HMAC (wrong pool secret?)")
        if h.type != FrameType.AUTH_OK or not isinstance(body, dict):
            raise FrameError(f"expected AUTH_OK, got {h.type.name}")
        auth.verify(secret, b"s", nonce_s, nonce_c, body.get("mac"))
        from_server, to_server = auth.session_keys(secret, nonce_s, nonce_c, backend, payload_mac)
        ch.seal(to_server, from_server)
    except BaseException:
        ch.close()
        raise
    ch.settimeout(settings.stall_timeout_s)
    return ch, remote, backend


class _Connections:
    """The pool secret, settings and idle authenticated streams a client keeps between transfers."""

    def __init__(self, secret: bytes, *, settings: TransferSettings | None = None,
                 metrics: TransferMetrics | None = None) -> None:
        if not secret:
            raise AuthError("empty transfer secret")
        self.secret = secret
        self.settings = settings or TransferSettings()
        self.metrics = metrics or TransferMetrics(link_capacity_bps=self.settings.link_capacity_gbps * 1e9)
        offered = [b for b in self.settings.backends if b in BACKENDS
                   and (b != "mooncake" or mooncake_available())]
        self.local = PeerInfo(local_host_id(self.settings.host_id), tuple(offered))
        self.mooncake: MooncakeEngine | None = None
        self._mooncake_lock = threading.Lock()
        self._remotes: dict[tuple[str, int], PeerInfo] = {}
        self._pool: dict[tuple[str, int, str], list[_Stream]] = {}

    # -- the pool of idle authenticated streams -----------------------------------
    def _engine(self) -> MooncakeEngine:
        """The client's Transfer Engine, started on first use (from an I/O thread)."""
        with self._mooncake_lock:
            if self.mooncake is None:
                listen = self.settings.listen_host
                host = listen if listen not in ("", "0.0.0.0", "::") else "127.0.0.1"
                self.mooncake = MooncakeEngine(host, self.settings.mooncake_protocol)
            return self.mooncake

    def _checkout(self, key: tuple[str, int, str], n: int) -> list[_Stream]:
        idle = self._pool.get(key, [])
        out: list[_Stream] = []
        while idle and len(out) < n:
            st = idle.pop()
            if st.alive():
                out.append(st)
            else:
                st.close()
        return out

    def _checkin(self, key: tuple[str, int, str], streams: list[_Stream]) -> None:
        idle = self._pool.setdefault(key, [])
        for st in streams:
            if len(idle) < max(self.settings.streams, 1) and st.alive():
                idle.append(st)
            else:
                st.close()

    def close(self) -> None:
        """Close the idle pooled connections (transfers in flight keep theirs)."""
        for idle in self._pool.values():
            for st in idle:
                st.close()
        self._pool.clear()
        with self._mooncake_lock:
            self.mooncake = None
