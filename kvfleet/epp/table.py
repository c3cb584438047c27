"""The EPP index's storage: (block key, pod slot) → tier mask in one open-addressing hash table of numpy
arrays.

Pods get small integer slots (freed slots are reused, oldest freed
first). Exact entries live in one open-addressing hash table of numpy arrays
keyed by (block key, pod slot), linear probing: ``keys`` (uint64), ``pods``
(uint16; two reserved values mark an empty and a deleted slot, so every 64-bit key
is a valid key) and ``mask`` (uint8, bit ``Tier.rank`` per tier held): 11 bytes per
slot, grown at load 0.7 to load ≤ 0.5 (≈ 16–31 bytes per (block, pod) entry; the
old ``key → {pod: mask}`` dicts plus per-pod key sets cost ≈ 173–209). Writes go in one batch per event.
The table is rebuilt into a new object, and the reference swapped, when live entries plus deleted slots pass
the load limit.

Linear probing from a pair's home position, in ``_probe.c`` for reads and inserts alike (one implementation
of the hash). A table is never resized in place: the index fills a new one and swaps its reference
(:class:`kvfleet.epp.index.BlockIndex`), so readers need no lock. An insert writes the key and the mask before
the pod slot (the slot is what makes an entry visible), and a slot only turns from free (never used, or
deleted) to used, so probe chains never break under a reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.cache.hashing import BlockKeys
from kvfleet.epp import probe

#: Pod-slot values that mark a free table slot: never used yet, or deleted (a "tombstone").
EMPTY = 0xFFFF
DELETED = 0xFFFE
MAX_PODS = DELETED  # slots 0 .. MAX_PODS − 1
MAX_LOAD = 0.7
TARGET_LOAD = 0.5
MIN_CAPACITY = 1 << 10
REBUILD_CHUNK = 1 << 18  # entries moved per batch when the table is rebuilt
MASK64 = (1 << 64) - 1
U64 = np.uint64
_SLOT_MIX = np.random.default_rng(0x6B7666).integers(0, np.iinfo(np.uint64).max, 1 << 16, dtype=np.uint64,
                                                     endpoint=True)


def as_u64(keys: Iterable[int]) -> npt.NDArray[np.uint64]:
    """Block keys as uint64 (negative ints, the int64 form of a hash, as their two's complement)."""
    if isinstance(keys, np.ndarray):
        return keys.astype(U64, copy=False)
    if isinstance(keys, BlockKeys):
        return keys.u64
    seq = keys if isinstance(keys, (list, tuple)) else list(keys)
    try:
        return np.fromiter(seq, dtype=U64, count=len(seq))
    except OverflowError:  # negative ints: their 64-bit two's complement, as to_int64 gives
        return np.array([k & MASK64 for k in seq], dtype=U64)


class PodKeyTable:
    """One open-addressing table; replaced whole (never resized in place) so readers need no lock."""

    __slots__ = ("capacity", "deleted", "keys", "live", "mask", "pods", "ref", "shift", "wrap")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.wrap = capacity - 1
        self.shift = U64(64 - (capacity.bit_length() - 1))
        self.keys = np.zeros(capacity, dtype=U64)
        self.pods = np.full(capacity, EMPTY, dtype=np.uint16)
        self.mask = np.zeros(capacity, dtype=np.uint8)
        #: the arrays as the compiled probes take them (addresses read once: these arrays are never replaced)
        self.ref = probe.table(self.keys, self.pods, self.mask, _SLOT_MIX, int(self.shift))
        self.live = 0
        self.deleted = 0

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.pods.nbytes + self.mask.nbytes)

    def find(self, keys: npt.NDArray[np.uint64], slots: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        """Table position of each (key, slot), −1 where absent (linear probing from the pair's home position
        up to the first empty slot; compiled: :mod:`kvfleet.epp.probe`)."""
        return probe.find(self.ref, keys, slots)

    def match(self, keys: npt.NDArray[np.uint64], slots: npt.NDArray[np.uint16], weights: Sequence[float],
              walk_budget: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """Per pod slot, the longest prefix of the chained ``keys`` held and its tier-weighted value (the
        rules: :mod:`kvfleet.epp.index`; compiled: :mod:`kvfleet.epp.probe`)."""
        return probe.match(self.ref, keys, slots, weights, walk_budget)

    def insert(self, keys: npt.NDArray[np.uint64], slots: npt.NDArray[Any],
               masks: npt.NDArray[np.uint8]) -> None:
        """Insert (key, slot) pairs known to be absent and distinct; the caller keeps the load below 1
        (compiled: :mod:`kvfleet.epp.probe`, where the home position of a pair is computed for every
        probe)."""
        if len(keys) == 0:
            return
        self.deleted -= probe.insert(self.ref, keys, slots, masks)
        self.live += len(keys)

    def count_absent(self, keys: npt.NDArray[np.uint64], slot: int) -> int:
        """How many of ``keys`` pod ``slot`` does not hold (a repeated key counts each time)."""
        return probe.count_absent(self.ref, keys, slot)

    def add(self, keys: npt.NDArray[np.uint64], slot: int, bit: int) -> tuple[int, int]:
        """Pod ``slot`` holds ``keys`` in the tier of mask ``bit``: held entries gain the bit, absent keys (at
        most :meth:`count_absent`; the caller keeps the load below 1) are inserted with it. Returns (entries
        inserted, held entries that gained the bit)."""
        if len(keys) == 0:
            return 0, 0
        inserted, gained, reused = probe.add(self.ref, keys, slot, bit)
        self.live += inserted
        self.deleted -= reused
        return inserted, gained

    def remove(self, keys: npt.NDArray[np.uint64], slot: int, keep: int, gpu_bit: int) -> tuple[int, int]:
        """Pod ``slot`` keeps only the tier bits of ``keep`` for ``keys``; entries left with none are deleted.
        Returns (entries deleted, entries that lost ``gpu_bit``)."""
        if len(keys) == 0:
            return 0, 0
        gone, lost = probe.remove(self.ref, keys, slot, keep, gpu_bit)
        self.live -= gone
        self.deleted += gone
        return gone, lost

    def entries(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint16], npt.NDArray[np.uint8]]:
        used = np.flatnonzero(self.pods < DELETED)
        return self.keys[used], self.pods[used], self.mask[used]


def capacity_for(n: int, floor: int = MIN_CAPACITY) -> int:
    cap = floor
    while n > cap * TARGET_LOAD:
        cap <<= 1
    return cap


