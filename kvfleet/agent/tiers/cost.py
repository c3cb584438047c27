"""The promotion rule of the seeds (chapter 2.3) for the agent's tiers: move a slow-tier hit up only when it
pays.

The rule itself is :mod:`kvfleet.cache.cost` (one definition for every part); this module prices the tiers.

For a block of ``t`` tokens found in tier ``slow`` (``n_slow`` encoded bytes)
whose promotion target is ``fast`` (``n_fast`` bytes after its codec)::

    prefill  = t / prefill_tokens_per_s                     (model profile)
    read     = latency(slow) + n_slow / read_bw(slow)
    write    = latency(fast) + n_fast / write_bw(fast)

    prefill > read + write   → PROMOTE         (read it, keep it in the fast tier)
    prefill > read           → SERVE_IN_PLACE  (read it, leave it where it is)
    otherwise                → RECOMPUTE       (cheaper to prefill again: report a miss)

Bandwidths and latencies come from the tier spec when set (> 0), else from
a start-up calibration of each store (:meth:`TierStore.probe`), else from
:data:`~kvfleet.config.tiers.NOMINAL_COSTS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvfleet.agent.tiers.base import TierStore
from kvfleet.agent.tiers.errors import TierError
from kvfleet.cache import cost
from kvfleet.cache.cost import Action as Action
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import NOMINAL_COSTS, ModelProfile, TierSpec

log = logging.getLogger(__name__)




@dataclass(frozen=True)
class TierCost:
    """Bandwidth (bytes/s) and per-operation latency (s) of one tier."""

    read_bps: float = 1e9
    write_bps: float = 1e9
    latency_s: float = 1e-6
    source: str = "nominal"

    def read_s(self, nbytes: int) -> float:
        return cost.move_s(nbytes, self.read_bps, self.latency_s)

    def write_s(self, nbytes: int) -> float:
        return cost.move_s(nbytes, self.write_bps, self.latency_s)


@dataclass(frozen=True)
class Decision:
    """A promotion decision with the inputs it was made from (exported as metrics)."""

    action: Action
    src: Tier
    dst: Tier
    prefill_s: float
    read_s: float
    write_s: float


def tier_cost(tier: Tier, spec: TierSpec, store: TierStore | None, calibrate: bool,
              probe_bytes: int) -> TierCost:
    """Configured values win, then a calibration probe, then the nominal figures."""
    nom_r, nom_w, nom_lat = NOMINAL_COSTS[tier.value]
    read, write, lat, source = nom_r * 1e9, nom_w * 1e9, nom_lat * 1e-6, "nominal"
    if calibrate and store is not None:
        try:
            read, write, lat = store.probe(probe_bytes)
            source = "calibrated"
        except TierError as exc:
            log.warning("%s tier: calibration failed (%s); using nominal costs", tier, exc)
    if spec.read_gbps > 0:
        read, source = spec.read_gbps * 1e9, "configured"
    if spec.write_gbps > 0:
        write, source = spec.write_gbps * 1e9, "configured"
    if spec.latency_us >= 0:
        lat, source = spec.latency_us * 1e-6, "configured"
    return TierCost(read_bps=read, write_bps=write, latency_s=lat, source=source)


class CostModel:
    """The model profile plus one :class:`TierCost` per tier."""

    def __init__(self, profile: ModelProfile, costs: dict[Tier, TierCost]) -> None:
        self.profile = profile
        self.costs = dict(costs)

    def prefill_s(self, tokens: int) -> float:
        return cost.prefill_s(tokens, self.profile.prefill_tokens_per_s)

    def decide(self, src: Tier, dst: Tier, tokens: int, src_nbytes: int, dst_nbytes: int) -> Decision:
        prefill = self.prefill_s(tokens)
        read = self.costs[src].read_s(src_nbytes)
        write = self.costs[dst].write_s(dst_nbytes)
        action = cost.promotion(prefill, read, write)
        return Decision(action=action, src=src, dst=dst, prefill_s=prefill, read_s=read, write_s=write)
