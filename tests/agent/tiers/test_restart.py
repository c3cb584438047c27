"""SSD restart (``files`` backend; slab files: test_slab.py): a new manager on the same directory re-indexes
and re-announces valid blocks, drops a corrupt and a truncated record (counted by reason), removes a partial
write, leaves a foreign file alone, and serves the surviving blocks bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prometheus_client import generate_latest

from kvfleet.agent.tiers.record import key_name
from kvfleet.cache.events import BlockStored, EventBuffer
from kvfleet.cache.tiers import Tier

from .conftest import Factory, make_block, small_settings


def test_restart_reuses_ssd_blocks(tmp_path: Path, manager_factory: Factory) -> None:
    ssd = tmp_path / "ssd"
    settings = small_settings(ssd, ssd_blocks=32, ssd_backend="files")
    first = manager_factory(settings, sink=EventBuffer())
    hashes = list(range(100, 110))
    for i, h in enumerate(hashes):
        first.put(h, make_block(h), tier=Tier.SSD, parent=h - 1, token_ids=range(16 * i, 16 * i + 16))
    assert first.drain(10)
    first.close()

    corrupt, truncated = ssd / (key_name(103) + ".kvb"), ssd / (key_name(107) + ".kvb")
    raw = bytearray(corrupt.read_bytes())
    raw[-100] ^= 0xFF
    corrupt.write_bytes(raw)
    truncated.write_bytes(truncated.read_bytes()[:-300])
    (ssd / "README.txt").write_text("not a block")
    (ssd / (key_name(200) + ".kvb.tmp")).write_bytes(b"half a write")

    events = EventBuffer()
    second = manager_factory(settings, sink=events)
    valid = [h for h in hashes if h not in (103, 107)]
    assert second.lookup(valid).tiers == [Tier.SSD] * len(valid)
    assert second.locate(103) is None and second.locate(107) is None
    batch = events.drain()
    assert batch is not None
    announced = {ev.block_hashes[0]: ev for ev in batch.events if isinstance(ev, BlockStored)}
    assert sorted(announced) == valid
    assert all(ev.medium == "SSD" for ev in announced.values())
    assert announced[104].parent_block_hash == 103 and announced[104].token_ids == list(range(64, 80))
    for h in valid:
        np.testing.assert_array_equal(second.get(h), make_block(h))

    text = generate_latest(second.metrics.registry).decode()
    for reason in ("corrupt", "truncated", "foreign", "partial"):
        assert f'kvfleet_tier_dropped_records_total{{reason="{reason}",tier="ssd"}} 1.0' in text
    assert 'kvfleet_tier_reindexed_blocks_total{tier="ssd"} 8.0' in text
    assert not corrupt.exists() and not truncated.exists()
    assert (ssd / "README.txt").exists()
    assert not list(ssd.glob("*.tmp"))


def test_close_with_flush_keeps_memory_blocks(tmp_path: Path, manager_factory: Factory) -> None:
    """close(flush=True) writes gpu/cpu blocks to ssd, so the next manager serves them from there."""
    settings = small_settings(tmp_path / "ssd", ssd_blocks=32)
    first = manager_factory(settings, sink=EventBuffer())
    for h in range(6):
        first.put(h, make_block(h), token_ids=range(16))
    first.close(flush=True)
    second = manager_factory(settings, sink=EventBuffer())
    assert second.lookup(range(6)).tiers == [Tier.SSD] * 6
    for h in range(6):
        np.testing.assert_array_equal(second.get(h), make_block(h))
