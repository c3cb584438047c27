"""The index's hash table against a dict reference model (property-based), and under concurrent writers and
readers.

Model: ``(key, pod) → tier mask``. Random add/remove/clear_pod sequences over a
few pods and keys that include the extremes of the 64-bit range and the values
the table reserves in its pod column (the table keys every 64-bit value), in a
16-slot table so growth, deletions and rebuilds all happen. Invariants: every
entry's tiers, per-pod counts, the entry count, and ``match`` on hole-free
chains (per-tier prefixes nested, as a tail-first LRU leaves them), both by
search and by the verifying walk.
"""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvfleet.cache.tiers import Tier
from kvfleet.epp import probe
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.table import DELETED, EMPTY

PODS = ["a", "b", "c", "d"]
SPECIAL = [0, 1, EMPTY, DELETED, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, (1 << 64) - 2]
keys_st = st.lists(st.one_of(st.sampled_from(SPECIAL), st.integers(min_value=0, max_value=60)), max_size=40)
tier_st = st.sampled_from(list(Tier))
WEIGHTS = [1.0, 0.5, 0.25, 0.125]


class TableMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.idx = BlockIndex(initial_capacity=16)
        self.model: dict[tuple[int, str], int] = {}

    @rule(pod=st.sampled_from(PODS), keys=keys_st, tier=tier_st)
    def add(self, pod: str, keys: list[int], tier: Tier) -> None:
        self.idx.add(pod, keys, tier)
        for k in keys:
            self.model[k, pod] = self.model.get((k, pod), 0) | (1 << tier.rank)

    @rule(pod=st.sampled_from(PODS), keys=keys_st, tier=st.one_of(st.none(), tier_st))
    def remove(self, pod: str, keys: list[int], tier: Tier | None) -> None:
        self.idx.remove(pod, keys, tier)
        for k in keys:
            m = self.model.get((k, pod), 0) & (0 if tier is None else ~(1 << tier.rank))
            if m:
                self.model[k, pod] = m
            else:
                self.model.pop((k, pod), None)

    @rule(pod=st.sampled_from(PODS))
    def clear_pod(self, pod: str) -> None:
        self.idx.clear_pod(pod)
        self.model = {e: m for e, m in self.model.items() if e[1] != pod}

    @rule(data=st.data())
    def chains(self, data: st.DataObject) -> None:
        """Hole-free chains: per pod a prefix, each block's best tier non-decreasing along it."""
        n = data.draw(st.integers(min_value=1, max_value=120))
        base = data.draw(st.integers(min_value=1000, max_value=1 << 40))
        keys = [base + i for i in range(n)]
        expected = {}
        for pod in PODS:
            self.idx.clear_pod(pod)
            self.model = {e: m for e, m in self.model.items() if e[1] != pod}
            cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=n), min_size=4, max_size=4)))
            weighted = 0.0
            for r, tier in enumerate(Tier):
                held = keys[: cuts[r]]
                self.add(pod, held, tier)
                weighted += (cuts[r] - (cuts[r - 1] if r else 0)) * WEIGHTS[r]
            if cuts[-1]:
                expected[pod] = (cuts[-1], weighted)
        for budget in (0, 1 << 20):
            self.idx.exact_walk_blocks = budget
            got = {p: (m.blocks, m.weighted) for p, m in self.idx.match(keys, PODS, WEIGHTS).items()}
            assert got.keys() == expected.keys() and all(
                got[p][0] == expected[p][0] and abs(got[p][1] - expected[p][1]) < 1e-9 for p in got
            ), (budget, got, expected)

    @invariant()
    def agrees(self) -> None:
        assert self.idx.num_entries == len(self.model)
        for pod in PODS:
            assert self.idx.num_pod_keys(pod) == sum(1 for _, p in self.model if p == pod)
        assert sorted(self.idx.pods()) == sorted({p for _, p in self.model})
        for i, k in enumerate(sorted({k for k, _ in self.model} | set(SPECIAL[:3]))):
            for pod in PODS:
                mask = self.model.get((k, pod), 0)
                assert self.idx.pod_tiers(pod, k) == {t for t in Tier if mask & (1 << t.rank)}, (k, pod)
            if i % 8 == 0:
                assert self.idx.match([k], PODS).keys() == {p for p in PODS if (k, p) in self.model}


TestTable = TableMachine.TestCase
TestTable.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=1, max_value=3000), st.integers(min_value=0, max_value=1 << 30))
def test_prefix_of_any_length_is_found(n: int, seed: int) -> None:
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(n)]
    idx = BlockIndex(exact_walk_blocks=0)
    held = rng.randrange(n + 1)
    idx.add("p", keys[:held])
    idx.add("q", keys[: held // 2])
    m = idx.match(keys, ["p", "q"])
    assert m.get("p", None) is None if held == 0 else m["p"].blocks == held
    assert ("q" not in m) if held // 2 == 0 else m["q"].blocks == held // 2


def test_concurrent_writers_and_readers() -> None:
    """Writer threads (one per pod, as ingestion applies each pod in order) grow and rebuild the table while
    readers match and look up: no exception, readers only see prefixes that were stored, and the final state
    is exact."""
    idx = BlockIndex(initial_capacity=16, exact_walk_blocks=64)
    chains = {f"p{i}": [(i << 40) + j for j in range(400)] for i in range(4)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(pod: str) -> None:
        try:
            keys = chains[pod]
            for rnd in range(6):
                for j in range(0, 400, 25):
                    idx.add(pod, keys[j : j + 25], Tier.GPU)
                idx.add(pod, keys[:100], Tier.CPU)
                if rnd < 5:
                    idx.remove(pod, keys[200:][::-1], None)  # tail first, as vLLM evicts
                    idx.remove(pod, keys[:100], Tier.CPU)
                    if rnd % 2:
                        idx.clear_pod(pod)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                for pod, keys in chains.items():
                    m = idx.match(keys, list(chains), [1.0, 0.5, 0.0, 0.0])
                    assert all(x.blocks <= 400 and x.weighted <= x.blocks for x in m.values())
                    idx.pod_tiers(pod, keys[0])
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(p,)) for p in chains]
    # each compiled call releases the GIL; a writer waiting to take it back behind two spinning readers waited
    # the default switch interval (5 ms) each time: the writers took 40-60 s and, past the join's timeout,
    # the checks below read a half-written index. A short interval keeps the interleaving and the pace.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        for t in readers + writers:
            t.start()
        for t in writers:
            t.join(120)
        stop.set()
        for t in readers:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not [t for t in readers + writers if t.is_alive()], "threads still running after 120 s"
    assert not errors, errors
    assert idx.num_entries == 4 * 400 and sorted(idx.pods()) == sorted(chains)
    for pod, keys in chains.items():
        m = idx.match(keys, [pod], [1.0, 0.5, 0.0, 0.0])[pod]
        assert (m.blocks, m.weighted) == (400, 400.0)  # the CPU copies of blocks 0..99 are also in GPU
        assert idx.pod_tiers(pod, keys[0]) == {Tier.GPU, Tier.CPU} and idx.num_pod_keys(pod) == 400


def test_the_compiled_probes_take_only_arrays_they_can_address() -> None:
    """A table's addresses are read once: the arrays must be contiguous, writable and of one length, or
    :func:`kvfleet.epp.probe.table` refuses them (a copy's address would go stale)."""
    keys, pods = np.zeros(16, dtype=np.uint64), np.full(16, EMPTY, dtype=np.uint16)
    mask = np.zeros(16, dtype=np.uint8)
    mix = np.zeros(1 << 16, dtype=np.uint64)
    t = probe.table(keys, pods, mask, mix, 60)
    assert (t.wrap, t.shift) == (15, 60)
    with pytest.raises(ValueError):
        probe.table(np.zeros(32, dtype=np.uint64)[::2], pods, mask, mix, 60)
    with pytest.raises(ValueError):
        probe.table(keys, pods[:8], mask, mix, 60)
    frozen = keys.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        probe.table(frozen, pods, mask, mix, 60)
