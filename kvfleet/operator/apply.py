"""Owned children by server-side apply: one call per child, never taking over someone else's object.

The rendering is the operator's whole intent for a child: it is applied with field manager
``kvfleet-operator`` (:meth:`~kvfleet.operator.kube.ApiClient.apply`), so the API server
removes what a new rendering drops (a tier's flag, a ConfigMap key, an annotation) and keeps
what other managers own. Before applying, the live object is read: one controlled by another
owner is never touched (:class:`ForeignOwnerError`); the answer's ``resourceVersion`` tells
whether anything changed (a steady state applies with no change and no new revision).

Children written by earlier kvfleet versions (GET + merge patch: the fields belong to manager
``kvfleet-operator`` with operation ``Update``) are migrated first, as client-go's
``csaupgrade`` does: that entry's fields join the ``Apply`` entry, so what the earlier version
rendered and this one does not is removed by the first apply instead of staying forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.operator.kube import ApiClient


class ForeignOwnerError(Exception):
    """An object with the rendered name exists and is controlled by another owner."""


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of ``obj``'s controlling owner reference, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def check_owner(live: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> None:
    """Raise :class:`ForeignOwnerError` when ``live`` is controlled by another object than ``wanted``
    names."""
    if live is None:
        return
    owner, live_owner = controller_uid(wanted), controller_uid(live)
    if live_owner is not None and owner is not None and live_owner != owner:
        meta = wanted["metadata"]
        raise ForeignOwnerError(f"{wanted['kind']} {meta['namespace']}/{meta['name']} is controlled by "
                                f"another object (uid {live_owner})")


def _union(a: Any, b: Any) -> Any:
    """The union of two ``fieldsV1`` trees (nested maps of ``f:``/``k:``/``v:``/``i:`` keys, ``.`` leaves)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return {k: _union(a.get(k), b.get(k)) if k in a and k in b else (a[k] if k in a else b[k])
                for k in {**a, **b}}
    return a if a is not None else b


def upgraded_managed_fields(live: Mapping[str, Any], manager: str) -> list[dict[str, Any]] | None:
    """``live``'s managedFields with ``manager``'s ``Update`` entry (main resource) merged into its ``Apply``
    entry, or None when there is nothing to migrate."""
    entries = [dict(e) for e in (live.get("metadata") or {}).get("managedFields") or []]
    update = next((e for e in entries if e.get("manager") == manager and e.get("operation") == "Update"
                   and not e.get("subresource")), None)
    if update is None:
        return None
    applied = next((e for e in entries if e.get("manager") == manager and e.get("operation") == "Apply"
                    and not e.get("subresource")), None)
    rest = [e for e in entries if e is not update and e is not applied]
    merged = {**update, "operation": "Apply",
              "fieldsV1": _union((applied or {}).get("fieldsV1") or {}, update.get("fieldsV1") or {})}
    return [*rest, merged]


async def apply(api: ApiClient, obj: Mapping[str, Any]) -> str:
    """Server-side apply ``obj``; returns ``created``, ``patched`` or ``unchanged``."""
    meta = obj["metadata"]
    live = await api.get_or_none(obj["kind"], meta["namespace"], meta["name"])
    check_owner(live, obj)
    if live is not None:
        migrated = upgraded_managed_fields(live, api.field_manager)
        if migrated is not None:
            rv = (live.get("metadata") or {}).get("resourceVersion")
            await api.patch(obj["kind"], meta["namespace"], meta["name"],
                            {"metadata": {"managedFields": migrated, "resourceVersion": rv}})
    result = await api.apply(obj)
    if live is None:
        return "created"
    before = (live.get("metadata") or {}).get("resourceVersion")
    return "unchanged" if (result.get("metadata") or {}).get("resourceVersion") == before else "patched"
