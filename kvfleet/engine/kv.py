"""The simulator's KV cache: real, deterministic bytes per block, paged on a GPU stand-in, tiered below it.

Layers (each only uses the one below):

* :func:`project_block` — a block's KV bytes: a tiny fixed projection of its
  token ids and its parent hash (``sin(token·a_j + slot·b_j + parent·c_j)`` as
  fp16, ``values_per_token`` per token). The same tokens after the same prefix
  always give the same bytes, so a transferred or tiered block is checked
  byte-for-byte against a recomputation.
* the slower tiers below the GPU (:mod:`kvfleet.engine.tiers`: the
  :class:`~kvfleet.engine.tiers.SlowTiers` seam over the node agent's tier
  manager, sized in blocks by ``engine.tiers``).
* :class:`EngineKV` — the GPU stand-in: :class:`~kvfleet.cache.blocks.BlockManager`
  (prefix cache by chained block hash, vLLM-style), a ``hash → bytes`` map of
  what the GPU holds, demotion of reclaimed GPU blocks into the slower tiers,
  promotion of slow-tier hits when the cost model says it pays, and the
  digest of a sequence's KV from which the simulated model derives its output.
  A block received from another engine is used only if its bytes equal this
  engine's own projection of it; otherwise it is dropped and counted
  (``mismatched_blocks``) and the engine keeps the bytes it computed itself.

Every store/remove on every tier is emitted as a KV event (``medium`` = tier).
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from kvfleet.cache import cost
from kvfleet.cache.blocks import BlockManager
from kvfleet.cache.events import AnyEvent, BlockRemoved, BlockStored, EventSink, null_sink, removed
from kvfleet.cache.hashing import BlockHash, BlockHasher, ExtraKeys, as_tokens, to_int64
from kvfleet.cache.tiers import Tier
from kvfleet.config.cache import CacheSettings
from kvfleet.config.engine import EngineSettings
from kvfleet.config.tiers import ModelProfile, TierSettings
from kvfleet.engine.tiers import SlowBlock, SlowTiers, open_tiers

log = logging.getLogger(__name__)

_GOLD = 0.6180339887498949


@functools.lru_cache(maxsize=8)
def _coefficients(
    values_per_token: int,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    j = np.arange(1, values_per_token + 1, dtype=np.float64)
    return ((j * _GOLD) % 1.0 * 0.37 + 0.01, (j * 0.7548776662) % 1.0 * 1.3 + 0.1,
            (j * 0.5698402910) % 1.0 + 0.05)


def project_block(token_ids: Sequence[int] | npt.NDArray[Any], parent: BlockHash | None,
                  values_per_token: int = 32) -> bytes:
    """The simulated KV bytes of one block (fp16, ``len(token_ids) × values_per_token``)."""
    a, b, c = _coefficients(values_per_token)
    toks = as_tokens(token_ids).astype(np.float64)
    slots = np.arange(len(toks), dtype=np.float64)
    p = float(to_int64(parent) % 1_000_003) if parent is not None else 0.0
    vals = np.sin(np.outer(toks, a) + np.outer(slots, b) + p * c)
    return vals.astype(np.float16).tobytes()


def _parent_phases(parents: Sequence[BlockHash | None]) -> npt.NDArray[np.float64]:
    """``to_int64(parent) % 1_000_003`` per parent as floats (0 for ``None``), as :func:`project_block`
    takes it."""
    try:  # int hashes (the default algorithms'): one pass in uint64 arithmetic, the same values exactly
        ints = np.array([0 if h is None else h for h in parents], dtype=np.uint64)
    except (TypeError, OverflowError, ValueError):  # bytes hashes (sha256 algorithms): one at a time
        return np.array([float(to_int64(h) % 1_000_003) if h is not None else 0.0 for h in parents])
    return (ints % np.uint64(1_000_003)).astype(np.float64)


def project_blocks(
    token_ids: Sequence[int] | npt.NDArray[Any], parents: Sequence[BlockHash | None], block_size: int,
    values_per_token: int = 32
) -> list[bytes]:
    """:func:`project_block` for a run of consecutive full blocks at once (one vectorised pass)."""
    n = len(parents)
    if n == 0:
        return []
    a, b, c = _coefficients(values_per_token)
    toks = as_tokens(token_ids)[: n * block_size].astype(np.float64).reshape(n, block_size)
    slots = np.arange(block_size, dtype=np.float64)
    p = _parent_phases(parents)
    phase = toks[:, :, None] * a + (slots[:, None] * b)[None, :, :] + (p[:, None] * c)[:, None, :]
    raw = np.sin(phase).astype(np.float16).reshape(n, -1)
    return [row.tobytes() for row in raw]


#: What the simulated model writes: lowercase letters and spaces.
OUTPUT_CHARS = "abcdefghijklmnopqrstuvwxyz "


def output_token(digest: int, step: int, alphabet: Sequence[int] | None = None) -> int:
    """The simulated model's token at ``step`` for a KV digest: one of :data:`OUTPUT_CHARS`, as the id the
    engine's tokenizer gives that character (``alphabet``; default: its byte, as the byte tokenizer's id)."""
    x = xxhash.xxh3_64_intdigest(struct.pack("<QQ", digest & 0xFFFFFFFFFFFFFFFF, step))
    r = x % len(OUTPUT_CHARS)
    return alphabet[r] if alphabet is not None else ord(OUTPUT_CHARS[r])


def output_alphabet(encode: Callable[[str], Any]) -> tuple[int, ...] | None:
    """The token ids of :data:`OUTPUT_CHARS` under a tokenizer's ``encode`` (each character must be one token;
    else ``None``: bytes)."""
    ids = [list(encode(ch)) for ch in OUTPUT_CHARS]
    return tuple(int(i[0]) for i in ids) if all(len(i) == 1 for i in ids) else None


# -- the GPU stand-in -----------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """What :meth:`EngineKV.admit` decided for a new sequence.

    ``gpu_cached_tokens``: prefix already on the GPU; ``promoted``: blocks
    loaded from slower tiers, per tier; ``promote_seconds``: their modelled
    read cost; ``cached_tokens``: everything prefill can skip (what the
    response reports as ``cached_tokens``); ``block_hashes``: the full blocks.
    """

    num_tokens: int
    gpu_cached_tokens: int
    cached_tokens: int
    promoted: dict[str, int] = field(default_factory=dict)
    promote_seconds: float = 0.0
    block_hashes: list[BlockHash] = field(default_factory=list)


class EngineKV:
    """Paged GPU stand-in with real bytes, demotion into :class:`SlowTiers`, cost-based promotion.

    ``tiers``: the tiers below the GPU; by default :func:`~kvfleet.engine.tiers.open_tiers` of
    ``settings.tiers`` with the default ``tiers:`` settings (and ``model``), closed by :meth:`close`.
    """

    def __init__(
        self,
        settings: EngineSettings,
        cache: CacheSettings,
        sink: EventSink = null_sink,
        tiers: SlowTiers | None = None,
        model: ModelProfile | None = None,
    ) -> None:
        self.settings = settings
        self.model: ModelProfile = model or ModelProfile()
        self.block_size = cache.block_size
        self.hasher = BlockHasher(block_size=cache.block_size, algo=cache.hash_algo, seed=cache.hash_seed)
        self.values_per_token = settings.sim_kv_values_per_token
        self.out_sink = sink
        self.gpu_data: dict[BlockHash, SlowBlock] = {}
        self.tiers: SlowTiers = tiers if tiers is not None else self._default_tiers()
        self.blocks = BlockManager(settings.num_gpu_blocks, cache.block_size, self.hasher,
                                   sink=self._on_gpu_event)
        self._incoming: dict[BlockHash, bytes] = {}  # promoted from a slower tier, during one admission
        self._received: dict[BlockHash, bytes] = {}  # transferred before their sequence was admitted
        self._demoted: list[SlowBlock] = []  # reclaimed from the GPU during one block-manager call
        self.tier_hits: dict[str, int] = {t.value: 0 for t in Tier}
        self.queries_tokens = 0
        self.hit_tokens = 0
        self.mismatched_blocks = 0

    def _default_tiers(self) -> SlowTiers:
        return open_tiers(self.settings, self.block_size, TierSettings(model=self.model), sink=self.out_sink)

    # -- event plumbing: GPU events keep gpu_data in step and demote reclaimed blocks ------------
    def _demote(self) -> None:
        """Hand the blocks reclaimed by the last block-manager call to the slower tiers, as one batch."""
        if self._demoted:
            blocks, self._demoted = self._demoted, []
            self.tiers.put_many(blocks)

    def _on_gpu_event(self, event: AnyEvent) -> None:
        if isinstance(event, BlockRemoved):  # the most frequent: one per reclaimed block
            for h in event.block_hashes:
                block = self.gpu_data.pop(h, None)
                if block is not None:
                    single = len(event.block_hashes) == 1
                    self.out_sink(event if single else removed([h], event.medium or Tier.GPU.medium))
                    self._demoted.append(block)
            return
        if isinstance(event, BlockStored):
            bs = event.block_size
            hashes = event.block_hashes
            parents = [event.parent_block_hash, *hashes[:-1]]
            fresh = project_blocks(event.token_ids, parents, bs, self.values_per_token)
            toks = event.token_ids
            incoming, received, gpu_data = self._incoming, self._received, self.gpu_data
            for i, h in enumerate(hashes):
                data = fresh[i]
                if incoming or received:  # a block promoted or transferred during this admission
                    data = incoming.pop(h, data)
                    got = received.pop(h, None)
                    if got is not None:
                        if got == fresh[i]:
                            data = got
                        else:
                            self.mismatched_blocks += 1
                gpu_data[h] = SlowBlock(h, parents[i], tuple(toks[i * bs : (i + 1) * bs]), data)
        else:
            self.gpu_data.clear()
        self.out_sink(event)

    # -- cost model ---------------------------------------------------------------------------
    def prefill_seconds(self, num_tokens: int) -> float:
        return cost.prefill_s(num_tokens, self.model.prefill_tokens_per_s)

    def read_seconds(self, tier: Tier, num_blocks: int) -> float:
        t = self.settings.tiers
        gbps = t.cpu_read_gbps if tier is Tier.CPU else t.ssd_read_gbps
        return cost.move_s(num_blocks * self.block_size * self.model.kv_bytes_per_token, gbps * 1e9)

    def promotion_pays(self, tier: Tier) -> bool:
        """The seeds' rule (:func:`kvfleet.cache.cost.promotion`) with a free write into the GPU stand-in."""
        return (cost.promotion(self.prefill_seconds(self.block_size), self.read_seconds(tier, 1), 0.0)
                is cost.Action.PROMOTE)

    # -- sequences ----------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int] | npt.NDArray[Any], extra_keys: ExtraKeys = None) -> int:
        """Leading tokens cached on the GPU (no state change)."""
        return self.blocks.num_cached_prefix_tokens(token_ids, extra_keys)

    def admit(self, seq_id: Any, token_ids: npt.NDArray[np.uint32],
              extra_keys: ExtraKeys = None) -> Admission:
        """Allocate a sequence: reuse the GPU prefix, promote slow-tier blocks that pay; raises
        OutOfBlocksError."""
        hashes: list[BlockHash] = self.hasher.hash_tokens(token_ids, extra_keys=extra_keys).tolist()
        gpu_blocks = 0
        for h in hashes:
            if h not in self.blocks.cached:
                break
            gpu_blocks += 1
        slow = self.tiers.lookup(hashes[gpu_blocks:])
        promoted: dict[str, int] = {}
        seconds = 0.0
        staged: list[BlockHash] = []
        for i, tier in enumerate(slow):
            if not self.promotion_pays(tier):
                break
            h = hashes[gpu_blocks + i]
            block = self.tiers.get(h)
            if block is None:
                break
            self._incoming[h] = block.data
            staged.append(h)
            promoted[tier.value] = promoted.get(tier.value, 0) + 1
            seconds += self.read_seconds(tier, 1)
        try:
            alloc = self.blocks.allocate(seq_id, token_ids, extra_keys=extra_keys)
        finally:
            self._demote()
            for h in staged:
                self._incoming.pop(h, None)
        for h in alloc.block_hashes:
            got = self._received.pop(h, None)
            if got is not None:  # arrived before admission, content already cached here
                self.install(h, got)
        gpu_cached = alloc.num_cached_tokens
        n_promoted = sum(promoted.values())
        cached = min(gpu_cached + n_promoted * self.block_size, len(token_ids))
        self.queries_tokens += len(token_ids)
        self.hit_tokens += cached
        self.tier_hits[Tier.GPU.value] += gpu_cached // self.block_size
        for k, v in promoted.items():
            self.tier_hits[k] += v
        return Admission(
            num_tokens=len(token_ids),
            gpu_cached_tokens=gpu_cached,
            cached_tokens=cached,
            promoted=promoted,
            promote_seconds=seconds,
            block_hashes=list(alloc.block_hashes),
        )

    def append(self, seq_id: Any, token_ids: Sequence[int]) -> None:
        try:
            self.blocks.append_tokens(seq_id, token_ids)
        finally:
            self._demote()

    def free(self, seq_id: Any) -> None:
        self.blocks.free(seq_id)

    def block(self, block_hash: BlockHash) -> SlowBlock | None:
        """A block held on the GPU (for a transfer to a decode engine)."""
        return self.gpu_data.get(block_hash)

    def expected_blocks(self, token_ids: npt.NDArray[np.uint32],
                        extra_keys: ExtraKeys = None) -> dict[BlockHash, bytes]:
        """This engine's own bytes of every full block of a prompt (what a transferred block must equal)."""
        hashes: list[BlockHash] = self.hasher.hash_tokens(token_ids, extra_keys=extra_keys).tolist()
        data = project_blocks(token_ids, [None, *hashes[:-1]], self.block_size, self.values_per_token)
        return dict(zip(hashes, data, strict=True))

    def receive(self, block_hash: BlockHash, data: bytes) -> bool:
        """A block transferred from another engine: install it, or stage it until its sequence is admitted.

        Returns ``False`` when it was refused at once (its bytes differ from ours, counted).
        """
        if block_hash in self.gpu_data:
            return self.install(block_hash, data)
        if len(self._received) > 4 * self.settings.num_gpu_blocks:
            self._received.clear()  # never grow without bound on stray blocks
        self._received[block_hash] = data
        return True

    def install(self, block_hash: BlockHash, data: bytes) -> bool:
        """Take received bytes for a GPU block only if they equal our own projection; else drop and count
        them."""
        held = self.gpu_data.get(block_hash)
        if held is None:
            return False
        own = project_blocks(held.token_ids, [held.parent], self.block_size, self.values_per_token)
        if not own or own[0] != data:
            self.mismatched_blocks += 1
            return False
        if held.data != data:  # e.g. a lossy slow-tier copy: the exact bytes replace it
            self.gpu_data[block_hash] = SlowBlock(held.block_hash, held.parent, held.token_ids, data)
        return True

    def digest(self, token_ids: npt.NDArray[np.uint32], block_hashes: Sequence[BlockHash]) -> int:
        """xxh3 over the KV bytes of the full blocks (as held on the GPU) and the tail tokens."""
        h = xxhash.xxh3_64()
        for bh in block_hashes:
            block = self.gpu_data.get(bh)
            h.update(block.data if block is not None else b"\xff" * 8)
        tail = token_ids[len(block_hashes) * self.block_size :]
        h.update(np.ascontiguousarray(tail, dtype="<u4").tobytes())
        return h.intdigest()

    @property
    def usage(self) -> float:
        return self.blocks.usage

    def reset(self) -> None:
        """Forget everything on every tier (raises LockedError while sequences run) and zero the counters."""
        self.blocks.reset()
        self.tiers.clear()
        self._incoming.clear()
        self._received.clear()
        self._demoted.clear()
        self.tier_hits = {t.value: 0 for t in Tier}
        self.queries_tokens = self.hit_tokens = self.mismatched_blocks = 0

    def close(self) -> None:
        """Close the tiers below the GPU (their queued writes land first; see :class:`SlowTiers`)."""
        self.tiers.close()
