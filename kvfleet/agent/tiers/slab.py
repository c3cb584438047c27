"""The SSD tier in slab files: many fixed-size block slots per preallocated file.

Layout of ``spec.path``::

    slab-00000.kvs   4096-byte file header  "KVFS" | version u16 | flags u16 | slot_bytes u64 | slots u64
                     then ``slots`` slots of ``slot_bytes``; a used slot starts with one record
                     (:mod:`~.record`: prefix, msgpack header, payload), a free one with 4 zero bytes
    slab-00001.kvs   ...

Why slots instead of a file per block (:class:`~.ssd.FileStore`): a write is
one ``os.pwritev`` of record head and payload at a known offset of a file
that is already open and preallocated (``posix_fallocate``), and a read one
``os.preadv`` straight into the caller's buffer — no ``open``/``rename``/
``unlink`` per block, so moving a block costs about what a plain sequential
write or read of its bytes costs. Files are :data:`SLAB_BYTES` (256 MiB)
each, or the tier's capacity when that is smaller (the slots per file are
then kept from the first file after a restart), created when first needed and
kept; freed slots are reused (a free-slot list). Delete clears the slot's
magic (one 4-byte write), so a deleted block does not come back after a
restart; :meth:`SlabStore.forget` (a block moved to a faster tier) frees the
slot but leaves its record, which stays valid until the slot is reused
(blocks are content-addressed), so a restart can still find it.

Direct I/O (``direct_io``, the default): see :mod:`~.slabio`, which holds the aligned buffers, the
vectored read/write loops and the calibration probe.

Slot size: the first record's size plus :data:`HEADER_ROOM` for larger
headers (more token ids), rounded up to 4 KiB; after a restart, the slot size
written in the existing files wins. A record that does not fit a slot raises
:class:`BlockTooLargeError` (the manager uses the next tier).

Restart (:meth:`SlabStore.scan`): every slot of every slab file is read and
checked like any record (magic, lengths, xxh3 checksum over header and
payload); valid records are re-indexed, duplicates and corrupt or truncated
slots (a slab file cut short, a torn write) are cleared and counted by
reason. Files that are not ours are left alone (``foreign``); record files
of the ``files`` backend (``*.kvb``) found in the directory are checked and
moved into slots, so switching backends keeps the blocks; ``*.kvb.tmp``
leftovers are removed (``partial``). Only regular files are read, without
following a symlink or blocking on a FIFO: any other entry named like a
record file (a directory, FIFO, symlink) is ``foreign`` and one that cannot
be read ``io``, each logged once and left in place.

Durability: like :class:`~.ssd.FileStore`, no fsync — a record lost or torn
in a crash fails its checks and is a miss, never wrong data.

A full disk (``ENOSPC`` on preallocation or write) or any other ``OSError``
becomes :class:`TierIOError` (``no_space`` / ``io``); the slot is freed and
the manager keeps the block where it was. Slots being read are leased: a
concurrent delete frees them only after the read.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvfleet.agent.codecs import Payload, as_payload
from kvfleet.agent.tiers.base import ScanReport, SlotLeases, TierStore, encoded_nbytes, spec_record
from kvfleet.agent.tiers.errors import (
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    TierFullError,
    TierIOError,
    TruncatedBlockError,
)
from kvfleet.agent.tiers.fileio import read_regular, remove_file
from kvfleet.agent.tiers.record import (
    MAGIC,
    PREFIX_SIZE,
    BlockMeta,
    decode_header,
    hash_from_key,
    pack,
    read_prefix,
    unpack,
    verify,
)
from kvfleet.agent.tiers.slabio import SLOT_ALIGN, ZERO_COPY_MIN, Bounce, probe
from kvfleet.agent.tiers.slabio import aligned as _aligned
from kvfleet.agent.tiers.slabio import dio_ready as _dio_ready
from kvfleet.agent.tiers.slabio import io_error as _io_error
from kvfleet.agent.tiers.slabio import pread_all as _pread_all
from kvfleet.agent.tiers.slabio import pwrite_all as _pwrite_all
from kvfleet.agent.tiers.slabio import slot_size as _slot_size
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import SsdTierSpec, TierSpec

log = logging.getLogger(__name__)

FILE_MAGIC = b"KVFS"
FILE_VERSION = 1
_FILE_HEADER = struct.Struct("<4sHHQQ")
FILE_HEADER_SIZE = 4096
#: room left in a slot for record headers larger than the first one's.
HEADER_ROOM = 1024
SLAB_BYTES = 256 << 20
_NAME = re.compile(r"^slab-(\d{5})\.kvs$")
_LEGACY, _LEGACY_TMP = ".kvb", ".kvb.tmp"
_ZERO4 = bytes(4)
#: the calibration probe's throw-away file (removed at start-up if a crash left it).
PROBE_NAME = "slab-probe.tmp"


@dataclass
class _Slot:
    meta: BlockMeta
    header_len: int
    payload_len: int
    checksum: int


class SlabStore(TierStore):
    """Block records in fixed slots of preallocated slab files; capacity counts whole slots."""

    backend = "slab"
    reads_into = True

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        super().__init__(tier, spec)
        sspec = spec if isinstance(spec, SsdTierSpec) else SsdTierSpec()
        self.root = Path(sspec.path)
        self.root.mkdir(parents=True, exist_ok=True)
        #: whether slots are written and read with O_DIRECT (off when the filesystem refuses it)
        self.direct = sspec.direct_io
        self.slot_bytes = 0
        self._per_file = 0
        #: per slab file: a buffered fd (file header, slot clears) and the fd for slot I/O
        #: (O_DIRECT or the same)
        self._fds: list[int] = []
        self._io_fds: list[int] = []
        self._bounce = Bounce()
        self._heads = Bounce()
        self._free: list[int] = []
        self._next_slot = 0
        self._slots: dict[int, _Slot] = {}
        self._where: dict[BlockHash, int] = {}
        self._leases = SlotLeases()
        self._lock = threading.Lock()
        self._partial = 0
        self._open_existing()

    # ------------------------------------------------------------ geometry

    @property
    def used_bytes(self) -> int:
        return len(self._where) * self.slot_bytes

    @property
    def num_slots(self) -> int:
        return self.capacity_bytes // self.slot_bytes if self.slot_bytes else 0

    def charge(self, payload_nbytes: int) -> int:
        return self.slot_bytes or _slot_size(PREFIX_SIZE + 64 + payload_nbytes)

    @classmethod
    def block_charge(cls, spec: TierSpec, meta: BlockMeta) -> int:
        """The slot a first record like ``meta``'s gives a new directory: record + :data:`HEADER_ROOM`,
        rounded up to 4 KiB."""
        sspec = spec if isinstance(spec, SsdTierSpec) else SsdTierSpec()
        big = sspec.direct_io and encoded_nbytes(spec, meta) >= ZERO_COPY_MIN
        head, body = spec_record(spec, meta, align=SLOT_ALIGN if big else 0)
        return _slot_size(len(head) + body.nbytes + HEADER_ROOM)

    def describe(self) -> str:
        io = "direct I/O" if self.direct else "buffered I/O"
        return (f"{self.tier} tier: slab files in {self.root} ({io}), capacity {self.capacity_bytes} bytes, "
                f"slot {self.slot_bytes or 'auto'}")

    def _file_path(self, i: int) -> Path:
        return self.root / f"slab-{i:05d}.kvs"

    def _locate(self, slot: int) -> tuple[int, int]:
        """The buffered fd of the slot's file and the slot's offset."""
        f, i = divmod(slot, self._per_file)
        return self._fds[f], FILE_HEADER_SIZE + i * self.slot_bytes

    def _locate_io(self, slot: int) -> tuple[int, int]:
        """The fd for slot I/O (O_DIRECT when on) of the slot's file and the slot's offset."""
        f, i = divmod(slot, self._per_file)
        return self._io_fds[f], FILE_HEADER_SIZE + i * self.slot_bytes

    def _add_file(self, fd: int, path: Path) -> None:
        """Track an open slab file; with direct I/O also open it with O_DIRECT (falls back once if
        refused)."""
        io_fd = fd
        if self.direct:
            try:
                io_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("%s tier: %s refuses O_DIRECT (%s); using buffered I/O",
                            self.tier, self.root, exc)
                self.direct = False
        self._fds.append(fd)
        self._io_fds.append(io_fd)

    def _set_slot_bytes(self, slot_bytes: int, per_file: int = 0) -> None:
        """Fix the slot size and the slots per file: ``per_file`` when given (an existing file's), else as
        many as :data:`SLAB_BYTES` holds, or the tier's capacity when that is smaller (a small tier, a
        small file)."""
        self.slot_bytes = slot_bytes
        most = (SLAB_BYTES - FILE_HEADER_SIZE) // slot_bytes
        self._per_file = per_file or max(1, min(most, self.capacity_bytes // slot_bytes))

    # ---------------------------------------------------------- slab files

    def _open_existing(self) -> None:
        """Open the slab files left by an earlier run (their slots are read by :meth:`scan`)."""
        names = sorted(int(m.group(1)) for e in os.scandir(self.root) if (m := _NAME.match(e.name)))
        for expected, i in enumerate(names):
            if i != expected:
                log.warning("%s tier: slab files stop at %s (next is %s); later ones are ignored",
                            self.tier, self._file_path(expected).name, self._file_path(i).name)
                break
            path = self._file_path(i)
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                log.warning("%s tier: cannot open %s: %s", self.tier, path.name, exc)
                break
            head = os.pread(fd, _FILE_HEADER.size, 0)
            if not head.strip(b"\0") and i == len(names) - 1:
                # created but never initialised (a crash right after creating it): ours, and empty
                log.warning("%s tier: removing uninitialised slab file %s", self.tier, path.name)
                os.close(fd)
                remove_file(str(path))
                self._partial += 1
                break
            ok = len(head) == _FILE_HEADER.size
            magic, version, _flags, slot_bytes, slots = _FILE_HEADER.unpack(head) if ok else (b"", 0, 0, 0, 0)
            if (not ok or magic != FILE_MAGIC or version != FILE_VERSION or slot_bytes <= 0
                    or (self.slot_bytes and slot_bytes != self.slot_bytes)):
                log.warning("%s tier: %s is not a slab file of this store; it and later ones are ignored",
                            self.tier, path.name)
                os.close(fd)
                break
            if not self.slot_bytes:
                self._set_slot_bytes(slot_bytes, slots)
            if slots != self._per_file:
                log.warning("%s tier: %s holds %d slots, expected %d; it and later ones are ignored",
                            self.tier, path.name, slots, self._per_file)
                os.close(fd)
                break
            try:
                self._add_file(fd, path)
            except OSError as exc:
                log.warning("%s tier: cannot open %s: %s", self.tier, path.name, exc)
                os.close(fd)
                break
        self._next_slot = len(self._fds) * self._per_file

    def _new_file(self) -> None:
        """Create and preallocate the next slab file (caller holds the lock)."""
        i = len(self._fds)
        path = self._file_path(i)
        size = FILE_HEADER_SIZE + self._per_file * self.slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # never clobber a file that is not ours
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                log.warning("%s tier: cannot preallocate %s (%s); writing it sparse",
                            self.tier, path.name, exc)
            head = _FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, 0, self.slot_bytes, self._per_file)
            _pwrite_all(fd, [head], 0)
            self._add_file(fd, path)
        except OSError:
            os.close(fd)
            remove_file(str(path))
            raise

    def _alloc(self) -> int:
        """A free slot (caller holds the lock); new slab files are made as needed."""
        if self._free:
            return self._free.pop()
        if self._next_slot >= self.num_slots:
            raise TierFullError(f"{self.tier}: all {self.num_slots} slots in use")
        slot = self._next_slot
        while slot // self._per_file >= len(self._fds):
            self._new_file()
        self._next_slot += 1
        return slot

    def _release_slot(self, slot: int) -> None:
        """Free a slot on disk and for reuse (caller holds the lock); a leased one once its reads end."""
        self._slots.pop(slot, None)
        if not self._leases.defer(slot):
            self._clear(slot)
            self._free.append(slot)

    # ----------------------------------------------------------- TierStore

    def write(self, meta: BlockMeta, payload: Payload, digest: int | None = None) -> int:
        # Large payloads under direct I/O get a header padded to a page, so that a payload in page-aligned
        # memory is written and read where it is; small ones go through the bounce buffer unpadded.
        big = self.direct and payload.nbytes >= ZERO_COPY_MIN
        head, body = pack(meta, payload, align=SLOT_ALIGN if big else 0, digest=digest)
        size = len(head) + body.nbytes
        with self._lock:
            if not self.slot_bytes:
                self._set_slot_bytes(_slot_size(size + HEADER_ROOM))
            if size > self.slot_bytes:
                raise BlockTooLargeError(
                    f"{self.tier}: record of {size} bytes exceeds the {self.slot_bytes}-byte slot")
            try:
                slot = self._alloc()
            except OSError as exc:
                raise _io_error(self.tier, "cannot create a slab file", exc) from exc
            fd, offset = self._locate_io(slot)
            direct = self.direct
        try:
            self._put_record(fd, offset, head, body, direct)
        except OSError as exc:
            with self._lock:
                self._clear(slot)  # a partial record would only fail its checks, but leave none
                self._free.append(slot)
            raise _io_error(self.tier, f"cannot write slot {slot}", exc) from exc
        _, _, checksum = read_prefix(head)
        with self._lock:
            old = self._where.pop(meta.hash, None)
            if old is not None:
                self._release_slot(old)
            self._where[meta.hash] = slot
            self._slots[slot] = _Slot(meta, len(head) - PREFIX_SIZE, body.nbytes, checksum)
        return self.slot_bytes

    def _put_record(self, fd: int, offset: int, head: bytes, body: memoryview, direct: bool) -> None:
        """Write a record at ``offset``: as it is (buffered), in place (direct, page-sized head and
        page-aligned payload), or through the thread's bounce buffer padded to 4 KiB (other direct)."""
        if not direct:
            _pwrite_all(fd, [head, body], offset)
        elif _dio_ready(len(head), body):
            hbuf = self._heads.get(len(head))
            hbuf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            _pwrite_all(fd, [memoryview(hbuf.data)[: len(head)], body], offset)
        else:
            n, size = len(head), len(head) + body.nbytes
            buf = self._bounce.get(size)
            buf[:n] = np.frombuffer(head, dtype=np.uint8)
            buf[n:size] = np.frombuffer(body, dtype=np.uint8)
            _pwrite_all(fd, [memoryview(buf.data)[: _slot_size(size)]], offset)

    def _lease(self, block_hash: BlockHash) -> tuple[int, _Slot]:
        with self._lock:
            slot = self._where.get(block_hash)
            if slot is None:
                raise BlockNotFoundError(block_hash)
            self._leases.take(slot)
            return slot, self._slots[slot]

    def _unlease(self, slot: int) -> None:
        with self._lock:
            if self._leases.end(slot):
                if self._leases.pop_clear(slot):
                    self._clear(slot)
                self._free.append(slot)

    def read(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload]:
        box: list[Payload] = []

        def alloc(meta: BlockMeta, nbytes: int) -> Payload:
            box.append(np.empty(nbytes, dtype=np.uint8))  # not zero-filled: one memory pass fewer
            return box[0]

        meta = self.read_into(block_hash, alloc)
        return meta, as_payload(box[0])

    def read_into(self, block_hash: BlockHash, alloc: Callable[[BlockMeta, int], Payload]) -> BlockMeta:
        """Read a record's payload into ``alloc(meta, payload_len)``, checked.

        Buffered I/O, or direct I/O of a page-sized head and payload into a page-aligned destination:
        one ``preadv`` of the head and straight into the destination, then checked there. Other direct
        I/O: one aligned ``preadv`` of the whole record into the thread's bounce buffer, checked there,
        then the payload copied out.
        """
        slot, info = self._lease(block_hash)
        total = PREFIX_SIZE + info.header_len + info.payload_len
        dest: Payload | None = None
        copy_from: memoryview | None = None  # bounce-buffer reads: the payload, copied out once checked
        try:
            fd, offset = self._locate_io(slot)
            try:
                if (self.direct and (PREFIX_SIZE + info.header_len) % SLOT_ALIGN == 0
                        and info.payload_len % SLOT_ALIGN == 0):
                    dest = as_payload(alloc(info.meta, info.payload_len))[: info.payload_len]
                direct_into = dest is not None and dest.ctypes.data % SLOT_ALIGN == 0
                if direct_into:
                    # padded head into a small aligned buffer, the payload straight into ``dest``
                    assert dest is not None
                    head: bytearray | memoryview = memoryview(
                        self._heads.get(PREFIX_SIZE + info.header_len).data)[: PREFIX_SIZE + info.header_len]
                    view = memoryview(dest.data).cast("B")
                    got = _pread_all(fd, [head, view], offset)
                elif self.direct:
                    whole = memoryview(self._bounce.get(self.slot_bytes).data)
                    got = _pread_all(fd, [whole[: _slot_size(total)]], offset)
                    head = whole[: PREFIX_SIZE + info.header_len]
                    view = copy_from = whole[PREFIX_SIZE + info.header_len : total]
                else:
                    head = bytearray(PREFIX_SIZE + info.header_len)
                    dest = alloc(info.meta, info.payload_len)
                    view = memoryview(dest.data).cast("B")[: info.payload_len]
                    got = _pread_all(fd, [head, view], offset)
            except OSError as exc:
                raise TierIOError(f"{self.tier}: cannot read slot {slot}: {exc}") from exc
        finally:
            self._unlease(slot)
        if got < total:
            raise TruncatedBlockError(f"slot {slot} of {block_hash!r} ended early")
        header_len, payload_len, checksum = read_prefix(head)
        if header_len != info.header_len or payload_len != info.payload_len or checksum != info.checksum:
            raise CorruptBlockError(f"slot {slot} no longer holds the record of {block_hash!r}")
        verify(head, memoryview(head)[PREFIX_SIZE:], view)
        meta = decode_header(memoryview(head)[PREFIX_SIZE:])
        if meta.hash != block_hash:
            raise CorruptBlockError(f"slot {slot} holds block {meta.hash!r}", reason="mismatch")
        if copy_from is not None:
            out = dest if dest is not None else as_payload(alloc(meta, payload_len))[:payload_len]
            np.copyto(out, np.frombuffer(copy_from, dtype=np.uint8))
        return meta

    def _clear(self, slot: int) -> None:
        """Mark a slot free on disk (its magic zeroed); errors are logged (a stale record is only a miss)."""
        fd, offset = self._locate(slot)
        try:
            os.pwrite(fd, _ZERO4, offset)
        except OSError as exc:
            log.warning("%s tier: cannot clear slot %d: %s", self.tier, slot, exc)

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            slot = self._where.pop(block_hash, None)
            if slot is None:
                return
            self._release_slot(slot)

    def forget(self, block_hash: BlockHash) -> None:
        """Free the block's slot but leave its record on disk (valid until the slot is reused)."""
        with self._lock:
            slot = self._where.pop(block_hash, None)
            if slot is None:
                return
            self._slots.pop(slot, None)
            if not self._leases.defer(slot, clear=False):
                self._free.append(slot)

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._where

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            return iter(list(self._where))

    def close(self) -> None:
        with self._lock:
            for fd in {*self._fds, *self._io_fds}:
                try:
                    os.close(fd)
                except OSError as exc:
                    log.warning("%s tier: close failed: %s", self.tier, exc)
            self._fds.clear()
            self._io_fds.clear()
            self._where.clear()
            self._slots.clear()
            self._free.clear()
            self._next_slot = 0

    def probe(self, nbytes: int) -> tuple[float, float, float]:
        """Measure ``(read_Bps, write_Bps, latency_s)`` the way slots are written and read
        (:func:`~.slabio.probe`, in a throw-away file: no slot is used, so the slot size stays open)."""
        try:
            return probe(self.root / PROBE_NAME, max(4096, min(nbytes, self.capacity_bytes // 4)),
                         self.direct, self._put_record, self._bounce)
        except OSError as exc:
            raise _io_error(self.tier, "cannot probe", exc) from exc

    # -------------------------------------------------------------- rescan

    def scan(self) -> ScanReport:
        report = ScanReport()
        for _ in range(self._partial):
            report.drop("partial")
        self._partial = 0
        buf = _aligned(self.slot_bytes) if self.slot_bytes else None
        for slot in range(len(self._fds) * self._per_file):
            assert buf is not None
            self._scan_slot(slot, buf, report)
        self._next_slot = len(self._fds) * self._per_file
        self._free.sort(reverse=True)  # lowest slots first: writes stay near the start of the files
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            name = entry.name
            m = _NAME.match(name)
            if m and int(m.group(1)) < len(self._fds):
                continue
            if name.endswith(_LEGACY_TMP) or name == PROBE_NAME:
                remove_file(entry.path)
                report.drop("partial")
            elif name.endswith(_LEGACY) and entry.is_file(follow_symlinks=False):
                self._adopt(entry.path, name[: -len(_LEGACY)], report)
            else:
                log.warning("%s tier: ignoring foreign file %s in %s", self.tier, name, self.root)
                report.drop("foreign")
        return report

    def _scan_slot(self, slot: int, buf: Payload, report: ScanReport) -> None:
        """Check one slot: its first 4 KiB, then (if it holds a record) the rest of the record."""
        fd, offset = self._locate_io(slot)
        whole = memoryview(buf.data)
        try:
            got = _pread_all(fd, [whole[:SLOT_ALIGN]], offset)
            if got == SLOT_ALIGN and bytes(whole[:4]) == MAGIC:
                header_len, payload_len, _ = read_prefix(whole)
                end = min(self.slot_bytes, _slot_size(PREFIX_SIZE + header_len + payload_len))
                if end > SLOT_ALIGN:
                    got += _pread_all(fd, [whole[SLOT_ALIGN:end]], offset + SLOT_ALIGN)
        except CorruptBlockError:
            pass  # judged below, on what was read
        except OSError as exc:
            log.warning("%s tier: cannot read slot %d: %s", self.tier, slot, exc)
            report.drop("io")
            self._free.append(slot)
            return
        view = whole[:got]
        if got < 4 or bytes(view[:4]) == _ZERO4:  # free, or beyond the end of a file cut short
            self._free.append(slot)
            return
        try:
            header_len, payload_len, checksum = read_prefix(view)
            total = PREFIX_SIZE + header_len + payload_len
            if total > self.slot_bytes:
                raise CorruptBlockError(f"record of {total} bytes in a {self.slot_bytes}-byte slot")
            if total > got:
                raise TruncatedBlockError(f"slot {slot} holds {got} of {total} bytes")
            meta, _ = unpack(view[:total])
        except CorruptBlockError as exc:
            log.warning("%s tier: dropping slot %d of %s (%s: %s)", self.tier, slot,
                        self._file_path(slot // self._per_file).name, exc.reason, exc)
            report.drop(exc.reason)
            self._clear(slot)
            self._free.append(slot)
            return
        if meta.hash in self._where:
            self._clear(slot)  # the same block twice (a crash between write and clear): keep one
            self._free.append(slot)
            return
        self._where[meta.hash] = slot
        self._slots[slot] = _Slot(meta, header_len, payload_len, checksum)
        report.blocks.append(meta)

    def _adopt(self, path: str, key: str, report: ScanReport) -> None:
        """Move a record file of the ``files`` backend into a slot (checked first)."""
        try:
            expected = hash_from_key(key)
        except ValueError:
            log.warning("%s tier: ignoring foreign file %s in %s",
                        self.tier, os.path.basename(path), self.root)
            report.drop("foreign")
            return
        try:
            raw = read_regular(path)
            meta, payload = unpack(raw)
            if meta.hash != expected:
                raise CorruptBlockError(f"{os.path.basename(path)} holds block {meta.hash!r}",
                                        reason="mismatch")
        except CorruptBlockError as exc:
            log.warning("%s tier: dropping %s (%s: %s)", self.tier, os.path.basename(path), exc.reason, exc)
            remove_file(path)
            report.drop(exc.reason)
            return
        except OSError as exc:
            log.warning("%s tier: cannot read %s: %s", self.tier, os.path.basename(path), exc)
            report.drop("io")
            return
        if meta.hash not in self._where:
            try:
                self.write(meta, as_payload(payload))
            except (TierFullError, BlockTooLargeError, TierIOError) as exc:
                log.warning("%s tier: cannot move %s into a slot (%s); left in place",
                            self.tier, os.path.basename(path), exc)
                report.drop("io")
                return
            report.blocks.append(meta)
        remove_file(path)
