"""Tier policy: where a block goes, what leaves a tier, and whether a slow-tier hit moves up.

It decides and never moves a byte (the moves are :mod:`~.moves`, the threads
:mod:`~.movement`):

- **placement**: a ``put`` tries its tier and the memory tiers below it, then
  the first persistent tier (:meth:`TierPolicy.put_candidates`,
  :meth:`spill_target`); a demoted block goes to the next enabled tier that
  is not failing (:meth:`demotion_targets`); a failing tier is skipped for
  ``retry_after_s`` (:meth:`io_failed`, :meth:`available`);
- **watermarks**: a tier above ``high_watermark × capacity`` gives up its
  least recently used unpinned blocks until it is at ``low_watermark``
  (:meth:`needs_demotion`, :meth:`victims`); the last tier drops them, and so
  does a persistent tier whose lower tiers are all failing (memory tiers keep
  what they hold);
- **the promotion rule** for a held block (:meth:`decide`): the inequality
  ``prefill_cost > read_cost(slow) + write_cost(fast)`` of
  :class:`~.cost.CostModel`, with its inputs exported as metrics.
"""

from __future__ import annotations

import logging
import time

from kvfleet.agent.codecs import Codec, get_codec
from kvfleet.agent.tiers.base import TierStore
from kvfleet.agent.tiers.cost import CostModel, Decision
from kvfleet.agent.tiers.errors import TierIOError
from kvfleet.agent.tiers.index import BlockIndex
from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.record import BlockMeta
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSettings, TierSpec

log = logging.getLogger(__name__)

#: every tier, fastest first
ORDER = (Tier.GPU, Tier.CPU, Tier.SSD, Tier.REMOTE)
#: tiers held in memory (lost on restart; never drop blocks because a tier below fails)
MEMORY = (Tier.GPU, Tier.CPU)


def tier_specs(settings: TierSettings) -> dict[Tier, TierSpec]:
    return {Tier.GPU: settings.gpu, Tier.CPU: settings.cpu, Tier.SSD: settings.ssd,
            Tier.REMOTE: settings.remote}


def payload_nbytes(codec: Codec, meta: BlockMeta) -> int:
    """Encoded bytes of the block ``meta`` under ``codec``."""
    return codec.encoded_nbytes(meta.dtype, meta.shape) if meta.shape else meta.raw_nbytes


class TierPolicy:
    """Placement, watermarks, tier health and the promotion rule over the open ``stores``."""

    def __init__(
        self,
        settings: TierSettings,
        stores: dict[Tier, TierStore],
        codecs: dict[Tier, Codec],
        index: BlockIndex,
        metrics: TierMetrics,
        cost: CostModel,
    ) -> None:
        self.settings = settings
        self.stores = stores
        self.codecs = codecs
        self.index = index
        self.metrics = metrics
        #: the enabled tiers, fastest first
        self.order: tuple[Tier, ...] = tuple(t for t in ORDER if t in stores)
        self.cost = cost
        self._skip_until: dict[Tier, float] = dict.fromkeys(ORDER, 0.0)
        self._candidates: dict[Tier, list[Tier]] = {}

    # ------------------------------------------------------------ placement

    def put_candidates(self, tier: Tier) -> list[Tier]:
        """The enabled tiers a ``put`` into ``tier`` may use, in order (do not change the list)."""
        found = self._candidates.get(tier)
        if found is None:
            found = self._candidates[tier] = [t for t in self.order if t.rank >= tier.rank]
        return found

    @staticmethod
    def spill_target(candidates: list[Tier]) -> Tier | None:
        """Where a put goes when no memory tier among ``candidates`` has room: the first persistent one."""
        return next((t for t in candidates if t not in MEMORY), None)

    def memory_below(self, tier: Tier) -> list[Tier]:
        """Memory tiers below ``tier`` that are not failing (where a displaced block may go)."""
        return [t for t in self.order if t.rank > tier.rank and t in MEMORY and self.available(t)]

    def slow_target(self) -> Tier | None:
        """The first persistent tier that is not failing."""
        return next((t for t in self.order if t not in MEMORY and self.available(t)), None)

    def write_targets(self, dst: Tier) -> list[Tier]:
        """Persistent tiers at or below ``dst``, in order: a spilled write tries those :meth:`available`
        then."""
        return [t for t in self.order if t.rank >= dst.rank and t not in MEMORY]

    def demotion_targets(self, tier: Tier) -> tuple[list[Tier], bool]:
        """``(tiers to try, drop)`` for blocks leaving ``tier``.

        ``drop``: the last tier drops; so does a persistent tier whose lower tiers are all failing.
        Memory tiers never drop because of a failure downstream: they keep what they hold.
        """
        below = [t for t in self.order if t.rank > tier.rank]
        lower = [t for t in below if self.available(t)]
        return lower, not below or (not lower and tier not in MEMORY)

    def faster(self, tier: Tier) -> list[Tier]:
        """Enabled tiers above ``tier``, fastest first (promotion targets)."""
        return [t for t in self.order if t.rank < tier.rank]

    def persistent(self) -> list[Tier]:
        """Persistent tiers that are not failing (where ``close(flush=True)`` writes)."""
        return [t for t in self.order if t not in MEMORY and self.available(t)]

    # --------------------------------------------------------------- health

    def available(self, tier: Tier) -> bool:
        return time.monotonic() >= self._skip_until[tier]

    def io_failed(self, tier: Tier, exc: TierIOError) -> None:
        """Count a failure of ``tier`` and skip it for its ``retry_after_s`` (1 s when it has none)."""
        m = self.metrics
        m.child(m.errors, tier.value, exc.kind).inc()
        spec = tier_specs(self.settings)[tier]
        backoff = getattr(spec, "retry_after_s", 1.0)
        self._skip_until[tier] = time.monotonic() + backoff
        log.error("%s tier: %s; skipping it for %.1fs (blocks stay where they are)", tier, exc, backoff)

    # ----------------------------------------------------------- watermarks

    def over_high(self, tier: Tier) -> bool:
        """Whether ``tier`` holds more than its high watermark (caller holds the index lock)."""
        store = self.stores[tier]
        return self.index.used[tier] > store.spec.high_watermark * store.capacity_bytes

    def needs_demotion(self, tier: Tier) -> bool:
        """Above the high watermark with a block that can move (caller holds the index lock)."""
        if not self.over_high(tier):
            return False
        return any(self.index.movable(h) for h in self.index.lru[tier])

    def victims(self, tier: Tier) -> list[BlockHash]:
        """LRU movable blocks that bring ``tier`` down to its low watermark, a batch at most (caller holds the
        lock)."""
        if not self.over_high(tier):
            return []
        store = self.stores[tier]
        excess = self.index.used[tier] - store.spec.low_watermark * store.capacity_bytes
        out: list[BlockHash] = []
        for h in self.index.lru[tier]:
            if excess <= 0 or len(out) >= self.settings.migration_batch:
                break
            e = self.index.entries[h]
            if e.pins or e.moving:
                continue
            out.append(h)
            excess -= e.charge
        return out

    def victim(self, tier: Tier) -> BlockHash | None:
        """``tier``'s least recently used movable block, marked moving (caller holds the lock)."""
        victim = next((h for h in self.index.lru[tier] if self.index.movable(h)), None)
        if victim is not None:
            self.index.entries[victim].moving = True
        return victim

    # ------------------------------------------------------- promotion rule

    def decide(self, h: BlockHash) -> Decision | None:
        """The promotion rule for ``h`` where it is now (``None`` if absent or already fastest)."""
        with self.index.lock:
            e = self.index.entries.get(h)
            if e is None or e.tier == self.order[0]:
                return None
            src, meta = e.tier, e.meta
        dst = self.order[0]
        tokens = len(meta.token_ids) or self.cost.profile.block_size
        d = self.cost.decide(
            src, dst, tokens, payload_nbytes(self.codecs.get(src, get_codec(meta.codec)), meta),
            payload_nbytes(self.codecs[dst], meta)
        )
        m = self.metrics
        m.child(m.decisions, src.value, d.action.value).inc()
        for term, v in (("prefill", d.prefill_s), ("read", d.read_s), ("write", d.write_s)):
            m.child(m.decision_cost, src.value, term).set(v)
        return d


__all__ = ["MEMORY", "ORDER", "TierPolicy", "payload_nbytes", "tier_specs"]
