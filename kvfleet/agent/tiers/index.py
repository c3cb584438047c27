"""The manager's index: which tier holds each block, LRU order and bytes per tier, pins.

One re-entrant lock (:attr:`BlockIndex.lock`) guards the whole index; the
policy, the moves and the worker threads take it for every read-modify-write
of an entry and wait on :attr:`BlockIndex.wake` (notified on every change
that may let a waiter go on: a block stored, moved or unpinned, a batch
finished). The index also announces what it holds: ``BlockStored`` /
``BlockRemoved`` KV events to the sink, and the per-tier gauges. It does no
I/O and knows no store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.record import BlockMeta
from kvfleet.cache.events import EventSink, removed, stored
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier


@dataclass
class Entry:
    """One held block: its tier, meta and charge there; pinned blocks never move, moving ones are in flight."""

    tier: Tier
    meta: BlockMeta
    charge: int
    pins: int = 0
    moving: bool = False


class BlockIndex:
    """hash → :class:`Entry`, an LRU order and the bytes charged per tier (see the module doc)."""

    def __init__(self, tiers: tuple[Tier, ...], metrics: TierMetrics, sink: EventSink, block_size: int) -> None:
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.entries: dict[BlockHash, Entry] = {}
        self.lru: dict[Tier, OrderedDict[BlockHash, None]] = {t: OrderedDict() for t in tiers}
        self.used: dict[Tier, int] = dict.fromkeys(tiers, 0)
        self.metrics = metrics
        self.sink = sink
        #: tokens of a block whose meta names none (events carry a block size)
        self.block_size = block_size

    # The methods below are called with ``lock`` held.

    def add(self, h: BlockHash, tier: Tier, meta: BlockMeta, charge: int) -> None:
        self.entries[h] = Entry(tier=tier, meta=meta, charge=charge)
        self.lru[tier][h] = None
        self.used[tier] += charge
        self.gauges(tier)

    def remove(self, h: BlockHash) -> Entry | None:
        e = self.entries.pop(h, None)
        if e is not None:
            self.lru[e.tier].pop(h, None)
            self.used[e.tier] -= e.charge
            self.gauges(e.tier)
        return e

    def relocate(self, h: BlockHash, e: Entry, dst: Tier, meta: BlockMeta, charge: int) -> None:
        """Point ``h`` (entry ``e``) at ``dst`` with its new meta and charge."""
        self.lru[e.tier].pop(h, None)
        self.used[e.tier] -= e.charge
        self.gauges(e.tier)
        e.tier, e.meta, e.charge = dst, meta, charge
        self.lru[dst][h] = None
        self.used[dst] += charge
        self.gauges(dst)

    def touch(self, h: BlockHash) -> Entry | None:
        """The entry of ``h``, now the most recently used of its tier (``None`` if absent)."""
        e = self.entries.get(h)
        if e is not None:
            self.lru[e.tier].move_to_end(h)
        return e

    def movable(self, h: BlockHash) -> bool:
        e = self.entries[h]
        return not e.pins and not e.moving

    def gauges(self, tier: Tier) -> None:
        m = self.metrics
        m.child(m.used, tier.value).set(self.used[tier])
        m.child(m.blocks, tier.value).set(len(self.lru[tier]))

    # Announcements (KV events); callable with or without the lock.

    def announce_stored(self, meta: BlockMeta, tier: Tier) -> None:
        bs = len(meta.token_ids) or self.block_size
        self.sink(stored([meta.hash], meta.parent, meta.token_ids, bs, tier.medium))

    def announce_removed(self, h: BlockHash, tier: Tier) -> None:
        self.sink(removed([h], tier.medium))

    def unmark(self, h: BlockHash) -> None:
        """Clear ``h``'s moving flag (takes the lock)."""
        with self.lock:
            e = self.entries.get(h)
            if e is not None:
                e.moving = False


__all__ = ["BlockIndex", "Entry"]
