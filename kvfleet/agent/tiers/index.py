"""The manager's index: which tier holds each block, LRU order and bytes per tier, pins.

One re-entrant lock (:attr:`BlockIndex.lock`) guards the whole index; the
policy, the moves and the worker threads take it for every read-modify-write
of an entry and wait on :attr:`BlockIndex.wake` (notified on every change
that may let a waiter go on: a block stored, moved or unpinned, a batch
finished). The index also announces what it holds: ``BlockStored`` /
``BlockRemoved`` KV events to the sink, and the per-tier gauges (read from
the index when scraped). It does no I/O and knows no store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.record import BlockMeta
from kvfleet.cache.events import EventSink, removed, stored
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier

_HASH, _TOKENS = attrgetter("hash"), attrgetter("token_ids")


@dataclass(slots=True)
class Entry:
    """One held block: its tier, meta and charge there; pinned blocks never move, moving ones are in
    flight."""

    tier: Tier
    meta: BlockMeta
    charge: int
    pins: int = 0
    moving: bool = False


class BlockIndex:
    """hash → :class:`Entry`, an LRU order and the bytes charged per tier (see the module doc)."""

    def __init__(self, tiers: tuple[Tier, ...], metrics: TierMetrics, sink: EventSink,
                 block_size: int) -> None:
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.entries: dict[BlockHash, Entry] = {}
        self.lru: dict[Tier, OrderedDict[BlockHash, None]] = {t: OrderedDict() for t in tiers}
        self.used: dict[Tier, int] = dict.fromkeys(tiers, 0)
        self.metrics = metrics
        self.sink = sink
        #: tokens of a block whose meta names none (events carry a block size)
        self.block_size = block_size
        self._medium = {t: t.medium for t in tiers}
        for t in tiers:  # read at scrape time: no gauge is set on the put path
            metrics.child(metrics.used, t.value).set_function(lambda t=t: self.used[t])
            metrics.child(metrics.blocks, t.value).set_function(lambda t=t: len(self.lru[t]))

    # The methods below are called with ``lock`` held.

    def add(self, h: BlockHash, tier: Tier, meta: BlockMeta, charge: int) -> None:
        self.entries[h] = Entry(tier=tier, meta=meta, charge=charge)
        self.lru[tier][h] = None
        self.used[tier] += charge

    def add_many(self, tier: Tier, metas: list[BlockMeta], charge: int) -> None:
        """:meth:`add` of every block of ``metas`` to ``tier``, each charged ``charge``, then
        :meth:`announce_stored` of each."""
        entries, lru = self.entries, self.lru[tier]
        for meta in metas:
            entries[meta.hash] = Entry(tier, meta, charge)
            lru[meta.hash] = None
        self.used[tier] += charge * len(metas)
        sink, medium, bs = self.sink, self._medium[tier], self.block_size
        for run in chains(metas, bs):  # a run of several holds full blocks only
            toks = list(chain.from_iterable(map(_TOKENS, run)))
            sink(stored(list(map(_HASH, run)), run[0].parent, toks, len(run[0].token_ids) or bs, medium))

    def fresh(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Positions in ``hashes`` of the blocks not held, in order; held ones are touched instead. A hash
        given twice counts once, from its last position, at its first one's place in the order."""
        out: dict[BlockHash, int] = {}
        entries = self.entries
        for i, h in enumerate(hashes):
            if h not in entries:
                out[h] = i
            else:
                self.touch(h)
        return list(out.values())

    def remove(self, h: BlockHash) -> Entry | None:
        e = self.entries.pop(h, None)
        if e is not None:
            self.lru[e.tier].pop(h, None)
            self.used[e.tier] -= e.charge
        return e

    def remove_unpinned(self, tier: Tier, hashes: list[BlockHash]) -> tuple[list[BlockHash], int]:
        """:meth:`remove` of each of ``hashes`` held unpinned in ``tier``; returns those removed and their
        charge."""
        entries, lru = self.entries, self.lru[tier]
        held, pop = self.held_unpinned, lru.pop
        gone: list[BlockHash] = []
        nbytes = 0
        for h in hashes:
            e = held(h, tier)
            if e is None:
                continue
            del entries[h]
            pop(h, None)
            nbytes += e.charge
            gone.append(h)
        self.used[tier] -= nbytes
        return gone, nbytes

    def relocate(self, h: BlockHash, e: Entry, dst: Tier, meta: BlockMeta, charge: int) -> None:
        """Point ``h`` (entry ``e``) at ``dst`` with its new meta and charge."""
        self.lru[e.tier].pop(h, None)
        self.used[e.tier] -= e.charge
        e.tier, e.meta, e.charge = dst, meta, charge
        self.lru[dst][h] = None
        self.used[dst] += charge

    def touch(self, h: BlockHash) -> Entry | None:
        """The entry of ``h``, now the most recently used of its tier (``None`` if absent)."""
        e = self.entries.get(h)
        if e is not None:
            self.lru[e.tier].move_to_end(h)
        return e

    def held_unpinned(self, h: BlockHash, tier: Tier) -> Entry | None:
        """The entry of ``h`` if it is held in ``tier`` and not pinned (may be moved out or dropped)."""
        e = self.entries.get(h)
        return None if e is None or e.tier != tier or e.pins else e

    def movable(self, h: BlockHash) -> bool:
        e = self.entries[h]
        return not e.pins and not e.moving

    # Announcements (KV events); callable with or without the lock.

    def announce_stored(self, meta: BlockMeta, tier: Tier) -> None:
        bs = len(meta.token_ids) or self.block_size
        self.sink(stored([meta.hash], meta.parent, meta.token_ids, bs, self._medium[tier]))

    def announce_removed(self, h: BlockHash, tier: Tier) -> None:
        self.sink(removed([h], self._medium[tier]))

    def announce_removed_many(self, hashes: list[BlockHash], tier: Tier) -> None:
        """One ``BlockRemoved`` for ``hashes`` (none when empty)."""
        if hashes:
            self.sink(removed(hashes, self._medium[tier]))

    def unmark(self, h: BlockHash) -> None:
        """Clear ``h``'s moving flag (takes the lock)."""
        with self.lock:
            e = self.entries.get(h)
            if e is not None:
                e.moving = False


def chains(metas: list[BlockMeta], block_size: int) -> list[list[BlockMeta]]:
    """``metas`` cut into runs that one ``BlockStored`` can announce, each in chain order (every block's
    parent the block before it): consecutive full blocks that chain forwards, or backwards (an engine
    frees a request's blocks tail first, so its demoted blocks arrive that way), are one run; any other
    block is a run of its own."""
    out: list[list[BlockMeta]] = []
    i, n = 0, len(metas)
    while i < n:
        run = [metas[i]]
        j = i + 1
        if len(metas[i].token_ids) == block_size:
            forward = j < n and metas[j].parent == metas[i].hash
            backward = not forward and j < n and metas[i].parent == metas[j].hash
            while j < n and len(metas[j].token_ids) == block_size and (
                    (forward and metas[j].parent == metas[j - 1].hash)
                    or (backward and metas[j - 1].parent == metas[j].hash)):
                run.append(metas[j])
                j += 1
            if backward:
                run.reverse()
        out.append(run)
        i = j
    return out


__all__ = ["BlockIndex", "Entry", "chains"]
