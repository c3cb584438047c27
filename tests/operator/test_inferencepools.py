"""Checks of InferencePools naming the kvfleet EPP, and Kubernetes quantities (pure functions).

Covers: which InferencePools count as naming the kvfleet EPP; problems reported
for a wrong EPP port, a non-HTTP protocol, pods without the agent sidecar and
pods missing a target port; a rendered pool with its own pods is valid; quantity
parsing in binary and decimal suffixes, and rejection of garbage.
"""

from __future__ import annotations

import copy
from decimal import Decimal

import pytest

from kvfleet.config import Settings
from kvfleet.operator import inferencepools
from kvfleet.operator.manifests import render_children
from kvfleet.operator.quantity import QuantityError, parse_quantity, to_bytes
from kvfleet.operator.spec import parse_spec
from tests.operator import samples

OP = Settings().operator


def _pod(name: str, labels: dict[str, str], agent: bool = True, port: int = 8000) -> dict[str, object]:
    containers: list[dict[str, object]] = [{"name": "engine", "ports": [{"containerPort": port}]}]
    if agent:
        containers.append({"name": "kvfleet-agent", "ports": [{"containerPort": 7000}]})
    return {"metadata": {"name": name, "labels": labels}, "spec": {"containers": containers}}


def test_rendered_pool_with_its_pods_is_valid() -> None:
    """A rendered InferencePool and pods shaped like its Deployment's template: no problems."""
    obj = copy.deepcopy(samples.MINIMAL)
    obj["metadata"]["uid"] = "u"
    children = render_children(obj, parse_spec(obj["spec"]), Settings())
    pool = next(c for c in children if c["kind"] == "InferencePool")
    dep = next(c for c in children if c["kind"] == "Deployment")
    pod = {"metadata": {"name": "p", "labels": dep["spec"]["template"]["metadata"]["labels"]},
           "spec": dep["spec"]["template"]["spec"]}
    assert inferencepools.names_kvfleet_epp(pool, OP)
    assert inferencepools.validate(pool, [pod], OP) == []


def test_problems_are_reported() -> None:
    """Wrong EPP port, h2c, an agent-less pod and a pod without the target port each yield a problem."""
    pool = samples.inferencepool(endpointPickerRef={"name": "kvfleet-epp", "port": {"number": 9999}},
                                 appProtocol="kubernetes.io/h2c")
    labels = {"app": "vllm", "kvfleet.io/agent": "true"}
    pods = [_pod("a", labels, agent=False), _pod("b", labels, port=8001),
            _pod("c", {"app": "other"}, agent=False)]
    problems = inferencepools.validate(pool, pods, OP)
    assert len(problems) == 4, problems
    assert any("9999" in p for p in problems) and any("HTTP" in p for p in problems)
    assert any("pod a" in p and "agent" in p for p in problems)
    assert any("pod b" in p and "8000" in p for p in problems)
    assert not any("pod c" in p for p in problems)


def test_only_pools_naming_the_kvfleet_epp_are_ours() -> None:
    """Another name, kind or group in endpointPickerRef is somebody else's pool."""
    assert inferencepools.names_kvfleet_epp(samples.inferencepool(), OP)
    for ref in ({"name": "other", "port": {"number": 9002}},
                {"name": "kvfleet-epp", "kind": "Backend", "group": "x.io"}):
        assert not inferencepools.names_kvfleet_epp(samples.inferencepool(endpointPickerRef=ref), OP)


@pytest.mark.parametrize(("text", "value"), [("64Gi", 64 * 2**30), ("1Ti", 2**40), ("500M", 500 * 10**6),
                                             ("1e3", 1000), ("1.5Ki", 1536), (42, 42)])
def test_quantities(text: str | int, value: int) -> None:
    """Binary and decimal suffixes and exponents become exact byte counts."""
    assert to_bytes(text) == value


def test_quantity_rounds_up_and_rejects_garbage() -> None:
    """Fractional bytes round up; non-quantities raise QuantityError."""
    assert parse_quantity("1m") == Decimal("0.001") and to_bytes("1m") == 1
    for bad in ("lots", "1GB", "", "--1"):
        with pytest.raises(QuantityError):
            parse_quantity(bad)
