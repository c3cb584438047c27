"""The promotion rule both ways: prefill > read + write promotes, prefill > read serves in place,
otherwise recompute (a miss); decisions and their inputs are exported as metrics; prefetch promotes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvfleet.agent.tiers import Action, TierManager
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec, ModelProfile, SsdTierSpec, TierSettings

from .conftest import BLOCK_NBYTES, Factory, make_block, small_settings


def _settings(tmp_path: Path, prefill_tokens_per_s: float, gpu_write_latency_us: float = 1.0) -> TierSettings:
    # Fixed costs: ssd read 100 µs + bytes at 2 GB/s; gpu write as given, 1000 GB/s.
    return small_settings(
        tmp_path,
        gpu=MemoryTierSpec(capacity_bytes=8 * BLOCK_NBYTES, latency_us=gpu_write_latency_us, read_gbps=1000,
                           write_gbps=1000),
        ssd=SsdTierSpec(capacity_bytes=16 * (BLOCK_NBYTES + 200), path=str(tmp_path / "ssd"), latency_us=100,
                        read_gbps=2, write_gbps=1),
        model=ModelProfile(kv_bytes_per_token=BLOCK_NBYTES // 16, prefill_tokens_per_s=prefill_tokens_per_s,
                           block_size=16),
    )


def _in_ssd(m: TierManager, h: int) -> None:
    assert m.put(h, make_block(h), tier=Tier.SSD) is Tier.SSD
    assert m.drain(10)
    assert m.locate(h) is Tier.SSD


def test_promote_when_prefill_costs_more(tmp_path: Path, manager_factory: Factory,
                                         events: EventBuffer) -> None:
    """A slow model (8k tokens/s: 2 ms per block) ≫ ssd read + gpu write: the hit moves up."""
    m = manager_factory(_settings(tmp_path, 8000.0))
    _in_ssd(m, 1)
    events.drain()
    d = m.decide(1)
    assert d is not None and d.action is Action.PROMOTE
    assert d.prefill_s == pytest.approx(16 / 8000.0)
    assert d.prefill_s > d.read_s + d.write_s
    np.testing.assert_array_equal(m.get(1), make_block(1))
    assert m.drain(10)
    assert m.locate(1) is Tier.GPU
    batch = events.drain()
    assert batch is not None
    kinds = {(type(e).__name__, e.medium) for e in batch.events if isinstance(e, BlockStored | BlockRemoved)}
    assert kinds == {("BlockStored", "GPU"), ("BlockRemoved", "SSD")}
    assert m.metrics.migrations.labels(src="ssd", dst="gpu", kind="promote")._value.get() == 1
    assert not m.stores[Tier.SSD].contains(1)


def test_recompute_when_prefill_is_cheaper(tmp_path: Path, manager_factory: Factory) -> None:
    """A very fast model (prefill cheaper than even reading the block): get() reports a miss, nothing
    moves."""
    m = manager_factory(_settings(tmp_path, 1e12))
    _in_ssd(m, 2)
    d = m.decide(2)
    assert d is not None and d.action is Action.RECOMPUTE and d.prefill_s < d.read_s
    assert m.get(2) is None
    assert m.drain(10)
    assert m.locate(2) is Tier.SSD
    assert m.metrics.decisions.labels(src="ssd", decision="recompute")._value.get() >= 2


def test_serve_in_place_between(tmp_path: Path, manager_factory: Factory) -> None:
    """read < prefill < read + write (a slow fast-tier write): the block is served but not moved."""
    # prefill 0.5 ms; ssd read ≈ 0.1 ms + 8 KiB / 2 GB/s; gpu write 1 ms.
    m = manager_factory(_settings(tmp_path, 16 / 0.0005, gpu_write_latency_us=1000))
    _in_ssd(m, 3)
    d = m.decide(3)
    assert d is not None and d.action is Action.SERVE_IN_PLACE
    assert d.read_s < d.prefill_s < d.read_s + d.write_s
    np.testing.assert_array_equal(m.get(3), make_block(3))
    assert m.drain(10)
    assert m.locate(3) is Tier.SSD


def test_decision_metrics_exported(tmp_path: Path, manager_factory: Factory) -> None:
    m = manager_factory(_settings(tmp_path, 8000.0))
    _in_ssd(m, 4)
    m.decide(4)
    text = generate_latest(m.metrics.registry).decode()
    assert 'kvfleet_tier_promotion_decisions_total{decision="promote",src="ssd"}' in text
    assert 'kvfleet_tier_promotion_cost_seconds{src="ssd",term="prefill"} 0.002' in text


def test_prefetch_promotes_in_background(tmp_path: Path, manager_factory: Factory) -> None:
    m = manager_factory(_settings(tmp_path, 8000.0))
    for h in (5, 6):
        _in_ssd(m, h)
    assert m.prefetch([5, 6, 7]) == 2
    assert m.drain(10)
    assert m.lookup([5, 6]).tiers == [Tier.GPU, Tier.GPU]
