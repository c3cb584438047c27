"""Fixtures: a Kubernetes API emulator (kmock) serving our resources, and the real
kopf runtime running the kvfleet operator's handlers against it.

kmock stores and watches objects and merges patches; it does not assign uid,
resourceVersion, generation or creationTimestamp, run admission, garbage-collect
owned objects, or filter by label selector. :class:`Emulator` fills the metadata
(generation bumps when a patch touches ``spec``, as the API server does), so
owner references and kopf's change detection work; tests never depend on GC or
selectors.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest

from kvfleet.config import Settings
from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.handlers import Runtime, build_registry
from kvfleet.operator.kube import ApiClient
from tests.kmockapi import Emulator, serve

RESOURCES: dict[str, kmock.ResourceInfo] = {
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"get", "list", "watch", "create"}),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True, verbs={"get", "list", "create", "delete"}),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"get", "list", "create", "patch"}),
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"}),
    "kvfleet.io/v1alpha1/kvcachepools": kmock.ResourceInfo(
        kind="KVCachePool", singular="kvcachepool", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
    "inference.networking.k8s.io/v1/inferencepools": kmock.ResourceInfo(
        kind="InferencePool", singular="inferencepool", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
}


@pytest.fixture()
async def k8s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Emulator]:
    """The API emulator on a free loopback port, with a kubeconfig pointing at it."""
    async with serve(RESOURCES, tmp_path, monkeypatch) as (emulator, _):
        client = ApiClient(kopf.ConnectionInfo(server=emulator.api_url, token="test"))
        try:  # the Secrets the samples reference: the chart's transfer secret and the remote tier's Redis URL
            for name, key in (("kvfleet-transfer", "secret"), ("kv-redis", "url")):
                await client.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "default"},
                                     "data": {key: "c2VjcmV0"}})
        finally:
            await client.close()
        yield emulator


@pytest.fixture()
async def api(k8s: Emulator) -> AsyncIterator[ApiClient]:
    """A client for the test itself (same code as the operator's)."""
    client = ApiClient(kopf.ConnectionInfo(server=k8s.api_url, token="test"))
    yield client
    await client.close()


@pytest.fixture()
def settings() -> Settings:
    return Settings(operator=OperatorSettings(status_interval_s=0.3, retry_backoff_s=0.5))


@contextlib.asynccontextmanager
async def running_operator(settings: Settings) -> AsyncIterator[Runtime]:
    """The real kopf runtime running kvfleet's registry for the body of the ``async with``; fails loudly if it dies.

    kopf runs in its own thread and event loop (as ``kvfleet operator`` runs in
    its own process): on stop it cancels every task of its loop that it did not
    start with, which must not include the test's own tasks or the API emulator.
    """
    rt = Runtime(settings=settings, namespace="kvfleet-system")
    registry = build_registry(rt)
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready))
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="kopf", daemon=True)
    thread.start()
    if not await asyncio.to_thread(ready.wait, 20):
        stop.set()
        pytest.fail(f"kopf did not become ready: {errors!r}")
    try:
        yield rt
    finally:
        alive_during_test = thread.is_alive()
        stop.set()
        await asyncio.to_thread(thread.join, 15)
    if thread.is_alive():
        pytest.fail("kopf did not stop within 15 s")
    if not alive_during_test or errors:
        pytest.fail(f"kopf died during the test: {errors!r}")


@pytest.fixture()
async def operator(k8s: Emulator, settings: Settings) -> AsyncIterator[Runtime]:
    """The operator running against the emulator for the whole test (see :func:`running_operator`)."""
    async with running_operator(settings) as rt:
        yield rt


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 15.0, interval: float = 0.1) -> Any:
    """Poll ``check`` until it returns a truthy value; fail with the last value/exception on timeout."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        try:
            last = await check()
            if last:
                return last
        except AssertionError as exc:
            last = exc
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s; last: {last!r}")
        await asyncio.sleep(interval)
