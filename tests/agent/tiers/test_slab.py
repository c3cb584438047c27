"""The slab-file ssd backend (the ssd default): slots in preallocated files, one pwritev/preadv per
block, free-slot reuse, deletes that stay deleted across a restart, and the restart rescan that
verifies every slot — a corrupt slot, a slab file cut short, a foreign file, a leftover partial
write and a record file of the ``files`` backend (adopted into a slot) — plus a slot corrupted while
indexed, a corrupted slot met by a prefetch, a full disk (injected ENOSPC, see the test), a delete
during a read, and a calibration probe that must not fix the slot size. Every test runs twice: with
O_DIRECT slot I/O (the default) and buffered (test_slab_io.py has the I/O mode's own tests)."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

import kvfleet.agent.tiers.slab as slab
from kvfleet.agent.codecs import get_codec
from kvfleet.agent.tiers import (
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    TierFullError,
    TierIOError,
    open_store,
    slabio,
)
from kvfleet.agent.tiers.record import BlockMeta, key_name, meta_for, pack
from kvfleet.agent.tiers.slab import FILE_HEADER_SIZE, SlabStore
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import SsdTierSpec

from .conftest import BLOCK_NBYTES, SSD_SLOT_BYTES, Factory, make_block, small_settings


@pytest.fixture(autouse=True, params=[True, False], ids=["direct", "buffered"])
def io_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Run the test with every slab store of it set to direct (O_DIRECT) or buffered slot I/O."""
    direct: bool = request.param
    init = SlabStore.__init__

    def patched(self: SlabStore, tier: Tier, spec: SsdTierSpec) -> None:
        init(self, tier,
             dataclasses.replace(spec, direct_io=direct) if isinstance(spec, SsdTierSpec) else spec)

    monkeypatch.setattr(SlabStore, "__init__", patched)
    yield direct


def _meta(h: int) -> BlockMeta:
    return meta_for(h, make_block(h), "none", parent=h - 1, token_ids=tuple(range(16)))


def _store(path: Path, slots: int) -> SlabStore:
    store = open_store(Tier.SSD, SsdTierSpec(capacity_bytes=slots * SSD_SLOT_BYTES, path=str(path)))
    assert isinstance(store, SlabStore)
    return store


def _slot_offset(store: SlabStore, h: BlockHash) -> tuple[Path, int]:
    slot = store._where[h]
    f, i = divmod(slot, store._per_file)
    return store._file_path(f), FILE_HEADER_SIZE + i * store.slot_bytes


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def test_slots_in_one_file(tmp_path: Path) -> None:
    """Blocks go to fixed slots of one preallocated file; reads are exact; full and too-large are typed."""
    store = _store(tmp_path, 3)
    none = get_codec("none")
    for h in (1, 2, 3):
        assert store.write(_meta(h), none.encode(make_block(h))) == SSD_SLOT_BYTES
    assert store.slot_bytes == SSD_SLOT_BYTES and store.used_bytes == 3 * SSD_SLOT_BYTES
    assert [p.name for p in tmp_path.iterdir()] == ["slab-00000.kvs"]
    with pytest.raises(TierFullError):
        store.write(_meta(4), none.encode(make_block(4)))
    meta, payload = store.read(2)
    assert meta == _meta(2)
    np.testing.assert_array_equal(none.decode(payload, meta.dtype, meta.shape), make_block(2))
    store.delete(2)
    with pytest.raises(BlockNotFoundError):
        store.read(2)
    store.write(_meta(4), none.encode(make_block(4)))  # the freed slot is reused
    assert sorted(store.keys()) == [1, 3, 4]
    with pytest.raises(BlockTooLargeError):
        store.write(BlockMeta(9, dtype="uint8", shape=(SSD_SLOT_BYTES,)), np.zeros(SSD_SLOT_BYTES, np.uint8))
    store.close()


def test_read_into_checks_the_slot(tmp_path: Path) -> None:
    """A payload byte flipped on disk is caught by the checksum on the direct read."""
    store = _store(tmp_path, 4)
    store.write(_meta(1), get_codec("none").encode(make_block(1)))
    path, offset = _slot_offset(store, 1)
    _flip(path, offset + 4000)  # inside the payload
    with pytest.raises(CorruptBlockError):
        store.read_into(1, lambda meta, n: np.empty(n, np.uint8))
    store.close()


def test_restart_rescans_slots(tmp_path: Path, manager_factory: Factory) -> None:
    """A restarted manager re-indexes and announces valid slots, drops a corrupt slot and one cut short
    (counted), adopts a ``files``-backend record, removes a partial write, leaves a foreign file alone,
    does not bring back deleted blocks, and serves the survivors bit for bit."""
    ssd = tmp_path / "ssd"
    settings = small_settings(ssd, ssd_blocks=32)
    first = manager_factory(settings, sink=EventBuffer())
    hashes = list(range(100, 110))
    for i, h in enumerate(hashes):
        first.put(h, make_block(h), tier=Tier.SSD, parent=h - 1, token_ids=range(16 * i, 16 * i + 16))
    assert first.drain(10)
    first.discard([101])
    store = first.stores[Tier.SSD]
    assert isinstance(store, SlabStore)
    corrupt_path, corrupt_at = _slot_offset(store, 103)
    last = max(store._where, key=lambda h: store._where[h])
    cut_path, cut_at = _slot_offset(store, last)
    first.close()

    _flip(corrupt_path, corrupt_at + 2000)
    with open(cut_path, "r+b") as f:
        f.truncate(cut_at + 3000)
    (ssd / "README.txt").write_text("not a block")
    (ssd / (key_name(300) + ".kvb.tmp")).write_bytes(b"half a write")
    head, body = pack(_meta(200), get_codec("none").encode(make_block(200)))
    (ssd / (key_name(200) + ".kvb")).write_bytes(head + bytes(body))

    events = EventBuffer()
    second = manager_factory(settings, sink=events)
    valid = [h for h in hashes if h not in (101, 103, last)] + [200]
    assert second.lookup(valid).tiers == [Tier.SSD] * len(valid)
    for gone in (101, 103, last):
        assert second.locate(gone) is None
    batch = events.drain()
    assert batch is not None
    announced = {ev.block_hashes[0]: ev for ev in batch.events if isinstance(ev, BlockStored)}
    assert sorted(announced) == sorted(valid)
    assert all(ev.medium == "SSD" for ev in announced.values())
    assert announced[104].parent_block_hash == 103 and announced[104].token_ids == list(range(64, 80))
    for h in valid:
        np.testing.assert_array_equal(second.get(h), make_block(h))

    text = generate_latest(second.metrics.registry).decode()
    for reason in ("corrupt", "truncated", "foreign", "partial"):
        assert f'kvfleet_tier_dropped_records_total{{reason="{reason}",tier="ssd"}} 1.0' in text
    assert f'kvfleet_tier_reindexed_blocks_total{{tier="ssd"}} {float(len(valid))}' in text
    assert (ssd / "README.txt").exists()
    assert not list(ssd.glob("*.kvb*"))
    second.close(flush=True)  # get() promoted the blocks: write them back to slots

    third = manager_factory(settings, sink=EventBuffer())  # and the dropped ones stay dropped
    assert sorted(h for h in [*valid, 101, 103, last] if third.locate(h) is Tier.SSD) == sorted(valid)


def test_slot_corrupted_while_indexed(tmp_path: Path, manager_factory: Factory, events: EventBuffer) -> None:
    """A slot damaged after indexing reads as a miss, is dropped and announced removed."""
    m = manager_factory(small_settings(tmp_path / "ssd"))
    m.put(5, make_block(5), tier=Tier.SSD)
    assert m.drain(10)
    store = m.stores[Tier.SSD]
    assert isinstance(store, SlabStore)
    path, offset = _slot_offset(store, 5)
    _flip(path, offset + 4000)
    events.drain()
    assert m.get(5) is None and m.locate(5) is None
    assert m.metrics.errors.labels(tier="ssd", kind="corrupt")._value.get() == 1
    batch = events.drain()
    assert batch is not None and [(type(e), getattr(e, "medium", None)) for e in batch.events] == [
        (BlockRemoved, "SSD")]


def test_prefetch_of_a_corrupted_slot(tmp_path: Path, manager_factory: Factory) -> None:
    """The direct slot → memory promotion checks the record: a damaged one is dropped, not promoted."""
    m = manager_factory(small_settings(tmp_path / "ssd"))
    for h in (6, 7):
        m.put(h, make_block(h), tier=Tier.SSD)
    assert m.drain(10)
    store = m.stores[Tier.SSD]
    assert isinstance(store, SlabStore)
    path, offset = _slot_offset(store, 6)
    _flip(path, offset + 4000)
    assert m.prefetch([6, 7]) == 2
    assert m.drain(10)
    assert m.locate(6) is None and m.locate(7) is Tier.GPU
    np.testing.assert_array_equal(m.get(7), make_block(7))
    assert m.metrics.errors.labels(tier="ssd", kind="corrupt")._value.get() == 1
    assert m.stores[Tier.GPU].used_bytes == m.used_bytes(Tier.GPU)


def test_full_disk_keeps_blocks_in_memory(tmp_path: Path, manager_factory: Factory,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot writes failing with ENOSPC leave the blocks in memory, counted as no_space, the slot free.

    A real ENOSPC needs a full filesystem, which a test cannot make without privileges; the error is
    raised at the store's single write call instead (the ``files`` backend's test uses /dev/full).
    """
    failures = {"left": 3}
    real = slabio.pwrite_all

    def pwrite(fd: int, parts: list[bytes | memoryview], offset: int) -> None:
        if offset >= FILE_HEADER_SIZE and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, parts, offset)

    monkeypatch.setattr(slab, "_pwrite_all", pwrite)
    m = manager_factory(small_settings(tmp_path / "ssd", gpu_blocks=4, cpu_blocks=4))
    for h in range(8):
        m.put(h, make_block(h))
        m.drain(0.3)
    assert m.metrics.errors.labels(tier="ssd", kind="no_space")._value.get() >= 1
    for h in range(8):
        assert m.locate(h) is not None
        np.testing.assert_array_equal(m.get(h), make_block(h))
    store = m.stores[Tier.SSD]
    assert store.used_bytes == m.used_bytes(Tier.SSD)


def test_unknown_slab_header_is_left_alone(tmp_path: Path) -> None:
    """A file named like a slab but not one of ours is neither used nor overwritten."""
    (tmp_path / "slab-00000.kvs").write_bytes(b"something else" * 400)
    store = _store(tmp_path, 4)
    report = store.scan()
    assert report.dropped == {"foreign": 1}
    with pytest.raises(TierIOError):
        store.write(_meta(1), get_codec("none").encode(make_block(1)))
    assert (tmp_path / "slab-00000.kvs").read_bytes().startswith(b"something else")
    store.close()


def test_block_nbytes_fits_the_conftest_slot() -> None:
    """The fixtures size ssd capacity in slots: a test block's record plus header room is one 12 KiB slot."""
    head, body = pack(_meta(1), get_codec("none").encode(make_block(1)))
    assert slabio.slot_size(len(head) + body.nbytes + slab.HEADER_ROOM) == SSD_SLOT_BYTES
    assert BLOCK_NBYTES < SSD_SLOT_BYTES


def test_calibration_does_not_fix_the_slot_size(tmp_path: Path, manager_factory: Factory) -> None:
    """The start-up probe measures through a throw-away file: the first real block still sizes the slots."""
    m = manager_factory(small_settings(tmp_path / "ssd", calibrate=True))
    store = m.stores[Tier.SSD]
    assert isinstance(store, SlabStore) and store.slot_bytes == 0
    assert m.cost.costs[Tier.SSD].source == "calibrated"
    assert m.put(1, make_block(1), tier=Tier.SSD) is Tier.SSD
    assert m.drain(10) and m.locate(1) is Tier.SSD
    assert store.slot_bytes == SSD_SLOT_BYTES
    assert sorted(p.name for p in (tmp_path / "ssd").iterdir()) == ["slab-00000.kvs"]


def test_delete_while_read_frees_the_slot_after_the_read(tmp_path: Path) -> None:
    """A slot being read is not cleared or reused by a concurrent delete until the read ends."""
    store = _store(tmp_path, 2)
    store.write(_meta(1), get_codec("none").encode(make_block(1)))
    path, offset = _slot_offset(store, 1)
    slot, _ = store._lease(1)
    store.delete(1)
    assert slot not in store._free
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(4) == b"KVFB"  # still readable by the lease holder
    store._unlease(slot)
    assert slot in store._free
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(4) == bytes(4)
    store.close()

