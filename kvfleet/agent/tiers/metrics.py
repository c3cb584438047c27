"""Prometheus metrics of the tier manager (names are API; tested against a golden list).

============================================  =======================  =======================================
name                                          labels                   meaning
============================================  =======================  =======================================
kvfleet_tier_info                             tier, backend, stand_in  1 per configured tier
kvfleet_tier_capacity_bytes                   tier                     capacity (encoded bytes)
kvfleet_tier_used_bytes                       tier                     bytes held
kvfleet_tier_blocks                           tier                     blocks held
kvfleet_tier_lookup_hits_total                tier                     blocks found by lookup(), per tier
kvfleet_tier_lookup_misses_total                                       lookups that ended at a missing block
kvfleet_tier_stores_total                     tier                     blocks put
kvfleet_tier_migrations_total                 src, dst, kind           blocks moved (kind demote/promote)
kvfleet_tier_migrated_bytes_total             src, dst, kind           encoded bytes written to dst
kvfleet_tier_evictions_total                  tier                     blocks dropped (last tier full)
kvfleet_tier_evicted_bytes_total              tier                     bytes dropped
kvfleet_tier_migration_queue_depth            queue                    jobs waiting (promote, write)
kvfleet_tier_codec_saved_bytes_total          tier, codec              raw − encoded bytes of blocks written
kvfleet_tier_promotion_decisions_total        src, decision            promote / serve_in_place / recompute
kvfleet_tier_promotion_cost_seconds           src, term                last decision's cost terms
kvfleet_tier_cost_bandwidth_bytes_per_second  tier, op                 calibrated or configured bandwidth
kvfleet_tier_errors_total                     tier, kind               io, no_space, unavailable, corrupt, ...
kvfleet_tier_dropped_records_total            tier, reason             records dropped by the start-up rescan
kvfleet_tier_reindexed_blocks_total           tier                     blocks the start-up rescan re-indexed
============================================  =======================  =======================================
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

METRIC_NAMES: tuple[str, ...] = (
    "kvfleet_tier_info",
    "kvfleet_tier_capacity_bytes",
    "kvfleet_tier_used_bytes",
    "kvfleet_tier_blocks",
    "kvfleet_tier_lookup_hits_total",
    "kvfleet_tier_lookup_misses_total",
    "kvfleet_tier_stores_total",
    "kvfleet_tier_migrations_total",
    "kvfleet_tier_migrated_bytes_total",
    "kvfleet_tier_evictions_total",
    "kvfleet_tier_evicted_bytes_total",
    "kvfleet_tier_migration_queue_depth",
    "kvfleet_tier_codec_saved_bytes_total",
    "kvfleet_tier_promotion_decisions_total",
    "kvfleet_tier_promotion_cost_seconds",
    "kvfleet_tier_cost_bandwidth_bytes_per_second",
    "kvfleet_tier_errors_total",
    "kvfleet_tier_dropped_records_total",
    "kvfleet_tier_reindexed_blocks_total",
)


def _strip(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


class TierMetrics:
    """Every tier metric, registered in one registry (a fresh one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.info = Gauge("kvfleet_tier_info",
                          "Configured tier (1), its backend and whether it is a stand-in",
                          ["tier", "backend", "stand_in"], registry=r)
        self.capacity = Gauge("kvfleet_tier_capacity_bytes", "Tier capacity in encoded bytes", ["tier"],
                              registry=r)
        self.used = Gauge("kvfleet_tier_used_bytes", "Bytes held by the tier", ["tier"], registry=r)
        self.blocks = Gauge("kvfleet_tier_blocks", "Blocks held by the tier", ["tier"], registry=r)
        self.hits = Counter(_strip("kvfleet_tier_lookup_hits_total"), "Blocks found by lookup, per tier",
                            ["tier"], registry=r)
        self.misses = Counter(_strip("kvfleet_tier_lookup_misses_total"),
                              "Lookups that stopped at a missing block", registry=r)
        self.stores = Counter(_strip("kvfleet_tier_stores_total"), "Blocks stored by put", ["tier"],
                              registry=r)
        self.migrations = Counter(_strip("kvfleet_tier_migrations_total"), "Blocks moved between tiers",
                                  ["src", "dst", "kind"], registry=r)
        self.migrated_bytes = Counter(_strip("kvfleet_tier_migrated_bytes_total"),
                                      "Encoded bytes written by migrations", ["src", "dst", "kind"],
                                      registry=r)
        self.evictions = Counter(_strip("kvfleet_tier_evictions_total"), "Blocks dropped from the last tier",
                                 ["tier"], registry=r)
        self.evicted_bytes = Counter(_strip("kvfleet_tier_evicted_bytes_total"),
                                     "Bytes dropped from the last tier", ["tier"], registry=r)
        self.queue_depth = Gauge("kvfleet_tier_migration_queue_depth", "Migration jobs waiting", ["queue"],
                                 registry=r)
        self.codec_saved = Counter(_strip("kvfleet_tier_codec_saved_bytes_total"),
                                   "Raw minus encoded bytes of blocks written", ["tier", "codec"], registry=r)
        self.decisions = Counter(_strip("kvfleet_tier_promotion_decisions_total"), "Promotion-rule outcomes",
                                 ["src", "decision"], registry=r)
        self.decision_cost = Gauge("kvfleet_tier_promotion_cost_seconds",
                                   "Terms of the last promotion decision", ["src", "term"], registry=r)
        self.bandwidth = Gauge("kvfleet_tier_cost_bandwidth_bytes_per_second",
                               "Tier bandwidth used by the promotion rule", ["tier", "op"], registry=r)
        self.errors = Counter(_strip("kvfleet_tier_errors_total"), "Tier errors by kind", ["tier", "kind"],
                              registry=r)
        self.dropped = Counter(_strip("kvfleet_tier_dropped_records_total"),
                               "Records dropped by the start-up rescan", ["tier", "reason"], registry=r)
        self.reindexed = Counter(_strip("kvfleet_tier_reindexed_blocks_total"),
                                 "Blocks re-indexed by the start-up rescan", ["tier"], registry=r)

    def child(self, metric: Any, *values: str) -> Any:
        """The labelled child of ``metric``, cached (``labels()`` validates and locks on every call)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child
