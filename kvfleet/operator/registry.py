"""The EPP's pool registry: which InferencePools name the kvfleet EPP, and are they sound.

The operator watches every InferencePool (its own and user-made ones). Those whose
``endpointPickerRef`` names the kvfleet EPP Service are validated — the selected
pods must carry the kvfleet agent sidecar and expose every target port, the EPP
port must agree, the protocol must be HTTP — and written, one data key per pool
(``<namespace>.<name>``), into a ConfigMap the EPP reads (``operator.pool_registry``
in the operator's namespace). The EPP resolves pod IPs itself from the selector.
Everything here is pure; :mod:`kvfleet.operator.handlers` does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.manifests import AGENT_CONTAINER, ANN_MODEL, ANN_ROUTING, LABEL_AGENT


def registry_key(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"


def names_kvfleet_epp(pool: Mapping[str, Any], op: OperatorSettings) -> bool:
    """Whether the InferencePool's endpointPickerRef points at the kvfleet EPP Service."""
    ref = (pool.get("spec") or {}).get("endpointPickerRef") or {}
    return bool(ref.get("name") == op.epp_service and (ref.get("kind") or "Service") == "Service" and not ref.get("group"))


def selects(selector: Mapping[str, str], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def selected_pods(pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    selector = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    if not selector:
        return []
    return [p for p in pods if selects(selector, (p.get("metadata") or {}).get("labels"))]


def validate(pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], op: OperatorSettings) -> list[str]:
    """Problems that stop the EPP from routing to this pool (empty when sound)."""
    spec = pool.get("spec") or {}
    problems: list[str] = []
    ref = spec.get("endpointPickerRef") or {}
    port = (ref.get("port") or {}).get("number")
    if port != op.epp_port:
        problems.append(f"endpointPickerRef.port.number is {port}, the kvfleet EPP serves ext_proc on {op.epp_port}")
    if spec.get("appProtocol", "http") != "http":
        problems.append(f"appProtocol {spec.get('appProtocol')!r}: kvfleet engines speak HTTP/1.1 (http)")
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    if not selector:
        problems.append("selector.matchLabels is empty")
    targets = [p.get("number") for p in spec.get("targetPorts") or []]
    for pod in selected_pods(pool, pods):
        pname = (pod.get("metadata") or {}).get("name")
        containers = (pod.get("spec") or {}).get("containers") or []
        if not any(c.get("name") == AGENT_CONTAINER for c in containers) or ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_AGENT) != "true":
            problems.append(f"pod {pname} matches the selector but carries no kvfleet agent sidecar")
        exposed = {p.get("containerPort") for c in containers if c.get("name") != AGENT_CONTAINER for p in c.get("ports") or []}
        for number in targets:
            if number not in exposed:
                problems.append(f"pod {pname} exposes no container port {number} (targetPorts)")
    return problems


def entry(pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], problems: list[str]) -> dict[str, Any]:
    """The registry record of one InferencePool."""
    meta = pool.get("metadata") or {}
    spec = pool.get("spec") or {}
    ann = meta.get("annotations") or {}
    routing: dict[str, Any] = {}
    if ANN_ROUTING in ann:
        try:
            routing = json.loads(ann[ANN_ROUTING])
        except ValueError:
            problems = [*problems, f"annotation {ANN_ROUTING} is not JSON; using default routing"]
    return {
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        "model": ann.get(ANN_MODEL, ""),
        "selector": (spec.get("selector") or {}).get("matchLabels") or {},
        "targetPorts": [p.get("number") for p in spec.get("targetPorts") or []],
        "appProtocol": spec.get("appProtocol", "http"),
        "failureMode": (spec.get("endpointPickerRef") or {}).get("failureMode", "FailClose"),
        "routing": routing,
        "valid": not problems,
        "problems": problems,
    }
