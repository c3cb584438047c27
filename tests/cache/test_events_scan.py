"""The compiled batch scanner (``scan_batch``) against the decoder (``decode_batch_lenient``, msgspec's): on
vLLM's own batches, on generated batches in vLLM's layout, and on mutated bytes, what the scanner returns is
what the decoder reads, and it declines whatever the decoder refuses any part of."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.cache.events import (
    AllBlocksCleared,
    AnyEvent,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ScannedBatch,
    decode_batch_lenient,
    encode_batch,
    scan_batch,
    stored,
)
from kvfleet.cache.hashing import to_int64


def runs_of(events: list[AnyEvent]) -> list[tuple[type[AnyEvent], str | None, list[int], int]]:
    """(type, medium, keys, events) of each run the scanner should report for decoded ``events``:
    consecutive stores or removals of one medium merged, every clear on its own."""
    out: list[tuple[type[AnyEvent], str | None, list[int], int]] = []
    for ev in events:
        medium = None if isinstance(ev, AllBlocksCleared) else ev.medium
        keys = [] if isinstance(ev, AllBlocksCleared) else [to_int64(h) for h in ev.block_hashes]
        if out and not isinstance(ev, AllBlocksCleared) and out[-1][0] is type(ev) and out[-1][1] == medium:
            kind, m, k, n = out[-1]
            out[-1] = (kind, m, k + keys, n + 1)
        else:
            out.append((type(ev), medium, keys, 1))
    return out


def scanned(scan: ScannedBatch) -> list[tuple[type[AnyEvent], str | None, list[int], int]]:
    return [(r.kind, r.medium, r.keys.tolist(), r.events) for r in scan.runs]


def check(payload: bytes) -> ScannedBatch | None:
    """The scanner's answer for ``payload``, checked against the decoder's."""
    scan = scan_batch(payload, 16, False)
    assert (scan_batch(payload, 16, True) is None) == (scan is None)  # the chain only decides hash_keys
    if scan is None:
        return None
    decoded = decode_batch_lenient(payload)  # raising here fails the test: the scanner took a bad batch
    assert not decoded.refused and decoded.reset_at is None, decoded.refused
    assert scanned(scan) == runs_of(decoded.batch.events)
    assert scan.ts == decoded.batch.ts or (scan.ts != scan.ts and decoded.batch.ts != decoded.batch.ts)
    return scan


def test_vllm_batches(vllm_batch_bytes: bytes, vllm_inthash_batch_bytes: bytes) -> None:
    """The batches vLLM encoded (bytes and int hashes): every event read, runs as the decoder's."""
    for payload in (vllm_batch_bytes, vllm_inthash_batch_bytes):
        scan = check(payload)
        assert scan is not None
    scan = scan_batch(vllm_batch_bytes, 16, True)
    assert scan is not None
    assert [r.kind for r in scan.runs] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    assert [r.medium for r in scan.runs] == ["GPU", "CPU", "GPU", None]


def test_one_block_events_merge_into_one_run() -> None:
    """An engine step: 16 one-block stores on the GPU, chained: one run of 16 keys."""
    rng = random.Random(3)
    events: list[Any] = []
    parent = None
    for _ in range(16):
        h = rng.getrandbits(64)
        events.append(stored([h], parent, [rng.randrange(1 << 32) for _ in range(16)], 16, "GPU"))
        parent = h
    scan = check(encode_batch(KVEventBatch(ts=12.5, events=events)))
    assert scan is not None and len(scan.runs) == 1 and scan.runs[0].events == 16 and scan.ts == 12.5
    assert scan.runs[0].keys.tolist() == [e.block_hashes[0] for e in events]


def _event_map(ev: AnyEvent) -> dict[str, Any]:
    """The map vLLM's encoder writes for ``ev`` (bytes kept as bytes)."""
    fields = {f: getattr(ev, f) for f in ev.__struct_fields__}
    return {"type": type(ev).__name__, **{k: v for k, v in fields.items() if v is not msgspec.UNSET}}


def _batch(events: list[Any], ts: Any = 1.0, rank: Any = 0, parts: int = 3) -> bytes:
    return msgspec.msgpack.encode([ts, events, rank][:parts])


GOOD: dict[str, Any] = _event_map(stored([7, 8], None, list(range(32)), 16, "GPU"))


@pytest.mark.parametrize("case", [
    "sglang_arrays", "map_batch", "missing_medium", "token_too_big", "token_negative", "block_size_0",
    "str_hash", "float_lora", "unknown_type", "no_type", "duplicate_field", "trailing", "truncated",
    "ext_field", "bad_utf8_medium", "four_parts", "bool_ts", "nested_deep",
])
def test_declines_what_it_does_not_read_completely(case: str) -> None:
    """Each of these the scanner leaves to the decoder (which reads some of them in part, or in another
    layout, and refuses the rest); nothing is half read."""
    ev = dict(GOOD)
    payload: bytes
    if case == "sglang_arrays":
        payload = _batch([["BlockStored", [7], None, list(range(16)), 16, None, "GPU"]])
    elif case == "map_batch":
        payload = msgspec.msgpack.encode({"ts": 1.0, "events": [ev]})
    elif case == "missing_medium":
        del ev["medium"]
        payload = _batch([ev])
    elif case == "token_too_big":
        payload = _batch([{**ev, "token_ids": [*range(31), 1 << 32]}])
    elif case == "token_negative":
        payload = _batch([{**ev, "token_ids": [*range(31), -1]}])
    elif case == "block_size_0":
        payload = _batch([{**ev, "block_size": 0}])
    elif case == "str_hash":
        payload = _batch([{**ev, "block_hashes": ["7"]}])
    elif case == "float_lora":
        payload = _batch([{**ev, "lora_id": 1.5}])
    elif case == "unknown_type":
        payload = _batch([{**ev, "type": "BlockMoved"}])
    elif case == "no_type":
        del ev["type"]
        payload = _batch([ev])
    elif case == "duplicate_field":
        body = msgspec.msgpack.encode(ev)
        # the map's count + 1 and a second "medium" at its end
        payload = (b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x91" + bytes([body[0] + 1]) + body[1:]
                   + msgspec.msgpack.encode("medium") + msgspec.msgpack.encode("CPU") + b"\x00")
    elif case == "trailing":
        payload = _batch([ev]) + b"\x00"
    elif case == "truncated":
        payload = _batch([ev])[:-3]
    elif case == "ext_field":
        payload = _batch([{**ev, "extra": msgspec.msgpack.Ext(1, b"xy")}])
    elif case == "bad_utf8_medium":
        good = _batch([ev])
        i = good.index(b"\xa3GPU")
        payload = good[:i] + b"\xa3G\xffU" + good[i + 4 :]
    elif case == "four_parts":
        payload = msgspec.msgpack.encode([1.0, [ev], 0, 0])
    elif case == "bool_ts":
        payload = _batch([ev], ts=True)
    else:
        deep: Any = 1
        for _ in range(40):
            deep = [deep]
        payload = _batch([{**ev, "extra": deep}])
    assert scan_batch(payload, 16, False) is None


def test_reads_what_vllm_may_add_or_reorder() -> None:
    """Unknown fields (newer vLLM's ``extra_keys``, ``group_idx``...) skipped, fields in any order, the tag
    last, ints of any width and sign as hashes, a two-part batch, an int timestamp."""
    ev = {**GOOD, "extra_keys": [["a", 1], None], "group_idx": 2,
          "block_hashes": [-1, 1 << 63, 5, b"\x01" * 32]}
    reordered = dict(reversed(list(ev.items())))
    for payload in (_batch([ev, reordered]), _batch([ev], ts=7, parts=2), _batch([ev], rank=None)):
        scan = check(payload)
        assert scan is not None
    scan = scan_batch(_batch([ev]), 16, False)
    assert scan is not None
    assert scan.runs[0].keys.tolist() == [(1 << 64) - 1, 1 << 63, 5, int.from_bytes(b"\x01" * 8, "big")]


# --- generated batches ------------------------------------------------------------------------------------
hashes = st.lists(st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=0, max_size=40)),
                  max_size=4)
mediums = st.sampled_from(["GPU", "CPU", "cpu_tier", "SSD", None, ""])
stores = st.builds(
    lambda h, p, t, bs, lora, m, name: _event_map(
        BlockStored(block_hashes=h, parent_block_hash=p, token_ids=t, block_size=bs, lora_id=lora, medium=m,
                    lora_name=name)),
    hashes, st.one_of(st.none(), st.integers(0, (1 << 64) - 1), st.binary(min_size=32, max_size=32)),
    st.lists(st.integers(0, (1 << 32) - 1), max_size=40), st.integers(1, 64),
    st.one_of(st.none(), st.integers(-5, 5)), mediums, st.one_of(st.none(), st.text(max_size=4)))
removals = st.builds(lambda h, m: _event_map(BlockRemoved(block_hashes=h, medium=m)), hashes, mediums)
clears = st.just(_event_map(AllBlocksCleared()))
events = st.lists(st.one_of(stores, stores, removals, removals, clears), max_size=12)


def _shuffled(ev: dict[str, Any], seed: int) -> dict[str, Any]:
    items = list(ev.items())
    random.Random(seed).shuffle(items)
    return dict(items)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events, st.integers(0, 1 << 30), st.floats(allow_nan=True), st.integers(2, 3))
def test_generated_batches_read_as_the_decoder_reads_them(evs: list[dict[str, Any]], seed: int, ts: float,
                                                          parts: int) -> None:
    """Valid batches in vLLM's layout, fields in any order: always read, and read as the decoder does."""
    payload = _batch([_shuffled(e, seed + i) for i, e in enumerate(evs)], ts=ts, parts=parts)
    assert check(payload) is not None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, 3))
def test_mutated_bytes_never_read_otherwise_than_the_decoder(evs: list[dict[str, Any]],
                                                             edits: list[tuple[int, int]], cut: int) -> None:
    """Bytes overwritten and the end cut: the scanner declines, or reads exactly what the decoder reads
    with nothing refused."""
    raw = bytearray(_batch(evs))
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    check(bytes(raw[: len(raw) - cut] if cut < len(raw) else raw))
