"""The wire format: a fixed 64-byte header per frame, then an optional body, then (after the handshake) a tag.

Header layout (network byte order)::

    0  2s  magic "KT"          12  Q  length   (body or block payload bytes)
    2  B   version (3)         20  Q  checksum (xxh3_64 of the body/payload)
    3  B   frame type          28  32s block hash (left-aligned, ``hash_len`` bytes)
    4  B   flags (bit0: int hash)  60 I  slot (shared-memory slot index)
    5  B   hash_len
    6  H   reserved
    8  I   seq  (block sequence number, or credit count)

Control frames (hello, auth, request, ...) carry a msgpack body; ``BLOCK``
frames carry the raw block bytes, which the receiver reads straight into a
preallocated destination slot. Once the HMAC handshake is done, every frame
in either direction is followed by a :data:`~kvfleet.agent.transfer.auth.TAG_BYTES`
keyed MAC (see :class:`~kvfleet.agent.transfer.auth.FrameSeal`). Version 1
had no tags, version 2 HMAC-SHA256 tags of 32 bytes: a peer announcing another version is refused with a
:class:`VersionError` instead of having its frames misread. Every other
decode error is a :class:`FrameError`.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from kvfleet.agent.transfer.errors import FrameError, VersionError

MAGIC = b"KT"
#: 3: GMAC tags (2: HMAC-SHA256 tags; 1: unkeyed xxh3 checksums only).
VERSION = 3
HEADER = struct.Struct("!2sBBBBHIQQ32sI")
HEADER_SIZE = HEADER.size
MAX_CONTROL_BYTES = 16 << 20
FLAG_INT_HASH = 0x01
_U64 = (1 << 64) - 1

assert HEADER_SIZE == 64

BlockHash = int | bytes


class FrameType(enum.IntEnum):
    """Frame types; the direction is noted per type."""

    HELLO = 1  # server → client: nonce, host id, backends
    AUTH = 2  # client → server: nonce, HMAC, chosen backend
    AUTH_OK = 3  # server → client: server HMAC
    AUTH_FAIL = 4  # server → client, then close
    REQUEST = 5  # client → server: [[seq, hash], ...] appended to the stream's queue
    CREDIT = 6  # client → server: seq = number of blocks the sender may send
    BLOCK = 7  # server → client: header + payload
    MISSING = 8  # server → client: the block ``hash`` at ``seq`` is not held
    SHM_ATTACH = 9  # client → server: shared-memory ring name, slots, slot size
    SLOT_BLOCK = 10  # server → client: block written to ``slot`` of the shm / mooncake ring
    ERROR = 11  # either way: a reason, then close
    MC_ATTACH = 12  # client → server: mooncake staging ring geometry
    MC_READY = 13  # server → client: its Transfer Engine rpc address and ring address


_TYPES = {int(t) for t in FrameType}


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded frame header."""

    type: FrameType = FrameType.ERROR
    seq: int = 0
    length: int = 0
    checksum: int = 0
    block_hash: BlockHash = b""
    slot: int = 0


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The payload checksum carried in frames: xxh3_64 (≈ 40 GB/s here)."""
    return xxhash.xxh3_64_intdigest(data)


def hash_to_wire(h: BlockHash) -> tuple[int, bytes]:
    """(flags, bytes) for a block hash; ints must fit in 64 bits, bytes in 32."""
    if isinstance(h, bool):
        raise FrameError(f"block hash must be int or bytes, got {h!r}")
    if isinstance(h, int):
        if not 0 <= h <= _U64:
            raise FrameError(f"int block hash out of uint64 range: {h}")
        return FLAG_INT_HASH, h.to_bytes(8, "big")
    if isinstance(h, bytes | bytearray):
        if len(h) > 32:
            raise FrameError(f"bytes block hash longer than 32 bytes: {len(h)}")
        return 0, bytes(h)
    raise FrameError(f"block hash must be int or bytes, got {type(h).__name__}")


def encode_header(
    ftype: FrameType,
    *,
    seq: int = 0,
    length: int = 0,
    checksum_: int = 0,
    block_hash: BlockHash | None = None,
    slot: int = 0,
) -> bytes:
    """Pack one header."""
    flags, hb = (0, b"") if block_hash is None else hash_to_wire(block_hash)
    return HEADER.pack(MAGIC, VERSION, int(ftype), flags, len(hb), 0, seq, length, checksum_, hb, slot)


def decode_header(buf: bytes | bytearray | memoryview, max_length: int,
                  max_control: int = MAX_CONTROL_BYTES) -> Header:
    """Unpack and validate one header; anything unexpected is a :class:`FrameError`.

    ``max_length`` bounds a ``BLOCK`` payload, ``max_control`` every other body
    (the handshake passes a few KiB for both).
    """
    if len(buf) != HEADER_SIZE:
        raise FrameError(f"short header: {len(buf)} bytes")
    magic, version, ftype, flags, hlen, _r, seq, length, csum, hb, slot = HEADER.unpack(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise VersionError(
            f"peer speaks transfer protocol version {version}, this side speaks {VERSION}: "
            "upgrade the older side"
        )
    if ftype not in _TYPES:
        raise FrameError(f"unknown frame type {ftype}")
    if hlen > 32:
        raise FrameError(f"hash length {hlen} > 32")
    t = FrameType(ftype)
    limit = max_length if t == FrameType.BLOCK else max_control
    if length > limit:
        raise FrameError(f"{t.name} length {length} exceeds limit {limit}")
    h: BlockHash
    if flags & FLAG_INT_HASH:
        if hlen != 8:
            raise FrameError(f"int hash with length {hlen}")
        h = int.from_bytes(hb[:8], "big")
    else:
        h = bytes(hb[:hlen])
    return Header(type=t, seq=seq, length=length, checksum=csum, block_hash=h, slot=slot)


def encode_control(ftype: FrameType, body: Any = None, *, seq: int = 0) -> bytes:
    """A control frame: header + msgpack body (checksummed)."""
    payload = b"" if body is None else msgspec.msgpack.encode(body)
    return encode_header(ftype, seq=seq, length=len(payload), checksum_=checksum(payload)) + payload


def decode_body(header: Header, payload: bytes) -> Any:
    """Verify and decode a control frame's msgpack body (an empty body has no checksum)."""
    if payload and checksum(payload) != header.checksum:
        raise FrameError(f"{header.type.name} body checksum mismatch")
    if not payload:
        return None
    try:
        return msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"{header.type.name} body is not msgpack: {exc}") from exc


def decode_request(body: Any) -> list[tuple[int, BlockHash]]:
    """Validate a REQUEST body: a list of ``[seq, hash]`` pairs."""
    if not isinstance(body, list):
        raise FrameError("REQUEST body must be a list")
    out: list[tuple[int, BlockHash]] = []
    for item in body:
        if type(item) is list and len(item) == 2:  # fast path: exact types, checked inline
            seq, h = item
            if type(seq) is int and ((type(h) is int and 0 <= h <= _U64)
                                     or (type(h) is bytes and len(h) <= 32)):
                out.append((seq, h))
                continue
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)):
            raise FrameError(f"REQUEST item must be [seq, hash], got {item!r}")
        seq, h = item
        hash_to_wire(h)  # validates type and size
        out.append((seq, h))
    return out
