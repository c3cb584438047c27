"""A manager with its gpu tier off (the engine simulator's tiers below its own GPU stand-in).

Covers: ``block_charge`` sizes a tier in blocks (exactly for the arena and slab
stores, at least for ``files``); the cpu tier, fastest with nothing in memory
below it, is an LRU: a put into the full tier drops its least recently used block
when cpu is the last tier, or queues it to the ssd writers; ``put_many`` ends in
the state of a put per item, counts what it could not keep, keeps the newest items
of a batch larger than the tier and counts its stores once; ``read`` returns a
block where it is without moving it and drops a corrupt record (``BlockRemoved``);
``clear`` drops every block.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvfleet.agent.tiers import BlockMeta, block_charge
from kvfleet.agent.tiers.slab import SlabStore
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec, SsdTierSpec, TierSettings
from tests.agent.tiers.conftest import BLOCK_SHAPE, SSD_SLOT_BYTES, Factory, make_block, small_settings

META = BlockMeta(hash=2**64 - 1, dtype="float16", shape=BLOCK_SHAPE, raw_nbytes=int(np.prod(BLOCK_SHAPE)) * 2,
                 parent=2**64 - 1, token_ids=(2**32 - 1,) * 16)


def gpu_off(ssd: Path, cpu_blocks: int, ssd_blocks: int = 0, **ssd_kw: object) -> TierSettings:
    """The gpu tier off; cpu and ssd sized with ``block_charge`` (cpu without watermark demotion)."""
    s = small_settings(ssd)
    cpu = MemoryTierSpec(high_watermark=1.0, low_watermark=1.0)
    cpu = dataclasses.replace(cpu, capacity_bytes=cpu_blocks * block_charge(Tier.CPU, cpu, META))
    sspec = dataclasses.replace(s.ssd, enabled=ssd_blocks > 0, **ssd_kw)  # type: ignore[arg-type]
    sspec = dataclasses.replace(sspec, capacity_bytes=ssd_blocks * block_charge(Tier.SSD, sspec, META))
    return dataclasses.replace(s, gpu=dataclasses.replace(s.gpu, enabled=False), cpu=cpu, ssd=sspec)


def items(hashes: range) -> list[tuple[int, np.ndarray, int | None, tuple[int, ...]]]:
    return [(h, make_block(h), None, tuple(range(16))) for h in hashes]


def removed(events: EventBuffer, medium: str) -> list[object]:
    batch = events.drain()
    return [h for e in (batch.events if batch else []) if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes]


def test_block_charge_sizes_a_tier_in_blocks(tmp_path: Path, manager_factory: Factory) -> None:
    # one slot, 64-byte aligned already
    assert block_charge(Tier.CPU, MemoryTierSpec(), META) == META.raw_nbytes
    assert block_charge(Tier.CPU, MemoryTierSpec(codec="fp8_e4m3"), META) < META.raw_nbytes
    assert block_charge(Tier.SSD, SsdTierSpec(), META) == SSD_SLOT_BYTES
    assert SlabStore.block_charge(SsdTierSpec(direct_io=False), META) == SSD_SLOT_BYTES
    files = block_charge(Tier.SSD, SsdTierSpec(backend="files"), META)
    assert META.raw_nbytes < files < META.raw_nbytes + 300
    for backend in ("", "files"):
        # no watermark demotion: the tier fills up to what its capacity holds, later writes find no room
        m = manager_factory(gpu_off(tmp_path / (backend or "slab"), cpu_blocks=0, ssd_blocks=5,
                                    backend=backend, high_watermark=1.0, low_watermark=1.0))
        for h in range(8):
            m.put(h, make_block(h), tier=Tier.SSD, token_ids=range(16))
            m.drain(10)
        held = m.blocks_in(Tier.SSD)
        assert held == 5 if backend == "" else 5 <= held < 8
        if backend == "":  # a tier smaller than a slab file gets a file of its own size
            assert (tmp_path / "slab" / "slab-00000.kvs").stat().st_size == 4096 + 5 * SSD_SLOT_BYTES


def test_the_cpu_tier_is_an_lru_when_nothing_in_memory_is_below_it(tmp_path: Path, manager_factory: Factory,
                                                                    events: EventBuffer) -> None:
    m = manager_factory(gpu_off(tmp_path / "ssd", cpu_blocks=4))
    for h in range(6):
        assert m.put(h, make_block(h), tier=Tier.CPU) is Tier.CPU
    m.put(2, make_block(2), tier=Tier.CPU)  # touched: now the most recent
    m.put(6, make_block(6), tier=Tier.CPU)
    assert removed(events, "CPU") == [0, 1, 3]
    assert [m.locate(h) for h in range(7)] == [None, None, Tier.CPU, None, Tier.CPU, Tier.CPU, Tier.CPU]
    assert m.metrics.evictions.labels(tier="cpu")._value.get() == 3


def test_the_cpu_lru_block_goes_to_the_ssd_writers(tmp_path: Path, manager_factory: Factory) -> None:
    m = manager_factory(gpu_off(tmp_path / "ssd", cpu_blocks=4, ssd_blocks=8))
    for h in range(6):
        m.put(h, make_block(h), tier=Tier.CPU)
    assert m.drain(10)
    assert [m.locate(h) for h in range(6)] == [Tier.SSD, Tier.SSD] + [Tier.CPU] * 4
    np.testing.assert_array_equal(m.read(0), make_block(0))


def test_put_many_ends_as_a_put_per_item(tmp_path: Path, manager_factory: Factory,
                                         events: EventBuffer) -> None:
    one = manager_factory(gpu_off(tmp_path / "a", cpu_blocks=6), sink=EventBuffer())
    many = manager_factory(gpu_off(tmp_path / "b", cpu_blocks=6))
    for batch in (range(0, 4), range(4, 8), range(2, 5), range(8, 11)):
        for h, block, parent, toks in items(batch):
            one.put(h, block, Tier.CPU, parent, toks)
        assert many.put_many(items(batch), Tier.CPU) == 0
    assert [many.locate(h) for h in range(11)] == [one.locate(h) for h in range(11)]
    assert list(many.index.lru[Tier.CPU]) == list(one.index.lru[Tier.CPU])
    for k in list(many.index.lru[Tier.CPU]):  # the batch's rows landed in their own slots
        np.testing.assert_array_equal(many.read(k), make_block(int(k)))
    assert many.metrics.stores.labels(tier="cpu")._value.get() == 11
    stored = [h for e in events.drain().events  # type: ignore[union-attr]
              if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == list(range(11))
    # a batch larger than the tier: its newest items are kept, the others counted as not kept
    assert many.put_many(items(range(20, 29)), Tier.CPU) == 3
    assert sorted(many.index.lru[Tier.CPU]) == list(range(23, 29))


def test_read_leaves_a_block_where_it_is_and_drops_a_corrupt_record(tmp_path: Path, manager_factory: Factory,
                                                                     events: EventBuffer) -> None:
    m = manager_factory(gpu_off(tmp_path / "ssd", cpu_blocks=2, ssd_blocks=8, backend="files"))
    m.put_many(items(range(4)), Tier.CPU)
    assert m.drain(10)
    assert m.locate(0) is Tier.SSD
    np.testing.assert_array_equal(m.read(0), make_block(0))
    assert m.drain(10) and m.locate(0) is Tier.SSD  # no promotion queued
    events.drain()
    path = next((tmp_path / "ssd").glob("i0000000000000001.kvb"))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert m.read(1) is None
    assert removed(events, "SSD") == [1] and m.locate(1) is None
    assert m.clear() == 3 and all(m.locate(h) is None for h in range(4))


@pytest.mark.parametrize("codec", ["fp8_e4m3"])
def test_put_many_into_a_compressed_tier_takes_the_usual_path(tmp_path: Path, manager_factory: Factory,
                                                              codec: str) -> None:
    s = gpu_off(tmp_path / "ssd", cpu_blocks=3)
    cpu = dataclasses.replace(s.cpu, codec=codec)
    s = dataclasses.replace(
        s, cpu=dataclasses.replace(cpu, capacity_bytes=3 * block_charge(Tier.CPU, cpu, META)))
    m = manager_factory(s)
    assert m.put_many(items(range(5)), Tier.CPU) == 0
    assert [m.locate(h) for h in range(5)] == [None, None, Tier.CPU, Tier.CPU, Tier.CPU]


def _rows(hashes: list[int]) -> tuple[list[int], np.ndarray, list[int | None], list[tuple[int, ...]]]:
    """``put_rows`` arguments for ``hashes``: their blocks as the rows of one array."""
    return (hashes, np.stack([make_block(h) for h in hashes]), [h - 1 if h % 3 else None for h in hashes],
            [tuple(range(h, h + 16)) for h in hashes])


def test_put_rows_ends_as_put_many(tmp_path: Path, manager_factory: Factory) -> None:
    """Rows of one array end like the same items through ``put_many``: placements, LRU order, bytes,
    store counts, events and what was not kept; with blocks already held, a hash given twice, a batch
    larger than the tier, and a tier that is not the batch path (the gpu tier on)."""
    sinks = EventBuffer(), EventBuffer()
    many = manager_factory(gpu_off(tmp_path / "a", cpu_blocks=6), sink=sinks[0])
    rows = manager_factory(gpu_off(tmp_path / "b", cpu_blocks=6), sink=sinks[1])
    for batch in ([0, 1, 2, 3], [4, 5, 6, 7], [2, 3, 8, 2], list(range(20, 29))):
        hs, blocks, parents, toks = _rows(batch)
        skipped = many.put_many(list(zip(hs, blocks, parents, toks, strict=True)), Tier.CPU)
        assert rows.put_rows(hs, blocks, parents, toks, tier=Tier.CPU) == skipped
        assert list(rows.index.lru[Tier.CPU]) == list(many.index.lru[Tier.CPU])
    assert skipped == 3
    for k in list(rows.index.lru[Tier.CPU]):
        np.testing.assert_array_equal(rows.read(k), make_block(int(k)))
    assert rows.metrics.stores.labels(tier="cpu")._value.get() == many.metrics.stores.labels(
        tier="cpu")._value.get()
    a, b = sinks[0].drain(), sinks[1].drain()
    assert a is not None and b is not None and a.events == b.events
    with pytest.raises(ValueError, match="one of each per block"):
        rows.put_rows([1, 2], np.zeros((1, 8), np.float16), [None, None], [(), ()], tier=Tier.CPU)
    on = manager_factory(small_settings(tmp_path / "c"))  # gpu on: a put per row
    assert on.put_rows(*_rows([1, 2, 3]), tier=Tier.GPU) == 0
    assert [on.locate(h) for h in (1, 2, 3)] == [Tier.GPU] * 3
    np.testing.assert_array_equal(on.get(2), make_block(2))
