"""The scheduler: one request's scheduling cycles over the candidates request control hands it.

What GIE's ``pkg/epp/scheduling/scheduler.go`` does with its profiles, for kvfleet's pools:

1. the serving cycle: the pool's scheduling profile (:meth:`Scheduler.profile_for`: the configured plugins
   with the pool's ``prefix``/``load`` routing weights applied) runs over the serving candidates (every
   ready pod of the chosen shard(s), decode and unified pods only in a P/D shard: :func:`serving_pods`);
   the picker's first pod is the pick, the rest are fallbacks;
2. the P/D second cycle: when the pick's shard is disaggregated and the uncached part of the prompt is at
   least ``pd_min_uncached_tokens``, the same profile runs over that shard's prefill (and unified) pods
   other than the pick, built with the serving cycle's hot key; its first pod computes the prompt;
3. the prediction: the cached tokens are the prefill pod's match when there is one (it computes the prompt
   and the engine reports its ``cached_tokens``), else the pick's.

It builds no request state: no index entries, no tickets (request control's PreRequest steps,
:mod:`kvfleet.epp.requestcontrol.director`). The one side effect is the profile's own ``pre_request`` hooks
(the GIE prefix scorer's LRU), as in GIE, where the prefix plugin hears of each profile's pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.config.epp import EppSettings, PluginSpec
from kvfleet.epp.datastore import Pod, Pool, PoolCache
from kvfleet.epp.scheduling.candidates import CandidateBuilder
from kvfleet.epp.scheduling.framework import Candidate, SchedulingRequest
from kvfleet.epp.scheduling.profile import Profile, Ranked

#: scorers whose weight a pool's ``routing.weights.prefix`` scales, and those ``load`` scales
PREFIX_SCORERS = frozenset({"prefix-cache-scorer", "prefix-affinity-scorer", "eviction-cost-scorer",
                            "recompute-load-scorer", "copy-value-scorer"})
LOAD_SCORERS = frozenset({"queue-scorer", "kv-cache-utilization-scorer", "least-inflight-scorer"})

#: a shard (pod subset) and its ready pods, as level 1 hands them to scheduling
Group = tuple[Pool, list[Pod]]


def serving_pods(groups: Sequence[Group]) -> list[Pod]:
    """The pods a request can be sent to: every ready pod, except the prefill-only pods of a P/D shard."""
    out: list[Pod] = []
    for g, pods in groups:  # a group's roles once, not once per pod
        out.extend([p for p in pods if p.role in ("both", "decode")] if g.disaggregated else pods)
    return out


@dataclass(frozen=True)
class SchedulingResult:
    """The cycles' outcome: the serving cycle's order (pick first, then fallbacks) with its scores,
    the prefill pod of a P/D pick, and the predicted cached and uncached tokens."""

    ranked: Ranked
    prefiller: Pod | None = None
    hit_tokens: int = 0
    uncached: int = 0

    @property
    def pick(self) -> Candidate:
        return self.ranked.pods[0]


class Scheduler:
    """Runs the scheduling profile (and the P/D second cycle) over candidates; owns the profiles."""

    def __init__(self, settings: EppSettings, candidates: CandidateBuilder) -> None:
        self.settings = settings
        self.candidates = candidates
        self.profile = Profile(settings.plugins)
        self._profiles: dict[tuple[float, float], Profile] = {(1.0, 1.0): self.profile}

    def profile_for(self, cache: PoolCache) -> Profile:
        """The scheduling profile with the pool's routing weights applied (prefix and load scorers scaled)."""
        key = (cache.prefix_weight, cache.load_weight)
        prof = self._profiles.get(key)
        if prof is None:
            scaled = []
            for p in self.settings.plugins:
                factor = (cache.prefix_weight if p.type in PREFIX_SCORERS
                          else cache.load_weight if p.type in LOAD_SCORERS else 1.0)
                scaled.append(PluginSpec(type=p.type, weight=p.weight * factor, params=dict(p.params)))
            prof = self._profiles[key] = Profile(tuple(scaled))
        return prof

    def schedule(
        self,
        req: SchedulingRequest,
        profile: Profile,
        cands: Sequence[Candidate],
        groups: Sequence[Group],
        keys: Sequence[int],
        hot: int,
    ) -> SchedulingResult | None:
        """The serving cycle over ``cands`` (built from :func:`serving_pods` of ``groups``), then the P/D
        cycle in the pick's group; ``None`` when the filters leave no pod. ``keys`` and ``hot`` build the
        prefill candidates (same request, same hot key)."""
        ranked = profile.run(req, cands)
        if not ranked.pods:
            return None
        best = ranked.pods[0]
        # the pick's group (the last one naming it); one group is the common case: no search
        name = best.name
        group, pods = groups[0] if len(groups) == 1 else next(
            (g, ps) for g, ps in reversed(groups) if any(p.name == name for p in ps))
        hit_tokens = min(req.num_tokens, best.hit_blocks * req.block_size)
        uncached = req.num_tokens - hit_tokens
        prefiller: Pod | None = None
        if group.disaggregated and uncached >= self.settings.pd_min_uncached_tokens:
            pre = [p for p in pods if p.role in ("both", "prefill") and p.name != best.name]
            if pre:
                built = self.candidates.build(pre, keys, req.shard, hot, req.block_size)[0]
                pranked = profile.run(req, built)
                if pranked.pods:
                    prefiller = pranked.pods[0].pod
                    # The prefill pod computes the prompt and its cache is what the engine reports as
                    # cached_tokens: predict (and account pending work) from it, like with like.
                    hit_tokens = min(req.num_tokens, pranked.pods[0].hit_blocks * req.block_size)
                    uncached = req.num_tokens - hit_tokens
        return SchedulingResult(ranked=ranked, prefiller=prefiller, hit_tokens=hit_tokens, uncached=uncached)
