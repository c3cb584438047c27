"""KV events: decode vLLM-encoded batches, re-encode them to the same msgpack, tolerate variants; the wire
module's frames (vLLM's) and its per-publisher sequencer (gaps, restarts, holes, timeouts)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvfleet.cache import kvwire
from kvfleet.cache.errors import EventDecodeError
from kvfleet.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBuffer,
    KVEventBatch,
    decode_batch,
    decode_batch_lenient,
    encode_batch,
    stored,
)


def test_decode_vllm_batch(vllm_batch_bytes: bytes) -> None:
    """The four events vLLM encoded: two BlockStored (GPU, CPU with parent), BlockRemoved,
    AllBlocksCleared."""
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


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
                                     msgspec.msgpack.encode({"a": 1})])
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


# --- other engines' layouts, per-event validation -----------------------------------------------


def test_sglang_and_older_vllm_layouts() -> None:
    """Events as tagged arrays (SGLang, older vLLM; medium and lora_name optional), the batch as a map."""
    arrays = [2.0, [["BlockStored", [1, 2], None, list(range(8)), 4, None, "CPU_PINNED"],
                    ["BlockStored", [3], 2, [8, 9, 10, 11], 4, None],
                    ["BlockRemoved", [1]],
                    ["AllBlocksCleared"]], 3]
    batch = decode_batch(msgspec.msgpack.encode(arrays))
    assert batch.data_parallel_rank == 3 and [type(e) for e in batch.events] == [
        BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    first, second = batch.events[0], batch.events[1]
    assert isinstance(first, BlockStored) and first.medium == "CPU_PINNED" and first.block_hashes == [1, 2]
    assert isinstance(second, BlockStored) and second.medium is None and second.parent_block_hash == 2
    mapped = {"ts": 1.0,
              "events": [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"}],
              "attn_dp_rank": 1}
    batch = decode_batch(msgspec.msgpack.encode(mapped))
    assert batch.data_parallel_rank == 1 and isinstance(batch.events[0], BlockRemoved)


def test_lenient_decoding_keeps_the_valid_events() -> None:
    good = msgspec.to_builtins(stored([1], None, [1, 2], 2, "GPU"))
    doc = [0.0, [good, {"type": "BlockMoved"}, {**good, "token_ids": [2**32, 1]}, {**good, "block_size": 0},
                 good]]
    out = decode_batch_lenient(msgspec.msgpack.encode(doc))
    assert len(out.batch.events) == 2 and len(out.refused) == 3 and out.reset_at is None
    assert "unknown event type" in out.refused[0] and "4294967295" in out.refused[1]
    with pytest.raises(EventDecodeError):
        decode_batch(msgspec.msgpack.encode(doc))
    unsafe = [0.0, [good, {"type": "BlockRemoved", "block_hashes": "x", "medium": None}, good, 7]]
    out = decode_batch_lenient(msgspec.msgpack.encode(unsafe))
    # the last unreadable event may have removed blocks
    assert len(out.batch.events) == 2 and out.reset_at == 2


# --- the wire module: frames and the per-publisher sequencer ------------------------------------


def test_frames_are_vllms() -> None:
    """As vLLM's ZmqEventPublisher: live [topic, seq, payload]; replay request [b"", start]; answer
    [b"", seq, payload] per batch then [b"", -1, b""] (no topic frame in replay answers)."""
    assert kvwire.live_frames(b"t", 3, b"p") == [b"t", (3).to_bytes(8, "big"), b"p"]
    assert kvwire.parse_live([b"t", (3).to_bytes(8, "big"), b"p"]) == kvwire.LiveMessage(b"t", 3, b"p")
    assert kvwire.replay_request(7) == [b"", (7).to_bytes(8, "big")]
    assert kvwire.parse_replay_request([b"id", b"", (7).to_bytes(8, "big")]) == (b"id", 7)
    assert kvwire.replay_item(b"id", 7, b"p") == [b"id", b"", (7).to_bytes(8, "big"), b"p"]
    assert kvwire.replay_end(b"id") == [b"id", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert kvwire.parse_replay_answer([b"", (7).to_bytes(8, "big"), b"p"]) == (7, b"p")
    assert kvwire.parse_replay_answer([b"", kvwire.END_SEQ, b""]) == (kvwire.END, b"")
    # earlier kvfleet
    assert kvwire.parse_replay_answer([b"", b"topic", (7).to_bytes(8, "big"), b"p"]) == (7, b"p")
    for bad in ([b"x"], [b"t", b"\x00" * 7, b"p"], [b"t", kvwire.END_SEQ, b"p"]):
        with pytest.raises(kvwire.KVWireError):
            kvwire.parse_live(bad)


class Sink:
    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def apply(self, seq: int, payload: bytes, replayed: bool) -> None:
        self.log.append(("replayed" if replayed else "live", seq))

    def clear(self, reason: str) -> None:
        self.log.append(("clear", -1))

    def request_replay(self, start: int) -> None:
        self.log.append(("request", start))

    def cancel_replay(self) -> None:
        pass

    def take(self) -> list[tuple[str, int]]:
        out, self.log = self.log, []
        return out


def answer(s: kvwire.FeedSequencer, seqs: list[int], now: float = 0.0) -> None:
    for q in seqs:
        s.on_replay(now, q, b"x")
    s.on_replay(now, kvwire.END, b"")


def started(replay: bool = True, **kw: Any) -> tuple[kvwire.FeedSequencer, Sink]:
    sink = Sink()
    s = kvwire.FeedSequencer(sink, replay=replay, **kw)
    s.start(0.0)
    return s, sink


class TestSequencer:
    def test_bootstrap_then_live_then_gap(self) -> None:
        s, sink = started()
        s.on_live(0, 3, b"x")  # waits for the bootstrap answer
        answer(s, [0, 1, 2])
        assert sink.take() == [("clear", -1), ("request", 0), ("replayed", 0), ("replayed", 1),
                               ("replayed", 2), ("live", 3)]
        s.on_live(0, 5, b"x")
        assert sink.take() == [("request", 4)] and s.stats.gaps == 1
        s.on_live(0, 6, b"x")
        answer(s, [4, 5])
        assert sink.take() == [("replayed", 4), ("replayed", 5), ("live", 6)]
        assert s.stats.resyncs == 0 and s.stats.duplicates == 1

    def test_any_backwards_sequence_is_a_restart(self) -> None:
        s, sink = started()
        answer(s, [0, 1, 2, 3])
        s.on_live(0, 2, b"x")  # a live duplicate of the replayed range (sent before the answer): skipped
        s.on_live(0, 4, b"x")
        sink.take()
        s.on_live(0, 2, b"x")  # below the last live one: seq 0 and 1 of the new publisher were lost
        assert sink.take() == [("clear", -1), ("request", 0)] and s.stats.restarts == 1
        answer(s, [0, 1, 2])
        assert sink.take() == [("replayed", 0), ("replayed", 1), ("replayed", 2)]

    def test_gap_older_than_the_buffer_rebuilds(self) -> None:
        s, sink = started()
        answer(s, [0])
        s.on_live(0, 1, b"x")
        s.on_live(0, 9, b"x")
        sink.take()
        s.on_replay(0, 5, b"x")  # the buffer starts at 5: 2..4 are gone (the rest of that answer is dropped)
        assert sink.take() == [("clear", -1), ("request", 0)]
        answer(s, [5, 6, 7, 8, 9])
        assert sink.take() == [("replayed", q) for q in range(5, 10)]

    def test_hole_in_a_rebuild_is_retried_then_cut(self) -> None:
        s, sink = started(max_full_retries=1)
        for q in (0, 1, 3):
            s.on_replay(0, q, b"x")
        assert sink.take() == [("clear", -1), ("request", 0), ("replayed", 0), ("replayed", 1), ("clear", -1),
                               ("request", 0)]
        answer(s, [0, 1, 3, 4])
        assert sink.take() == [("replayed", 0), ("replayed", 1), ("clear", -1), ("replayed", 3),
                               ("replayed", 4)]
        assert s.stats.replay_holes == 2 and s.stats.resyncs == 2

    def test_hole_between_replay_and_live(self) -> None:
        s, sink = started(max_full_retries=0)
        s.on_live(0, 5, b"x")
        answer(s, [0, 1, 2])  # 3 and 4 neither replayed nor received
        assert sink.take()[-3:] == [("replayed", 2), ("clear", -1), ("live", 5)]
        assert s.stats.replay_holes == 1

    def test_silent_endpoint_times_out_and_backs_off(self) -> None:
        s, sink = started(timeout_s=1.0, backoff_s=5.0)
        answer(s, [0])
        sink.take()
        s.on_live(10.0, 2, b"x")
        assert sink.take() == [("request", 1)] and s.deadline == 11.0
        s.on_live(10.5, 3, b"x")
        s.poll(10.9)
        assert sink.take() == []
        s.poll(11.0)  # given up: the pod is cleared at the hole, the waiting batches go on
        assert sink.take() == [("clear", -1), ("live", 2), ("live", 3)] and s.stats.replay_timeouts == 1
        s.on_live(12.0, 5, b"x")  # within the back-off: no request, cleared at once
        assert sink.take() == [("clear", -1), ("live", 5)]
        s.on_live(20.0, 7, b"x")  # back-off over: asked again
        assert sink.take() == [("request", 6)]

    def test_no_replay_endpoint(self) -> None:
        s, sink = started(replay=False)
        s.on_live(0, 4, b"x")
        s.on_live(0, 6, b"x")
        assert sink.take() == [("clear", -1), ("live", 4), ("clear", -1), ("live", 6)]
        s.on_live(0, 1, b"x")
        assert sink.take() == [("clear", -1), ("live", 1)] and s.stats.restarts == 1

    def test_too_many_waiting_batches_give_the_request_up(self) -> None:
        s, sink = started(max_pending=3)
        for q in range(10, 14):
            s.on_live(0, q, b"x")
        assert not s.replaying and sink.take()[-4:] == [("live", q) for q in range(10, 14)]
