"""The storage interface of one tier (the name → backend registry is :mod:`~.backends`).

A :class:`TierStore` holds encoded blocks keyed by block hash. It knows
nothing about watermarks, LRU order or other tiers: that is the manager's
job (:mod:`kvfleet.agent.tiers.manager`). Stores are called from the
manager's migration threads and from the engine's thread; implementations
are thread-safe.

Backends (``TierSpec.backend``; empty = the tier's default; :func:`~.backends.open_store`):

=========  ==============================================  ==========================
name       class                                           default for
=========  ==============================================  ==========================
arena      :class:`~.memory.ArenaStore` (host slabs)       gpu (stand-in), cpu
torch      :class:`~.device.TorchDeviceStore` (tensors)    gpu when ``device`` is a torch device
slab       :class:`~.slab.SlabStore` (slab files)          ssd
files      :class:`~.ssd.FileStore` (file per block)
redis      :class:`~.remote.RedisStore`                    remote
=========  ==============================================  ==========================

The gpu tier's default follows ``MemoryTierSpec.device`` (:func:`~.backends.default_backend`):
``torch`` when it resolves to a torch device (``auto`` with torch installed and
CUDA available, ``cuda``, ``cuda:N``, ``cpu``), else ``arena``.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from kvfleet.agent.codecs import Payload, get_codec
from kvfleet.agent.tiers.errors import TierFullError, TierIOError
from kvfleet.agent.tiers.record import PREFIX_SIZE, BlockMeta, pack
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSpec

#: Hash used by :meth:`TierStore.probe` (never a real block: real hashes are whole 64-bit values).
PROBE_HASH: BlockHash = b"kvfleet-probe"


@dataclass
class ScanReport:
    """What a start-up rescan found: valid blocks, and dropped records by reason."""

    blocks: list[BlockMeta] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


class TierStore(ABC):
    """Encoded blocks of one tier, keyed by hash, within ``capacity_bytes``."""

    backend: ClassVar[str]
    #: ``True`` when this store imitates a medium it is not (host memory for the GPU tier).
    stand_in: bool = False

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        self.tier = tier
        self.spec = spec
        self.capacity_bytes = spec.capacity_bytes

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently held (what counts against capacity)."""

    @abstractmethod
    def charge(self, payload_nbytes: int) -> int:
        """Bytes a block with this encoded size would occupy here."""

    @property
    def full(self) -> bool:
        """Whether a new block certainly finds no room (a hint, read without the store's lock; ``False``
        when unknown)."""
        return False

    @classmethod
    def block_charge(cls, spec: TierSpec, meta: BlockMeta) -> int:
        """Bytes a block like ``meta`` (dtype, shape, header fields) takes in a new store of this backend.

        What sizing a tier in blocks multiplies by, before any block is stored; the block is encoded
        with ``spec.codec``. This default charges the whole record (prefix, header, payload), as the
        stores that keep one record per block do.
        """
        return len(spec_record(spec, meta)[0]) + encoded_nbytes(spec, meta)

    @abstractmethod
    def write(self, meta: BlockMeta, payload: Payload, digest: int | None = None) -> int:
        """Store a block; returns its charge. Raises TierFullError, BlockTooLargeError, TierIOError.

        ``digest``: the payload's :func:`~.record.payload_digest` when the caller has it (record stores
        then do not read the payload again to checksum it; memory stores ignore it)."""

    @abstractmethod
    def read(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload]:
        """The block's meta and payload (a view valid until the block is deleted for memory stores).

        Raises BlockNotFoundError, CorruptBlockError, TierIOError.
        """

    @abstractmethod
    def delete(self, block_hash: BlockHash) -> None:
        """Forget a block (no error if absent)."""

    def delete_many(self, hashes: Iterable[BlockHash]) -> None:
        """:meth:`delete` of each hash; a failure does not stop the others (the first is raised at the end).

        Stores with one lock override it to take the lock once.
        """
        failed: TierIOError | None = None
        for h in hashes:
            try:
                self.delete(h)
            except TierIOError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def forget(self, block_hash: BlockHash) -> None:
        """Drop a block that moved to another tier; persistent stores may keep its bytes until reused."""
        self.delete(block_hash)

    def scan(self) -> ScanReport:
        """Blocks that survive from an earlier run (persistent stores); memory stores have none."""
        return ScanReport()

    def keys(self) -> Iterator[BlockHash]:
        return iter(())

    #: whether :meth:`read_into` is implemented (record stores on disk): promotion then reads a record
    #: straight into a reserved memory slot.
    reads_into: ClassVar[bool] = False

    def read_into(self, block_hash: BlockHash, alloc: Callable[[BlockMeta, int], Payload]) -> BlockMeta:
        """Read the block's payload into ``alloc(meta, payload_len)``, checked; stores with
        :attr:`reads_into`."""
        raise NotImplementedError(f"the {self.backend} backend does not read into a caller's buffer")

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the store holds the block (by its own bookkeeping, no I/O)."""
        return block_hash in set(self.keys())

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing to release
        """Release resources; the store is not used afterwards."""

    def describe(self) -> str:
        return f"{self.tier} tier: {self.backend} backend, capacity {self.capacity_bytes} bytes"

    def probe(self, nbytes: int) -> tuple[float, float, float]:
        """Measure ``(read_Bps, write_Bps, latency_s)`` with a throw-away block of ``nbytes``.

        The probe is capped at a quarter of the capacity. A disk store probes through its
        own I/O path: buffered I/O measures the page cache more than the device (configure
        ``read_gbps``/``write_gbps`` when the device's own figures matter).
        """
        nbytes = max(4096, min(nbytes, self.capacity_bytes // 4))
        small = np.zeros(64, dtype=np.uint8)
        big = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
        meta_small = BlockMeta(hash=PROBE_HASH, codec="none", dtype="uint8", shape=(64,), raw_nbytes=64)
        meta_big = BlockMeta(hash=PROBE_HASH, codec="none", dtype="uint8", shape=(nbytes,), raw_nbytes=nbytes)
        try:
            t0 = time.perf_counter()
            self.write(meta_small, small)
            t1 = time.perf_counter()
            self.read(PROBE_HASH)
            t2 = time.perf_counter()
            self.delete(PROBE_HASH)
            t3 = time.perf_counter()
            self.write(meta_big, big)
            t4 = time.perf_counter()
            self.read(PROBE_HASH)
            t5 = time.perf_counter()
        finally:
            self.delete(PROBE_HASH)
        latency = max(1e-7, min(t1 - t0, t2 - t1))
        write_bps = nbytes / max(1e-9, (t4 - t3) - (t1 - t0))
        read_bps = nbytes / max(1e-9, (t5 - t4) - (t2 - t1))
        return read_bps, write_bps, latency



def encoded_nbytes(spec: TierSpec, meta: BlockMeta) -> int:
    """Payload bytes of a block like ``meta`` under ``spec.codec``."""
    return get_codec(spec.codec).encoded_nbytes(np.dtype(meta.dtype), meta.shape)


def spec_record(spec: TierSpec, meta: BlockMeta, align: int = 0) -> tuple[bytes, memoryview]:
    """The record (prefix + header, payload) of a zero block like ``meta`` encoded with ``spec.codec``."""
    codec = get_codec(spec.codec)
    payload = np.zeros(encoded_nbytes(spec, meta), dtype=np.uint8)
    encoded = meta._replace(codec=codec.name)
    return pack(encoded, payload, align=align)


class RecordStore(TierStore):
    """A store that charges each block the size of its whole record (:mod:`~.record`).

    Sizes are this store's own bookkeeping (``_sizes``, ``_used``), changed under
    ``_lock`` with :meth:`_check_room`, :meth:`_account` and :meth:`_forget`.
    """

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        super().__init__(tier, spec)
        self._sizes: dict[BlockHash, int] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def charge(self, payload_nbytes: int) -> int:
        return PREFIX_SIZE + 64 + payload_nbytes

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._sizes

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            return iter(list(self._sizes))

    def _check_room(self, block_hash: BlockHash, size: int) -> int:
        """The block's current size (0 if absent); TierFullError if ``size`` does not fit in its place (caller
        holds the lock)."""
        old = self._sizes.get(block_hash, 0)
        if self._used - old + size > self.capacity_bytes:
            raise TierFullError(
                f"{self.tier}: {self._used} of {self.capacity_bytes} bytes used, block needs {size}")
        return old

    def _account(self, block_hash: BlockHash, size: int) -> None:
        """Charge the block ``size`` bytes in place of its earlier size (caller holds the lock)."""
        self._used += size - self._sizes.get(block_hash, 0)
        self._sizes[block_hash] = size

    def _forget(self, block_hash: BlockHash) -> None:
        """Stop charging the block (no error if absent; caller holds the lock)."""
        self._used -= self._sizes.pop(block_hash, 0)


class SlotLeases:
    """Lease counts of a store's fixed slots: a slot deleted while leased is reused only after its last lease.

    It only counts; the store frees slots when told to, under its own lock (these methods take none).
    """

    def __init__(self) -> None:
        #: slot → outstanding leases
        self._counts: dict[int, int] = {}
        #: deleted slots still leased, freed on the last release
        self._deferred: set[int] = set()
        #: deferred slots whose content is to be kept (not cleared) when freed
        self._keep: set[int] = set()

    def __bool__(self) -> bool:
        """Whether any slot is leased."""
        return bool(self._counts)

    def take(self, slot: int) -> None:
        self._counts[slot] = self._counts.get(slot, 0) + 1

    def defer(self, slot: int, clear: bool = True) -> bool:
        """Whether ``slot`` (just deleted) is leased; if so :meth:`end` frees it later.

        ``clear=False`` records that the slot's content may stay when it is freed (:meth:`pop_clear`).
        """
        if self._counts.get(slot):
            self._deferred.add(slot)
            if not clear:
                self._keep.add(slot)
            return True
        return False

    def pop_clear(self, slot: int) -> bool:
        """Whether a slot that :meth:`end` just freed is to be cleared (``defer(..., clear=True)``)."""
        if slot in self._keep:
            self._keep.discard(slot)
            return False
        return True

    def end(self, slot: int) -> bool:
        """End one lease of ``slot``; whether it was the last one of a deleted slot, now to be freed."""
        n = self._counts.get(slot, 0) - 1
        if n > 0:
            self._counts[slot] = n
            return False
        self._counts.pop(slot, None)
        if slot in self._deferred:
            self._deferred.discard(slot)
            return True
        return False

    def clear(self) -> None:
        self._counts.clear()
        self._deferred.clear()
        self._keep.clear()
