"""The wire format: header round trips and every way a header or body can be malformed."""

from __future__ import annotations

import pytest

from kvfleet.agent.transfer.errors import FrameError
from kvfleet.agent.transfer.frames import (
    HEADER_SIZE,
    FrameType,
    decode_body,
    decode_header,
    decode_request,
    encode_control,
    encode_header,
)


@pytest.mark.parametrize("h", [0, 1, (1 << 64) - 1, b"", b"\x00" * 32, bytes(range(32)), b"abc"])
def test_header_round_trip_keeps_hash_kind_and_value(h: int | bytes) -> None:
    raw = encode_header(FrameType.BLOCK, seq=7, length=100, checksum_=42, block_hash=h, slot=3)
    assert len(raw) == HEADER_SIZE
    got = decode_header(raw, max_length=1000)
    assert (got.type, got.seq, got.length, got.checksum, got.block_hash, got.slot) == (
        FrameType.BLOCK, 7, 100, 42, h, 3)
    assert type(got.block_hash) is type(h)


@pytest.mark.parametrize("bad", [-1, 1 << 64, b"x" * 33, "text", 1.5, True])
def test_unencodable_hashes_are_frame_errors(bad: object) -> None:
    with pytest.raises(FrameError):
        encode_header(FrameType.BLOCK, block_hash=bad)  # type: ignore[arg-type]


def _mutate(raw: bytes, at: int, value: int) -> bytes:
    b = bytearray(raw)
    b[at] = value
    return bytes(b)


@pytest.mark.parametrize(
    ("at", "value", "what"),
    [(0, ord("X"), "magic"), (2, 9, "version"), (3, 200, "type"), (5, 40, "hash length")],
)
def test_malformed_headers_are_rejected(at: int, value: int, what: str) -> None:
    raw = encode_header(FrameType.BLOCK, seq=1, length=10, block_hash=b"abc")
    with pytest.raises(FrameError):
        decode_header(_mutate(raw, at, value), max_length=1000)


def test_block_longer_than_limit_is_rejected_before_reading_it() -> None:
    raw = encode_header(FrameType.BLOCK, length=2000, block_hash=1)
    with pytest.raises(FrameError, match="exceeds"):
        decode_header(raw, max_length=1000)


def test_short_header_is_rejected() -> None:
    with pytest.raises(FrameError):
        decode_header(b"KT", max_length=10)


def test_control_body_round_trip_and_corruption() -> None:
    raw = encode_control(FrameType.REQUEST, [[0, 5], [1, b"h"]])
    h = decode_header(raw[:HEADER_SIZE], max_length=0)
    body = raw[HEADER_SIZE:]
    assert decode_request(decode_body(h, body)) == [(0, 5), (1, b"h")]
    with pytest.raises(FrameError, match="checksum"):
        decode_body(h, body[:-1] + bytes([body[-1] ^ 1]))


@pytest.mark.parametrize("body", [{"a": 1}, [[1]], [["x", 1]], [[1, 2.5]], [[1, b"y" * 40]]])
def test_malformed_requests_are_rejected(body: object) -> None:
    with pytest.raises(FrameError):
        decode_request(body)
