"""A Kubernetes API for tests: kmock's emulator on a free loopback port, with a kubeconfig.

kmock stores and watches objects and merges patches; it does not assign uid,
resourceVersion, generation or creationTimestamp, run admission, garbage-collect
owned objects, or filter by label selector; server-side apply is approximated (an absent
object is created, a present one merged). :class:`Emulator` fills the metadata
(generation bumps when a patch touches ``spec``, as the API server does), so
owner references, watches from a resourceVersion and kopf's change detection
work; tests never depend on GC or selectors. Used by the operator and the EPP's
Kubernetes datastore tests.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import kmock
import pytest
import yaml
from kmock._internal import enums

#: The resources the operator reads and writes (kmock serves only what it is told).
OPERATOR_RESOURCES: dict[str, kmock.ResourceInfo] = {
    "v1/namespaces": kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"get", "list", "watch", "create"},
    ),
    "v1/pods": kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "v1/configmaps": kmock.ResourceInfo(
        kind="ConfigMap", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "v1/secrets": kmock.ResourceInfo(
        kind="Secret", namespaced=True, verbs={"get", "list", "create", "delete"},
    ),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"get", "list", "create", "patch"}),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
    "kvfleet.io/v1alpha1/kvcachepools": kmock.ResourceInfo(
        kind="KVCachePool", singular="kvcachepool", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
    "inference.networking.k8s.io/v1/inferencepools": kmock.ResourceInfo(
        kind="InferencePool", singular="inferencepool", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
}


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the metadata the real API server assigns."""

    _versions = itertools.count(1)
    api_url = ""

    async def _handle(self, request: kmock.Request) -> Any:
        if (request.action == enums.action.UPDATE and "apply-patch" in request.headers.get("Content-Type", "")
                and request.name is not None and request.resource is not None):
            # server-side apply of an absent object creates it; of a present one it merges (one field
            # manager's approximation: fields the apply drops are not removed, as the real server does)
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                request = attrs.evolve(request, action=enums.action.CREATE)
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                if "name" not in meta and "generateName" in meta:
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp",
                                datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                if request.namespace and "namespace" not in meta:
                    meta["namespace"] = request.namespace
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == enums.action.UPDATE and request.name is not None:
                meta["resourceVersion"] = str(next(self._versions))
                key = (request.resource, request.namespace, request.name)
                if ("spec" in request.data and request.subresource is None and key in self.objects
                        and not self.objects[key].deleted):
                    live = self.objects[key]
                    meta["generation"] = int((live.get("metadata") or {}).get("generation") or 1) + 1
        return await super()._handle(request)


@contextlib.asynccontextmanager
async def serve(
    resources: Mapping[str, kmock.ResourceInfo], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    namespace: str = "default",
) -> AsyncIterator[tuple[Emulator, Path]]:
    """Serve ``resources`` and point ``$KUBECONFIG`` at the emulator; yields it and the kubeconfig path."""
    emulator = Emulator()
    for key, info in resources.items():
        emulator.resources[key] = info
    async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        emulator.api_url = str(server.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": emulator.api_url}}],
            "users": [{"name": "kmock", "user": {"token": "test"}}],
            "contexts": [{"name": "kmock",
                          "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}],
        }))  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield emulator, kubeconfig
