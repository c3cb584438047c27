"""Stores on their own: the record format, host arena slots and views (one by one and a batch of rows), the
file store, the backend registry; KV-event chains of a stored batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfleet.agent.codecs import get_codec
from kvfleet.agent.tiers import (
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    TierFullError,
    TruncatedBlockError,
    UnknownBackendError,
    memory,
    open_store,
)
from kvfleet.agent.tiers.index import chains
from kvfleet.agent.tiers.memory import ArenaStore
from kvfleet.agent.tiers.record import BlockMeta, hash_from_key, key_name, meta_for, pack, unpack
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec, SsdTierSpec, TierSpec

from .conftest import BLOCK_NBYTES, make_block


def _meta(h: int | bytes, codec: str = "none") -> BlockMeta:
    return meta_for(h, make_block(1), codec, parent=7, token_ids=tuple(range(16)))


@pytest.mark.parametrize("h", [0, 2**64 - 1, 12345, b"\x01" * 32])
def test_record_round_trip(h: int | bytes) -> None:
    """pack/unpack keep meta and payload; key names round-trip int and bytes hashes."""
    payload = get_codec("none").encode(make_block(1))
    head, body = pack(_meta(h), payload)
    meta, out = unpack(head + bytes(body))
    assert meta == _meta(h)
    assert bytes(out) == payload.tobytes()
    assert hash_from_key(key_name(h)) == h


def test_record_detects_damage() -> None:
    """A flipped bit, a short record, and a foreign blob are typed errors with a reason."""
    head, body = pack(_meta(5), get_codec("none").encode(make_block(1)))
    raw = bytearray(head + bytes(body))
    flipped = bytearray(raw)
    flipped[-10] ^= 0x40
    with pytest.raises(CorruptBlockError) as exc:
        unpack(flipped)
    assert exc.value.reason == "corrupt"
    with pytest.raises(TruncatedBlockError):
        unpack(raw[:-1])
    with pytest.raises(CorruptBlockError) as exc:
        unpack(b"GIF89a" + bytes(100))
    assert exc.value.reason == "foreign"


def test_arena_slots_and_zero_copy_views() -> None:
    """The arena sizes its slots from the first block, hands out read-only views, and refuses when full."""
    store = open_store(Tier.CPU, MemoryTierSpec(capacity_bytes=3 * BLOCK_NBYTES, slab_bytes=2 * BLOCK_NBYTES))
    payload = get_codec("none").encode(make_block(1))
    for h in range(3):
        store.write(_meta(h), payload)
    assert store.used_bytes == 3 * BLOCK_NBYTES
    with pytest.raises(TierFullError):
        store.write(_meta(3), payload)
    _, view = store.read(1)
    assert not view.flags.writeable
    assert view.tobytes() == payload.tobytes()
    store.delete(0)
    store.write(_meta(3), payload)  # the freed slot is reused
    with pytest.raises(BlockTooLargeError):
        store.write(_meta(4), np.zeros(BLOCK_NBYTES + 1, dtype=np.uint8))
    with pytest.raises(BlockNotFoundError):
        store.read(0)


def test_gpu_arena_reports_stand_in() -> None:
    store = open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=BLOCK_NBYTES, device="host"))
    assert store.stand_in
    assert "standing in for HBM" in store.describe()
    assert not open_store(Tier.CPU, MemoryTierSpec(capacity_bytes=BLOCK_NBYTES)).stand_in


def test_file_store_write_read_delete(tmp_path: Path) -> None:
    """One record file per block; capacity counts record bytes; delete removes the file."""
    store = open_store(Tier.SSD, SsdTierSpec(capacity_bytes=2 * (BLOCK_NBYTES + 200), path=str(tmp_path),
                                             backend="files"))
    payload = get_codec("none").encode(make_block(1))
    store.write(_meta(1), payload)
    store.write(_meta(2), payload)
    with pytest.raises(TierFullError):
        store.write(_meta(3), payload)
    meta, out = store.read(1)
    assert meta.token_ids == tuple(range(16)) and bytes(out) == payload.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [key_name(1) + ".kvb", key_name(2) + ".kvb"]
    store.delete(1)
    assert not (tmp_path / (key_name(1) + ".kvb")).exists()
    with pytest.raises(BlockNotFoundError):
        store.read(1)


def test_unknown_backend_lists_names() -> None:
    with pytest.raises(UnknownBackendError, match="arena, files, redis, slab"):
        open_store(Tier.CPU, TierSpec(backend="nvme-of"))


def test_arena_lease_defers_slot_reuse() -> None:
    """A slot deleted while leased (a demotion writing from it) is not handed out until released."""
    store = open_store(Tier.CPU, MemoryTierSpec(capacity_bytes=1 * BLOCK_NBYTES))
    a, b = (get_codec("none").encode(make_block(i)) for i in (1, 2))
    store.write(_meta(1), a)
    _, view, slot = store.lease(1)  # type: ignore[attr-defined]
    store.delete(1)
    with pytest.raises(TierFullError):
        store.write(_meta(2), b)
    assert view.tobytes() == a.tobytes()
    store.release(slot)  # type: ignore[attr-defined]
    store.write(_meta(2), b)


@pytest.mark.parametrize("slab_blocks", [1, 2, 64])
def test_arena_lends_slots_beyond_its_capacity(monkeypatch: pytest.MonkeyPatch, slab_blocks: int) -> None:
    """A lent block leaves the store at once; its slot keeps its bytes until released and does not count
    against the capacity (a full store takes as many blocks as slots are lent); at most ``loan_slots``
    are lent at once; a released loan's slot is free again, so the store holds its capacity and no more."""
    monkeypatch.setattr(memory, "LOAN_BYTES", 2 * BLOCK_NBYTES)
    store = open_store(Tier.CPU, MemoryTierSpec(capacity_bytes=2 * BLOCK_NBYTES,
                                                slab_bytes=slab_blocks * BLOCK_NBYTES))
    assert isinstance(store, ArenaStore)
    blocks = [get_codec("none").encode(make_block(i)) for i in range(6)]
    store.write(_meta(0), blocks[0])
    store.write(_meta(1), blocks[1])
    assert store.full and store.loan_slots == 2
    loans = [store.lend(0), store.lend(1)]
    assert store.lend(2) is None  # both loans are out
    assert all(loan is not None for loan in loans)
    assert not store.contains(0) and store.used_bytes == 0 and store.free_slots == 2
    store.write(_meta(2), blocks[2])
    store.write(_meta(3), blocks[3])
    with pytest.raises(TierFullError):
        store.write(_meta(4), blocks[4])
    with pytest.raises(BlockNotFoundError):
        store.read(0)
    for i, loan in enumerate(loans):  # the lent views kept their blocks through the writes
        assert loan is not None and loan[0].hash == i and loan[1].tobytes() == blocks[i].tobytes()
    assert loans[0] is not None
    store.release(loans[0][2])
    assert store.full  # the released slot is free, but the capacity is taken
    with pytest.raises(TierFullError):
        store.write(_meta(4), blocks[4])
    assert store.lend(2) is not None  # one loan is free again
    store.write(_meta(4), blocks[4])
    assert loans[1] is not None
    store.release(loans[1][2])
    with pytest.raises(BlockNotFoundError):
        store.lend(9)
    assert sorted(store.keys()) == [3, 4]


class _DeviceLike(ArenaStore):
    """Slots a writer cannot write from (as the torch-device store's: ``lends`` false)."""

    lends = False


def test_stores_without_host_slots_do_not_lend(tmp_path: Path) -> None:
    """A slot store that does not lend (the torch-device store's flag) keeps its block and its capacity:
    ``lend`` returns ``None``, the block stays readable and the full store stays full; the ssd slab store
    has no slots to lend; the gpu arena standing in for HBM lends."""
    payload = get_codec("none").encode(make_block(1))
    device = _DeviceLike(Tier.GPU, MemoryTierSpec(capacity_bytes=BLOCK_NBYTES, device="host"))
    device.write(_meta(1), payload)
    assert device.loan_slots == 0 and device.lend(1) is None
    assert device.contains(1) and device.full
    with pytest.raises(TierFullError):
        device.write(_meta(2), payload)
    ssd = open_store(Tier.SSD, SsdTierSpec(capacity_bytes=4 * BLOCK_NBYTES, path=str(tmp_path)))
    assert not hasattr(ssd, "lend")
    gpu = open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=BLOCK_NBYTES, device="host"))
    gpu.write(_meta(1), payload)
    assert isinstance(gpu, ArenaStore) and gpu.lend(1) is not None


@pytest.mark.parametrize("slab_blocks", [1, 3, 64])
def test_arena_write_rows_equals_write_many(slab_blocks: int) -> None:
    """A batch of rows (copied per slab at once) ends as writing each block: the same slots, the same bytes,
    across slab boundaries, over freed slots, with a hash written twice (its last row kept), and the batch
    cut where the store is full."""
    spec = MemoryTierSpec(capacity_bytes=8 * BLOCK_NBYTES, slab_bytes=slab_blocks * BLOCK_NBYTES)
    rows_store, each_store = open_store(Tier.CPU, spec), open_store(Tier.CPU, spec)
    assert isinstance(rows_store, ArenaStore) and isinstance(each_store, ArenaStore)
    codec = get_codec("none")

    def batch(hs: list[int]) -> tuple[list[BlockMeta], np.ndarray]:
        return [_meta(h) for h in hs], np.stack([codec.encode(make_block(h)) for h in hs])

    for store in (rows_store, each_store):
        store.write(_meta(100), codec.encode(make_block(100)))  # sizes the slots
        store.write_many([(_meta(h), codec.encode(make_block(h))) for h in (101, 102)])
        store.delete(101)
    for hs in ([1, 2, 3], [4, 2, 5], [6, 7, 8, 9]):
        metas, rows = batch(hs)
        n = rows_store.write_rows(metas, rows)
        assert n == each_store.write_many(list(zip(metas, rows, strict=True)))
    assert n == 1  # 8 slots: 100, 102 and 1..6 (2 rewritten), then 6 of the last batch fits
    for store in (rows_store, each_store):  # free slots for whole batches
        for gone in (1, 3, 4, 5, 102):
            store.delete(gone)
    for hs in ([10, 11], [12, 13, 14]):
        metas, rows = batch(hs)
        each = list(zip(metas, rows, strict=True))
        assert rows_store.write_rows(metas, rows) == each_store.write_many(each)
    held = sorted(rows_store.keys())
    assert held == sorted(each_store.keys())
    assert [rows_store._index[h][0] for h in held] == [each_store._index[h][0] for h in held]  # same slots
    assert rows_store.used_bytes == each_store.used_bytes
    for h in list(rows_store.keys()):
        assert rows_store.read(h)[1].tobytes() == codec.encode(make_block(int(h))).tobytes() == \
            each_store.read(h)[1].tobytes(), h


def test_chains_of_a_stored_batch() -> None:
    """Blocks that chain forwards or backwards (freed tail first) are one run, in chain order; a block
    that is not full, or does not chain, is a run of its own."""
    def m(h: int, parent: int | None, n: int = 4) -> BlockMeta:
        return BlockMeta(h, parent=parent, token_ids=tuple(range(n)))

    forward = [m(1, None), m(2, 1), m(3, 2)]
    backward = [m(13, 12), m(12, 11), m(11, 10)]
    partial = [m(21, 20, n=2)]
    stray = [m(31, 99), m(41, 98)]
    runs = chains(forward + backward + partial + stray, 4)
    assert [[x.hash for x in r] for r in runs] == [[1, 2, 3], [11, 12, 13], [21], [31], [41]]
    assert chains([], 4) == [] and chains([m(5, 3, n=2), m(6, 5)], 4) == [[m(5, 3, n=2)], [m(6, 5)]]
