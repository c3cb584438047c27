"""The SSD tier, ``files`` backend: one self-describing record file per block in a local directory
(the default ssd backend is :mod:`~.slab`).

Files are ``<key>.kvb`` (:func:`~.record.key_name`), written as
``<key>.kvb.tmp`` then renamed, so a reader never sees half a file under the
final name. After a restart :meth:`FileStore.scan` reads every record,
checks magic, length, checksum and that the header's hash matches the file
name, keeps the valid ones (the manager re-announces them as KV events) and
deletes corrupt or truncated ones, counting them by reason. Files that are
not ours (other names, and entries named like a record that are not regular
files: directories, FIFOs, symlinks) are left alone and counted as
``foreign``; one that cannot be read is left and counted as ``io``;
leftover ``.tmp`` files from an interrupted write are removed (``partial``).
Record files are opened without following a symlink.

A full disk (``ENOSPC``) or any other ``OSError`` on write becomes
:class:`TierIOError` with ``kind`` ``no_space`` or ``io``; nothing is left
behind and the manager keeps the block where it was.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvfleet.agent.codecs import Payload, as_payload
from kvfleet.agent.tiers.base import RecordStore, ScanReport
from kvfleet.agent.tiers.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    TierIOError,
    TruncatedBlockError,
)
from kvfleet.agent.tiers.fileio import advance_views, remove_file
from kvfleet.agent.tiers.record import (
    PREFIX_SIZE,
    BlockMeta,
    decode_header,
    hash_from_key,
    key_name,
    pack,
    read_prefix,
    unpack,
    verify,
)
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import SsdTierSpec, TierSpec

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".kvb.tmp"


class FileStore(RecordStore):
    """A file per block under ``spec.path``; capacity counts whole record files."""

    backend = "files"
    reads_into = True

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        super().__init__(tier, spec)
        path = spec.path if isinstance(spec, SsdTierSpec) else SsdTierSpec().path
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        return f"{self.tier} tier: files in {self.root}, capacity {self.capacity_bytes} bytes"

    def _path(self, block_hash: BlockHash) -> Path:
        return self.root / (key_name(block_hash) + SUFFIX)

    def write(self, meta: BlockMeta, payload: Payload, digest: int | None = None) -> int:
        head, body = pack(meta, payload, digest=digest)
        size = len(head) + body.nbytes
        with self._lock:
            old = self._check_room(meta.hash, size)
            self._account(meta.hash, size)
        final = self._path(meta.hash)
        tmp = final.with_name(final.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, head, body)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            with self._lock:
                self._used -= size
                if old:
                    self._sizes[meta.hash] = old
                    self._used += old
                else:
                    self._sizes.pop(meta.hash, None)
            tmp.unlink(missing_ok=True)
            kind = "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
            raise TierIOError(f"{self.tier}: cannot write {final.name}: {exc}", kind=kind) from exc
        return size

    def read(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload]:
        path = self._path(block_hash)
        try:
            with open(_open_record(path), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = np.empty(size, dtype=np.uint8)  # not zero-filled: one memory pass fewer
                got = f.readinto(memoryview(buf.data))
        except FileNotFoundError:
            raise BlockNotFoundError(block_hash) from None
        except OSError as exc:
            raise TierIOError(f"{self.tier}: cannot read {path.name}: {exc}") from exc
        meta, payload = unpack(memoryview(buf.data)[:got])
        if meta.hash != block_hash:
            raise CorruptBlockError(f"{path.name} holds block {meta.hash!r}", reason="mismatch")
        return meta, as_payload(payload)

    def read_into(self, block_hash: BlockHash, alloc: Callable[[BlockMeta, int], Payload]) -> BlockMeta:
        """Read a record's payload straight into ``alloc(meta, payload_len)`` (checked like :meth:`read`)."""
        path = self._path(block_hash)
        try:
            with open(_open_record(path), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(PREFIX_SIZE)
                header_len, payload_len, _ = read_prefix(prefix)
                if size != PREFIX_SIZE + header_len + payload_len:
                    raise TruncatedBlockError(
                        f"{path.name} is {size} bytes, its prefix says "
                        f"{PREFIX_SIZE + header_len + payload_len}")
                header = f.read(header_len)
                meta = decode_header(header)
                if meta.hash != block_hash:
                    raise CorruptBlockError(f"{path.name} holds block {meta.hash!r}", reason="mismatch")
                dest = alloc(meta, payload_len)
                view = memoryview(dest.data).cast("B")
                got = 0
                while got < payload_len:
                    n = f.readinto(view[got:])
                    if not n:
                        raise TruncatedBlockError(f"{path.name} ended early")
                    got += n
        except FileNotFoundError:
            raise BlockNotFoundError(block_hash) from None
        except OSError as exc:
            raise TierIOError(f"{self.tier}: cannot read {path.name}: {exc}") from exc
        verify(prefix, header, view)
        return meta

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._forget(block_hash)
        try:
            self._path(block_hash).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("%s tier: cannot delete %s: %s", self.tier, key_name(block_hash), exc)

    def scan(self) -> ScanReport:
        report = ScanReport()
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                remove_file(entry.path)
                report.drop("partial")
                continue
            if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                log.warning("%s tier: ignoring foreign file %s in %s", self.tier, name, self.root)
                report.drop("foreign")
                continue
            try:
                expected = hash_from_key(name[: -len(SUFFIX)])
                meta, _ = self.read(expected)
            except ValueError:
                log.warning("%s tier: ignoring foreign file %s in %s", self.tier, name, self.root)
                report.drop("foreign")
                continue
            except CorruptBlockError as exc:
                log.warning("%s tier: dropping %s (%s: %s)", self.tier, name, exc.reason, exc)
                remove_file(entry.path)
                report.drop(exc.reason)
                continue
            except (BlockNotFoundError, TierIOError) as exc:
                log.warning("%s tier: cannot read %s: %s", self.tier, name, exc)
                report.drop("io")
                continue
            size = entry.stat().st_size
            with self._lock:
                self._account(expected, size)
            report.blocks.append(meta)
        return report


def _open_record(path: Path) -> int:
    """A read-only descriptor of a record file (a symlink is not followed: ``OSError``)."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _write_all(fd: int, *parts: bytes | memoryview) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        advance_views(views, n)
