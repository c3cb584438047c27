"""Engine adapter of the write path: decoded ``KVEventBatch`` → index operations for one pod.

Keys are the 64-bit form of the engine's block hashes (:func:`~kvfleet.cache.hashing.to_int64`)
when the engine hashes like the picker does (same algorithm, block size and seed:
kvfleet's engines, or vLLM with ``sha256_cbor``). With ``recompute_keys`` the
picker instead recomputes its own keys from the events' ``token_ids``, chained
from the hash it recorded for ``parent_block_hash`` (as llm-d's indexer does), so
pods whose hash differs (vLLM's builtin ``hash``) still line up.

Chaining keeps, per engine hash, the picker's key *and* its full hash: a
``sha256_cbor`` chain continues from the parent's 32 bytes, not from the 64-bit
key (follow-up turns, decode blocks and chunked prefill all store blocks with a
parent). A parent the picker never saw (stored before the subscription, or
forgotten) is resumed from the engine's own ``parent_block_hash`` when it is a
hash of the picker's algorithm: if the recomputation reproduces the engine's
hashes the pod hashes like the picker and the blocks are indexed; otherwise the
event cannot be keyed and counts as an orphan.

Once a pod has shown that it hashes like the picker, its hashes *are* the keys the recomputation would give
(equal, or the salted case below), so later stores are indexed from the engine's hashes without hashing
their tokens again: only what decides the outcome is checked per event (block size and token count, and
hashes and a parent of a form the pod's hashes take; anything else is recomputed as before). That is what
keeps ingestion up with a flood: an engine that demotes publishes one ``BlockStored`` per block, a decoding
request one per filled block. The forms: ints for ``xxh3_64``; for ``sha256_cbor`` the 32-byte hashes or
their 64-bit ints, which vLLM publishes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): such a pod's
int is its block's key, and no child needs the full hash, since a child is keyed by its own int too (the
recomputation could not even chain from a parent it never saw: that child was an orphan).

Events carry no extra keys, so a block whose hash mixed in a cache salt, a LoRA
or multimodal key cannot be recomputed. Once a pod has shown that it hashes like
the picker (some recomputed key equalled its hash), a block whose hash differs
from the recomputation is such a block: its engine hash is the key (it equals the
picker's key for the salted/LoRA request) and its children chain from it. Until
then (or on a pod that hashes differently) the recomputed keys stand, and salted
requests miss on that pod.

The engine-hash map holds only blocks whose engine hash is not the picker's key and chain value (a pod
hashing otherwise, or a salted block stored before the pod showed it hashes like the picker): a pod that
hashes like the picker costs the index's entries alone. It is bounded: an entry goes when its block has
left every tier of the pod (``BlockRemoved``), the map is emptied with the pod's entries, and beyond
``max_keys`` the least recently used entry is dropped (counted in ``key_evictions``; a later child of that
block can then only be keyed by resuming from the engine's hash).

Every event is applied on its own: one that fails (token ids outside 32 bits, a
hash of the wrong type, ...) is counted in ``rejected`` and skipped; when it was
not a ``BlockStored`` (a removal the index did not see) the pod's entries are
cleared, so no removed block stays indexed. Unknown ``medium`` names count in
``unknown_medium`` and are indexed in the slowest tier (see
:mod:`kvfleet.cache.tiers` for the names engines use).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import repeat
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvfleet.cache.events import (
    REMOVED,
    STORED,
    AllBlocksCleared,
    AnyEvent,
    BatchScanner,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from kvfleet.cache.hashing import BlockHash, BlockHasher, hashes_as_ints, to_int64
from kvfleet.cache.tiers import Tier
from kvfleet.epp.index import BlockIndex

log = logging.getLogger(__name__)
_MASK = (1 << 64) - 1
#: :meth:`PodEventApplier.apply_payload` indexes the stores it holds at this many keys at the latest
HOLD_KEYS = 1 << 14


def _int_or_32(h: object) -> bool:
    """An int hash (vLLM's 64-bit form) or a 32-byte one (``sha256_cbor``'s own)."""
    return isinstance(h, int) or (isinstance(h, bytes) and len(h) == 32)


def _engine_keys(hashes: list[int | bytes]) -> npt.NDArray[np.uint64] | list[int]:
    """:func:`to_int64` of every hash: one numpy conversion when they are all non-negative 64-bit ints (vLLM's
    int hashes), else per hash (bytes hashes, negative ints)."""
    try:
        if hashes and type(hashes[0]) is int:
            return np.array(hashes, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        pass
    return [to_int64(h) for h in hashes]


@dataclass
class IngestStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    """Blocks not indexed: their parent is unknown and cannot be resumed."""
    unknown_medium: int = 0
    """Events whose ``medium`` is not a known name (indexed in the slowest tier)."""
    rejected: int = 0
    """Events that failed to apply (skipped)."""
    key_evictions: int = 0
    """Engine-hash map entries dropped by the ``max_keys`` bound."""


class PodEventApplier:
    """Applies one pod's batches, in sequence order, to the shared index."""

    def __init__(
        self, pod: str, index: BlockIndex, hasher: BlockHasher, recompute_keys: bool = False,
        max_keys: int = 1 << 18
    ) -> None:
        self.pod = pod
        self.index = index
        self.hasher = hasher
        self.recompute_keys = recompute_keys
        self.max_keys = max(1, max_keys)
        self.stats = IngestStats()
        #: engine hash (64-bit form) → (the picker's key, the picker's full hash to chain children from)
        self._engine_to_key: OrderedDict[int, tuple[int, BlockHash]] = OrderedDict()
        #: None until known: does this pod hash like the picker (same algorithm, block size, seed)?
        self.hashes_like_us: bool | None = None
        self._scanner = BatchScanner(hasher.block_size, hasher.algo == "sha256_cbor")
        #: stores of :meth:`apply_payload` not indexed yet (:meth:`flush`):
        #: ``_held_keys[_held_from:_held_to]`` (a scanner's buffer), their tier and events
        self._held_keys = self._scanner.keys
        self._held_from = self._held_to = self._held_events = 0
        self._held_tier = Tier.GPU
        self._last_log = 0.0

    def __len__(self) -> int:
        """Entries of the engine-hash map."""
        return len(self._engine_to_key)

    def reset(self, picks: bool = True) -> None:
        """Forget the pod's blocks (before a full resync), and with ``picks`` the picker's picks on it."""
        self._drop_held()
        self.index.clear_pod(self.pod, picks)
        self._engine_to_key.clear()

    def apply(self, batch: KVEventBatch) -> int:
        """Apply every event; returns how many failed (each skipped, see the module doc).

        Engines publish one event per block as blocks move (vLLM's ``BlockRemoved`` per evicted block; the
        simulator's tiers a ``BlockStored`` and a ``BlockRemoved`` per demoted block): a run of consecutive
        removals of one medium, or of stores into one medium when the keys are the engine's hashes
        (``recompute_keys`` off, or a pod that hashes like the picker: a store is then order-free), is
        applied as one index operation. If that fails, the run's events are applied one by one, so a bad
        one is still isolated (re-applying a store or a removal is idempotent)."""
        failed = self.flush()
        events = batch.events
        i = 0
        while i < len(events):
            j = self._run_end(events, i)
            ev = events[i]
            if isinstance(ev, BlockStored) and not self._keys_are_hashes:
                failed += self._recompute_stores(cast("list[BlockStored]", events[i:j]))
                i = j
                continue
            if j - i > 1 and isinstance(ev, (BlockStored, BlockRemoved)):
                moves = cast("list[BlockStored | BlockRemoved]", events[i:j])  # one kind: see _run_end
                try:
                    if isinstance(ev, BlockRemoved):
                        hashes = [h for e in moves for h in e.block_hashes]
                        tier = self._tier(ev.medium, j - i)
                        self._removed(BlockRemoved(block_hashes=hashes, medium=ev.medium), tier)
                    else:
                        failed += self._store_run(cast("list[BlockStored]", moves))
                    i = j
                    continue
                except Exception:  # isolate the bad one below
                    pass
            for one in events[i:j]:
                failed += self._apply_one(one)
            i = j
        return failed

    def apply_payload(self, payload: bytes) -> tuple[float, int] | None:
        """Apply the batch in ``payload`` straight from its bytes when it is in vLLM's layout with every event
        valid (:class:`~kvfleet.cache.events.BatchScanner`) and its stores may be indexed by their hashes:
        what :meth:`apply` would do with it, run by run, without decoding events into objects (an engine
        step's batch of one-block events costs a few µs instead of tens). Returns (the batch's ``ts``,
        events that failed), or ``None`` with nothing applied (a store whose keys must be recomputed, a batch
        the scan declines): the caller then decodes the batch
        (:func:`~kvfleet.cache.events.decode_batch_lenient`) and calls :meth:`apply`.

        Stores into one tier are held and indexed as one operation with the stores of the batches that
        follow (an engine publishes a batch per step): until another kind of event, another tier,
        :data:`HOLD_KEYS` keys, or :meth:`flush`, which the subscriber calls after each read of a socket.
        The held keys stay where the scan wrote them; the next batch's are written after them."""
        if not self._keys_are_hashes:
            return None
        scanner = self._scanner
        at = self._held_to if self._held_keys is scanner.keys else 0
        if not scanner.fits(len(payload), at):  # larger than the lasting buffers: buffers of its own
            scanner = BatchScanner.sized(scanner.block_size, scanner.chain_bytes, len(payload))
            at = 0
        scan = scanner.scan(payload, at)
        if scan is None:
            return None
        ts, runs = scan
        if self.recompute_keys and not all(run[5] for run in runs):
            return None  # a store whose keys must be recomputed: apply() decodes the batch
        keys = scanner.keys
        failed = 0
        for kind, medium, first, count, events, _ in runs:
            if kind == STORED:
                tier = self._tier(medium, events)
                if not count:
                    continue
                if self._held_to > self._held_from and (
                        tier is not self._held_tier or self._held_keys is not keys or first != self._held_to):
                    failed += self.flush()
                if self._held_to == self._held_from:
                    self._held_keys, self._held_from, self._held_tier = keys, first, tier
                self._held_to = first + count
                self._held_events += events
                if self._held_to - self._held_from >= HOLD_KEYS:
                    failed += self.flush()
                continue
            failed += self.flush()
            try:
                if kind == REMOVED:
                    self._remove_engine(keys[first : first + count], self._tier(medium, events))
                else:
                    self.stats.cleared += 1
                    self.reset()
            except Exception as exc:  # as apply(): the run's events count as failed, a lost removal clears
                failed += self._failed(events, "BlockRemoved" if kind == REMOVED else "AllBlocksCleared", exc)
                self.reset()
        if self._held_keys is not self._scanner.keys:  # held in a batch's own buffers: indexed now
            failed += self.flush()
        return ts, failed

    def flush(self) -> int:
        """Index the stores :meth:`apply_payload` holds; returns how many events failed (counted in
        ``stats.rejected`` too)."""
        if self._held_to == self._held_from:
            return 0
        keys = self._held_keys[self._held_from : self._held_to]
        events, tier = self._held_events, self._held_tier
        self._drop_held()
        try:
            self.index.add(self.pod, keys, tier)
        except Exception as exc:  # as apply(): the stores count as failed (they are not indexed)
            return self._failed(events, "BlockStored", exc)
        self.stats.stored += len(keys)
        return 0

    def _drop_held(self) -> None:
        self._held_keys = self._scanner.keys
        self._held_from = self._held_to = self._held_events = 0

    def _failed(self, events: int, kind: str, exc: Exception) -> int:
        self.stats.rejected += events
        self._log(f"pod {self.pod}: {events} KV event(s) {kind} dropped: {exc}")
        return events

    def _run_end(self, events: list[AnyEvent], i: int) -> int:
        """End of the run of events from ``i`` that :meth:`apply` may merge into one index operation; for a
        store whose keys are recomputed, of the consecutive stores (any medium) :meth:`_recompute_stores`
        takes together."""
        ev = events[i]
        if isinstance(ev, BlockStored) and not self._keys_are_hashes:
            j = i + 1
            while j < len(events) and isinstance(events[j], BlockStored):
                j += 1
            return j
        if not isinstance(ev, (BlockRemoved, BlockStored)):
            return i + 1
        kind, medium = type(ev), ev.medium
        j = i + 1
        while j < len(events):
            nxt = events[j]
            if type(nxt) is not kind or nxt.medium != medium:
                break
            j += 1
        return j

    @property
    def _keys_are_hashes(self) -> bool:
        """Whether stores may be indexed by the engine's hashes (see the module doc)."""
        return not self.recompute_keys or self.hashes_like_us is True

    def _keyed_by_hash(self, ev: BlockStored) -> bool:
        """Whether ``ev``'s hashes are indexed as they are: ``recompute_keys`` off, or a pod that hashes like
        the picker and an event :meth:`_hash_is_key` takes."""
        return self._keys_are_hashes and (not self.recompute_keys or self._hash_is_key(ev))

    def _hash_is_key(self, ev: BlockStored) -> bool:
        """For a pod that hashes like the picker: whether ``ev``'s hashes are the keys the recomputation
        would give (what :meth:`_stored` would otherwise find out by hashing its tokens): its block size and
        token count, and hashes and parent of a form the pod's hashes take (ints; for ``sha256_cbor`` also
        32-byte hashes, see the module doc)."""
        n, bs = len(ev.block_hashes), self.hasher.block_size
        if ev.block_size != bs or len(ev.token_ids) < n * bs:
            return False
        if self.hasher.algo != "sha256_cbor":  # ints only (any int chains: :meth:`_chain_value`)
            parent = ev.parent_block_hash
            return (parent is None or isinstance(parent, int)) and all(
                map(isinstance, ev.block_hashes, repeat(int)))
        return (ev.parent_block_hash is None or _int_or_32(ev.parent_block_hash)) and all(
            map(_int_or_32, ev.block_hashes))

    def _recompute_stores(self, stores: list[BlockStored]) -> int:
        """:meth:`_apply_one` of each of ``stores`` (consecutive stores of a pod whose keys are
        recomputed), in order and with its outcome, but the one-block stores among them (a decode step's: a
        block for each of many requests) hashed in one call
        (:meth:`~kvfleet.cache.hashing.BlockHasher.hash_each`) and indexed in one add per tier. A store of
        several blocks, or whose parent is stored earlier in the run or not known, or once the pod turns out
        to hash like the picker, goes through :meth:`_apply_one` itself. Returns how many failed."""
        bs, m = self.hasher.block_size, self._engine_to_key
        seen: set[int] = set()  # the engine hashes stored earlier in the run
        todo: list[int] = []
        parents: list[BlockHash | None] = []
        engine_parents: list[int | None] = []
        for i, ev in enumerate(stores):
            hashes = ev.block_hashes
            if len(hashes) == 1 and ev.block_size == bs and len(ev.token_ids) >= bs:
                parent = ev.parent_block_hash
                if parent is None:
                    todo.append(i)
                    parents.append(None)
                    engine_parents.append(None)
                elif type(parent) in (int, bytes) and (pe := to_int64(parent)) not in seen:
                    known = m.get(pe)
                    if known is not None:
                        todo.append(i)
                        parents.append(known[1])
                        engine_parents.append(pe)
            for h in hashes:
                if type(h) in (int, bytes):
                    seen.add(to_int64(h))
        #: event → (its key and chain value as hashed, the parent's chain value and engine hash it used)
        ours: dict[int, tuple[int, BlockHash, BlockHash | None, int | None]] = {}
        if len(todo) > 1:
            try:
                rows = np.array([stores[i].token_ids[:bs] for i in todo], dtype=np.uint32)
                keys, chains = self._keys_and_chain(self.hasher.hash_each(rows, parents))
                ours = {i: (k, c, p, pe)
                        for i, k, c, p, pe in zip(todo, keys, chains, parents, engine_parents, strict=True)}
            except Exception:  # whatever it is, each event on its own says it
                ours = {}
        failed = 0
        adds: dict[Tier, list[tuple[int, BlockStored]]] = {}
        for i, ev in enumerate(stores):
            pre = ours.get(i)
            if pre is not None and not self._keys_are_hashes:
                key, chain, parent, parent_engine = pre
                if parent_engine is not None:  # as _stored: the parent's entry, used again
                    known = m.get(parent_engine)
                    if known is not None and known[1] == parent:
                        m.move_to_end(parent_engine)
                    else:  # its entry went meanwhile (the map's bound): the event on its own
                        pre = None
                if pre is not None:
                    tier = self._tier(ev.medium)
                    settled = self._settle(ev.block_hashes, [to_int64(ev.block_hashes[0])], [key], [chain],
                                           False)
                    assert settled is not None  # not resumed: never an orphan
                    adds.setdefault(tier, []).append((settled[0], ev))
                    continue
            failed += self._apply_one(ev)
        for tier, done in adds.items():
            try:
                self.index.add(self.pod, [k for k, _ in done], tier)
                self.stats.stored += len(done)
            except Exception:  # each on its own, so a failure costs only its event
                for k, _ev in done:
                    try:
                        self.index.add(self.pod, [k], tier)
                        self.stats.stored += 1
                    except Exception as exc:
                        failed += self._failed(1, "BlockStored", exc)
        return failed

    def _store_run(self, stores: list[BlockStored]) -> int:
        """A run of stores into one medium as one index operation; events whose hashes cannot stand for
        the keys (:meth:`_hash_is_key`) are applied one by one after it. Returns how many failed."""
        fast = [self._keyed_by_hash(e) for e in stores]
        n = sum(fast)
        if n:
            run = [h for e, ok in zip(stores, fast, strict=True) if ok for h in e.block_hashes]
            self._store_engine_keys(run, self._tier(stores[0].medium, n))
        if n == len(stores):
            return 0
        return sum(self._apply_one(e) for e, ok in zip(stores, fast, strict=True) if not ok)

    def _apply_one(self, ev: KVCacheEvent) -> int:
        try:
            self._apply(ev)
        except Exception as exc:  # one bad event must never stop the pod's feed
            self._failed(1, type(ev).__name__, exc)
            if not isinstance(ev, BlockStored):
                self.reset()
            return 1
        return 0

    def _apply(self, ev: KVCacheEvent) -> None:
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._removed(ev)
        elif isinstance(ev, AllBlocksCleared):
            self.stats.cleared += 1
            self.reset()

    def _log(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            log.warning("%s", msg)

    def _tier(self, medium: str | None, events: int = 1) -> Tier:
        try:
            return Tier.from_medium(medium)
        except ValueError:
            self.stats.unknown_medium += events
            self._log(
                f"pod {self.pod}: unknown KV medium {str(medium)[:64]!r}, indexed as {Tier.slowest().medium}")
            return Tier.slowest()

    def _keys_and_chain(self, hashed: npt.NDArray[Any]) -> tuple[list[int], list[BlockHash]]:
        """The index keys of the picker's block hashes ``hashed`` and the chain values a child continues from
        (the keys themselves for ``xxh3_64``, the 32-byte hashes for ``sha256_cbor``)."""
        keys = hashes_as_ints(hashed)
        return keys, list(keys) if self.hasher.algo == "xxh3_64" else list(hashed)

    def _chain_value(self, h: int | bytes) -> BlockHash | None:
        """``h`` as a parent the picker's algorithm can continue from, or ``None``."""
        if self.hasher.algo == "sha256_cbor":
            return h if isinstance(h, bytes) and len(h) == 32 else None
        return h & _MASK if isinstance(h, int) else None

    def _remember(self, engine: int, key: int, chain: BlockHash) -> None:
        m = self._engine_to_key
        m[engine] = (key, chain)
        m.move_to_end(engine)
        while len(m) > self.max_keys:
            m.popitem(last=False)
            self.stats.key_evictions += 1

    def _store_engine_keys(self, hashes: list[int | bytes], tier: Tier) -> None:
        """Index the engine's own hashes as keys (:meth:`_keyed_by_hash`)."""
        if not hashes:
            return
        self.index.add(self.pod, _engine_keys(hashes), tier)
        self.stats.stored += len(hashes)

    def _stored(self, ev: BlockStored) -> None:
        tier = self._tier(ev.medium)
        if not ev.block_hashes:
            return
        if self._keyed_by_hash(ev):
            self._store_engine_keys(ev.block_hashes, tier)
            return
        engine = [to_int64(h) for h in ev.block_hashes]
        n = len(engine)
        bs = self.hasher.block_size
        if ev.block_size != bs or len(ev.token_ids) < n * bs:
            self.stats.orphans += n  # another block size: the picker's keys cannot line up
            return
        resumed = False
        parent: BlockHash | None = None
        if ev.parent_block_hash is not None:
            pe = to_int64(ev.parent_block_hash)
            known = self._engine_to_key.get(pe)
            if known is not None:
                self._engine_to_key.move_to_end(pe)
                parent = known[1]
            else:
                parent = self._chain_value(ev.parent_block_hash)
                if parent is None:
                    self.stats.orphans += n
                    return
                resumed = True
        keys, chain = self._keys_and_chain(self.hasher.hash_tokens(ev.token_ids[: n * bs], parent=parent))
        if len(keys) != n:
            self.stats.orphans += n
            return
        settled = self._settle(ev.block_hashes, engine, keys, chain, resumed)
        if settled is None:
            return
        self.index.add(self.pod, settled, tier)
        self.stats.stored += n

    def _settle(self, hashes: list[int | bytes], engine: list[int], keys: list[int], chain: list[BlockHash],
                resumed: bool) -> list[int] | None:
        """The keys to index for blocks of these engine hashes (and their 64-bit form) whose recomputed keys
        and chain values are ``keys`` and ``chain`` (``resumed``: from a parent the picker never saw), with
        the engine-hash map updated; ``None`` when they are orphans (counted)."""
        remember = True
        if keys == engine:
            self.hashes_like_us = True
            # the engine's hashes are the picker's keys and chain values: a child or a removal finds
            # them from the hash alone, so nothing is remembered (the map holds only differing blocks)
            remember = not all(self._chain_value(h) == c for h, c in zip(hashes, chain, strict=True))
        elif self.hashes_like_us:
            # the pod hashes like the picker: a differing hash mixed in extra keys (salt, LoRA, media),
            # and the engine's hash is the picker's key for that request
            keys = engine
            chain = []
            for h, e in zip(hashes, engine, strict=True):
                c = self._chain_value(h)
                chain.append(e if c is None else c)
        elif resumed:
            self.stats.orphans += len(engine)  # unknown parent, and the pod does not hash like the picker
            return None
        if remember:
            for e, k, c in zip(engine, keys, chain, strict=True):
                self._remember(e, k, c)
        return keys

    def _removed(self, ev: BlockRemoved, tier: Tier | None = None) -> None:
        self._remove_engine(_engine_keys(ev.block_hashes), self._tier(ev.medium) if tier is None else tier)

    def _remove_engine(self, hashes: npt.NDArray[np.uint64] | list[int], tier: Tier) -> None:
        """Blocks of these engine hashes (their 64-bit form) left ``tier``: their keys are the hashes but
        where the engine-hash map says otherwise (its entries go once their block has left every tier)."""
        m = self._engine_to_key
        if not self.recompute_keys or not m:
            self.index.remove(self.pod, hashes, tier)
            self.stats.removed += len(hashes)
            return
        engine: list[int] = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
        keys = [m[e][0] if e in m else e for e in engine]
        self.index.remove(self.pod, keys, tier)
        self.stats.removed += len(keys)
        known = [(e, k) for e, k in zip(engine, keys, strict=True) if e in m]
        if known:
            held = self.index.masks(self.pod, [k for _, k in known])
            for (e, _), mask in zip(known, held.tolist(), strict=True):
                if not mask:
                    m.pop(e, None)  # gone from every tier of the pod
