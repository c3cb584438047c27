"""kvfleet's KV-event publisher (engine simulator, agent) feeding the EPP's subscriber over loopback ZMQ:
vLLM's replay frames, bootstrap of an idle pod, a gap filled, and a restarted publisher on the same ports."""

from __future__ import annotations

import socket

import zmq

from kvfleet.agent.publisher import PortInUseError, ZmqPublisher
from kvfleet.cache import kvwire
from kvfleet.cache.events import KVEventBatch, stored
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.subscriber import EventSubscriber
from tests.conftest import wait_for

H = BlockHasher(4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def key(i: int) -> int:
    return hashes_as_ints(H.hash_tokens([i, 1, 2, 3]))[0]


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[stored([key(i)], None, [i, 1, 2, 3], 4, "CPU")])


def restarted(ep: str, rep: str) -> ZmqPublisher:
    """A new publisher on the old ports (ZMQ releases a closed socket's port asynchronously)."""

    def bound() -> ZmqPublisher | None:
        try:
            return ZmqPublisher(ep, rep)
        except PortInUseError:
            return None

    return wait_for(bound, "the closed publisher's ports released", timeout_s=5)


def publish_until_indexed(pub: ZmqPublisher, idx: BlockIndex, first: int, what: str) -> None:
    """Publish batches ``first``, ``first + 1``, … until one of them is in the index (a live subscription is
    up)."""
    sent: list[int] = []

    def probe() -> bool:
        if any(idx.match([key(i)], ["a"]) for i in sent):
            return True
        sent.append(first + len(sent))
        pub.publish(batch(sent[-1]))
        return False

    wait_for(probe, what, timeout_s=10, interval_s=0.05)


def test_replay_answer_is_vllms_frames() -> None:
    ports = free_port(), free_port()
    pub = ZmqPublisher(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", topic="kv@a@m")
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(3):
            pub.publish(batch(i))
        wait_for(lambda: pub.next_seq == 3, what="published")
        dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
        dealer.send_multipart(kvwire.replay_request(1))
        got = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == b""
            seq, _ = kvwire.parse_replay_answer(frames)
            if seq == kvwire.END:
                assert frames[1:] == [kvwire.END_SEQ, b""]
                break
            got.append(seq)
        assert got == [1, 2]
    finally:
        dealer.close(0)
        pub.close()


def test_subscriber_follows_kvfleet_publisher_through_a_restart() -> None:
    ports = free_port(), free_port()
    ep, rep = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    pub = ZmqPublisher(ep, rep)
    for i in range(3):  # an idle pod's history: known at once from the replay buffer
        pub.publish(batch(i))
    idx = BlockIndex()
    sub = EventSubscriber(replay_timeout_s=1.0)
    sub.start()
    try:
        sub.add_pod("a", ep, rep, PodEventApplier("a", idx, H, recompute_keys=True))
        wait_for(lambda: all(idx.match([key(i)], ["a"]) for i in range(3)), what="bootstrap")
        publish_until_indexed(pub, idx, 11, "the live subscription")
        pub.close()
        pub = restarted(ep, rep)  # the engine restarts: sequence numbers from 0, empty buffer
        publish_until_indexed(pub, idx, 1001, "the restarted publisher's batches")
        wait_for(lambda: not idx.match([key(0)], ["a"]), what="stale blocks of the old engine cleared")
        assert sub.healthy() and sub.stats["a"].rejected == 0
    finally:
        sub.stop()
        pub.close()


def test_replay_buffer_is_bounded_in_bytes() -> None:
    """A flood of large batches keeps at most ``buffer_bytes`` of them: a replay from 0 answers only the
    newest ones (the subscriber sees the hole and resyncs), and the buffer never grows past the cap."""
    ports = free_port(), free_port()
    pub = ZmqPublisher(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", buffer_bytes=64 << 10)
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    big = [KVEventBatch(ts=0.0, events=[stored([key(i)], None, [i] * 4096, 4096, "GPU")]) for i in range(200)]
    try:
        peak = 0
        for b in big:
            pub.publish(b)
            peak = max(peak, pub.buffer_bytes)
        wait_for(lambda: pub.next_seq == 200, what="published")
        assert 0 < pub.buffer_bytes <= 64 << 10 and peak <= (64 << 10) + 40_000
        dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
        dealer.send_multipart(kvwire.replay_request(0))
        got = []
        while True:
            assert dealer.poll(5000)
            seq, _ = kvwire.parse_replay_answer(dealer.recv_multipart())
            if seq == kvwire.END:
                break
            got.append(seq)
        assert got and got[-1] == 199 and got[0] > 150 and got == list(range(got[0], 200))
    finally:
        dealer.close(0)
        pub.close()
