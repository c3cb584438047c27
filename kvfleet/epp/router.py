"""The read path's public face: a parsed request → block keys → pool (level 1) → pod(s) (level 2).

:class:`Router` wires the two rooms the work happens in and keeps the methods the ext_proc server
(``kvfleet/epp/server.py``), the routing simulation (``bench.routing``) and the tests call:

* request control (:mod:`kvfleet.epp.requestcontrol`): the request's lifecycle. Keys (the invoked pool's
  block hasher), the invoked pool and level 1's prefix shard (spilling past saturated shards), shedding,
  then the PreRequest steps once scheduling picked: speculative index entries on the chosen pod(s) (until the
  pod's events confirm them, or :meth:`Router.pick_ttl` after the first token), an in-flight ticket counted
  under the request's hot key (:meth:`Router.hotspot_key`), and the fallback ``served`` bookkeeping;
* scheduling (:mod:`kvfleet.epp.scheduling`): candidate building (index match, in-flight load, scraped
  metrics: :mod:`~kvfleet.epp.scheduling.candidates`), then the scheduler
  (:mod:`~kvfleet.epp.scheduling.scheduler`): the pool's profile of filters, scorers and picker, and for a
  P/D shard the second cycle that picks the prefill pod when the uncached part is at least
  ``pd_min_uncached_tokens`` (the predicted hit is then the prefill pod's).

A subclass may override :meth:`Router.hotspot_key` (the routing simulation's former rule does): candidate
building calls it for every request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvfleet.cache.hashing import BlockHasher
from kvfleet.cache.tokens import ByteTokenizer
from kvfleet.config.cache import CacheSettings
from kvfleet.config.epp import EppSettings
from kvfleet.epp.datastore import Datastore, Pod, Pool, PoolCache
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.requestcontrol import Decision, Director
from kvfleet.epp.scheduling import Profile
from kvfleet.epp.scheduling import candidates as _candidates
from kvfleet.epp.scheduling.candidates import CandidateBuilder, tier_weights
from kvfleet.epp.scheduling.scheduler import LOAD_SCORERS, PREFIX_SCORERS, Scheduler
from kvfleet.epp.tokenize import PoolTokenizers, Tokenizer

__all__ = ["LOAD_SCORERS", "PREFIX_SCORERS", "Decision", "Router", "tier_weights"]


class Router:
    """Routes requests over a datastore with a block index, metrics and the picker's own accounting."""

    def __init__(
        self,
        settings: EppSettings,
        cache: CacheSettings,
        datastore: Datastore,
        index: BlockIndex,
        metrics: MetricsStore,
        tokenizer: Tokenizer | PoolTokenizers,
        tracker: InflightTracker | None = None,
    ) -> None:
        self.settings = settings
        self.datastore = datastore
        self.index = index
        self.metrics = metrics
        self.tokenizers = PoolTokenizers.of(tokenizer)
        default = self.tokenizers.default
        self.tokenizer: Tokenizer = default if not isinstance(default, str) else ByteTokenizer()
        self.tracker = tracker or InflightTracker()
        self.tier_weights = tier_weights(settings.cost)
        self.candidates = CandidateBuilder(
            index, self.tracker, metrics, self.tier_weights,
            hot_key=lambda keys, longest, shard: self.hotspot_key(keys, longest, shard),
        )
        self.scheduler = Scheduler(settings, self.candidates)
        self.director = Director(settings, cache, datastore, index, metrics, self.tokenizers, self.tracker,
                                 self.scheduler)
        self.profile: Profile = self.scheduler.profile
        self.hasher: BlockHasher = self.director.hasher
        self.prefill_s_per_token = self.director.prefill_s_per_token
        #: called before each decision (a replica applies its peers' latest picks and load: the app sets
        #: :meth:`~kvfleet.epp.gossip.ReplicaGossip.receive`) and after it (what the decision held back is
        #: sent: :meth:`~kvfleet.epp.gossip.ReplicaGossip.flush`)
        self.before_decision: Callable[[], object] | None = None
        self.after_decision: Callable[[], object] | None = None

    def tokens_of(self, req: InferenceRequest, pool: Pool | None = None) -> np.ndarray:
        """``req``'s token ids as ``pool``'s engines compute them (default: the first pool serving its model);
        ValueError naming why they cannot be."""
        if pool is None:
            pools = self.director.locator.serving_pools(req.model)
            pool = pools[0] if pools else None
        got = self.director.tokens_of(req, pool)
        if got.ids is None:
            raise ValueError(f"request not keyable: {got.reason} {got.detail}".rstrip())
        return got.ids

    def hasher_for(self, pool: Pool | None) -> BlockHasher:
        """The block hasher of ``pool``'s engines: its block size, algorithm and seed, else the picker's."""
        return self.director.hasher_for(pool)

    def profile_for(self, cache: PoolCache) -> Profile:
        """The scheduling profile with the pool's routing weights applied (prefix and load scorers scaled)."""
        return self.scheduler.profile_for(cache)

    def keys_of(self, tokens: np.ndarray, cache_salt: str | None, pool: Pool | None = None) -> Sequence[int]:
        return self.director.keys_of(tokens, cache_salt, pool)

    def serving_pools(self, model: str) -> list[Pool]:
        """The pools serving ``model`` (a pool without models serves every model)."""
        return self.director.locator.serving_pools(model)

    @contextlib.contextmanager
    def _decision(self) -> Iterator[None]:
        if self.before_decision is not None:
            self.before_decision()
        try:
            yield
        finally:
            if self.after_decision is not None:
                self.after_decision()

    def route(self, req: InferenceRequest, subset: Sequence[str] | None = None) -> Decision:
        """An inference request: keyed with its pool's hasher, then routed as :meth:`route_keys`."""
        with self._decision():
            return self.director.handle(req, subset)

    def route_any(self, model: str | None, subset: Sequence[str] | None = None) -> Decision:
        """A request that is not an inference (``/tokenize``, ``/health``...): the least-loaded ready pod
        of the invoked pool (of ``model``'s pool when the body names one). Counted in flight, no cache
        state."""
        with self._decision():
            return self.director.handle_any(model, subset)

    def route_keys(
        self,
        model: str,
        keys: Sequence[int],
        num_tokens: int,
        pools: Sequence[Pool] | None = None,
        subset: Sequence[str] | None = None,
        tail: np.ndarray | None = None,
    ) -> Decision:
        """Pool, shard, scheduling and the pick's recording for a request already keyed: ``keys`` of its full
        blocks, ``num_tokens`` in all.

        ``pools`` defaults to those serving ``model``; ``tail`` (the token ids) shards a prompt shorter
        than one block. The routing simulation (``bench.routing``) drives this with trace block ids.
        """
        with self._decision():
            return self.director.handle_keys(model, keys, num_tokens, pools, subset, tail)

    def pick_ttl(self, pod: Pod) -> float:
        """How long after its first token a pick on ``pod`` counts as cached there: until the pod's KV events
        take over (``speculative_ttl_s``), or, for a pod whose engine publishes none (events off, or an engine
        whose events cannot be indexed: the operator leaves its events annotation empty),
        ``approximate_ttl_s``."""
        return self.director.pick_ttl(pod)

    def unreachable(self, d: Decision, endpoint: str) -> None:
        """The gateway found nothing listening at ``endpoint`` (one of ``d``'s): out of rotation until a
        metrics scrape reaches the pod again."""
        self.director.unreachable(d, endpoint)

    def hotspot_key(self, keys: Sequence[int], longest: int, shard: int) -> int:
        """The key a request is counted under for hot-spot decay: the key of the longest prefix
        (``longest`` blocks) any candidate holds, else the shard key
        (:func:`~kvfleet.epp.scheduling.candidates.hotspot_key`)."""
        return _candidates.hotspot_key(keys, longest, shard)
