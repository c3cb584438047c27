"""Pod Security admission "restricted" (enforced by the real API server) over every pod kvfleet makes.

Each pod is sent as a Pod (server-side dry run, ``kubectl apply --dry-run=server``) into a
namespace labelled ``pod-security.kubernetes.io/enforce=restricted``: PodSecurity only
*warns* about Deployments, and enforces on Pods. Covered: the chart's Deployments under the
default, kind and TLS values, and the Deployments the operator renders
(kvfleet.operator.manifests.render_children) for every KVCachePool sample and engine kind.
A user-chosen hostPath volume for the ssd tier cannot be restricted: it is refused, saying so.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvfleet.config import Settings
from kvfleet.operator.manifests import render_children
from kvfleet.operator.spec import parse_spec
from tests.cluster.conftest import CHART, RESTRICTED, WORKLOADS, Kube, dump, pod_from_template, template
from tests.cluster.test_crds import VALID

CHART_VALUES = {"default": (), "kind": ("-f", str(CHART / "values-kind.yaml")),
                "tls": ("--set", "epp.tls.enabled=true", "--set", "epp.tls.secretName=epp-tls")}


@pytest.fixture(scope="module")
def ns(kube: Kube, namespaces: Callable[..., str]) -> str:
    made: str = namespaces("restricted", RESTRICTED)
    return made


def _dry_run(kube: Kube, objs: list[dict[str, Any]], ns: str) -> tuple[int, str]:
    result = kube.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=dump(objs), check=False)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("values", sorted(CHART_VALUES))
def test_chart_pods_are_restricted(kube: Kube, ns: str, values: str) -> None:
    objs = template(kube, *CHART_VALUES[values], namespace=ns)
    workloads = [o for o in objs if o["kind"] in WORKLOADS]
    assert len(workloads) == 3
    # ServiceAccount admission looks them up
    kube.apply([o for o in objs if o["kind"] == "ServiceAccount"], "-n", ns)
    pods = [pod_from_template(w, ns) for w in workloads]
    rc, out = _dry_run(kube, pods, ns)
    assert rc == 0 and "violate" not in out, out
    rc, out = _dry_run(kube, workloads, ns)  # and the Deployments draw no Pod Security warning
    assert rc == 0 and "violate" not in out, out


def _rendered(name: str, ns: str, **spec: Any) -> list[dict[str, Any]]:
    obj = copy.deepcopy(VALID[name])
    obj["spec"].update(spec)
    obj["metadata"] = {**obj["metadata"], "namespace": ns, "uid": str(uuid.uuid4())}
    return render_children(obj, parse_spec(obj["spec"], obj["metadata"]["name"]), Settings())


def _without_hostpath(name: str) -> dict[str, Any]:
    tiers = [{k: v for k, v in t.items() if not (k == "volume" and "hostPath" in v)}
             for t in VALID[name]["spec"].get("tiers", [])]
    return {"tiers": tiers} if tiers else {}


@pytest.mark.parametrize("name", sorted(VALID))
@pytest.mark.parametrize("engine", ["sim", "vllm", "sglang"])
def test_operator_pods_are_restricted(kube: Kube, ns: str, name: str, engine: str) -> None:
    """Every pod the operator renders passes "restricted" (a hostPath ssd volume aside: see below)."""
    extra: dict[str, Any] = {**_without_hostpath(name)}
    if engine in ("vllm", "sglang") and "prefill" in VALID[name]["spec"].get("roles", {}):
        # vLLM and SGLang 0.5.3 P/D move KV with NIXL or Mooncake
        extra["transfer"] = {"backends": ["nixl", "tcp"]}
    if engine == "sglang" and "tiers" in extra:
        # SGLang has no Redis storage backend, and sizes its host cache in whole GiB
        extra["tiers"] = [{**t, "capacity": "1Gi"} if t["name"] == "cpu" else t
                          for t in extra["tiers"] if t["name"] != "remote"]
    children = _rendered(name, ns, engine={"kind": engine}, **extra)
    deployments = [c for c in children if c["kind"] == "Deployment"]
    assert deployments
    rc, out = _dry_run(kube, [pod_from_template(d, ns) for d in deployments], ns)
    assert rc == 0 and "violate" not in out, out
    for d in deployments:
        assert d["spec"]["template"]["spec"]["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"}


def test_hostpath_ssd_tier_is_refused_under_restricted(kube: Kube, ns: str) -> None:
    """A hostPath volume (the GPU sample's ssd tier) needs a namespace that allows it; restricted says why
    not."""
    (deployment, *_) = [c for c in _rendered("samples.py:full-gpu", ns) if c["kind"] == "Deployment"]
    rc, out = _dry_run(kube, [pod_from_template(deployment, ns)], ns)
    assert rc != 0 and ('restricted:latest": restricted volume types '
                        '(volume "ssd" uses restricted volume type "hostPath")') in out, out
    assert ("allowPrivilegeEscalation" not in out and "runAsNonRoot" not in out
            and "seccompProfile" not in out), out
