"""Property-based: random allocate/append/fork/free sequences against a content model.

The test plays the engine: it writes each sequence's tokens into the blocks it
was given (skipping cached ones) and applies copy-on-write copies. Invariants
after every step: no negative refcount; a block is free iff unreferenced; every
cached hash maps to a block carrying it; every live sequence reads back exactly
its own tokens from its blocks (so sharing, reuse and COW never corrupt KV);
a failed allocation changes nothing.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet.cache.blocks import BlockManager
from kvfleet.cache.errors import OutOfBlocksError

BS = 2
tokens_st = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=9)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.m = BlockManager(10, block_size=BS)
        self.content: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _snapshot(self) -> tuple[Any, ...]:
        return (list(self.m.ref_cnt), list(self.m._free), dict(self.m.cached),
                {k: list(v) for k, v in self.tokens.items()})

    def _write(self, sid: int, start_token: int) -> None:
        toks = self.tokens[sid]
        table = self.m.block_table(sid)
        for i in range(start_token // BS, len(table)):
            self.content[table[i]] = toks[i * BS : (i + 1) * BS]

    @rule(toks=tokens_st)
    def allocate(self, toks: list[int]) -> None:
        sid = self.next_id
        self.next_id += 1
        before = self._snapshot()
        try:
            a = self.m.allocate(sid, toks)
        except OutOfBlocksError:
            assert self._snapshot() == before
            return
        self.tokens[sid] = list(toks)
        self._write(sid, a.num_cached_tokens)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), toks=st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=4))
    def append(self, data: st.DataObject, toks: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._snapshot()
        old_len = len(self.tokens[sid])
        try:
            r = self.m.append_tokens(sid, toks)
        except OutOfBlocksError:
            assert self._snapshot() == before
            return
        for src, dst in r.copies:
            self.content[dst] = list(self.content[src])
        self.tokens[sid] += toks
        self._write(sid, old_len - old_len % BS)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.m.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid)
        del self.tokens[sid]

    @invariant()
    def refcounts_and_free_queue_agree(self) -> None:
        if not hasattr(self, "m"):
            return
        refs = [0] * self.m.num_blocks
        for sid in self.tokens:
            for b in self.m.block_table(sid):
                refs[b] += 1
        assert refs == self.m.ref_cnt
        assert all(r >= 0 for r in self.m.ref_cnt)
        assert set(self.m._free) == {b for b, r in enumerate(self.m.ref_cnt) if r == 0}

    @invariant()
    def cache_is_consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        for h, b in self.m.cached.items():
            assert self.m.block_hash[b] == h

    @invariant()
    def sequences_read_back_their_tokens(self) -> None:
        if not hasattr(self, "m"):
            return
        for sid, toks in self.tokens.items():
            table = self.m.block_table(sid)
            got = [t for b in table for t in self.content.get(b, [])]
            assert got[: len(toks)] == toks, (sid, table)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
