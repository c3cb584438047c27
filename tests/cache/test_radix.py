"""Radix tree: match/insert/split, tiers, locks, leaf-LRU eviction order, events."""

from __future__ import annotations

import numpy as np
import pytest

from kvfleet.cache.errors import LockedError
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.hashing import BlockHasher
from kvfleet.cache.radix import RadixTree
from kvfleet.cache.tiers import Tier


def test_insert_match_and_split() -> None:
    t = RadixTree(block_size=4)
    r = t.insert(range(12), [10, 11, 12])
    assert r.num_new_blocks == 3 and t.total_blocks == 3
    r2 = t.insert([0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9, 9], [10, 11, 20])
    assert (r2.num_existing_blocks, r2.num_new_blocks) == (2, 1)
    assert t.num_nodes == 3  # split into [0..7] + two children
    m = t.match_prefix(range(14))
    assert m.num_tokens == 12 and m.block_ids.tolist() == [10, 11, 12]
    assert m.block_hashes.tolist() == BlockHasher(block_size=4).hash_tokens(range(12)).tolist()
    assert t.match_prefix([0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9]).block_ids.tolist() == [10, 11, 20]
    assert t.match_prefix([0, 1, 2]).num_tokens == 0
    assert t.match_prefix([5, 1, 2, 3]).num_tokens == 0


def test_partial_node_match_returns_block_aligned_prefix() -> None:
    t = RadixTree(block_size=2)
    t.insert(range(10))
    m = t.match_prefix([0, 1, 2, 3, 4, 99, 6, 7])
    assert m.num_tokens == 4 and m.num_blocks == 2


def test_tiers_are_reported_per_block() -> None:
    t = RadixTree(block_size=2)
    t.insert(range(6), tier=Tier.CPU)
    m = t.match_prefix(range(6))
    t.set_tier(m.node, Tier.SSD, start=2)
    assert t.match_prefix(range(6)).tiers() == [Tier.CPU, Tier.CPU, Tier.SSD]


def test_events_on_insert_and_evict() -> None:
    buf = EventBuffer()
    t = RadixTree(block_size=2, sink=buf)
    t.insert(range(4), tier=Tier.CPU)
    t.insert([0, 1, 7, 7])
    t.evict(1)
    batch = buf.drain()
    assert batch is not None
    st = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in st] == [2, 1]
    assert st[0].medium == "CPU" and st[1].parent_block_hash == st[0].block_hashes[0]
    rm = [e for e in batch.events if isinstance(e, BlockRemoved)]
    assert len(rm) == 1 and len(rm[0].block_hashes) == 1


def test_evicts_least_recently_used_leaf_tail_first() -> None:
    t = RadixTree(block_size=2)
    t.insert([1, 1, 2, 2, 3, 3])  # A
    t.insert([4, 4, 5, 5])  # B
    t.match_prefix([1, 1, 2, 2, 3, 3])  # A is now most recent
    freed = t.evict(1)
    assert t.match_prefix([4, 4, 5, 5], touch=False).num_tokens == 2  # B lost its tail block first
    freed += t.evict(2)
    assert t.match_prefix([4, 4, 5, 5], touch=False).num_tokens == 0
    assert t.match_prefix([1, 1, 2, 2, 3, 3], touch=False).num_tokens == 4
    assert sum(len(e.block_hashes) for e in freed) == 3 and t.total_blocks == 2


def test_locked_path_is_never_evicted() -> None:
    t = RadixTree(block_size=2)
    t.insert(range(8))
    t.insert([0, 1, 2, 3, 9, 9])
    node = t.match_prefix(range(8)).node
    with t.lock(node) as receipt:
        assert t.evictable_blocks == 1  # only the [9, 9] branch
        t.evict(100)
        assert t.match_prefix(range(8)).num_tokens == 8
        assert receipt.active
    assert not receipt.active
    receipt.release()  # idempotent
    t.evict(100)
    assert t.total_blocks == 0


def test_reset_refused_while_locked() -> None:
    t = RadixTree(block_size=2)
    t.insert(range(4))
    receipt = t.lock(t.match_prefix(range(4)).node)
    with pytest.raises(LockedError):
        t.reset()
    receipt.release()
    t.reset()
    assert t.total_blocks == 0 and t.match_prefix(range(4)).num_tokens == 0


def test_sha256_tree_and_index_only_blocks() -> None:
    t = RadixTree(block_size=16, hasher=BlockHasher(block_size=16, algo="sha256_cbor"))
    r = t.insert(np.arange(40))
    assert r.new_block_ids.tolist() == [-1, -1]
    assert isinstance(t.match_prefix(np.arange(40)).block_hashes[1], bytes)
    r2 = t.insert(np.arange(48))
    assert (r2.new_block_hashes.tolist()
            == BlockHasher(block_size=16, algo="sha256_cbor").hash_tokens(np.arange(48))[2:].tolist())


def test_insert_needs_enough_block_ids() -> None:
    with pytest.raises(ValueError, match="block ids"):
        RadixTree(block_size=2).insert(range(6), [1])
