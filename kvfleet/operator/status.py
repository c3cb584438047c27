"""KVCachePool status as pure functions: ready counts per role and the four conditions.

Conditions follow metav1.Condition: ``type``, ``status`` ("True"/"False"/"Unknown"),
``reason`` (CamelCase), ``message``, ``observedGeneration``, ``lastTransitionTime``
(kept while the status stays the same).

* ``InvalidSpec`` — True when the spec cannot be realised (reason ``InvalidSpec``,
  message names the field); nothing else is attempted for that generation.
* ``Ready`` — every role of every prefix shard has all its replicas ready.
* ``Progressing`` — children are being created or rolled (ready < desired).
* ``Degraded`` — a child is missing or the API rejected one (reason says which).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet.operator.manifests import shard_name
from kvfleet.operator.spec import PoolSpec

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "InvalidSpec")


def now_iso() -> str:
    return datetime.datetime.now(tz=datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """A new conditions list with ``type_`` set; other types are kept as they were."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != value
        out.append({
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": (now or now_iso()) if changed
            else cond.get("lastTransitionTime") or now or now_iso(),
        })
    if not found:
        out.append({"type": type_, "status": value, "reason": reason, "message": message,
                    "observedGeneration": generation, "lastTransitionTime": now or now_iso()})
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(str(c.get("type")), len(order)))


def deployment_names(pool_name: str, spec: PoolSpec) -> list[str]:
    return [f"{shard_name(pool_name, i)}-{r.name}" for i in range(spec.pools) for r in spec.roles]


def role_counts(pool_name: str, spec: PoolSpec,
                deployments: Mapping[str, Mapping[str, Any] | None]) -> dict[str, dict[str, int]]:
    """Desired and ready pods per role, summed over prefix shards (a missing Deployment counts 0 ready)."""
    counts: dict[str, dict[str, int]] = {r.name: {"desired": 0, "ready": 0} for r in spec.roles}
    for i in range(spec.pools):
        for r in spec.roles:
            dep = deployments.get(f"{shard_name(pool_name, i)}-{r.name}")
            counts[r.name]["desired"] += r.replicas
            if dep is not None:
                counts[r.name]["ready"] += int((dep.get("status") or {}).get("readyReplicas") or 0)
    return counts


def healthy_conditions(
    conditions: Sequence[Mapping[str, Any]],
    pool_name: str,
    spec: PoolSpec,
    deployments: Mapping[str, Mapping[str, Any] | None],
    generation: int,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Conditions of a valid spec from the observed Deployments."""
    counts = role_counts(pool_name, spec, deployments)
    missing = [n for n in deployment_names(pool_name, spec) if deployments.get(n) is None]
    behind = {role: c for role, c in counts.items() if c["ready"] < c["desired"]}
    summary = ", ".join(f"{role} {c['ready']}/{c['desired']}" for role, c in counts.items())
    out = set_condition(conditions, "InvalidSpec", False, "Valid", "spec accepted", generation, now)
    if missing:
        out = set_condition(out, "Degraded", True, "ChildMissing",
                            f"missing Deployment(s): {', '.join(missing)}", generation, now)
    else:
        out = set_condition(out, "Degraded", False, "AsExpected", "all children present", generation, now)
    out = set_condition(out, "Progressing", bool(behind), "RollingOut" if behind else "Complete",
                        f"ready pods: {summary}", generation, now)
    ready = not behind and not missing
    out = set_condition(out, "Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
                        f"ready pods: {summary}", generation, now)
    return out


def invalid_conditions(conditions: Sequence[Mapping[str, Any]], message: str, generation: int,
                       now: str | None = None) -> list[dict[str, Any]]:
    """Conditions of a spec that cannot be realised: InvalidSpec True, Ready False, nothing in progress."""
    out = set_condition(conditions, "InvalidSpec", True, "InvalidSpec", message, generation, now)
    out = set_condition(out, "Ready", False, "InvalidSpec", message, generation, now)
    out = set_condition(out, "Progressing", False, "InvalidSpec", "waiting for a valid spec", generation, now)
    return out


def degraded_conditions(conditions: Sequence[Mapping[str, Any]], reason: str, message: str, generation: int,
                        now: str | None = None) -> list[dict[str, Any]]:
    out = set_condition(conditions, "Degraded", True, reason, message, generation, now)
    return set_condition(out, "Ready", False, reason, message, generation, now)
