"""The read path: a parsed request → block keys → pool (level 1) → pod(s) (level 2).

1. tokenize (byte-level or HF) and key the prompt's full blocks with the core's
   chained hash (``cache_salt`` → the extra key ``(salt,)`` of block 0, exactly
   as vLLM and the engine simulator key it: :func:`~kvfleet.cache.tokens.salt_extra_keys`);
2. level 1: rank the pools serving the model by weighted rendezvous hashing of
   the first ``prefix_shard_blocks`` keys; spill to the next pool while the
   ranked one is saturated (every ready pod waits ≥ ``pool_saturation_queue``);
3. level 2: look the keys up in the global index, build one candidate per pod
   and run the scheduling profile; P/D pools pick a decode pod, and a prefill
   pod only when the uncached part is at least ``pd_min_uncached_tokens``; with
   a prefill pod the predicted hit is the prefill pod's (it computes the prompt,
   and the engine reports its ``cached_tokens``), else the serving pod's;
4. record the pick: a speculative index entry on the chosen pod(s) (until the
   pod's events confirm it, or ``speculative_ttl_s`` after its first token) and
   an in-flight ticket (load, hot-spot decay, pending prefill work).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.tiers import Tier
from kvfleet.cache.tokens import salt_extra_keys
from kvfleet.config.cache import CacheSettings
from kvfleet.config.epp import CostModelSettings, EppSettings
from kvfleet.epp.datastore import Datastore, Pod, Pool
from kvfleet.epp.errors import NoEndpointError, SheddingError, UnknownModelError
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker, Ticket
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.scheduling import Candidate, Profile, SchedulingRequest, rendezvous_rank
from kvfleet.epp.scheduling.plugins import waiting_of
from kvfleet.epp.tokenize import Tokenizer


def tier_weights(cost: CostModelSettings) -> list[float]:
    """weight(tier) = max(0, 1 − load_s_per_token / prefill_s_per_token), by ``Tier.rank``."""
    prefill = 1.0 / cost.prefill_tokens_per_s
    gbps = {Tier.CPU: cost.cpu_gbps, Tier.SSD: cost.ssd_gbps, Tier.REMOTE: cost.remote_gbps}
    out = [1.0] * len(Tier)
    for tier, bw in gbps.items():
        load = cost.kv_bytes_per_token / (bw * 1e9)
        out[tier.rank] = max(0.0, 1.0 - load / prefill)
    return out


@dataclass(frozen=True)
class Decision:
    """The routing result: ``endpoints`` (pick first, then fallbacks), optional prefill pod."""

    endpoints: tuple[str, ...] = ()
    pod: str = ""
    pool: str = ""
    prefiller: str | None = None
    num_tokens: int = 0
    predicted_hit_tokens: int = 0
    scores: tuple[float, ...] = ()
    #: every serving candidate's (name, hit blocks, of which speculative, engine-reported waiting or −1 when
    #: stale, the picker's pending requests) at the pick: the decision log's evidence
    hits: tuple[tuple[str, int, int, float, int], ...] = ()
    ticket: Ticket | None = field(default=None, compare=False)


class Router:
    """Routes requests over a datastore with a block index, metrics and the picker's own accounting."""

    def __init__(
        self,
        settings: EppSettings,
        cache: CacheSettings,
        datastore: Datastore,
        index: BlockIndex,
        metrics: MetricsStore,
        tokenizer: Tokenizer,
        tracker: InflightTracker | None = None,
    ) -> None:
        self.settings = settings
        self.hasher = BlockHasher(cache.block_size, cache.hash_algo, cache.hash_seed)
        self.datastore = datastore
        self.index = index
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.tracker = tracker or InflightTracker()
        self.profile = Profile(settings.plugins)
        self.tier_weights = tier_weights(settings.cost)
        self.prefill_s_per_token = 1.0 / settings.cost.prefill_tokens_per_s
        self._lock = threading.Lock()

    def tokens_of(self, req: InferenceRequest) -> np.ndarray:
        if req.prompt_token_ids is not None:
            return np.asarray(req.prompt_token_ids, dtype=np.uint32)
        return self.tokenizer.encode(req.prompt or "")

    def keys_of(self, tokens: np.ndarray, cache_salt: str | None) -> list[int]:
        return hashes_as_ints(self.hasher.hash_tokens(tokens, extra_keys=salt_extra_keys(cache_salt)))

    def route(self, req: InferenceRequest, subset: Sequence[str] | None = None) -> Decision:
        pools = [p for p in self.datastore.pools() if req.model in p.models or "*" in p.models]
        if not pools:
            raise UnknownModelError(f"no pool serves model {req.model!r}")
        tokens = self.tokens_of(req)
        keys = self.keys_of(tokens, req.cache_salt)
        return self.route_keys(req.model, keys, len(tokens), pools, subset, tail=tokens)

    def route_keys(
        self,
        model: str,
        keys: Sequence[int],
        num_tokens: int,
        pools: Sequence[Pool] | None = None,
        subset: Sequence[str] | None = None,
        tail: np.ndarray | None = None,
    ) -> Decision:
        """Steps 2–4 for a request already keyed: ``keys`` of its full blocks, ``num_tokens`` in all.

        ``pools`` defaults to those serving ``model``; ``tail`` (the token ids) shards a prompt shorter
        than one block. The routing simulation (``bench.routing``) drives this with trace block ids.
        """
        if pools is None:
            pools = [p for p in self.datastore.pools() if model in p.models or "*" in p.models]
            if not pools:
                raise UnknownModelError(f"no pool serves model {model!r}")
        k = min(self.settings.prefix_shard_blocks, len(keys))
        shard = keys[k - 1] if k else xxhash.xxh3_64_intdigest(b"" if tail is None else tail.tobytes())
        sreq = SchedulingRequest(
            num_tokens=num_tokens,
            block_size=self.hasher.block_size,
            prefill_s_per_token=self.prefill_s_per_token,
            hotspot_beta=self.settings.hotspot_beta,
            shard=shard,
        )
        allowed = set(subset) if subset is not None else None
        groups = self._pools(model, shard, pools, allowed)
        home = {p.name: (pool, pods) for pool, pods in groups for p in pods}
        serving = [p for pool, pods, disagg in ((g, ps, g.disaggregated) for g, ps in groups) for p in pods
                   if not disagg or p.role in ("both", "decode")]
        with self._lock:
            cands = self._candidates(serving, keys, shard)
            if self.settings.shed_queue > 0 and all(waiting_of(c) >= self.settings.shed_queue for c in cands):
                raise SheddingError(f"every pod of pool {groups[0][0].name!r} is above the shedding threshold")
            ranked = self.profile.run(sreq, cands)
            if not ranked.pods:
                raise NoEndpointError(f"no endpoint of pool {groups[0][0].name!r} passed the filters")
            best = ranked.pods[0]
            pool, pods = home[best.name]
            disagg = pool.disaggregated
            hit_tokens = min(num_tokens, best.hit_blocks * self.hasher.block_size)
            uncached = num_tokens - hit_tokens
            prefiller: Pod | None = None
            if disagg and uncached >= self.settings.pd_min_uncached_tokens:
                pre = [p for p in pods if p.role in ("both", "prefill") and p.name != best.name]
                if pre:
                    pranked = self.profile.run(sreq, self._candidates(pre, keys, shard))
                    if pranked.pods:
                        prefiller = pranked.pods[0].pod
                        # The prefill pod computes the prompt and its cache is what the engine reports as
                        # cached_tokens: predict (and account pending work) from it, like with like.
                        hit_tokens = min(num_tokens, pranked.pods[0].hit_blocks * self.hasher.block_size)
                        uncached = num_tokens - hit_tokens
            picked = (best.name,) if prefiller is None else (best.name, prefiller.name)
            ttl = self.settings.speculative_ttl_s if self.settings.events_enabled else self.settings.approximate_ttl_s

            leases = [self.index.add_speculative(name, keys, self.tracker.max_age_s) for name in picked]

            def refresh() -> None:  # the TTL counts from the first token: a long queue must not expire the entry
                for lease in leases:
                    self.index.extend(lease, ttl)

            ticket = self.tracker.open(picked, shard, float(uncached), on_first_byte=refresh)
        return Decision(
            endpoints=tuple(c.pod.endpoint for c in ranked.pods),
            pod=best.name,
            pool=pool.name,
            prefiller=None if prefiller is None else prefiller.endpoint,
            num_tokens=num_tokens,
            predicted_hit_tokens=hit_tokens,
            scores=ranked.scores,
            hits=tuple(
                (c.name, c.hit_blocks, c.spec_blocks, -1.0 if c.metrics is None else c.metrics.waiting, c.pending_requests)
                for c in cands
            ),
            ticket=ticket,
        )

    def _pools(
        self, model: str, shard: int, pools: Sequence[Pool], allowed: set[str] | None
    ) -> list[tuple[Pool, list[Pod]]]:
        """Level 1: the one pool the prefix shard picks (spilling past saturated pools), or, with
        ``prefix_shard_pools: false``, every pool with a ready pod (one flat scheduling cycle)."""
        ready: list[tuple[Pool, list[Pod]]] = []
        for pool in rendezvous_rank(shard, pools) if self.settings.prefix_shard_pools else pools:
            pods = [p for p in pool.pods if p.ready and (allowed is None or p.endpoint in allowed)]
            if pods:
                ready.append((pool, pods))
        if not ready:
            raise NoEndpointError(f"no ready endpoint for model {model!r}")
        if not self.settings.prefix_shard_pools or len(ready) == 1:  # one pool: nowhere to spill
            return ready
        for pool, pods in ready:
            if min(self._waiting(p) for p in pods) < self.settings.pool_saturation_queue:
                return [(pool, pods)]
        return [ready[0]]

    def _waiting(self, pod: Pod) -> float:
        m = self.metrics.get(pod.name)
        _, _, pending = self.tracker.load(pod.name)
        return max(m.waiting, pending) if m is not None else float(pending)

    def _candidates(self, pods: Sequence[Pod], keys: Sequence[int], shard: int) -> list[Candidate]:
        matches = self.index.match(keys, [p.name for p in pods], self.tier_weights)
        out = []
        for p in pods:
            m = matches.get(p.name)
            inflight, pending_tokens, pending_requests = self.tracker.load(p.name)
            pm = self.metrics.get(p.name)
            # which of the scraped waiting requests are ours: count them at the scrape's instant, not now
            scrape_pending = self.tracker.pending_at(p.name, pm.scraped_at) if pm is not None and pm.waiting > 0 else None
            out.append(
                Candidate(
                    pod=p,
                    hit_blocks=m.blocks if m else 0,
                    hit_weighted=m.weighted if m else 0.0,
                    spec_blocks=m.speculative if m else 0,
                    inflight=inflight,
                    same_prefix=self.tracker.same_prefix(p.name, shard),
                    pending_tokens=pending_tokens,
                    pending_requests=pending_requests,
                    metrics=pm,
                    scrape_pending=scrape_pending,
                )
            )
        return out
