"""Memory tiers: slabs of fixed-size slots. :class:`ArenaStore` keeps them in host memory (reads are zero-copy
views).

:class:`SlotStore` is the slot scheme shared with the torch-device store
(:mod:`~.device`): slot arithmetic, slabs allocated on first need, the index,
slot leases and the locking; subclasses only say where slabs live and how bytes
get into and out of a slot.

The arena serves ``cpu``, and ``gpu`` when no torch device is driven (device
``host``, or ``auto`` without torch or CUDA): it then reports itself as a
*stand-in* for HBM (log line at start, ``stand_in="true"`` on the
``kvfleet_tier_info`` metric).

Slots have one size per store: ``slot_bytes`` from the spec, or (0) the
encoded size of the first block written, rounded up to 64 bytes. Capacity is
``slots × slot_bytes``; a quantizing codec makes blocks, hence slots, smaller,
so the same capacity holds more blocks. Slabs of ``slab_bytes`` are allocated
when first needed and kept.

A host store can *lend* a block's slot to the ssd/remote writers
(:meth:`SlotStore.lend`): the block leaves the store at once, the writer
writes it from the slot where it is (no staging copy), and the slot is free
again on :meth:`SlotStore.release`. A lent slot does not count against the
capacity, so up to :data:`LOAN_BYTES` of slots more than the capacity exist
while writes are pending.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

from kvfleet.agent.codecs import Payload
from kvfleet.agent.tiers.base import SlotLeases, TierStore, encoded_nbytes
from kvfleet.agent.tiers.errors import BlockNotFoundError, BlockTooLargeError, TierFullError
from kvfleet.agent.tiers.record import BlockMeta
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import MemoryTierSpec, TierSpec

log = logging.getLogger(__name__)

_ALIGN = 64
#: slots of at least this size are page-aligned (and host slabs too), so the ssd tier's direct I/O
#: reads and writes them without a bounce copy.
PAGE = 4096
_PAGE_SLOTS = 64 << 10
#: bytes of slots a host store may have lent to the ssd/remote writers at once, beyond its capacity
LOAN_BYTES = 64 << 20

#: the type of one slab (a numpy array for the arena, a torch tensor on a device).
SlabT = TypeVar("SlabT")


def memory_spec(spec: TierSpec) -> MemoryTierSpec:
    """``spec`` as a :class:`MemoryTierSpec` (a plain spec gets the memory defaults)."""
    return spec if isinstance(spec, MemoryTierSpec) else MemoryTierSpec(capacity_bytes=spec.capacity_bytes)


class SlotStore(TierStore, Generic[SlabT]):
    """Fixed-size block slots carved from slabs allocated when first needed.

    The hooks (:meth:`_new_slab`, :meth:`_put`, :meth:`_get`, :meth:`_buffer`,
    :meth:`_land`, :meth:`_unbuffer`) are called with ``_lock`` held.
    """

    #: whether :meth:`lend` hands out slots (host memory only: a writer writes a numpy view of the slot);
    #: such slots also take a put's bytes through :meth:`reserve` (the copy outside the locks)
    lends = False

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        super().__init__(tier, spec)
        mspec = memory_spec(spec)
        self._slab_bytes = max(_ALIGN, mspec.slab_bytes)
        self.slot_bytes = _round_up(mspec.slot_bytes) if mspec.slot_bytes else 0
        self._slabs: list[SlabT] = []
        self._free: list[int] = []
        self._next_slot = 0
        self._index: dict[BlockHash, tuple[int, int, BlockMeta]] = {}
        self._leases = SlotLeases()
        #: slots lent to a writer (:meth:`lend`), not counted against the capacity
        self._lent: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ hooks

    @abstractmethod
    def _new_slab(self, nbytes: int) -> SlabT:
        """A new slab of ``nbytes`` (TierFullError when the medium has no room)."""

    @abstractmethod
    def _put(self, slot: int, data: Payload) -> None:
        """Copy ``data`` (flat uint8) into the start of ``slot``."""

    @abstractmethod
    def _get(self, slot: int, nbytes: int) -> Payload:
        """What :meth:`read` and :meth:`lease` return for the first ``nbytes`` of ``slot``."""

    @abstractmethod
    def _buffer(self, slot: int, nbytes: int) -> Payload:
        """The writable buffer :meth:`reserve` hands out for ``slot``."""

    def _land(self, slot: int, nbytes: int) -> None:
        """Move what the caller wrote into the reserved buffer into ``slot`` (at :meth:`commit`)."""

    def _unbuffer(self, slot: int) -> None:
        """Forget the reserved buffer of ``slot`` (at :meth:`abort`)."""

    # ------------------------------------------------------------ slots

    @property
    def num_slots(self) -> int:
        return self.capacity_bytes // self.slot_bytes if self.slot_bytes else 0

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.slot_bytes

    @property
    def loan_slots(self) -> int:
        """How many slots may be lent at once (:data:`LOAN_BYTES` rounded up to a slot; 0 for a store that
        does not lend)."""
        return -(-LOAN_BYTES // self.slot_bytes) if self.lends and self.slot_bytes else 0

    def _room(self) -> int:
        """Slots a write can take now: the capacity, plus the slots lent out, less the slots taken."""
        return self.num_slots + len(self._lent) - (self._next_slot - len(self._free))

    @property
    def full(self) -> bool:
        """Every slot is taken (slots sized already, none free)."""
        return bool(self.slot_bytes) and self._room() <= 0

    @property
    def free_slots(self) -> int:
        """Slots a write can take now (0 until the first block sized them; read without the lock)."""
        return max(0, self._room()) if self.slot_bytes else 0

    def charge(self, payload_nbytes: int) -> int:
        return self.slot_bytes or _round_up(payload_nbytes)

    @classmethod
    def block_charge(cls, spec: TierSpec, meta: BlockMeta) -> int:
        """One slot: ``slot_bytes`` from the spec, or the block's encoded size, rounded up like every slot."""
        return _round_up(memory_spec(spec).slot_bytes or encoded_nbytes(spec, meta))

    def _place(self, slot: int) -> tuple[SlabT, int]:
        """The slab holding ``slot`` and the slot's byte offset in it."""
        per_slab = self._slab_bytes // self.slot_bytes
        slab, i = divmod(slot, per_slab)
        return self._slabs[slab], i * self.slot_bytes

    def _fit(self, nbytes: int) -> None:
        """Size the slots by the first block; BlockTooLargeError if ``nbytes`` exceeds a slot (caller holds
        the lock)."""
        if not self.slot_bytes:
            self.slot_bytes = _round_up(nbytes)
            self._slab_bytes = max(self._slab_bytes, self.slot_bytes)
        if nbytes > self.slot_bytes:
            raise BlockTooLargeError(
                f"{self.tier}: block of {nbytes} bytes exceeds the {self.slot_bytes}-byte slot")

    def _alloc(self) -> int:
        if self._room() <= 0:
            raise TierFullError(f"{self.tier}: all {self.num_slots} slots in use")
        if self._free:
            return self._free.pop()
        slot = self._next_slot
        per_slab = self._slab_bytes // self.slot_bytes
        if slot // per_slab >= len(self._slabs):
            # the last slab also holds the slots that may be lent beyond the capacity (touched only when used)
            remaining = (self.num_slots + self.loan_slots - len(self._slabs) * per_slab) * self.slot_bytes
            self._slabs.append(self._new_slab(min(per_slab * self.slot_bytes, remaining)))
        self._next_slot += 1
        return slot

    def _index_slot(self, slot: int, meta: BlockMeta, nbytes: int) -> None:
        """Index ``slot`` under ``meta.hash``, freeing the slot of an earlier copy (caller holds the lock)."""
        old = self._index.pop(meta.hash, None)
        if old is not None:
            self._release_slot(old[0])
        self._index[meta.hash] = (slot, nbytes, meta)

    def _lookup(self, block_hash: BlockHash) -> tuple[int, int, BlockMeta]:
        try:
            return self._index[block_hash]
        except KeyError:
            raise BlockNotFoundError(block_hash) from None

    def _release_slot(self, slot: int) -> None:
        if not self._leases.defer(slot):
            self._free.append(slot)

    # ------------------------------------------------------------ store API

    def write(self, meta: BlockMeta, payload: Payload, digest: int | None = None) -> int:
        nbytes = int(payload.nbytes)
        flat = _flat(payload)
        with self._lock:
            self._fit(nbytes)
            old = self._index.pop(meta.hash, None)
            if old is not None:
                self._release_slot(old[0])
            slot = self._alloc()
            self._put(slot, flat)
            self._index[meta.hash] = (slot, nbytes, meta)
        return self.slot_bytes

    def write_many(self, blocks: Sequence[tuple[BlockMeta, Payload]]) -> int:
        """:meth:`write` of each ``(meta, payload)`` in order under one lock, until one finds no slot.

        Returns how many were written (each charged :attr:`slot_bytes`); the one that stopped the
        batch (no free slot, or larger than a slot) and those after it are not written.
        """
        index, put, alloc = self._index, self._put, self._alloc
        n = 0
        with self._lock:
            for meta, payload in blocks:
                nbytes = int(payload.nbytes)
                try:
                    if nbytes > self.slot_bytes:
                        self._fit(nbytes)
                    slot = alloc()
                except (TierFullError, BlockTooLargeError):
                    break
                old = index.pop(meta.hash, None)
                if old is not None:
                    self._release_slot(old[0])
                put(slot, _flat(payload))
                index[meta.hash] = (slot, nbytes, meta)
                n += 1
        return n

    def write_rows(self, metas: Sequence[BlockMeta], rows: Payload) -> int:
        """:meth:`write_many` of ``metas[i]`` with payload ``rows[i]`` (a 2-D uint8 array, one row per block),
        the bytes copied in one operation per slab (:meth:`_put_rows`). Returns how many were written."""
        nbytes = int(rows.shape[1])
        alloc, index_slot = self._alloc, self._index_slot
        slots: list[int] = []
        with self._lock:
            try:
                if nbytes > self.slot_bytes:
                    self._fit(nbytes)
            except BlockTooLargeError:
                return 0
            for meta in metas:
                try:
                    slot = alloc()
                except TierFullError:
                    break
                index_slot(slot, meta, nbytes)
                slots.append(slot)
            if slots:
                self._put_rows(slots, rows[: len(slots)])
        return len(slots)

    def _put_rows(self, slots: list[int], rows: Payload) -> None:
        """Copy ``rows[i]`` into the start of ``slots[i]``, in order (a slot listed twice: its last row)."""
        for slot, row in zip(slots, rows, strict=True):
            self._put(slot, row)

    def reserve(self, nbytes: int) -> tuple[int, Payload]:
        """A free slot and a writable buffer of ``nbytes`` for it; then :meth:`commit` or :meth:`abort`."""
        with self._lock:
            self._fit(nbytes)
            slot = self._alloc()
            try:
                return slot, self._buffer(slot, nbytes)
            except BaseException:
                self._free.append(slot)
                raise

    def commit(self, slot: int, meta: BlockMeta, nbytes: int) -> int:
        """Index a reserved slot (its buffer filled by the caller) under ``meta.hash``; returns its charge."""
        with self._lock:
            self._land(slot, nbytes)
            self._index_slot(slot, meta, nbytes)
        return self.slot_bytes

    def abort(self, slot: int) -> None:
        with self._lock:
            self._unbuffer(slot)
            self._free.append(slot)

    def read(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload]:
        with self._lock:
            slot, nbytes, meta = self._lookup(block_hash)
            return meta, self._get(slot, nbytes)

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            old = self._index.pop(block_hash, None)
            if old is not None:
                self._release_slot(old[0])

    def delete_many(self, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            pop = self._index.pop
            gone = [old[0] for old in map(lambda h: pop(h, None), hashes) if old is not None]
            if self._leases:
                for slot in gone:
                    self._release_slot(slot)
            else:  # no slot is leased: every one is free at once
                self._free.extend(gone)

    def lease(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload, int]:
        """Like :meth:`read`, but the slot is not reused until :meth:`release` (even if deleted)."""
        with self._lock:
            slot, nbytes, meta = self._lookup(block_hash)
            out = self._get(slot, nbytes)
            self._leases.take(slot)
        return meta, out, slot

    def lend(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload, int] | None:
        """Take ``block_hash`` out of the store, its slot lent to the caller (a writer) until
        :meth:`release`: the returned view stays valid and unchanged until then, and the slot does not
        count against the capacity meanwhile. ``None`` when the store does not lend or
        :attr:`loan_slots` are lent already; BlockNotFoundError when the block is not here."""
        with self._lock:
            if len(self._lent) >= self.loan_slots:
                return None
            slot, nbytes, meta = self._lookup(block_hash)
            del self._index[block_hash]
            self._leases.take(slot)
            self._leases.defer(slot)
            self._lent.add(slot)
            return meta, self._get(slot, nbytes), slot

    def release(self, slot: int) -> None:
        """End a :meth:`lease` or a :meth:`lend` of ``slot``."""
        with self._lock:
            if self._leases.end(slot):
                self._lent.discard(slot)
                self._free.append(slot)

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            return iter(list(self._index))

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._leases.clear()
            self._lent.clear()
            self._slabs.clear()
            self._free.clear()
            self._next_slot = 0


class ArenaStore(SlotStore[np.ndarray]):
    """Preallocated host slabs with fixed block slots; reads are read-only views of a slot."""

    backend = "arena"
    lends = True

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        super().__init__(tier, spec)
        self.stand_in = tier is Tier.GPU
        if self.stand_in:
            log.warning("gpu tier: host arena standing in for HBM (no CUDA device driven), capacity %d bytes",
                        self.capacity_bytes)

    def describe(self) -> str:
        what = "host arena standing in for HBM" if self.stand_in else "host slabs"
        return (f"{self.tier} tier: {what}, capacity {self.capacity_bytes} bytes, "
                f"slot {self.slot_bytes or 'auto'}")

    def _new_slab(self, nbytes: int) -> np.ndarray:
        return page_aligned(nbytes)

    def _slot_view(self, slot: int, nbytes: int) -> Payload:
        slab, start = self._place(slot)
        view: Payload = slab[start : start + nbytes]
        return view

    def _put(self, slot: int, data: Payload) -> None:
        slab, start = self._place(slot)
        slab[start : start + data.nbytes] = data

    def _put_rows(self, slots: list[int], rows: Payload) -> None:
        sb = self.slot_bytes
        per_slab = self._slab_bytes // sb
        nbytes = rows.shape[1]
        if nbytes != sb:
            super()._put_rows(slots, rows)
            return
        slab_of, at = np.divmod(np.asarray(slots), per_slab)
        # a slot as one numpy element (a void of slot_bytes), so that a fancy-indexed assignment copies whole
        # slots (as uint8 rows it would copy byte by byte); numpy assigns in order: a repeated slot keeps
        # its last row
        slot_t = np.dtype((np.void, sb))
        whole = np.ascontiguousarray(rows).view(slot_t).reshape(-1)
        # all in one slab (the usual case): the rows go as they are; selecting them per slab copies them all
        one = bool((slab_of == slab_of[0]).all())
        for k in [int(slab_of[0])] if one else np.unique(slab_of).tolist():
            slab = self._slabs[k]
            grid = slab[: len(slab) // sb * sb].view(slot_t)
            if one:
                grid[at] = whole
            else:
                sel = slab_of == k
                grid[at[sel]] = whole[sel]

    def _get(self, slot: int, nbytes: int) -> Payload:
        view = self._slot_view(slot, nbytes).view()
        view.flags.writeable = False
        return view

    def _buffer(self, slot: int, nbytes: int) -> Payload:
        return self._slot_view(slot, nbytes)

    def probe(self, nbytes: int) -> tuple[float, float, float]:
        """A memory copy of ``nbytes`` stands for both directions (no slot is used)."""
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = max(1e-9, time.perf_counter() - t0)
        return nbytes / dt, nbytes / dt, 1e-6


def _flat(payload: Payload) -> Payload:
    """``payload`` as flat bytes (a view; as it is when it already is)."""
    return payload if payload.ndim == 1 and payload.dtype == np.uint8 else payload.reshape(-1).view(np.uint8)


def _round_up(n: int) -> int:
    align = PAGE if n >= _PAGE_SLOTS else _ALIGN
    return max(_ALIGN, -(-n // align) * align)


def page_aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of zero-filled, page-aligned memory (an anonymous mapping) as a uint8 array.

    Mappings of 2 MiB and more are advised to use transparent huge pages (as numpy does for its
    large arrays), so a first write faults once per 2 MiB instead of once per 4 KiB.
    """
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    m = mmap.mmap(-1, size)
    if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages: 4 KiB faults, still correct
            m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)[:nbytes]
