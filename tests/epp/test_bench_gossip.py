"""bench.gossip: its arrival patterns, and one short real run between two processes (every pick published is
applied on the peer, each once, with a latency the clocks can vouch for)."""

from __future__ import annotations

import random
import sys

import numpy as np

from bench.gossip import BURST, BURST_GAP_S, Setup, arrivals, missed, run_one


def test_arrival_patterns() -> None:
    burst = arrivals("burst", 2.5 * BURST_GAP_S, 400.0, random.Random(1))
    assert len(burst) == 3 * BURST and burst == sorted(burst)
    assert burst[BURST] == BURST_GAP_S and burst[BURST - 1] < 0.01  # back to back, then the next burst
    poisson = arrivals("poisson", 10.0, 400.0, random.Random(1))
    assert 3600 < len(poisson) < 4400 and all(0 < t < 10.0 for t in poisson)


def test_what_a_decision_missed_is_the_oldest_pick_published_before_it_and_not_applied() -> None:
    published = {1: 0.0, 2: 1.0, 3: 1.5}
    applied = {1: 0.5, 2: 3.0, 3: 1.9}  # 3 applied between two decisions: none missed it
    assert missed(published, applied, [0.2, 0.6, 2.0, 3.5]).tolist() == [200.0, 0.0, 1000.0, 0.0]
    assert missed({1: 0.0}, {}, [1.0]).tolist() == [1000.0]  # never applied


def test_a_short_run_applies_every_pick_on_the_routing_peer() -> None:
    setup = Setup("poisson", 0.4, 200.0, 0.0002, 1, sys.getswitchinterval())
    r = run_one(setup, "busy, pick path", routes=True, pick_path=True)
    assert r.decisions > 40 and len(r.latency_ms) == r.decisions  # run_one raises when a pick is missing
    assert float(np.min(r.latency_ms)) > 0.0 and r.q(0.99) < 1000.0
    assert len(r.stale_ms) > 20 and 0.0 <= r.stale(0.5) <= r.stale(0.99) < 1000.0
    # a decision's open and pick leave together; first tokens and ends ride along or follow in batches
    assert 1.0 <= r.sent_messages / r.decisions <= 3.0
    assert r.publish_s > 0.0 and r.receive_s > 0.0
