"""The simulator's tiers below its GPU stand-in: the seam :class:`SlowTiers`, and the built-in :class:`LocalTiers`.

:class:`LocalTiers` is used when no agent tier manager is wired in (``engine.tiers.backend`` other than
``agent``, see :mod:`kvfleet.engine.tiers`): a host LRU (``cpu``) and a directory of block files (``ssd``)
whose header ``{magic, hash, parent, tokens, length, xxh64}`` lets a restarted engine rescan, verify and
re-announce what it had (corrupt files are dropped and counted; entries that are not regular files are
skipped and counted). Every store and removal is a KV event (``medium`` = tier).
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from kvfleet.cache.events import EventSink, null_sink, removed, stored
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.engine import EngineTierSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlowBlock:
    """A block held below the GPU: its bytes plus what a KV event needs to announce it."""

    block_hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    data: bytes


class SlowTiers(Protocol):
    """What :class:`EngineKV` needs from the tiers below the GPU (the agent's tier manager fits this seam)."""

    def put(self, block: SlowBlock) -> None:
        """Take a block demoted from the GPU (may cascade further down or drop)."""
        ...

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        """Tiers of the leading ``hashes`` present below the GPU (stops at the first miss)."""
        ...

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        """Read a block (for promotion); ``None`` if it is gone."""
        ...

    def announce(self) -> None:
        """Re-emit ``BlockStored`` for everything held (after a restart)."""
        ...

    def clear(self) -> None:
        """Drop every block (``BlockRemoved`` per tier)."""
        ...


class NoTiers:
    """No tier below the GPU: demoted blocks are dropped."""

    def put(self, block: SlowBlock) -> None:
        return None

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        return []

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        return None

    def announce(self) -> None:
        return None

    def clear(self) -> None:
        return None


_MAGIC = b"KVFB1\x00"
_HEADER = struct.Struct("<6sHHIQ")  # magic, hash_len, parent_len, n_tokens, data_len; then a trailing xxh64


def _hash_bytes(h: BlockHash | None) -> bytes:
    if h is None:
        return b""
    if isinstance(h, bytes):
        return h
    return b"\x00" + int(h).to_bytes(8, "big")


def _hash_from(raw: bytes) -> BlockHash | None:
    if not raw:
        return None
    if len(raw) == 9 and raw[0] == 0:
        return int.from_bytes(raw[1:], "big")
    return raw


def _file_name(h: BlockHash) -> str:
    return (h.hex() if isinstance(h, bytes) else f"{int(h):016x}") + ".kvb"


def encode_block_file(block: SlowBlock) -> bytes:
    """One SSD block file: header, hash, parent, token ids (uint32), data, xxh64 of all before it."""
    hb, pb = _hash_bytes(block.block_hash), _hash_bytes(block.parent)
    toks = np.asarray(block.token_ids, dtype="<u4").tobytes()
    body = _HEADER.pack(_MAGIC, len(hb), len(pb), len(block.token_ids), len(block.data)) + hb + pb + toks + block.data
    return body + xxhash.xxh64_digest(body)


class CorruptBlockFileError(ValueError):
    """A block file failed its header, length or checksum check."""


class _ForeignEntryError(OSError):
    """An entry named like a block file that is not a regular file."""


def _read_block_file(path: Path) -> bytes:
    """A block file's bytes; only a regular file is read (no symlink is followed, a FIFO never blocks)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _ForeignEntryError("not a regular file")
        return f.read()


def _unlink_file(path: Path) -> None:
    """Remove a file of ours; a failure is logged, never raised, and a directory under that name is left alone."""
    try:
        if path.is_dir() and not path.is_symlink():
            return
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("ssd tier: cannot remove %s (%s)", path.name, exc)


def decode_block_file(raw: bytes) -> SlowBlock:
    """Inverse of :func:`encode_block_file`; raises :class:`CorruptBlockFileError`."""
    if len(raw) < _HEADER.size + 8:
        raise CorruptBlockFileError("truncated header")
    magic, hl, pl, nt, dl = _HEADER.unpack_from(raw)
    if magic != _MAGIC:
        raise CorruptBlockFileError("bad magic")
    end = _HEADER.size + hl + pl + 4 * nt + dl
    if len(raw) != end + 8:
        raise CorruptBlockFileError(f"length {len(raw)} != {end + 8}")
    if xxhash.xxh64_digest(raw[:end]) != raw[end:]:
        raise CorruptBlockFileError("checksum mismatch")
    off = _HEADER.size
    h = _hash_from(raw[off : off + hl])
    off += hl
    parent = _hash_from(raw[off : off + pl])
    off += pl
    toks = tuple(np.frombuffer(raw[off : off + 4 * nt], dtype="<u4").tolist())
    off += 4 * nt
    if h is None:
        raise CorruptBlockFileError("empty block hash")
    return SlowBlock(block_hash=h, parent=parent, token_ids=toks, data=raw[off : off + dl])


class LocalTiers:
    """Host LRU (``cpu``) above a directory of block files (``ssd``); see the module doc.

    A block lives in exactly one of them. ``put`` inserts into the CPU tier,
    spilling its least recently used block to SSD, whose own overflow is
    dropped. Reading a block for promotion leaves it where it is (the GPU copy
    is announced by the GPU's own event).
    """

    def __init__(self, settings: EngineTierSettings, block_size: int, sink: EventSink = null_sink) -> None:
        self.settings = settings
        self.block_size = block_size
        self.sink = sink
        self.cpu: OrderedDict[BlockHash, SlowBlock] = OrderedDict()
        self.ssd: OrderedDict[BlockHash, Path] = OrderedDict()
        self.ssd_dir = Path(settings.ssd_dir) if settings.ssd_dir else None
        self.corrupt_files = 0
        self.recovered_blocks = 0
        if self.ssd_dir is not None:
            self.ssd_dir.mkdir(parents=True, exist_ok=True)
            self._rescan()

    def _rescan(self) -> None:
        """Index the block files left in ``ssd_dir``; never raises for what it finds there.

        Only regular files are read (opened without following links and without
        blocking, so a FIFO cannot hang the start). An entry that is not a
        regular file or cannot be read (a directory, FIFO, socket, symlink,
        unreadable file) is skipped, left in place, logged once and counted in
        ``corrupt_files``; a readable file that fails its checks is deleted and
        counted the same way.
        """
        assert self.ssd_dir is not None
        found: list[tuple[float, str, Path]] = []
        with os.scandir(self.ssd_dir) as entries:
            for entry in entries:
                if not entry.name.endswith(".kvb"):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError as exc:
                    self._skip(entry.name, f"cannot stat: {exc.strerror or exc}")
                    continue
                if not stat.S_ISREG(st.st_mode):
                    self._skip(entry.name, "not a regular file")
                    continue
                found.append((st.st_mtime, entry.name, Path(entry.path)))
        for _mtime, _name, path in sorted(found):
            try:
                raw = _read_block_file(path)
            except _ForeignEntryError as exc:
                self._skip(path.name, str(exc))
                continue
            except OSError as exc:
                self._skip(path.name, f"cannot read: {exc.strerror or exc}")
                continue
            try:
                block = decode_block_file(raw)
                if path.name != _file_name(block.block_hash):
                    raise CorruptBlockFileError("file name does not match its block hash")
            except CorruptBlockFileError as exc:
                self.corrupt_files += 1
                log.warning("ssd tier: dropping %s (%s)", path.name, exc)
                _unlink_file(path)
                continue
            self.ssd[block.block_hash] = path
            self.recovered_blocks += 1
        for path in self.ssd_dir.glob("*.tmp"):
            _unlink_file(path)

    def _skip(self, name: str, why: str) -> None:
        self.corrupt_files += 1
        log.warning("ssd tier: skipping %s in %s (%s)", name, self.ssd_dir, why)

    def announce(self) -> None:
        if not self.ssd_dir:
            return
        for h in list(self.ssd):
            block = self._read_ssd(h)
            if block is not None:
                self.sink(stored([h], block.parent, block.token_ids, self.block_size, Tier.SSD.medium))

    def put(self, block: SlowBlock) -> None:
        h = block.block_hash
        if h in self.cpu:
            self.cpu.move_to_end(h)
            return
        if h in self.ssd:
            self.ssd.move_to_end(h)
            return
        if self.settings.cpu_blocks > 0:
            self.cpu[h] = block
            self.sink(stored([h], block.parent, block.token_ids, self.block_size, Tier.CPU.medium))
            while len(self.cpu) > self.settings.cpu_blocks:
                _, old = self.cpu.popitem(last=False)
                self.sink(removed([old.block_hash], Tier.CPU.medium))
                self._put_ssd(old)
        else:
            self._put_ssd(block)

    def _put_ssd(self, block: SlowBlock) -> None:
        if self.ssd_dir is None or self.settings.ssd_blocks == 0:
            return
        path = self.ssd_dir / _file_name(block.block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(encode_block_file(block))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("ssd tier: cannot write %s (%s); block dropped", path.name, exc)
            return
        self.ssd[block.block_hash] = path
        self.sink(stored([block.block_hash], block.parent, block.token_ids, self.block_size, Tier.SSD.medium))
        while len(self.ssd) > self.settings.ssd_blocks:
            old_h, old_path = self.ssd.popitem(last=False)
            _unlink_file(old_path)
            self.sink(removed([old_h], Tier.SSD.medium))

    def clear(self) -> None:
        if self.cpu:
            self.sink(removed(list(self.cpu), Tier.CPU.medium))
            self.cpu.clear()
        if self.ssd:
            self.sink(removed(list(self.ssd), Tier.SSD.medium))
            for path in self.ssd.values():
                _unlink_file(path)
            self.ssd.clear()

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        out: list[Tier] = []
        for h in hashes:
            if h in self.cpu:
                out.append(Tier.CPU)
            elif h in self.ssd:
                out.append(Tier.SSD)
            else:
                break
        return out

    def _read_ssd(self, h: BlockHash) -> SlowBlock | None:
        path = self.ssd.get(h)
        if path is None:
            return None
        try:
            return decode_block_file(_read_block_file(path))
        except (OSError, CorruptBlockFileError) as exc:
            self.corrupt_files += 1
            log.warning("ssd tier: dropping unreadable %s (%s)", path.name, exc)
            self.ssd.pop(h, None)
            _unlink_file(path)
            self.sink(removed([h], Tier.SSD.medium))
            return None

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        if block_hash in self.cpu:
            self.cpu.move_to_end(block_hash)
            return self.cpu[block_hash]
        return self._read_ssd(block_hash)


