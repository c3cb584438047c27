"""Block pool and block manager: allocation, prefix reuse, COW fork, LRU reclaim order, errors, events."""

from __future__ import annotations

import numpy as np
import pytest

from kvfleet.cache.blocks import BlockManager, BlockPool
from kvfleet.cache.errors import LockedError, OutOfBlocksError, UnknownSequenceError
from kvfleet.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBuffer


def test_pool_allocate_free_and_errors() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert sorted(ids.tolist()) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1  # failed allocation took nothing
    pool.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match="twice"):
        pool.free([ids[1], ids[1]])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([7])


def test_prefix_reuse_and_events() -> None:
    """A second sequence with the same prefix reuses the cached full blocks; stored blocks are announced."""
    buf = EventBuffer()
    m = BlockManager(8, block_size=4, sink=buf)
    a = m.allocate("a", range(10))
    assert a.num_cached_tokens == 0 and len(a.block_ids) == 3
    b = m.allocate("b", [*range(8), 42, 43, 44, 45])
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert m.num_cached_prefix_tokens(range(12)) == 8
    batch = buf.drain()
    assert batch is not None
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == a.block_hashes and stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == a.block_hashes[1] and stored[1].token_ids == [42, 43, 44, 45]


def test_free_keeps_blocks_cached_until_reclaimed_lru_tail_first() -> None:
    """Freed full blocks stay reusable; a fresh allocation reclaims the oldest, chain tail first."""
    buf = EventBuffer()
    m = BlockManager(4, block_size=2, sink=buf)
    a = m.allocate("a", [1, 2, 3, 4])
    m.free("a")
    assert m.num_free_blocks == 4
    assert m.allocate("again", [1, 2, 3, 4]).num_cached_tokens == 4
    m.free("again")
    m.allocate("c", [9, 9, 8, 8, 7, 7])  # needs 3 fresh blocks: 2 empty ones, then a's tail
    buf.drain()
    m.free("c")
    m.allocate("d", [5, 5])
    batch = buf.drain()
    assert batch is not None
    removed = [e for e in batch.events if isinstance(e, BlockRemoved)]
    # a's tail block went first (when c allocated), so its head is still cached now or reclaimed after c's
    # blocks
    assert m.num_cached_prefix_tokens([1, 2, 3, 4]) in (0, 2)
    assert all(len(e.block_hashes) == 1 for e in removed)
    assert a.block_hashes[1] not in m.cached


def test_fork_shares_blocks_and_copy_on_write() -> None:
    m = BlockManager(8, block_size=4)
    m.allocate("p", range(6))  # one full block + a partial one
    m.fork("p", "c")
    assert m.block_table("p") == m.block_table("c")
    assert m.ref_cnt[m.block_table("p")[0]] == 2
    r = m.append_tokens("c", [100])
    assert len(r.copies) == 1 and r.copies[0][0] == m.block_table("p")[1]
    assert m.block_table("c")[1] == r.copies[0][1] != m.block_table("p")[1]
    assert m.block_table("c")[0] == m.block_table("p")[0]
    r2 = m.append_tokens("p", [7])  # the parent's partial block is now its own: no copy
    assert r2.copies == []


def test_append_opens_blocks_at_boundaries_and_registers_hashes() -> None:
    m = BlockManager(8, block_size=4)
    m.allocate("s", range(3))
    assert m.append_tokens("s", [3]).new_block_ids == []
    assert len(m.append_tokens("s", [4]).new_block_ids) == 1
    assert m.num_cached_prefix_tokens(range(4)) == 4
    m.append_tokens("s", [5, 6, 7])
    assert m.num_cached_prefix_tokens(range(8)) == 8
    assert m.sequence_hashes("s") == m.hasher.hash_tokens(range(8)).tolist()


def test_out_of_blocks_changes_nothing() -> None:
    m = BlockManager(3, block_size=2)
    m.allocate("a", range(4))
    before = (list(m.ref_cnt), list(m._free), dict(m.cached))
    with pytest.raises(OutOfBlocksError) as exc:
        m.allocate("b", range(100, 108))
    assert exc.value.needed == 4 and exc.value.available == 1
    assert (list(m.ref_cnt), list(m._free), dict(m.cached)) == before
    with pytest.raises(OutOfBlocksError):
        m.append_tokens("a", list(range(10)))
    assert (list(m.ref_cnt), list(m._free), dict(m.cached)) == before


def test_errors_are_typed() -> None:
    m = BlockManager(4, block_size=2)
    with pytest.raises(UnknownSequenceError):
        m.free("nope")
    m.allocate("a", [1])
    with pytest.raises(ValueError, match="already"):
        m.allocate("a", [1])
    with pytest.raises(LockedError):
        m.reset()
    m.free("a")
    buf = EventBuffer()
    m.sink = buf
    m.reset()
    batch = buf.drain()
    assert batch is not None and isinstance(batch.events[-1], AllBlocksCleared)
    assert m.cached == {}


def test_usage_tracks_referenced_blocks() -> None:
    m = BlockManager(4, block_size=2)
    m.allocate("a", np.arange(4))
    assert m.usage == 0.5
    m.free("a")
    assert m.usage == 0.0
