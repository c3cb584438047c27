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
from kvfleet.epp.scheduling.framework import Candidate

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
    ) -> tuple[list[Candidate], int]:
        """One candidate per pod, and the hot key their ``same_prefix`` counts (``hot``, else
        ``hot_key`` of the longest match among ``pods``). ``block_size``: the tokens of one of ``keys``'
        blocks (a pod's cache size is published in its engine's blocks)."""
        names = [p.name for p in pods]
        matches = self.index.match(keys, names, self.weights)
        if hot is None:
            hot = self.hot_key(keys, max((m.blocks for m in matches.values()), default=0), shard)
        out = []
        pms = [self.metrics.get(n) for n in names]
        held = [matches.get(n) for n in names]
        hits = [m.blocks if m else 0 for m in held]
        # what the index holds now, cut to what is expected to survive until the request runs; a pod with
        # lower tiers (the index holds blocks of it off the GPU) demotes what its GPU pushes out, and a
        # demoted block still hits: the sketch's GPU bound does not apply there (capacity 0: not cut)
        idx = self.index
        gpu = [idx.num_pod_gpu_keys(n) for n in names]  # also each candidate's held_blocks
        caps = [0 if idx.num_pod_keys(n) > g else gpu_capacity(pm, block_size) or 0
                for n, g, pm in zip(names, gpu, pms, strict=True)]
        kept = idx.reuse.fit(names, hits, caps, keys)
        # which of the scraped waiting requests are ours: count them at the scrape's instant, not now
        views = self.tracker.view(names, hot, [pm.scraped_at if pm is not None and pm.waiting > 0 else None
                                               for pm in pms])
        for p, pm, v, m, h, k, g in zip(pods, pms, views, held, hits, kept, gpu, strict=True):
            out.append(
                Candidate(
                    pod=p,
                    hit_blocks=k,
                    hit_weighted=(m.weighted if k == h else m.weighted * k / h) if m and h else 0.0,
                    spec_blocks=min(m.speculative, k) if m else 0,
                    inflight=v.inflight,
                    same_prefix=v.same_prefix,
                    pending_tokens=v.pending_tokens,
                    pending_requests=v.pending_requests,
                    pending_elapsed_s=v.pending_elapsed_s,
                    expected_wait_s=v.expected_wait_s,
                    held_blocks=g,
                    picked_blocks=m.picked if m else 0,
                    metrics=pm,
                    scrape_pending=v.scrape_pending,
                    busy_share=v.busy_share,
                )
            )
        return out, hot
