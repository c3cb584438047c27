"""Property-based: random insert/match/lock/evict sequences against a prefix-set reference model.

The model is the set of block-aligned prefixes (tuples of blocks) the tree
should hold. Invariants: ``match_prefix`` returns the longest prefix in the
model (so, the longest inserted common block-aligned prefix still cached); the
model stays prefix-closed (eviction never frees an ancestor before its
descendants); locked paths survive any eviction; block counts agree; evicted
hashes are exactly the hashes of the prefixes removed.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet.cache.hashing import BlockHasher
from kvfleet.cache.radix import LockReceipt, RadixTree

BS = 2
seq_st = st.lists(st.integers(min_value=0, max_value=2), min_size=0, max_size=12)


class RadixMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.hasher = BlockHasher(block_size=BS)
        self.t = RadixTree(block_size=BS, hasher=self.hasher)
        self.model: set[tuple[int, ...]] = set()
        self.by_hash: dict[int, tuple[int, ...]] = {}
        self.locks: list[tuple[LockReceipt, tuple[int, ...]]] = []

    def _blocks(self, toks: list[int]) -> list[tuple[int, ...]]:
        n = len(toks) // BS
        return [tuple(toks[: (i + 1) * BS]) for i in range(n)]

    @rule(toks=seq_st)
    def insert(self, toks: list[int]) -> None:
        self.t.insert(toks)
        hashes = self.hasher.hash_tokens(toks).tolist()
        for prefix, h in zip(self._blocks(toks), hashes, strict=True):
            self.model.add(prefix)
            self.by_hash[h] = prefix

    @rule(toks=seq_st)
    def match(self, toks: list[int]) -> None:
        got = self.t.match_prefix(toks)
        want = 0
        for prefix in self._blocks(toks):
            if prefix not in self.model:
                break
            want += 1
        assert got.num_blocks == want
        assert got.block_hashes.tolist() == self.hasher.hash_tokens(toks[: want * BS]).tolist()

    @rule(toks=seq_st)
    def lock(self, toks: list[int]) -> None:
        m = self.t.match_prefix(toks)
        if m.num_blocks:
            self.locks.append((self.t.lock(m.node), tuple(toks[: m.num_tokens])))

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(min_value=0, max_value=100))
    def unlock(self, i: int) -> None:
        receipt, _ = self.locks.pop(i % len(self.locks))
        receipt.release()

    @rule(n=st.integers(min_value=1, max_value=6))
    def evict(self, n: int) -> None:
        """Frees exactly min(n, evictable) blocks: never a locked path's, never fewer than it could."""
        pinned = {prefix for _, toks in self.locks for prefix in self._blocks(list(toks))}
        evictable = len(self.model - pinned)
        freed = self.t.evict(n)
        count = 0
        for ev in freed:
            for h in ev.block_hashes.tolist():
                assert self.by_hash[h] not in pinned
                self.model.discard(self.by_hash[h])
                count += 1
        assert count == min(n, evictable), (count, n, evictable)

    @invariant()
    def prefix_closed_and_counts_agree(self) -> None:
        if not hasattr(self, "t"):
            return
        for p in self.model:
            if len(p) > BS:
                assert p[:-BS] in self.model
        assert self.t.total_blocks == len(self.model)

    @invariant()
    def locked_paths_survive(self) -> None:
        if not hasattr(self, "t"):
            return
        for _, toks in self.locks:
            for prefix in self._blocks(list(toks)):
                assert prefix in self.model


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
