"""The read path: a parsed request → block keys → pool (level 1) → pod(s) (level 2).

1. tokenize (byte-level or HF) and key the prompt's full blocks with the core's
   chained hash (``cache_salt`` → the extra key ``(salt,)`` of block 0, exactly
   as vLLM and the engine simulator key it: :func:`~kvfleet.cache.tokens.salt_extra_keys`);
2. the invoked pool: the one InferencePool serving the model (or, with a
   subset hint, the pool holding those endpoints; several pools serving one model
   are ranked by rendezvous hashing of the shard key). Every endpoint returned,
   pick and fallbacks, belongs to that one pool (GIE v1.6);
   level 1: rank the pool's prefix shards (pod subsets, label ``kvfleet.io/shard``)
   by weighted rendezvous hashing of the first ``prefix_shard_blocks`` keys; spill
   to the next shard while the ranked one is saturated (every ready pod waits
   ≥ ``pool_saturation_queue``);
3. level 2: look the keys up in the global index, build one candidate per pod
   and run the scheduling profile; P/D pools pick a decode pod, and a prefill
   pod only when the uncached part is at least ``pd_min_uncached_tokens``; with
   a prefill pod the predicted hit is the prefill pod's (it computes the prompt,
   and the engine reports its ``cached_tokens``), else the serving pod's;
4. record the pick: a speculative index entry on the chosen pod(s) (until the
   pod's events confirm it, or ``speculative_ttl_s`` after its first token) and
   an in-flight ticket (load, hot-spot decay, pending prefill work); the ticket
   counts for hot-spot decay under the request's *hot key* (:meth:`Router.hotspot_key`:
   the key of the longest prefix any candidate holds), so requests damp each other
   only when they would hit the same cached prefix, not merely share a shard;
5. when the gateway reports that another endpoint of the list served the request
   (a fallback), :meth:`Decision.served` moves the ticket and the speculative entry there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvfleet.cache import cost
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.tiers import Tier
from kvfleet.cache.tokens import salt_extra_keys
from kvfleet.config.cache import CacheSettings
from kvfleet.config.epp import CostModelSettings, EppSettings, PluginSpec
from kvfleet.epp.datastore import Datastore, Pod, Pool, PoolCache
from kvfleet.epp.errors import NoEndpointError, SheddingError, UnknownModelError
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker, Ticket
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.scheduling import Candidate, Profile, SchedulingRequest, rendezvous_rank
from kvfleet.epp.scheduling.plugins import waiting_of
from kvfleet.epp.tokenize import Tokenizer

#: scorers whose weight a pool's ``routing.weights.prefix`` scales, and those ``load`` scales
PREFIX_SCORERS = frozenset({"prefix-cache-scorer", "prefix-affinity-scorer"})
LOAD_SCORERS = frozenset({"queue-scorer", "kv-cache-utilization-scorer", "least-inflight-scorer"})


def tier_weights(model: CostModelSettings) -> list[float]:
    """weight(tier) = :func:`kvfleet.cache.cost.hit_value` of one token read from the tier against its prefill
    (``max(0, 1 − load_s_per_token / prefill_s_per_token)``), by ``Tier.rank``."""
    prefill = cost.prefill_s(1, model.prefill_tokens_per_s)
    gbps = {Tier.CPU: model.cpu_gbps, Tier.SSD: model.ssd_gbps, Tier.REMOTE: model.remote_gbps}
    out = [1.0] * len(Tier)
    for tier, bw in gbps.items():
        out[tier.rank] = cost.hit_value(prefill, cost.move_s(model.kv_bytes_per_token, bw * 1e9))
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
    #: the prefix shard (pod subset of ``pool``) level 1 chose; "" when the pool has one
    shard: str = ""
    #: the pool's block size (tokens), which ``predicted_hit_tokens`` counts in
    block_size: int = 16
    on_served: Callable[[str], bool] | None = field(default=None, compare=False)

    def served(self, endpoint: str) -> bool:
        """The gateway says ``endpoint`` served the request; ``True`` if that moved the accounting
        off the pick (a fallback served it)."""
        if self.on_served is None or not self.endpoints or endpoint == self.endpoints[0]:
            return False
        return self.on_served(endpoint)


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
        self._cache = cache
        self._hashers: dict[tuple[int, str, str], BlockHasher] = {
            (cache.block_size, cache.hash_algo, cache.hash_seed): self.hasher}
        self._profiles: dict[tuple[float, float], Profile] = {(1.0, 1.0): self.profile}
        self.tier_weights = tier_weights(settings.cost)
        self.prefill_s_per_token = 1.0 / settings.cost.prefill_tokens_per_s
        self._lock = threading.Lock()

    def tokens_of(self, req: InferenceRequest) -> np.ndarray:
        if req.prompt_token_ids is not None:
            return np.asarray(req.prompt_token_ids, dtype=np.uint32)
        return self.tokenizer.encode(req.prompt or "")

    def hasher_for(self, pool: Pool | None) -> BlockHasher:
        """The block hasher of ``pool``'s engines: its block size, algorithm and seed, else the picker's."""
        if pool is None:
            return self.hasher
        c, d = pool.cache, self._cache
        key = (c.block_size or d.block_size, c.hash_algo or d.hash_algo, c.hash_seed or d.hash_seed)
        h = self._hashers.get(key)
        if h is None:
            h = self._hashers[key] = BlockHasher(*key)
        return h

    def profile_for(self, cache: PoolCache) -> Profile:
        """The scheduling profile with the pool's routing weights applied (prefix and load scorers scaled)."""
        key = (cache.prefix_weight, cache.load_weight)
        prof = self._profiles.get(key)
        if prof is None:
            scaled = []
            for p in self.settings.plugins:
                factor = cache.prefix_weight if p.type in PREFIX_SCORERS else cache.load_weight if p.type in LOAD_SCORERS else 1.0
                scaled.append(PluginSpec(type=p.type, weight=p.weight * factor, params=dict(p.params)))
            prof = self._profiles[key] = Profile(tuple(scaled))
        return prof

    def keys_of(self, tokens: np.ndarray, cache_salt: str | None, pool: Pool | None = None) -> list[int]:
        hasher = self.hasher_for(pool)
        return hashes_as_ints(hasher.hash_tokens(tokens, extra_keys=salt_extra_keys(cache_salt)))

    def serving_pools(self, model: str) -> list[Pool]:
        """The pools serving ``model`` (a pool without models serves every model)."""
        return [p for p in self.datastore.pools() if model in p.models or "*" in p.models]

    def route(self, req: InferenceRequest, subset: Sequence[str] | None = None) -> Decision:
        pools = self.serving_pools(req.model)
        if not pools:
            raise UnknownModelError(f"no pool serves model {req.model!r}")
        tokens = self.tokens_of(req)
        pool = pools[0]
        if len(pools) > 1 or subset is not None:  # the pool first: its engines decide how blocks are keyed
            head = tokens[: self.settings.prefix_shard_blocks * self.hasher.block_size]
            allowed = None if subset is None else set(subset)
            pool = self._invoked_pool(req.model, xxhash.xxh3_64_intdigest(head.tobytes()), pools, allowed)
        keys = self.keys_of(tokens, req.cache_salt, pool)
        return self.route_keys(req.model, keys, len(tokens), [pool], subset, tail=tokens)

    def route_any(self, model: str | None, subset: Sequence[str] | None = None) -> Decision:
        """A request that is not an inference (``/tokenize``, ``/health``...): the least-loaded ready pod
        of the invoked pool (of ``model``'s pool when the body names one). Counted in flight, no cache state."""
        pools = self.serving_pools(model) if model else sorted(self.datastore.pools(), key=lambda p: p.name)
        if not pools:
            raise UnknownModelError(f"no pool serves model {model!r}")
        pool = self._invoked_pool(model or "", 0, pools, None if subset is None else set(subset))
        pods = [p for p in pool.pods if self._up(p) and (subset is None or p.endpoint in subset)]
        if not pods:
            raise NoEndpointError(f"no ready endpoint in pool {pool.name!r}")
        best = min(pods, key=lambda p: (self._waiting(p), self.tracker.load(p.name)[0], p.name))
        ticket = self.tracker.open((best.name,), 0, 0.0)
        return Decision(endpoints=(best.endpoint,), pod=best.name, pool=pool.name, shard=best.shard, ticket=ticket)

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
            pools = self.serving_pools(model)
            if not pools:
                raise UnknownModelError(f"no pool serves model {model!r}")
        k = min(self.settings.prefix_shard_blocks, len(keys))
        shard = keys[k - 1] if k else xxhash.xxh3_64_intdigest(b"" if tail is None else tail.tobytes())
        allowed = set(subset) if subset is not None else None
        invoked = self._invoked_pool(model, shard, pools, allowed)
        block_size = self.hasher_for(invoked).block_size
        beta = invoked.cache.hotspot_decay
        sreq = SchedulingRequest(
            num_tokens=num_tokens,
            block_size=block_size,
            prefill_s_per_token=self.prefill_s_per_token,
            hotspot_beta=self.settings.hotspot_beta if beta is None else beta,
            shard=shard,
        )
        profile = self.profile_for(invoked.cache)
        groups = self._shards(model, shard, invoked, allowed)
        home = {p.name: (g, pods) for g, pods in groups for p in pods}
        serving = [p for g, pods in groups for p in pods if not g.disaggregated or p.role in ("both", "decode")]
        with self._lock:
            cands, hot = self._candidates(serving, keys, shard)
            if self.settings.shed_queue > 0 and all(waiting_of(c) >= self.settings.shed_queue for c in cands):
                raise SheddingError(f"every pod of pool {invoked.name!r} is above the shedding threshold")
            ranked = profile.run(sreq, cands)
            if not ranked.pods:
                raise NoEndpointError(f"no endpoint of pool {invoked.name!r} passed the filters")
            best = ranked.pods[0]
            group, pods = home[best.name]
            disagg = group.disaggregated
            hit_tokens = min(num_tokens, best.hit_blocks * block_size)
            uncached = num_tokens - hit_tokens
            prefiller: Pod | None = None
            if disagg and uncached >= self.settings.pd_min_uncached_tokens:
                pre = [p for p in pods if p.role in ("both", "prefill") and p.name != best.name]
                if pre:
                    pranked = profile.run(sreq, self._candidates(pre, keys, shard, hot)[0])
                    if pranked.pods:
                        prefiller = pranked.pods[0].pod
                        # The prefill pod computes the prompt and its cache is what the engine reports as
                        # cached_tokens: predict (and account pending work) from it, like with like.
                        hit_tokens = min(num_tokens, pranked.pods[0].hit_blocks * block_size)
                        uncached = num_tokens - hit_tokens
            picked = (best.name,) if prefiller is None else (best.name, prefiller.name)
            ttl = {best.name: self.pick_ttl(best.pod)}
            if prefiller is not None:
                ttl[prefiller.name] = self.pick_ttl(prefiller)

            leases = {name: self.index.add_speculative(name, keys, self.tracker.max_age_s) for name in picked}

            def refresh() -> None:  # the TTL counts from the first token: a long queue must not expire the entry
                for name, lease in leases.items():
                    self.index.extend(lease, ttl.get(name, self.settings.speculative_ttl_s))

            ticket = self.tracker.open(picked, hot, float(uncached), on_first_byte=refresh)
        by_endpoint = {c.pod.endpoint: c.pod for c in ranked.pods}

        def served(endpoint: str) -> bool:
            """A fallback served the request: its pod, not the pick, holds the prefix and carries the load."""
            pod = by_endpoint.get(endpoint)
            if pod is None or pod.name in leases:
                return False
            leases[best.name].expiry = 0.0
            leases[pod.name] = self.index.add_speculative(pod.name, keys, self.tracker.max_age_s)
            ttl[pod.name] = self.pick_ttl(pod)
            self.tracker.move(ticket, best.name, pod.name)
            return True

        return Decision(
            endpoints=tuple(c.pod.endpoint for c in ranked.pods),
            pod=best.name,
            pool=invoked.name,
            prefiller=None if prefiller is None else prefiller.endpoint,
            num_tokens=num_tokens,
            predicted_hit_tokens=hit_tokens,
            scores=ranked.scores,
            hits=tuple(
                (c.name, c.hit_blocks, c.spec_blocks, -1.0 if c.metrics is None else c.metrics.waiting, c.pending_requests)
                for c in cands
            ),
            ticket=ticket,
            shard=best.pod.shard,
            block_size=block_size,
            on_served=served,
        )

    def _invoked_pool(self, model: str, shard: int, pools: Sequence[Pool], allowed: set[str] | None) -> Pool:
        """The one pool this request is routed in: with a subset hint, the pool holding the hinted
        endpoints; else the only pool serving the model, or (several) the first of the rendezvous
        ranking that has a ready pod. Endpoints of two pools are never mixed in one answer."""
        if allowed is not None:
            pools = [p for p in pools if any(pod.endpoint in allowed for pod in p.pods)]
            if not pools:
                raise NoEndpointError("no endpoint of the subset hint belongs to a pool serving the model")
        if len(pools) == 1:
            return pools[0]
        ranked = rendezvous_rank(shard, pools)
        for pool in ranked:
            if any(self._up(p) and (allowed is None or p.endpoint in allowed) for p in pool.pods):
                return pool
        raise NoEndpointError(f"no ready endpoint for model {model!r}")

    def _shards(self, model: str, shard: int, pool: Pool, allowed: set[str] | None) -> list[tuple[Pool, list[Pod]]]:
        """Level 1 inside the invoked pool: the prefix shard (pod subset) the shard key picks, spilling
        past saturated shards, or, with ``prefix_shard_pools: false``, every shard with a ready pod (one
        flat scheduling cycle: what a plain load balancer does, the baselines)."""
        by_shard: dict[str, list[Pod]] = {}
        for p in pool.pods:
            by_shard.setdefault(p.shard, []).append(p)
        groups = [Pool(name=f"{pool.name}/{k}" if k else pool.name, models=pool.models, pods=tuple(v))
                  for k, v in sorted(by_shard.items())]
        ready: list[tuple[Pool, list[Pod]]] = []
        for g in rendezvous_rank(shard, groups) if self.settings.prefix_shard_pools else groups:
            pods = [p for p in g.pods if self._up(p) and (allowed is None or p.endpoint in allowed)]
            if pods:
                ready.append((g, pods))
        if not ready:
            raise NoEndpointError(f"no ready endpoint in pool {pool.name!r} for model {model!r}")
        if not self.settings.prefix_shard_pools or len(ready) == 1:  # one shard: nowhere to spill
            return ready
        for g, pods in ready:
            if min(self._waiting(p) for p in pods) < self.settings.pool_saturation_queue:
                return [(g, pods)]
        return [ready[0]]

    def pick_ttl(self, pod: Pod) -> float:
        """How long after its first token a pick on ``pod`` counts as cached there: until the pod's KV events
        take over (``speculative_ttl_s``), or, for a pod whose engine publishes none (events off, or an engine
        whose events cannot be indexed: the operator leaves its events annotation empty), ``approximate_ttl_s``."""
        s = self.settings
        return s.speculative_ttl_s if s.events_enabled and pod.events else s.approximate_ttl_s

    def unreachable(self, d: Decision, endpoint: str) -> None:
        """The gateway found nothing listening at ``endpoint`` (one of ``d``'s): out of rotation until a metrics
        scrape reaches the pod again."""
        names = {p.endpoint: p.name for pool in self.datastore.pools() for p in pool.pods}
        name = names.get(endpoint) or (d.pod if endpoint in ("", "-") else None)
        if name is not None:
            self.metrics.mark_down(name)

    def _up(self, pod: Pod) -> bool:
        """Ready in the datastore and not refusing connections (the metrics scrape's health check)."""
        return pod.ready and not self.metrics.down(pod.name)

    def _waiting(self, pod: Pod) -> float:
        m = self.metrics.get(pod.name)
        _, _, pending = self.tracker.load(pod.name)
        return max(m.waiting, pending) if m is not None else float(pending)

    def hotspot_key(self, keys: Sequence[int], longest: int, shard: int) -> int:
        """The key a request is counted under for hot-spot decay: the key of the longest prefix
        (``longest`` blocks) any candidate holds, else the shard key. Requests damp each other only
        when they would hit the same cached prefix: a storm of one long prompt prefix is counted as
        one hot spot, while sessions of one application (one shard, each with its own history)
        are not counted against each other."""
        return keys[longest - 1] if 0 < longest <= len(keys) else shard

    def _candidates(
        self, pods: Sequence[Pod], keys: Sequence[int], shard: int, hot: int | None = None,
    ) -> tuple[list[Candidate], int]:
        """One candidate per pod, and the hot key their ``same_prefix`` counts (``hot``, else
        :meth:`hotspot_key` of the longest match among ``pods``)."""
        matches = self.index.match(keys, [p.name for p in pods], self.tier_weights)
        if hot is None:
            hot = self.hotspot_key(keys, max((m.blocks for m in matches.values()), default=0), shard)
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
                    same_prefix=self.tracker.same_prefix(p.name, hot),
                    pending_tokens=pending_tokens,
                    pending_requests=pending_requests,
                    metrics=pm,
                    scrape_pending=scrape_pending,
                )
            )
        return out, hot
