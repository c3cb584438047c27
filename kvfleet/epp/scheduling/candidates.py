"""Candidate building: what the picker knows about each pod for one request, in one place.

A :class:`~kvfleet.epp.scheduling.framework.Candidate` joins three sources for one pod:

* the global block index (:class:`~kvfleet.epp.index.BlockIndex`): the longest prefix of the request's keys
  the pod holds, weighted by tier (:func:`tier_weights`), and how much of it only the picker's speculative
  entries vouch for;
* the index's reuse sketch (:mod:`kvfleet.epp.reuse`): of the held prefix, what is expected to be still in
  the pod's cache when the request runs there (the queued requests' prefills may evict it first);
* the in-flight tracker (:class:`~kvfleet.epp.inflight.InflightTracker`): the picker's requests on the pod,
  those counted under the request's hot key (hot-spot decay), and the predicted prefill work still pending;
* the scraped model-server metrics (:class:`~kvfleet.epp.podmetrics.MetricsStore`), with the picker's pending
  requests at the scrape's instant so the queue scorer does not count its own requests twice.

The *hot key* (:func:`hotspot_key`) is the key of the longest prefix any candidate holds, else the shard key;
a P/D request's prefill cycle reuses the serving cycle's hot key (:meth:`CandidateBuilder.build` with
``hot``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfleet.cache import cost
from kvfleet.cache.tiers import Tier
from kvfleet.config.epp import CostModelSettings
from kvfleet.epp.datastore import Pod
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore, gpu_capacity
from kvfleet.epp.scheduling.framework import Candidates

#: ``(keys, longest held prefix in blocks, shard key) → hot key``
HotKey = Callable[[Sequence[int], int, int], int]


def tier_weights(model: CostModelSettings) -> list[float]:
    """weight(tier) = :func:`kvfleet.cache.cost.hit_value` of one token read from the tier against its prefill
    (``max(0, 1 − load_s_per_token / prefill_s_per_token)``), by ``Tier.rank``."""
    prefill = cost.prefill_s(1, model.prefill_tokens_per_s)
    gbps = {Tier.CPU: model.cpu_gbps, Tier.SSD: model.ssd_gbps, Tier.REMOTE: model.remote_gbps}
    out = [1.0] * len(Tier)
    for tier, bw in gbps.items():
        out[tier.rank] = cost.hit_value(prefill, cost.move_s(model.kv_bytes_per_token, bw * 1e9))
    return out


def hotspot_key(keys: Sequence[int], longest: int, shard: int) -> int:
    """The key a request is counted under for hot-spot decay: the key of the longest prefix
    (``longest`` blocks) any candidate holds, else the shard key. Requests damp each other only
    when they would hit the same cached prefix: a storm of one long prompt prefix is counted as
    one hot spot, while sessions of one application (one shard, each with its own history)
    are not counted against each other."""
    return keys[longest - 1] if 0 < longest <= len(keys) else shard


class CandidateBuilder:
    """One :class:`Candidate` per pod from the index, the in-flight tracker and the scraped metrics.

    ``hot_key`` chooses the hot key from the longest match (default :func:`hotspot_key`; the router passes
    its own, overridable :meth:`~kvfleet.epp.router.Router.hotspot_key`).
    """

    def __init__(
        self,
        index: BlockIndex,
        tracker: InflightTracker,
        metrics: MetricsStore,
        weights: Sequence[float],
        hot_key: HotKey = hotspot_key,
    ) -> None:
        self.index = index
        self.tracker = tracker
        self.metrics = metrics
        self.weights = list(weights)
        self.hot_key = hot_key

    def build(
        self, pods: Sequence[Pod], keys: Sequence[int], shard: int, hot: int | None = None,
        block_size: int = 16,
    ) -> tuple[Candidates, int]:
        """One candidate per pod (as columns: :class:`~kvfleet.epp.scheduling.framework.Candidates`), and
        the hot key their ``same_prefix`` counts (``hot``, else ``hot_key`` of the longest match among
        ``pods``). ``block_size``: the tokens of one of ``keys``' blocks (a pod's cache size is published in
        its engine's blocks)."""
        names = [p.name for p in pods]
        idx = self.index
        blocks, weighted, spec, picked = idx.match_lists(keys, names, self.weights)
        if hot is None:
            hot = self.hot_key(keys, max(blocks, default=0), shard)
        pms = self.metrics.get_many(names)
        # what the index holds now, cut to what is expected to survive until the request runs; a pod with
        # lower tiers (the index holds blocks of it off the GPU) demotes what its GPU pushes out, and a
        # demoted block still hits: the sketch's GPU bound does not apply there (capacity 0: not cut)
        held, gpu = idx.pod_key_counts(names)  # gpu: also each candidate's held_blocks
        capacity = [gpu_capacity(pm, block_size) for pm in pms]
        caps = [0 if a > g else c or 0 for a, g, c in zip(held, gpu, capacity, strict=True)]
        kept = idx.reuse.fit(names, blocks, caps, keys)
        # which of the scraped waiting requests are ours: count them at the scrape's instant, not now
        views = self.tracker.view(names, hot, [pm.scraped_at if pm is not None and pm.waiting > 0 else None
                                               for pm in pms])
        if views:
            (inflight, ptokens, prequests, same, elapsed, expected, scraped, busy, arrivals,
             rate) = zip(*views, strict=True)
        else:
            inflight = ptokens = prequests = same = elapsed = expected = scraped = busy = arrivals = rate = ()
        # the hit cut to what is kept, its tier-weighted value cut in proportion, the speculative part with it
        hit_weighted = [(x if k == h else x * k / h) if h else 0.0
                        for h, x, k in zip(blocks, weighted, kept, strict=True)]
        spec_kept = [sp if sp < k else k for sp, k in zip(spec, kept, strict=True)]
        return Candidates((pods, kept, hit_weighted, spec_kept, inflight, same, ptokens, prequests, elapsed,
                           expected, gpu, picked, busy, pms, scraped, arrivals, rate), names,
                          (block_size, capacity)), hot
