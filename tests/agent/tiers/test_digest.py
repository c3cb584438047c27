"""Record checksums from a payload digest taken before the write.

Covers: a record packed with the payload's digest given equals one packed without it, and one packed
with a wrong digest fails its check when read; version-1 records (one pass over header and payload) are
still read and still checked; ``copy_digest`` copies exactly and returns the copy's digest at every
size around its chunk and for non-contiguous arrays; the staging copy comes with its digest; in a
manager, spilled puts and demotion batches hand their digests to the ssd store (the batch's taken
blocks ahead) and every block reads back intact after a restart, so a digest of the wrong block would
show as a lost block; with the cpu tier lending its slots to the writers (the default), spilled
blocks are written from their lent slots and read back intact too.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvfleet.agent.codecs import get_codec
from kvfleet.agent.tiers import CorruptBlockError, memory
from kvfleet.agent.tiers.record import (
    COPY_CHUNK,
    MAGIC,
    PREFIX_SIZE,
    BlockMeta,
    copy_digest,
    meta_for,
    pack,
    payload_digest,
    unpack,
)
from kvfleet.agent.tiers.staging import StagingSlab
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec, TierSettings
from tests.agent.tiers.conftest import Factory, make_block, small_settings


def _record(h: int = 5) -> tuple[BlockMeta, np.ndarray]:
    return (meta_for(h, make_block(h), "none", parent=7, token_ids=tuple(range(16))),
            get_codec("none").encode(make_block(h)))


def test_a_given_digest_makes_the_same_record() -> None:
    meta, payload = _record()
    assert pack(meta, payload, digest=payload_digest(payload)) == pack(meta, payload)
    aligned = pack(meta, payload, align=4096, digest=payload_digest(payload))
    assert aligned == pack(meta, payload, align=4096)
    assert unpack(aligned[0] + bytes(aligned[1]))[0] == meta


def test_a_wrong_digest_fails_the_check_when_read() -> None:
    meta, payload = _record()
    head, body = pack(meta, payload, digest=payload_digest(payload) ^ 1)
    with pytest.raises(CorruptBlockError) as exc:
        unpack(head + bytes(body))
    assert exc.value.reason == "corrupt"


def test_version_1_records_are_still_read_and_checked() -> None:
    meta, payload = _record()
    head, body = pack(meta, payload)
    header = head[PREFIX_SIZE:]
    h = xxhash.xxh3_64(header)
    h.update(body)
    v1 = struct.pack("<4sHHIQQ", MAGIC, 1, 0, len(header), body.nbytes, h.intdigest()) + header + bytes(body)
    got, out = unpack(v1)
    assert got == meta and bytes(out) == payload.tobytes()
    damaged = bytearray(v1)
    damaged[-3] ^= 0x10
    with pytest.raises(CorruptBlockError):
        unpack(damaged)
    # the same checksum under the version-2 rule is wrong
    v2_prefix = struct.pack("<4sHHIQQ", MAGIC, 2, 0, len(header), body.nbytes, h.intdigest())
    with pytest.raises(CorruptBlockError):
        unpack(v2_prefix + header + bytes(body))


@pytest.mark.parametrize("nbytes", [0, 1, COPY_CHUNK - 1, COPY_CHUNK, COPY_CHUNK + 1, 3 * COPY_CHUNK + 6])
def test_copy_digest_copies_and_hashes_the_copy(nbytes: int) -> None:
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert copy_digest(dst, src) == payload_digest(src)
    np.testing.assert_array_equal(dst, src)


def test_copy_digest_of_arrays_that_are_not_contiguous() -> None:
    base = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float16)
    src = base.T  # Fortran order
    dst = np.zeros_like(src)
    d = copy_digest(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert d == payload_digest(np.ascontiguousarray(src))
    c = np.zeros(src.shape, dtype=np.float16)  # C-ordered destination of a transposed source
    assert copy_digest(c, src) == d


def test_a_staged_copy_comes_with_its_digest() -> None:
    staging = StagingSlab(nbytes=1 << 20)
    for i in range(3):  # carved, recycled, and a one-off beyond the slab
        block = make_block(i)
        copy, digest = staging.stage(block)
        np.testing.assert_array_equal(copy, block)
        assert digest == payload_digest(copy)
    big = np.ones(2 << 20, dtype=np.uint8)  # larger than the slab: a one-off buffer
    copy, digest = staging.stage(big)
    assert not np.shares_memory(copy, big) and digest == payload_digest(big)


def _lone_cpu(ssd: Path, cpu_blocks: int, ssd_blocks: int) -> TierSettings:
    """The gpu tier off: cpu is the fastest tier, demoted by watermark into ssd."""
    s = small_settings(ssd, cpu_blocks=cpu_blocks, ssd_blocks=ssd_blocks)
    cpu = dataclasses.replace(s.cpu, high_watermark=0.9, low_watermark=0.5)
    return dataclasses.replace(s, gpu=MemoryTierSpec(enabled=False), cpu=cpu, migration_batch=8)


@pytest.mark.parametrize("lend", [False, True], ids=["staged", "lent"])
def test_demotions_and_spills_write_with_digests_and_read_back_intact(
        tmp_path: Path, manager_factory: Factory, monkeypatch: pytest.MonkeyPatch, lend: bool) -> None:
    if not lend:
        monkeypatch.setattr(memory, "LOAN_BYTES", 0)
    settings = _lone_cpu(tmp_path / "ssd", cpu_blocks=16, ssd_blocks=64)
    m = manager_factory(settings)
    store = m.mover.stores[Tier.SSD]
    given: dict[Any, bool] = {}
    write = store.write
    cpu = m.mover.stores[Tier.CPU]
    assert isinstance(cpu, memory.SlotStore)
    lent: list[Any] = []
    lend_slot = cpu.lend

    def lend_spy(h: Any) -> Any:
        loan = lend_slot(h)
        if loan is not None:
            lent.append(h)
        return loan

    cpu.lend = lend_spy  # type: ignore[method-assign, assignment]

    def spy(meta: BlockMeta, payload: Any, digest: int | None = None) -> int:
        given[meta.hash] = digest is not None
        return write(meta, payload, digest)

    store.write = spy  # type: ignore[method-assign]
    for h in range(15):  # over the high watermark: the demotion thread moves a batch down
        m.put(h, make_block(h), tier=Tier.CPU)
    assert m.drain(10)
    demoted = [h for h in range(15) if m.locate(h) is Tier.SSD]
    assert len(demoted) >= 3, demoted
    for h in range(15, 40):  # faster than the thread: a full tier spills its LRU blocks to the writers
        m.put(h, make_block(h), tier=Tier.CPU)
    assert m.drain(10)
    on_ssd = [h for h in range(40) if m.locate(h) is Tier.SSD]
    # a lent block is hashed by the store as it writes it (one pass over the slot either way)
    assert given and all(given[h] for h in on_ssd if h not in lent), given
    assert bool(lent) is lend and set(lent) <= set(on_ssd), lent
    assert m.metrics.migrations.labels(src="cpu", dst="ssd", kind="demote")._value.get() >= 3
    m.close()
    again = manager_factory(settings)  # a restart: every block is read from its record
    for h in on_ssd:
        assert again.locate(h) is Tier.SSD
        np.testing.assert_array_equal(again.read(h), make_block(h))
    assert again.metrics.errors.labels(tier="ssd", kind="corrupt")._value.get() == 0
