"""KV events over ZMQ in vLLM's framing, from a running engine.

Covers: a SUB socket receives ``[topic, 8-byte big-endian seq, msgpack KVEventBatch]``
with seq counting from 0 and BlockStored events whose hashes equal the
engine's; the replay ROUTER answers ``[b"", start_seq]`` with every buffered
batch from that seq as ``[b"", seq, payload]`` then the ``[b"", -1, b""]`` end
marker, frame for frame what vLLM's ``ZmqEventPublisher`` sends.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from kvfleet.agent.publisher import END_SEQ
from kvfleet.cache import kvwire
from kvfleet.cache.events import BlockStored, KVEventBatch, decode_batch
from kvfleet.cache.hashing import BlockHasher
from tests.conftest import eventually
from tests.engine.conftest import EngineFactory


async def test_events_are_published_and_replayed(make_engine: EngineFactory) -> None:
    eng = await make_engine(kv_events_topic="kv@sim-0@m")
    es = eng.server.es
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{es.kv_events_port}")
    try:
        prompt = list(range(500, 548))  # 3 full blocks
        received: list[list[bytes]] = []
        for _ in range(50):  # PUB/SUB slow joiner: resend until the subscription is live
            await eng.post("/v1/completions", {"model": es.model, "prompt": prompt, "max_tokens": 1})
            try:
                received.append(await asyncio.wait_for(sub.recv_multipart(), 0.1))
                break
            except TimeoutError:
                prompt = [t + 1000 for t in prompt]
        assert received, "no KV event batch arrived"
        topic, seq, payload = received[0]
        assert topic == b"kv@sim-0@m" and len(seq) == 8
        batch = decode_batch(payload)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored and stored[0].medium == "GPU" and stored[0].block_size == 16
        assert stored[0].block_hashes == BlockHasher().hash_tokens(prompt).tolist()
    finally:
        sub.close(0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{es.kv_events_replay_port}")
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            assert len(frames) == 3 and frames[0] == b""  # vLLM's: no topic frame in replay answers
            if frames[1] == END_SEQ:
                assert frames[2] == b""
                break
            seqs.append(int.from_bytes(frames[1], "big"))
            decode_batch(frames[2])
        assert seqs == list(range(len(seqs))) and len(seqs) >= 1
    finally:
        dealer.close(0)


async def test_reset_drops_older_history_from_replay(make_engine: EngineFactory, pool_secret: bytes) -> None:
    """After a cache reset, replay starts at the reset (its AllBlocksCleared), not at the stale blocks before
    it."""
    from kvfleet.cache.events import AllBlocksCleared

    eng = await make_engine()
    es = eng.server.es
    for base in (0, 1000):
        await eng.post("/v1/completions",
                       {"model": es.model, "prompt": list(range(base, base + 48)), "max_tokens": 1})
    st, _, _ = await eng.call("POST", "/kvfleet/v1/reset", signed=True)
    assert st == 200
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{es.kv_events_replay_port}")
    try:
        async def replay_from_the_reset() -> list[tuple[int, KVEventBatch]] | None:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while True:
                seq, payload = kvwire.parse_replay_answer(await asyncio.wait_for(dealer.recv_multipart(), 5))
                if seq == kvwire.END:
                    break
                batches.append((seq, decode_batch(payload)))
            return (batches if batches and any(isinstance(e, AllBlocksCleared) for e in batches[0][1].events)
                    else None)

        # the publisher thread applies the reset asynchronously
        batches = await eventually(replay_from_the_reset, "a replay starting at the reset's AllBlocksCleared",
                                   timeout_s=5, interval_s=0.05)
        assert batches[0][0] > 0, "sequence numbers keep counting across a reset"
        first = batches[0][1].events
        cleared = next(i for i, e in enumerate(first) if isinstance(e, AllBlocksCleared))
        assert not any(isinstance(e, BlockStored) for e in first[cleared:])
    finally:
        dealer.close(0)
