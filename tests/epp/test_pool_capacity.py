"""Level 1 weighs pools and prefix shards by capacity (``kvfleet.epp.scheduling.pools``).

Covers: capacity = the prompt-computing pods (both/prefill; decode pods only in a pool without them) × their
GPU KV blocks when every pod states them, else their number; ``pool.weight`` multiplies it; rendezvous shares
follow it; ``kv_blocks`` from the pods file (validated) and the ``kvfleet.io/kv-blocks`` pod annotation;
the demo's default topology (a unified shard of two pods, a P/D shard of one prefill and one decode pod)
gets 2/3 and 1/3 of the prefixes through the router, where equal weights gave half each.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.config import load
from kvfleet.demo.stack import plan_pods, pods_file
from kvfleet.epp.datastore import Pod, Pool, StaticDatastore, pools_from_dict
from kvfleet.epp.errors import DatastoreError
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.kube import pools_from_objects
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.scheduling import rendezvous_rank
from kvfleet.epp.scheduling.pools import capacity, weights
from kvfleet.epp.tokenize import load_tokenizer


def pool(name: str, roles: list[str], blocks: int | None = None, weight: float = 1.0) -> Pool:
    pods = tuple(Pod(name=f"{name}-{i}", role=r, kv_blocks=blocks) for i, r in enumerate(roles))
    return Pool(name=name, weight=weight, pods=pods)


def share(pools: list[Pool], name: str, n: int = 6000) -> float:
    return sum(rendezvous_rank(k * 7919 + 3, pools)[0].name == name for k in range(n)) / n


def test_capacity_counts_the_pods_that_compute_prompts() -> None:
    assert capacity(pool("u", ["both", "both"], 8192)) == 2 * 8192
    assert capacity(pool("pd", ["prefill", "decode", "decode"], 8192)) == 8192  # decode pods add nothing
    assert capacity(pool("d", ["decode", "decode"], 100)) == 200  # no prefill pod: the decode pods compute
    assert capacity(pool("n", ["both", "prefill"])) == 2.0  # blocks unknown: pods
    assert capacity(Pool(name="empty")) == 1.0  # pods not known yet: the weight alone


def test_weights_use_blocks_only_when_every_pod_states_them() -> None:
    big, small = pool("big", ["both"], 16384), pool("small", ["both", "both"], 4096)
    assert weights([big, small]) == [16384.0, 8192.0]
    # one pool without blocks: pods everywhere
    assert weights([big, pool("unknown", ["both", "both"])]) == [1.0, 2.0]
    assert weights([pool("w", ["both"], 10, weight=3.0)]) == [30.0]


def test_rendezvous_shares_follow_capacity() -> None:
    unified, pd = pool("unified", ["both", "both"], 8192), pool("pd", ["prefill", "decode"], 8192)
    assert 0.30 < share([unified, pd], "pd") < 0.37
    assert 0.46 < share([pool("a", ["both"], 4096), pool("b", ["both"], 4096)], "b") < 0.54
    assert 0.72 < share([pool("a", ["both"], 4096), pool("b", ["both"], 12288)], "b") < 0.78
    assert 0.72 < share([pool("a", ["both"]), pool("b", ["both"], weight=3.0)], "b") < 0.78


def test_kv_blocks_from_the_pods_file_and_kubernetes() -> None:
    data: dict[str, Any] = {"pools": [{"name": "p",
                                       "pods": [{"name": "a", "address": "h", "port": 1, "kv_blocks": 512},
                                                {"name": "b", "address": "h", "port": 2}]}]}
    (p,) = pools_from_dict(data)
    assert [q.kv_blocks for q in p.pods] == [512, None]
    data["pools"][0]["pods"][1]["kv_blocks"] = 0
    with pytest.raises(DatastoreError, match=r"kv_blocks must be > 0"):
        pools_from_dict(data)
    ip = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
          "metadata": {"name": "llm", "namespace": "ns"},
          "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]}}

    def kpod(name: str, blocks: str | None) -> dict[str, Any]:
        ann = {} if blocks is None else {"kvfleet.io/kv-blocks": blocks}
        return {"metadata": {"name": name, "namespace": "ns", "labels": {"app": "llm"}, "annotations": ann},
                "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}

    (kp,) = pools_from_objects([ip], [kpod("a", "8192"), kpod("b", "nonsense"), kpod("c", None)])
    assert {q.name: q.kv_blocks for q in kp.pods} == {"a": 8192, "b": None, "c": None}


def test_the_demo_topology_shards_by_capacity() -> None:
    """The demo's pods file states each engine's GPU blocks, so the router's level 1 sends two thirds of the
    prefixes to the two-pod unified shard and one third to the P/D shard (one prefill pod)."""
    specs = plan_pods(4, 2, 1)
    data = pods_file(specs, "m", kv_blocks=8192)
    assert all(p["kv_blocks"] == 8192 for p in data["pools"][0]["pods"])
    assert "kv_blocks" not in pods_file(specs, "m")["pools"][0]["pods"][0]
    s = load(overrides={"epp": {"pool_saturation_queue": 1e9,
                                "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}]}})
    r = Router(s.epp, s.cache, StaticDatastore(data=data), BlockIndex(), MetricsStore(),
               load_tokenizer("bytes"))
    shards = [r.route(InferenceRequest(model="m", prompt=f"{i:08d} conversation opening " * 4)).shard
              for i in range(900)]
    assert 0.28 < shards.count("pool-b") / len(shards) < 0.39, shards.count("pool-b")
