"""The KV-event feed over real ZMQ sockets: vLLM framing, per-pod order, gaps filled by replay, restarts."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator

import pytest
import zmq

from kvfleet.cache.events import KVEventBatch, stored
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.subscriber import EventSubscriber
from tests.epp.conftest import wait_for
from tests.epp.pods import KVEventPublisher

H = BlockHasher(4)


def batch(i: int) -> KVEventBatch:
    toks = [i] * 4
    return KVEventBatch(ts=0.0, events=[stored(hashes_as_ints(H.hash_tokens(toks)), None, toks, 4, "GPU")])


def key(i: int) -> int:
    return hashes_as_ints(H.hash_tokens([i] * 4))[0]


@pytest.fixture
def feed() -> Iterator[tuple[KVEventPublisher, EventSubscriber, BlockIndex]]:
    pub = KVEventPublisher()
    sub = EventSubscriber(replay_timeout_s=1.0)
    sub.start()
    idx = BlockIndex()
    yield pub, sub, idx
    sub.stop()
    pub.close()


def connect(pub: KVEventPublisher, sub: EventSubscriber, idx: BlockIndex, replay: bool = True) -> None:
    sub.add_pod("p", pub.endpoint, pub.replay_endpoint if replay else None, PodEventApplier("p", idx, H))
    # PUB/SUB joins asynchronously: publish probes until one gets through.
    deadline = time.monotonic() + 5
    while sub.stats.get("p") is None or sub.stats["p"].batches == 0:
        assert time.monotonic() < deadline, "subscriber never connected"
        pub.publish(batch(10_000))
        time.sleep(0.05)


class TestFeed:
    def test_batches_reach_the_index(self, feed: tuple[KVEventPublisher, EventSubscriber, BlockIndex]) -> None:
        """Published BlockStored batches show up in the index under the pod."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        for i in range(5):
            pub.publish(batch(i))
        wait_for(lambda: all(idx.match([key(i)], ["p"]) for i in range(5)), what="5 batches indexed")

    def test_gap_is_filled_from_replay(self, feed: tuple[KVEventPublisher, EventSubscriber, BlockIndex]) -> None:
        """A lost message (sequence gap) is fetched from the ROUTER replay endpoint, in order."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        pub.publish(batch(1), drop=True)
        pub.publish(batch(2))
        wait_for(lambda: bool(idx.match([key(2)], ["p"])), what="batch after the gap")
        assert idx.match([key(1)], ["p"]), "the dropped batch was not replayed"
        assert sub.stats["p"].gaps >= 1 and sub.stats["p"].replayed >= 1

    def test_late_subscriber_rebuilds_from_the_pod(self, feed: tuple[KVEventPublisher, EventSubscriber, BlockIndex]) -> None:
        """A picker that starts (or restarts) after the pod published rebuilds the index via replay from 0."""
        pub, sub, idx = feed
        for i in range(3):
            pub.publish(batch(i))
        connect(pub, sub, idx)
        wait_for(lambda: all(idx.match([key(i)], ["p"]) for i in range(3)), what="replayed history")

    def test_idle_pod_is_known_without_a_new_publish(self, feed: tuple[KVEventPublisher, EventSubscriber, BlockIndex]) -> None:
        """Adding a pod replays its history from 0 right away: an idle pod's blocks are indexed before it publishes."""
        pub, sub, idx = feed
        for i in range(3):
            pub.publish(batch(i))
        sub.add_pod("p", pub.endpoint, pub.replay_endpoint, PodEventApplier("p", idx, H))
        wait_for(lambda: all(idx.match([key(i)], ["p"]) for i in range(3)), what="history of an idle pod")
        assert sub.stats["p"].replayed == 3 and sub.stats["p"].gaps == 0
        pub.publish(batch(3))  # the live stream continues after the replayed sequence, without a gap
        wait_for(lambda: bool(idx.match([key(3)], ["p"])), what="live batch after the bootstrap")
        assert sub.stats["p"].gaps == 0

    def test_gap_without_replay_resyncs(self, feed: tuple[KVEventPublisher, EventSubscriber, BlockIndex]) -> None:
        """Without a replay endpoint a gap clears the pod's blocks (stale entries must not linger)."""
        pub, sub, idx = feed
        connect(pub, sub, idx, replay=False)
        pub.publish(batch(1))
        wait_for(lambda: bool(idx.match([key(1)], ["p"])), what="batch 1")
        pub.publish(batch(2), drop=True)
        pub.publish(batch(3))
        wait_for(lambda: bool(idx.match([key(3)], ["p"])), what="batch 3")
        assert not idx.match([key(1)], ["p"]) and sub.stats["p"].resyncs >= 1

    def test_malformed_frames_are_counted_not_fatal(self, feed: tuple[KVEventPublisher, EventSubscriber, BlockIndex]) -> None:
        pub, sub, idx = feed
        connect(pub, sub, idx)
        with pub._lock:
            seq = pub.seq
            pub.seq += 1
            pub.buffer.append((seq, b"\xc1garbage"))
            pub.pub.send_multipart([b"", struct.pack(">q", seq), b"\xc1garbage"])
            pub.pub.send_multipart([b"only-one-frame"])
        pub.publish(batch(7))
        wait_for(lambda: bool(idx.match([key(7)], ["p"])), what="batch after garbage")
        assert sub.stats["p"].decode_errors >= 2
        assert zmq.zmq_version_info() >= (4,)
