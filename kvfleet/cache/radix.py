"""Radix tree over block-aligned token sequences: "how much of this prompt is cached, and where".

The SGLang ``RadixCache`` idea at block granularity: a path from the root
spells a token sequence; any two sequences share the nodes of their common
prefix; insert splits a node at the block where sequences diverge. Each node
holds, for its run of ``k`` blocks:

- ``key``: the tokens, as little-endian ``uint32`` bytes (``k·block_size·4``);
  matching compares whole nodes with one ``bytes.startswith`` (memcmp in C)
  and needs no hashing for the cached part of a prompt;
- ``hashes``: the chained block hashes (numpy), computed once at insert, for
  the whole new suffix in one vectorised call (:mod:`kvfleet.cache.hashing`);
- ``block_ids`` (numpy ``int64``), ``tiers`` (numpy ``int8`` tier ranks);
- ``lock_count``, ``last_access`` (a logical clock), ``hit_count``.

Eviction is leaf-LRU: :meth:`RadixTree.evict` frees blocks from the tail of
the least recently used unlocked leaf first (a leaf emptied this way is
removed and its parent may become the next candidate); an ancestor of a
locked node is never freed because :meth:`RadixTree.lock` pins the whole path
to the root. Candidates sit in a lazy min-heap keyed by ``last_access``:
stale entries are skipped when popped, so ``match_prefix`` and ``insert`` cost
O(path length) and never scan the tree.

Every insert emits ``BlockStored`` and every eviction ``BlockRemoved`` (medium =
the blocks' tier) to the ``sink`` (see :mod:`kvfleet.cache.events`).
Invariants are property-tested against a reference model in
``tests/cache/test_radix_property.py``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.cache.errors import LockedError
from kvfleet.cache.events import EventSink, null_sink, removed, stored
from kvfleet.cache.hashing import BlockHasher, as_tokens
from kvfleet.cache.tiers import Tier

_TIERS: list[Tier] = sorted(Tier, key=lambda t: t.rank)
_EMPTY_IDS = np.empty(0, dtype=np.int64)
_EMPTY_TIERS = np.empty(0, dtype=np.int8)


class Node:
    """A run of blocks on one edge of the tree (see module doc for the fields)."""

    __slots__ = (
        "__weakref__",
        "block_ids",
        "children",
        "hashes",
        "hit_count",
        "key",
        "last_access",
        "lock_count",
        "parent",
        "tiers",
    )

    def __init__(
        self,
        key: bytes,
        hashes: npt.NDArray[Any],
        block_ids: npt.NDArray[np.int64],
        tiers: npt.NDArray[np.int8],
        parent: Node | None,
        tick: int,
    ) -> None:
        self.key = key
        self.hashes = hashes
        self.block_ids = block_ids
        self.tiers = tiers
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.lock_count = 0
        self.last_access = tick
        self.hit_count = 0

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def __repr__(self) -> str:
        return f"Node(blocks={self.num_blocks}, children={len(self.children)}, lock={self.lock_count})"


@dataclass(frozen=True)
class MatchResult:
    """What :meth:`RadixTree.match_prefix` found.

    ``num_tokens``: matched tokens (a multiple of the block size);
    ``block_ids``/``block_hashes``/``tier_ranks``: one entry per matched block,
    in sequence order (``tier_ranks`` are :attr:`Tier.rank` values, see
    :meth:`tiers`); ``node``: the deepest node touched, to :meth:`RadixTree.lock`.
    """

    num_tokens: int
    block_ids: npt.NDArray[np.int64]
    block_hashes: npt.NDArray[Any]
    tier_ranks: npt.NDArray[np.int8]
    node: Node

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def tiers(self) -> list[Tier]:
        """The tier of every matched block."""
        return [_TIERS[r] for r in self.tier_ranks.tolist()]


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`RadixTree.insert` added: ``num_new_blocks`` blocks with ``new_block_hashes``,
    ``num_existing_blocks`` already present; ``node`` is the node holding the last block."""

    num_existing_blocks: int
    num_new_blocks: int
    new_block_hashes: npt.NDArray[Any]
    new_block_ids: npt.NDArray[np.int64]
    node: Node


@dataclass(frozen=True)
class Evicted:
    """Blocks freed by :meth:`RadixTree.evict` from one node (tail-first order reversed: sequence order)."""

    block_ids: npt.NDArray[np.int64]
    block_hashes: npt.NDArray[Any]
    tier: Tier


class LockReceipt:
    """Holds a lock on a node's path; :meth:`release` (or leaving the ``with``) unlocks it once."""

    __slots__ = ("_node", "_tree")

    def __init__(self, tree: RadixTree, node: Node) -> None:
        self._tree: RadixTree | None = tree
        self._node = node

    @property
    def active(self) -> bool:
        return self._tree is not None

    def release(self) -> None:
        tree, self._tree = self._tree, None
        if tree is not None:
            tree._unlock(self._node)

    def __enter__(self) -> LockReceipt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RadixTree:
    """Block-aligned prefix index with leaf-LRU eviction and path locks (see module doc)."""

    def __init__(self, block_size: int = 16, hasher: BlockHasher | None = None,
                 sink: EventSink = null_sink) -> None:
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(block_size=block_size)
        if self.hasher.block_size != block_size:
            raise ValueError("hasher.block_size must equal block_size")
        self.sink = sink
        self._bb = 4 * block_size  # bytes per block key
        self._tick = 0
        self.root = Node(b"", self._empty_hashes(), _EMPTY_IDS, _EMPTY_TIERS, None, 0)
        self.root.lock_count = 1  # the root is never evicted
        self._heap: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self._num_nodes = 0
        self.total_blocks = 0
        self.locked_blocks = 0

    def _empty_hashes(self) -> npt.NDArray[Any]:
        return self.hasher.hash_tokens(np.empty(0, dtype=np.uint32))

    # -- read path -------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int] | npt.NDArray[Any], touch: bool = True) -> MatchResult:
        """The longest cached block-aligned prefix of ``token_ids``.

        ``touch`` refreshes LRU recency and hit counts along the path (a real
        lookup); ``touch=False`` is a pure query.
        """
        q = as_tokens(token_ids)
        n = len(q) // self.block_size
        qb = q[: n * self.block_size].tobytes()
        tick = None
        if touch:
            self._tick += 1
            tick = self._tick
        node, pos, parts = self._descend(qb, n, tick, count_hits=True)
        if touch and node.parent is not None and not node.children:
            self._push(node)
        return self._result(pos, parts, node)

    def _descend(self, qb: bytes, n: int, tick: int | None,
                 count_hits: bool) -> tuple[Node, int, list[tuple[Node, int]]]:
        """Walk from the root along the ``n`` blocks of ``qb``: (deepest node, blocks matched, path).

        With a ``tick``, every node on the path gets it as its last access, and a
        node matched only partly is split first, so its unmatched tail keeps its
        own recency; without one, the walk changes nothing.
        """
        bb = self._bb
        node = self.root
        pos = 0
        parts: list[tuple[Node, int]] = []
        while pos < n:
            child = node.children.get(qb[pos * bb : (pos + 1) * bb])
            if child is None:
                break
            k = child.num_blocks
            if pos + k <= n and qb.startswith(child.key, pos * bb):
                m = k
            else:
                m = self._common_blocks(child.key, qb, pos, n)
            if tick is not None:
                if m < k:
                    child = self._split(child, m)
                child.last_access = tick
                if count_hits:
                    child.hit_count += 1
            parts.append((child, m))
            pos += m
            node = child
            if m < k:
                break
        return node, pos, parts

    def _common_blocks(self, key: bytes, qb: bytes, pos: int, n: int) -> int:
        bb = self._bb
        k = len(key) // bb
        m = min(k, n - pos)
        a = np.frombuffer(key, dtype=np.uint8, count=m * bb)
        b = np.frombuffer(qb, dtype=np.uint8, count=m * bb, offset=pos * bb)
        diff = np.flatnonzero(a != b)
        return m if diff.size == 0 else int(diff[0]) // bb

    def _result(self, pos: int, parts: list[tuple[Node, int]], node: Node) -> MatchResult:
        if not parts:
            return MatchResult(0, _EMPTY_IDS, self._empty_hashes(), _EMPTY_TIERS, node)
        if len(parts) == 1:
            c, m = parts[0]
            return MatchResult(pos * self.block_size, c.block_ids[:m], c.hashes[:m], c.tiers[:m], node)
        return MatchResult(
            pos * self.block_size,
            np.concatenate([c.block_ids[:m] for c, m in parts]),
            np.concatenate([c.hashes[:m] for c, m in parts]),
            np.concatenate([c.tiers[:m] for c, m in parts]),
            node,
        )

    # -- write path ------------------------------------------------------
    def insert(
        self,
        token_ids: Sequence[int] | npt.NDArray[Any],
        block_ids: Sequence[int] | npt.NDArray[Any] | None = None,
        tier: Tier = Tier.GPU,
    ) -> InsertResult:
        """Insert every full block of ``token_ids``.

        ``block_ids`` gives one id per full block (the ids of blocks already in
        the tree are ignored: the tree keeps its own); ``None`` stores ``-1``
        (an index without physical blocks, as the EPP's approximate mode uses).
        """
        q = as_tokens(token_ids)
        bs, bb = self.block_size, self._bb
        n = len(q) // bs
        ids = np.full(n, -1, dtype=np.int64) if block_ids is None else np.asarray(block_ids, dtype=np.int64)
        if len(ids) < n:
            raise ValueError(f"insert needs {n} block ids, got {len(ids)}")
        qb = q[: n * bs].tobytes()
        self._tick += 1
        tick = self._tick
        node, pos, _ = self._descend(qb, n, tick, count_hits=False)
        existing = pos
        if pos == n:
            if node.parent is not None and not node.children:
                self._push(node)
            return InsertResult(existing, 0, self._empty_hashes(), _EMPTY_IDS, node)
        parent_hash = node.hashes[-1] if node.num_blocks else None
        if parent_hash is not None and isinstance(parent_hash, np.integer):
            parent_hash = int(parent_hash)
        new_hashes = self.hasher.hash_tokens(q[pos * bs : n * bs], parent=parent_hash)
        new_ids = ids[pos:n].copy()
        tiers = np.full(n - pos, tier.rank, dtype=np.int8)
        leaf = Node(qb[pos * bb :], new_hashes, new_ids, tiers, node, tick)
        node.children[qb[pos * bb : (pos + 1) * bb]] = leaf
        self._num_nodes += 1
        self.total_blocks += n - pos
        self._push(leaf)
        if self.sink is not null_sink:
            parent_wire = None if parent_hash is None else parent_hash
            self.sink(
                stored(new_hashes.tolist(), parent_wire, q[pos * bs : n * bs].tolist(), bs, tier.medium))
        return InsertResult(existing, n - pos, new_hashes, new_ids, leaf)

    def _split(self, child: Node, m: int) -> Node:
        """Cut ``child`` after ``m`` blocks; returns the new upper node (which keeps recency)."""
        bb = self._bb
        upper = Node(child.key[: m * bb], child.hashes[:m], child.block_ids[:m], child.tiers[:m],
                     child.parent, child.last_access)
        upper.lock_count = child.lock_count
        upper.hit_count = child.hit_count
        parent = child.parent
        assert parent is not None
        parent.children[child.key[:bb]] = upper
        child.key = child.key[m * bb :]
        child.hashes = child.hashes[m:]
        child.block_ids = child.block_ids[m:]
        child.tiers = child.tiers[m:]
        child.parent = upper
        upper.children[child.key[:bb]] = child
        self._num_nodes += 1
        return upper

    # -- locks -----------------------------------------------------------
    def lock(self, node: Node) -> LockReceipt:
        """Pin ``node`` and its ancestors against eviction until the receipt is released."""
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.lock_count == 0:
                self.locked_blocks += n.num_blocks
            n.lock_count += 1
            n = n.parent
        return LockReceipt(self, node)

    def _unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.lock_count <= 0:
                raise LockedError("unlock of a node that is not locked")
            n.lock_count -= 1
            if n.lock_count == 0:
                self.locked_blocks -= n.num_blocks
                if not n.children:
                    self._push(n)
            n = n.parent

    @property
    def evictable_blocks(self) -> int:
        """Blocks not pinned by a lock (an upper bound on what :meth:`evict` can free)."""
        return self.total_blocks - self.locked_blocks

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    # -- eviction --------------------------------------------------------
    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._compact_heap()

    def _compact_heap(self) -> None:
        live = [(n.last_access, next(self._seq), n) for n in self._leaves()]
        heapq.heapify(live)
        self._heap = live

    def _leaves(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                yield n

    def evict(self, num_blocks: int) -> list[Evicted]:
        """Free up to ``num_blocks`` blocks, least recently used unlocked leaves first.

        Blocks leave from the tail of a leaf; a leaf that empties is removed and
        its parent becomes a candidate. Returns what was freed, per node.
        """
        out: list[Evicted] = []
        left = num_blocks
        heap = self._heap
        while left > 0 and heap:
            ts, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_count > 0 or ts != node.last_access:
                continue  # stale entry: re-pushed when it becomes a candidate again
            k = node.num_blocks
            take = min(k, left)
            cut = k - take
            freed_ids = node.block_ids[cut:]
            freed_hashes = node.hashes[cut:]
            freed_tiers = node.tiers[cut:]
            if cut == 0:
                parent = node.parent
                del parent.children[node.key[: self._bb]]
                node.parent = None
                self._num_nodes -= 1
                if parent is not self.root and not parent.children and parent.lock_count == 0:
                    self._push(parent)
            else:
                node.key = node.key[: cut * self._bb]
                node.hashes = node.hashes[:cut].copy()
                node.block_ids = node.block_ids[:cut].copy()
                node.tiers = node.tiers[:cut].copy()
                heapq.heappush(heap, (node.last_access, next(self._seq), node))
            self.total_blocks -= take
            left -= take
            lo, hi = int(freed_tiers.min()), int(freed_tiers.max())
            groups = [lo] if lo == hi else np.unique(freed_tiers).tolist()
            for rank in groups:
                if lo == hi:
                    ev = Evicted(freed_ids, freed_hashes, _TIERS[rank])
                else:
                    sel = freed_tiers == rank
                    ev = Evicted(freed_ids[sel], freed_hashes[sel], _TIERS[rank])
                tier = ev.tier
                out.append(ev)
                if self.sink is not null_sink:
                    self.sink(removed(ev.block_hashes.tolist(), tier.medium))
        return out

    # -- tiers -----------------------------------------------------------
    def set_tier(self, node: Node, tier: Tier, start: int = 0, end: int | None = None) -> None:
        """Record that blocks ``start:end`` of ``node`` now live in ``tier``."""
        node.tiers[start:end] = tier.rank

    def reset(self) -> None:
        """Drop everything (no events: the caller announces ``AllBlocksCleared``)."""
        if self.locked_blocks:
            raise LockedError("reset refused: locked nodes")
        self.root.children.clear()
        self._heap.clear()
        self._num_nodes = 0
        self.total_blocks = 0
