"""helm install / upgrade / uninstall of charts/kvfleet against a real API server.

The release goes into a namespace that enforces Pod Security "restricted"; the controller
manager turns its Deployments into ReplicaSets and Pods (which stay Pending: there is no
scheduler or kubelet), so admission of every chart pod is exercised for real, as is garbage
collection on uninstall. Checked: the install passes the chart's kubeVersion against the
server's real version; CRDs, InferencePools and KVCachePools survive an upgrade, and a changed
value rolls the Deployment (a new ReplicaSet); an upgrade with the same values changes no pod
template; the generated transfer Secret keeps its value across upgrades, uninstall and
reinstall; uninstall removes the workloads and their pods and keeps CRDs, custom objects and
the Secret.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import pytest

from tests.cluster.conftest import CHART, IP_CRD, KVCP_CRD, RESTRICTED, Kube
from tests.conftest import wait_for
from tests.operator import samples

RELEASE = "kvf"
#: No node runs anything here, and nothing may be pulled: pods only need to be admitted.
VALUES = ("--set", "image.pullPolicy=Never")
DEPLOYMENTS = {"kvf-kvfleet-epp": "epp", "kvf-kvfleet-operator": "operator", "kvf-kvfleet-gateway": "gateway"}


@pytest.fixture(scope="module")
def ns(kube: Kube, namespaces: Callable[..., str]) -> str:
    made: str = namespaces("helm", RESTRICTED)
    return made


@pytest.fixture(scope="module")
def installed(kube: Kube, ns: str) -> dict[str, Any]:
    ip_crd_before = kube.exists("crd", IP_CRD)
    result = kube.helm("install", RELEASE, str(CHART), "-n", ns, *VALUES)
    return {"ip_crd_before": ip_crd_before, "stderr": result.stderr}


def _pods(kube: Kube, ns: str, component: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube.get(
        "pods", None, ns, "-l",
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}")["items"]
    return items


def _secret(kube: Kube, ns: str) -> str:
    return base64.b64decode(kube.get("secret", "kvf-kvfleet-transfer", ns)["data"]["secret"]).decode()


def _uid(kube: Kube, kind: str, name: str, ns: str | None = None) -> str:
    uid: str = kube.get(kind, name, ns)["metadata"]["uid"]
    return uid


def test_install_admits_every_pod_under_restricted(kube: Kube, ns: str, installed: dict[str, Any]) -> None:
    """Installed without Pod Security warnings; the ReplicaSets create every pod (Pending) in a restricted
    namespace."""
    assert "PodSecurity" not in installed["stderr"], installed["stderr"]
    for name, component in DEPLOYMENTS.items():
        wait_for(lambda c=component: len(_pods(kube, ns, c)) == 1, f"the {name} pod", timeout_s=60)  # type: ignore[misc]
    events = kube.get("events", None, ns, "--field-selector", "reason=FailedCreate")["items"]
    assert events == [], [e["message"] for e in events]


def test_install_serves_the_crds_and_disruption_budgets(
    kube: Kube, ns: str, installed: dict[str, Any]
) -> None:
    crd = kube.get("crd", KVCP_CRD)
    assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
    ip = kube.get("crd", IP_CRD)
    # the chart installed it (crds.inferencePool=auto on a cluster without the API)
    if not installed["ip_crd_before"]:
        ann = ip["metadata"]["annotations"]
        assert ann["helm.sh/resource-policy"] == "keep" and ann["meta.helm.sh/release-namespace"] == ns
    for name in DEPLOYMENTS:  # the disruption controller counts each Deployment's pod under its budget
        wait_for(lambda n=name: kube.get("pdb", n, ns).get("status", {}).get("expectedPods") == 1,  # type: ignore[misc]
                 f"PDB {name} covering its pod", timeout_s=60)


def test_pods_run_under_their_own_service_accounts(kube: Kube, ns: str, installed: dict[str, Any]) -> None:
    """The EPP and the operator get an API token; the gateway (Envoy) has its own account and none."""
    for name, component in DEPLOYMENTS.items():
        (pod,) = _pods(kube, ns, component)
        assert pod["spec"]["serviceAccountName"] == name
        tokens = [v for v in pod["spec"].get("volumes", []) if v["name"].startswith("kube-api-access")]
        assert bool(tokens) == (component != "gateway"), (name, pod["spec"].get("volumes"))
        assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_upgrade_keeps_crds_and_objects_and_rolls_on_a_changed_value(
    kube: Kube, ns: str, installed: dict[str, Any]
) -> None:
    pool = samples.inferencepool("user-pool", ns,
                                 endpointPickerRef={"name": "kvf-kvfleet-epp", "port": {"number": 9002}})
    kube.apply([pool, samples.kvcachepool("llama", ns, engine={"kind": "sim"})])
    before = {"crds": (_uid(kube, "crd", KVCP_CRD), _uid(kube, "crd", IP_CRD)),
              "objs": (_uid(kube, "inferencepool", "user-pool", ns), _uid(kube, "kvcachepool", "llama", ns)),
              "secret": _secret(kube, ns)}
    epp = kube.get("deployment", "kvf-kvfleet-epp", ns)

    kube.helm("upgrade", RELEASE, str(CHART), "-n", ns, *VALUES, "--set-json", "config.epp.hotspot_beta=0.25")
    after = kube.get("deployment", "kvf-kvfleet-epp", ns)
    assert after["metadata"]["generation"] == epp["metadata"]["generation"] + 1
    assert (after["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            != epp["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    wait_for(lambda: len(kube.get("replicasets", None, ns, "-l",
                                  "app.kubernetes.io/component=epp")["items"]) == 2,
             "a second EPP ReplicaSet (the rollout)", timeout_s=60)
    assert (_uid(kube, "crd", KVCP_CRD), _uid(kube, "crd", IP_CRD)) == before["crds"]
    assert (_uid(kube, "inferencepool", "user-pool", ns),
            _uid(kube, "kvcachepool", "llama", ns)) == before["objs"]
    assert _secret(kube, ns) == before["secret"]

    # The same values again: nothing rolls (the rendering is stable), the Secret stays.
    templates = {n: kube.get("deployment", n, ns)["metadata"]["generation"] for n in DEPLOYMENTS}
    kube.helm("upgrade", RELEASE, str(CHART), "-n", ns, *VALUES, "--set-json", "config.epp.hotspot_beta=0.25")
    assert {n: kube.get("deployment", n, ns)["metadata"]["generation"] for n in DEPLOYMENTS} == templates
    assert _secret(kube, ns) == before["secret"]


def test_uninstall_removes_workloads_and_keeps_crds_objects_and_secret(
    kube: Kube, ns: str, installed: dict[str, Any]
) -> None:
    kube.apply([samples.kvcachepool("kept", ns)])
    secret = _secret(kube, ns)
    kube.helm("uninstall", RELEASE, "-n", ns)
    for name in DEPLOYMENTS:
        assert not kube.exists("deployment", name, ns)
        assert not kube.exists("serviceaccount", name, ns)
    assert (not kube.exists("role", "kvf-kvfleet-operator", ns)
            and not kube.exists("clusterrole", "kvf-kvfleet-operator"))
    # garbage collection (the controller manager) removes the ReplicaSets' pods
    wait_for(lambda: kube.get("pods", None, ns, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"] == [],
             "the release's pods to go", timeout_s=60)
    assert kube.exists("crd", KVCP_CRD) and kube.exists("crd", IP_CRD)
    assert kube.exists("kvcachepool", "kept", ns)
    assert _secret(kube, ns) == secret  # helm.sh/resource-policy: keep

    # Reinstalling adopts the kept Secret (and the InferencePool CRD this release installed) unchanged.
    kube.helm("install", RELEASE, str(CHART), "-n", ns, *VALUES)
    assert _secret(kube, ns) == secret
    kube.helm("uninstall", RELEASE, "-n", ns)
