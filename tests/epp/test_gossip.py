"""Pick gossip between EPP replicas: a pick made on one replica routes the same prefix on another; hostile messages.

Covers: two in-process pickers (the real :class:`Epp` assembly, ZMQ on loopback) configured as each other's
peers: a pick made by replica A's router becomes a speculative entry on replica B, so B predicts the hit and
routes the same prompt to the same pod before any KV event exists (without gossip B predicts nothing); the
counters on /metrics. Each rule of the gossip port's boundary, through :meth:`PickGossip.apply`: an oversized
message, too many keys, undecodable or wrong-version payloads, a missing or wrong HMAC tag when a secret is
set, a replica's own messages and an unknown pod are dropped and counted, and the index is left unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvfleet.demo.envoy import free_port
from kvfleet.epp.app import Epp
from kvfleet.epp.gossip import MAX_BYTES, MAX_KEYS, PickGossip, resolve
from kvfleet.epp.index import BlockIndex, spec_positions
from kvfleet.epp.protocol import InferenceRequest
from tests.epp.conftest import wait_for
from tests.epp.pods import PodFleet

PROMPT = "a long shared system prompt for the burst " * 30


def test_a_pick_on_one_replica_routes_the_same_prefix_on_another(epp_factory: Callable[..., Epp], fleet: PodFleet) -> None:
    pa, pb = free_port(), free_port()
    a = epp_factory(gossip_port=pa, gossip_peers=[f"127.0.0.1:{pb}"])
    b = epp_factory(gossip_port=pb, gossip_peers=[f"localhost:{pa}"])  # a name, resolved
    assert a.gossip is not None and b.gossip is not None
    # ZMQ's slow joiner: probe picks from A until B applies one (B's SUB has connected to A's PUB)
    probe = [1, 2, 3]
    wait_for(lambda: a.index.add_speculative(fleet.pods[0].name, probe, 1.0) is not None and b.gossip is not None
          and b.gossip.received["applied"] > 0, timeout=10.0, what="B to hear A")

    req = InferenceRequest(model="m", prompt=PROMPT)
    keys = b.router.keys_of(b.router.tokens_of(req), None)
    pods = [p.name for p in fleet.pods]
    assert b.index.match(keys, pods) == {}  # nothing on B: no KV event exists, B made no pick
    first = a.router.route(req)
    assert first.predicted_hit_tokens == 0
    wait_for(lambda: getattr(b.index.match(keys, pods).get(first.pod), "blocks", 0) == len(keys), timeout=10.0, what="A's pick on B")
    spec = b.index.match(keys, pods)[first.pod]
    assert spec.speculative == spec.blocks == len(keys) and set(b.index.match(keys, pods)) == {first.pod}
    again = b.router.route(req)
    assert again.pod == first.pod
    assert again.predicted_hit_tokens == len(keys) * 16 > 0  # B predicts the hit it learned from A
    text = _metrics(b)
    assert 'kvfleet_epp_gossip_picks_total{direction="in",result="applied"}' in text
    assert a.gossip.out["sent"] >= 2 and a.gossip.out["dropped"] == 0
    wait_for(lambda: b.gossip is not None and b.gossip.out["sent"] >= 1, timeout=10.0, what="B's own pick shared")


def _metrics(epp: Epp) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


class TestBoundary:
    """Every message is checked before it can touch the index; each failure is counted by reason."""

    def gossip(self, secret: bytes = b"") -> tuple[PickGossip, BlockIndex]:
        idx = BlockIndex()
        g = PickGossip(idx, host="127.0.0.1", port=0, peers=(), ttl_s=5.0, known_pod=lambda p: p == "pod-0", secret=secret,
                       replica="me")
        return g, idx

    @staticmethod
    def payload(*fields: Any) -> bytes:
        return msgspec.msgpack.encode(list(fields))

    def test_a_valid_pick_is_applied(self) -> None:
        g, idx = self.gossip()
        keys = list(range(100, 200))
        sampled = [keys[i] for i in spec_positions(len(keys))]
        assert g.apply([self.payload(1, "peer", "pod-0", sampled)]) == "applied"
        assert idx.match(keys, ["pod-0"])["pod-0"].blocks == 100

    @pytest.mark.parametrize(("frames", "result"), [
        ([b"\x00" * (MAX_BYTES + 1)], "too_large"),
        ([msgspec.msgpack.encode([1, "peer", "pod-0", list(range(MAX_KEYS + 1))])], "too_large"),
        ([b"\xc1not msgpack"], "malformed"),
        ([msgspec.msgpack.encode([2, "peer", "pod-0", [1, 2]])], "malformed"),
        ([msgspec.msgpack.encode([1, "peer", "pod-0", []])], "malformed"),
        ([msgspec.msgpack.encode([1, "peer", "pod-0", ["x"]])], "malformed"),
        ([msgspec.msgpack.encode([1, "peer", "pod-0", [1.5]])], "malformed"),
        ([msgspec.msgpack.encode([1, "peer", "pod-0", [1]]), b"extra"], "malformed"),
        ([], "malformed"),
        ([msgspec.msgpack.encode([1, "me", "pod-0", [1, 2]])], "self"),
        ([msgspec.msgpack.encode([1, "peer", "evil-pod", [1, 2]])], "unknown_pod"),
    ])
    def test_refused_messages_touch_nothing(self, frames: list[bytes], result: str) -> None:
        g, idx = self.gossip()
        assert g.apply(frames) == result
        assert idx.num_speculative == 0

    def test_with_a_secret_every_message_needs_its_tag(self) -> None:
        g, idx = self.gossip(secret=b"s3cret")
        body = self.payload(1, "peer", "pod-0", [1, 2, 3])
        good = hmac.new(b"s3cret", body, hashlib.sha256).digest()
        wrong = hmac.new(b"other", body, hashlib.sha256).digest()
        assert g.apply([body]) == "bad_tag"
        assert g.apply([body, wrong]) == "bad_tag"
        assert g.apply([body, good[:-1]]) == "bad_tag"
        assert idx.num_speculative == 0
        assert g.apply([body, good]) == "applied" and idx.num_speculative == 3

    def test_the_pick_path_never_blocks(self) -> None:
        g, _ = self.gossip()
        g = PickGossip(BlockIndex(), host="127.0.0.1", port=0, peers=(), ttl_s=5.0, known_pod=lambda p: True, queue_size=2)
        for _ in range(5):  # the gossip thread is not running: the queue fills, then picks are dropped and counted
            g.publish("pod-0", [1, 2])
        assert g.out["dropped"] == 3


def test_peer_names_resolve_to_every_address() -> None:
    assert resolve(["127.0.0.1:7100", "localhost:7101", "no-such-host.invalid:7102", "[::1]:7103"]) >= {
        "tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101"}
