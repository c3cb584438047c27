"""Bad input and broken media (``files`` backend; the slab backend's are in test_slab.py): a full disk (real
ENOSPC from /dev/full) keeps blocks in memory, a record corrupted while indexed is dropped on read, bad
settings and codec names are clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvfleet.agent.codecs import UnknownCodecError
from kvfleet.agent.tiers.record import key_name
from kvfleet.cache.events import BlockRemoved, EventBuffer
from kvfleet.cache.tiers import Tier
from kvfleet.config import ConfigError, load
from kvfleet.config.tiers import MemoryTierSpec, TierSettings

from .conftest import Factory, make_block, small_settings

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@needs_dev_full
def test_full_disk_keeps_blocks_in_memory(tmp_path: Path, manager_factory: Factory) -> None:
    """Demotions whose file write fails with ENOSPC leave the blocks in the cpu tier, counted as no_space."""
    ssd = tmp_path / "ssd"
    m = manager_factory(small_settings(ssd, gpu_blocks=4, cpu_blocks=4, ssd_backend="files"))
    for h in range(8):  # the first write of each record lands on a device that is always full
        (ssd / (key_name(h) + ".kvb.tmp")).symlink_to("/dev/full")
    for h in range(8):
        m.put(h, make_block(h))
        m.drain(0.3)
    assert m.metrics.errors.labels(tier="ssd", kind="no_space")._value.get() >= 1
    for h in range(8):
        assert m.locate(h) is not None
        np.testing.assert_array_equal(m.get(h), make_block(h))
    for h in range(8):
        if m.locate(h) is Tier.SSD:  # written after the retry; the failed attempt left nothing behind
            assert (ssd / (key_name(h) + ".kvb")).exists() and not (ssd / (key_name(h) + ".kvb.tmp")).exists()

def test_corrupted_while_indexed(tmp_path: Path, manager_factory: Factory, events: EventBuffer) -> None:
    """A record damaged on disk after indexing reads as a miss, is dropped and announced removed."""
    m = manager_factory(small_settings(tmp_path / "ssd", ssd_backend="files"))
    m.put(5, make_block(5), tier=Tier.SSD)
    assert m.drain(10)
    path = tmp_path / "ssd" / (key_name(5) + ".kvb")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    events.drain()
    assert m.get(5) is None
    assert m.locate(5) is None
    assert m.metrics.errors.labels(tier="ssd", kind="corrupt")._value.get() == 1
    batch = events.drain()
    assert batch is not None and [(type(e), getattr(e, "medium", None)) for e in batch.events] == [
        (BlockRemoved, "SSD")]


def test_bad_settings_are_clear() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        MemoryTierSpec(high_watermark=0.5, low_watermark=0.8)
    with pytest.raises(ConfigError, match=r"tiers\.cpu\.slot_byte"):
        load(overrides={"tiers": {"cpu": {"slot_byte": 1}}})
    s = load(overrides={"tiers": {"cpu": {"codec": "int4", "capacity_bytes": 1024}}})
    assert s.tiers.cpu.codec == "int4" and isinstance(s.tiers, TierSettings)


def test_unknown_codec_at_start(tmp_path: Path, manager_factory: Factory) -> None:
    with pytest.raises(UnknownCodecError, match="known: fp8_e4m3, int4, int8, none"):
        manager_factory(small_settings(tmp_path, cpu=MemoryTierSpec(codec="fp4")))


def test_prefetch_of_a_corrupted_record(tmp_path: Path, manager_factory: Factory,
                                        events: EventBuffer) -> None:
    """The direct ssd → slot promotion checks the record too: a damaged one is dropped, not promoted."""
    m = manager_factory(small_settings(tmp_path / "ssd", ssd_backend="files"))
    for h in (6, 7):
        m.put(h, make_block(h), tier=Tier.SSD)
    assert m.drain(10)
    path = tmp_path / "ssd" / (key_name(6) + ".kvb")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    assert m.prefetch([6, 7]) == 2
    assert m.drain(10)
    assert m.locate(6) is None and m.locate(7) is Tier.GPU
    np.testing.assert_array_equal(m.get(7), make_block(7))
    assert m.metrics.errors.labels(tier="ssd", kind="corrupt")._value.get() == 1
    assert m.stores[Tier.GPU].used_bytes == m.used_bytes(Tier.GPU)  # the reserved slot was given back
