"""A Kubernetes API for tests: kmock's emulator on a free loopback port, with a kubeconfig.

kmock stores and watches objects and merges patches; it does not assign uid,
resourceVersion, generation or creationTimestamp, run admission, garbage-collect
owned objects, or filter by label selector. :class:`Emulator` fills the metadata
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

import kmock
import pytest
import yaml
from kmock._internal import enums


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the metadata the real API server assigns."""

    _versions = itertools.count(1)
    api_url = ""

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                if "name" not in meta and "generateName" in meta:
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                if request.namespace and "namespace" not in meta:
                    meta["namespace"] = request.namespace
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == enums.action.UPDATE and request.name is not None:
                meta["resourceVersion"] = str(next(self._versions))
                key = (request.resource, request.namespace, request.name)
                if "spec" in request.data and request.subresource is None and key in self.objects and not self.objects[key].deleted:
                    live = self.objects[key]
                    meta["generation"] = int((live.get("metadata") or {}).get("generation") or 1) + 1
        return await super()._handle(request)


@contextlib.asynccontextmanager
async def serve(
    resources: Mapping[str, kmock.ResourceInfo], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, namespace: str = "default"
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
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}],
        }))  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield emulator, kubeconfig
