"""Concurrency: an engine-like thread puts, looks up, gets, pins and discards while the migration
threads demote and promote through all tiers; every block read back is the block that was put
(exact for uncompressed tiers, within the fp8 bound for the quantized cpu tier), and the index
agrees with the stores at the end."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvfleet.agent.codecs import Payload
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec

from .conftest import BLOCK_NBYTES, Factory, make_block, small_settings


def test_engine_thread_against_migrations(tmp_path: Path, manager_factory: Factory) -> None:
    s = small_settings(
        tmp_path,
        gpu_blocks=6,
        ssd_blocks=30,
        cpu=MemoryTierSpec(capacity_bytes=6 * BLOCK_NBYTES, codec="fp8_e4m3", high_watermark=0.9,
                           low_watermark=0.5),
    )
    m = manager_factory(s)
    blocks = {h: make_block(h) for h in range(60)}
    errors: list[str] = []

    def engine(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for step in range(400):
            h = int(rng.integers(0, 60))
            op = step % 5
            if op in (0, 1):
                m.put(h, blocks[h])
            elif op == 2:
                m.lookup([h, (h + 1) % 60])
            elif op == 3:
                got = m.get(h)
                if got is not None:
                    x = blocks[h].astype(np.float64)
                    bound = 2.0**-4 * np.abs(x) + 2.0**-13 * np.abs(x).max() + 1e-3 * np.abs(x)
                    if got.shape != x.shape or not np.all(np.abs(got - x) <= bound):
                        errors.append(f"block {h} came back wrong")
            elif step % 20 == 4:
                m.discard([h])
            else:
                m.prefetch([h])

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert m.drain(20)
    assert errors == []
    for tier in m.order:
        held = {h for h in range(60) if m.locate(h) is tier}
        assert held == set(m.stores[tier].keys()), tier
    total = sum(m.blocks_in(t) for t in m.order)
    assert total == sum(1 for h in range(60) if m.locate(h) is not None)
    assert m.blocks_in(Tier.GPU) <= 6


def test_put_copies_into_a_host_slot_without_the_index_lock(tmp_path: Path, manager_factory: Factory,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``put`` copies a block into its host slot with the index lock free (a writer indexing a block it has
    just written must not wait for that copy), and the block reads back exact."""
    m = manager_factory(small_settings(tmp_path))
    codec = m.mover.codecs[Tier.GPU]
    original = codec.encode_into
    free: list[bool] = []

    def encode_into(block: npt.NDArray[Any], out: Payload) -> Payload:
        got: list[bool] = []

        def take() -> None:  # on another thread, as a writer indexing its block would
            got.append(m.index.lock.acquire(timeout=2))
            if got[0]:
                m.index.lock.release()

        other = threading.Thread(target=take)
        other.start()
        other.join()
        free.append(got[0])
        return original(block, out)

    monkeypatch.setattr(codec, "encode_into", encode_into)
    b = make_block(7)
    assert m.put(7, b) is Tier.GPU
    assert free == [True]
    got = m.get(7)
    assert got is not None and np.array_equal(got, b)
