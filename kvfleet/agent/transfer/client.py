"""The receiving side: pull blocks from a peer's :class:`TransferServer`.

A :class:`TransferClient` opens a *session* per attempt: N authenticated
streams (tcp) or one (shm, mooncake), the remaining blocks striped over them
round-robin by sequence number so that block 0 lands first. I/O threads
``recv_into`` each payload straight into its destination slot, verify its
keyed MAC (tcp; :mod:`.auth`) or checksum (shm, mooncake: the MAC covers their
headers), and hand it to the event loop — or, with ``deliver="thread"``,
straight to ``on_block`` in that thread; the :class:`TransferHandle` delivers
blocks strictly in sequence order, each exactly once, as soon as the gap
before it closes. Block 0's path is kept short: with pooled streams its
REQUEST leaves inside ``pull()``; a stream's I/O thread is waiting in
``recv`` before its REQUEST is written; stream 0 starts before the others
connect.

Flow control: every stream starts with ``window_blocks`` credits and gets one
back each time the consumer takes one of its blocks, so a slow consumer stops
the sender (bounded memory: streams × window blocks). Each stream sends its
blocks in sequence order, so the next block to deliver always has a credit:
no deadlock.

Failover: a broken, stalled or corrupt stream fails the session; the blocks
already verified are kept and a new session asks for the remaining ones only,
on the next backend of the topology's list (shm → tcp, mooncake → tcp) at
once, or on the same one after an exponential back-off with full jitter
(:mod:`.backoff`), up to ``max_retries`` times. Permanent errors (auth, missing block)
fail at once. Idle authenticated streams are pooled per (peer, backend), each
with its I/O thread, so a warm transfer starts with one REQUEST frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.agent.transfer import auth
from kvfleet.agent.transfer.auth import EMPTY_DIGEST
from kvfleet.agent.transfer.backoff import Backoff
from kvfleet.agent.transfer.channel import Channel, IdleTimeout
from kvfleet.agent.transfer.errors import (
    AuthError,
    BlockNotFoundError,
    ChecksumError,
    FrameError,
    IntegrityError,
    StreamError,
    TransferCancelled,
    TransferError,
    UnknownBackendError,
)
from kvfleet.agent.transfer.frames import (
    BlockHash,
    FrameType,
    Header,
    checksum,
    encode_control,
    encode_header,
)
from kvfleet.agent.transfer.metrics import TransferMetrics
from kvfleet.agent.transfer.mooncake import MooncakeEngine, RegisteredRing
from kvfleet.agent.transfer.mooncake import available as mooncake_available
from kvfleet.agent.transfer.shm import ShmRing
from kvfleet.agent.transfer.topology import PeerInfo, choose_backends, local_host_id
from kvfleet.config.transfer import TransferSettings

log = logging.getLogger(__name__)

#: ``alloc(seq, block_hash, length) -> writable buffer of exactly length bytes``;
#: called from I/O threads, so it must be thread-safe.
Allocator = Callable[[int, BlockHash, int], Any]
#: Backends with an implementation (``mooncake`` only where :func:`mooncake.available`; NIXL has none).
BACKENDS: tuple[str, ...] = ("shm", "mooncake", "tcp")
Peer = tuple[str, int] | str
#: Where ``on_block`` runs: the event loop thread, or the receiving I/O thread.
DELIVERY: tuple[str, ...] = ("loop", "thread")


@dataclass(frozen=True, slots=True)
class Block:
    """One delivered block: its position in the batch, its hash and its bytes."""

    seq: int
    block_hash: BlockHash
    data: memoryview


@dataclass
class TransferStats:
    """What one transfer did; filled in as it runs."""

    blocks: int = 0
    bytes: int = 0
    retries: int = 0
    failovers: int = 0
    backoff_s: float = 0.0  # waited between retries in total
    backends: list[str] = field(default_factory=list)
    started: float = 0.0
    first_block_s: float | None = None
    finished_s: float | None = None


def _default_alloc(seq: int, block_hash: BlockHash, length: int) -> memoryview:
    return memoryview(bytearray(length))


def _parse_peer(peer: Peer) -> tuple[str, int]:
    if isinstance(peer, tuple):
        return peer[0], int(peer[1])
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"peer must be 'host:port' or (host, port), got {peer!r}")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------------------
# one connection
# ---------------------------------------------------------------------------


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
            self.thread = threading.Thread(target=self._work, name=f"kvfleet-xfer-recv-{self.index}", daemon=True)
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


def _connect(host: str, port: int, secret: bytes, local: PeerInfo, settings: TransferSettings, backend: str | None) -> tuple[Channel, PeerInfo, str]:
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
        remote = PeerInfo(str(hello.get("host", "")), tuple(str(b) for b in backends) if isinstance(backends, list) else ())
        if backend is None:
            choice = choose_backends(local, remote)
            if not choice:
                raise StreamError(f"no common backend with {host}:{port} (ours {local.backends}, theirs {remote.backends})")
            backend = choice[0]
        nonce_c = auth.new_nonce()
        payload_mac = settings.payload_mac
        ch.send(encode_control(FrameType.AUTH, {
            "nonce": nonce_c, "mac": auth.mac(secret, b"c", nonce_s, nonce_c), "backend": backend, "payload_mac": payload_mac,
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


# ---------------------------------------------------------------------------
# the handle a caller holds
# ---------------------------------------------------------------------------


class TransferHandle:
    """A running transfer: async-iterate it for blocks in sequence order, or pass ``on_block``.

    ``await handle.wait()`` returns when every block was delivered (or raises
    the :class:`TransferError` that ended it); ``handle.cancel()`` stops it
    (then ``wait`` raises :class:`TransferCancelled`). Without ``on_block``
    the blocks must be consumed (iterate, or ``await handle.collect()``):
    unconsumed blocks hold the sender's credits.

    With ``deliver="thread"`` the ``on_block`` callback runs in the receiving
    I/O thread, right after the block's checksum was verified: no hop to the
    event loop before the consumer sees it. Calls are serialised by a lock and
    stay in sequence order, each block once; the callback must not block on
    the event loop (use ``loop.call_soon_threadsafe``). A block whose delivery
    is already under way when the transfer is cancelled still completes.
    """

    def __init__(self, hashes: Sequence[BlockHash], on_block: Callable[[Block], Any] | None, *, in_thread: bool = False) -> None:
        self.block_hashes = list(hashes)
        self.stats = TransferStats(started=time.perf_counter())
        self._on_block = on_block
        self._in_thread = in_thread and on_block is not None
        self._lock = threading.Lock()  # guards _landed/_next/credits while I/O threads deliver
        self._stopped = False
        self.complete = False  # every block delivered (set in the I/O thread with deliver="thread")
        self._landed: dict[int, tuple[Block, _Stream | None]] = {}
        self._next = 0
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._finish_hooks: list[Callable[[TransferHandle], Any]] = []
        self._holding: set[_Stream] = set()

    # -- observing ------------------------------------------------------------
    def done(self) -> bool:
        return self._done.done()

    @property
    def state(self) -> str:
        """``running``, ``done``, ``failed`` or ``cancelled``."""
        if not self._done.done():
            return "running"
        if self._error is None:
            return "done"
        return "cancelled" if isinstance(self._error, TransferCancelled) else "failed"

    def exception(self) -> BaseException | None:
        return self._error

    @property
    def delivered(self) -> int:
        return self._next

    async def wait(self) -> TransferStats:
        await asyncio.shield(self._done)
        return self.stats

    def cancel(self) -> None:
        if not self._done.done():
            self._finish(TransferCancelled("transfer cancelled"))

    def add_done_callback(self, fn: Callable[[TransferHandle], Any]) -> None:
        self._done.add_done_callback(lambda _f: fn(self))

    async def collect(self) -> list[Block]:
        return [b async for b in self]

    def __aiter__(self) -> AsyncIterator[Block]:
        if self._on_block is not None:
            raise RuntimeError("this transfer delivers through on_block; it cannot also be iterated")
        return self._iterate()  # a new iterator continues where the last one stopped

    async def _iterate(self) -> AsyncIterator[Block]:
        n = len(self.block_hashes)
        while self._next < n:
            got = self._landed.pop(self._next, None)
            if got is None:
                if self._error is not None:
                    raise self._error
                self._flush_credits()
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._deliver(*got):
                self._finish(None)
            yield got[0]
        if self._error is not None and not isinstance(self._error, TransferCancelled):
            raise self._error

    # -- fed by the driver (event-loop thread) --------------------------------
    def _is_needed(self, seq: int) -> bool:
        return seq >= self._next and seq not in self._landed

    def _landed_block(self, block: Block, stream: _Stream | None) -> None:
        if not self._is_needed(block.seq) or self._done.done():
            return  # a duplicate from an older session: never delivered twice
        if block.seq == 0 and self.stats.first_block_s is None:
            self.stats.first_block_s = time.perf_counter() - self.stats.started
        self._landed[block.seq] = (block, stream)
        if self._on_block is not None:
            while self._next in self._landed:
                b, s = self._landed.pop(self._next)
                try:
                    self._on_block(b)
                except Exception as exc:  # the consumer's failure ends the transfer
                    self._finish(exc)
                    return
                if self._deliver(b, s):
                    self._finish(None)
            self._flush_credits()
        else:
            self._wake.set()

    # -- fed by an I/O thread (deliver="thread") --------------------------------
    def _landed_in_thread(self, block: Block, stream: _Stream | None) -> None:
        """Deliver ``block`` and any landed successors to ``on_block`` from this I/O thread."""
        assert self._on_block is not None
        with self._lock:
            if self._stopped or not self._is_needed(block.seq):
                return  # a duplicate from an older session, or the transfer ended
            if block.seq == 0 and self.stats.first_block_s is None:
                self.stats.first_block_s = time.perf_counter() - self.stats.started
            self._landed[block.seq] = (block, stream)
            while self._next in self._landed and not self._stopped:
                b, s = self._landed.pop(self._next)
                try:
                    self._on_block(b)
                except Exception as exc:  # the consumer's failure ends the transfer
                    self._stopped = True
                    self._loop.call_soon_threadsafe(self._finish, exc)
                    return
                if self._deliver(b, s):
                    self._stopped = self.complete = True  # the session's _landed, posted next, finishes
            self._flush_credits()

    def _deliver(self, block: Block, stream: _Stream | None) -> bool:
        """Account one delivered block; True when it was the last one."""
        self._next = block.seq + 1
        self.stats.blocks += 1
        self.stats.bytes += len(block.data)
        if stream is not None and stream.give_back(stream.batch):
            self._holding.add(stream)
        if self._next == len(self.block_hashes):
            self.stats.finished_s = time.perf_counter() - self.stats.started
            return True
        return False

    def _flush_credits(self) -> None:
        for st in self._holding:
            st.flush()
        self._holding.clear()

    def _finish(self, error: BaseException | None) -> None:
        if self._done.done():
            return
        self._stopped = True
        self._error = error
        if error is None:
            self._done.set_result(None)
        else:
            self._done.set_exception(error)
            self._done.exception()  # mark retrieved: iteration reports it too
            if self._task is not None and self._task is not asyncio.current_task():
                self._task.cancel()  # stop the driver: its session closes its streams
        for hook in self._finish_hooks:
            hook(self)
        self._wake.set()

    def _missing(self) -> list[tuple[int, BlockHash]]:
        with self._lock:
            return [(s, self.block_hashes[s]) for s in range(self._next, len(self.block_hashes)) if s not in self._landed]


# ---------------------------------------------------------------------------
# the client
# ---------------------------------------------------------------------------


class TransferClient:
    """Pulls blocks from peers' transfer servers; one client per agent."""

    def __init__(self, secret: bytes, *, settings: TransferSettings | None = None, metrics: TransferMetrics | None = None) -> None:
        if not secret:
            raise AuthError("empty transfer secret")
        self.secret = secret
        self.settings = settings or TransferSettings()
        self.metrics = metrics or TransferMetrics(link_capacity_bps=self.settings.link_capacity_gbps * 1e9)
        offered = [b for b in self.settings.backends if b in BACKENDS and (b != "mooncake" or mooncake_available())]
        self.local = PeerInfo(local_host_id(self.settings.host_id), tuple(offered))
        self.mooncake: MooncakeEngine | None = None
        self._mooncake_lock = threading.Lock()
        self._remotes: dict[tuple[str, int], PeerInfo] = {}
        self._pool: dict[tuple[str, int, str], list[_Stream]] = {}
        self.backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        self._sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep  # injectable for tests

    # -- the pool of idle authenticated streams -----------------------------------
    def _engine(self) -> MooncakeEngine:
        """The client's Transfer Engine, started on first use (from an I/O thread)."""
        with self._mooncake_lock:
            if self.mooncake is None:
                host = self.settings.listen_host if self.settings.listen_host not in ("", "0.0.0.0", "::") else "127.0.0.1"
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

    async def __aenter__(self) -> TransferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def pull(
        self,
        peer: Peer,
        block_hashes: Iterable[BlockHash],
        on_block: Callable[[Block], Any] | None = None,
        *,
        alloc: Allocator | None = None,
        streams: int | None = None,
        backends: Sequence[str] | None = None,
        deliver: str = "loop",
    ) -> TransferHandle:
        """Start pulling ``block_hashes`` from ``peer``; returns at once (call from a coroutine).

        ``alloc`` gives each block its destination buffer (default: a new
        bytearray); ``streams`` overrides the tcp stream count; ``backends``
        restricts and orders the backends tried (default: the topology's choice).
        ``deliver`` says where ``on_block`` runs: ``"loop"`` (the event loop
        thread) or ``"thread"`` (the receiving I/O thread, as soon as the block
        is verified: the lowest first-block latency; see :class:`TransferHandle`).
        """
        for name in backends or ():
            if name not in BACKENDS:
                raise UnknownBackendError(name, list(BACKENDS))
        if deliver not in DELIVERY:
            raise ValueError(f"deliver must be one of {', '.join(DELIVERY)}, got {deliver!r}")
        if deliver == "thread" and on_block is None:
            raise ValueError('deliver="thread" needs an on_block callback')
        handle = TransferHandle(list(block_hashes), on_block, in_thread=deliver == "thread")
        host, port = _parse_peer(peer)
        n = streams if streams is not None else self.settings.streams
        if n < 1:
            raise ValueError(f"streams must be >= 1, got {n}")
        handle._finish_hooks.append(self._record)
        if not handle.block_hashes:
            handle._finish(None)
            return handle
        alloc = alloc or _default_alloc
        candidates = list(backends) if backends else None
        known = self._remotes.get((host, port))
        if candidates is None and known is not None:
            candidates = choose_backends(self.local, known)
        warm: _Session | None = None
        if candidates:  # pooled streams: block 0's request goes out before this call returns
            session = _Session(self, handle, host, port, alloc, n)
            try:
                if session.start_warm(candidates[0]):
                    warm = session
            except TransferError:  # a pooled connection died under us: the driver reconnects
                session.close()
        handle._task = asyncio.get_running_loop().create_task(self._drive(handle, host, port, alloc, n, candidates, warm))
        if warm is not None:  # closed also when the task is cancelled before it runs
            close_warm = warm.close
            handle._task.add_done_callback(lambda _t: close_warm())
        return handle

    #: ``transfer(block_hashes, peer)`` reads well where the caller thinks in batches.
    def transfer(self, block_hashes: Iterable[BlockHash], peer: Peer, **kw: Any) -> TransferHandle:
        return self.pull(peer, block_hashes, **kw)

    async def _drive(
        self, handle: TransferHandle, host: str, port: int, alloc: Allocator, n: int,
        candidates: list[str] | None, warm: _Session | None,
    ) -> None:
        idx = 0
        attempt = 0
        wait_s = 0.0
        while not handle.done() and handle._missing():
            if wait_s:
                handle.stats.backoff_s += wait_s
                await self._sleep(wait_s)
                wait_s = 0.0
                if handle.done():
                    break
            backend = candidates[idx] if candidates else None
            session: _Session | None = None
            try:
                session, warm = warm or _Session(self, handle, host, port, alloc, n), None
                await session.open(backend)
                if candidates is None:
                    candidates = choose_backends(self.local, self._remotes[(host, port)])
                backend = session.backend
                if backend not in handle.stats.backends:
                    handle.stats.backends.append(backend)
                await session.finished
                session.release()
            except asyncio.CancelledError:
                if session is not None:
                    session.close()
                raise
            except TransferError as exc:
                self.metrics.errors.labels(exc.kind).inc()
                if handle.done():
                    break
                if not exc.retryable or attempt >= self.settings.max_retries:
                    log.warning("transfer from %s:%s failed: %s", host, port, exc)
                    handle._finish(exc)
                    break
                attempt += 1
                handle.stats.retries += 1
                self.metrics.retries.labels(backend or "none").inc()
                if candidates and idx + 1 < len(candidates):
                    handle.stats.failovers += 1
                    self.metrics.failovers.labels(candidates[idx], candidates[idx + 1]).inc()
                    idx += 1
                else:  # the same backend again: back off first
                    wait_s = self.backoff.delay(attempt)
                log.info("transfer from %s:%s: %s; retrying %d remaining blocks (attempt %d, in %.3f s)",
                         host, port, exc, len(handle._missing()), attempt, wait_s)
            except Exception as exc:  # an allocator or consumer bug: fail, never hang
                handle._finish(exc)
                break
            finally:
                if session is not None:
                    session.close()


    def _record(self, handle: TransferHandle) -> None:
        if handle.state == "done" and handle.stats.finished_s:
            backend = handle.stats.backends[-1] if handle.stats.backends else "none"
            self.metrics.completed(backend, handle.stats.bytes, handle.stats.finished_s)


class _Session:
    """One attempt: streams opened on one backend, for the blocks still missing."""

    def __init__(self, client: TransferClient, handle: TransferHandle, host: str, port: int, alloc: Allocator, n: int) -> None:
        self.client = client
        self.handle = handle
        self.host, self.port = host, port
        self.alloc = alloc
        self.n = n
        self.loop = asyncio.get_running_loop()
        self.streams: list[_Stream] = []
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self.backend = "tcp"
        self._n = 1
        self._stripes: list[list[tuple[int, BlockHash]]] = []
        self._outstanding = 0
        self._closed = False

    def _plan(self, backend: str) -> list[tuple[int, BlockHash]]:
        """Fix the backend, the stream count and each stream's stripe (round-robin: block 0 on stream 0)."""
        items = self.handle._missing()
        self.backend = backend
        self._n = 1 if backend in ("shm", "mooncake") else max(1, min(self.n, len(items)))
        self._stripes = [items[i :: self._n] for i in range(self._n)]
        self._outstanding = len(items)
        return items

    def start_warm(self, backend: str) -> bool:
        """Start at once on pooled streams, without an event-loop turn: block 0's REQUEST leaves now.

        False (nothing started) when the pool holds no stream for this backend;
        :meth:`open` then connects, and after a warm start it connects only the
        streams the pool lacked.
        """
        if not self._plan(backend):
            return False
        pooled = self.client._checkout((self.host, self.port, backend), self._n)
        for st in pooled:
            self.streams.append(st)
            self._go(st)
        return bool(pooled)

    async def open(self, backend: str | None) -> None:
        """Request the missing blocks: stream 0 (block 0's) first, the others as they connect.

        Stream 0 — pooled, or the first connection authenticated — gets its
        REQUEST and starts receiving before any further stream is opened, so
        block 0 is on its way while the rest connect (concurrently).
        """
        c = self.client
        if not self.streams:  # not started warm
            first: Channel | None = None
            if backend is None:  # first contact: the peer's HELLO decides the backend
                first, remote, chosen = await asyncio.to_thread(_connect, self.host, self.port, c.secret, c.local, c.settings, None)
                c._remotes[(self.host, self.port)] = remote
            else:
                chosen = backend
            backend = chosen
            if not self._plan(backend):
                if first is not None:
                    first.close()
                self.finished.set_result(None)
                return
            pooled = c._checkout((self.host, self.port, backend), self._n - (first is not None))
            if first is not None:
                pooled.append(_Stream(first, backend, len(pooled)))
            try:
                for st in pooled:
                    await self._start(st)
            except BaseException:
                for st in pooled:
                    if st not in self.streams:
                        st.close()
                raise
        missing = self._n - len(self.streams)
        if missing:
            fresh = await asyncio.gather(
                *(asyncio.to_thread(_connect, self.host, self.port, c.secret, c.local, c.settings, self.backend) for _ in range(missing)),
                return_exceptions=True,
            )
            chans = [x[0] for x in fresh if not isinstance(x, BaseException)]
            errors = [x for x in fresh if isinstance(x, BaseException)]
            if errors:
                for ch in chans:
                    ch.close()
                raise errors[0]
            for ch in chans:
                await self._start(_Stream(ch, self.backend, len(self.streams)))

    async def _start(self, st: _Stream) -> None:
        """Attach a fresh stream's ring (shm, mooncake; pooled ones keep theirs), then :meth:`_go`."""
        self.streams.append(st)  # from here on close() closes it
        c = self.client
        window = c.settings.window_blocks
        if self.backend == "shm" and st.ring is None:
            slot_bytes = c.settings.max_block_bytes
            st.ring = await asyncio.to_thread(ShmRing.create, c.settings.shm_dir, window, slot_bytes)
            st.ch.send_frames(encode_control(FrameType.SHM_ATTACH, {"name": st.ring.name, "slots": window, "slot_bytes": slot_bytes}))
        elif self.backend == "mooncake" and st.ring is None:
            slot_bytes = c.settings.max_block_bytes
            engine = await asyncio.to_thread(c._engine)
            st.ring = await asyncio.to_thread(RegisteredRing, engine, window, slot_bytes, slot_bytes)
            st.ch.send_frames(encode_control(FrameType.MC_ATTACH, {"slots": window, "slot_bytes": slot_bytes}))
        self._go(st)

    def _go(self, st: _Stream) -> None:
        """Start the stream's receiver, then send its credits and REQUESTs in one write."""
        items = st.items = self._stripes[self.streams.index(st)]
        window = self.client.settings.window_blocks
        st.batch = max(1, window // 4)
        st.pending = 0  # held-back credits of an earlier session: the top-up covers them
        top_up = window - (st.granted - st.received)
        # the stream's first block in a REQUEST of its own: the sender starts it before decoding the rest
        request = encode_control(FrameType.REQUEST, [list(items[0])])
        rest = encode_control(FrameType.REQUEST, [[q, h] for q, h in items[1:]]) if len(items) > 1 else b""
        credit = b""
        if top_up > 0:  # credits first: the sender may start block 0 as soon as it reads the REQUEST
            st.granted += top_up
            credit = encode_header(FrameType.CREDIT, seq=top_up)
        # the receiver first, then the request: the I/O thread is already waiting in recv when block 0
        # arrives (on loopback the woken sender often preempts this thread for a whole block's send)
        st.submit(self._receive)
        st.ch.send_frames(credit, request, rest)

    # -- I/O thread -------------------------------------------------------------
    def _receive(self, s: _Stream) -> None:
        try:
            if isinstance(s.ring, RegisteredRing) and s.remote is None:
                h0, body = s.ch.recv_control()
                if h0.type != FrameType.MC_READY or not isinstance(body, dict):
                    raise FrameError(f"expected MC_READY, got {h0.type.name}")
                rpc, addr = body.get("rpc"), body.get("addr")
                if not (isinstance(rpc, str) and isinstance(addr, int)):
                    raise FrameError("MC_READY needs rpc (str) and addr (int)")
                s.remote = (rpc, addr)
            in_thread = self.handle._in_thread
            payload_mac = self.client.settings.payload_mac
            for seq, bh in s.items:
                s.ch.quickack()
                while True:
                    try:
                        h = s.ch.recv_header()
                        break
                    except IdleTimeout:
                        if not s.starved():
                            raise
                raw = s.ch.header_bytes()
                if h.type == FrameType.MISSING and h.seq == seq:
                    self._check_tag(s, raw, EMPTY_DIGEST, h)
                    raise BlockNotFoundError(bh)
                want = FrameType.SLOT_BLOCK if s.ring is not None else FrameType.BLOCK
                if h.type != want or h.seq != seq or h.block_hash != bh:
                    raise FrameError(f"expected {want.name} seq {seq}, got {h.type.name} seq {h.seq}")
                dest = memoryview(self.alloc(seq, bh, h.length)).cast("B")
                if len(dest) != h.length:
                    raise ValueError(f"allocator returned {len(dest)} bytes for a {h.length}-byte block")
                if isinstance(s.ring, ShmRing):
                    self._check_tag(s, raw, EMPTY_DIGEST, h)  # the slot, length and checksum are the sender's
                    s.ring.unlink()  # the sender has it mapped now
                    dest[:] = s.ring.slot(h.slot, h.length)
                    self._verify(h, dest)
                elif isinstance(s.ring, RegisteredRing):
                    assert s.remote is not None
                    self._check_tag(s, raw, EMPTY_DIGEST, h)
                    ring = s.ring
                    ring.engine.read(s.remote[0], ring.slot_addr(h.slot), s.remote[1] + h.slot * ring.slot_bytes, h.length)
                    dest[:] = ring.slot(h.slot, h.length)
                    self._verify(h, dest)
                elif payload_mac:  # the tag covers the payload: no separate checksum pass unless it fails
                    if not s.ch.recv_tag(raw, s.ch.recv_digest_into(dest)):
                        self._verify(h, dest)  # a plain checksum mismatch: corrupt, not forged
                        raise IntegrityError(f"block seq {h.seq}: MAC mismatch with a matching checksum "
                                             "(altered in transit, or a wrong session key)")
                else:
                    s.ch.recv_into(dest)
                    self._check_tag(s, raw, EMPTY_DIGEST, h)
                    self._verify(h, dest)
                s.received += 1
                block = Block(seq, bh, dest)
                if in_thread:
                    self.handle._landed_in_thread(block, s)  # the consumer sees it now; bookkeeping follows
                self.loop.call_soon_threadsafe(self._landed, s, block)
        except BaseException as exc:
            if not (self._closed or s.closed):
                self.loop.call_soon_threadsafe(self._failed, exc)

    @staticmethod
    def _verify(h: Header, dest: memoryview) -> None:
        if checksum(dest) != h.checksum:
            raise ChecksumError(f"block seq {h.seq} checksum mismatch")

    @staticmethod
    def _check_tag(s: _Stream, raw: bytes, digest: bytes, h: Header) -> None:
        if not s.ch.recv_tag(raw, digest):
            raise IntegrityError(f"{h.type.name} seq {h.seq}: MAC mismatch (altered in transit, or a wrong session key)")

    # -- event-loop thread ------------------------------------------------------
    def _landed(self, s: _Stream, block: Block) -> None:
        """Bookkeeping for one verified block (posted by its I/O thread, after any in-thread delivery)."""
        if not self._closed:
            self._outstanding -= 1
            self.client.metrics.moved(self.backend, "received", len(block.data))
            if not self.handle._in_thread:
                self.handle._landed_block(block, s)
            if self._outstanding == 0 and not self.finished.done():
                self.release()  # pooled before the consumer resumes: a pull right after starts warm
                self.finished.set_result(None)
        if self.handle.complete:  # deliver="thread": the last block went to the consumer
            self.handle._finish(None)

    def _failed(self, exc: BaseException) -> None:
        if not self.finished.done() and not self._closed:
            self.finished.set_exception(exc)

    def release(self) -> None:
        """Success: every stream is idle and healthy; park them in the client's pool (idempotent)."""
        self._closed = True
        idle = [st for st in self.streams if st.idle.wait(1.0)]
        for st in self.streams:
            if st not in idle:
                st.close()
        self.client._checkin((self.host, self.port, self.backend), idle)
        self.streams = []

    def close(self) -> None:
        self._closed = True
        for st in self.streams:
            st.close()
        if not self.finished.done():
            self.finished.cancel()
