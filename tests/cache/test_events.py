"""KV events: decode vLLM-encoded batches, re-encode them to the same msgpack, tolerate variants."""

from __future__ import annotations

import msgspec
import pytest

from kvfleet.cache.errors import EventDecodeError
from kvfleet.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBuffer,
    KVEventBatch,
    decode_batch,
    encode_batch,
    stored,
)


def test_decode_vllm_batch(vllm_batch_bytes: bytes) -> None:
    """The four events vLLM encoded: two BlockStored (GPU, CPU with parent), BlockRemoved, AllBlocksCleared."""
    batch = decode_batch(vllm_batch_bytes)
    assert batch.data_parallel_rank == 0
    kinds = [type(e) for e in batch.events]
    assert kinds == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.medium == "GPU" and first.block_size == 16 and first.token_ids == list(range(32))
    assert first.block_hashes[0].hex().startswith("dc918a88")  # type: ignore[union-attr]
    second = batch.events[1]
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[0] and second.medium == "CPU"


@pytest.mark.parametrize("fixture", ["vllm_batch_bytes", "vllm_inthash_batch_bytes"])
def test_reencode_equals_vllm_message(fixture: str, request: pytest.FixtureRequest) -> None:
    """Our encoding of a decoded vLLM batch is the same msgpack document (every field, same values)."""
    raw: bytes = request.getfixturevalue(fixture)
    ours = encode_batch(decode_batch(raw))
    assert msgspec.msgpack.decode(ours) == msgspec.msgpack.decode(raw)


def test_int_hashes_and_missing_rank(vllm_inthash_batch_bytes: bytes) -> None:
    batch = decode_batch(vllm_inthash_batch_bytes)
    assert batch.data_parallel_rank is None
    ev = batch.events[0]
    assert isinstance(ev, BlockStored) and ev.block_hashes == [2233398808101521225]


def test_tolerates_unknown_fields_and_omitted_lora_name() -> None:
    """Newer vLLM fields (extra_keys, group_idx) are ignored; older publishers omit lora_name."""
    doc = [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU",
                "group_idx": 3,
                "extra_keys": [["x"]],
            }
        ],
    ]
    batch = decode_batch(msgspec.msgpack.encode(doc))
    ev = batch.events[0]
    assert isinstance(ev, BlockStored) and ev.medium == "CPU" and ev.lora_name is msgspec.UNSET


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), msgspec.msgpack.encode({"a": 1})])
def test_malformed_payloads_raise_typed_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_buffer_drains_batches_and_bounds_memory() -> None:
    buf = EventBuffer(data_parallel_rank=1, max_events=2)
    assert buf.drain() is None
    for i in range(3):
        buf(stored([i], None, [0] * 4, 4, "GPU"))
    batch = buf.drain(ts=5.0)
    assert isinstance(batch, KVEventBatch)
    assert len(batch.events) == 2 and buf.dropped == 1 and batch.data_parallel_rank == 1
    assert decode_batch(encode_batch(batch)) == batch
