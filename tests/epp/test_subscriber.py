"""The KV-event feed over real ZMQ sockets on loopback: vLLM framing, per-pod order, gaps filled by replay,
restarts, holes, isolation of bad input, and pods that never stall each other."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from kvfleet.cache import kvwire
from kvfleet.cache.events import AllBlocksCleared, KVEventBatch, encode_batch, removed, stored
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.tiers import Tier
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.subscriber import EventSubscriber
from tests.conftest import wait_for
from tests.epp.pods import KVEventPublisher

H = BlockHasher(4)


def toks(i: int) -> list[int]:
    return [i % 100_000, i // 100_000, 7, 7]


def key(i: int) -> int:
    return hashes_as_ints(H.hash_tokens(toks(i)))[0]


def batch(i: int, medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[stored([key(i)], None, toks(i), 4, medium)])


def drop(i: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[removed([key(i)], "GPU")])


Feed = tuple[KVEventPublisher, EventSubscriber, BlockIndex]
_PROBE = iter(range(10_000_000, 20_000_000))


@pytest.fixture
def feed() -> Iterator[Feed]:
    pub = KVEventPublisher()
    sub = EventSubscriber(replay_timeout_s=1.0)
    sub.start()
    idx = BlockIndex()
    yield pub, sub, idx
    sub.stop()
    pub.close()


def connect(
    pub: KVEventPublisher, sub: EventSubscriber, idx: BlockIndex, pod: str = "p", replay: bool = True,
    recompute: bool = True, **kw: object,
) -> PodEventApplier:
    ap = PodEventApplier(pod, idx, H, recompute_keys=recompute)
    sub.add_pod(pod, pub.endpoint, pub.replay_endpoint if replay else None, ap, **kw)  # type: ignore[arg-type]
    # PUB/SUB joins asynchronously: publish probes until one of them is indexed.
    wait_for(_publishing_probes(pub, idx, pod), f"the subscriber joined to {pod}'s publisher", timeout_s=10,
             interval_s=0.1)
    return ap


def _publishing_probes(
    pub: KVEventPublisher, idx: BlockIndex, pod: str, probes: Iterator[int] = _PROBE
) -> Callable[[], bool]:
    """A probe for :func:`wait_for` that publishes a new probe batch each time until one of them is
    indexed."""
    sent: list[int] = []

    def probe() -> bool:
        if any(indexed(idx, i, pod) for i in sent):
            return True
        sent.append(next(probes))
        pub.publish(batch(sent[-1]))
        return False

    return probe


def indexed(idx: BlockIndex, i: int, pod: str = "p") -> bool:
    return bool(idx.match([key(i)], [pod]))


class TestFeed:
    def test_batches_reach_the_index(self, feed: Feed) -> None:
        """Published BlockStored batches show up in the index under the pod."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        for i in range(5):
            pub.publish(batch(i))
        wait_for(lambda: all(indexed(idx, i) for i in range(5)), what="5 batches indexed")
        assert sub.healthy()

    def test_gap_is_filled_from_replay(self, feed: Feed) -> None:
        """A lost message (sequence gap) is fetched from the ROUTER replay endpoint, in order."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        pub.publish(batch(1), drop=True)
        pub.publish(batch(2))
        wait_for(lambda: indexed(idx, 2), what="batch after the gap")
        assert indexed(idx, 1), "the dropped batch was not replayed"
        st = sub.stats["p"]
        assert st.gaps >= 1 and st.replayed >= 1 and st.resyncs == 0

    def test_late_subscriber_rebuilds_from_the_pod(self, feed: Feed) -> None:
        """A picker that starts (or restarts) after the pod published rebuilds the index via replay from 0."""
        pub, sub, idx = feed
        for i in range(3):
            pub.publish(batch(i))
        connect(pub, sub, idx)
        wait_for(lambda: all(indexed(idx, i) for i in range(3)), what="replayed history")

    def test_idle_pod_is_known_without_a_new_publish(self, feed: Feed) -> None:
        """Adding a pod replays its history from 0 right away: an idle pod's blocks are indexed before it
        publishes."""
        pub, sub, idx = feed
        for i in range(3):
            pub.publish(batch(i))
        sub.add_pod("p", pub.endpoint, pub.replay_endpoint, PodEventApplier("p", idx, H))
        wait_for(lambda: all(indexed(idx, i) for i in range(3)), what="history of an idle pod")
        assert sub.stats["p"].replayed == 3 and sub.stats["p"].gaps == 0
        pub.publish(batch(3))  # the live stream continues after the replayed sequence, without a gap
        wait_for(lambda: indexed(idx, 3), what="live batch after the bootstrap")
        assert sub.stats["p"].gaps == 0

    def test_gap_without_replay_resyncs(self, feed: Feed) -> None:
        """Without a replay endpoint a gap clears the pod's blocks (stale entries must not linger)."""
        pub, sub, idx = feed
        connect(pub, sub, idx, replay=False)
        pub.publish(batch(1))
        wait_for(lambda: indexed(idx, 1), what="batch 1")
        pub.publish(batch(2), drop=True)
        pub.publish(batch(3))
        wait_for(lambda: indexed(idx, 3), what="batch 3")
        assert not indexed(idx, 1) and sub.stats["p"].resyncs >= 1

    def test_replay_answer_in_vllm_frames(self, feed: Feed) -> None:
        """The test pod answers replay exactly as vLLM's ZmqEventPublisher does ([b"", seq, payload], then
        [b"", -1, b""]); the subscriber fills gaps from it (the end marker is what closes a request)."""
        pub, sub, idx = feed
        assert kvwire.replay_item(b"id", 5, b"x") == [b"id", b"", (5).to_bytes(8, "big"), b"x"]
        assert kvwire.replay_end(b"id") == [b"id", b"", (-1).to_bytes(8, "big", signed=True), b""]
        connect(pub, sub, idx)
        for i in range(20, 25):
            pub.publish(batch(i), drop=True)
        pub.publish(batch(25))
        wait_for(lambda: all(indexed(idx, i) for i in range(20, 26)), timeout_s=3, what="gap of 5 replayed")
        assert sub.stats["p"].replay_timeouts == 0 and sub.stats["p"].resyncs == 0


class TestBadInput:
    """Anything a pod sends is validated and isolated: counted, dropped, the feed and other pods go on."""

    def test_token_id_beyond_32_bits_is_counted_and_pods_keep_indexing(self, feed: Feed) -> None:
        """A BlockStored with a token id >= 2^32 once killed the ingestion thread for every pod."""
        pub, sub, idx = feed
        other = KVEventPublisher()
        try:
            connect(pub, sub, idx, pod="p")
            connect(other, sub, idx, pod="q")
            bad = stored([12345], None, [2**32 + 5, 1, 2, 3], 4, "GPU")
            pub.publish(KVEventBatch(ts=0.0, events=[bad, batch(1).events[0]]))
            pub.publish(batch(2))
            other.publish(batch(3))
            wait_for(lambda: indexed(idx, 2) and indexed(idx, 3, "q"), what="both pods after the bad event")
            assert indexed(idx, 1), "the valid event of the same batch was dropped"
            assert sub.stats["p"].rejected == 1 and sub.stats["q"].rejected == 0
            assert sub.healthy()
        finally:
            other.close()

    def test_malformed_frames_payloads_and_event_types(self, feed: Feed) -> None:
        pub, sub, idx = feed
        connect(pub, sub, idx)
        pub.publish_raw(b"\xc1garbage")  # not msgpack
        pub.send_frames([b"only-one-frame"])  # not a live message
        pub.send_frames([b"", b"\x00\x01", b"x"])  # a 2-byte sequence number
        unknown = msgspec.msgpack.encode([0.0, [{"type": "BlockMoved", "x": 1},
                                                msgspec.to_builtins(batch(4).events[0])]])
        pub.publish_raw(unknown)
        pub.publish(batch(7))
        wait_for(lambda: indexed(idx, 7) and indexed(idx, 4), what="batches after the garbage")
        assert sub.stats["p"].rejected == 4 and sub.healthy()

    def test_huge_batch_is_refused(self) -> None:
        """A batch above the byte cap is refused (counted), the pod's entries cleared, the feed goes on."""
        pub, idx = KVEventPublisher(), BlockIndex()
        sub = EventSubscriber(replay_timeout_s=1.0, max_batch_bytes=64 << 10)
        sub.start()
        try:
            connect(pub, sub, idx)
            pub.publish(batch(1))
            wait_for(lambda: indexed(idx, 1), what="batch 1")
            big = stored([key(2)], None, [1] * 100_000, 4, "GPU")
            pub.publish(KVEventBatch(ts=0.0, events=[big]))
            pub.publish(batch(3))
            wait_for(lambda: indexed(idx, 3), what="batch after the huge one")
            st = sub.stats["p"]
            assert st.rejected == 1 and not indexed(idx, 1) and st.resyncs >= 1 and sub.healthy()
        finally:
            sub.stop()
            pub.close()

    def test_wrong_topic_is_refused(self, feed: Feed) -> None:
        """With the pod's topic given, a message on another topic (here another publisher's seq 0, which
        would read as a restart) is refused before it is sequenced."""
        pub, sub, idx = feed
        pub.topic = b"kv@p@m"
        connect(pub, sub, idx, topic="kv@p@m")
        pub.send_frames(kvwire.live_frames(b"kv@p@m2", 0, encode_batch(batch(1))))
        pub.publish(batch(2))
        wait_for(lambda: indexed(idx, 2), what="batch on the right topic")
        st = sub.stats["p"]
        assert not indexed(idx, 1) and st.rejected == 1 and st.restarts == 0 and st.resyncs == 0

    def test_mediums_of_real_engines(self, feed: Feed) -> None:
        """SGLang's CPU_PINNED/DISK/EXTERNAL, vLLM's STORAGE, lowercase: indexed in their tiers; unknown names
        counted."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        cases = {"CPU_PINNED": Tier.CPU, "cpu_pinned": Tier.CPU, "DISK": Tier.SSD, "STORAGE": Tier.SSD,
                 "EXTERNAL": Tier.REMOTE, "gpu": Tier.GPU, "TAPE": Tier.REMOTE}
        for i, medium in enumerate(cases, start=30):
            pub.publish(batch(i, medium))
        pub.publish(KVEventBatch(ts=0.0, events=[stored([key(40)], None, toks(40), 4, None)]))  # type: ignore[arg-type]
        wait_for(lambda: indexed(idx, 40), what="mediums")
        for i, tier in enumerate(cases.values(), start=30):
            assert idx.pod_tiers("p", key(i)) == {tier}
        assert idx.pod_tiers("p", key(40)) == {Tier.GPU}
        assert sub.stats["p"].ingest.unknown_medium == 1 and sub.stats["p"].rejected == 0


class TestNoStall:
    def test_silent_replay_endpoint_and_gaps_do_not_stall_other_pods(self) -> None:
        """A pod whose replay endpoint never answers, with a gap every 0.2 s: another pod's batches are still
        indexed within a fraction of the replay timeout (one thread served every pod, 2 s per gap)."""
        slow, fast, idx = KVEventPublisher(), KVEventPublisher(), BlockIndex()
        sub = EventSubscriber(replay_timeout_s=1.0)
        sub.start()
        try:
            connect(slow, sub, idx, pod="slow")
            connect(fast, sub, idx, pod="fast")
            slow.replay_silent = True
            latencies: list[float] = []
            t_end = time.monotonic() + 3.0
            i = 100
            while time.monotonic() < t_end:
                slow.publish(batch(i), drop=True)  # a gap on the slow pod
                slow.publish(batch(i + 1))
                for _ in range(4):
                    i += 2
                    t0 = time.monotonic()
                    fast.publish(batch(i))
                    wait_for(lambda i=i: indexed(idx, i, "fast"), timeout_s=5, interval_s=0.02,  # type: ignore[misc]
                             what="fast pod batch")
                    latencies.append(time.monotonic() - t0)
                    time.sleep(0.05)  # pacing: the fast pod publishes about 20 batches a second
            assert max(latencies) < 0.5, f"fast pod stalled: max {max(latencies):.2f} s"
            assert sub.stats["slow"].replay_timeouts >= 1 and len(slow.replay_requests) >= 1
            assert sub.healthy()
            slow.publish(batch(99_999))  # the slow pod is still indexed too
            wait_for(lambda: indexed(idx, 99_999, "slow"), what="slow pod's batch")
        finally:
            sub.stop()
            slow.close()
            fast.close()


class TestConsistency:
    @pytest.mark.parametrize("lost_live", [False, True])
    def test_replay_hole_resyncs_instead_of_keeping_a_phantom(self, feed: Feed, lost_live: bool) -> None:
        """The removal of block 1 is lost live and missing from the replay answer: the pod is cleared and
        rebuilt from what follows the hole; block 1 must not stay indexed."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        pub.publish(batch(1), drop=lost_live)
        if not lost_live:
            wait_for(lambda: indexed(idx, 1), what="batch 1")
        seq = pub.publish(drop(1), drop=True)
        pub.replay_skip.add(seq)
        pub.publish(batch(2))
        wait_for(lambda: indexed(idx, 2), what="batch after the hole")
        # the hole is noticed and the pod rebuilt without block 1; a phantom (a block whose removal was lost,
        # still indexed) keeps this from ever holding
        wait_for(lambda: sub.stats["p"].resyncs >= 1 and not indexed(idx, 1),
                 what="a resync after the hole that leaves no phantom of block 1")
        assert indexed(idx, 2)
        st = sub.stats["p"]
        assert st.replay_holes + st.gaps >= 1 and sub.healthy()

    def test_restart_with_seq_0_lost_is_detected(self, feed: Feed) -> None:
        """The restarted publisher's seq 0 is lost (slow joiner): its seq 1 is below the last seen, so the pod
        is rebuilt from its new replay buffer; the old blocks go and the new ones (seq 0 included) are
        indexed."""
        pub, sub, idx = feed
        connect(pub, sub, idx)
        pub.publish(batch(1))
        pub.publish(batch(2))
        wait_for(lambda: indexed(idx, 2), what="before the restart")
        pub.restart()
        pub.publish(batch(3), drop=True)  # new seq 0, lost
        pub.publish(batch(4))  # new seq 1
        wait_for(lambda: indexed(idx, 4) and indexed(idx, 3) and not indexed(idx, 1),
                 what="rebuilt after the restart")
        assert sub.stats["p"].restarts == 1

    def test_restart_without_replay_clears_stale_blocks(self, feed: Feed) -> None:
        pub, sub, idx = feed
        connect(pub, sub, idx, replay=False)
        for i in (1, 2, 3):
            pub.publish(batch(i))
        wait_for(lambda: indexed(idx, 3), what="before the restart")
        pub.restart()
        pub.publish(batch(4), drop=True)
        pub.publish(batch(5))
        wait_for(lambda: indexed(idx, 5), what="after the restart")
        assert not indexed(idx, 1) and sub.stats["p"].restarts == 1

    def test_reconnection_rebuilds_the_pod(self) -> None:
        """A new publisher on the same ports whose first batches were lost and whose sequence numbers pass
        the old ones: only the reconnection tells; the pod is rebuilt from the new replay buffer."""
        idx = BlockIndex()
        sub = EventSubscriber(replay_timeout_s=1.0)
        sub.start()
        pub = KVEventPublisher()
        try:
            connect(pub, sub, idx)
            pub.publish(batch(1))
            wait_for(lambda: indexed(idx, 1), what="batch 1")
            ports = (int(pub.endpoint.rsplit(":", 1)[1]), int(pub.replay_endpoint.rsplit(":", 1)[1]))
            last = pub.seq
            pub.close()
            # a time gap: the subscriber's connection drops before the new publisher binds the ports
            time.sleep(0.3)
            pub = KVEventPublisher(ports=ports)
            for i in range(last + 3):  # lost while reconnecting
                pub.publish(batch(200 + i), drop=True)
            wait_for(_publishing_probes(pub, idx, "p", itertools.count(501)), "the subscriber reconnected",
                     timeout_s=10, interval_s=0.1)
            wait_for(lambda: indexed(idx, 200) and not indexed(idx, 1), what="rebuilt after the reconnection")
        finally:
            sub.stop()
            pub.close()

    def test_all_blocks_cleared_and_removal(self, feed: Feed) -> None:
        pub, sub, idx = feed
        connect(pub, sub, idx)
        pub.publish(batch(1))
        pub.publish(batch(2))
        pub.publish(drop(1))
        wait_for(lambda: indexed(idx, 2) and not indexed(idx, 1), what="removal")
        pub.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        wait_for(lambda: not indexed(idx, 2), what="cleared")


class TestWatchdog:
    def test_healthy_turns_false_when_the_loop_is_stuck_or_dead(self) -> None:
        pub, idx = KVEventPublisher(), BlockIndex()
        stuck: list[float] = []

        def on_batch(pod: str) -> None:
            if stuck:
                time.sleep(stuck.pop())

        sub = EventSubscriber(replay_timeout_s=1.0, on_batch=on_batch, stall_after_s=0.5)
        assert not sub.healthy()  # not started
        sub.start()
        try:
            connect(pub, sub, idx)
            assert sub.healthy()
            stuck.append(1.5)
            pub.publish(batch(1))
            wait_for(lambda: not sub.healthy(), what="stuck loop reported")
            wait_for(lambda: indexed(idx, 1) and sub.healthy(), what="recovered")
            boom: Callable[[], int] = lambda: 1 // 0  # noqa: E731
            sub._poll_ms = boom  # type: ignore[method-assign]
            wait_for(lambda: not sub.healthy(), what="dead loop reported")
        finally:
            sub.stop()
            pub.close()
        assert not sub.healthy()


class TestLag:
    def test_lag_is_the_age_of_batches_applied_behind_a_queue_and_0_once_caught_up(self) -> None:
        """While batches are queued behind the one applied, the lag is that batch's age (by its ``ts``);
        once the socket is read empty it is 0 (a pod that stops publishing is not "behind")."""
        pub, idx = KVEventPublisher(), BlockIndex()
        seen: list[float] = []
        slow = [False]

        def on_batch(pod: str) -> None:
            seen.append(sub.stats[pod].lag_s)
            if slow[0]:
                time.sleep(0.05)  # a busy ingestion thread: the rest wait in the socket

        sub = EventSubscriber(replay_timeout_s=1.0, on_batch=on_batch)
        sub.start()
        try:
            connect(pub, sub, idx)
            slow[0] = True
            seen.clear()
            old = time.time() - 30.0
            for i in range(20):
                pub.publish(KVEventBatch(ts=old, events=[stored([key(i)], None, toks(i), 4, "GPU")]))
            wait_for(lambda: indexed(idx, 19), what="the queued batches applied")
            assert len(seen) >= 20 and all(lag >= 30.0 for lag in seen[:19]), seen
            wait_for(lambda: sub.stats["p"].lag_s == 0.0, what="lag back to 0 once caught up")
            # a pod's timestamps are hostile input: inf or NaN leave the lag a number, the batch applied
            seen.clear()
            pub.publish(KVEventBatch(ts=old, events=[stored([key(20)], None, toks(20), 4, "GPU")]))
            for i, ts in ((21, float("inf")), (22, float("nan"))):
                pub.publish(KVEventBatch(ts=ts, events=[stored([key(i)], None, toks(i), 4, "GPU")]))
            wait_for(lambda: indexed(idx, 22), what="batches with inf and NaN timestamps applied")
            assert len(seen) == 3 and seen[0] >= 30.0 and seen[1:] == [seen[0], seen[0]], seen
        finally:
            sub.stop()
            pub.close()


class TestCoalescing:
    """``coalesce_s``: under sustained traffic the ingestion thread wakes once per window and reads every
    batch that arrived meanwhile; after a quiet spell a batch is read at once."""

    @staticmethod
    @contextlib.contextmanager
    def joined(window_s: float) -> Iterator[Feed]:
        """A subscriber with that window joined to a publisher, after a quiet spell longer than the window."""
        pub, idx = KVEventPublisher(), BlockIndex()
        sub = EventSubscriber(replay_timeout_s=1.0, coalesce_s=window_s)
        sub.start()
        try:
            connect(pub, sub, idx)
            time.sleep(window_s + 0.1)  # the probes' reads are a window behind
            yield pub, sub, idx
        finally:
            sub.stop()
            pub.close()

    def test_sustained_batches_share_reads(self) -> None:
        with self.joined(0.1) as (pub, sub, idx):
            before = sub.reads
            for i in range(40):  # 0.4 s of traffic, a batch every 10 ms
                pub.publish(batch(100 + i))
                time.sleep(0.01)
            wait_for(lambda: all(indexed(idx, 100 + i) for i in range(40)), what="the 40 batches indexed")
            assert sub.reads - before <= 10, sub.reads - before  # one read per 0.1 s window (40 without)

    def test_a_batch_after_a_quiet_spell_is_read_at_once_the_next_waits_for_the_window(self) -> None:
        with self.joined(1.5) as (pub, _, idx):
            t0 = time.monotonic()
            pub.publish(batch(1))
            wait_for(lambda: indexed(idx, 1), what="the first batch", timeout_s=1.0, interval_s=0.01)
            assert time.monotonic() - t0 < 1.0
            pub.publish(batch(2))
            time.sleep(0.5)
            assert not indexed(idx, 2)  # within the window of the read that found batch 1
            wait_for(lambda: indexed(idx, 2), what="the second batch, at the window's end", timeout_s=3.0)

    def test_setting_is_bounded(self) -> None:
        from kvfleet.config.epp import EppSettings

        assert EppSettings().events_coalesce_s == 0.02
        with pytest.raises(ValueError, match="events_coalesce_s"):
            EppSettings(events_coalesce_s=-1.0)


class TestBounds:
    def test_engine_hash_map_is_bounded(self, feed: Feed) -> None:
        """Blocks whose engine hash differs from the picker's recomputation on a pod not known to hash like
        the picker (keyed by the recomputation, remembered so that a removal or a child finds the key):
        entries go with BlockRemoved, the map is capped (evictions counted)."""
        pub, sub, idx = feed
        ap = connect(pub, sub, idx)
        ap.max_keys = 8
        ap.hashes_like_us = None  # the probes of connect() showed it; this pod is to hash otherwise

        def foreign(i: int) -> KVEventBatch:
            return KVEventBatch(ts=0.0, events=[stored([key(i) ^ 1], None, toks(i), 4, "GPU")])

        def held(i: int) -> bool:
            return bool(idx.match([key(i)], ["p"]))

        for i in range(50, 70):
            pub.publish(foreign(i))
        wait_for(lambda: held(69), what="20 batches")
        assert len(ap) == 8 and sub.stats["p"].ingest.key_evictions >= 12
        for i in range(62, 70):
            pub.publish(KVEventBatch(ts=0.0, events=[removed([key(i) ^ 1], "GPU")]))
        wait_for(lambda: not held(69), what="removals")
        assert len(ap) == 0

    def test_a_pod_hashing_like_the_picker_needs_no_map(self, feed: Feed) -> None:
        """Engine hashes equal to the picker's keys are indexed and removed with no engine-hash map entry."""
        pub, sub, idx = feed
        ap = connect(pub, sub, idx)
        for i in range(50, 70):
            pub.publish(batch(i))
        wait_for(lambda: indexed(idx, 69), what="20 batches")
        assert len(ap) == 0 and ap.hashes_like_us
        for i in range(50, 70):
            pub.publish(drop(i))
        wait_for(lambda: not any(indexed(idx, i) for i in range(50, 70)), what="removals")
        sub.remove_pod("p")
        wait_for(lambda: "p" not in sub.stats, what="stats of a removed pod dropped")
