"""What the chart renders, checked without a server (helm template): the properties the
real-server tests rely on, each pinned by a test of its own.

* ``kubeVersion`` is what the CRDs need: the KVCachePool CRD's CEL uses Kubernetes' quantity
  library (``isQuantity``, ``quantity``), which a server accepts in new CRDs from 1.29 on
  (1.28 ships it only for expressions already stored);
* the transfer Secret: ``transfer.secret.existingSecret`` renders none and points every pod at
  the named one, so a client-side render (GitOps) is byte-stable; a generated one is rendered
  once and kept (``helm.sh/resource-policy: keep``, ``lookup`` on upgrade);
* RBAC: namespaced Roles (the EPP reads Pods and InferencePools of its namespace; the operator
  works in the namespaces it watches, its release namespace by default); the one ClusterRole lets
  kopf list and watch CRDs and namespaces; ``kvcachepools/finalizers`` for owner references that
  block deletion;
* every pod: ``seccompProfile: RuntimeDefault``, non-root, no privilege escalation, all
  capabilities dropped (Pod Security "restricted");
* PodDisruptionBudgets for the EPP, the operator and the gateway;
* Envoy runs under its own ServiceAccount, without an API token.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.config import Settings, from_dict
from tests.cluster.conftest import CHART, WORKLOADS, template
from tests.operator.k8s import load_crd


def _by(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def _render(tools: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools / "helm"), "template", "kvf", str(CHART), "--namespace", "kvfleet", *args],
        capture_output=True, text=True, timeout=60)


def _cel(crd: dict[str, Any]) -> str:
    return yaml.safe_dump(crd["spec"]["versions"])


def test_kube_version_is_what_the_crds_need(tools: Path) -> None:
    """The CRD uses the quantity CEL library; the chart refuses 1.28 (which rejects it in new CRDs) and takes
    1.29+."""
    assert "isQuantity(" in _cel(load_crd("kvcachepool.yaml"))
    old = _render(tools, "--kube-version", "1.28.15")
    assert old.returncode != 0 and "kubeVersion" in old.stderr, old.stderr
    for version in ("1.29.0", "1.34.12", "1.36.0"):
        ok = _render(tools, "--kube-version", version)
        assert ok.returncode == 0, (version, ok.stderr)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.29.0-0"


def test_existing_transfer_secret_renders_stably(tools: Path) -> None:
    """existingSecret: no Secret rendered, the config names the given one, and two renders are identical
    (GitOps)."""
    args = ("--set", "transfer.secret.existingSecret=kv-transfer-sealed")
    first, second = _render(tools, *args), _render(tools, *args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    objs = [d for d in yaml.safe_load_all(first.stdout) if d]
    assert _by(objs, "Secret") == []
    (cm,) = _by(objs, "ConfigMap", "kvf-kvfleet-config")
    assert from_dict(Settings, yaml.safe_load(cm["data"]["config.yaml"])).operator.transfer_secret == (
        "kv-transfer-sealed")


def test_given_transfer_secret_value_renders_stably(tools: Path) -> None:
    args = ("--set", "transfer.secret.value=s3cret-s3cret-s3cret")
    assert _render(tools, *args).stdout == _render(tools, *args).stdout


def test_generated_transfer_secret_is_kept(tools: Path) -> None:
    """The generated Secret survives uninstall and is never re-randomised while it exists (see the server
    tests)."""
    (secret,) = _by(template(tools), "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["secret"]) >= 48


def _rules(objs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    (role,) = _by(objs, kind, name)
    rules: list[dict[str, Any]] = role["rules"]
    return rules


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_epp_rbac_is_a_namespaced_read_only_role(tools: Path) -> None:
    """The EPP watches Pods and InferencePools of its own namespace: a Role there, nothing cluster-wide."""
    objs = template(tools)
    assert (_by(objs, "ClusterRole", "kvf-kvfleet-epp") == []
            and _by(objs, "ClusterRoleBinding", "kvf-kvfleet-epp") == [])
    (role,) = _by(objs, "Role", "kvf-kvfleet-epp")
    assert role["metadata"]["namespace"] == "kvfleet"
    assert _grants(role["rules"]) == {
        (g, r, v) for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
        for v in ("get", "list", "watch")}
    (binding,) = _by(objs, "RoleBinding", "kvf-kvfleet-epp")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvf-kvfleet-epp", "namespace": "kvfleet"}]


def test_operator_rbac_is_namespaced_with_finalizers(tools: Path) -> None:
    """The operator's rights are a Role in the namespace it watches (the release's by default) with
    kvcachepools/finalizers; cluster-wide it only lists and watches CRDs and namespaces (kopf)."""
    objs = template(tools)
    (role,) = _by(objs, "Role", "kvf-kvfleet-operator")
    assert role["metadata"]["namespace"] == "kvfleet"
    grants = _grants(role["rules"])
    assert ("kvfleet.io", "kvcachepools/finalizers", "update") in grants
    assert ("", "secrets", "get") in grants and not {g for g in grants if g[1] == "secrets" and g[2] != "get"}
    (cluster,) = _by(objs, "ClusterRole", "kvf-kvfleet-operator")
    assert _grants(cluster["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} | {
        ("", "namespaces", v) for v in ("list", "watch")}
    (op,) = _by(objs, "Deployment", "kvf-kvfleet-operator")
    assert "--namespace=kvfleet" in op["spec"]["template"]["spec"]["containers"][0]["args"]


def test_operator_watching_other_namespaces_gets_a_role_in_each(tools: Path) -> None:
    objs = template(tools, "--set", "operator.watchNamespaces={team-a,team-b}")
    roles = {r["metadata"]["namespace"] for r in _by(objs, "Role", "kvf-kvfleet-operator")}
    bindings = {(b["metadata"]["namespace"], b["subjects"][0]["namespace"])
                for b in _by(objs, "RoleBinding", "kvf-kvfleet-operator")}
    assert roles == {"team-a", "team-b"}  # nothing of the operator's lives in its own namespace
    assert bindings == {("team-a", "kvfleet"), ("team-b", "kvfleet")}
    (op,) = _by(objs, "Deployment", "kvf-kvfleet-operator")
    args = op["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]


VALUES = [(), ("-f", str(CHART / "values-kind.yaml")),
          ("--set", "epp.tls.enabled=true", "--set", "epp.tls.secretName=epp-tls")]


@pytest.mark.parametrize("args", VALUES, ids=["default", "kind", "tls"])
def test_every_pod_is_restricted(tools: Path, args: tuple[str, ...]) -> None:
    """Pod-level seccompProfile RuntimeDefault and runAsNonRoot; each container: no privilege escalation,
    drops ALL, a read-only root filesystem."""
    workloads = [o for o in template(tools, *args) if o["kind"] in WORKLOADS]
    assert {o["metadata"]["name"] for o in workloads} == {
        "kvf-kvfleet-epp", "kvf-kvfleet-operator", "kvf-kvfleet-gateway"}
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, w["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], (
                w["metadata"]["name"], c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (w["metadata"]["name"], c["name"])


def test_disruption_budgets(tools: Path) -> None:
    """One PodDisruptionBudget per Deployment, selecting exactly its pods."""
    objs = template(tools)
    pdbs = {p["metadata"]["name"]: p for p in _by(objs, "PodDisruptionBudget")}
    deployments = {d["metadata"]["name"]: d for d in _by(objs, "Deployment")}
    assert set(pdbs) == set(deployments)
    for name, pdb in pdbs.items():
        assert pdb["spec"]["selector"] == deployments[name]["spec"]["selector"]
        assert pdb["spec"]["maxUnavailable"] == 1
    assert _by(template(tools, "--set", "podDisruptionBudget.enabled=false"), "PodDisruptionBudget") == []


def test_gateway_has_its_own_service_account_without_a_token(tools: Path) -> None:
    objs = template(tools)
    (gw,) = _by(objs, "Deployment", "kvf-kvfleet-gateway")
    pod = gw["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kvf-kvfleet-gateway" and pod["automountServiceAccountToken"] is False
    (sa,) = _by(objs, "ServiceAccount", "kvf-kvfleet-gateway")
    assert sa["automountServiceAccountToken"] is False
    assert not [b for b in _by(objs, "RoleBinding") + _by(objs, "ClusterRoleBinding")
                if any(s["name"] == "kvf-kvfleet-gateway" for s in b["subjects"])]
