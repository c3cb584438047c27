"""Metric names are API: the exposition after some traffic has exactly the golden family names,
and the gpu stand-in is visible on kvfleet_tier_info."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.agent.tiers import METRIC_NAMES
from kvfleet.cache.tiers import Tier

from .conftest import Factory, make_block, small_settings

GOLDEN = {
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
}


def test_metric_names_golden(tmp_path: Path, manager_factory: Factory) -> None:
    assert set(METRIC_NAMES) == GOLDEN
    m = manager_factory(small_settings(tmp_path, gpu_blocks=2, cpu_blocks=2, ssd_blocks=2))
    for h in range(10):
        m.put(h, make_block(h))
        m.drain(5)
    m.lookup([9, 12345])
    text = generate_latest(m.metrics.registry).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            names.add(sample.name)
    exposed = {n for n in names if not n.endswith("_created")}
    assert exposed <= GOLDEN
    assert GOLDEN - exposed <= {"kvfleet_tier_dropped_records_total", "kvfleet_tier_reindexed_blocks_total",
                                "kvfleet_tier_errors_total", "kvfleet_tier_promotion_decisions_total",
                                "kvfleet_tier_promotion_cost_seconds"}
    assert 'kvfleet_tier_info{backend="arena",stand_in="true",tier="gpu"} 1.0' in text
    assert 'kvfleet_tier_info{backend="arena",stand_in="false",tier="cpu"} 1.0' in text
    assert m.metrics.migrations.labels(src="gpu", dst="cpu", kind="demote")._value.get() > 0
    assert m.blocks_in(Tier.SSD) <= 2
