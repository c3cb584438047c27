"""The simulator's KV: deterministic block bytes, GPU → CPU → SSD demotion into the agent's tiers, promotion,
SSD restart.

Covers: ``project_block`` is a pure function of (tokens, parent); reclaimed GPU
blocks are demoted into the node agent's tier manager (BlockRemoved GPU,
BlockStored CPU, then SSD: the agent's records in its slab files) with the same
bytes, and a later request is served from the slower tier and reports it as
cached; the cpu tier is an LRU of exactly ``cpu_blocks`` blocks; a new engine
over the same SSD directory re-indexes the valid records, re-announces them
(medium SSD, parents and token ids) and drops a corrupt one, counted; a record
corrupted while held is dropped when it is read (BlockRemoved SSD) and the
block recomputed; an entry named like a record file that is not one (a
directory, a FIFO, a symlink, an unreadable file) is skipped, left in place,
logged once and counted, with either ssd backend, and an engine over such a
directory starts and serves; an ``ssd_dir`` that cannot hold the tier is a
clear error; a received block is used only if its bytes equal the engine's own
(else dropped and counted), whether it lands before or after its sequence is
admitted.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfleet.agent.tiers import TierError
from kvfleet.agent.tiers.record import PREFIX_SIZE, key_name
from kvfleet.cache.events import AnyEvent, BlockRemoved, BlockStored
from kvfleet.cache.tiers import Tier
from kvfleet.config import load
from kvfleet.engine.kv import EngineKV, project_block
from kvfleet.engine.tiers import AgentTiers, NoTiers, open_tiers
from tests.engine.conftest import EngineFactory

KVFactory = Callable[..., EngineKV]


@pytest.fixture
def make_kv() -> Iterator[KVFactory]:
    """EngineKVs with ``engine.tiers`` (and top-level ``tiers``) overrides; closed at teardown."""
    made: list[EngineKV] = []

    def make(events: list[AnyEvent] | None = None, num_gpu_blocks: int = 8,
             sections: dict[str, Any] | None = None, **tiers: object) -> EngineKV:
        s = load(None, {"engine": {"num_gpu_blocks": num_gpu_blocks, "tiers": tiers}, **(sections or {})})
        sink = events.append if events is not None else (lambda e: None)
        below = open_tiers(s.engine, s.cache.block_size, s.tiers, sink=sink)
        kv = EngineKV(s.engine, s.cache, sink=sink, tiers=below, model=s.tiers.model)
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.close()


def agent(kv: EngineKV) -> AgentTiers:
    assert isinstance(kv.tiers, AgentTiers)
    return kv.tiers


def counter(tiers: AgentTiers, metric: str, *labels: str) -> float:
    m = tiers.mgr.metrics
    value: float = m.child(getattr(m, metric), *labels)._value.get()
    return value


def stored_hashes(events: list[AnyEvent], medium: str) -> list[Any]:
    return [h for e in events if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes]


def removed_hashes(events: list[AnyEvent], medium: str) -> list[Any]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


def push_out(kv: EngineKV, base: int) -> None:
    """Admit and free a fresh prompt as long as the GPU: every block cached before is demoted."""
    n = kv.settings.num_gpu_blocks * kv.block_size
    kv.admit("fill", np.arange(base, base + n, dtype=np.uint32))
    kv.free("fill")


def record_offset(slab: Path, h: int) -> int:
    """The offset of the record of block ``h`` in a slab file (its header starts with the hash)."""
    raw = slab.read_bytes()
    key = b"\xcf" + h.to_bytes(8, "big")  # msgpack uint64, the header array's first field
    return next(o for o in slot_offsets(slab) if raw[o + PREFIX_SIZE + 1 : o + PREFIX_SIZE + 10] == key)


def test_block_bytes_are_deterministic_and_prefix_dependent() -> None:
    toks = list(range(16))
    a = project_block(toks, 123, 32)
    assert a == project_block(toks, 123, 32)
    assert len(a) == 16 * 32 * 2
    assert a != project_block(toks, 124, 32)
    assert a != project_block([t + 1 for t in toks], 123, 32)


def test_no_tier_configured_means_no_tier_manager(make_kv: KVFactory) -> None:
    assert isinstance(make_kv().tiers, NoTiers)
    assert isinstance(make_kv(ssd_dir="/nonexistent", ssd_blocks=0).tiers, NoTiers)


def test_eviction_demotes_to_cpu_then_ssd_and_a_hit_promotes(make_kv: KVFactory, tmp_path: Path) -> None:
    events: list[AnyEvent] = []
    kv = make_kv(events, cpu_blocks=2, ssd_dir=str(tmp_path / "ssd"), ssd_blocks=64)
    first = np.arange(64, dtype=np.uint32)  # 4 blocks
    adm = kv.admit("a", first)
    gpu_bytes = {h: kv.block(h).data for h in adm.block_hashes}  # type: ignore[union-attr]
    kv.free("a")
    kv.admit("b", np.arange(10_000, 10_128, dtype=np.uint32))  # 8 blocks: reclaims all of "a"
    kv.free("b")
    assert agent(kv).mgr.drain(10)  # the writes to SSD land
    assert set(adm.block_hashes) <= set(removed_hashes(events, "GPU"))
    assert {"GPU", "CPU", "SSD"} <= {e.medium for e in events if isinstance(e, BlockStored)}
    assert (tmp_path / "ssd" / "slab-00000.kvs").is_file()  # the agent's slab file, its records inside
    assert sorted(kv.tiers.lookup(adm.block_hashes)) == [Tier.CPU, Tier.CPU, Tier.SSD, Tier.SSD]
    # The first prompt again: nothing on the GPU, everything below it, promoted because it pays.
    again = kv.admit("c", first)
    assert again.gpu_cached_tokens == 0
    assert again.cached_tokens == 64
    assert again.promoted == {"cpu": 2, "ssd": 2} and again.promote_seconds > 0
    for h in again.block_hashes:
        assert kv.block(h).data == gpu_bytes[h]  # type: ignore[union-attr]
    # a promoted block stays below the GPU too (the GPU holds a copy; "c" pushed "b" out after it)
    assert agent(kv).mgr.drain(10)
    assert all(agent(kv).mgr.locate(h) is not None for h in adm.block_hashes)


def test_the_cpu_tier_is_an_lru_of_cpu_blocks(make_kv: KVFactory) -> None:
    events: list[AnyEvent] = []
    kv = make_kv(events, num_gpu_blocks=4, cpu_blocks=6)
    for i in range(4):  # 4 prompts of 4 blocks through a 4-block GPU: 12 blocks demoted, 4 at a time
        kv.admit(i, np.arange(1000 * i, 1000 * i + 64, dtype=np.uint32))
        kv.free(i)
    demoted = removed_hashes(events, "GPU")
    assert len(demoted) == 12 and sorted(stored_hashes(events, "CPU")) == sorted(demoted)
    # each prompt's blocks are freed tail first and announced on the CPU as one chain, parent first (but the
    # first batch, block by block: the cpu tier learns its slot size from the first block)
    parent: dict[object, object] = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "GPU":
            parent.update(zip(e.block_hashes, [e.parent_block_hash, *e.block_hashes[:-1]], strict=True))
    chains = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [len(e.block_hashes) for e in chains] == [1, 1, 1, 1, 4, 4]
    for e in chains:
        assert [parent[h] for h in e.block_hashes] == [e.parent_block_hash, *e.block_hashes[:-1]]
    assert removed_hashes(events, "CPU") == demoted[:6]  # the oldest make room, in order
    mgr = agent(kv).mgr
    assert [mgr.locate(h) for h in demoted] == [None] * 6 + [Tier.CPU] * 6
    assert counter(agent(kv), "evictions", "cpu") == 6
    # a batch larger than the tier: its newest blocks are kept
    kv2 = make_kv(num_gpu_blocks=4, cpu_blocks=3)
    for i in range(3):
        kv2.admit(i, np.arange(1000 * i, 1000 * i + 64, dtype=np.uint32))
        kv2.free(i)
    assert agent(kv2).mgr.blocks_in(Tier.CPU) == 3


def slot_offsets(slab: Path) -> list[int]:
    """Offsets of the records in a slab file (file header, then slots; a used slot starts with the magic)."""
    raw = slab.read_bytes()
    slot_bytes, slots = struct.unpack_from("<QQ", raw, 8)
    return [4096 + i * slot_bytes for i in range(slots)
            if raw[4096 + i * slot_bytes : 4100 + i * slot_bytes] == b"KVFB"]


def flip_payload_byte(slab: Path, offset: int) -> None:
    """Flip one byte of the payload of the record at ``offset`` (its checksum then fails)."""
    with open(slab, "r+b") as f:
        f.seek(offset)
        prefix = f.read(PREFIX_SIZE)
        header_len = struct.unpack_from("<I", prefix, 8)[0]
        f.seek(offset + PREFIX_SIZE + header_len + 3)
        b = f.read(1)
        f.seek(offset + PREFIX_SIZE + header_len + 3)
        f.write(bytes([b[0] ^ 0xFF]))


def test_ssd_tier_survives_a_restart_and_drops_corrupt_records(make_kv: KVFactory, tmp_path: Path) -> None:
    prompt = np.arange(500, 564, dtype=np.uint32)  # 4 blocks
    events: list[AnyEvent] = []
    kv = make_kv(events, cpu_blocks=0, ssd_dir=str(tmp_path), ssd_blocks=64)
    first = kv.admit("a", prompt)
    own = {h: kv.block(h).data for h in first.block_hashes}  # type: ignore[union-attr]
    kv.free("a")
    push_out(kv, 50_000)
    assert agent(kv).mgr.drain(10)
    assert set(stored_hashes(events, "SSD")) == set(first.block_hashes)
    kv.close()
    slab = tmp_path / "slab-00000.kvs"
    offsets = slot_offsets(slab)
    assert len(offsets) == 4  # the prompt's blocks
    flip_payload_byte(slab, offsets[0])
    (tmp_path / "foreign.kvb").write_bytes(b"not a block")

    events.clear()
    again = make_kv(events, cpu_blocks=0, ssd_dir=str(tmp_path), ssd_blocks=64)
    tiers = agent(again)
    assert counter(tiers, "reindexed", "ssd") == 3
    assert (counter(tiers, "dropped", "ssd", "corrupt") == 1
            and counter(tiers, "dropped", "ssd", "foreign") == 1)
    announced = [e for e in events if isinstance(e, BlockStored)]
    assert all(e.medium == "SSD" for e in announced) and len(announced) == 3
    kept = {e.block_hashes[0]: e for e in announced}
    for i, h in enumerate(first.block_hashes):
        if h in kept:  # parents and token ids come back from the record headers
            assert kept[h].token_ids == prompt[16 * i : 16 * (i + 1)].tolist()
            assert kept[h].parent_block_hash == (first.block_hashes[i - 1] if i else None)
    lost = [h for h in first.block_hashes if h not in kept]
    assert len(lost) == 1
    adm = again.admit("b", prompt)  # served from SSD up to the dropped block, recomputed after it
    n = first.block_hashes.index(lost[0])
    assert adm.promoted.get("ssd", 0) == n and adm.cached_tokens == 16 * n
    assert all(again.block(h).data == own[h] for h in first.block_hashes)  # type: ignore[union-attr]


def test_a_record_corrupted_while_held_is_dropped_when_read(
    make_kv: KVFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = np.arange(700, 764, dtype=np.uint32)
    events: list[AnyEvent] = []
    kv = make_kv(events, cpu_blocks=0, ssd_dir=str(tmp_path), ssd_blocks=64,
                 sections={"tiers": {"ssd": {"direct_io": False}}})
    first = kv.admit("a", prompt)
    own = {h: kv.block(h).data for h in first.block_hashes}  # type: ignore[union-attr]
    kv.free("a")
    push_out(kv, 60_000)
    assert agent(kv).mgr.drain(10)
    assert kv.tiers.lookup(first.block_hashes) == [Tier.SSD] * 4
    slab = tmp_path / "slab-00000.kvs"
    target = first.block_hashes[2]
    assert isinstance(target, int)  # the default hash (xxh3_64) keys blocks by int
    flip_payload_byte(slab, record_offset(slab, target))
    events.clear()
    with caplog.at_level(logging.ERROR, logger="kvfleet.agent.tiers"):
        adm = kv.admit("b", prompt)
    assert adm.promoted == {"ssd": 2} and adm.cached_tokens == 32  # up to the corrupt block
    assert removed_hashes(events, "SSD") == [target] and "corrupt" in caplog.text
    assert kv.tiers.lookup([target]) == []
    assert counter(agent(kv), "errors", "ssd", "corrupt") == 1
    assert all(kv.block(h).data == own[h] for h in first.block_hashes)  # type: ignore[union-attr]


def _foreign_entries(d: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """Entries named like record files that are not readable record files: (foreign ones, unreadable ones)."""
    (d / f"{key_name(0xAA)}.kvb").mkdir()
    (d / f"{key_name(0xAA)}.kvb" / "inside").write_bytes(b"x")
    os.mkfifo(d / f"{key_name(0xBB)}.kvb")
    (d / f"{key_name(0xCC)}.kvb").symlink_to(d / "nowhere")
    elsewhere = d.parent / f"{d.name}-elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (elsewhere / "record").write_bytes(b"KVFB" + bytes(60))
    # a link to a regular file is not followed either
    (d / f"{key_name(0xEE)}.kvb").symlink_to(elsewhere / "record")
    locked = d / f"{key_name(0xDD)}.kvb"
    locked.write_bytes(b"unreadable")
    locked.chmod(0)
    (d / f"{key_name(0xFF)}.kvb.tmp").mkdir()  # a directory named like a partial write
    if os.geteuid() == 0:  # permissions do not stop root: make the read fail as it would for anyone else
        real_open = os.open

        def deny(path: object, flags: int, *args: object, **kw: object) -> int:
            if Path(str(path)).name == locked.name:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", deny)  # os.open is how the stores open record files
    names = [f"{key_name(k)}.kvb" for k in (0xAA, 0xBB, 0xCC, 0xEE)]
    return names, [locked.name]


@pytest.mark.timeout(20)  # a FIFO opened for reading would block forever
@pytest.mark.parametrize("backend", ["slab", "files"])
def test_foreign_entries_named_like_record_files_are_skipped_and_counted(
    make_kv: KVFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    backend: str,
) -> None:
    ssd = tmp_path / "ssd"
    sections = {"tiers": {"ssd": {"backend": backend}}}
    kv = make_kv(num_gpu_blocks=4, cpu_blocks=0, ssd_dir=str(ssd), ssd_blocks=64, sections=sections)
    prompt = np.arange(64, dtype=np.uint32)
    kv.admit("a", prompt)
    kv.free("a")
    push_out(kv, 90_000)
    assert agent(kv).mgr.drain(10)
    kv.close()
    foreign, unreadable = _foreign_entries(ssd, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvfleet.agent.tiers"):
        again = make_kv(num_gpu_blocks=4, cpu_blocks=0, ssd_dir=str(ssd), ssd_blocks=64, sections=sections)
    tiers = agent(again)
    assert counter(tiers, "reindexed", "ssd") == 4
    assert counter(tiers, "dropped", "ssd", "foreign") == len(foreign)
    assert counter(tiers, "dropped", "ssd", "io") == len(unreadable)
    for name in foreign + unreadable:  # logged once each, and left where they are
        assert sum(name in r.getMessage() for r in caplog.records) == 1, name
        assert os.path.lexists(ssd / name)
    assert (ssd / f"{key_name(0xFF)}.kvb.tmp").is_dir()
    assert again.admit("b", prompt).cached_tokens == 64
    again.free("b")
    tiers.clear()  # removes only its own records
    assert all(os.path.lexists(ssd / name) for name in foreign + unreadable)


@pytest.mark.timeout(30)
async def test_an_engine_over_an_ssd_dir_with_foreign_entries_starts_and_serves(
    make_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    foreign, unreadable = _foreign_entries(tmp_path, monkeypatch)
    eng = await make_engine(tiers={"ssd_dir": str(tmp_path), "ssd_blocks": 64})
    tiers = eng.server.kv.tiers
    assert isinstance(tiers, AgentTiers)
    assert (counter(tiers, "dropped", "ssd", "foreign") + counter(tiers, "dropped", "ssd", "io")
            == len(foreign) + len(unreadable))
    st, body, _ = await eng.post("/v1/completions",
                                 {"model": "llama-3-8b", "prompt": list(range(64)), "max_tokens": 2})
    assert st == 200 and body["usage"]["completion_tokens"] == 2


def test_an_ssd_dir_that_cannot_hold_the_tier_is_a_clear_error(tmp_path: Path) -> None:
    afile = tmp_path / "a-file"
    afile.write_bytes(b"")
    for path, why in ((afile, "is not a directory"), (afile / "below", "cannot create it")):
        s = load(None, {"engine": {"tiers": {"ssd_dir": str(path)}}})
        with pytest.raises(TierError, match=why):
            open_tiers(s.engine, s.cache.block_size, s.tiers)


def test_received_blocks_are_used_only_if_they_equal_our_own(make_kv: KVFactory) -> None:
    """A transferred block whose bytes differ from this engine's projection is dropped and counted, before or
    after admission."""
    kv = make_kv()
    toks = np.arange(500, 564, dtype=np.uint32)  # 4 blocks
    own = kv.expected_blocks(toks)
    hashes = list(own)
    forged = bytes(len(own[hashes[0]]))
    # Two arrive before the sequence is admitted (one forged, one good), two after (the same).
    assert kv.receive(hashes[0], forged) and kv.receive(hashes[1], own[hashes[1]])
    kv.admit("a", toks)
    assert kv.mismatched_blocks == 1
    assert not kv.receive(hashes[2], forged) and kv.receive(hashes[3], own[hashes[3]])
    assert kv.mismatched_blocks == 2
    assert [kv.block(h).data for h in hashes] == [own[h] for h in hashes]  # type: ignore[union-attr]
