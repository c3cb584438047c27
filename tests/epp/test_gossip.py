"""Replica gossip between EPP replicas: picks and in-flight load made on one replica count on another; hostile
messages.

Covers: two in-process pickers (the real :class:`Epp` assembly, ZMQ on loopback) configured as each other's
peers: a pick made by replica A's router becomes a speculative entry on replica B, so B predicts the hit and
routes the same prompt to the same pod before any KV event exists (without gossip B predicts nothing); A's
open requests count in B's in-flight and pending figures until A sees their first token and stream end, each
pick's follow-up sample counts on both, a peer's pick lives as its picker's own (until its ticket's first
token, then the speculative TTL, served) or moves with its ticket, and
a replica that goes silent has its requests closed on the others; the counters on /metrics. Each rule of the
gossip port's boundary, through :meth:`ReplicaGossip.apply`: an oversized message, too many keys,
undecodable or wrong-version payloads, a missing or wrong HMAC tag when a secret is set, a replica's own
messages, an unknown pod, an unknown ticket event, a bad token count, and more peer tickets than the
tracker holds are dropped and counted, leaving the index and tracker unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

import kvfleet.epp.gossip as gossip_mod
from kvfleet.config import load
from kvfleet.demo.envoy import free_port
from kvfleet.epp.app import Epp
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.gossip import MAX_BYTES, MAX_KEYS, VERSION, ReplicaGossip, resolve
from kvfleet.epp.index import BlockIndex, PickOrigin
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.speculative import spec_positions
from kvfleet.epp.tokenize import load_tokenizer
from tests.conftest import wait_for
from tests.epp.pods import PodFleet

PROMPT = "a long shared system prompt for the burst " * 30


def test_a_pick_on_one_replica_routes_the_same_prefix_on_another(
    epp_factory: Callable[..., Epp], fleet: PodFleet
) -> None:
    pa, pb = free_port(), free_port()
    a = epp_factory(gossip_port=pa, gossip_peers=[f"127.0.0.1:{pb}"])
    b = epp_factory(gossip_port=pb, gossip_peers=[f"localhost:{pa}"])  # a name, resolved
    assert a.gossip is not None and b.gossip is not None
    # ZMQ's slow joiner: probe picks from A until B applies one (B's SUB has connected to A's PUB)
    probe = [1, 2, 3]
    wait_for(lambda: a.index.add_speculative(fleet.pods[0].name, probe, 1.0) is not None
             and b.gossip is not None and b.gossip.picks_in["applied"] > 0,
             timeout_s=10.0, what="B to hear A")
    wait_for(lambda: b.index.add_speculative(fleet.pods[0].name, probe, 1.0) is not None
             and a.gossip is not None and a.gossip.picks_in["applied"] > 0,
             timeout_s=10.0, what="A to hear B")

    req = InferenceRequest(model="m", prompt=PROMPT)
    keys = b.router.keys_of(b.router.tokens_of(req), None)
    pods = [p.name for p in fleet.pods]
    assert b.index.match(keys, pods) == {}  # nothing on B: no KV event exists, B made no pick
    first = a.router.route(req)
    assert first.predicted_hit_tokens == 0
    wait_for(lambda: getattr(b.index.match(keys, pods).get(first.pod), "blocks", 0) == len(keys),
             timeout_s=10.0, what="A's pick on B")
    spec = b.index.match(keys, pods)[first.pod]
    assert spec.speculative == spec.blocks == len(keys) and set(b.index.match(keys, pods)) == {first.pod}
    again = b.router.route(req)
    assert again.pod == first.pod
    assert again.predicted_hit_tokens == len(keys) * 16 > 0  # B predicts the hit it learned from A
    text = _metrics(b)
    assert 'kvfleet_epp_gossip_picks_total{direction="in",result="applied"}' in text
    assert 'kvfleet_epp_gossip_peers 1.0' in text
    assert a.gossip.picks_out["sent"] >= 2 and a.gossip.picks_out["dropped"] == 0
    wait_for(lambda: b.gossip is not None and b.gossip.picks_out["sent"] >= 1, timeout_s=10.0,
             what="B's own pick shared")
    # each pick carried its follow-up sample (A's: nothing live covered the prompt, B's: A's pick did):
    # both replicas fold the same two, in the same order, as one picker would have
    wait_for(lambda: a.router.director.followup_shares() == b.router.director.followup_shares() == {
        "pool-a": pytest.approx(0.01)}, timeout_s=10.0, what="both follow-up samples on both replicas")


def test_in_flight_load_on_one_replica_counts_on_the_other(
    epp_factory: Callable[..., Epp], fleet: PodFleet, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gossip_mod, "SILENT_S", 2.0)
    pa, pb = free_port(), free_port()
    a = epp_factory(gossip_port=pa, gossip_peers=[f"127.0.0.1:{pb}"])
    b = epp_factory(gossip_port=pb, gossip_peers=[f"127.0.0.1:{pa}"])
    assert a.gossip is not None and b.gossip is not None
    wait_for(lambda: b.gossip is not None and b.gossip.live_peers == 1, timeout_s=10.0,
             what="B to hear A's heartbeat")

    decisions = [a.router.route(InferenceRequest(model="m", prompt=f"request {i} " * 50)) for i in range(6)]
    mine = {d.pod: a.tracker.load(d.pod) for d in decisions}
    assert sum(n for n, _, _ in mine.values()) == 6
    # B has routed nothing, yet sees A's six requests in flight with their pending prefill work
    wait_for(lambda: {pod: b.tracker.load(pod) for pod in mine} == mine, timeout_s=10.0,
             what="A's tickets on B")
    assert b.tracker.remote_count() == 6 and "kvfleet_epp_remote_tickets 6.0" in _metrics(b)
    for d in decisions[:3]:
        assert d.ticket is not None
        d.ticket.first_byte()  # prefill done: pending work ends, still in flight
    wait_for(lambda: sum(b.tracker.load(p)[2] for p in mine) == 3, timeout_s=10.0, what="first tokens on B")
    assert sum(b.tracker.load(p)[0] for p in mine) == 6
    for d in decisions[:4]:
        assert d.ticket is not None
        d.ticket.close()
    wait_for(lambda: b.tracker.remote_count() == 2, timeout_s=10.0, what="closes on B")
    assert sum(b.tracker.load(p)[0] for p in mine) == 2
    assert a.tracker.remote_count() == 0  # B sent no tickets of its own
    # A stops (as a killed replica): after SILENT_S without a heartbeat, B closes A's remaining requests
    assert a.gossip is not None
    a.gossip.stop()
    wait_for(lambda: b.tracker.remote_count() == 0, timeout_s=10.0, what="B to forget silent A")
    assert all(b.tracker.load(p) == (0, 0.0, 0) for p in mine) and b.gossip.peers_gone == 1
    assert a.gossip.replica not in b.tracker._remote  # nothing kept for a peer that is gone


def _metrics(epp: Epp) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


class _Pub:
    """A PUB socket that keeps what it is sent."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)


class TestBoundary:
    """Every message is checked before it can touch the index or the tracker; each failure is counted by
    reason."""

    def gossip(self, secret: bytes = b"", max_remote: int = 100) -> tuple[ReplicaGossip, BlockIndex]:
        idx = BlockIndex()
        self.tracker = InflightTracker(max_remote=max_remote)
        g = ReplicaGossip(idx, host="127.0.0.1", port=0, peers=(), ttl_s=5.0,
                          known_pod=lambda p: p in ("pod-0", "pod-1"),
                          tracker=self.tracker, secret=secret, replica="me")
        return g, idx

    @staticmethod
    def payload(
        picks: Sequence[Any] = (), tickets: Sequence[Any] = (), version: int = VERSION, replica: str = "peer"
    ) -> bytes:
        return msgspec.msgpack.encode([version, replica, list(picks), list(tickets)])

    def test_a_valid_pick_is_applied(self) -> None:
        g, idx = self.gossip()
        keys = list(range(100, 200))
        sampled = [keys[i] for i in spec_positions(len(keys))]
        assert g.apply([self.payload([["pod-0", sampled]])]) == "ok"
        assert g.picks_in["applied"] == 1
        assert idx.match(keys, ["pod-0"])["pod-0"].blocks == 100
        # the pick also counts in the pod's reuse sketch: without its length (a peer of an older release) the
        # last sampled key weighs up to the grid's next point (111), with it exactly (99)
        assert idx.reuse.distance("pod-0", [keys[99], keys[0]]) == [0, 111]
        assert g.apply([self.payload([["pod-0", sampled, 100], ["pod-1", sampled, -7]])]) == "ok"
        assert g.picks_in["applied"] == 3
        assert idx.reuse.distance("pod-0", [keys[0]]) == [99]
        assert idx.reuse.distance("pod-1", [keys[0]]) == [111]  # a length that does not fit: the grid's

    def test_a_peer_pick_lives_as_its_pickers_own(self) -> None:
        """With its ticket held, a peer's pick lives until the ticket's first token (however long the queue),
        then the pod's speculative TTL as a served pick, which the pod's removals drop; without its ticket,
        ``ttl_s`` and never served."""
        now = [100.0]
        idx = BlockIndex(clock=lambda: now[0])
        tracker = InflightTracker(clock=lambda: now[0])
        g = ReplicaGossip(idx, host="127.0.0.1", port=0, peers=(), ttl_s=5.0, known_pod=lambda p: True,
                          tracker=tracker, replica="me", pick_ttl=lambda pod: 2.0 if pod == "pod-0" else 3.0)
        keys = list(range(100, 200))
        sampled = [keys[i] for i in spec_positions(len(keys))]
        u64 = np.array(sampled, dtype=np.uint64)
        # the ticket's open comes first (both are queued at the pick, in that order)
        opened = [[0, 7, ["pod-0"], 0, 10.0]]
        assert g.apply([self.payload([["pod-0", sampled, 100, 7, 0.0, "pool"]], opened)]) == "ok"
        assert idx.drop_served_speculative("pod-0", u64) == 0  # not served yet: a removal keeps it
        now[0] += 60.0  # a long queue: the pick waits for its first token, as its picker's own entry does
        assert idx.match(keys, ["pod-0"])["pod-0"].blocks == 100
        assert g.apply([self.payload(tickets=[[1, 7, []]])]) == "ok"  # first token: pick_ttl from now
        now[0] += 1.9
        assert idx.match(keys, ["pod-0"])["pod-0"].blocks == 100
        now[0] += 0.2
        assert idx.match(keys, ["pod-0"]) == {}
        # served: the pod's removal drops it at once
        opened_and_first = [[0, 8, ["pod-1"], 0, 1.0], [1, 8, []]]
        assert g.apply([self.payload([["pod-1", sampled, 100, 8, 0.0, "pool"]], opened_and_first)]) == "ok"
        assert idx.match(keys, ["pod-1"])["pod-1"].blocks == 100  # first token before the pick: served now
        assert idx.drop_served_speculative("pod-1", u64) == len(sampled)
        assert idx.match(keys, ["pod-1"]) == {}
        # no ticket held (an older peer sends none; this one is unknown): ttl_s from receipt, never served
        unlinked = [["pod-0", sampled, 100], ["pod-1", sampled, 100, 99, 0.0, "pool"]]
        assert g.apply([self.payload(unlinked)]) == "ok"
        assert idx.drop_served_speculative("pod-0", u64) == idx.drop_served_speculative("pod-1", u64) == 0
        now[0] += 4.9
        assert set(idx.match(keys, ["pod-0", "pod-1"])) == {"pod-0", "pod-1"}
        now[0] += 0.2
        assert idx.match(keys, ["pod-0", "pod-1"]) == {}

    def test_a_peer_pick_moved_off_its_pod_expires_at_the_first_token(self) -> None:
        """The peer's fallback served (its ticket moved): the pick's entries on the first pod end at the first
        token, while the fallback's own pick (same ticket) lives on."""
        now = [0.0]
        idx = BlockIndex(clock=lambda: now[0])
        tracker = InflightTracker(clock=lambda: now[0])
        g = ReplicaGossip(idx, host="127.0.0.1", port=0, peers=(), ttl_s=5.0, known_pod=lambda p: True,
                          tracker=tracker, replica="me", pick_ttl=lambda pod: 2.0)
        keys = list(range(1000, 1040))
        sampled = [keys[i] for i in spec_positions(len(keys))]
        opened = [[0, 3, ["pod-0"], 0, 1.0]]
        assert g.apply([self.payload([["pod-0", sampled, 40, 3, 0.5, "pool"]], opened)]) == "ok"
        moved = [[3, 3, ["pod-0", "pod-1"]]]  # the peer's fallback served: its own pick, same ticket
        assert g.apply([self.payload([["pod-1", sampled, 40, 3, -1.0, "pool"]], moved)]) == "ok"
        assert set(idx.match(keys, ["pod-0", "pod-1"])) == {"pod-0", "pod-1"}
        assert g.apply([self.payload(tickets=[[1, 3, []]])]) == "ok"
        assert set(idx.match(keys, ["pod-0", "pod-1"])) == {"pod-1"}

    def test_peer_follow_up_samples_are_folded(self) -> None:
        """Each pick's follow-up sample goes to ``on_followup`` with its pool; samples outside 0..1, not
        finite, or without a pool are not (the pick itself still applies)."""
        got: list[tuple[str, float]] = []
        g = ReplicaGossip(BlockIndex(), host="127.0.0.1", port=0, peers=(), ttl_s=5.0,
                          known_pod=lambda p: True, replica="me",
                          on_followup=lambda pool, share: got.append((pool, share)))
        picks = [["pod-0", [1, 2], 2, -1, share, pool] for share, pool in [
            (0.25, "pool-a"), (1.0, "pool-b"), (0.0, "pool-a"), (1.5, "pool-a"), (-1.0, "pool-a"),
            (float("nan"), "pool-a"), (float("inf"), "pool-a"), (0.5, "")]]
        assert g.apply([self.payload(picks)]) == "ok"
        assert got == [("pool-a", 0.25), ("pool-b", 1.0), ("pool-a", 0.0)]
        assert g.picks_in["applied"] == len(picks)

    def test_valid_ticket_changes_are_applied(self) -> None:
        g, _ = self.gossip()
        assert g.apply([self.payload(tickets=[[0, 7, ["pod-0"], 42, 300.0],
                                              [0, 8, ["pod-0", "pod-1"], 1, 10.0]])]) == "ok"
        assert self.tracker.load("pod-0") == (2, 310.0, 2) and self.tracker.load("pod-1") == (1, 10.0, 1)
        assert self.tracker.same_prefix("pod-0", 42) == 1
        # first token; a move
        assert g.apply([self.payload(tickets=[[1, 7, []], [3, 8, ["pod-1", "pod-0"]]])]) == "ok"
        assert self.tracker.load("pod-0") == (2, 10.0, 1) and self.tracker.same_prefix("pod-0", 42) == 0
        # closes; 99 is unknown
        assert g.apply([self.payload(tickets=[[2, 7, []], [2, 8, []], [2, 99, []]])]) == "ok"
        assert self.tracker.remote_count() == 0 and self.tracker.load("pod-0") == (0, 0.0, 0)
        assert g.tickets_in["applied"] == 7

    @pytest.mark.parametrize(("frames", "result"), [
        ([b"\x00" * (MAX_BYTES + 1)], "too_large"),
        ([b"\xc1not msgpack"], "malformed"),
        ([msgspec.msgpack.encode([1, "peer", "pod-0", [1, 2]])], "malformed"),  # the version-1 wire
        ([msgspec.msgpack.encode([VERSION + 1, "peer", [], []])], "malformed"),
        ([msgspec.msgpack.encode([VERSION, "peer", [["pod-0", ["x"]]], []])], "malformed"),
        ([msgspec.msgpack.encode([VERSION, "peer", [["pod-0", [1.5]]], []])], "malformed"),
        *[([msgspec.msgpack.encode([VERSION, "peer", [["pod-0", [1, 2], 2, *origin]], []])], "malformed")
          for origin in (["t", 0.5, "pool"], [1, "x", "pool"], [1, 0.5, 7])],  # a pick's origin, mistyped
        ([msgspec.msgpack.encode([VERSION, "peer", [], [[0, "id", ["pod-0"]]]])], "malformed"),
        ([msgspec.msgpack.encode([VERSION, "peer", [], []]), b"extra"], "malformed"),
        ([], "malformed"),
        ([msgspec.msgpack.encode([VERSION, "me", [["pod-0", [1, 2]]], [[0, 1, ["pod-0"], 0, 1.0]]])], "self"),
    ])
    def test_refused_messages_touch_nothing(self, frames: list[bytes], result: str) -> None:
        g, idx = self.gossip()
        assert g.apply(frames) == result
        assert idx.num_speculative == 0 and self.tracker.remote_count() == 0

    @pytest.mark.parametrize(("picks", "tickets", "counter", "result"), [
        ([["pod-0", list(range(MAX_KEYS + 1))]], [], "picks_in", "too_large"),
        ([["pod-0", []]], [], "picks_in", "malformed"),
        ([["evil-pod", [1, 2]]], [], "picks_in", "unknown_pod"),
        ([], [[0, 1, ["evil-pod"], 0, 1.0]], "tickets_in", "unknown_pod"),
        ([], [[9, 1, ["pod-0"], 0, 1.0]], "tickets_in", "malformed"),
        ([], [[-1, 1, ["pod-0"], 0, 1.0]], "tickets_in", "malformed"),
        ([], [[0, 1, [], 0, 1.0]], "tickets_in", "malformed"),
        ([], [[0, 1, ["pod-0", "pod-1", "pod-0"], 0, 1.0]], "tickets_in", "malformed"),
        ([], [[0, 1, ["pod-0"], 0, -5.0]], "tickets_in", "malformed"),
        ([], [[0, 1, ["pod-0"], 0, float("nan")]], "tickets_in", "malformed"),
        ([], [[0, 1, ["pod-0"], 0, float("inf")]], "tickets_in", "malformed"),
        ([], [[0, 1, ["pod-0"], 0, 2e9]], "tickets_in", "malformed"),
        ([], [[3, 1, ["pod-0"]]], "tickets_in", "malformed"),
    ])
    def test_refused_items_touch_nothing(
        self, picks: list[Any], tickets: list[Any], counter: str, result: str
    ) -> None:
        g, idx = self.gossip()
        assert g.apply([self.payload(picks, tickets)]) == "ok"  # the message is sound; the item is not
        assert getattr(g, counter)[result] == 1
        assert idx.num_speculative == 0 and self.tracker.remote_count() == 0
        assert self.tracker.load("pod-0") == (0, 0.0, 0)

    def test_peer_tickets_are_bounded(self) -> None:
        g, _ = self.gossip(max_remote=3)
        opens = [[0, i, ["pod-0"], 0, 1.0] for i in range(5)]
        assert g.apply([self.payload(tickets=opens)]) == "ok"
        assert self.tracker.remote_count() == 3 and g.tickets_in["refused"] == 2
        # per peer
        assert g.apply([self.payload(tickets=[[0, 0, ["pod-0"], 0, 1.0]], replica="other")]) == "ok"
        # a repeated open
        assert g.apply([self.payload(tickets=[[0, 0, ["pod-0"], 0, 1.0]], replica="other")]) == "ok"
        assert self.tracker.remote_count() == 4 and g.tickets_in["refused"] == 3

    def test_with_a_secret_every_message_needs_its_tag(self) -> None:
        g, idx = self.gossip(secret=b"s3cret")
        body = self.payload([["pod-0", [1, 2, 3]]])
        good = hmac.new(b"s3cret", body, hashlib.sha256).digest()
        wrong = hmac.new(b"other", body, hashlib.sha256).digest()
        assert g.apply([body]) == "bad_tag"
        assert g.apply([body, wrong]) == "bad_tag"
        assert g.apply([body, good[:-1]]) == "bad_tag"
        assert idx.num_speculative == 0
        assert g.apply([body, good]) == "ok" and idx.num_speculative == 3

    def test_the_pick_path_never_blocks(self) -> None:
        g = ReplicaGossip(BlockIndex(), host="127.0.0.1", port=0, peers=(), ttl_s=5.0,
                          known_pod=lambda p: True, queue_size=2)
        tracker = InflightTracker()
        tracker.on_ticket = g.publish_ticket
        # the sockets are not up: changes wait, at most queue_size of them, then are dropped and counted
        for _ in range(3):
            g.publish("pod-0", [1, 2])
        tracker.open(("pod-0",), 0, 1.0)
        assert g.picks_out["dropped"] == 1 and g.tickets_out["dropped"] == 1


    def test_first_tokens_and_ends_leave_with_the_next_pick(self) -> None:
        """A first token or an end waits for the next pick (or the gossip thread, not running here) and leaves
        in its message; a ticket's open waits for its pick; a pick leaves at once."""
        g = ReplicaGossip(BlockIndex(), host="127.0.0.1", port=0, peers=(), ttl_s=5.0,
                          known_pod=lambda p: True, replica="me")
        pub = _Pub()
        g._pub = pub  # type: ignore[assignment]
        tracker = InflightTracker()
        tracker.on_ticket = g.publish_ticket
        earlier = tracker.open(("pod-0",), 0, 10.0)
        g.flush()  # a decision without a pick ends: its open leaves
        assert len(pub.sent) == 1
        earlier.first_byte()
        earlier.close()
        t = tracker.open(("pod-1",), 0, 10.0)
        assert len(pub.sent) == 1  # nothing left yet
        g.publish("pod-1", [1, 2, 3], 3, PickOrigin(t.id, 0.0, "pool"))
        assert len(pub.sent) == 2
        last = msgspec.msgpack.decode(pub.sent[-1][0], type=gossip_mod.Message)
        assert [(c.event, c.tid) for c in last.tickets] == [(1, earlier.id), (2, earlier.id), (0, t.id)]
        assert [p.ticket for p in last.picks] == [t.id]

    def test_queued_changes_go_out_in_few_messages_that_each_fit(self) -> None:
        """What waited for the sockets leaves as few messages as fit under the size bound (a receiver pays
        per message); a pick of the most keys allowed still fits alone; order is kept."""
        g = ReplicaGossip(BlockIndex(), host="127.0.0.1", port=0, peers=(), ttl_s=5.0,
                          known_pod=lambda p: True, replica="me")
        tracker = InflightTracker()
        tracker.on_ticket = g.publish_ticket
        for i in range(40):
            g.publish(f"pod-{i % 3}", list(range(i, i + 77)), 1000)
            tracker.open((f"pod-{i % 3}",), i, 10.0).close()
        g.publish("pod-0", list(range(MAX_KEYS)), MAX_KEYS)

        pub = _Pub()
        g._drain(pub)  # type: ignore[arg-type]
        msgs = [msgspec.msgpack.decode(f[0], type=gossip_mod.Message) for f in pub.sent]
        assert 2 <= len(msgs) <= 3 and all(len(f[0]) <= MAX_BYTES for f in pub.sent)
        picks = [p for m in msgs for p in m.picks]
        assert [p.keys[0] for p in picks] == [*range(40), 0] and len(picks[-1].keys) == MAX_KEYS
        events = [(t.event, t.tid) for m in msgs for t in m.tickets]
        assert len(events) == 120 and events == sorted(events, key=lambda e: e[1])
        assert g.picks_out["sent"] == 41 and g.tickets_out["sent"] == 120

def _router(index: BlockIndex, tracker: InflightTracker) -> Router:
    data = {"pools": [{"name": "pool", "models": ["m"], "pods": [
        {"name": f"p{i}", "address": "10.0.0.1", "port": 8000 + i} for i in range(4)]}]}
    s = load(overrides={"epp": {"events_enabled": False}})
    return Router(s.epp, s.cache, StaticDatastore(data=data), index, MetricsStore(), load_tokenizer("bytes"),
                  tracker)


def _pair(a_thread: bool, b_thread: bool) -> tuple[ReplicaGossip, Router, ReplicaGossip, Router]:
    """Replicas A and B (real sockets on loopback), each a router wired to its gossip as the app wires it,
    their gossip threads running as ``a_thread`` and ``b_thread`` say; returns once B has applied one of A's
    picks. With neither thread running nothing else is in flight from A to B then: no heartbeats, and the
    handshake's other probes are taken before."""
    out: list[Any] = []
    pa, pb = free_port(), free_port()
    for name, port, peer, thread in (("a", pa, pb, a_thread), ("b", pb, pa, b_thread)):
        index, tracker = BlockIndex(), InflightTracker()
        router = _router(index, tracker)
        g = ReplicaGossip(index, host="127.0.0.1", port=port, peers=[f"127.0.0.1:{peer}"], ttl_s=30.0,
                          known_pod=lambda pod: True, tracker=tracker, replica=name,
                          pick_ttl=router.director.pick_ttl_of, on_followup=router.director.peer_followup)
        index.on_pick, tracker.on_ticket = g.publish, g.publish_ticket
        router.before_decision, router.after_decision = g.receive, g.flush
        out += [g.start(thread), router]
    a, _, b, _ = out
    # ZMQ's slow joiner: probe picks from A until B has one (B's SUB has connected to A's PUB)
    wait_for(lambda: (a.publish("p0", [7, 8, 9], 3), b.receive() if not b_thread else 0)
             and b.picks_in["applied"] > 0, timeout_s=10.0, what="B to hear A")
    if not b_thread:  # the probes still on their way: taken until the socket has been quiet a while
        quiet = [0]

        def settled() -> bool:
            quiet[0] = 0 if b.receive() else quiet[0] + 1
            return quiet[0] >= 10

        wait_for(settled, timeout_s=10.0, interval_s=0.02, what="the probes taken")
    return a, out[1], b, out[3]


def test_a_busy_replica_routes_on_its_peers_latest_picks() -> None:
    """A replica applies what its peers sent before each decision, on the pick path: B's gossip thread is
    not running (as when a burst of decisions keeps it from the interpreter), yet B routes A's prefix to
    A's pod the moment A's pick has come, and A's ticket counts in B's load."""
    a, ra, b, rb = _pair(a_thread=False, b_thread=False)
    try:
        prompt = list(range(1000, 1064))
        first = ra.route_keys("m", prompt, 64 * 16)
        assert first.ticket is not None
        assert a.messages["sent"] >= 1 and a.tickets_out["sent"] >= 1
        wait_for(lambda: b._sub is not None and int(b._sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN,
                 timeout_s=10.0, interval_s=0.001, what="A's pick at B's socket")
        assert rb.index.match(prompt, ["p0", "p1", "p2", "p3"]) == {}  # nobody applied it yet
        again = rb.route_keys("m", prompt, 64 * 16)  # applies it first
        assert again.pod == first.pod and again.predicted_hit_tokens == 64 * 16
        assert rb.tracker.remote_count() == 1 and rb.tracker.load(first.pod)[0] == 2
    finally:
        a.stop()
        b.stop()


def test_a_flood_is_applied_a_go_at_a_time() -> None:
    """Before a decision a replica applies at most ``RECEIVE_GO`` of its peers' messages: a flood does not
    hold one decision up; the next decisions take the rest."""
    a, _, b, _ = _pair(a_thread=False, b_thread=False)
    try:
        before = b.picks_in["applied"]
        for i in range(200):
            a.publish("p1", [i, i + 1], 2)
        time.sleep(0.2)  # all of them at B's socket (loopback)
        got: list[int] = []

        def take() -> bool:
            got.append(b.receive())
            return b.picks_in["applied"] - before >= 200

        wait_for(take, timeout_s=10.0, interval_s=0.01, what="the flood applied")
        assert max(got) <= gossip_mod.RECEIVE_GO and sum(1 for n in got if n) >= 4
    finally:
        a.stop()
        b.stop()


def test_a_decision_is_sent_as_it_ends_and_first_tokens_and_ends_soon_after() -> None:
    """A decision's ticket open and pick leave as the pick is made; a decision without a pick (a request that
    is not an inference) sends its open when it ends, not at the next heartbeat; a first token and an end
    leave from the gossip thread soon after when no pick takes them along (which changes share a message:
    ``TestBoundary.test_first_tokens_and_ends_leave_with_the_next_pick``; heartbeats make message counts
    here inexact)."""
    a, ra, b, rb = _pair(a_thread=True, b_thread=True)
    try:
        picks, tickets = a.picks_out["sent"], a.tickets_out["sent"]
        ra.route_keys("m", list(range(2000, 2064)), 64 * 16)
        assert (a.picks_out["sent"], a.tickets_out["sent"]) == (picks + 1, tickets + 1)
        d = ra.route_any("m")
        assert a.tickets_out["sent"] == tickets + 2
        wait_for(lambda: rb.tracker.remote_count() == 2, timeout_s=10.0, what="both tickets on B")
        assert d.ticket is not None
        d.ticket.close()  # its first token (a close implies it) and its close
        wait_for(lambda: a.tickets_out["sent"] == tickets + 4, timeout_s=1.0, interval_s=0.001,
                 what="the gossip thread to send them")
        wait_for(lambda: rb.tracker.remote_count() == 1, timeout_s=10.0, what="the close on B")
    finally:
        a.stop()
        b.stop()


def test_first_tokens_and_ends_on_the_event_loop_leave_from_its_timer() -> None:
    """A first token and an end that happen on the event loop the gossip uses (``use_loop``: the ext_proc
    streams') leave from that loop's timer within the window, waking no other thread: here no gossip thread
    runs at all, and they still leave (without the loop's timer they would wait for the next pick); one that
    happens on another thread wakes the gossip thread (the pipe) instead."""
    import asyncio
    import os
    import threading

    a, ra, b, rb = _pair(a_thread=False, b_thread=False)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        a.use_loop(loop)
        first = ra.route_keys("m", list(range(3000, 3064)), 64 * 16)
        other = ra.route_keys("m", list(range(4000, 4064)), 64 * 16)
        assert first.ticket is not None and other.ticket is not None
        wait_for(lambda: (b.receive(), rb.tracker.remote_count())[1] == 2, timeout_s=10.0,
                 what="both tickets on B")
        sent = a.tickets_out["sent"]
        loop.call_soon_threadsafe(first.ticket.close)  # its first token and its end, on the loop
        wait_for(lambda: a.tickets_out["sent"] == sent + 2, timeout_s=2.0, interval_s=0.001,
                 what="the loop's timer to send them")
        with pytest.raises(BlockingIOError):
            os.read(a._wake_r, 16)  # the gossip thread was never woken
        wait_for(lambda: (b.receive(), rb.tracker.remote_count())[1] == 1, timeout_s=10.0,
                 what="the end on B")
        other.ticket.close()  # not on the loop: the gossip thread's to send (not running here)
        assert os.read(a._wake_r, 16) and a.tickets_out["sent"] == sent + 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
        a.stop()
        b.stop()


def test_a_replica_that_routes_nothing_applies_its_peers_messages_a_window_at_a_time() -> None:
    """The gossip thread of a replica that routes nothing applies its peers' messages in one go per
    ``APPLY_WINDOW_S`` instead of one per message: a peer's 20 picks, 2 ms apart, are applied in a few
    goes (one each without the window)."""
    a, _, b, _ = _pair(a_thread=False, b_thread=True)  # A sends no heartbeats: only the picks below
    goes: list[int] = []
    receive = b.receive

    def counted() -> int:
        n = receive()
        if n:
            goes.append(n)
        return n

    b.receive = counted  # type: ignore[method-assign]  # the thread looks it up on each turn
    try:
        time.sleep(0.2)  # the handshake's probes applied
        before, goes[:] = b.picks_in["applied"], []
        for i in range(20):
            a.publish("p1", [i, i + 1], 2)
            time.sleep(0.002)
        wait_for(lambda: b.picks_in["applied"] - before >= 20, timeout_s=10.0, what="the picks applied")
        assert sum(goes) == 20 and len(goes) <= 6, goes
    finally:
        a.stop()
        b.stop()


def test_a_pd_pick_names_its_ticket_on_both_pods_and_samples_once() -> None:
    """A prefill/decode pick records both pods under the request's one ticket; only the first carries the
    request's follow-up sample (peers fold one sample per request, as the picker does)."""
    data = {"pools": [{"name": "pd", "models": ["m"], "pods": [
        {"name": f"p{i}", "address": "10.0.0.1", "port": 8000 + i, "role": r}
        for i, r in enumerate(["prefill", "decode"])]}]}
    s = load(overrides={"epp": {"events_enabled": False, "pd_min_uncached_tokens": 1}})
    index = BlockIndex()
    router = Router(s.epp, s.cache, StaticDatastore(data=data), index, MetricsStore(),
                    load_tokenizer("bytes"))
    published: list[tuple[str, PickOrigin | None]] = []
    index.on_pick = lambda pod, sampled, blocks, origin: published.append((pod, origin))
    d = router.route(InferenceRequest(model="m", prompt=PROMPT))
    assert d.prefiller is not None and d.ticket is not None
    assert [pod for pod, _ in published] == ["p1", "p0"]
    origins = [o for _, o in published]
    assert all(o is not None and o.ticket == d.ticket.id and o.pool == "pd" for o in origins)
    assert [o.covered for o in origins if o is not None] == [0.0, -1.0]
    assert router.director.followup_shares() == {"pd": 0.0}
    # a peer's sample: only for a pool this picker serves, only within 0..1 (a forged stream of pool names
    # or values leaves nothing behind)
    for pool, share in [("no-such-pool", 0.5), *((f"pool-{i}", 1.0) for i in range(100)), ("pd", 1.5),
                        ("pd", float("nan")), ("pd", -0.1)]:
        router.director.peer_followup(pool, share)
    assert router.director.followup_shares() == {"pd": 0.0}
    router.director.peer_followup("pd", 1.0)
    assert router.director.followup_shares() == {"pd": pytest.approx(0.01)}


def test_peer_names_resolve_to_every_address() -> None:
    assert resolve(["127.0.0.1:7100", "localhost:7101", "no-such-host.invalid:7102", "[::1]:7103"]) >= {
        "tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101"}
