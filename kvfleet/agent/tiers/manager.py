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
    mgr.put_many([(h, block, parent, token_ids), ...], tier) -> int
        a put per item, oldest first (refused items counted, not raised); cheaper
        into a fastest memory tier with no memory tier below it.
    mgr.put_rows(hashes, rows, parents, token_ids, tier) -> int
        put_many of blocks given as the rows of one array.
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
    mgr.read(h) -> ndarray | None    the block where it is, without the promotion rule (no move)
    mgr.discard(hashes)              drop blocks from every tier (BlockRemoved)
    mgr.clear()                      drop every block
    mgr.decide(h) -> Decision | None the promotion rule for a held block, with its inputs
    mgr.drain(timeout_s) -> bool     wait until the queues are empty and no tier is above its high watermark
    mgr.close(flush=False)           flush=True first writes gpu/cpu blocks to ssd/remote (kept across
                                     restarts)

Events: every store, move and drop goes to ``sink`` as vLLM KV events with
``medium`` = the tier (``BlockStored`` on the destination, ``BlockRemoved`` on
the source); after a restart, blocks re-indexed from ssd/remote are announced
with ``BlockStored``. The sink is called from the migration threads too: use a
thread-safe one (:class:`kvfleet.cache.events.EventBuffer`).

This class is a facade over the package's rooms (docs/tiers.md, "Layout"),
about 530 lines on purpose: the public API, one short method per call, each
handing over to the room that does the work:

- :mod:`~.index`: hash → tier, LRU order, bytes per tier, pins, the KV events;
- :mod:`~.policy`: placement, watermarks, failing tiers, the promotion rule
  (:mod:`~.cost`);
- :mod:`~.moves`: one block's move between two stores, index switched over;
- :mod:`~.movement`: the migration threads, queues, back-pressure, staging
  (:mod:`~.staging`);
- the stores (:mod:`~.base` interface, :mod:`~.backends` factory).

A block lives in exactly one tier at a time. If a destination fails (disk
full, Redis down) the block stays where it was, the error is logged and
counted, and the failing tier is skipped for a while (``retry_after_s``):
nothing held in memory is lost. While every tier below it is failing, the ssd
tier acts as the last tier (drops its LRU blocks); memory tiers fill up
instead, and new blocks that find no room anywhere are not cached (logged,
``kvfleet_tier_errors_total{kind="write_dropped"}``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry

from kvfleet.agent.codecs import Codec, get_codec, warm_up
from kvfleet.agent.tiers.backends import open_store
from kvfleet.agent.tiers.base import TierStore
from kvfleet.agent.tiers.cost import Action, CostModel, Decision, TierCost, tier_cost
from kvfleet.agent.tiers.errors import (
    BackpressureError,
    BlockNotFoundError,
    BlockTooLargeError,
    TierError,
    TierFullError,
    TierIOError,
)
from kvfleet.agent.tiers.index import BlockIndex
from kvfleet.agent.tiers.memory import SlotStore
from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.movement import Movement
from kvfleet.agent.tiers.moves import Mover, PutItem
from kvfleet.agent.tiers.policy import MEMORY, ORDER, TierPolicy, payload_nbytes, tier_specs
from kvfleet.agent.tiers.record import meta_for
from kvfleet.cache.events import EventSink, null_sink
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSettings, TierSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupResult:
    """``num_hits`` leading hashes are held; ``tiers[i]`` is where hash ``i`` lives."""

    num_hits: int
    tiers: list[Tier]


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
        self.metrics = m = TierMetrics(registry)
        self.stores: dict[Tier, TierStore] = {}
        self.codecs: dict[Tier, Codec] = {}
        specs = self.specs()
        for tier in ORDER:
            spec = specs[tier]
            if not spec.enabled:
                continue
            codec = get_codec(spec.codec)
            store = (stores or {}).get(tier) or self._open(tier, spec)
            if store is None:
                continue
            self.stores[tier] = store
            self.codecs[tier] = codec
            m.child(m.info, tier.value, store.backend, str(store.stand_in).lower()).set(1)
            m.child(m.capacity, tier.value).set(store.capacity_bytes)
            log.info("%s, codec %s", store.describe(), codec.name)
        if not self.stores:
            raise TierError("no tier is enabled")
        lossy = sorted({c.name for c in self.codecs.values() if not c.lossless})
        if lossy:  # compile the codec kernels now, not in a migration thread mid-serving
            warm_up(lossy)
        self.order: tuple[Tier, ...] = tuple(t for t in ORDER if t in self.stores)
        self.cost = CostModel(self.settings.model, self._costs())
        self.index = BlockIndex(ORDER, m, sink, self.settings.model.block_size)
        self.policy = TierPolicy(self.settings, self.stores, self.codecs, self.index, m, self.cost)
        self.mover = Mover(self.stores, self.codecs, self.index, self.policy, m)
        self.movement = Movement(self.settings, self.mover, self.policy, self.index, m)
        for tier in self.order:
            self._rescan(tier)
        self.movement.start()

    # ----------------------------------------------------------------- setup


    @property
    def sink(self) -> EventSink:
        """Where the KV events of every store, move and drop go (the index emits them); may be replaced."""
        return self.index.sink

    @sink.setter
    def sink(self, value: EventSink) -> None:
        self.index.sink = value
    def specs(self) -> dict[Tier, TierSpec]:
        return tier_specs(self.settings)

    def _open(self, tier: Tier, spec: TierSpec) -> TierStore | None:
        try:
            return open_store(tier, spec)
        except (OSError, TierIOError) as exc:
            log.error("%s tier: cannot open (%s); continuing without it", tier, exc)
            self.metrics.child(self.metrics.errors, tier.value, "open").inc()
            return None

    def _costs(self) -> dict[Tier, TierCost]:
        specs = self.specs()
        m = self.metrics
        costs: dict[Tier, TierCost] = {}
        for tier in self.order:
            c = tier_cost(tier, specs[tier], self.stores[tier], self.settings.calibrate,
                          self.settings.calibrate_bytes)
            costs[tier] = c
            m.child(m.bandwidth, tier.value, "read").set(c.read_bps)
            m.child(m.bandwidth, tier.value, "write").set(c.write_bps)
            log.info("%s tier costs (%s): read %.2f GB/s, write %.2f GB/s, latency %.1f us", tier, c.source,
                     c.read_bps / 1e9, c.write_bps / 1e9, c.latency_s * 1e6)
        return costs

    def _rescan(self, tier: Tier) -> None:
        """Index what ``tier``'s store kept from an earlier run (announced when ``announce_on_start``)."""
        store = self.stores[tier]
        m = self.metrics
        try:
            report = store.scan()
        except TierIOError as exc:
            log.error("%s tier: start-up rescan failed: %s", tier, exc)
            m.child(m.errors, tier.value, exc.kind).inc()
            return
        for reason, n in report.dropped.items():
            log.warning("%s tier: dropped %d %s record(s) at start-up", tier, n, reason)
            m.child(m.dropped, tier.value, reason).inc(n)
        announced = 0
        index = self.index
        with index.lock:
            for meta in report.blocks:
                if meta.hash in index.entries:
                    # Held by a faster tier already: one copy only.
                    store.delete(meta.hash)
                    continue
                charge = store.charge(payload_nbytes(self.codecs[tier], meta))
                index.add(meta.hash, tier, meta, charge)
                if self.settings.announce_on_start:
                    index.announce_stored(meta, tier)
                    announced += 1
        if report.blocks:
            m.child(m.reindexed, tier.value).inc(len(report.blocks))
            log.info("%s tier: re-indexed %d block(s) from a previous run, announced %d", tier,
                     len(report.blocks), announced)

    # ------------------------------------------------------------ accounting

    def usage(self, tier: Tier) -> float:
        store = self.stores[tier]
        return self.index.used[tier] / store.capacity_bytes if store.capacity_bytes else 1.0

    def used_bytes(self, tier: Tier) -> int:
        return self.index.used[tier]

    def blocks_in(self, tier: Tier) -> int:
        return len(self.index.lru[tier])

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
        with self.index.lock:
            e = self.index.touch(h)
            if e is not None:
                return e.tier
        toks = tuple(map(int, token_ids))
        candidates = self.policy.put_candidates(tier)
        if not candidates:
            raise TierError(f"no enabled tier at or below {tier}")
        for t in candidates:
            if t not in MEMORY:
                break
            # The newest block belongs in the fastest tier: when ``tier`` is full, move its LRU block
            # one memory tier down (a memory copy) to make room, rather than send the new block down.
            made_room = t is tier and self.stores[t].full and self.movement.make_room(t)
            try:
                return self.mover.store_now(h, block, t, parent, toks)
            except BlockTooLargeError:
                continue
            except TierFullError:
                if made_room or t is not tier or not self.movement.make_room(t):
                    continue
            try:
                return self.mover.store_now(h, block, t, parent, toks)
            except (TierFullError, BlockTooLargeError):
                continue
        dst = self.policy.spill_target(candidates)
        if dst is None:
            raise TierFullError(f"no room for block {h!r} in {', '.join(candidates)}")
        self.movement.spill(h, block, meta_for(h, block, self.codecs[dst].name, parent, toks), dst)
        return dst

    def put_many(self, blocks: Sequence[PutItem], tier: Tier = Tier.GPU) -> int:
        """Store ``(hash, block, parent, token_ids)`` items, oldest first; returns how many were not kept.

        The end state of a :meth:`put` per item, with a refused item (no room anywhere, back-pressure)
        counted instead of raised. When ``tier`` is :attr:`~.movement.Movement.lone_top` with an
        uncompressed slot store (a manager whose gpu tier is off: the engine simulator's cpu tier),
        the batch is cheaper: the room for it is made at once (the tier's LRU blocks queued to the
        ssd/remote writers, or dropped when it is the last tier), the stores are counted once, and of
        a batch larger than the tier only the newest items that fit are stored (the older ones would
        only have pushed each other out): their ``BlockRemoved`` events all come before the batch's
        ``BlockStored`` ones.
        """
        store = self._batch_store(tier)
        if store is None:
            return self._put_each(blocks, tier)
        with self.index.lock:
            over, fresh = self._make_room(tier, store, [item[0] for item in blocks])
            stored, left = self.mover.store_batch(tier, [blocks[i] for i in fresh])
            skipped = over + self._put_each(left, tier)  # no room was made for these
        self._count_stores(tier, stored)
        return skipped

    def put_rows(self, hashes: Sequence[BlockHash], rows: npt.NDArray[Any],
                 parents: Sequence[BlockHash | None], token_ids: Sequence[tuple[int, ...]],
                 tier: Tier = Tier.GPU) -> int:
        """:meth:`put_many` of blocks given as the rows of one array: ``rows[i]`` is the block of
        ``hashes[i]`` (all of one dtype and shape), ``token_ids[i]`` a tuple of ints. On the batch path
        no array is made per block: the blocks' metas are built in one pass and the rows copied into
        their slots as they are (the engine simulator hands over its demoted blocks so)."""
        store = self._batch_store(tier)
        if store is None:
            return self.put_many(list(zip(hashes, rows, parents, token_ids, strict=True)), tier)
        with self.index.lock:
            over, fresh = self._make_room(tier, store, hashes)
            every = len(fresh) == len(hashes)  # nothing held, no hash twice: the rows as they are
            stored = self.mover.store_rows(
                tier, hashes if every else [hashes[i] for i in fresh], rows if every else rows[fresh],
                parents if every else [parents[i] for i in fresh],
                token_ids if every else [token_ids[i] for i in fresh])
            skipped = over + self._put_each(
                [(hashes[i], rows[i], parents[i], token_ids[i]) for i in fresh[stored:]], tier)
        self._count_stores(tier, stored)
        return skipped

    def _batch_store(self, tier: Tier) -> SlotStore[Any] | None:
        """The store of ``tier`` when a batch into it takes the cheaper path (see :meth:`put_many`)."""
        store, codec = self.stores.get(tier), self.codecs.get(tier)
        ok = (tier is self.movement.lone_top and isinstance(store, SlotStore) and codec is not None
              and codec.lossless and bool(store.slot_bytes))
        return store if ok and isinstance(store, SlotStore) else None

    def _make_room(self, tier: Tier, store: SlotStore[Any], hashes: Sequence[BlockHash]
                   ) -> tuple[int, list[int]]:
        """For a batch into ``tier`` (caller holds the index lock): the positions of the new blocks to store
        (:meth:`~.index.BlockIndex.fresh`; of more than the tier holds, the newest) after room is made for
        them at once, and how many new ones were left out for want of slots."""
        fresh = self.index.fresh(hashes)
        over = max(0, len(fresh) - store.num_slots)
        fresh = fresh[over:]
        self.movement.free_slots(tier, len(fresh) - store.free_slots)
        return over, fresh

    def _count_stores(self, tier: Tier, n: int) -> None:
        if n:
            self.metrics.child(self.metrics.stores, tier.value).inc(n)

    def _put_each(self, blocks: Iterable[PutItem], tier: Tier) -> int:
        """:meth:`put` of every item; returns how many were refused."""
        refused = 0
        for h, block, parent, token_ids in blocks:
            try:
                self.put(h, block, tier, parent, token_ids)
            except TierError as exc:
                log.debug("%s tier: block %r not kept: %s", tier, h, exc)
                refused += 1
        return refused

    def lookup(self, hashes: Iterable[BlockHash]) -> LookupResult:
        """How many leading ``hashes`` are held, and where (counts hits per tier)."""
        tiers: list[Tier] = []
        with self.index.lock:
            for h in hashes:
                e = self.index.entries.get(h)
                if e is None:
                    self.metrics.misses.inc()
                    break
                tiers.append(e.tier)
        for t in tiers:
            self.metrics.child(self.metrics.hits, t.value).inc()
        return LookupResult(num_hits=len(tiers), tiers=tiers)

    def locate(self, h: BlockHash) -> Tier | None:
        with self.index.lock:
            e = self.index.entries.get(h)
            return None if e is None else e.tier

    def decide(self, h: BlockHash) -> Decision | None:
        """The promotion rule for ``h`` where it is now (``None`` if absent or already fastest)."""
        return self.policy.decide(h)

    def get(self, h: BlockHash) -> npt.NDArray[Any] | None:
        """The block, applying the promotion rule to slow-tier hits (see module doc)."""
        return self._fetch(h, rule=True)

    def read(self, h: BlockHash) -> npt.NDArray[Any] | None:
        """The block where it is, touched as used: no promotion rule, no move.

        For a caller that keeps its own copy in a faster medium and prices the read itself (the
        engine simulator's GPU stand-in). ``None`` when absent or unreadable; a corrupt record is
        dropped (``BlockRemoved``), as with :meth:`get`.
        """
        return self._fetch(h, rule=False)

    def _fetch(self, h: BlockHash, rule: bool) -> npt.NDArray[Any] | None:
        for _ in range(3):
            with self.index.lock:
                e = self.index.touch(h)
                if e is None:
                    return None
                tier = e.tier
                if tier in MEMORY:
                    return self.mover.read_memory(h, e)
            decision = self.decide(h) if rule else None
            if decision is not None and decision.action is Action.RECOMPUTE:
                return None
            try:
                block = self.mover.read(tier, h)
            except BlockNotFoundError:
                continue  # moved or dropped meanwhile: look again
            except TierError:
                return None
            if decision is not None and decision.action is Action.PROMOTE:
                with contextlib.suppress(BackpressureError):
                    self.movement.promote(h, block)
            return block
        return None

    def prefetch(self, hashes: Iterable[BlockHash]) -> int:
        """Queue promotions of held slow-tier blocks that the rule says to promote."""
        n = 0
        for h in hashes:
            d = self.decide(h)
            if d is not None and d.action is Action.PROMOTE:
                try:
                    self.movement.promote(h)
                except BackpressureError:
                    break
                n += 1
        return n

    def pin(self, hashes: Iterable[BlockHash]) -> PinReceipt:
        """Pin held blocks (never demoted or evicted until unpinned); raises BlockNotFoundError."""
        hs = list(hashes)
        entries = self.index.entries
        with self.index.lock:
            missing = [h for h in hs if h not in entries]
            if missing:
                raise BlockNotFoundError(missing[0])
            for h in hs:
                entries[h].pins += 1
        return PinReceipt(self, hs)

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        with self.index.lock:
            for h in hashes:
                e = self.index.entries.get(h)
                if e is not None and e.pins > 0:
                    e.pins -= 1
            self.index.wake.notify_all()

    def discard(self, hashes: Iterable[BlockHash]) -> int:
        """Drop blocks wherever they are (pinned ones included); returns how many were held."""
        n = 0
        with self.index.lock:
            for h in hashes:
                e = self.index.remove(h)
                if e is None:
                    continue
                n += 1
                try:
                    self.stores[e.tier].delete(h)
                except TierIOError as exc:
                    self.policy.io_failed(e.tier, exc)
                self.index.announce_removed(h, e.tier)
        return n

    def clear(self) -> int:
        """Drop every block from every tier (``BlockRemoved`` each); returns how many were held.

        A spilled write still queued lands afterwards: :meth:`drain` first to drop those too.
        """
        with self.index.lock:
            hashes = list(self.index.entries)
        return self.discard(hashes)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until no job is queued or running and no tier needs demotion."""
        deadline = time.monotonic() + timeout_s
        index = self.index
        with index.lock:
            while True:
                if self.movement.idle() and not any(self.policy.needs_demotion(t) for t in self.order):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                index.wake.notify_all()
                # woken by every finished batch and index change; the timeout covers a job just queued
                index.wake.wait(timeout=min(0.005, remaining))

    def close(self, flush: bool = False) -> None:
        """Stop the migration threads and close the stores.

        Memory tiers are lost unless ``flush``: then their blocks are first written
        to the persistent tiers (most recently used first, while there is room), so
        a restarted agent finds them there.
        """
        if self.movement.stopped:
            return
        self.movement.stop()
        if flush:
            self.mover.flush_memory()
        for store in self.stores.values():
            try:
                store.close()
            except Exception as exc:  # closing must not fail the caller
                log.warning("%s tier: close failed: %s", store.tier, exc)

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LookupResult", "PinReceipt", "PutItem", "TierManager"]
