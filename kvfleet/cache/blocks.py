"""Paged KV blocks: a free-list pool, and a vLLM-style block manager with a prefix cache.

Two structures, two jobs:

:class:`BlockPool`
    the physical pool of ``num_blocks`` block ids, vectorised (numpy free stack):
    ``allocate(n)`` / ``free(ids)``. The radix tree draws its blocks from it.

:class:`BlockManager`
    per-sequence block tables the way vLLM's ``KVCacheManager`` keeps them:
    allocate a sequence reusing cached full blocks by hash, append tokens (a new
    block at each boundary), per-block refcounts, ``fork`` for parallel sampling
    and beam search (the child shares every block; appending into a shared
    partial block copies it first: copy-on-write), ``free``, and ``reset``.
    Freed full blocks stay cached, unreferenced, in an LRU free queue and are
    reclaimed only when a fresh block is needed, least recently freed first and,
    among blocks freed together, the chain tail first (vLLM frees in reverse).
    Blocks that hold no full, hashed content are reclaimed before any cached one.

Invariants (property-tested in ``tests/cache/test_blocks_property.py``):
refcounts are never negative; a block is free (in the queue) iff its refcount
is 0; a cached hash maps to exactly one block, which carries that hash; an
allocation that cannot be satisfied raises :class:`OutOfBlocksError` and
changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.cache.errors import LockedError, OutOfBlocksError, UnknownSequenceError
from kvfleet.cache.events import AllBlocksCleared, EventSink, null_sink, removed, stored
from kvfleet.cache.hashing import BlockHash, BlockHasher, ExtraKeys, as_tokens


class BlockPool:
    """A fixed set of block ids ``0..num_blocks-1`` with O(1) vectorised allocate/free.

    Double frees and foreign ids raise ``ValueError`` (checked with a bitmap),
    so a caller bug can never hand one block to two owners.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
        self._top = num_blocks
        self._in_use = np.zeros(num_blocks, dtype=np.bool_)
        self._mark = np.zeros(num_blocks, dtype=np.int64)  # duplicate detection scratch

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._top

    def allocate(self, n: int) -> npt.NDArray[np.int64]:
        """``n`` free block ids; raises :class:`OutOfBlocksError` (nothing taken) if short."""
        if n > self._top:
            raise OutOfBlocksError(n, self._top)
        self._top -= n
        ids = self._stack[self._top : self._top + n][::-1].copy()
        self._in_use[ids] = True
        return ids

    def free(self, ids: npt.NDArray[np.int64] | Sequence[int]) -> None:
        """Return blocks to the pool."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.num_blocks:
            raise ValueError(f"block id out of range 0..{self.num_blocks - 1}")
        if not self._in_use[arr].all():
            raise ValueError("double free of a KV block")
        self._mark[arr] = np.arange(arr.size)
        if (self._mark[arr] != np.arange(arr.size)).any():
            raise ValueError("the same KV block freed twice in one call")
        self._in_use[arr] = False
        self._stack[self._top : self._top + arr.size] = arr[::-1]
        self._top += arr.size


@dataclass(frozen=True)
class Allocation:
    """Result of :meth:`BlockManager.allocate`.

    ``block_ids``: the sequence's block table; ``num_cached_tokens``: leading
    tokens whose KV was already cached (prefill can skip them);
    ``block_hashes``: hashes of the sequence's full blocks.
    """

    block_ids: list[int]
    num_cached_tokens: int
    block_hashes: list[BlockHash]


@dataclass(frozen=True)
class AppendResult:
    """Result of :meth:`BlockManager.append_tokens`.

    ``new_block_ids``: blocks added to the table; ``copies``: ``(src, dst)``
    pairs the engine must copy (copy-on-write of a shared partial block).
    """

    new_block_ids: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int]
    hashes: list[BlockHash]
    extra_keys: ExtraKeys = None


class BlockManager:
    """vLLM-style block tables over a fixed pool with a hash-keyed prefix cache (see module doc)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        hasher: BlockHasher | None = None,
        sink: EventSink = null_sink,
        medium: str = "GPU",
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(block_size=block_size)
        if self.hasher.block_size != block_size:
            raise ValueError("hasher.block_size must equal block_size")
        self.sink = sink
        self.medium = medium
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # LRU free queue: front = reclaimed first. Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._seqs: dict[Any, _Seq] = {}
        self.hits = 0
        self.queries = 0

    # -- read-only views -------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (cached or empty): what a new allocation can use."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, seq_id: Any) -> list[int]:
        return list(self._get(seq_id).blocks)

    def sequence_hashes(self, seq_id: Any) -> list[BlockHash]:
        return list(self._get(seq_id).hashes)

    def num_cached_prefix_tokens(self, token_ids: Sequence[int] | npt.NDArray[Any],
                                 extra_keys: ExtraKeys = None) -> int:
        """How many leading tokens are cached (lookup only: no refcount, no LRU touch)."""
        hashes = self.hasher.hash_tokens(token_ids, extra_keys=extra_keys)
        n = 0
        for h in hashes.tolist():
            if h not in self.cached:
                break
            n += 1
        return n * self.block_size

    # -- mutations -------------------------------------------------------
    def allocate(self, seq_id: Any, token_ids: Sequence[int] | npt.NDArray[Any],
                 extra_keys: ExtraKeys = None) -> Allocation:
        """Give a new sequence its block table, reusing the longest cached prefix.

        Every cached full block counts; an engine that must recompute the last
        token (as vLLM does for a fully cached prompt) decides that itself.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        tokens = as_tokens(token_ids)
        hashes: list[BlockHash] = self.hasher.hash_tokens(tokens, extra_keys=extra_keys).tolist()
        hit_blocks: list[int] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hit_blocks.append(b)
        total = -(-len(tokens) // self.block_size)
        fresh = total - len(hit_blocks)
        free_hits = sum(1 for b in hit_blocks if self.ref_cnt[b] == 0)
        available = len(self._free) - free_hits
        if fresh > available:
            raise OutOfBlocksError(fresh, available)
        self.queries += len(tokens)
        self.hits += len(hit_blocks) * self.block_size
        for b in hit_blocks:
            self._incref(b)
        blocks = list(hit_blocks)
        new_full: list[int] = []
        for i in range(len(hit_blocks), total):
            b = self._take_fresh()
            blocks.append(b)
            if i < len(hashes):
                new_full.append(i)
        seq = _Seq(tokens=tokens.tolist(), blocks=blocks, hashes=hashes, extra_keys=extra_keys)
        self._seqs[seq_id] = seq
        self._register(seq, new_full)
        return Allocation(block_ids=list(blocks), num_cached_tokens=len(hit_blocks) * self.block_size,
                          block_hashes=list(hashes))

    def append_tokens(self, seq_id: Any, token_ids: Sequence[int]) -> AppendResult:
        """Append decoded tokens; opens a block at each boundary, copy-on-write on shared partials."""
        seq = self._get(seq_id)
        new_tokens = [int(t) for t in token_ids]
        bs = self.block_size
        n_after = len(seq.tokens) + len(new_tokens)
        need = -(-n_after // bs) - len(seq.blocks)
        last_partial = len(seq.tokens) % bs != 0
        cow = last_partial and bool(new_tokens) and self.ref_cnt[seq.blocks[-1]] > 1
        if need + int(cow) > len(self._free):
            raise OutOfBlocksError(need + int(cow), len(self._free))
        copies: list[tuple[int, int]] = []
        new_ids: list[int] = []
        if cow:
            src = seq.blocks[-1]
            dst = self._take_fresh()
            self._decref(src)
            seq.blocks[-1] = dst
            copies.append((src, dst))
            new_ids.append(dst)
        first_new_full = len(seq.hashes)
        seq.tokens.extend(new_tokens)
        for _ in range(need):
            b = self._take_fresh()
            seq.blocks.append(b)
            new_ids.append(b)
        n_full = len(seq.tokens) // bs
        if n_full > first_new_full:
            parent = seq.hashes[-1] if seq.hashes else None
            more = self.hasher.hash_tokens(seq.tokens[first_new_full * bs : n_full * bs],
                                           parent=parent).tolist()
            seq.hashes.extend(more)
            self._register(seq, list(range(first_new_full, n_full)))
        return AppendResult(new_block_ids=new_ids, copies=copies)

    def fork(self, parent_seq: Any, child_seq: Any) -> None:
        """The child shares every block of the parent (refcount + 1 each)."""
        if child_seq in self._seqs:
            raise ValueError(f"sequence {child_seq!r} already allocated")
        p = self._get(parent_seq)
        for b in p.blocks:
            self._incref(b)
        self._seqs[child_seq] = _Seq(tokens=list(p.tokens), blocks=list(p.blocks), hashes=list(p.hashes),
                                     extra_keys=p.extra_keys)

    def free(self, seq_id: Any) -> None:
        """Drop a sequence; its blocks go to the free queue tail-first, cached ones stay cached."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(seq_id)
        for b in reversed(seq.blocks):
            self._decref(b)

    def reset(self) -> None:
        """Forget every cached hash (``AllBlocksCleared``); refused while sequences hold blocks."""
        if self._seqs:
            raise LockedError(f"reset refused: {len(self._seqs)} sequences still hold blocks")
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._free = OrderedDict((b, None) for b in range(self.num_blocks))
        self.sink(AllBlocksCleared())

    # -- internals -------------------------------------------------------
    def _get(self, seq_id: Any) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None

    def _incref(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            del self._free[b]
        self.ref_cnt[b] += 1

    def _decref(self, b: int) -> None:
        rc = self.ref_cnt[b] - 1
        if rc < 0:
            raise AssertionError(f"negative refcount on block {b}")
        self.ref_cnt[b] = rc
        if rc == 0:
            self._free[b] = None
            if self.block_hash[b] is None:
                self._free.move_to_end(b, last=False)

    def _take_fresh(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                self.sink(removed([h], self.medium))
        self.ref_cnt[b] = 1
        return b

    def _register(self, seq: _Seq, block_indices: list[int]) -> None:
        """Put newly full blocks into the prefix cache and announce them (``BlockStored``)."""
        bs = self.block_size
        announced: list[int] = []
        for i in block_indices:
            h = seq.hashes[i]
            b = seq.blocks[i]
            if h in self.cached:
                continue  # same content already cached in another block: keep that one
            self.cached[h] = b
            self.block_hash[b] = h
            announced.append(i)
        if announced and self.sink is not null_sink:
            # One event per run of consecutive blocks, parent = the hash before the run.
            start = prev = announced[0]
            for i in [*announced[1:], -1]:
                if i != prev + 1:
                    parent = seq.hashes[start - 1] if start > 0 else None
                    self.sink(
                        stored(seq.hashes[start : prev + 1], parent, seq.tokens[start * bs : (prev + 1) * bs],
                               bs, self.medium)
                    )
                    start = i
                prev = i
