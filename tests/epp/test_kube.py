"""The Kubernetes datastore: the pure mapping, and against a Kubernetes API emulator (kmock): list, then watch
Pods and InferencePools.

kmock serves list/watch/create/delete; ``tests/kmockapi.py`` adds the
resourceVersion it does not assign (as the API server would). Label selectors are not needed: the
datastore filters pods by the pool's matchLabels itself.

Covers: pods carry their prefix shard (label ``kvfleet.io/shard``); an
InferencePool without ``endpointPickerRef`` (optional since GIE v1.6, e.g. the
upstream conformance example) is taken as a pool when the EPP has no Service
name and is not ours when it has one, as are pools naming another picker or
another kind of picker; the watch follows pools and pods as they come and go.
"""

from __future__ import annotations

import asyncio
import copy
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from kvfleet.epp.kube import KubernetesDatastore, pools_from_objects
from tests.conftest import eventually
from tests.kmockapi import serve

GIE_NO_REF = (Path(__file__).parents[1]
              / "operator/data/gie-v1.6.0/conformance/tests/inferencepool_missing_epp_ref.yaml")

RESOURCES = {
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True,
                                  verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "inference.networking.k8s.io/v1/inferencepools": kmock.ResourceInfo(
        kind="InferencePool", singular="inferencepool", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
}


@pytest.fixture
async def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    async with serve(RESOURCES, tmp_path, monkeypatch, namespace="ns") as (_, path):
        yield path


def pod(name: str, ip: str, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "llm", **(labels or {})}},
        "spec": {"containers": [{"name": "engine", "image": "kvfleet"}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


async def test_pools_follow_the_api(kubeconfig: Path) -> None:
    """Pools appear from InferencePools, pods join and leave as they are created and deleted."""
    from kubernetes import client, config

    config.load_kube_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    api = client.ApiClient()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "llm", "namespace": "ns", "annotations": {"kvfleet.io/models": "m"}},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]},
    }
    await asyncio.to_thread(custom.create_namespaced_custom_object, "inference.networking.k8s.io", "v1", "ns",
                            "inferencepools", pool)
    await asyncio.to_thread(core.create_namespaced_pod, "ns", pod("a", "10.0.0.1"))  # type: ignore[arg-type]
    ds = await asyncio.to_thread(KubernetesDatastore, "ns", 0.2, api)
    try:
        await eventually(lambda: bool(ds.pools()) and [p.name for p in ds.pools()[0].pods] == ["a"],
                         "the pool with pod a")
        await eventually(ds.has_synced, "the datastore's first lists")
        assert ds.pools()[0].models == ("m",) and ds.pools()[0].pods[0].endpoint == "10.0.0.1:8000"
        await asyncio.to_thread(core.create_namespaced_pod, "ns", pod("b", "10.0.0.2"))  # type: ignore[arg-type]
        await eventually(lambda: [p.name for p in ds.pools()[0].pods] == ["a", "b"], "pod b joining")
        await asyncio.to_thread(core.delete_namespaced_pod, "a", "ns")
        await eventually(lambda: [p.name for p in ds.pools()[0].pods] == ["b"], "pod a leaving")
    finally:
        ds.stop()


async def test_not_synced_until_both_lists_are_in() -> None:
    """With the API server unreachable the datastore never reports synced (the picker stays NOT_SERVING)."""
    from kubernetes import client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cfg = client.Configuration(host=f"http://127.0.0.1:{dead}")
    cfg.retries = 0
    ds = await asyncio.to_thread(KubernetesDatastore, "ns", 0.1, client.ApiClient(cfg))
    try:
        await asyncio.sleep(1.0)  # a time gap: several failed lists (back-off 0.1 s)
        assert not ds.has_synced() and ds.pools() == ()
    finally:
        ds.stop()


def inference_pool(name: str, ref: dict[str, Any] | None = None, app: str = "llm") -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": app}}, "targetPorts": [{"number": 8000}]}
    if ref is not None:
        spec["endpointPickerRef"] = ref
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "ns"}, "spec": spec}


OURS = {"name": "kvfleet-epp", "port": {"number": 9002}}


def test_pods_carry_their_shard() -> None:
    """Label kvfleet.io/shard becomes Pod.shard; without it the pod is in the pool's only shard ("")."""
    pods = [pod("a", "10.0.0.1", labels={"kvfleet.io/shard": "0"}),
            pod("b", "10.0.0.2", labels={"kvfleet.io/shard": "1"}), pod("c", "10.0.0.3")]
    (pool,) = pools_from_objects([inference_pool("llm", OURS)], pods, epp_service="kvfleet-epp")
    assert {p.name: p.shard for p in pool.pods} == {"a": "0", "b": "1", "c": ""}
    assert {p.pool for p in pool.pods} == {"llm"}  # shards are pod subsets of the one pool


def test_pools_without_endpoint_picker_ref() -> None:
    """GIE v1.6's example pool without endpointPickerRef: a pool for an EPP with no Service name, not ours for
    one with a name."""
    (upstream,) = [d for d in yaml.safe_load_all(GIE_NO_REF.read_text()) if d["kind"] == "InferencePool"]
    upstream = copy.deepcopy(upstream)
    upstream["metadata"]["namespace"] = "ns"
    pods = [pod("a", "10.0.0.1", labels={"app": upstream["spec"]["selector"]["matchLabels"]["app"]})]
    (pool,) = pools_from_objects([upstream], pods)
    assert pool.name == "pool-with-missing-epp-ref" and [p.endpoint for p in pool.pods] == ["10.0.0.1:3000"]
    assert pools_from_objects([upstream], pods, epp_service="kvfleet-epp") == []


def test_only_pools_naming_this_picker_are_ours() -> None:
    """With a Service name: the pool naming it (kind Service, core group, defaults or explicit) is kept;
    others are skipped."""
    pools = [
        inference_pool("ours", OURS),
        inference_pool("explicit", {**OURS, "kind": "Service", "group": ""}),
        inference_pool("none"),
        inference_pool("other", {"name": "other-epp", "port": {"number": 9002}}),
        inference_pool("backend", {"name": "kvfleet-epp", "kind": "Backend", "group": "x.example.com"}),
    ]
    assert [p.name for p in pools_from_objects(pools, [], epp_service="kvfleet-epp")] == ["ours", "explicit"]
    assert [p.name for p in pools_from_objects(pools, [])] == ["ours", "explicit", "none", "other", "backend"]


def test_odd_target_ports_fall_back_to_8000() -> None:
    """A pool whose targetPorts is missing or malformed still maps (port 8000) rather than failing the
    rebuild."""
    for ports in (None, [], ["x"], [{"number": "nan"}]):
        ip = inference_pool("p")
        ip["spec"]["targetPorts"] = ports
        (pool,) = pools_from_objects([ip], [pod("a", "10.0.0.1")])
        assert pool.pods[0].port == 8000


async def test_watch_keeps_only_this_pickers_pools(kubeconfig: Path) -> None:
    """An EPP with a Service name watching a namespace with a pool without endpointPickerRef: only its own
    pool, pods with shards."""
    from kubernetes import client, config

    config.load_kube_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    api = client.ApiClient()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    for ip in (inference_pool("theirs", None), inference_pool("ours", OURS)):
        await asyncio.to_thread(custom.create_namespaced_custom_object, "inference.networking.k8s.io", "v1",
                                "ns", "inferencepools", ip)
    await asyncio.to_thread(core.create_namespaced_pod, "ns",
                            pod("a", "10.0.0.1", labels={"kvfleet.io/shard": "1"}))  # type: ignore[arg-type]
    ds = await asyncio.to_thread(KubernetesDatastore, "ns", 0.2, api, "kvfleet-epp")
    try:
        await eventually(lambda: [(p.name, [(x.name, x.shard) for x in p.pods]) for p in ds.pools()]
                         == [("ours", [("a", "1")])],
                         "only our pool, with pod a of shard 1")
        await asyncio.to_thread(custom.delete_namespaced_custom_object, "inference.networking.k8s.io", "v1",
                                "ns", "inferencepools", "ours")
        await eventually(lambda: not ds.pools(), "no pool left")
    finally:
        ds.stop()
