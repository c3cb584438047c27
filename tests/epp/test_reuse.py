"""The per-pod reuse distance (kvfleet/epp/reuse.py, _reuse.c): LRU stack distance in distinct blocks, its
memory bound, the survival rule, and how the index and the candidates use it."""

from __future__ import annotations

import random

import pytest

from kvfleet.cache.tiers import Tier
from kvfleet.epp.datastore import Pod
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore, PodMetrics, gpu_capacity
from kvfleet.epp.reuse import ReuseTracker, _weights
from kvfleet.epp.scheduling.candidates import CandidateBuilder
from kvfleet.epp.speculative import spec_positions


def lru_distance(sends: list[tuple[int, int]], key: int) -> int:
    """The definition: blocks of the distinct keys sent after ``key``'s last send (−1: never sent)."""
    last = max((i for i, (k, _) in enumerate(sends) if k == key), default=-1)
    if last < 0:
        return -1
    latest: dict[int, int] = {}
    for k, w in sends[last + 1:]:
        latest[k] = w
    latest.pop(key, None)
    return sum(latest.values())


def test_distance_counts_distinct_blocks_not_sends() -> None:
    t = ReuseTracker(64)
    t.touch("a", [1, 2, 3])  # a 3-block prompt: each key one block
    for _ in range(10):  # a prefix sent again and again pushes nothing out
        t.touch("a", [7, 8])
    assert t.distance("a", [3, 2, 1, 8, 9]) == [2, 3, 4, 0, -1]
    assert t.distance("b", [1]) == [-1]
    assert t.live_blocks("a") == 5


def test_distance_matches_the_definition_on_random_sends() -> None:
    rng = random.Random(3)
    t, sends = ReuseTracker(10_000), []
    for _ in range(600):
        keys = [rng.randrange(40) for _ in range(rng.randrange(1, 5))]
        t.touch("p", keys)
        sends += [(k, 1) for k in keys]
    keys = list(range(45))
    assert t.distance("p", keys) == [lru_distance(sends, k) for k in keys]


def test_memory_is_bounded_and_the_newest_sends_are_kept() -> None:
    t = ReuseTracker(8)
    t.touch("a", [0])
    size = t.memory_bytes
    for k in range(1, 1000):
        t.touch("a", [k])
    assert t.memory_bytes == size  # one fixed buffer per pod
    assert t.forgotten() > 900
    d = t.distance("a", list(range(990, 1000)))
    assert d[-8:] == list(range(7, -1, -1))  # the newest sends, exact
    assert t.distance("a", [0, 500]) == [-1, -1]  # forgotten: unknown, not far


def test_a_pick_weighs_the_blocks_its_sampled_keys_stand_for() -> None:
    n = 200
    pos = list(spec_positions(n))
    w = _weights(len(pos), n)
    assert sum(w) == n and all(x > 0 for x in w)
    assert w == [p - q for p, q in zip(pos, [-1, *pos[:-1]], strict=True)]
    # a peer that did not send the length: the last key weighs up to its grid spacing
    assert sum(_weights(len(pos))) >= n


def test_fit_keeps_the_longest_prefix_that_survives() -> None:
    t = ReuseTracker(1024)
    keys = list(range(100, 140))  # a 40-block prompt, every position sampled
    t.touch("a", keys, 40)
    t.touch("a", list(range(1000, 1030)), 30)  # 30 other blocks sent since
    # key at position p has 30 + (39 − p) blocks sent after it; it survives while that + p + 1 ≤ capacity
    assert t.fit(["a"], [40], [100], keys) == [40]  # 30 + 40 fits
    assert t.fit(["a"], [40], [65], keys) == [0]  # 30 + 39 − p + p + 1 = 70 > 65 for every p
    t.touch("a", keys[:10], 10)  # the first 10 blocks sent again: now at the top
    assert t.fit(["a"], [40], [65], keys) == [10]  # the re-sent head survives, the tail does not
    # the boundaries: the tail's last block has 40 blocks sent after it, the head's 0 to 9
    assert t.fit(["a", "a"], [40, 40], [80, 79], keys) == [40, 10]
    assert t.fit(["a", "a"], [40, 40], [10, 9], keys) == [10, 0]
    assert t.fit(["a", "b"], [40, 40], [0, 10], keys) == [40, 40]  # unknown capacity, unknown pod
    assert t.shortened == 5


def test_the_index_feeds_the_sketch_and_forgets_a_cleared_pod() -> None:
    idx = BlockIndex(reuse_entries=256)
    keys = list(range(50, 80))
    idx.add_speculative("p", keys, 10.0)
    assert idx.reuse.distance("p", [keys[-1], keys[0]]) == [0, 29]
    idx.add_speculative_sampled("p", [9, 10], 10.0, blocks=2)  # a peer's pick
    assert idx.reuse.distance("p", [keys[-1]]) == [2]
    idx.clear_pod("p", picks=False)  # a resubscription: the picks (and what they sent) stay
    assert idx.reuse.distance("p", [keys[-1]]) == [2]
    idx.clear_pod("p")  # AllBlocksCleared: nothing sent before is cached any more
    assert idx.reuse.distance("p", [keys[-1]]) == [-1]
    assert BlockIndex(reuse_entries=0).reuse.fit(["p"], [5], [1], keys) == [5]


@pytest.mark.parametrize("cap_blocks, expect", [(1000, 30), (40, 0)])
def test_candidates_credit_only_what_survives(cap_blocks: int, expect: int) -> None:
    idx = BlockIndex()
    prompt = list(range(30))
    idx.add_speculative("p", prompt, 10.0)
    idx.add_speculative("p", list(range(100, 130)), 10.0)  # another 30 blocks queued behind it
    metrics = MetricsStore(clock=lambda: 0.0)
    metrics.put("p", PodMetrics(waiting=0, running=0, kv_usage=0.5, block_size=16, num_gpu_blocks=cap_blocks))
    b = CandidateBuilder(idx, InflightTracker(), metrics, [1.0, 1.0, 1.0, 1.0])
    (c,), _ = b.build([Pod("p", "10.0.0.1", 8000)], prompt, 0, block_size=16)
    assert c.hit_blocks == expect
    assert c.hit_weighted == pytest.approx(float(expect))
    assert gpu_capacity(metrics.get("p"), 32) == cap_blocks // 2
    assert gpu_capacity(None, 16) is None


def test_a_pod_with_lower_tiers_keeps_what_its_gpu_demotes() -> None:
    """Blocks a full GPU pushes out of a pod with a CPU tier move there and still hit: once the index holds
    blocks of the pod off the GPU, the sketch's GPU bound no longer cuts its held prefix."""
    idx = BlockIndex()
    prompt = list(range(30))
    idx.add("p", prompt)
    idx.add_speculative("p", prompt, 10.0)
    idx.add_speculative("p", list(range(100, 130)), 10.0)  # 30 blocks queued behind it on a 40-block GPU
    metrics = MetricsStore(clock=lambda: 0.0)
    metrics.put("p", PodMetrics(waiting=0, running=0, kv_usage=0.5, block_size=16, num_gpu_blocks=40))
    b = CandidateBuilder(idx, InflightTracker(), metrics, [1.0, 0.9, 0.5, 0.2])
    pod = [Pod("p", "10.0.0.1", 8000)]
    assert b.build(pod, prompt, 0, block_size=16)[0][0].hit_blocks == 0  # GPU only: pushed out, cut
    idx.add("p", [500, 501], Tier.CPU)  # the pod demotes to a CPU tier
    (c,), _ = b.build(pod, prompt, 0, block_size=16)
    assert c.hit_blocks == 30 and c.hit_weighted == pytest.approx(30.0)
