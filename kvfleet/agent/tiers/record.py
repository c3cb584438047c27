"""The self-describing record a block is stored as in the SSD and remote tiers.

Layout (little-endian)::

    prefix  28 bytes  magic "KVFB" | version u16 | flags u16 | header_len u32 | payload_len u64 | checksum u64
    header            msgpack [hash, codec, dtype, shape, raw_nbytes, parent, token_ids, pad]
    payload           the codec's bytes

``pad`` (zero bytes, may be absent) makes prefix + header a multiple of an
I/O alignment when the writer asks for it (``pack(..., align=4096)``: the slab
store's direct I/O then writes and reads the payload straight from and into
page-aligned memory, with no bounce copy). Readers ignore it.

``checksum`` is the xxh3-64 of the header seeded with the xxh3-64 of the
payload (version 2; version 1 records, one xxh3-64 over header and payload,
are still read), so a torn write, a flipped bit or a foreign file is detected
when the record is read or rescanned; writes therefore need no fsync for
correctness (a block lost in a crash is a cache miss, never wrong data). The
payload's own digest lets a writer hash a block where its bytes are still in
the CPU cache (the staging copy, :func:`copy_digest`) instead of reading them
from memory again right before the write: on a virtual disk that copies the
write out of guest memory, that second read slows the write itself.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np
import xxhash

from kvfleet.agent.codecs import Payload
from kvfleet.agent.tiers.errors import CorruptBlockError, TruncatedBlockError
from kvfleet.cache.hashing import BlockHash

if TYPE_CHECKING:
    from typing_extensions import Buffer  # anything with the buffer protocol

MAGIC = b"KVFB"
VERSION = 2
#: record versions read (version 1: one xxh3-64 over header and payload)
VERSIONS = (1, 2)
#: bytes copied and hashed at a time by :func:`copy_digest` (stays in the core's L2 between the two)
COPY_CHUNK = 256 << 10
_PREFIX = struct.Struct("<4sHHIQQ")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER = 1 << 20


class BlockMeta(NamedTuple):
    """Everything about a block except its bytes; travels in every record header.

    A named tuple (immutable, like a frozen dataclass, but made about 7 × faster: one is made for every
    block a tier stores)."""

    hash: BlockHash
    codec: str = "none"
    dtype: str = "float16"
    shape: tuple[int, ...] = ()
    #: bytes of the decoded block.
    raw_nbytes: int = 0
    parent: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class _Header(msgspec.Struct, array_like=True):
    hash: int | bytes
    codec: str
    dtype: str
    shape: list[int]
    raw_nbytes: int
    parent: int | bytes | None
    token_ids: list[int]
    pad: bytes = b""


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(_Header)


def key_name(block_hash: BlockHash) -> str:
    """A file/key-safe name: ``i`` + 16 hex digits for int hashes, ``b`` + hex for bytes."""
    if isinstance(block_hash, int):
        return f"i{block_hash:016x}"
    return "b" + block_hash.hex()


def hash_from_key(name: str) -> BlockHash:
    """Inverse of :func:`key_name`; raises ``ValueError`` for anything else."""
    if name.startswith("i") and len(name) == 17:
        return int(name[1:], 16)
    if name.startswith("b") and len(name) > 1:
        return bytes.fromhex(name[1:])
    raise ValueError(f"not a block key: {name!r}")


def pack(meta: BlockMeta, payload: Payload, align: int = 0,
         digest: int | None = None) -> tuple[bytes, memoryview]:
    """``(prefix + header, payload)``: write them back to back.

    ``align`` > 0: the header is padded so that prefix + header is a multiple of ``align``.
    ``digest``: the payload's :func:`payload_digest` when the caller has it (else it is computed here).
    """
    fields = _Header(
        hash=meta.hash,
        codec=meta.codec,
        dtype=meta.dtype,
        shape=list(meta.shape),
        raw_nbytes=meta.raw_nbytes,
        parent=meta.parent,
        token_ids=list(meta.token_ids),
    )
    header = _ENC.encode(fields)
    if align:
        header = _pad_header(fields, header, align)
    body = memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data)
    if digest is None:
        digest = xxhash.xxh3_64_intdigest(body)
    checksum = xxhash.xxh3_64_intdigest(header, seed=digest)
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(header), body.nbytes, checksum)
    return prefix + header, body


def payload_digest(payload: Buffer | np.ndarray[Any, Any]) -> int:
    """The payload's part of a record's checksum (xxh3-64 of its bytes)."""
    return xxhash.xxh3_64_intdigest(payload.data if isinstance(payload, np.ndarray) else payload)


def copy_digest(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> int:
    """Copy ``src`` into ``dst`` (same shape) and return the copy's :func:`payload_digest`.

    Contiguous arrays are copied and hashed :data:`COPY_CHUNK` bytes at a time, so the hash reads bytes
    the copy has just brought into the cache (about a fifth of the cost of a copy, instead of a second
    pass over memory)."""
    if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype):
        np.copyto(dst, src)
        return payload_digest(np.ascontiguousarray(dst).reshape(-1).view(np.uint8))
    d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_64()
    for a in range(0, d.nbytes, COPY_CHUNK):
        np.copyto(d[a : a + COPY_CHUNK], s[a : a + COPY_CHUNK])
        h.update(d[a : a + COPY_CHUNK].data)
    return h.intdigest()


def verify(prefix: Buffer, header: Buffer, payload: Buffer | np.ndarray[Any, Any]) -> None:
    """Raise CorruptBlockError unless the checksum in ``prefix`` (already read by :func:`read_prefix`)
    matches ``header`` and ``payload``, by the rule of the record's version."""
    _, version, _, _, _, checksum = _PREFIX.unpack_from(prefix, 0)
    if version == 1:
        h = xxhash.xxh3_64(header)
        h.update(payload.data if isinstance(payload, np.ndarray) else payload)
        ok = h.intdigest() == checksum
    else:
        ok = xxhash.xxh3_64_intdigest(header, seed=payload_digest(payload)) == checksum
    if not ok:
        raise CorruptBlockError("checksum mismatch")


def _pad_header(fields: _Header, header: bytes, align: int) -> bytes:
    """``header`` re-encoded with a ``pad`` that brings prefix + header to a multiple of ``align``."""
    extra = -(PREFIX_SIZE + len(header)) % align
    if not extra:
        return header
    # an empty pad encodes in 2 bytes (bin8); n pad bytes take 2 + n up to 255, then 3 + n (bin16)
    n = extra if extra <= 255 else extra - 1
    if n == 255 and extra == 256:
        n = extra + align - 1
    padded = _ENC.encode(msgspec.structs.replace(fields, pad=bytes(n)))
    return padded if (PREFIX_SIZE + len(padded)) % align == 0 else header


def packed_size(meta_header_len: int, payload_len: int) -> int:
    return PREFIX_SIZE + meta_header_len + payload_len


def read_prefix(buf: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(header_len, payload_len, checksum)`` of a record's first bytes."""
    if len(buf) < PREFIX_SIZE:
        raise TruncatedBlockError(f"record of {len(buf)} bytes is shorter than its {PREFIX_SIZE}-byte prefix")
    magic, version, _flags, header_len, payload_len, checksum = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {bytes(magic)!r}", reason="foreign")
    if version not in VERSIONS:
        raise CorruptBlockError(f"unsupported record version {version}", reason="version")
    if header_len > MAX_HEADER:
        raise CorruptBlockError(f"header length {header_len} is implausible")
    return header_len, payload_len, checksum


def decode_header(raw: bytes | memoryview) -> BlockMeta:
    try:
        h = _DEC.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptBlockError(f"unreadable record header: {exc}") from exc
    return BlockMeta(
        hash=h.hash,
        codec=h.codec,
        dtype=h.dtype,
        shape=tuple(h.shape),
        raw_nbytes=h.raw_nbytes,
        parent=h.parent,
        token_ids=tuple(h.token_ids),
    )


def unpack(buf: bytes | bytearray | memoryview, check: bool = True) -> tuple[BlockMeta, memoryview]:
    """Parse and check a whole record; returns the meta and a view of the payload."""
    view = memoryview(buf)
    header_len, payload_len, _ = read_prefix(view)
    total = PREFIX_SIZE + header_len + payload_len
    if len(view) != total:
        raise TruncatedBlockError(f"record is {len(view)} bytes, its prefix says {total}")
    header = view[PREFIX_SIZE : PREFIX_SIZE + header_len]
    payload = view[PREFIX_SIZE + header_len :]
    if check:
        verify(view, header, payload)
    return decode_header(header), payload


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def _dtype_name(dt: np.dtype[Any]) -> str:
    """``dt.name``, cached (numpy computes it on every access)."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = dt.name
    return name


def meta_for(block_hash: BlockHash, block: Any, codec: str, parent: BlockHash | None,
             token_ids: tuple[int, ...]) -> BlockMeta:
    arr = block if isinstance(block, np.ndarray) else np.asarray(block)
    # an ndarray's shape is a tuple of ints and its nbytes an int: taken as they are (on every put)
    return BlockMeta(block_hash, codec, _dtype_name(arr.dtype), arr.shape, arr.nbytes, parent, token_ids)
