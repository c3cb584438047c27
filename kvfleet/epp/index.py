"""The global block index: which pod holds which block key, in which tier.

Write path (KV events, per pod, in order): :meth:`BlockIndex.add`, :meth:`BlockIndex.remove`,
:meth:`BlockIndex.clear_pod`. Read path: :meth:`BlockIndex.match` returns, per pod, the length of the longest
prefix of a request's chained block keys the pod holds and its tier-weighted value.

**Storage** is :class:`kvfleet.epp.table.PodKeyTable` (one numpy hash table of (block key, pod slot) → tier
mask, ≈ 16–31 bytes per entry); pods get small integer slots, freed slots are reused oldest first. This module
is one class of ~600 lines on purpose: the write path, the lookup and the speculative entries share the
table reference, the pod slots and the locks described below.

**Lookup: search, don't walk.** Keys are chained, so a pod holding the key at position ``i`` stored the whole
prefix ``0..i`` when it stored it, and vLLM frees a request's blocks tail first (a parent is never evicted
before its child): "held at ``i``" is monotone in ``i``. :meth:`match` therefore finds each candidate pod's
longest prefix by an 8-way search over positions (each step probes 7 positions of the pod's open interval):
O(pods · log blocks) probes. The probes and the search are compiled (``_probe.c`` through
:mod:`kvfleet.epp.probe`: one call per lookup, no Python per probe). Tier weighting uses the same argument
per tier: ``L_r``, the longest prefix held in tiers ``≤ r``, is monotone too, and the weighted hit is
``Σ_r (L_r − L_{r−1}) · w_r`` (searched only for pods whose first and last held blocks sit in different
tiers).

**Holes** (a block removed while a later block of the same chain is still held: not produced by vLLM's
tail-first eviction, but possible with lost or reordered events, or tier moves): when the prompt's blocks ×
candidate pods, or else the found prefixes' total, are at most ``exact_walk_blocks`` (default 1,024 block
probes, ≈ 0.1–0.2 ms: a 1k-token prompt held by 16 pods), every position of each (found) prefix is probed in
one batch and cut at the first hole, with exact per-block tier weights (the exact walk; for small prompts this
also skips the search's sequential steps). Beyond that budget the search's answer stands: a pod may be
credited past a hole (the search settles on some held block followed by a missing one), by at most the blocks
after the hole; such an over-prediction shows in ``kvfleet_epp_misprediction_tokens_total{direction="over"}``,
and the engine recomputes what it lacks, so a hole costs at most a less good pick, never a wrong answer.
``tests/epp/test_index.py`` pins both regimes.

**Concurrency.** Writers (the ingestion thread, ``clear_pod`` from the datastore) serialize on a write lock;
readers take no lock. A reader reads the table reference once and probes that object: a rebuild fills a new
object and swaps the reference, so a reader sees the old table or the new one, never a half-built one. An
in-place insert writes the key and the mask before the pod slot (the slot is what makes the entry visible;
readers read the slot first), and a slot only turns from empty to used, so probe chains never break under a
reader. A reader may miss an entry being added or still see one being removed; it never sees garbage.

Speculative entries (:meth:`add_speculative`: the picker's own picks until the pod's events confirm
them or their TTL expires) are described in :mod:`kvfleet.epp.speculative`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvfleet.cache.hashing import BlockKeys
from kvfleet.cache.tiers import Tier
from kvfleet.epp.reuse import ReuseTracker
from kvfleet.epp.speculative import NO_POD, Lease, SpecStore, spec_position_index, spec_positions
from kvfleet.epp.table import (
    DELETED,
    MAX_LOAD,
    MAX_PODS,
    MIN_CAPACITY,
    REBUILD_CHUNK,
    PodKeyTable,
    as_u64,
    capacity_for,
)

#: at the speculative bound, expired picks are looked for (a scan of every pick) at most this often; in
#: between, the oldest picks make room
EXPIRE_EVERY_S = 1.0
#: the GPU tier's bit in a tier mask
_GPU_BIT = np.uint8(1 << Tier.GPU.rank)


@dataclass(frozen=True)
class PodMatch:
    """One pod's prefix hit: ``blocks`` matched from the start, ``weighted`` = Σ tier weight per block;
    ``speculative``: of ``blocks``, those only picks vouch for; ``picked``: the prefix a live pick covers
    (sent to the pod within the speculative TTL after its first token, whatever the events say)."""

    blocks: int = 0
    weighted: float = 0.0
    speculative: int = 0
    picked: int = 0


def sampled_keys(keys: Sequence[int]) -> npt.NDArray[np.uint64]:
    """``keys`` at :func:`spec_positions` of their length, as uint64 (one array read for a
    :class:`~kvfleet.cache.hashing.BlockKeys`)."""
    if isinstance(keys, BlockKeys):
        return keys.u64[spec_position_index(len(keys))]
    return as_u64([keys[i] for i in spec_positions(len(keys))])


class PickOrigin(NamedTuple):
    """What other replicas need, beside its keys, to count a pick as its picker does: the in-flight ticket
    it belongs to (its first token serves the pick: :meth:`BlockIndex.extend`), and the pick's sample of its
    pool's follow-up share (the share of the prompt a live pick already covered, −1 for none: a fallback's
    pick repeats a request already counted)."""

    ticket: int
    covered: float
    pool: str


class BlockIndex:
    """(key, pod slot) → tier mask in one hash table; plus speculative picks with an expiry (see module doc).

    ``max_speculative``: bound on speculative entries; ``exact_walk_blocks``: the verifying walk's budget (see
    Holes); ``initial_capacity``: the table's smallest size (rounded up to a power of two ≥ 16; tests use a
    small one to exercise growth). At most ``MAX_PODS`` pods at once. ``reuse``: each pod's reuse distance,
    fed by every pick recorded here (:mod:`kvfleet.epp.reuse`; ``reuse_entries`` per pod, 0: off).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_speculative: int = 1_000_000,
        exact_walk_blocks: int = 1024,
        initial_capacity: int = MIN_CAPACITY,
        reuse_entries: int = 4096,
    ) -> None:
        self.clock = clock
        self.max_speculative = max(1, max_speculative)
        self.exact_walk_blocks = exact_walk_blocks
        self._floor = 1 << max(4, (initial_capacity - 1).bit_length())  # a power of two ≥ 16
        self._table = PodKeyTable(self._floor)
        self._slot: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: deque[int] = deque()
        self._count: list[int] = []  # entries per slot
        self._gpu: list[int] = []  # of those, entries on the GPU tier
        self._lock = threading.Lock()  # writers of the table
        #: speculative entries, compiled (:class:`SpecStore`), with their own pod slots: a pod's entries may
        #: outlive its exact slot (:meth:`clear_pod` with ``picks=False``)
        self._spec_lock = threading.Lock()  # every call on the store, reads included
        self._specs = SpecStore(self._spec_lock)
        self._spec_slot: dict[str, int] = {}
        self._spec_free: deque[int] = deque()
        self._spec_n = 0
        self._spec_picks: deque[tuple[Lease, str, npt.NDArray[np.uint64]]] = deque()
        self._expire_after = -math.inf
        #: scans of the picks for expired ones (:meth:`expire`, and at the bound)
        self.expire_scans = 0
        #: speculative entries dropped by the ``max_speculative`` bound (expired ones do not count)
        self.speculative_dropped = 0
        #: called with (pod, sampled keys, prompt blocks, the pick's :class:`PickOrigin` or None) after each
        #: of this picker's own picks (:meth:`add_speculative`), not for picks learned from other replicas
        #: (:meth:`add_speculative_sampled`): how picks are shared (epp/gossip.py)
        self.on_pick: Callable[[str, list[int], int, PickOrigin | None], None] | None = None
        self.reuse = ReuseTracker(reuse_entries)

    # --- slots -----------------------------------------------------------------------
    def _acquire(self, pod: str) -> int:
        s = self._slot.get(pod)
        if s is not None:
            return s
        if self._free:
            s = self._free.popleft()
            self._names[s] = pod
        else:
            s = len(self._names)
            if s >= MAX_PODS:
                raise RuntimeError(f"the block index holds at most {MAX_PODS} pods")
            self._names.append(pod)
            self._count.append(0)
            self._gpu.append(0)
        self._slot[pod] = s
        return s

    def _reserve(self, extra: int) -> PodKeyTable:
        """The table to insert ``extra`` more entries into: rebuilt (and swapped) above the load limit."""
        t = self._table
        if t.live + t.deleted + extra <= t.capacity * MAX_LOAD:
            return t
        new = PodKeyTable(capacity_for(t.live + extra, self._floor))
        k, s, m = t.entries()
        # bounded temporaries (a probe window is 8 × 8 bytes per pair)
        for i in range(0, len(k), REBUILD_CHUNK):
            new.insert(k[i : i + REBUILD_CHUNK], s[i : i + REBUILD_CHUNK], m[i : i + REBUILD_CHUNK])
        self._table = new  # one reference swap: readers see the old table or the new one
        return new

    # --- write path -------------------------------------------------------------------
    def add(self, pod: str, keys: Iterable[int], tier: Tier = Tier.GPU) -> None:
        """``pod`` holds ``keys`` in ``tier`` (as well as wherever it held them): one compiled pass over the
        keys after the load check (the table is rebuilt first when the keys it lacks would not fit)."""
        k = as_u64(keys)
        if not len(k):
            return
        with self._lock:
            slot = self._acquire(pod)
            t = self._table
            if t.live + t.deleted + len(k) > t.capacity * MAX_LOAD:  # only then may the keys lacking not fit
                absent = t.count_absent(k, slot)
                t = self._reserve(absent) if absent else t
            inserted, gained = t.add(k, slot, 1 << tier.rank)
            self._count[slot] += inserted
            if tier is Tier.GPU:
                self._gpu[slot] += inserted + gained

    def remove(self, pod: str, keys: Iterable[int], tier: Tier | None = Tier.GPU) -> None:
        """Drop ``keys`` of ``pod`` from ``tier`` (``None``: from every tier). Removed from the GPU (or every
        tier), a key also loses ``pod``'s speculative entries of *served* picks (see
        :meth:`drop_served_speculative`)."""
        k = as_u64(keys)
        if self._spec_n and (tier is None or tier is Tier.GPU):
            self.drop_served_speculative(pod, k)
        with self._lock:
            slot = self._slot.get(pod)
            if slot is None:
                return
            gone, lost = self._table.remove(k, slot, 0 if tier is None else 0xFF ^ (1 << tier.rank),
                                            int(_GPU_BIT))
            self._gpu[slot] -= lost
            self._count[slot] -= gone

    def clear_pod(self, pod: str, picks: bool = True) -> None:
        """Forget everything ``pod`` holds (AllBlocksCleared, resync, pod gone); its slot is freed. With
        ``picks=False`` its speculative entries stay (they expire on their own): a new subscription to the
        pod's events rebuilds what the engine holds, while picks not yet prefilled are in no replay."""
        with self._lock:
            slot = self._slot.pop(pod, None)
            if slot is not None:
                t = self._table
                if self._count[slot]:
                    gone = np.flatnonzero(t.pods == slot)
                    t.pods[gone] = DELETED
                    t.live -= len(gone)
                    t.deleted += len(gone)
                self._count[slot] = 0
                self._gpu[slot] = 0
                self._names[slot] = None
                self._free.append(slot)
        if not picks:
            return
        self.reuse.forget(pod)
        with self._spec_lock:
            slot = self._spec_slot.pop(pod, None)
            if slot is not None:
                self._spec_n -= self._specs.drop_pod(slot)
                self._spec_free.append(slot)
            self._spec_picks = deque(p for p in self._spec_picks if p[1] != pod)

    def add_speculative(self, pod: str, keys: Sequence[int], ttl_s: float, now: float | None = None,
                        origin: PickOrigin | None = None) -> Lease:
        """Record that ``pod`` will hold the prefix ``keys`` (until ``now + ttl_s``).

        Keys are chained, so holding block ``i`` implies blocks ``0..i``: only the
        positions of :func:`spec_positions` are stored (every block of the first
        ``SPEC_DENSE``, every ``SPEC_STRIDE``-th to ``SPEC_FAR``, then ``SPEC_RESOLUTION``
        points per doubling, and the last block) and :meth:`match` credits the prefix up
        to the last sampled key found. A 220 KB prompt (13.7 k blocks) costs about 370 entries
        (915 with a fixed stride). Returns the pick's :class:`Lease`: :meth:`extend` moves the expiry of
        every entry still held by this pick at once (a later pick of the same key takes the entry over).
        Beyond ``max_speculative`` entries, expired picks and then the oldest picks are dropped.
        ``origin`` goes to :attr:`on_pick` with the pick (what other replicas need to treat it as their own).
        """
        sampled = sampled_keys(keys)
        lease = self._add_sampled(pod, sampled, ttl_s, now, len(keys))
        if self.on_pick is not None:
            self.on_pick(pod, sampled.tolist(), len(keys), origin)
        return lease

    def add_speculative_sampled(self, pod: str, sampled: Sequence[int] | npt.NDArray[np.uint64], ttl_s: float,
                                now: float | None = None, blocks: int = 0) -> Lease:
        """:meth:`add_speculative` of a pick already sampled (the keys of a prompt at :func:`spec_positions`
        of its length: positions are absolute, so the sample alone is the pick): how another replica's pick is
        recorded. ``blocks``: the prompt's length, when known (the reuse sketch's weight of the last key)."""
        return self._add_sampled(pod, as_u64(sampled), ttl_s, now, blocks)

    def _spec_slot_of(self, pod: str) -> int:
        s = self._spec_slot.get(pod)
        if s is None:
            if self._spec_free:
                s = self._spec_free.popleft()
            else:
                s = len(self._spec_slot)
                if s >= MAX_PODS:
                    raise RuntimeError(f"the block index holds at most {MAX_PODS} pods")
            self._spec_slot[pod] = s
        return s

    def _add_sampled(self, pod: str, sampled: npt.NDArray[np.uint64], ttl_s: float, now: float | None,
                     blocks: int) -> Lease:
        t = self.clock() if now is None else now
        with self._spec_lock:
            lease = self._specs.lease(t + ttl_s)  # lowers the store's next_expiry
            self._spec_n += self._specs.add(sampled, self._spec_slot_of(pod), lease)
            self._spec_picks.append((lease, pod, sampled))
            if len(self._spec_picks) > 2 * self._spec_n + 1024:  # picks whose entries were all taken over
                owned = self._specs.owned
                self._spec_picks = deque(p for p in self._spec_picks if owned(p[0].handle) > 0)
            if self._spec_n > self.max_speculative:
                if t >= self._expire_after:  # a scan of every pick: at most once per EXPIRE_EVERY_S here
                    self._expire(t)
                    self._expire_after = t + EXPIRE_EVERY_S
                while self._spec_n > self.max_speculative and len(self._spec_picks) > 1:
                    self.speculative_dropped += self._drop(*self._spec_picks.popleft())
        self.reuse.touch(pod, sampled, blocks)
        return lease

    def _drop(self, lease: Lease, pod: str, keys: npt.NDArray[np.uint64]) -> int:
        """Remove the entries one pick still holds (a later pick may have taken some over)."""
        slot = self._spec_slot.get(pod)
        n = 0 if slot is None else self._specs.drop(keys, slot, lease)
        self._spec_n -= n
        return n

    def extend(self, lease: Lease, ttl_s: float, now: float | None = None) -> None:
        """Set a pick's speculative entries to expire ``ttl_s`` from now; called at the pick's first token,
        it marks the lease ``served``."""
        lease.serve((self.clock() if now is None else now) + ttl_s)

    def drop_served_speculative(self, pod: str, keys: npt.NDArray[np.uint64]) -> int:
        """The pod evicted ``keys``: drop its speculative entries for them whose pick was already served.

        A served pick's blocks were stored before this removal was sent (a block in use by a running
        request is not evicted, and a pod's events arrive in order), so the removal is the newer news; a
        pick still waiting for its first token re-admits the blocks when its prefill runs, so its entries
        stay. (Dropping every pick's entries on a removal lowered the hit rate: the waiting picks'
        prefixes vanished; keeping the served ones until their TTL over-predicted hits on pods whose
        caches churn, and a pod credited with blocks it evicted looked less loaded than it was.)
        Returns how many entries went."""
        with self._spec_lock:
            slot = self._spec_slot.get(pod)
            n = 0 if slot is None else self._specs.drop_served(as_u64(keys), slot)
            self._spec_n -= n
        return n

    def expire(self, now: float | None = None) -> int:
        """Drop expired speculative entries; returns how many."""
        with self._spec_lock:
            return self._expire(self.clock() if now is None else now)

    def _expire(self, t: float) -> int:
        """Drop the entries of expired picks: O(picks), not O(entries) (every entry belongs to a listed
        pick), and nothing at all before the earliest expiry of a listed pick (``next_expiry``)."""
        store = self._specs
        if t < store.next_expiry:
            return 0
        self.expire_scans += 1
        n = 0
        keep: deque[tuple[Lease, str, npt.NDArray[np.uint64]]] = deque()
        soonest = math.inf
        for pick in self._spec_picks:
            expiry = pick[0].expiry
            if expiry <= t:
                n += self._drop(*pick)  # nothing for a lease already freed
            else:
                keep.append(pick)
                if expiry < soonest:
                    soonest = expiry
        self._spec_picks = keep
        store.next_expiry = soonest
        return n

    # --- read path --------------------------------------------------------------------
    def match(
        self,
        keys: Sequence[int],
        pods: Iterable[str],
        tier_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
        now: float | None = None,
    ) -> dict[str, PodMatch]:
        """Longest held prefix of ``keys`` for each of ``pods`` (pods without a hit are absent).

        A pod's match is the longer of its exact prefix (events; tier-weighted) and
        its speculative prefix (picks; GPU weight for the blocks beyond the exact part).
        """
        names = list(dict.fromkeys(pods))
        blocks, weighted, spec, picked = self.match_lists(keys, names, tier_weights, now)
        rows = zip(names, blocks, weighted, spec, picked, strict=True)
        return {p: PodMatch(b, x, s, k) for p, b, x, s, k in rows if b > 0 or k > 0}

    def match_lists(
        self, keys: Sequence[int], names: Sequence[str], tier_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
        now: float | None = None,
    ) -> tuple[list[int], list[float], list[int], list[int]]:
        """:meth:`match` as four lists in the order of ``names`` (distinct): each pod's ``blocks``,
        ``weighted``, ``speculative`` and ``picked`` (:class:`PodMatch`; 0 without a hit). What candidate
        building reads: no object per pod."""
        t = self.clock() if now is None else now
        w = list(tier_weights)
        n = len(names)
        blocks, weighted, spec, picked = [0] * n, [0.0] * n, [0] * n, [0] * n
        self._exact(keys, names, w, blocks, weighted)
        if self._spec_n:
            for i, k in self._speculative(keys, names, t):
                exact = blocks[i]
                if k > exact:
                    weighted[i] += (k - exact) * w[0]
                    spec[i] = k - exact
                    blocks[i] = k
                picked[i] = k
        return blocks, weighted, spec, picked

    def _exact(self, keys: Sequence[int], names: Sequence[str], w: list[float], blocks: list[int],
               weighted: list[float]) -> None:
        table = self._table  # read once: a concurrent rebuild swaps the reference, never this object
        count = self._count
        slot = self._slot
        cand = [(i, s) for i, p in enumerate(names) if (s := slot.get(p)) is not None and s < len(count)
                and count[s] > 0]
        if not len(keys) or not cand:
            return
        slots = np.array([s for _, s in cand], dtype=np.uint16)
        length, wt = table.match(as_u64(keys), slots, w, self.exact_walk_blocks)
        for (i, _), b, x in zip(cand, length.tolist(), wt.tolist(), strict=True):
            if b > 0:
                blocks[i] = b
                weighted[i] = x

    def _speculative(self, keys: Sequence[int], names: Sequence[str], t: float) -> list[tuple[int, int]]:
        """(position in ``names``, speculative prefix length) of the pods with a live pick of ``keys``."""
        if not len(keys):
            return []
        slot = self._spec_slot
        sampled = sampled_keys(keys)
        with self._spec_lock:  # slots read under it: none is freed and given to another pod before the lookup
            pods = np.fromiter([slot.get(p, NO_POD) for p in names], dtype=np.uint16, count=len(names))
            hits, got = self._specs.match(sampled, spec_position_index(len(keys)), pods, t)
        if not hits:
            return []
        return [(i, k) for i, k in enumerate(got.tolist()) if k]

    def pod_tiers(self, pod: str, key: int) -> set[Tier]:
        mask = int(self.masks(pod, [key])[0])
        return {t for t in Tier if mask & (1 << t.rank)}

    def masks(self, pod: str, keys: Sequence[int]) -> npt.NDArray[np.uint8]:
        """The tier mask ``pod`` holds for each of ``keys`` (0: not held), in one batched probe."""
        out = np.zeros(len(keys), dtype=np.uint8)
        slot = self._slot.get(pod)
        if slot is None or not len(keys):
            return out
        table = self._table
        at = table.find(as_u64(keys), np.full(len(keys), slot, dtype=np.uint16))
        hit = at >= 0
        out[hit] = table.mask[at[hit]]
        return out

    @property
    def num_entries(self) -> int:
        """(block, pod) entries held (a block held by three pods counts three times)."""
        return self._table.live

    @property
    def num_keys(self) -> int:
        """Same as :attr:`num_entries` (distinct keys are not counted: the table is keyed by (block, pod))."""
        return self._table.live

    @property
    def nbytes(self) -> int:
        """Bytes of the exact table's arrays."""
        return self._table.nbytes

    def num_pod_keys(self, pod: str) -> int:
        slot = self._slot.get(pod)
        return 0 if slot is None else self._count[slot]

    def num_pod_gpu_keys(self, pod: str) -> int:
        """Blocks ``pod`` holds on its GPU tier (what its ``num_gpu_blocks`` bounds)."""
        slot = self._slot.get(pod)
        return 0 if slot is None else self._gpu[slot]

    def pod_key_counts(self, pods: Sequence[str]) -> tuple[list[int], list[int]]:
        """:meth:`num_pod_keys` and :meth:`num_pod_gpu_keys` of each of ``pods``."""
        slot, count, gpu = self._slot, self._count, self._gpu
        slots = [slot.get(p) for p in pods]
        return ([0 if s is None else count[s] for s in slots], [0 if s is None else gpu[s] for s in slots])

    @property
    def num_speculative(self) -> int:
        return self._spec_n

    def speculative_entries(self) -> set[tuple[int, str]]:
        """Every speculative entry as (key, pod), expired ones not yet dropped included (tests; a scan)."""
        with self._spec_lock:
            keys, slots = self._specs.entries()
            names = {s: p for p, s in self._spec_slot.items()}
        return {(k, names[s]) for k, s in zip(keys.tolist(), slots.tolist(), strict=True)}

    def pods(self) -> list[str]:
        with self._lock:
            return [p for p, s in self._slot.items() if self._count[s] > 0]
