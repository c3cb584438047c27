"""Engine adapter of the write path: decoded ``KVEventBatch`` → index operations for one pod.

Keys are the 64-bit form of the engine's block hashes (:func:`~kvfleet.cache.hashing.to_int64`)
when the engine hashes like the picker does (same algorithm, block size and seed:
kvfleet's engines, or vLLM with ``sha256_cbor``). With ``recompute_keys`` the
picker instead recomputes its own keys from the events' ``token_ids``, chained
from the key it recorded for ``parent_block_hash`` (as llm-d's indexer does), so
pods whose hash differs (vLLM's builtin ``hash``) still line up. A stored event
whose parent is unknown cannot be keyed and is counted as an orphan.

Events carry no extra keys, so a chain whose first block was salted
(``cache_salt``) or LoRA/multimodal-keyed cannot be recomputed. Once a pod has
shown that it hashes like the picker (some recomputed key equalled its hash),
a first block whose hash differs from the recomputation is such a block: its
engine hashes are used as keys (they equal the picker's salted keys) and its
children chain from them. Until then (or on a pod that hashes differently) the
recomputed keys stand, and salted requests miss on that pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints, to_int64
from kvfleet.cache.tiers import Tier
from kvfleet.epp.index import BlockIndex


@dataclass
class IngestStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    bad_medium: int = 0


class PodEventApplier:
    """Applies one pod's batches, in sequence order, to the shared index."""

    def __init__(self, pod: str, index: BlockIndex, hasher: BlockHasher, recompute_keys: bool = False) -> None:
        self.pod = pod
        self.index = index
        self.hasher = hasher
        self.recompute_keys = recompute_keys
        self.stats = IngestStats()
        self._engine_to_key: dict[int, int] = {}
        #: None until known: does this pod hash like the picker (same algorithm, block size, seed)?
        self.hashes_like_us: bool | None = None

    def reset(self) -> None:
        """Forget the pod's blocks (before a full resync)."""
        self.index.clear_pod(self.pod)
        self._engine_to_key.clear()

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.stats.cleared += 1
                self.reset()

    def _tier(self, medium: str | None) -> Tier | None:
        try:
            return Tier.from_medium(medium)
        except ValueError:
            self.stats.bad_medium += 1
            return None

    def _stored(self, ev: BlockStored) -> None:
        tier = self._tier(ev.medium)
        if tier is None:
            return
        engine = [to_int64(h) for h in ev.block_hashes]
        if not self.recompute_keys:
            keys = engine
        else:
            if ev.parent_block_hash is None:
                parent = None
            else:
                pk = self._engine_to_key.get(to_int64(ev.parent_block_hash))
                if pk is None:
                    self.stats.orphans += 1
                    return
                parent = pk
            n = len(engine)
            toks = ev.token_ids[: n * self.hasher.block_size]
            if self.hasher.algo == "xxh3_64":
                keys = hashes_as_ints(self.hasher.hash_tokens(toks, parent=parent))
            else:
                # sha256 chains continue from bytes; keep the int form only as a key and
                # recompute from the root when the parent is not the root (rare mixed setups).
                if parent is not None:
                    self.stats.orphans += 1
                    return
                keys = hashes_as_ints(self.hasher.hash_tokens(toks))
            if len(keys) != n:
                self.stats.orphans += 1
                return
            if keys == engine:
                self.hashes_like_us = True
            elif parent is None and self.hashes_like_us:
                keys = engine  # an extra-keyed (salted) first block: the engine's hashes are our keys
            for e, k in zip(engine, keys, strict=True):
                self._engine_to_key[e] = k
        self.stats.stored += len(keys)
        self.index.add(self.pod, keys, tier)

    def _removed(self, ev: BlockRemoved) -> None:
        tier = self._tier(ev.medium)
        if tier is None:
            return
        engine = [to_int64(h) for h in ev.block_hashes]
        keys = [self._engine_to_key.get(e, e) for e in engine] if self.recompute_keys else engine
        self.stats.removed += len(keys)
        self.index.remove(self.pod, keys, tier)
