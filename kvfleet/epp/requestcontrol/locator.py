"""Where a request may go: the invoked pool, then level 1 (its prefix shard), over the ready pods.

GIE's ``pkg/epp/requestcontrol/candidates.go`` (``Locate``: the endpoints a request may be scheduled on, the
subset hint applied) with kvfleet's two routing levels above the pod:

* the invoked pool (:meth:`Locator.invoked_pool`): with a subset hint, the pool holding the hinted endpoints;
  else the only pool serving the model, or (several) the first of a rendezvous ranking of the shard key that
  has a ready pod. Every endpoint of one answer belongs to that one pool (GIE v1.6);
* level 1 (:meth:`Locator.shards`): the pool's prefix shards (pod subsets, label ``kvfleet.io/shard``) ranked
  by weighted rendezvous hashing of the shard key (:func:`~kvfleet.epp.scheduling.pools.rendezvous_rank`),
  spilling past a shard whose every ready pod waits ≥ ``pool_saturation_queue``; with
  ``prefix_shard_pools: false`` every shard with a ready pod (one flat cycle).

A pod is up when the datastore marks it ready and the metrics scrape has not found it refusing connections;
its waiting requests are the scraped queue or, when larger or unscraped, the picker's own pending requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.config.epp import EppSettings
from kvfleet.epp.datastore import Datastore, Pod, Pool
from kvfleet.epp.errors import NoEndpointError
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.scheduling import rendezvous_rank
from kvfleet.epp.scheduling.scheduler import Group


class Locator:
    """The pools, shards and ready pods a request may be routed to."""

    def __init__(self, settings: EppSettings, datastore: Datastore, metrics: MetricsStore,
                 tracker: InflightTracker) -> None:
        self.settings = settings
        self.datastore = datastore
        self.metrics = metrics
        self.tracker = tracker
        #: each pool's shard groups, by the pool object's identity (a pool that changes is a new object)
        self._groups: dict[int, tuple[Pool, list[Pool]]] = {}

    def serving_pools(self, model: str) -> list[Pool]:
        """The pools serving ``model`` (a pool without models serves every model)."""
        return [p for p in self.datastore.pools() if model in p.models or "*" in p.models]

    def up(self, pod: Pod) -> bool:
        """Ready in the datastore and not refusing connections (the metrics scrape's health check)."""
        return pod.ready and not self.metrics.down(pod.name)

    def waiting(self, pod: Pod) -> float:
        """The pod's waiting requests: the scraped queue, or the picker's pending requests when more (or
        unscraped)."""
        m = self.metrics.get(pod.name)
        _, _, pending = self.tracker.load(pod.name)
        return max(m.waiting, pending) if m is not None else float(pending)

    def invoked_pool(self, model: str, shard: int, pools: Sequence[Pool], allowed: set[str] | None) -> Pool:
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
            if any(self.up(p) and (allowed is None or p.endpoint in allowed) for p in pool.pods):
                return pool
        raise NoEndpointError(f"no ready endpoint for model {model!r}")

    def _shard_groups(self, pool: Pool) -> list[Pool]:
        """``pool``'s prefix shards as pools of their pods, in shard order."""
        got = self._groups.get(id(pool))
        if got is not None and got[0] is pool:
            return got[1]
        by_shard: dict[str, list[Pod]] = {}
        for p in pool.pods:
            by_shard.setdefault(p.shard, []).append(p)
        groups = [Pool(name=f"{pool.name}/{k}" if k else pool.name, models=pool.models, pods=tuple(v))
                  for k, v in sorted(by_shard.items())]
        if len(self._groups) >= 256:  # pools replaced many times over: start again
            self._groups.clear()
        self._groups[id(pool)] = (pool, groups)
        return groups

    def shards(self, model: str, shard: int, pool: Pool, allowed: set[str] | None) -> list[Group]:
        """Level 1 inside the invoked pool: the prefix shard (pod subset) the shard key picks, spilling
        past saturated shards, or, with ``prefix_shard_pools: false``, every shard with a ready pod (one
        flat scheduling cycle: what a plain load balancer does, the baselines)."""
        groups = self._shard_groups(pool)
        ready: list[Group] = []
        down = self.metrics.down
        ranked = self.settings.prefix_shard_pools and len(groups) > 1
        for g in rendezvous_rank(shard, groups) if ranked else groups:
            pods = [p for p in g.pods
                    if p.ready and not down(p.name) and (allowed is None or p.endpoint in allowed)]
            if pods:
                ready.append((g, pods))
        if not ready:
            raise NoEndpointError(f"no ready endpoint in pool {pool.name!r} for model {model!r}")
        if not self.settings.prefix_shard_pools or len(ready) == 1:  # one shard: nowhere to spill
            return ready
        for g, pods in ready:
            if min(self.waiting(p) for p in pods) < self.settings.pool_saturation_queue:
                return [(g, pods)]
        return [ready[0]]
