"""Movement: the threads that run the moves, their queues, and how they share the machine.

Threads (daemons, started by :meth:`Movement.start`):

- ``kvfleet-tier-demote``: watches the watermarks (:meth:`~.policy.TierPolicy.victims`)
  and demotes batches of ``migration_batch``, slowest tier first; with
  ``demotion_workers`` > 1 a batch bound for ssd/remote goes through an
  executor of that many I/O threads (``kvfleet-tier-demote-io_N``);
- ``kvfleet-tier-write`` (``-1``, …; ``demotion_workers`` of them): write the
  blocks ``put()`` spilled to ssd/remote (staged copies, :mod:`~.staging`);
- ``kvfleet-tier-promote`` (``-1``, …; ``promotion_workers``): promotions
  queued by ``get()`` and ``prefetch()``.

Back-pressure: both queues hold ``queue_depth`` jobs; a full queue raises
:class:`~.errors.BackpressureError` to the caller instead of blocking it.
Sharing the machine with the engine's step loop: demotion and write threads
run at a lower CPU priority (per-thread nice +:data:`BACKGROUND_NICE`) and
hand the GIL over about once a millisecond of work (promotion threads keep
the engine's priority and drop the GIL only at their reads and checksums),
and a demotion round that moved nothing (every destination full or failing)
backs off for 20 ms. :meth:`Movement.make_room` is the one move made on the
caller's thread: a full fastest memory tier pushes its LRU block one memory
tier down (or, with none enabled below, to the ssd/remote writers, or out
when it is the last tier) so a new block can stay on top.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from kvfleet.agent.codecs import IdentityCodec, get_codec
from kvfleet.agent.tiers.errors import BackpressureError, BlockNotFoundError
from kvfleet.agent.tiers.index import BlockIndex
from kvfleet.agent.tiers.memory import SlotStore
from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.moves import Mover
from kvfleet.agent.tiers.policy import MEMORY, TierPolicy
from kvfleet.agent.tiers.record import BlockMeta
from kvfleet.agent.tiers.staging import StagingSlab
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSettings

log = logging.getLogger(__name__)

#: a demotion batch bound for ssd/remote takes each block's payload digest this many blocks before writing
#: it (:meth:`~.moves.Mover.digest`)
DIGEST_AHEAD = 2
#: nice increment of the background threads (demotion, spilled writes); promotions keep the engine's priority.
BACKGROUND_NICE = 5


@dataclass(frozen=True)
class Job:
    kind: str  # "promote" | "write"
    hash: BlockHash
    block: npt.NDArray[Any] | None = None
    meta: BlockMeta | None = None
    dst: Tier | None = None
    #: the staged block's payload digest (writes)
    digest: int | None = None
    #: the store and slot ``block`` is a view of, lent by that store (writes; else ``block`` is staged)
    lent: tuple[SlotStore[Any], int] | None = None


class Movement:
    """The migration threads and queues over one :class:`~.moves.Mover` (see the module doc)."""

    def __init__(self, settings: TierSettings, mover: Mover, policy: TierPolicy, index: BlockIndex,
                 metrics: TierMetrics) -> None:
        self.settings = settings
        self.mover = mover
        self.policy = policy
        self.index = index
        self.metrics = metrics
        self.staging = StagingSlab()
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=settings.queue_depth)  # promotions
        # put() spilled to ssd/remote
        self._writes: queue.Queue[Job] = queue.Queue(maxsize=settings.queue_depth)
        self._stop = threading.Event()
        self._busy = 0
        top = policy.order[0]
        #: the fastest tier when it is a memory tier with no memory tier enabled below it (a manager whose gpu
        #: tier is off): making room in it sends its LRU blocks to the ssd/remote writers, or out (make_room)
        alone = top in MEMORY and not any(t in MEMORY for t in policy.order[1:])
        self.lone_top: Tier | None = top if alone else None
        self._has_slow = any(t not in MEMORY for t in policy.order)
        self._last_yield = 0.0
        metrics.child(metrics.queue_depth, "jobs").set(0)
        writers, readers = settings.demotion_workers, settings.promotion_workers
        self._threads = [threading.Thread(target=self._demote_loop, name="kvfleet-tier-demote", daemon=True)]
        self._threads += [
            threading.Thread(target=self._job_loop, args=(self._writes, writers, BACKGROUND_NICE),
                             name=f"kvfleet-tier-write-{i}" if i else "kvfleet-tier-write", daemon=True)
            for i in range(writers)
        ]
        self._threads += [
            threading.Thread(target=self._job_loop, args=(self._jobs, readers, 0),
                             name=f"kvfleet-tier-promote-{i}" if i else "kvfleet-tier-promote", daemon=True)
            for i in range(readers)
        ]
        # Demotion picks victims on its own thread; a batch bound for ssd/remote goes through these.
        self._demote_pool = (
            ThreadPoolExecutor(writers, thread_name_prefix="kvfleet-tier-demote-io",
                               initializer=lower_priority, initargs=(BACKGROUND_NICE,))
            if writers > 1
            else None
        )

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop the threads (queued jobs are dropped) and wait for them."""
        self._stop.set()
        with self.index.lock:
            self.index.wake.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        if self._demote_pool is not None:
            self._demote_pool.shutdown(wait=True)

    def idle(self) -> bool:
        """No job queued or running (caller holds the index lock)."""
        return self._jobs.unfinished_tasks == 0 and self._writes.unfinished_tasks == 0 and self._busy == 0

    # --------------------------------------------------------------- queues

    def enqueue(self, job: Job) -> None:
        """Queue ``job`` without waiting; BackpressureError when its queue is full."""
        try:
            (self._writes if job.kind == "write" else self._jobs).put_nowait(job)
        except queue.Full:
            raise BackpressureError(f"migration queue full ({self.settings.queue_depth} jobs)") from None
        self._depth()

    def promote(self, h: BlockHash, block: npt.NDArray[Any] | None = None) -> None:
        self.enqueue(Job("promote", h, block))

    def spill(self, h: BlockHash, block: npt.NDArray[Any], meta: BlockMeta, dst: Tier) -> None:
        """Queue a staged copy of ``block`` for the ssd/remote writers (BackpressureError when full)."""
        staged, digest = self.staging.stage(block)
        try:
            self.enqueue(Job("write", h, staged, meta, dst, digest))
        except BackpressureError:
            self.staging.unstage(staged)
            raise

    def _depth(self) -> None:
        self.metrics.child(self.metrics.queue_depth, "jobs").set(self._jobs.qsize() + self._writes.qsize())

    # ------------------------------------------------- on the caller's thread

    def make_room(self, tier: Tier) -> bool:
        """Make a free slot in the memory tier ``tier`` on the caller's thread, without disk I/O.

        Its least recently used movable block moves to the next memory tier; when that one is full
        too, its own LRU block is first queued to the ssd/remote writers (:meth:`_spill_lru`). When
        ``tier`` is the fastest enabled tier and no memory tier is enabled below it (a manager whose
        gpu tier is off), its LRU block itself is queued to the writers, or dropped when ``tier``
        is the last tier (as its watermark would drop it later). ``False`` when no block can move.
        """
        store = self.mover.stores[tier]
        if not isinstance(store, SlotStore):
            return False
        if tier is self.lone_top:
            return (self._has_slow and self._spill_lru(tier)) or self._evict_lru(tier)
        below = self.policy.memory_below(tier)
        if not below:
            return False
        with self.index.lock:
            victim = self.policy.victim(tier)
        if victim is None:
            return False
        write_moved = self.mover.write_moved
        try:
            meta, view, slot = store.lease(victim)
            try:
                if write_moved(victim, (meta, view), tier, below[0], kind="demote"):
                    return True
                return self._spill_lru(below[0]) and write_moved(victim, (meta, view), tier, below[0],
                                                                 kind="demote")
            finally:
                store.release(slot)
        except BlockNotFoundError:
            return False
        finally:
            self.index.unmark(victim)

    def _spill_lru(self, tier: Tier) -> bool:
        """Free a slot of the memory tier ``tier``: its LRU movable block is dropped from the tier and queued
        to the ssd/remote writers (like a spilled ``put``; it is a miss until written). The writer writes
        it from its slot, lent by the store (:meth:`~.memory.SlotStore.lend`), or, when the store does
        not lend it, from a staging copy. ``False`` when there is no such block, no slow tier, or no
        queue room."""
        dst = self.policy.slow_target()
        store = self.mover.stores[tier]
        if dst is None or not isinstance(store, SlotStore) or self._writes.full():
            return False
        index = self.index
        with index.lock:
            victim = self.policy.victim(tier)
        if victim is None:
            return False
        staged: npt.NDArray[Any] | None = None
        lent: tuple[SlotStore[Any], int] | None = None  # handed to the writer with the job
        try:
            with index.lock:
                e = index.held_unpinned(victim, tier)
                if e is None:
                    return False
                loan = store.lend(victim) if e.meta.codec == IdentityCodec.name else None
                if loan is not None:
                    index.remove(victim)
                    index.announce_removed(victim, tier)
            if loan is not None:
                meta, view, slot = loan
                lent = (store, slot)
                job = Job("write", victim, get_codec(meta.codec).decode(view, meta.dtype, meta.shape), meta,
                          dst, lent=lent)
            else:
                meta, view, slot = store.lease(victim)
                try:
                    staged, digest = self.staging.stage(
                        get_codec(meta.codec).decode(view, meta.dtype, meta.shape))
                finally:
                    store.release(slot)
                with index.lock:
                    if index.held_unpinned(victim, tier) is None:
                        return False
                    index.remove(victim)
                    store.delete(victim)
                    index.announce_removed(victim, tier)
                job = Job("write", victim, staged, meta, dst, digest)
            self.enqueue(job)
            staged = lent = None
            return True
        except BlockNotFoundError:
            return False
        except BackpressureError:
            log.warning("block %r not cached: the slow-tier write queue filled meanwhile", victim)
            self.metrics.child(self.metrics.errors, dst.value, "write_dropped").inc()
            return False
        finally:
            if staged is not None:
                self.staging.unstage(staged)
            if lent is not None:
                lent[0].release(lent[1])
            index.unmark(victim)

    def _evict_lru(self, tier: Tier) -> bool:
        """Drop the LRU movable block of the memory tier ``tier`` when it is the last tier."""
        return self._evict_lru_many(tier, 1) > 0

    def _evict_lru_many(self, tier: Tier, n: int) -> int:
        """Drop up to ``n`` LRU movable blocks of the memory tier ``tier`` if it is the last tier;
        returns how many."""
        if tier is not self.policy.order[-1] or n <= 0:
            return 0
        index = self.index
        with index.lock:
            victims: list[BlockHash] = []
            entries = index.entries
            for h in index.lru[tier]:
                e = entries[h]
                if not e.pins and not e.moving:
                    victims.append(h)
                    if len(victims) >= n:
                        break
            return self.mover.evict(tier, victims)

    def free_slots(self, tier: Tier, n: int) -> int:
        """Free up to ``n`` slots of :attr:`lone_top` at once, as ``n`` calls of :meth:`make_room` would;
        returns how many."""
        if tier is not self.lone_top or n <= 0:
            return 0
        freed = 0
        if self._has_slow:
            while freed < n and self._spill_lru(tier):
                freed += 1
        return freed + self._evict_lru_many(tier, n - freed)

    # -------------------------------------------------------------- threads

    def _yield_gil(self) -> None:
        """Give the engine's thread the GIL about once a millisecond of migration work."""
        now = time.perf_counter()
        if now - self._last_yield > 0.001:
            time.sleep(0)
            self._last_yield = time.perf_counter()

    def _demote_loop(self) -> None:
        lower_priority(BACKGROUND_NICE)
        while not self._stop.is_set():
            worked = False
            for tier in reversed(self.policy.order):
                try:
                    worked |= self._demote_batch(tier)
                except Exception:  # a bug here must not kill the thread silently
                    log.exception("%s tier: demotion failed", tier)
                    time.sleep(0.1)
            if not worked:
                with self.index.lock:
                    self.index.wake.wait(timeout=0.05)

    def _demote_batch(self, tier: Tier) -> bool:
        index = self.index
        with index.lock:
            victims = self.policy.victims(tier)
            if not victims:
                return False
            for h in victims:
                index.entries[h].moving = True
            self._busy += 1
        moved = 0
        try:
            lower, drop = self.policy.demotion_targets(tier)
            if drop:
                moved = self.mover.evict(tier, victims)
            elif lower[0] in MEMORY:
                for h in victims:
                    moved += self._move_down(tier, h, lower)
            elif self._demote_pool is None or len(victims) == 1:
                # to ssd/remote: each block's digest taken DIGEST_AHEAD blocks before its write
                digests = {h: self.mover.digest(tier, h) for h in victims[:DIGEST_AHEAD]}
                for i, h in enumerate(victims):
                    if i + DIGEST_AHEAD < len(victims):
                        ahead = victims[i + DIGEST_AHEAD]
                        digests[ahead] = self.mover.digest(tier, ahead)
                    moved += self._move_down(tier, h, lower, digests.pop(h))
            else:
                moved = sum(self._demote_pool.map(lambda h: self._move_down(tier, h, lower), victims))
        finally:
            with index.lock:
                for h in victims:
                    e = index.entries.get(h)
                    if e is not None:
                        e.moving = False
                self._busy -= 1
        if not moved:
            time.sleep(0.02)  # every destination full or failing: back off
        return moved > 0

    def _move_down(self, tier: Tier, h: BlockHash, lower: list[Tier], digest: int | None = None) -> int:
        try:
            return self.mover.move_down(tier, h, lower, digest)
        finally:
            self._yield_gil()

    def _job_loop(self, jobs: queue.Queue[Job], workers: int, nice: int) -> None:
        lower_priority(nice)
        while not self._stop.is_set():
            try:
                job = jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            with self.index.lock:
                self._busy += 1
            try:
                batch = [job]
                # Share the queue between the workers: each takes its part, up to a batch.
                share = min(self.settings.migration_batch, max(1, -(-jobs.qsize() // workers)))
                while len(batch) < share:
                    try:
                        batch.append(jobs.get_nowait())
                    except queue.Empty:
                        break
                self._depth()
                for j in batch:
                    try:
                        self._run_job(j)
                    except Exception:
                        log.exception("tier job %s for %r failed", j.kind, j.hash)
                    finally:
                        jobs.task_done()
                    if nice:
                        # background work hands the GIL over; a promotion (on a request's path, at the
                        # engine's priority) drops it anyway at each read and checksum, and a forced
                        # hand-over per block only queues it for the GIL again
                        self._yield_gil()
            finally:
                with self.index.lock:
                    self._busy -= 1
                    self.index.wake.notify_all()

    def _run_job(self, job: Job) -> None:
        if job.kind != "write":
            self.mover.promote(job.hash, job.block)
            return
        assert job.block is not None and job.meta is not None and job.dst is not None
        try:
            self.mover.write_new(job.hash, job.block, job.meta, job.dst, job.digest)
        finally:
            if job.lent is not None:
                job.lent[0].release(job.lent[1])
            else:
                self.staging.unstage(job.block)


def lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by ``increment`` (Linux: per-thread nice).

    On a busy machine the kernel then runs the engine's step loop first and demotion takes the
    CPU time left over. A no-op where per-thread priorities are not supported.
    """
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as exc:
        log.debug("cannot lower migration thread priority: %s", exc)


__all__ = ["BACKGROUND_NICE", "Job", "Movement", "lower_priority"]
