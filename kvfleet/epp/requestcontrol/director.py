"""The director: one request's lifecycle around scheduling, as GIE's ``pkg/epp/requestcontrol/director.go``.

:meth:`Director.handle` (an inference request) and :meth:`Director.handle_keys` (a request already keyed):

1. keys: tokenize (byte-level or HF) and key the prompt's full blocks with the invoked pool's block hasher
   (:meth:`Director.hasher_for`: its block size, algorithm and seed) and the core's chained hash
   (``cache_salt`` → the extra key ``(salt,)`` of block 0, exactly as vLLM and the engine simulator key it:
   :func:`~kvfleet.cache.tokens.salt_extra_keys`);
2. the pool and its shard (:class:`~kvfleet.epp.requestcontrol.locator.Locator`): the invoked pool, then
   level 1's prefix shard(s), over the ready pods of the subset hint;
3. the candidates (:class:`~kvfleet.epp.scheduling.candidates.CandidateBuilder`) of the serving pods, then
   admission: shed (:class:`~kvfleet.epp.errors.SheddingError`) when every candidate waits ≥ ``shed_queue``;
4. scheduling (:class:`~kvfleet.epp.scheduling.scheduler.Scheduler`): the profile's pick and fallbacks, the
   P/D prefill pod, the predicted hit;
5. PreRequest: a speculative index entry on each chosen pod, all under one :class:`~kvfleet.epp.index.Lease`
   per pod whose TTL (:meth:`Director.pick_ttl`) counts from the first token (the ticket's ``on_first_byte``
   refresh), and an in-flight ticket (load, pending prefill, hot-spot decay under the request's hot key);
6. served: when the gateway reports that a fallback served the request, :meth:`Decision.served` moves the
   ticket and the speculative entry there.

Steps 3–5 run under one lock: the candidates see every earlier pick's ticket and entries.
:meth:`Director.handle_any` routes a request that is not an inference (least-loaded ready pod, a ticket only).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash

from kvfleet.cache.hashing import BlockHasher, block_keys
from kvfleet.cache.tokens import salt_extra_keys
from kvfleet.config.cache import CacheSettings
from kvfleet.config.epp import EppSettings
from kvfleet.epp.datastore import Datastore, Pod, Pool
from kvfleet.epp.errors import NoEndpointError, SheddingError, UnknownModelError
from kvfleet.epp.index import BlockIndex, PickOrigin
from kvfleet.epp.inflight import InflightTracker, Ticket
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.requestcontrol.locator import Locator
from kvfleet.epp.scheduling import Candidate, SchedulingRequest
from kvfleet.epp.scheduling.candidates import CandidateBuilder
from kvfleet.epp.scheduling.framework import column
from kvfleet.epp.scheduling.plugins import waiting
from kvfleet.epp.scheduling.scheduler import Scheduler, SchedulingResult, serving_pods
from kvfleet.epp.speculative import Lease
from kvfleet.epp.tokenize import PoolTokenizers, Tokens

log = logging.getLogger(__name__)

#: the longest age of a hot key's popularity run counted for the requests expected to follow it
#: (``SchedulingRequest.hot_followers``, the copy-value scorer's ``N``); chosen among 10, 30 and 60 s on the
#: workload family's documents (docs/epp.md): at 10 s a document read by most requests kept one holder, at
#: 60 s the copies' makers, each paying a whole recompute, reached the tail on 16 pods
COPY_HORIZON_S = 30.0
#: a popularity run younger than this counts no followers (the pods' load history, ``history_s``): an agent
#: tree's burst of sibling steps is not a popular prefix
COPY_MIN_AGE_S = 10.0

#: weight of one decision in a pool's :attr:`~kvfleet.epp.scheduling.SchedulingRequest.followup_share` (its
#: last ≈ 1 / FOLLOWUP_ALPHA decisions count)
FOLLOWUP_ALPHA = 0.01


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
    #: the serving candidates at the pick (read-only snapshots), the source of :attr:`hits`
    candidates: Sequence[Candidate] = field(default=(), compare=False, repr=False)
    ticket: Ticket | None = field(default=None, compare=False)
    #: the prefix shard (pod subset of ``pool``) level 1 chose; "" when the pool has one
    shard: str = ""
    #: the pool's block size (tokens), which ``predicted_hit_tokens`` counts in
    block_size: int = 16
    on_served: Callable[[str], bool] | None = field(default=None, compare=False)
    #: why the prompt could not be keyed as the pool's engines key it ("" = keyed): routed on load
    unkeyed: str = ""

    @property
    def hits(self) -> tuple[tuple[str, int, int, float, int], ...]:
        """Every serving candidate's (name, hit blocks, of which speculative, engine-reported waiting or −1
        when stale, the picker's pending requests) at the pick: the decision log's evidence (built when read:
        64 tuples per decision cost ≈ 10 µs, and only the opt-in decision log reads them)."""
        return evidence(self.candidates)

    def served(self, endpoint: str) -> bool:
        """The gateway says ``endpoint`` served the request; ``True`` if that moved the accounting
        off the pick (a fallback served it)."""
        if self.on_served is None or not self.endpoints or endpoint == self.endpoints[0]:
            return False
        return self.on_served(endpoint)


def evidence(cands: Sequence[Candidate]) -> tuple[tuple[str, int, int, float, int], ...]:
    """:attr:`Decision.hits` of the serving candidates."""
    return tuple(
        (p.name, hit, spec, -1.0 if pm is None else pm.waiting, pending)
        for p, hit, spec, pm, pending in zip(column(cands, "pod"), column(cands, "hit_blocks"),
                                             column(cands, "spec_blocks"), column(cands, "metrics"),
                                             column(cands, "pending_requests"), strict=True)
    )


class Director:
    """Keys a request, locates its pool and shard, admits it, has it scheduled and records the pick."""

    def __init__(
        self,
        settings: EppSettings,
        cache: CacheSettings,
        datastore: Datastore,
        index: BlockIndex,
        metrics: MetricsStore,
        tokenizers: PoolTokenizers,
        tracker: InflightTracker,
        scheduler: Scheduler,
    ) -> None:
        self.settings = settings
        self.datastore = datastore
        self.index = index
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.tracker = tracker
        self.scheduler = scheduler
        self.candidates: CandidateBuilder = scheduler.candidates
        self.locator = Locator(settings, datastore, metrics, tracker)
        self.hasher = BlockHasher(cache.block_size, cache.hash_algo, cache.hash_seed)
        self._cache = cache
        self._hashers: dict[tuple[int, str, str], BlockHasher] = {
            (cache.block_size, cache.hash_algo, cache.hash_seed): self.hasher}
        self.prefill_s_per_token = 1.0 / settings.cost.prefill_tokens_per_s
        self._lock = threading.Lock()
        #: per pool: the share of its recent prompts' blocks a live pick covered (``followup_share``)
        self._followup: dict[str, float] = {}

    # --- keys ---------------------------------------------------------------------------------

    def tokens_of(self, req: InferenceRequest, pool: Pool | None = None) -> Tokens:
        """``req``'s prompt token ids as ``pool``'s engines compute them, or why they cannot be known."""
        return self.tokenizers.tokens(req, pool)

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

    def keys_of(self, tokens: np.ndarray, cache_salt: str | None, pool: Pool | None = None) -> Sequence[int]:
        hasher = self.hasher_for(pool)
        return block_keys(hasher.hash_tokens(tokens, extra_keys=salt_extra_keys(cache_salt)))

    # --- the request --------------------------------------------------------------------------

    def handle(self, req: InferenceRequest, subset: Sequence[str] | None = None) -> Decision:
        """An inference request: tokens and the pool first (its engines decide how blocks are keyed), then
        :meth:`handle_keys`."""
        pools = self.locator.serving_pools(req.model)
        if not pools:
            raise UnknownModelError(f"no pool serves model {req.model!r}")
        pool = pools[0]
        got = self.tokens_of(req, pool)
        if got.ids is None:  # not keyable as the engines key it: routed on load, counted
            return self._unkeyed(req, pools, subset, pool, got)
        tokens = got.ids
        if len(pools) > 1 or subset is not None:  # the pool first: its engines decide how blocks are keyed
            head = tokens[: self.settings.prefix_shard_blocks * self.hasher.block_size]
            allowed = None if subset is None else set(subset)
            pool = self.locator.invoked_pool(req.model, xxhash.xxh3_64_intdigest(head.tobytes()), pools,
                                             allowed)
            if (self.tokenizers.spec_of(pool), pool.cache.chat_dialect) != \
                    (self.tokenizers.spec_of(pools[0]), pools[0].cache.chat_dialect):
                got = self.tokens_of(req, pool)  # another model build serving the same name
                if got.ids is None:
                    return self._unkeyed(req, [pool], subset, pool, got)
                tokens = got.ids
        keys = self.keys_of(tokens, req.cache_salt, pool)
        return self.handle_keys(req.model, keys, len(tokens), [pool], subset, tail=tokens)

    def _unkeyed(self, req: InferenceRequest, pools: Sequence[Pool], subset: Sequence[str] | None, pool: Pool,
                 got: Tokens) -> Decision:
        if got.detail:
            log.debug("request to pool %s routed on load: %s", pool.name, got.detail)
        approx = len(req.prompt or "") // 4  # a text's tokens, roughly: only the load scorers read it
        return replace(self.handle_keys(req.model, [], approx, pools, subset), unkeyed=got.reason)

    def handle_any(self, model: str | None, subset: Sequence[str] | None = None) -> Decision:
        """A request that is not an inference (``/tokenize``, ``/health``...): the least-loaded ready pod
        of the invoked pool (of ``model``'s pool when the body names one). Counted in flight, no cache
        state."""
        loc = self.locator
        pools = loc.serving_pools(model) if model else sorted(self.datastore.pools(), key=lambda p: p.name)
        if not pools:
            raise UnknownModelError(f"no pool serves model {model!r}")
        pool = loc.invoked_pool(model or "", 0, pools, None if subset is None else set(subset))
        pods = [p for p in pool.pods if loc.up(p) and (subset is None or p.endpoint in subset)]
        if not pods:
            raise NoEndpointError(f"no ready endpoint in pool {pool.name!r}")
        best = min(pods, key=lambda p: (loc.waiting(p), self.tracker.load(p.name)[0], p.name))
        ticket = self.tracker.open((best.name,), 0, 0.0)
        return Decision(endpoints=(best.endpoint,), pod=best.name, pool=pool.name, shard=best.shard,
                        ticket=ticket)

    def handle_keys(
        self,
        model: str,
        keys: Sequence[int],
        num_tokens: int,
        pools: Sequence[Pool] | None = None,
        subset: Sequence[str] | None = None,
        tail: np.ndarray | None = None,
    ) -> Decision:
        """Steps 2–6 for a request already keyed: ``keys`` of its full blocks, ``num_tokens`` in all.

        ``pools`` defaults to those serving ``model``; ``tail`` (the token ids) shards a prompt shorter
        than one block. The routing simulation (``bench.routing``) drives this with trace block ids.
        """
        if pools is None:
            pools = self.locator.serving_pools(model)
            if not pools:
                raise UnknownModelError(f"no pool serves model {model!r}")
        k = min(self.settings.prefix_shard_blocks, len(keys))
        shard = keys[k - 1] if k else xxhash.xxh3_64_intdigest(b"" if tail is None else tail.tobytes())
        allowed = set(subset) if subset is not None else None
        invoked = self.locator.invoked_pool(model, shard, pools, allowed)
        block_size = self.hasher_for(invoked).block_size
        beta = invoked.cache.hotspot_decay
        followup_share = self._followup.get(invoked.name, 0.0)
        profile = self.scheduler.profile_for(invoked.cache)
        groups = self.locator.shards(model, shard, invoked, allowed)
        serving = serving_pods(groups)
        with self._lock:
            cands, hot = self.candidates.build(serving, keys, shard, block_size=block_size)
            rate, age = self.tracker.popularity(hot)
            sreq = SchedulingRequest(
                num_tokens=num_tokens,
                block_size=block_size,
                prefill_s_per_token=self.prefill_s_per_token,
                hotspot_beta=self.settings.hotspot_beta if beta is None else beta,
                shard=shard,
                shard_blocks=k,
                followup_share=followup_share,
                hot_followers=rate * min(age, COPY_HORIZON_S) if age >= COPY_MIN_AGE_S else 0.0,
            )
            covered = self._observe_followup(invoked.name, keys, cands)
            self._admit(invoked, cands)
            result = self.scheduler.schedule(sreq, profile, cands, groups, keys, hot)
            if result is None:
                raise NoEndpointError(f"no endpoint of pool {invoked.name!r} passed the filters")
            ticket, leases, ttl = self._pre_request(result, keys, hot, invoked.name, covered)
        best = result.pick
        return Decision(
            endpoints=tuple(c.pod.endpoint for c in result.ranked.pods),
            pod=best.name,
            pool=invoked.name,
            prefiller=None if result.prefiller is None else result.prefiller.endpoint,
            num_tokens=num_tokens,
            predicted_hit_tokens=result.hit_tokens,
            scores=result.ranked.scores,
            candidates=cands,
            ticket=ticket,
            shard=best.pod.shard,
            block_size=block_size,
            on_served=self._on_served(result, keys, ticket, leases, ttl, invoked.name),
        )

    def followup_shares(self) -> dict[str, float]:
        """Per pool, its ``followup_share`` now (the metric's source)."""
        return dict(self._followup)

    def _observe_followup(self, pool: str, keys: Sequence[int], cands: Sequence[Candidate]) -> float:
        """Folds this request's share covered by a live pick (the longest prefix a pick on any candidate
        covers ÷ its blocks) into the pool's ``followup_share`` and returns it (−1 for a request without
        full blocks: no sample). The caller holds the lock."""
        if not keys:
            return -1.0
        picked = min(1.0, max(column(cands, "picked_blocks"), default=0) / len(keys))
        self._fold_followup(pool, picked)
        return picked

    def _fold_followup(self, pool: str, share: float) -> None:
        prev = self._followup.get(pool)
        self._followup[pool] = share if prev is None else prev + FOLLOWUP_ALPHA * (share - prev)

    def peer_followup(self, pool: str, share: float) -> None:
        """A peer replica's sample of ``pool``'s follow-up share (its :class:`PickOrigin`'s ``covered``),
        folded as this replica's own: every replica then counts the whole fleet's requests, as one picker
        would, not the third the gateway sends it (``docs/epp.md``, Replicas). A pool this picker does not
        know is ignored."""
        if not 0.0 <= share <= 1.0:
            return
        with self._lock:
            if pool not in self._followup and all(p.name != pool for p in self.datastore.pools()):
                return
            self._fold_followup(pool, share)

    def _admit(self, pool: Pool, cands: Sequence[Candidate]) -> None:
        """Shedding: refuse the request when every candidate waits ≥ ``shed_queue`` (0: never)."""
        if self.settings.shed_queue > 0 and bool((waiting(cands) >= self.settings.shed_queue).all()):
            raise SheddingError(f"every pod of pool {pool.name!r} is above the shedding threshold")

    # --- PreRequest: the pick's speculative entries and ticket ---------------------------------

    def _pre_request(
        self, result: SchedulingResult, keys: Sequence[int], hot: int, pool: str, covered: float,
    ) -> tuple[Ticket, dict[str, Lease], dict[str, float]]:
        """The in-flight ticket, then speculative entries on the chosen pod(s), one lease each: the ticket's
        first byte starts the leases' TTL (a long queue must not expire the entries). The ticket opens first
        so that the pick names it to other replicas (:class:`PickOrigin`)."""
        best, prefiller = result.pick.pod, result.prefiller
        picked = (best.name,) if prefiller is None else (best.name, prefiller.name)
        ttl = {best.name: self.pick_ttl(best)}
        if prefiller is not None:
            ttl[prefiller.name] = self.pick_ttl(prefiller)
        leases: dict[str, Lease] = {}

        def refresh() -> None:  # the TTL counts from the first token: a long queue must not expire the entry
            for name, lease in leases.items():
                self.index.extend(lease, ttl.get(name, self.settings.speculative_ttl_s))

        ticket = self.tracker.open(picked, hot, float(result.uncached), on_first_byte=refresh)
        for i, name in enumerate(picked):  # one request, one follow-up sample: the prefill pick has none
            origin = PickOrigin(ticket.id, covered if i == 0 else -1.0, pool)
            leases[name] = self.index.add_speculative(name, keys, self.tracker.max_age_s, origin=origin)
        return ticket, leases, ttl

    def _on_served(
        self, result: SchedulingResult, keys: Sequence[int], ticket: Ticket, leases: dict[str, Lease],
        ttl: dict[str, float], pool: str,
    ) -> Callable[[str], bool]:
        """:attr:`Decision.on_served`: when a fallback served, its pod gets the ticket and a speculative entry
        (in the ``leases``/``ttl`` the ticket's first-byte refresh reads) and the pick's entry expires."""
        by_endpoint = {c.pod.endpoint: c.pod for c in result.ranked.pods}
        best = result.pick.name

        def served(endpoint: str) -> bool:
            """A fallback served the request: its pod, not the pick, holds the prefix and carries the load."""
            pod = by_endpoint.get(endpoint)
            if pod is None or pod.name in leases:
                return False
            leases.pop(best).expiry = 0.0  # out of the refresh too: the fallback holds the prefix
            leases[pod.name] = self.index.add_speculative(pod.name, keys, self.tracker.max_age_s,
                                                          origin=PickOrigin(ticket.id, -1.0, pool))
            ttl[pod.name] = self.pick_ttl(pod)
            self.tracker.move(ticket, best, pod.name)
            return True

        return served

    # --- the pick's lifetime and the gateway's reports ------------------------------------------

    def pick_ttl(self, pod: Pod) -> float:
        """How long after its first token a pick on ``pod`` counts as cached there: until the pod's KV events
        take over (``speculative_ttl_s``), or, for a pod whose engine publishes none (events off, or an engine
        whose events cannot be indexed: the operator leaves its events annotation empty),
        ``approximate_ttl_s``."""
        s = self.settings
        return s.speculative_ttl_s if s.events_enabled and pod.events else s.approximate_ttl_s

    def pick_ttl_of(self, name: str) -> float:
        """:meth:`pick_ttl` of the pod called ``name`` (a peer's pick); ``speculative_ttl_s`` for a pod no
        pool holds now."""
        for pool in self.datastore.pools():
            for pod in pool.pods:
                if pod.name == name:
                    return self.pick_ttl(pod)
        return self.settings.speculative_ttl_s

    def unreachable(self, d: Decision, endpoint: str) -> None:
        """The gateway found nothing listening at ``endpoint`` (one of ``d``'s): out of rotation until a
        metrics scrape reaches the pod again."""
        names = {p.endpoint: p.name for pool in self.datastore.pools() for p in pool.pods}
        name = names.get(endpoint) or (d.pod if endpoint in ("", "-") else None)
        if name is not None:
            self.metrics.mark_down(name)
