"""Staging buffers: private copies of blocks queued for the ssd/remote writers.

A ``put`` that finds no room in memory (and a memory slot freed for it) hands
its block to a writer thread, so the caller's array must be copied first.
Copies land in buffers carved from one :data:`STAGING_BYTES` slab mapped with
transparent huge pages and recycled per (dtype, shape): a first write faults
once per 2 MiB and a recycled buffer not at all. Large buffers start on a
page, so the ssd tier's direct I/O writes them where they are. When the slab
is used up a buffer is a one-off allocation (page-aligned when large). The
copy is hashed as it is made (the record's payload digest), so the writer
need not read it again.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.agent.tiers.memory import PAGE, page_aligned
from kvfleet.agent.tiers.record import copy_digest
from kvfleet.agent.tiers.slabio import ZERO_COPY_MIN

#: bytes of copy buffers for writes queued by put(), carved from one slab and recycled.
STAGING_BYTES = 64 << 20


class StagingSlab:
    """Recycled copy buffers carved from one slab (see the module doc); thread-safe."""

    def __init__(self, nbytes: int = STAGING_BYTES) -> None:
        self.nbytes = nbytes
        self._pools: dict[tuple[np.dtype[Any], tuple[int, ...]], list[npt.NDArray[Any]]] = {}
        self._slab: npt.NDArray[np.uint8] | None = None
        self._used = 0
        self._lock = threading.Lock()

    def stage(self, block: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], int]:
        """A private copy of ``block``, in a recycled buffer when one is free, and the copy's
        :func:`~.record.payload_digest` (hashed while the copy is in the cache:
        :func:`~.record.copy_digest`)."""
        buf = self._buffer(block)
        return buf, copy_digest(buf, block)

    def _buffer(self, block: npt.NDArray[Any]) -> npt.NDArray[Any]:
        key = (block.dtype, block.shape)
        nbytes = block.nbytes
        buf: npt.NDArray[Any] | None = None
        with self._lock:
            pool = self._pools.get(key)
            if pool:
                buf = pool.pop()
            elif 0 < nbytes and self._used + nbytes <= self.nbytes:
                if self._slab is None:
                    self._slab = page_aligned(self.nbytes)
                align = PAGE if nbytes >= ZERO_COPY_MIN else 64
                start = -(-self._used // align) * align
                if start + nbytes <= self.nbytes:
                    raw = self._slab[start : start + nbytes]
                    buf = raw.view(block.dtype).reshape(block.shape)
                    self._used = start + nbytes
        if buf is None:
            buf = (page_aligned(nbytes).view(block.dtype).reshape(block.shape) if nbytes >= ZERO_COPY_MIN
                   else np.empty(block.shape, dtype=block.dtype))
        return buf

    def unstage(self, buf: npt.NDArray[Any]) -> None:
        """Give a buffer back for reuse (only those carved from the slab are kept)."""
        slab = self._slab
        if slab is not None and np.shares_memory(buf, slab):
            with self._lock:
                self._pools.setdefault((buf.dtype, buf.shape), []).append(buf)


__all__ = ["STAGING_BYTES", "StagingSlab"]
