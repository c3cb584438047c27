"""The Kubernetes datastore against a Kubernetes API emulator (kmock): list, then watch Pods and InferencePools.

kmock serves list/watch/create/delete; ``tests/kmockapi.py`` adds the
resourceVersion it does not assign (as the API server would). Label selectors are not needed: the
datastore filters pods by the pool's matchLabels itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest

from kvfleet.epp.kube import KubernetesDatastore
from tests.kmockapi import serve

RESOURCES = {
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "inference.networking.k8s.io/v1/inferencepools": kmock.ResourceInfo(
        kind="InferencePool", singular="inferencepool", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
}


@pytest.fixture
async def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    async with serve(RESOURCES, tmp_path, monkeypatch, namespace="ns") as (_, path):
        yield path


def pod(name: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "llm"}},
        "spec": {"containers": [{"name": "engine", "image": "kvfleet"}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


async def eventually(pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "datastore did not follow the API"
        await asyncio.sleep(0.05)


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
    await asyncio.to_thread(custom.create_namespaced_custom_object, "inference.networking.k8s.io", "v1", "ns", "inferencepools", pool)
    await asyncio.to_thread(core.create_namespaced_pod, "ns", pod("a", "10.0.0.1"))  # type: ignore[arg-type]
    ds = await asyncio.to_thread(KubernetesDatastore, "ns", 0.2, api)
    try:
        await eventually(lambda: bool(ds.pools()) and [p.name for p in ds.pools()[0].pods] == ["a"])
        assert ds.pools()[0].models == ("m",) and ds.pools()[0].pods[0].endpoint == "10.0.0.1:8000"
        await asyncio.to_thread(core.create_namespaced_pod, "ns", pod("b", "10.0.0.2"))  # type: ignore[arg-type]
        await eventually(lambda: [p.name for p in ds.pools()[0].pods] == ["a", "b"])
        await asyncio.to_thread(core.delete_namespaced_pod, "a", "ns")
        await eventually(lambda: [p.name for p in ds.pools()[0].pods] == ["b"])
    finally:
        ds.stop()
