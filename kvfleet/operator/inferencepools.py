"""Checks of InferencePools that name the kvfleet EPP: are they sound for it.

The operator watches every InferencePool (its own and user-made ones). Those whose
``endpointPickerRef`` names the kvfleet EPP Service are checked: the selected pods
must carry the kvfleet agent sidecar and expose every target port, the EPP port
must agree, the protocol must be HTTP. Each problem becomes a Warning Event on the
InferencePool; the EPP routes to a pool's ready pods whatever the check says (it
resolves pools and pods from its own watch, :mod:`kvfleet.epp.kube`).
Everything here is pure; :mod:`kvfleet.operator.handlers` does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.manifests import AGENT_CONTAINER, LABEL_AGENT


def names_kvfleet_epp(pool: Mapping[str, Any], op: OperatorSettings) -> bool:
    """Whether the InferencePool's endpointPickerRef points at the kvfleet EPP Service."""
    ref = (pool.get("spec") or {}).get("endpointPickerRef") or {}
    return bool(ref.get("name") == op.epp_service and (ref.get("kind") or "Service") == "Service"
                and not ref.get("group"))


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
        problems.append(
            f"endpointPickerRef.port.number is {port}, the kvfleet EPP serves ext_proc on {op.epp_port}")
    if spec.get("appProtocol", "http") != "http":
        problems.append(f"appProtocol {spec.get('appProtocol')!r}: kvfleet engines speak HTTP/1.1 (http)")
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    if not selector:
        problems.append("selector.matchLabels is empty")
    targets = [p.get("number") for p in spec.get("targetPorts") or []]
    for pod in selected_pods(pool, pods):
        pname = (pod.get("metadata") or {}).get("name")
        containers = (pod.get("spec") or {}).get("containers") or []
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not any(c.get("name") == AGENT_CONTAINER for c in containers) or labels.get(LABEL_AGENT) != "true":
            problems.append(f"pod {pname} matches the selector but carries no kvfleet agent sidecar")
        exposed = {p.get("containerPort") for c in containers if c.get("name") != AGENT_CONTAINER
                   for p in c.get("ports") or []}
        for number in targets:
            if number not in exposed:
                problems.append(f"pod {pname} exposes no container port {number} (targetPorts)")
    return problems

