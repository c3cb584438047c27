"""The slab store's slot I/O: O_DIRECT (default) or buffered, large page-aligned blocks read and
written in place (no bounce copy) and unaligned ones through the bounce buffer, the fallback when a
filesystem refuses O_DIRECT, and ``forget`` (a block moved to a faster tier keeps its record for a
restart, ``delete`` clears it)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

import numpy as np
import pytest

import kvfleet.agent.tiers.slab as slab
from kvfleet.agent.tiers import CorruptBlockError, open_store
from kvfleet.agent.tiers.record import BlockMeta, meta_for
from kvfleet.agent.tiers.slab import SlabStore
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import SsdTierSpec

from .conftest import SSD_SLOT_BYTES, make_block


def _meta(h: int) -> BlockMeta:
    return meta_for(h, make_block(h), "none", parent=h - 1, token_ids=tuple(range(16)))


def _store(path: Path, slots: int, direct: bool = True) -> SlabStore:
    store = open_store(Tier.SSD, SsdTierSpec(capacity_bytes=slots * SSD_SLOT_BYTES, path=str(path),
                                             direct_io=direct))
    assert isinstance(store, SlabStore)
    return store


@pytest.mark.parametrize("io_mode", [True, False], ids=["direct", "buffered"])
def test_slot_io_mode(tmp_path: Path, io_mode: bool) -> None:
    """With direct_io the slot fds carry O_DIRECT (and records still round-trip); buffered ones do not."""
    store = _store(tmp_path, slots=4, direct=io_mode)
    meta = _meta(1)
    store.write(meta, make_block(1).view(np.uint8).reshape(-1))
    assert store.direct is io_mode
    flags = fcntl.fcntl(store._io_fds[0], fcntl.F_GETFL)
    assert bool(flags & os.O_DIRECT) is io_mode
    assert ("direct I/O" in store.describe()) is io_mode
    _, payload = store.read(meta.hash)
    assert np.array_equal(payload, make_block(1).view(np.uint8).reshape(-1))
    store.close()


def test_direct_io_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL, injected: the tmpfs here accepts it) gets buffered I/O,
    one log line, same data."""
    real_open = os.open

    def refuse_direct(path: object, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse_direct)
    with caplog.at_level(logging.WARNING):
        store = _store(tmp_path, slots=4)
        meta = _meta(2)
        store.write(meta, make_block(2).view(np.uint8).reshape(-1))
    assert not store.direct
    assert "refuses O_DIRECT" in caplog.text
    _, payload = store.read(meta.hash)
    assert np.array_equal(payload, make_block(2).view(np.uint8).reshape(-1))
    store.close()


def test_forget_keeps_the_record_delete_does_not(tmp_path: Path) -> None:
    """``forget`` (block moved to a faster tier) frees the slot but a restart still finds the record;
    ``delete`` clears it; a forgotten slot that is reused holds only the new block."""
    store = _store(tmp_path, slots=2)
    for h in (1, 2):
        store.write(_meta(h), make_block(h).view(np.uint8).reshape(-1))
    store.forget(1)
    store.delete(2)
    assert not store.contains(1) and not store.contains(2)
    store.close()
    again = _store(tmp_path, slots=2)
    report = again.scan()
    assert [m.hash for m in report.blocks] == [1]
    _, payload = again.read(1)
    assert np.array_equal(payload, make_block(1).view(np.uint8).reshape(-1))
    again.forget(1)
    again.write(_meta(3), make_block(3).view(np.uint8).reshape(-1))
    again.write(_meta(4), make_block(4).view(np.uint8).reshape(-1))  # both slots now reused
    again.close()
    third = _store(tmp_path, slots=2)
    assert sorted(m.hash for m in third.scan().blocks) == [3, 4]
    third.close()


def _big(i: int, aligned: bool) -> np.ndarray:
    """A 256 KiB fp16 block, in page-aligned memory or one byte off a page (unaligned)."""
    from kvfleet.agent.tiers.memory import page_aligned

    n = 256 << 10
    raw = page_aligned(n + 4096)
    start = 0 if aligned else 2
    block = raw[start : start + n].view(np.float16)
    block[:] = np.random.default_rng(i).standard_normal(n // 2).astype(np.float16)
    return block


@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned", "unaligned"])
def test_large_blocks_direct_without_bounce(tmp_path: Path, aligned: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Under direct I/O a large record gets a page-sized head and a page-aligned payload is written
    and read in place (no bounce copy; counted here by spying on the bounce buffer); an unaligned
    one goes through the bounce buffer. Both round-trip, survive a restart and fail their checksum
    when a payload byte flips."""
    from kvfleet.agent.tiers.memory import page_aligned
    from kvfleet.agent.tiers.record import PREFIX_SIZE

    store = open_store(Tier.SSD, SsdTierSpec(capacity_bytes=64 << 20, path=str(tmp_path), direct_io=True))
    assert isinstance(store, SlabStore) and store.direct
    bounced: list[int] = []
    get = store._bounce.get

    def spy(n: int) -> np.ndarray:
        bounced.append(n)
        return get(n)

    monkeypatch.setattr(store._bounce, "get", spy)
    blocks = {h: _big(h, aligned) for h in (1, 2)}
    for h, b in blocks.items():
        store.write(meta_for(h, b, "none", None, ()), b.view(np.uint8))
    assert (PREFIX_SIZE + store._slots[store._where[1]].header_len) % 4096 == 0
    dests = []

    def alloc(meta: BlockMeta, n: int) -> np.ndarray:
        d = page_aligned(n + 4096)[0 if aligned else 8 :][:n]
        dests.append(d)
        return d

    for h, b in blocks.items():
        store.read_into(h, alloc)
        assert np.array_equal(dests[-1], b.view(np.uint8))
    assert bool(bounced) is not aligned
    store.close()
    again = open_store(Tier.SSD, SsdTierSpec(capacity_bytes=64 << 20, path=str(tmp_path), direct_io=True))
    assert isinstance(again, SlabStore)
    assert sorted(m.hash for m in again.scan().blocks) == [1, 2]
    _, payload = again.read(2)
    assert np.array_equal(payload, blocks[2].view(np.uint8))
    slot = again._where[1]
    f, i = divmod(slot, again._per_file)
    with open(again._file_path(f), "r+b") as fh:
        fh.seek(slab.FILE_HEADER_SIZE + i * again.slot_bytes + 4096 + 1000)
        fh.write(b"\xff")
    with pytest.raises(CorruptBlockError):
        again.read_into(1, alloc)
    again.close()
