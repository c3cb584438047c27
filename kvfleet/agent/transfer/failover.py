"""Failover: one attempt is a :class:`_Session`; :func:`drive` runs attempts until every block landed.

A session opens N authenticated streams (tcp) or one (shm, mooncake) — pooled
ones first, stream 0 (block 0's) before the others connect — stripes the
missing blocks over them round-robin by sequence number, and runs each
stream's receive loop in its I/O thread: header, payload straight into its
destination slot, tag (and checksum) checked, then handed to the
:class:`TransferHandle`. A broken, stalled, corrupt or forged stream fails
the session; the blocks already verified are kept and :func:`drive` starts a
new session for the remaining ones only, on the next backend of the
topology's list (shm → tcp, mooncake → tcp) at once, or on the same one after
an exponential back-off with full jitter (:mod:`.backoff`), up to
``max_retries`` times. Permanent errors (auth, version, missing block) fail
at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvfleet.agent.transfer.backoff import Backoff
from kvfleet.agent.transfer.channel import Channel, IdleTimeout
from kvfleet.agent.transfer.connection import Allocator, _connect, _Connections, _Stream
from kvfleet.agent.transfer.errors import (
    BlockNotFoundError,
    ChecksumError,
    FrameError,
    IntegrityError,
    TransferError,
)
from kvfleet.agent.transfer.frames import (
    BlockHash,
    FrameType,
    Header,
    checksum,
    encode_control,
    encode_header,
)
from kvfleet.agent.transfer.handle import Block, TransferHandle
from kvfleet.agent.transfer.mooncake import RegisteredRing
from kvfleet.agent.transfer.shm import ShmRing
from kvfleet.agent.transfer.topology import choose_backends

log = logging.getLogger("kvfleet.agent.transfer.client")  # one logger for the receiving side


async def drive(
    conns: _Connections, handle: TransferHandle, host: str, port: int, alloc: Allocator, n: int,
    candidates: list[str] | None, warm: _Session | None, backoff: Backoff,
    sleep: Callable[[float], Awaitable[Any]],
) -> None:
    """Run sessions until every block landed, retrying and failing over; ends the handle with the last
    error."""
    idx = 0
    attempt = 0
    wait_s = 0.0
    while not handle.done() and handle._missing():
        if wait_s:
            handle.stats.backoff_s += wait_s
            await sleep(wait_s)
            wait_s = 0.0
            if handle.done():
                break
        backend = candidates[idx] if candidates else None
        session: _Session | None = None
        try:
            session, warm = warm or _Session(conns, handle, host, port, alloc, n), None
            await session.open(backend)
            if candidates is None:
                candidates = choose_backends(conns.local, conns._remotes[(host, port)])
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
            conns.metrics.errors.labels(exc.kind).inc()
            if handle.done():
                break
            if not exc.retryable or attempt >= conns.settings.max_retries:
                log.warning("transfer from %s:%s failed: %s", host, port, exc)
                handle._finish(exc)
                break
            attempt += 1
            handle.stats.retries += 1
            conns.metrics.retries.labels(backend or "none").inc()
            if candidates and idx + 1 < len(candidates):
                handle.stats.failovers += 1
                conns.metrics.failovers.labels(candidates[idx], candidates[idx + 1]).inc()
                idx += 1
            else:  # the same backend again: back off first
                wait_s = backoff.delay(attempt)
            log.info("transfer from %s:%s: %s; retrying %d remaining blocks (attempt %d, in %.3f s)",
                     host, port, exc, len(handle._missing()), attempt, wait_s)
        except Exception as exc:  # an allocator or consumer bug: fail, never hang
            handle._finish(exc)
            break
        finally:
            if session is not None:
                session.close()


class _Session:
    """One attempt: streams opened on one backend, for the blocks still missing."""

    def __init__(self, client: _Connections, handle: TransferHandle, host: str, port: int, alloc: Allocator,
                 n: int) -> None:
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
                first, remote, chosen = await asyncio.to_thread(_connect, self.host, self.port, c.secret,
                                                                c.local, c.settings, None)
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
                *(asyncio.to_thread(_connect, self.host, self.port, c.secret, c.local, c.settings,
                                    self.backend) for _ in range(missing)),
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
            st.ch.send_frames(encode_control(
                FrameType.SHM_ATTACH, {"name": st.ring.name, "slots": window, "slot_bytes": slot_bytes}))
        elif self.backend == "mooncake" and st.ring is None:
            slot_bytes = c.settings.max_block_bytes
            engine = await asyncio.to_thread(c._engine)
            st.ring = await asyncio.to_thread(RegisteredRing, engine, window, slot_bytes, slot_bytes)
            st.ch.send_frames(
                encode_control(FrameType.MC_ATTACH, {"slots": window, "slot_bytes": slot_bytes}))
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
                    self._check_tag(s, raw, h)
                    raise BlockNotFoundError(bh)
                want = FrameType.SLOT_BLOCK if s.ring is not None else FrameType.BLOCK
                if h.type != want or h.seq != seq or h.block_hash != bh:
                    raise FrameError(f"expected {want.name} seq {seq}, got {h.type.name} seq {h.seq}")
                dest = memoryview(self.alloc(seq, bh, h.length)).cast("B")
                if len(dest) != h.length:
                    raise ValueError(f"allocator returned {len(dest)} bytes for a {h.length}-byte block")
                if isinstance(s.ring, ShmRing):
                    self._check_tag(s, raw, h)  # the slot, length and checksum are the sender's
                    s.ring.unlink()  # the sender has it mapped now
                    dest[:] = s.ring.slot(h.slot, h.length)
                    self._verify(h, dest)
                elif isinstance(s.ring, RegisteredRing):
                    assert s.remote is not None
                    self._check_tag(s, raw, h)
                    ring = s.ring
                    ring.engine.read(s.remote[0], ring.slot_addr(h.slot),
                                     s.remote[1] + h.slot * ring.slot_bytes, h.length)
                    dest[:] = ring.slot(h.slot, h.length)
                    self._verify(h, dest)
                elif payload_mac:  # the tag covers the payload: no separate checksum pass unless it fails
                    if not s.ch.recv_block_mac(raw, dest):
                        self._verify(h, dest)  # a plain checksum mismatch: corrupt, not forged
                        raise IntegrityError(f"block seq {h.seq}: MAC mismatch with a matching checksum "
                                             "(altered in transit, or a wrong session key)")
                else:
                    s.ch.recv_into(dest)
                    self._check_tag(s, raw, h)
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
    def _check_tag(s: _Stream, raw: bytes, h: Header) -> None:
        if not s.ch.recv_tag(raw):
            raise IntegrityError(
                f"{h.type.name} seq {h.seq}: MAC mismatch (altered in transit, or a wrong session key)")

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
