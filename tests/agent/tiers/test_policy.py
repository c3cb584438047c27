"""Tier policy: prefix lookup, watermark demotion in LRU order, eviction from the last tier,
pins, quantized tiers holding more blocks, KV events for every store/move/drop, get() copy semantics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfleet.agent.tiers import BlockNotFoundError
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec

from .conftest import BLOCK_NBYTES, Factory, make_block, small_settings


def _events(buf: EventBuffer) -> list[tuple[str, int | bytes, str | None]]:
    batch = buf.drain()
    out: list[tuple[str, int | bytes, str | None]] = []
    for ev in batch.events if batch else []:
        if isinstance(ev, BlockStored | BlockRemoved):
            out.extend((type(ev).__name__, h, ev.medium) for h in ev.block_hashes)
    return out


def test_put_lookup_prefix(tmp_path: Path, manager_factory: Factory, events: EventBuffer) -> None:
    """lookup() counts leading hits and says where each lives; put() is idempotent; events say GPU."""
    m = manager_factory(small_settings(tmp_path))
    for h in (10, 11, 12):
        assert m.put(h, make_block(h), token_ids=range(16)) is Tier.GPU
    assert m.put(10, make_block(10)) is Tier.GPU
    r = m.lookup([10, 11, 99, 12])
    assert r.num_hits == 2 and r.tiers == [Tier.GPU, Tier.GPU]
    assert m.lookup([99, 10]).num_hits == 0
    assert _events(events) == [("BlockStored", h, "GPU") for h in (10, 11, 12)]
    np.testing.assert_array_equal(m.get(11), make_block(11))
    assert m.get(99) is None


def test_watermark_demotion_lru(tmp_path: Path, manager_factory: Factory, events: EventBuffer) -> None:
    """Above the high watermark the least recently used blocks move down until the low watermark."""
    m = manager_factory(small_settings(tmp_path, gpu_blocks=10, cpu_blocks=40))
    for h in range(8):
        m.put(h, make_block(h))
    assert m.drain(10)
    assert m.blocks_in(Tier.GPU) == 8  # 80 % < high watermark 90 %
    m.get(0)  # 0 becomes most recently used
    m.put(8, make_block(8))
    m.put(9, make_block(9))  # 100 % > 90 %
    assert m.drain(10)
    assert m.usage(Tier.GPU) <= 0.5
    in_gpu = {h for h in range(10) if m.locate(h) is Tier.GPU}
    assert in_gpu == {0, 6, 7, 8, 9}
    assert {h for h in range(10) if m.locate(h) is Tier.CPU} == {1, 2, 3, 4, 5}
    evs = _events(events)
    for h in (1, 2, 3, 4, 5):
        assert ("BlockStored", h, "CPU") in evs and ("BlockRemoved", h, "GPU") in evs
        np.testing.assert_array_equal(m.get(h), make_block(h))


def test_chain_to_ssd_and_eviction(tmp_path: Path, manager_factory: Factory, events: EventBuffer) -> None:
    """gpu → cpu → ssd, and the last tier drops its LRU blocks with BlockRemoved."""
    m = manager_factory(small_settings(tmp_path, gpu_blocks=4, cpu_blocks=4, ssd_blocks=6))
    for h in range(30):
        m.put(h, make_block(h))
        assert m.drain(10)
    counts = {t: m.blocks_in(t) for t in m.order}
    assert counts[Tier.SSD] > 0 and sum(counts.values()) < 30
    gone = [h for h in range(30) if m.locate(h) is None]
    evs = _events(events)
    for h in gone:
        assert ("BlockRemoved", h, "SSD") in evs
    assert m.metrics.evictions.labels(tier="ssd")._value.get() == len(gone)
    assert gone == list(range(len(gone)))  # the oldest went first
    for h in range(30):
        if m.locate(h) is Tier.SSD:
            np.testing.assert_array_equal(m.get(h), make_block(h))


def test_pinned_blocks_stay(tmp_path: Path, manager_factory: Factory) -> None:
    """Pinned blocks are never demoted; once released they can be."""
    m = manager_factory(small_settings(tmp_path, gpu_blocks=4, cpu_blocks=20))
    m.put(0, make_block(0))
    receipt = m.pin([0])
    for h in range(1, 12):
        m.put(h, make_block(h))
        m.drain(10)
    assert m.locate(0) is Tier.GPU
    view = m.get(0)
    assert view is not None and not view.flags.writeable  # zero-copy while pinned
    receipt.release()
    for h in range(12, 16):
        m.put(h, make_block(h))
        m.drain(10)
    assert m.locate(0) is Tier.CPU
    with pytest.raises(BlockNotFoundError):
        m.pin([12345])


def test_unpinned_get_is_a_copy(tmp_path: Path, manager_factory: Factory) -> None:
    m = manager_factory(small_settings(tmp_path))
    m.put(1, make_block(1))
    a = m.get(1)
    assert a is not None and a.flags.writeable
    a[...] = 0
    np.testing.assert_array_equal(m.get(1), make_block(1))


def test_quantized_tier_holds_more_blocks(tmp_path: Path, manager_factory: Factory) -> None:
    """Capacity counts encoded bytes: an fp8 cpu tier holds about twice the blocks of an fp16 one."""
    held = {}
    for codec in ("none", "fp8_e4m3"):
        cpu = MemoryTierSpec(capacity_bytes=8 * BLOCK_NBYTES, codec=codec, high_watermark=1.0,
                             low_watermark=1.0)
        s = small_settings(tmp_path / codec, gpu_blocks=1, cpu=cpu)
        m = manager_factory(s)
        for h in range(40):
            m.put(h, make_block(h), tier=Tier.CPU)
        m.drain(10)
        held[codec] = m.blocks_in(Tier.CPU)
        assert m.metrics.codec_saved.labels(tier="cpu", codec=codec)._value.get() >= (
            0 if codec == "none" else held[codec] * BLOCK_NBYTES * 0.45)
        if codec == "fp8_e4m3":
            x = make_block(0).astype(np.float64)
            y = m.get(0)
            assert y is not None and y.dtype == np.float16
            assert np.all(np.abs(y - x) <= 2.0**-4 * np.abs(x) + 2.0**-13 * np.abs(x).max()
                          + 1e-3 * np.abs(x))
    assert held["none"] == 8
    assert held["fp8_e4m3"] >= 15


def test_discard_emits_removed(tmp_path: Path, manager_factory: Factory, events: EventBuffer) -> None:
    m = manager_factory(small_settings(tmp_path))
    m.put(1, make_block(1))
    _events(events)
    assert m.discard([1, 2]) == 1
    assert m.locate(1) is None
    assert _events(events) == [("BlockRemoved", 1, "GPU")]


def test_put_rejects_non_arrays(tmp_path: Path, manager_factory: Factory) -> None:
    m = manager_factory(small_settings(tmp_path))
    with pytest.raises(TypeError):
        m.put(1, [1, 2, 3])  # type: ignore[arg-type]
    assert m.locate(1) is None


def test_full_memory_pushes_lru_blocks_down(tmp_path: Path, manager_factory: Factory,
                                            events: EventBuffer) -> None:
    """A put into a full gpu tier keeps the new block in the gpu: the gpu's LRU block moves to a free
    cpu slot (on the caller's thread); when the cpu is full too, the cpu's LRU block is first queued
    to the ssd writers (a miss until written). Background demotion is off (watermarks 1.0)."""
    s = small_settings(
        tmp_path,
        gpu=MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES, high_watermark=1.0, low_watermark=1.0,
                           device="host"),
        cpu=MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES, high_watermark=1.0, low_watermark=1.0),
    )
    m = manager_factory(s)
    tiers = [m.put(h, make_block(h)) for h in range(6)]
    assert tiers == [Tier.GPU] * 6
    assert m.drain(10)
    assert [m.locate(h) for h in range(6)] == [Tier.SSD, Tier.SSD, Tier.CPU, Tier.CPU, Tier.GPU, Tier.GPU]
    for h in range(6):
        np.testing.assert_array_equal(m.get(h), make_block(h))
    ev = [e for e in _events(events) if e[1] == 0]
    assert ev[:5] == [("BlockStored", 0, "GPU"), ("BlockStored", 0, "CPU"), ("BlockRemoved", 0, "GPU"),
                      ("BlockRemoved", 0, "CPU"), ("BlockStored", 0, "SSD")]


def test_full_memory_goes_to_ssd_when_nothing_can_move(tmp_path: Path, manager_factory: Factory) -> None:
    """When every memory block is pinned, put() queues the new block itself to the ssd tier."""
    s = small_settings(
        tmp_path,
        gpu=MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES, high_watermark=1.0, low_watermark=1.0,
                           device="host"),
        cpu=MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES, high_watermark=1.0, low_watermark=1.0),
    )
    m = manager_factory(s)
    assert [m.put(h, make_block(h)) for h in range(4)] == [Tier.GPU] * 4
    with m.pin(range(4)):
        assert m.put(9, make_block(9)) is Tier.SSD
        assert m.drain(10)
    assert [m.locate(h) for h in (0, 1, 2, 3, 9)] == [Tier.CPU, Tier.CPU, Tier.GPU, Tier.GPU, Tier.SSD]
    np.testing.assert_array_equal(m.get(9), make_block(9))


def test_full_gpu_keeps_pinned_blocks(tmp_path: Path, manager_factory: Factory) -> None:
    """Making room in a full gpu tier never moves a pinned block: with every gpu block pinned the new
    block goes to the cpu tier instead."""
    s = small_settings(
        tmp_path,
        gpu=MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES, high_watermark=1.0, low_watermark=1.0,
                           device="host"),
        cpu=MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES, high_watermark=1.0, low_watermark=1.0),
    )
    m = manager_factory(s)
    m.put(0, make_block(0))
    m.put(1, make_block(1))
    with m.pin([0, 1]):
        assert m.put(2, make_block(2)) is Tier.CPU
    assert m.locate(0) is Tier.GPU and m.locate(1) is Tier.GPU
