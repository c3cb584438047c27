"""The simulator's KV: deterministic block bytes, GPU → CPU → SSD demotion with events, promotion, SSD restart.

Covers: ``project_block`` is a pure function of (tokens, parent); reclaimed GPU
blocks are demoted (BlockRemoved GPU, BlockStored CPU, then SSD) with the same
bytes; a later request is served from the slower tier and reports it as cached;
a new ``LocalTiers`` over the same directory re-indexes valid block files,
re-announces them, and drops a corrupt one; an entry named like a block file
that is not one (a directory, a FIFO, a dangling symlink, an unreadable file)
is skipped, left in place, logged once and counted, and an engine over such a
directory starts and serves; a received block is used only if
its bytes equal the engine's own (else dropped and counted), whether it lands
before or after its sequence is admitted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvfleet.cache.events import AnyEvent, BlockRemoved, BlockStored
from kvfleet.cache.tiers import Tier
from kvfleet.config import load
from kvfleet.engine.kv import EngineKV, project_block
from kvfleet.engine.localtiers import LocalTiers, SlowBlock
from tests.engine.conftest import EngineFactory


def make_kv(tmp_path: Path, events: list[AnyEvent], **tiers: object) -> EngineKV:
    s = load(None, {"engine": {"num_gpu_blocks": 8, "tiers": tiers}})
    return EngineKV(s.engine, s.cache, sink=events.append)


def test_block_bytes_are_deterministic_and_prefix_dependent() -> None:
    toks = list(range(16))
    a = project_block(toks, 123, 32)
    assert a == project_block(toks, 123, 32)
    assert len(a) == 16 * 32 * 2
    assert a != project_block(toks, 124, 32)
    assert a != project_block([t + 1 for t in toks], 123, 32)


def test_eviction_demotes_to_cpu_then_ssd_and_a_hit_promotes(tmp_path: Path) -> None:
    events: list[AnyEvent] = []
    kv = make_kv(tmp_path, events, cpu_blocks=2, ssd_dir=str(tmp_path / "ssd"))
    first = np.arange(64, dtype=np.uint32)  # 4 blocks
    adm = kv.admit("a", first)
    gpu_bytes = {h: kv.block(h).data for h in adm.block_hashes}  # type: ignore[union-attr]
    kv.free("a")
    kv.admit("b", np.arange(10_000, 10_128, dtype=np.uint32))  # 8 blocks: reclaims all of "a"
    kv.free("b")
    removed_gpu = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes]
    assert set(adm.block_hashes) <= set(removed_gpu)
    media = {e.medium for e in events if isinstance(e, BlockStored)}
    assert {"GPU", "CPU", "SSD"} <= media
    assert len(list((tmp_path / "ssd").glob("*.kvb"))) >= 2
    # The first prompt again: nothing on the GPU, everything below it, promoted because it pays.
    again = kv.admit("c", first)
    assert again.gpu_cached_tokens == 0
    assert again.cached_tokens == 64
    assert sum(again.promoted.values()) == 4 and again.promote_seconds > 0
    for h in again.block_hashes:
        assert kv.block(h).data == gpu_bytes[h]  # type: ignore[union-attr]


def test_ssd_tier_survives_a_restart_and_drops_corrupt_files(tmp_path: Path) -> None:
    settings = load(None, {"engine": {"tiers": {"ssd_dir": str(tmp_path)}}}).engine.tiers
    tiers = LocalTiers(settings, 16)
    blocks = [SlowBlock(h, None, tuple(range(16)), project_block(range(16), None, 8)) for h in (11, 22, 33)]
    for b in blocks:
        tiers.put(b)
    files = sorted(tmp_path.glob("*.kvb"))
    assert len(files) == 3
    files[0].write_bytes(files[0].read_bytes()[:-3])  # truncate one
    (tmp_path / "foreign.kvb").write_bytes(b"not a block")
    events: list[AnyEvent] = []
    again = LocalTiers(settings, 16, sink=events.append)
    assert again.corrupt_files == 2 and again.recovered_blocks == 2
    again.announce()
    announced = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert len(announced) == 2 and all(e.medium == Tier.SSD.medium for e in events if isinstance(e, BlockStored))
    assert again.lookup([b.block_hash for b in blocks if b.block_hash in announced]) == [Tier.SSD, Tier.SSD]
    for h in announced:
        got = again.get(h)
        assert got is not None and got.data == next(b.data for b in blocks if b.block_hash == h)


def _foreign_entries(d: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Entries named like block files that are not readable block files; returns their names."""
    (d / "00000000000000aa.kvb").mkdir()
    (d / "00000000000000aa.kvb" / "inside").write_bytes(b"x")
    os.mkfifo(d / "00000000000000bb.kvb")
    (d / "00000000000000cc.kvb").symlink_to(d / "nowhere")
    locked = d / "00000000000000dd.kvb"
    locked.write_bytes(b"unreadable")
    locked.chmod(0)
    (d / "00000000000000ee.tmp").mkdir()  # a directory named like a partial write
    if os.geteuid() == 0:  # permissions do not stop root: make the read fail as it would for anyone else
        real_open = os.open

        def deny(path: object, flags: int, *args: object, **kw: object) -> int:
            if Path(str(path)).name == locked.name:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", deny)  # os.open is how the tier opens block files
    return ["00000000000000aa.kvb", "00000000000000bb.kvb", "00000000000000cc.kvb", locked.name]


@pytest.mark.timeout(20)  # a FIFO opened for reading would block forever
def test_foreign_entries_named_like_block_files_are_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load(None, {"engine": {"tiers": {"ssd_dir": str(tmp_path)}}}).engine.tiers
    good = SlowBlock(11, None, tuple(range(16)), project_block(range(16), None, 8))
    LocalTiers(settings, 16).put(good)
    foreign = _foreign_entries(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvfleet.engine.kv"):
        again = LocalTiers(settings, 16)
    assert again.corrupt_files == len(foreign) and again.recovered_blocks == 1
    for name in foreign:  # logged once each, and left where they are
        assert sum(name in r.getMessage() for r in caplog.records) == 1
        assert os.path.lexists(tmp_path / name)
    assert (tmp_path / "00000000000000ee.tmp").is_dir()
    got = again.get(11)
    assert got is not None and got.data == good.data
    again.put(SlowBlock(12, None, tuple(range(16, 32)), project_block(range(16, 32), None, 8)))
    again.clear()  # removes only its own files
    assert all(os.path.lexists(tmp_path / name) for name in foreign)


@pytest.mark.timeout(30)
async def test_an_engine_over_an_ssd_dir_with_foreign_entries_starts_and_serves(
    make_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    foreign = _foreign_entries(tmp_path, monkeypatch)
    eng = await make_engine(tiers={"ssd_dir": str(tmp_path)})
    tiers = eng.server.kv.tiers
    assert isinstance(tiers, LocalTiers) and tiers.corrupt_files == len(foreign)
    st, body, _ = await eng.post("/v1/completions", {"model": "llama-3-8b", "prompt": list(range(64)), "max_tokens": 2})
    assert st == 200 and body["usage"]["completion_tokens"] == 2


def test_received_blocks_are_used_only_if_they_equal_our_own(tmp_path: Path) -> None:
    """A transferred block whose bytes differ from this engine's projection is dropped and counted, before or after admission."""
    kv = make_kv(tmp_path, [])
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
