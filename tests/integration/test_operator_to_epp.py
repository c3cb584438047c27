"""The operator's objects, as the EPP's Kubernetes datastore reads them.

Covers the seam between two roles that never import each other: the
InferencePool and pod template the operator renders for a KVCachePool, turned
into running Pods (an IP and a Ready condition added, as the kubelet would), must
give the EPP one pool per KVCachePool that serves the pool's model and holds the
pods of every prefix shard, each pod with its shard, at the engine's serving
port, with its role (prefill / decode / both), its KV-event and replay endpoints
and its metrics URL; an EPP told its Service name keeps only the pools whose
endpointPickerRef names it.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from kvfleet.config import Settings, from_dict
from kvfleet.epp.kube import pools_from_objects
from kvfleet.operator.manifests import render_children
from kvfleet.operator.spec import parse_spec
from tests.operator import samples


def _running_pods(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = []
    n = 0
    for obj in children:
        if obj["kind"] != "Deployment":
            continue
        for _ in range(obj["spec"]["replicas"]):
            n += 1
            tmpl = copy.deepcopy(obj["spec"]["template"])
            meta = tmpl["metadata"]
            meta["name"] = f"{obj['metadata']['name']}-{n}"
            meta["namespace"] = obj["metadata"]["namespace"]
            pods.append({
                "metadata": meta,
                "spec": tmpl["spec"],
                "status": {"podIP": f"10.0.0.{n}", "conditions": [{"type": "Ready", "status": "True"}]},
            })  # fmt: skip
    return pods


def _engine_settings(children: list[dict[str, Any]], role: str) -> Settings:
    for obj in children:
        if obj["kind"] == "ConfigMap":
            for key, text in obj["data"].items():
                if key.endswith(".yaml") and role in key:
                    return from_dict(Settings, yaml.safe_load(text))
    raise AssertionError(f"no config for role {role}")


def test_epp_sees_the_operators_pools_and_pods() -> None:
    obj = copy.deepcopy(samples.SIM_PD)
    obj["metadata"]["uid"] = "uid-1"
    spec = parse_spec(obj["spec"], obj["metadata"]["name"])
    children = render_children(obj, spec, Settings())
    pools = [c for c in children if c["kind"] == "InferencePool"]
    assert pools
    base = Settings()
    seen = pools_from_objects(pools, _running_pods(children), epp_service=base.operator.epp_service)
    assert len(seen) == len(pools) == 1
    assert pools_from_objects(pools, _running_pods(children), epp_service="another-picker") == []
    for pool in seen:
        assert pool.name == obj["metadata"]["name"]
        assert pool.models == (spec.model.name,)
        roles = sorted(p.role for p in pool.pods)
        assert roles == ["decode", "prefill"], roles
        for pod in pool.pods:
            assert pod.shard == "0" and pod.pool == pool.name
            assert pod.ready and pod.address.startswith("10.0.0.")
            engine = _engine_settings(children, pod.role)
            assert pod.port == engine.engine.port
            assert pod.events == f"tcp://{pod.address}:{engine.engine.kv_events_port}"
            assert pod.replay == f"tcp://{pod.address}:{engine.engine.kv_events_replay_port}"
            assert pod.metrics is not None and pod.metrics.endswith("/metrics")


def test_unified_pods_serve_both_roles() -> None:
    obj = copy.deepcopy(samples.MINIMAL)
    obj["metadata"]["uid"] = "uid-2"
    spec = parse_spec(obj["spec"], obj["metadata"]["name"])
    children = render_children(obj, spec, Settings())
    seen = pools_from_objects([c for c in children if c["kind"] == "InferencePool"], _running_pods(children))
    assert seen and all(p.role == "both" for pool in seen for p in pool.pods)


def test_every_shard_is_a_pod_subset_of_the_one_pool() -> None:
    """pools: 3 → one EPP pool holding every shard's pods, each pod carrying the shard of the Deployment it
    came from."""
    obj = samples.kvcachepool(name="sharded", pools=3, roles={"unified": {"replicas": 2}})
    obj["metadata"]["uid"] = "uid-3"
    spec = parse_spec(obj["spec"], obj["metadata"]["name"])
    children = render_children(obj, spec, Settings())
    (pool,) = pools_from_objects([c for c in children if c["kind"] == "InferencePool"],
                                 _running_pods(children), epp_service=Settings().operator.epp_service)
    assert pool.name == "sharded" and len(pool.pods) == 6
    for pod in pool.pods:
        deployment = pod.name.rsplit("-", 1)[0]  # <pool>-p<i>-<role>-<n> → <pool>-p<i>-<role>
        assert deployment == f"sharded-p{pod.shard}-unified"
    assert sorted({p.shard for p in pool.pods}) == ["0", "1", "2"]
