"""The tier manager: where each KV block lives (gpu → cpu → ssd → remote) and moving it.

API for an engine's step loop (every call returns without waiting for disk
or network unless it says so)::

    mgr = TierManager(settings: TierSettings, sink: EventSink = null_sink,
                      registry: CollectorRegistry | None = None)
    mgr.put(h, block, tier=Tier.GPU, parent=None, token_ids=()) -> Tier
        store a block (ndarray; dtype/shape recorded in its header) in ``tier``
        or, when full, the next memory tier; when no memory tier has room the
        write is queued to ssd/remote (BackpressureError when that queue is full).
        Idempotent: a hash already held is only touched (content addressing).
    mgr.lookup(hashes) -> LookupResult(num_hits, tiers)
        prefix-style: how many leading hashes are held, and in which tier each.
    mgr.locate(h) -> Tier | None
    mgr.get(h) -> ndarray | None
        the block (a read-only view into its slot when pinned and stored
        uncompressed in memory, a fresh array otherwise). A hit in a slower
        tier applies the promotion rule (kvfleet.agent.tiers.cost): PROMOTE
        returns the block and queues its move up; SERVE_IN_PLACE returns it and
        leaves it; RECOMPUTE returns None (prefill is cheaper). Reading an
        ssd/remote block is synchronous I/O: call prefetch() ahead of time.
    mgr.prefetch(hashes) -> int      queue promotions of slow-tier blocks (rule applied); returns how many
    mgr.pin(hashes) -> PinReceipt    pinned blocks are never demoted or evicted; receipt.release() / with
    mgr.unpin(hashes)
    mgr.discard(hashes)              drop blocks from every tier (BlockRemoved)
    mgr.decide(h) -> Decision | None the promotion rule for a held block, with its inputs
    mgr.drain(timeout_s) -> bool     wait until the queues are empty and no tier is above its high watermark
    mgr.close(flush=False)           flush=True first writes gpu/cpu blocks to ssd/remote (kept across restarts)

Events: every store, move and drop goes to ``sink`` as vLLM KV events with
``medium`` = the tier (``BlockStored`` on the destination, ``BlockRemoved`` on
the source); after a restart, blocks re-indexed from ssd/remote are announced
with ``BlockStored``. The sink is called from the migration threads too: use a
thread-safe one (:class:`kvfleet.cache.events.EventBuffer`).

Policy: a tier above its high watermark demotes least-recently-used,
unpinned blocks one enabled tier down until it is at its low watermark; the
last enabled tier drops them instead (``BlockRemoved``). Daemon threads do
the moving (``kvfleet-tier-demote``, ``kvfleet-tier-write`` at a lower CPU
priority; ``kvfleet-tier-promote`` and ``kvfleet-tier-promote-1`` share the
promotion queue), in batches of
``migration_batch``, off the caller's thread; demotion writes straight from
the source slot (leased, so it is not reused meanwhile) and promotion from
ssd reads straight into a reserved slot. A block lives in exactly one tier at
a time. If the destination fails (disk full, Redis down) the block
stays where it was, the error is logged and counted, and the failing tier is
skipped for a while (``retry_after_s``): nothing held in memory is lost. While
every tier below it is failing, the ssd tier acts as the last tier (drops its
LRU blocks); memory tiers fill up instead, and new blocks that find no room
anywhere are not cached (logged, ``kvfleet_tier_errors_total{kind="write_dropped"}``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry

from kvfleet.agent.codecs import Codec, Payload, get_codec, warm_up
from kvfleet.agent.tiers.base import TierStore, open_store
from kvfleet.agent.tiers.cost import Action, CostModel, Decision, TierCost, tier_cost
from kvfleet.agent.tiers.errors import (
    BackpressureError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    TierError,
    TierFullError,
    TierIOError,
)
from kvfleet.agent.tiers.memory import PAGE, SlotStore, page_aligned
from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.record import BlockMeta, meta_for
from kvfleet.agent.tiers.slab import ZERO_COPY_MIN, SlabStore
from kvfleet.agent.tiers.ssd import FileStore
from kvfleet.cache.events import EventSink, null_sink, removed, stored
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSettings, TierSpec

log = logging.getLogger(__name__)

_ORDER = (Tier.GPU, Tier.CPU, Tier.SSD, Tier.REMOTE)
#: bytes of copy buffers for writes queued by put(), carved from one slab and recycled.
STAGING_BYTES = 64 << 20
#: nice increment of the background threads (demotion, spilled writes); promotions keep the engine's priority.
BACKGROUND_NICE = 5
_MEMORY = (Tier.GPU, Tier.CPU)


@dataclass(frozen=True)
class LookupResult:
    """``num_hits`` leading hashes are held; ``tiers[i]`` is where hash ``i`` lives."""

    num_hits: int
    tiers: list[Tier]


@dataclass
class _Entry:
    tier: Tier
    meta: BlockMeta
    charge: int
    pins: int = 0
    moving: bool = False


@dataclass(frozen=True)
class _Job:
    kind: str  # "promote" | "write"
    hash: BlockHash
    block: npt.NDArray[Any] | None = None
    meta: BlockMeta | None = None
    dst: Tier | None = None


@dataclass
class PinReceipt:
    """Releases its pins once (``release()`` or leaving a ``with`` block)."""

    manager: TierManager
    hashes: list[BlockHash] = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.manager.unpin(self.hashes)

    def __enter__(self) -> PinReceipt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TierManager:
    """Blocks across tiers with watermarks, the promotion rule and background migration."""

    def __init__(
        self,
        settings: TierSettings | None = None,
        sink: EventSink = null_sink,
        registry: CollectorRegistry | None = None,
        stores: dict[Tier, TierStore] | None = None,
    ) -> None:
        self.settings = settings or TierSettings()
        self.sink = sink
        self.metrics = TierMetrics(registry)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._lock = threading.RLock()
        self._entries: dict[BlockHash, _Entry] = {}
        self._lru: dict[Tier, OrderedDict[BlockHash, None]] = {t: OrderedDict() for t in _ORDER}
        self._used: dict[Tier, int] = dict.fromkeys(_ORDER, 0)
        self._skip_until: dict[Tier, float] = dict.fromkeys(_ORDER, 0.0)
        self.stores: dict[Tier, TierStore] = {}
        self.codecs: dict[Tier, Codec] = {}
        specs = self.specs()
        for tier in _ORDER:
            spec = specs[tier]
            if not spec.enabled:
                continue
            codec = get_codec(spec.codec)
            store = (stores or {}).get(tier) or self._open(tier, spec)
            if store is None:
                continue
            self.stores[tier] = store
            self.codecs[tier] = codec
            self._m(self.metrics.info, tier.value, store.backend, str(store.stand_in).lower()).set(1)
            self._m(self.metrics.capacity, tier.value).set(store.capacity_bytes)
            log.info("%s, codec %s", store.describe(), codec.name)
        if not self.stores:
            raise TierError("no tier is enabled")
        lossy = sorted({c.name for c in self.codecs.values() if not c.lossless})
        if lossy:  # compile the codec kernels now, not in a migration thread mid-serving
            warm_up(lossy)
        self.order: tuple[Tier, ...] = tuple(t for t in _ORDER if t in self.stores)
        self.cost = CostModel(self.settings.model, self._costs())
        self._wake = threading.Condition(self._lock)
        self._jobs: queue.Queue[_Job] = queue.Queue(maxsize=self.settings.queue_depth)  # promotions
        self._writes: queue.Queue[_Job] = queue.Queue(maxsize=self.settings.queue_depth)  # put() spilled to ssd/remote
        self._staging: dict[tuple[np.dtype[Any], tuple[int, ...]], list[npt.NDArray[Any]]] = {}
        self._staging_slab: npt.NDArray[np.uint8] | None = None
        self._staging_used = 0
        self._staging_lock = threading.Lock()
        self._stop = threading.Event()
        self._busy = 0
        self._last_yield = 0.0
        self._m(self.metrics.queue_depth, "jobs").set(0)
        for tier in self.order:
            self._rescan(tier)
        writers, readers = self.settings.demotion_workers, self.settings.promotion_workers
        self._threads = [threading.Thread(target=self._demote_loop, name="kvfleet-tier-demote", daemon=True)]
        self._threads += [
            threading.Thread(target=self._job_loop, args=(self._writes, writers, BACKGROUND_NICE), name=f"kvfleet-tier-write-{i}" if i else "kvfleet-tier-write", daemon=True)
            for i in range(writers)
        ]
        self._threads += [
            threading.Thread(target=self._job_loop, args=(self._jobs, readers, 0), name=f"kvfleet-tier-promote-{i}" if i else "kvfleet-tier-promote", daemon=True)
            for i in range(readers)
        ]
        # Demotion picks victims on its own thread; a batch bound for ssd/remote goes through these.
        self._demote_pool = (
            ThreadPoolExecutor(writers, thread_name_prefix="kvfleet-tier-demote-io", initializer=_lower_priority, initargs=(BACKGROUND_NICE,))
            if writers > 1
            else None
        )
        for t in self._threads:
            t.start()

    # ----------------------------------------------------------------- setup

    def specs(self) -> dict[Tier, TierSpec]:
        s = self.settings
        return {Tier.GPU: s.gpu, Tier.CPU: s.cpu, Tier.SSD: s.ssd, Tier.REMOTE: s.remote}

    def _open(self, tier: Tier, spec: TierSpec) -> TierStore | None:
        try:
            return open_store(tier, spec)
        except (OSError, TierIOError) as exc:
            log.error("%s tier: cannot open (%s); continuing without it", tier, exc)
            self._m(self.metrics.errors, tier.value, "open").inc()
            return None

    def _costs(self) -> dict[Tier, TierCost]:
        specs = self.specs()
        costs: dict[Tier, TierCost] = {}
        for tier in self.order:
            c = tier_cost(tier, specs[tier], self.stores[tier], self.settings.calibrate, self.settings.calibrate_bytes)
            costs[tier] = c
            self._m(self.metrics.bandwidth, tier.value, "read").set(c.read_bps)
            self._m(self.metrics.bandwidth, tier.value, "write").set(c.write_bps)
            log.info("%s tier costs (%s): read %.2f GB/s, write %.2f GB/s, latency %.1f us", tier, c.source, c.read_bps / 1e9, c.write_bps / 1e9, c.latency_s * 1e6)
        return costs

    def _rescan(self, tier: Tier) -> None:
        store = self.stores[tier]
        try:
            report = store.scan()
        except TierIOError as exc:
            log.error("%s tier: start-up rescan failed: %s", tier, exc)
            self._m(self.metrics.errors, tier.value, exc.kind).inc()
            return
        for reason, n in report.dropped.items():
            log.warning("%s tier: dropped %d %s record(s) at start-up", tier, n, reason)
            self._m(self.metrics.dropped, tier.value, reason).inc(n)
        announced = 0
        with self._lock:
            for meta in report.blocks:
                if meta.hash in self._entries:
                    # Held by a faster tier already: one copy only.
                    store.delete(meta.hash)
                    continue
                charge = store.charge(_payload_nbytes(self.codecs[tier], meta))
                self._add(meta.hash, tier, meta, charge)
                if self.settings.announce_on_start:
                    self._emit_stored(meta, tier)
                    announced += 1
        if report.blocks:
            self._m(self.metrics.reindexed, tier.value).inc(len(report.blocks))
            log.info("%s tier: re-indexed %d block(s) from a previous run, announced %d", tier, len(report.blocks), announced)

    # ------------------------------------------------------------- index ops

    def _add(self, h: BlockHash, tier: Tier, meta: BlockMeta, charge: int) -> None:
        self._entries[h] = _Entry(tier=tier, meta=meta, charge=charge)
        self._lru[tier][h] = None
        self._used[tier] += charge
        self._gauges(tier)

    def _remove(self, h: BlockHash) -> _Entry | None:
        e = self._entries.pop(h, None)
        if e is not None:
            self._lru[e.tier].pop(h, None)
            self._used[e.tier] -= e.charge
            self._gauges(e.tier)
        return e

    def _relocate(self, h: BlockHash, e: _Entry, dst: Tier, meta: BlockMeta, charge: int) -> None:
        self._lru[e.tier].pop(h, None)
        self._used[e.tier] -= e.charge
        self._gauges(e.tier)
        e.tier, e.meta, e.charge = dst, meta, charge
        self._lru[dst][h] = None
        self._used[dst] += charge
        self._gauges(dst)

    def _m(self, metric: Any, *values: str) -> Any:
        """The labelled child of a metric, cached (``labels()`` validates and locks on every call)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _gauges(self, tier: Tier) -> None:
        self._m(self.metrics.used, tier.value).set(self._used[tier])
        self._m(self.metrics.blocks, tier.value).set(len(self._lru[tier]))

    def _emit_stored(self, meta: BlockMeta, tier: Tier) -> None:
        bs = len(meta.token_ids) or self.cost.profile.block_size
        self.sink(stored([meta.hash], meta.parent, meta.token_ids, bs, tier.medium))

    def _emit_removed(self, h: BlockHash, tier: Tier) -> None:
        self.sink(removed([h], tier.medium))

    def usage(self, tier: Tier) -> float:
        store = self.stores[tier]
        return self._used[tier] / store.capacity_bytes if store.capacity_bytes else 1.0

    def used_bytes(self, tier: Tier) -> int:
        return self._used[tier]

    def blocks_in(self, tier: Tier) -> int:
        return len(self._lru[tier])

    # ------------------------------------------------------------ public API

    def put(
        self,
        h: BlockHash,
        block: npt.NDArray[Any],
        tier: Tier = Tier.GPU,
        parent: BlockHash | None = None,
        token_ids: Sequence[int] = (),
    ) -> Tier:
        """Store ``block`` under ``h``; returns the tier it went to (see module doc)."""
        if not isinstance(block, np.ndarray):
            raise TypeError(f"a block is a numpy array, got {type(block).__name__}")
        with self._lock:
            e = self._entries.get(h)
            if e is not None:
                self._lru[e.tier].move_to_end(h)
                return e.tier
        toks = tuple(int(t) for t in token_ids)
        candidates = [t for t in self.order if t.rank >= tier.rank]
        if not candidates:
            raise TierError(f"no enabled tier at or below {tier}")
        for t in candidates:
            if t not in _MEMORY:
                break
            try:
                return self._store_now(h, block, t, parent, toks)
            except BlockTooLargeError:
                continue
            except TierFullError:
                # The newest block belongs in the fastest tier: move that tier's LRU block one memory
                # tier down (a memory copy) to make room, rather than send the new block down.
                if t is not tier or not self._displace(t):
                    continue
            try:
                return self._store_now(h, block, t, parent, toks)
            except (TierFullError, BlockTooLargeError):
                continue
        dst = next((t for t in candidates if t not in _MEMORY), None)
        if dst is None:
            raise TierFullError(f"no room for block {h!r} in {', '.join(candidates)}")
        meta = meta_for(h, block, self.codecs[dst].name, parent, toks)
        staged = self._stage(block)
        try:
            self._enqueue(_Job("write", h, staged, meta, dst))
        except BackpressureError:
            self._unstage(staged)
            raise
        return dst

    def _victim(self, tier: Tier) -> BlockHash | None:
        """``tier``'s least recently used block that is neither pinned nor moving, marked moving (caller holds the lock)."""
        victim = next((h for h in self._lru[tier] if not self._entries[h].pins and not self._entries[h].moving), None)
        if victim is not None:
            self._entries[victim].moving = True
        return victim

    def _unmark(self, h: BlockHash) -> None:
        with self._lock:
            e = self._entries.get(h)
            if e is not None:
                e.moving = False

    def _displace(self, tier: Tier) -> bool:
        """Make a free slot in the memory tier ``tier`` on the caller's thread, without disk I/O.

        Its least recently used movable block moves to the next memory tier; when that one is full
        too, its own LRU block is first queued to the ssd/remote writers (:meth:`_spill_lru`).
        ``False`` when no block can move.
        """
        below = [t for t in self.order if t.rank > tier.rank and t in _MEMORY and self._available(t)]
        store = self.stores[tier]
        if not below or not isinstance(store, SlotStore):
            return False
        with self._lock:
            victim = self._victim(tier)
        if victim is None:
            return False
        try:
            meta, view, slot = store.lease(victim)
            try:
                if self._write_moved(victim, (meta, view), tier, below[0], kind="demote"):
                    return True
                return self._spill_lru(below[0]) and self._write_moved(victim, (meta, view), tier, below[0], kind="demote")
            finally:
                store.release(slot)
        except BlockNotFoundError:
            return False
        finally:
            self._unmark(victim)

    def _spill_lru(self, tier: Tier) -> bool:
        """Free a slot of the memory tier ``tier``: its LRU movable block is copied to a staging buffer,
        dropped from the tier, and queued to the ssd/remote writers (like a spilled ``put``; it is a
        miss until written). ``False`` when there is no such block, no slow tier, or no queue room."""
        dst = next((t for t in self.order if t not in _MEMORY and self._available(t)), None)
        store = self.stores[tier]
        if dst is None or not isinstance(store, SlotStore) or self._writes.full():
            return False
        with self._lock:
            victim = self._victim(tier)
        if victim is None:
            return False
        staged: npt.NDArray[Any] | None = None
        try:
            meta, view, slot = store.lease(victim)
            try:
                staged = self._stage(get_codec(meta.codec).decode(view, meta.dtype, meta.shape))
            finally:
                store.release(slot)
            with self._lock:
                e = self._entries.get(victim)
                if e is None or e.tier != tier or e.pins:
                    return False
                self._remove(victim)
                store.delete(victim)
                self._emit_removed(victim, tier)
            self._enqueue(_Job("write", victim, staged, meta, dst))
            staged = None
            return True
        except BlockNotFoundError:
            return False
        except BackpressureError:
            log.warning("block %r not cached: the slow-tier write queue filled meanwhile", victim)
            self._m(self.metrics.errors, dst.value, "write_dropped").inc()
            return False
        finally:
            if staged is not None:
                self._unstage(staged)
            self._unmark(victim)

    def _stage(self, block: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A private copy of ``block`` for a queued write, in a recycled buffer when one is free.

        Recycled buffers are already backed by memory: copying into them costs no page faults.
        """
        key = (block.dtype, block.shape)
        nbytes = block.nbytes
        buf: npt.NDArray[Any] | None = None
        with self._staging_lock:
            pool = self._staging.get(key)
            if pool:
                buf = pool.pop()
            elif 0 < nbytes and self._staging_used + nbytes <= STAGING_BYTES:
                # Carved from one big slab mapped with huge pages (page_aligned advises them), so a
                # first write faults once per 2 MiB, not once per 4 KiB.
                if self._staging_slab is None:
                    self._staging_slab = page_aligned(STAGING_BYTES)
                # large blocks start on a page, so the ssd tier's direct I/O writes them where they are
                align = PAGE if nbytes >= ZERO_COPY_MIN else 64
                start = -(-self._staging_used // align) * align
                if start + nbytes <= STAGING_BYTES:
                    raw = self._staging_slab[start : start + nbytes]
                    buf = raw.view(block.dtype).reshape(block.shape)
                    self._staging_used = start + nbytes
        if buf is None:  # staging slab used up: a one-off buffer (page-aligned when large, like the slab's)
            buf = page_aligned(nbytes).view(block.dtype).reshape(block.shape) if nbytes >= ZERO_COPY_MIN else np.empty(block.shape, dtype=block.dtype)
        np.copyto(buf, block)
        return buf

    def _unstage(self, buf: npt.NDArray[Any]) -> None:
        """Give a staging buffer back for reuse (only those carved from the slab are kept)."""
        slab = self._staging_slab
        if slab is not None and np.shares_memory(buf, slab):
            with self._staging_lock:
                self._staging.setdefault((buf.dtype, buf.shape), []).append(buf)

    def _store_now(self, h: BlockHash, block: npt.NDArray[Any], tier: Tier, parent: BlockHash | None, toks: tuple[int, ...]) -> Tier:
        codec = self.codecs[tier]
        meta = meta_for(h, block, codec.name, parent, toks)
        store = self.stores[tier]
        if isinstance(store, SlotStore) and not codec.lossless:
            # A quantizing codec encodes straight into the slot: no temporary payload, no copy.
            nbytes = codec.encoded_nbytes(block.dtype, block.shape)
            slot, view = store.reserve(nbytes)
            try:
                codec.encode_into(block, view)
            except BaseException:
                store.abort(slot)
                raise
            with self._lock:
                if h in self._entries:
                    store.abort(slot)
                    return self._entries[h].tier
                charge = store.commit(slot, meta, nbytes)
                self._add(h, tier, meta, charge)
                self._emit_stored(meta, tier)
                self._wake.notify_all()
        else:
            payload = codec.encode(block)
            nbytes = payload.nbytes
            with self._lock:
                if h in self._entries:
                    return self._entries[h].tier
                charge = store.write(meta, payload)
                self._add(h, tier, meta, charge)
                self._emit_stored(meta, tier)
                self._wake.notify_all()
        self._m(self.metrics.stores, tier.value).inc()
        self._m(self.metrics.codec_saved, tier.value, codec.name).inc(max(0, meta.raw_nbytes - nbytes))
        return tier

    def lookup(self, hashes: Iterable[BlockHash]) -> LookupResult:
        """How many leading ``hashes`` are held, and where (counts hits per tier)."""
        tiers: list[Tier] = []
        with self._lock:
            for h in hashes:
                e = self._entries.get(h)
                if e is None:
                    self.metrics.misses.inc()
                    break
                tiers.append(e.tier)
        for t in tiers:
            self._m(self.metrics.hits, t.value).inc()
        return LookupResult(num_hits=len(tiers), tiers=tiers)

    def locate(self, h: BlockHash) -> Tier | None:
        with self._lock:
            e = self._entries.get(h)
            return None if e is None else e.tier

    def decide(self, h: BlockHash) -> Decision | None:
        """The promotion rule for ``h`` where it is now (``None`` if absent or already fastest)."""
        with self._lock:
            e = self._entries.get(h)
            if e is None or e.tier == self.order[0]:
                return None
            src, meta = e.tier, e.meta
        dst = self.order[0]
        tokens = len(meta.token_ids) or self.cost.profile.block_size
        d = self.cost.decide(
            src, dst, tokens, _payload_nbytes(self.codecs.get(src, get_codec(meta.codec)), meta), _payload_nbytes(self.codecs[dst], meta)
        )
        self._m(self.metrics.decisions, src.value, d.action.value).inc()
        for term, v in (("prefill", d.prefill_s), ("read", d.read_s), ("write", d.write_s)):
            self._m(self.metrics.decision_cost, src.value, term).set(v)
        return d

    def get(self, h: BlockHash) -> npt.NDArray[Any] | None:
        """The block, applying the promotion rule to slow-tier hits (see module doc)."""
        for _ in range(3):
            with self._lock:
                e = self._entries.get(h)
                if e is None:
                    return None
                self._lru[e.tier].move_to_end(h)
                tier = e.tier
                if tier in _MEMORY:
                    return self._read_memory(h, e)
            decision = self.decide(h)
            if decision is not None and decision.action is Action.RECOMPUTE:
                return None
            try:
                block = self._read(tier, h)
            except BlockNotFoundError:
                continue  # moved or dropped meanwhile: look again
            except TierError:
                return None
            if decision is not None and decision.action is Action.PROMOTE:
                with contextlib.suppress(BackpressureError):
                    self._enqueue(_Job("promote", h, block))
            return block
        return None

    def _read_memory(self, h: BlockHash, e: _Entry) -> npt.NDArray[Any]:
        meta, payload = self.stores[e.tier].read(h)
        block = get_codec(meta.codec).decode(payload, meta.dtype, meta.shape)
        if e.pins > 0:
            return block
        return np.array(block, copy=True) if np.shares_memory(block, payload) else block

    def _read(self, tier: Tier, h: BlockHash) -> npt.NDArray[Any]:
        """Read and decode from a slow tier (outside the lock); errors are logged and counted."""
        meta, payload = self._read_raw(tier, h)
        return get_codec(meta.codec).decode(payload, meta.dtype, meta.shape)

    def _read_raw(self, tier: Tier, h: BlockHash) -> tuple[BlockMeta, Payload]:
        try:
            meta, payload = self.stores[tier].read(h)
        except BlockNotFoundError:
            raise
        except CorruptBlockError as exc:
            log.error("%s tier: block %r is corrupt (%s); dropping it", tier, h, exc)
            self._m(self.metrics.errors, tier.value, "corrupt").inc()
            with self._lock:
                e = self._entries.get(h)
                if e is not None and e.tier == tier:
                    self._remove(h)
                    self.stores[tier].delete(h)
                    self._emit_removed(h, tier)
            raise
        except TierIOError as exc:
            self._io_failed(tier, exc)
            raise
        return meta, payload

    def prefetch(self, hashes: Iterable[BlockHash]) -> int:
        """Queue promotions of held slow-tier blocks that the rule says to promote."""
        n = 0
        for h in hashes:
            d = self.decide(h)
            if d is not None and d.action is Action.PROMOTE:
                try:
                    self._enqueue(_Job("promote", h))
                except BackpressureError:
                    break
                n += 1
        return n

    def pin(self, hashes: Iterable[BlockHash]) -> PinReceipt:
        """Pin held blocks (never demoted or evicted until unpinned); raises BlockNotFoundError."""
        hs = list(hashes)
        with self._lock:
            missing = [h for h in hs if h not in self._entries]
            if missing:
                raise BlockNotFoundError(missing[0])
            for h in hs:
                self._entries[h].pins += 1
        return PinReceipt(self, hs)

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                e = self._entries.get(h)
                if e is not None and e.pins > 0:
                    e.pins -= 1
            self._wake.notify_all()

    def discard(self, hashes: Iterable[BlockHash]) -> int:
        """Drop blocks wherever they are (pinned ones included); returns how many were held."""
        n = 0
        with self._lock:
            for h in hashes:
                e = self._remove(h)
                if e is None:
                    continue
                n += 1
                try:
                    self.stores[e.tier].delete(h)
                except TierIOError as exc:
                    self._io_failed(e.tier, exc)
                self._emit_removed(h, e.tier)
        return n

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until no job is queued or running and no tier needs demotion."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._jobs.unfinished_tasks == 0 and self._writes.unfinished_tasks == 0 and self._busy == 0 and not any(self._needs_demotion(t) for t in self.order):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.notify_all()
                # woken by every finished batch and index change; the timeout covers a job just queued
                self._wake.wait(timeout=min(0.005, remaining))

    def close(self, flush: bool = False) -> None:
        """Stop the migration threads and close the stores.

        Memory tiers are lost unless ``flush``: then their blocks are first written
        to the persistent tiers (most recently used first, while there is room), so
        a restarted agent finds them there.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        if self._demote_pool is not None:
            self._demote_pool.shutdown(wait=True)
        if flush:
            self._flush_memory()
        for store in self.stores.values():
            try:
                store.close()
            except Exception as exc:  # closing must not fail the caller
                log.warning("%s tier: close failed: %s", store.tier, exc)

    def _flush_memory(self) -> None:
        persistent = [t for t in self.order if t not in _MEMORY and self._available(t)]
        flushed = 0
        for tier in (t for t in self.order if t in _MEMORY):
            with self._lock:
                hashes = list(reversed(self._lru[tier]))
            for h in hashes:
                try:
                    source = self._read_for_move(tier, h)
                except TierError:
                    continue
                if not any(self._write_moved(h, source, tier, dst, kind="demote") for dst in persistent):
                    break  # no room left
                flushed += 1
        if flushed:
            log.info("flushed %d block(s) from memory tiers to %s before closing", flushed, ", ".join(persistent))

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- migrations

    def _yield_gil(self) -> None:
        """Give the engine's thread the GIL about once a millisecond of migration work."""
        now = time.perf_counter()
        if now - self._last_yield > 0.001:
            time.sleep(0)
            self._last_yield = time.perf_counter()

    def _enqueue(self, job: _Job) -> None:
        try:
            (self._writes if job.kind == "write" else self._jobs).put_nowait(job)
        except queue.Full:
            raise BackpressureError(f"migration queue full ({self.settings.queue_depth} jobs)") from None
        self._m(self.metrics.queue_depth, "jobs").set(self._jobs.qsize() + self._writes.qsize())

    def _available(self, tier: Tier) -> bool:
        return time.monotonic() >= self._skip_until[tier]

    def _io_failed(self, tier: Tier, exc: TierIOError) -> None:
        self._m(self.metrics.errors, tier.value, exc.kind).inc()
        spec = self.specs()[tier]
        backoff = getattr(spec, "retry_after_s", 1.0)
        self._skip_until[tier] = time.monotonic() + backoff
        log.error("%s tier: %s; skipping it for %.1fs (blocks stay where they are)", tier, exc, backoff)

    def _needs_demotion(self, tier: Tier) -> bool:
        store = self.stores[tier]
        if self._used[tier] <= store.spec.high_watermark * store.capacity_bytes:
            return False
        return any(not self._entries[h].pins and not self._entries[h].moving for h in self._lru[tier])

    def _demote_loop(self) -> None:
        _lower_priority(BACKGROUND_NICE)
        while not self._stop.is_set():
            worked = False
            for tier in reversed(self.order):
                try:
                    worked |= self._demote_batch(tier)
                except Exception:  # a bug here must not kill the thread silently
                    log.exception("%s tier: demotion failed", tier)
                    time.sleep(0.1)
            if not worked:
                with self._lock:
                    self._wake.wait(timeout=0.05)

    def _victims(self, tier: Tier) -> list[BlockHash]:
        store = self.stores[tier]
        if self._used[tier] <= store.spec.high_watermark * store.capacity_bytes:
            return []
        target = store.spec.low_watermark * store.capacity_bytes
        excess = self._used[tier] - target
        out: list[BlockHash] = []
        for h in self._lru[tier]:
            if excess <= 0 or len(out) >= self.settings.migration_batch:
                break
            e = self._entries[h]
            if e.pins or e.moving:
                continue
            out.append(h)
            excess -= e.charge
        return out

    def _demote_batch(self, tier: Tier) -> bool:
        with self._lock:
            victims = self._victims(tier)
            if not victims:
                return False
            for h in victims:
                self._entries[h].moving = True
            self._busy += 1
        moved = 0
        try:
            below = [t for t in self.order if t.rank > tier.rank]
            lower = [t for t in below if self._available(t)]
            # The last tier drops; so does a persistent tier whose lower tiers are all failing.
            # Memory tiers never drop because of a failure downstream: they keep what they hold.
            if not below or (not lower and tier not in _MEMORY):
                moved = self._evict(tier, victims)
            elif self._demote_pool is None or len(victims) == 1 or lower[0] in _MEMORY:
                for h in victims:
                    moved += self._move_down(tier, h, lower)
            else:
                moved = sum(self._demote_pool.map(lambda h: self._move_down(tier, h, lower), victims))
        finally:
            with self._lock:
                for h in victims:
                    e = self._entries.get(h)
                    if e is not None:
                        e.moving = False
                self._busy -= 1
        if not moved:
            time.sleep(0.02)  # every destination full or failing: back off
        return moved > 0

    def _evict(self, tier: Tier, victims: list[BlockHash]) -> int:
        n = 0
        with self._lock:
            for h in victims:
                e = self._entries.get(h)
                if e is None or e.tier != tier or e.pins:
                    continue
                self._remove(h)
                try:
                    self.stores[tier].delete(h)
                except TierIOError as exc:
                    self._io_failed(tier, exc)
                self._emit_removed(h, tier)
                self._m(self.metrics.evictions, tier.value).inc()
                self._m(self.metrics.evicted_bytes, tier.value).inc(e.charge)
                n += 1
        return n

    def _move_down(self, src: Tier, h: BlockHash, lower: list[Tier]) -> int:
        if not lower:
            return 0
        store = self.stores[src]
        if isinstance(store, SlotStore):
            # Write straight from the slot: the lease keeps it from being reused meanwhile.
            try:
                meta, view, slot = store.lease(h)
            except BlockNotFoundError:
                return 0
            try:
                return int(any(self._write_moved(h, (meta, view), src, dst, kind="demote") for dst in lower))
            finally:
                store.release(slot)
                self._yield_gil()
        try:
            source = self._read_for_move(src, h)
        except TierError:
            return 0
        try:
            return int(any(self._write_moved(h, source, src, dst, kind="demote") for dst in lower))
        finally:
            self._yield_gil()

    def _read_for_move(self, src: Tier, h: BlockHash) -> tuple[BlockMeta, Payload]:
        """The encoded block as stored (memory tiers: a private copy, the slot may be reused)."""
        if src in _MEMORY:
            with self._lock:
                meta, payload = self.stores[src].read(h)
                return meta, np.array(payload, copy=True)
        return self._read_raw(src, h)

    def _write_moved(self, h: BlockHash, source: tuple[BlockMeta, Payload], src: Tier, dst: Tier, kind: str) -> bool:
        """Write the block to ``dst`` then, if ``h`` is still in ``src`` and movable, switch it over.

        The payload is re-encoded only when the two tiers use different codecs.
        """
        codec = self.codecs[dst]
        store = self.stores[dst]
        with self._lock:
            e = self._entries.get(h)
            if e is None or e.tier != src:
                return True  # gone or moved meanwhile: nothing to do
            meta = BlockMeta(h, codec.name, e.meta.dtype, e.meta.shape, e.meta.raw_nbytes, e.meta.parent, e.meta.token_ids)
        src_meta, src_payload = source
        if src_meta.codec == codec.name:
            payload = src_payload
        else:
            block = get_codec(src_meta.codec).decode(src_payload, src_meta.dtype, src_meta.shape)
            payload = codec.encode(block)
        try:
            charge = store.write(meta, payload)
        except (TierFullError, BlockTooLargeError):
            return False
        except TierIOError as exc:
            self._io_failed(dst, exc)
            return False
        with self._lock:
            e = self._entries.get(h)
            if e is None or e.tier != src or (kind == "demote" and e.pins):
                # Handled: gone, moved or pinned meanwhile. Stores are keyed by hash, so the copy
                # just written is only ours to delete if the index does not place the block there.
                if e is None or e.tier != dst:
                    _quiet_delete(store, h)
                return True
            if not store.contains(h):  # deleted by another mover's clean-up meanwhile
                return False
            self._switch(h, e, src, dst, meta, charge)
        self._count_move(src, dst, kind, meta, payload.nbytes)
        return True

    def _switch(self, h: BlockHash, e: _Entry, src: Tier, dst: Tier, meta: BlockMeta, charge: int) -> None:
        """Point the index at ``dst`` and drop the ``src`` copy (caller holds the lock)."""
        self._relocate(h, e, dst, meta, charge)
        try:
            self.stores[src].forget(h)
        except TierIOError as exc:
            self._io_failed(src, exc)
        self._emit_stored(meta, dst)
        self._emit_removed(h, src)
        self._wake.notify_all()

    def _count_move(self, src: Tier, dst: Tier, kind: str, meta: BlockMeta, nbytes: int) -> None:
        self._m(self.metrics.migrations, src.value, dst.value, kind).inc()
        self._m(self.metrics.migrated_bytes, src.value, dst.value, kind).inc(nbytes)
        self._m(self.metrics.codec_saved, dst.value, meta.codec).inc(max(0, meta.raw_nbytes - nbytes))

    def _promote_direct(self, h: BlockHash, src: Tier, dst: Tier) -> bool | None:
        """Read an ssd record straight into a free slot of a memory tier (same codec): one copy.

        ``None`` when not applicable (other stores or codecs), else like :meth:`_write_moved`.
        """
        src_store, dst_store = self.stores[src], self.stores[dst]
        if not isinstance(src_store, (FileStore, SlabStore)) or not isinstance(dst_store, SlotStore):
            return None
        with self._lock:
            e = self._entries.get(h)
            if e is None or e.tier != src:
                return True
            if e.meta.codec != self.codecs[dst].name:
                return None
        reserved: list[tuple[int, int]] = []

        def alloc(meta: BlockMeta, nbytes: int) -> Payload:
            slot, view = dst_store.reserve(nbytes)
            reserved.append((slot, nbytes))
            return view

        try:
            meta = src_store.read_into(h, alloc)
        except (TierFullError, BlockTooLargeError):
            return False
        except TierError:
            for slot, _ in reserved:
                dst_store.abort(slot)
            self._read_raw(src, h)  # the normal path logs, counts and drops what is broken
            return False
        slot, nbytes = reserved[0]
        with self._lock:
            e = self._entries.get(h)
            if e is None or e.tier != src:
                dst_store.abort(slot)
                return True
            charge = dst_store.commit(slot, meta, nbytes)
            self._switch(h, e, src, dst, meta, charge)
        self._count_move(src, dst, "promote", meta, nbytes)
        return True

    def _job_loop(self, jobs: queue.Queue[_Job], workers: int, nice: int) -> None:
        _lower_priority(nice)
        while not self._stop.is_set():
            try:
                job = jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            with self._lock:
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
                self._m(self.metrics.queue_depth, "jobs").set(self._jobs.qsize() + self._writes.qsize())
                for j in batch:
                    try:
                        self._run_job(j)
                    except Exception:
                        log.exception("tier job %s for %r failed", j.kind, j.hash)
                    finally:
                        jobs.task_done()
                    self._yield_gil()
            finally:
                with self._lock:
                    self._busy -= 1
                    self._wake.notify_all()

    def _run_job(self, job: _Job) -> None:
        if job.kind == "write":
            self._write_new(job)
            return
        with self._lock:
            e = self._entries.get(job.hash)
            if e is None or e.moving or e.tier == self.order[0]:
                return
            src = e.tier
            e.moving = True
        try:
            faster = [t for t in self.order if t.rank < src.rank]
            if job.block is None:
                for dst in faster:
                    done = self._promote_direct(job.hash, src, dst)
                    if done is None:
                        break
                    if done:
                        return
            if job.block is not None:
                plain = get_codec("none")
                source = (BlockMeta(job.hash, plain.name, job.block.dtype.name, job.block.shape), plain.encode(job.block))
            else:
                source = self._read_for_move(src, job.hash)
            for dst in faster:
                if self._write_moved(job.hash, source, src, dst, kind="promote"):
                    return
                with self._lock:
                    self._wake.notify_all()  # make room upstream for the next try
        except TierError as exc:
            log.warning("%s tier: promotion of %r failed: %s", src, job.hash, exc)
        finally:
            with self._lock:
                e = self._entries.get(job.hash)
                if e is not None:
                    e.moving = False

    def _write_new(self, job: _Job) -> None:
        assert job.block is not None and job.meta is not None and job.dst is not None
        try:
            self._write_staged(job)
        finally:
            self._unstage(job.block)

    def _write_staged(self, job: _Job) -> None:
        assert job.block is not None and job.meta is not None and job.dst is not None
        for dst in [t for t in self.order if t.rank >= job.dst.rank and t not in _MEMORY]:
            if not self._available(dst):
                continue
            codec = self.codecs[dst]
            meta = BlockMeta(job.hash, codec.name, job.meta.dtype, job.meta.shape, job.meta.raw_nbytes, job.meta.parent, job.meta.token_ids)
            payload = codec.encode(job.block)
            try:
                charge = self.stores[dst].write(meta, payload)
            except (TierFullError, BlockTooLargeError):
                continue
            except TierIOError as exc:
                self._io_failed(dst, exc)
                continue
            with self._lock:
                e = self._entries.get(job.hash)
                if e is not None:  # put again meanwhile; same hash, same bytes
                    if e.tier != dst:
                        _quiet_delete(self.stores[dst], job.hash)
                    return
                if not self.stores[dst].contains(job.hash):  # evicted meanwhile
                    continue
                self._add(job.hash, dst, meta, charge)
                self._emit_stored(meta, dst)
                self._wake.notify_all()
            self._m(self.metrics.stores, dst.value).inc()
            return
        log.warning("block %r not cached: every slow tier is full or failing", job.hash)
        self._m(self.metrics.errors, job.dst.value, "write_dropped").inc()


def _lower_priority(increment: int) -> None:
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


def _quiet_delete(store: TierStore, h: BlockHash) -> None:
    try:
        store.delete(h)
    except TierError as exc:
        log.warning("%s tier: cannot delete %r: %s", store.tier, h, exc)


def _payload_nbytes(codec: Codec, meta: BlockMeta) -> int:
    return codec.encoded_nbytes(meta.dtype, meta.shape) if meta.shape else meta.raw_nbytes


__all__ = ["LookupResult", "PinReceipt", "TierManager"]
