"""The chart's ServiceAccounts can do exactly what their programs need, on a real API server.

* ``kubectl auth can-i --as=system:serviceaccount:NS:NAME``: what the operator and the EPP must
  be allowed, and a sample of what they must not (Secrets beyond one get, other namespaces,
  workloads they do not own, RBAC itself); the gateway's account may do nothing;
* the real operator (``kvfleet operator``, kopf) runs as its ServiceAccount (a TokenRequest
  token) in a namespace enforcing Pod Security "restricted": it reconciles a KVCachePool (with
  the OwnerReferencesPermissionEnforcement admission plugin on), its Deployments' pods are
  admitted, a user InferencePool naming the EPP is checked against its pods (a Warning Event), and
  on deletion the finalizer is handled and the garbage collector removes the children; its log
  has no permission error;
* the EPP's Kubernetes datastore (``kvfleet.epp.kube.KubernetesDatastore``) runs as the EPP's
  ServiceAccount and follows an InferencePool and a Pod as the pod becomes ready and goes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.controlplane.cluster import ControlPlane
from kvfleet.demo.envoy import free_port
from tests.cluster.conftest import CHART, RESTRICTED, Kube
from tests.conftest import wait_for
from tests.operator import samples

RELEASE = "kvr"
OPERATOR, EPP, GATEWAY = "kvr-kvfleet-operator", "kvr-kvfleet-epp", "kvr-kvfleet-gateway"


@pytest.fixture(scope="module")
def release(kube: Kube, namespaces: Callable[..., str]) -> dict[str, str]:
    ns = namespaces("rbac", RESTRICTED)
    other = namespaces("rbac-other")
    kube.helm("install", RELEASE, str(CHART), "-n", ns, "--set", "image.pullPolicy=Never")
    return {"ns": ns, "other": other}


def _sa(ns: str, name: str) -> str:
    return f"system:serviceaccount:{ns}:{name}"


def _can(kube: Kube, user: str, verb: str, resource: str, namespace: str | None) -> bool:
    resource, _, sub = resource.partition("/")
    args = [f"--subresource={sub}"] if sub else []
    ns = ["-n", namespace] if namespace else []
    result = kube.kubectl("auth", "can-i", verb, resource, f"--as={user}", *ns, *args, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    return answer == "yes"


# (verb, resource, namespace: "ns" | "other" | "" for cluster scope)
OPERATOR_ALLOWED = [
    ("list", "kvcachepools.kvfleet.io", "ns"), ("watch", "kvcachepools.kvfleet.io", "ns"),
    ("patch", "kvcachepools.kvfleet.io", "ns"),
    ("patch", "kvcachepools.kvfleet.io/status", "ns"), ("update", "kvcachepools.kvfleet.io/finalizers", "ns"),
    ("create", "inferencepools.inference.networking.k8s.io", "ns"),
    ("delete", "inferencepools.inference.networking.k8s.io", "ns"),
    ("watch", "inferencepools.inference.networking.k8s.io", "ns"),
    ("create", "deployments.apps", "ns"), ("patch", "deployments.apps", "ns"),
    ("delete", "deployments.apps", "ns"),
    ("create", "services", "ns"), ("create", "configmaps", "ns"), ("patch", "configmaps", "ns"),
    ("list", "deployments.apps", "ns"), ("list", "services", "ns"), ("list", "configmaps", "ns"),
    ("list", "pods", "ns"), ("get", "secrets", "ns"), ("create", "events", "ns"),
    ("create", "events.events.k8s.io", "ns"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("watch", "namespaces", ""),
]
OPERATOR_FORBIDDEN = [
    ("list", "secrets", "ns"), ("watch", "secrets", "ns"), ("create", "secrets", "ns"),
    ("get", "secrets", "other"),
    ("create", "pods", "ns"), ("delete", "pods", "ns"), ("create", "deployments.apps", "other"),
    ("list", "deployments.apps", "other"), ("create", "configmaps", "other"),
    ("list", "kvcachepools.kvfleet.io", "other"), ("list", "kvcachepools.kvfleet.io", ""),
    ("delete", "kvcachepools.kvfleet.io", "ns"),
    ("update", "deployments.apps", "ns"), ("create", "roles.rbac.authorization.k8s.io", "ns"),
    ("create", "rolebindings.rbac.authorization.k8s.io", "ns"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("delete", "namespaces", ""), ("create", "serviceaccounts/token", "ns"), ("patch", "nodes", ""),
]
EPP_ALLOWED = [("get", "pods", "ns"), ("list", "pods", "ns"), ("watch", "pods", "ns"),
               ("get", "inferencepools.inference.networking.k8s.io", "ns"),
               ("list", "inferencepools.inference.networking.k8s.io", "ns"),
               ("watch", "inferencepools.inference.networking.k8s.io", "ns")]
EPP_FORBIDDEN = [
    ("get", "secrets", "ns"), ("list", "secrets", "ns"), ("create", "deployments.apps", "ns"),
    ("get", "deployments.apps", "ns"),
    ("list", "pods", "other"), ("list", "pods", ""), ("patch", "pods", "ns"),
    ("patch", "inferencepools.inference.networking.k8s.io", "ns"),
    ("list", "inferencepools.inference.networking.k8s.io", "other"), ("get", "configmaps", "ns"),
    ("list", "kvcachepools.kvfleet.io", "ns"),
    ("create", "events", "ns"), ("create", "pods/exec", "ns"),
]
GATEWAY_FORBIDDEN = [("get", "pods", "ns"), ("list", "inferencepools.inference.networking.k8s.io", "ns"),
                     ("get", "secrets", "ns"), ("get", "configmaps", "ns"),
                     ("list", "endpointslices.discovery.k8s.io", "ns")]

CASES = ([(OPERATOR, *c, True) for c in OPERATOR_ALLOWED]
         + [(OPERATOR, *c, False) for c in OPERATOR_FORBIDDEN]
         + [(EPP, *c, True) for c in EPP_ALLOWED] + [(EPP, *c, False) for c in EPP_FORBIDDEN]
         + [(GATEWAY, *c, False) for c in GATEWAY_FORBIDDEN])


@pytest.mark.parametrize(("account", "verb", "resource", "where", "allowed"), CASES,
                         ids=[f"{a.split('-')[-1]}-{'may' if ok else 'mustnot'}-{v}-{r}-{w or 'cluster'}"
                              for a, v, r, w, ok in CASES])
def test_service_account_rights(kube: Kube, release: dict[str, str], account: str, verb: str, resource: str,
                                where: str, allowed: bool) -> None:
    namespace = release[where] if where else None
    assert _can(kube, _sa(release["ns"], account), verb, resource, namespace) is allowed


@contextlib.contextmanager
def _operator(kube: Kube, cp: ControlPlane, ns: str, tmp: Path) -> Iterator[Path]:
    """``kvfleet operator`` as the chart's operator ServiceAccount, with the config the chart renders."""
    kubeconfig = cp.service_account_kubeconfig(ns, OPERATOR, tmp / "operator.kubeconfig")
    config = tmp / "config.yaml"
    config.write_text(kube.get("configmap", "kvr-kvfleet-config", ns)["data"]["config.yaml"])
    port, log = free_port(), tmp / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvfleet", "operator", f"--config={config}",
                                 f"--namespace={ns}", f"--liveness=http://127.0.0.1:{port}/healthz"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def alive() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"the operator exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
                with (contextlib.suppress(OSError),
                      urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r):
                    return bool(r.status == 200)
                return False

            wait_for(alive, "the operator's /healthz", timeout_s=90)
            yield log
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _warnings(kube: Kube, ns: str, name: str) -> list[str]:
    """The operator's InvalidInferencePool Warning Events about InferencePool ``name``."""
    events = kube.get("events", None, ns, "--field-selector",
                      f"reason=InvalidInferencePool,involvedObject.name={name}")["items"]
    return [e.get("message") or "" for e in events]


def test_operator_reconciles_as_its_service_account(
    kube: Kube, control_plane: ControlPlane, release: dict[str, str], tmp_path: Path
) -> None:
    ns = release["ns"]
    pool = samples.kvcachepool("sim-pd", ns, engine={"kind": "sim"}, roles={"prefill": {}, "decode": {}},
                               transfer={"backends": ["tcp"]},
                               tiers=[{"name": "gpu", "gpuShare": 0.5}, {"name": "cpu", "capacity": "256Mi"}])
    with _operator(kube, control_plane, ns, tmp_path) as log:
        kube.apply([pool])

        def reconciled() -> bool:
            status = kube.get("kvcachepool", "sim-pd", ns).get("status") or {}
            return bool(status.get("observedGeneration") == 1 and status.get("inferencePools") == ["sim-pd"])

        wait_for(reconciled, "the KVCachePool's status from the operator", timeout_s=90)
        live = kube.get("kvcachepool", "sim-pd", ns)
        assert "kvfleet.io/finalizer" in live["metadata"]["finalizers"]
        for kind, name in (("configmap", "sim-pd-p0"), ("deployment", "sim-pd-p0-prefill"),
                           ("deployment", "sim-pd-p0-decode"), ("service", "sim-pd-p0"),
                           ("inferencepool", "sim-pd")):
            owners = kube.get(kind, name, ns)["metadata"]["ownerReferences"]
            assert owners[0]["uid"] == live["metadata"]["uid"] and owners[0]["blockOwnerDeletion"] is True
        # its engine pods pass Pod Security "restricted" and ServiceAccount admission
        # (created by the ReplicaSets)
        wait_for(lambda: len(kube.get("pods", None, ns, "-l", "kvfleet.io/pool=sim-pd")["items"]) == 2,
                 "the pool's two pods", timeout_s=60)
        # it reads pods to check an InferencePool naming the EPP (here with a wrong EPP port) and posts
        # a Warning Event
        kube.apply([samples.inferencepool("user-pool", ns,
                                          selector={"matchLabels": {"kvfleet.io/pool": "sim-pd"}},
                                          endpointPickerRef={"name": EPP, "port": {"number": 9999}})])
        wait_for(lambda: any("9999" in m for m in _warnings(kube, ns, "user-pool")),
                 "the operator's warning about user-pool", timeout_s=60)
        assert _warnings(kube, ns, "sim-pd") == []  # its own InferencePool is sound

        kube.kubectl("delete", "kvcachepool", "sim-pd", "-n", ns, "--wait=false")
        wait_for(lambda: not kube.exists("kvcachepool", "sim-pd", ns),
                 "the KVCachePool to go (finalizer released)", timeout_s=90)
        wait_for(lambda: (not kube.exists("deployment", "sim-pd-p0-prefill", ns)
                          and not kube.exists("inferencepool", "sim-pd", ns)),
                 "garbage collection of the children", timeout_s=90)
        time.sleep(1)  # a time gap: the operator handles the deletions' last events before its log is read
    text = log.read_text()
    for bad in ("Forbidden", "forbidden", "Not enough permissions", "HTTP 403"):
        assert bad not in text, text[-4000:]


def test_epp_watches_as_its_service_account(
    kube: Kube, control_plane: ControlPlane, release: dict[str, str], tmp_path: Path
) -> None:
    from kubernetes import config as kconfig

    from kvfleet.epp.kube import KubernetesDatastore

    ns = release["ns"]
    labels = {"app": "epp-watch", "kvfleet.io/agent": "true"}
    pool = samples.inferencepool("watched", ns, selector={"matchLabels": labels},
                                 endpointPickerRef={"name": EPP, "port": {"number": 9002}})
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "engine-0", "namespace": ns,
                        "labels": {**labels, "kvfleet.io/role": "decode"}},
           "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "engine", "image": "kvfleet:dev", "imagePullPolicy": "Never",
                                    "securityContext": {"allowPrivilegeEscalation": False,
                                                        "capabilities": {"drop": ["ALL"]}}}]}}
    kube.apply([pool, pod])
    kubeconfig = control_plane.service_account_kubeconfig(ns, EPP, tmp_path / "epp.kubeconfig")
    api = kconfig.new_client_from_config(str(kubeconfig))  # type: ignore[no-untyped-call]
    ds = KubernetesDatastore(namespace=ns, api_client=api, epp_service=EPP, backoff_s=0.5)
    try:
        def pods() -> list[Any] | None:
            found = [p for p in ds.pools() if p.name == "watched"]
            return list(found[0].pods) if found else None

        wait_for(ds.has_synced, "the EPP's first lists", timeout_s=60)
        wait_for(lambda: pods() is not None, "the InferencePool in the EPP", timeout_s=60)
        assert [p.ready for p in pods() or []] in ([], [False])
        kube.kubectl("patch", "pod", "engine-0", "-n", ns, "--subresource=status", "--type=merge", "-p",
                     '{"status": {"podIP": "10.1.2.3", "podIPs": [{"ip": "10.1.2.3"}], '
                     '"conditions": [{"type": "Ready", "status": "True"}]}}')
        wait_for(lambda: [(p.address, p.port, p.role, p.ready) for p in pods() or []] == [
                     ("10.1.2.3", 8000, "decode", True)],
                 "the pod ready in the EPP", timeout_s=60)
        kube.kubectl("delete", "pod", "engine-0", "-n", ns, "--grace-period=0", "--force")
        wait_for(lambda: [p for p in pods() or [] if p.ready] == [], "the pod gone from the EPP",
                 timeout_s=60)
    finally:
        ds.stop()
