"""Slot I/O of the slab SSD tier (:mod:`~.slab`): aligned buffers, vectored read/write loops, the probe.

Direct I/O (``direct_io``, the default): slots are written and read with
``O_DIRECT``, so the page cache does not keep a second copy of what the
memory tiers above already cache, and a move costs what the device costs. A
payload of :data:`ZERO_COPY_MIN` or more gets a header padded to a page; when
it sits in page-aligned memory it is written and read in place (head page +
payload in one vectored call). Other records go through a page-aligned bounce
buffer per thread (:class:`Bounce`: record copied in, padded to 4 KiB; read
back whole, checked, payload copied out). A filesystem that refuses
``O_DIRECT`` (tmpfs) gets buffered I/O and one log line. Clearing a slot's
magic stays a buffered 4-byte write (the kernel writes it back before the next
direct I/O on that range).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from kvfleet.agent.codecs import Payload
from kvfleet.agent.tiers.errors import TierIOError
from kvfleet.agent.tiers.fileio import advance_views, remove_file
from kvfleet.agent.tiers.memory import page_aligned
from kvfleet.agent.tiers.record import PREFIX_SIZE
from kvfleet.cache.tiers import Tier

SLOT_ALIGN = 4096
#: payloads from this size on are read and written without a bounce copy under direct I/O (when aligned).
ZERO_COPY_MIN = 64 << 10

#: ``put_record(fd, offset, head, body, direct)``: how the store writes one record.
PutRecord = Callable[[int, int, bytes, memoryview, bool], None]


class Bounce(threading.local):
    """A page-aligned buffer per thread for O_DIRECT slot I/O, grown on demand."""

    buf: Payload | None = None

    def get(self, nbytes: int) -> Payload:
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = aligned(nbytes)
        return self.buf


def aligned(nbytes: int) -> Payload:
    """``nbytes`` of page-aligned memory (rounded up to a page) as a uint8 array."""
    return page_aligned(slot_size(nbytes))


def dio_ready(head_len: int, body: memoryview) -> bool:
    """Whether a record can go to an O_DIRECT fd as it is: page-sized head, page-aligned payload."""
    if head_len % SLOT_ALIGN or body.nbytes % SLOT_ALIGN:
        return False
    return np.frombuffer(body, dtype=np.uint8).ctypes.data % SLOT_ALIGN == 0


def slot_size(n: int) -> int:
    """``n`` rounded up to whole pages (at least one)."""
    return max(SLOT_ALIGN, -(-n // SLOT_ALIGN) * SLOT_ALIGN)


def io_error(tier: Tier, what: str, exc: OSError) -> TierIOError:
    kind = "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
    return TierIOError(f"{tier}: {what}: {exc}", kind=kind)


def pwrite_all(fd: int, parts: list[bytes | memoryview], offset: int) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        offset += n
        advance_views(views, n)


def pread_all(fd: int, parts: list[bytearray | memoryview], offset: int) -> int:
    """Fill ``parts`` from ``offset``; returns the bytes read (short only at end of file)."""
    views = [memoryview(p).cast("B") for p in parts]
    total = 0
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            break
        total += n
        offset += n
        advance_views(views, n)
    return total


def probe(path: Path, nbytes: int, direct: bool, put_record: PutRecord,
          bounce: Bounce) -> tuple[float, float, float]:
    """Measure ``(read_Bps, write_Bps, latency_s)`` the way slots are written and read.

    The throw-away file ``path`` takes a 64-byte and an ``nbytes`` record, each one ``pwritev`` with its
    checksum (``put_record``, the store's own write), read back with one ``preadv`` (through the aligned
    ``bounce`` buffer under direct I/O, as the store reads) and checked; the file is removed after.
    Raises ``OSError``.
    """
    big = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    small = big[:64]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        times = []
        for data in (small, big):
            head = bytes(PREFIX_SIZE + 64)
            dest = np.empty(data.nbytes, dtype=np.uint8)
            t0 = time.perf_counter()
            xxhash.xxh3_64_intdigest(memoryview(data.data))
            put_record(fd, 0, head, memoryview(data.data), direct)
            t1 = time.perf_counter()
            if direct:  # read back whole through the aligned buffer, as read_into() does
                n = slot_size(len(head) + data.nbytes)
                buf = bounce.get(n)
                pread_all(fd, [memoryview(buf.data)[:n]], 0)
                np.copyto(dest, buf[len(head) : len(head) + data.nbytes])
            else:
                pread_all(fd, [bytearray(len(head)), memoryview(dest.data)], 0)
            xxhash.xxh3_64_intdigest(memoryview(dest.data))
            t2 = time.perf_counter()
            times.append((t1 - t0, t2 - t1))
    finally:
        os.close(fd)
        remove_file(str(path))
    (w_small, r_small), (w_big, r_big) = times
    latency = max(1e-7, min(w_small, r_small))
    return nbytes / max(1e-9, r_big - r_small), nbytes / max(1e-9, w_big - w_small), latency
