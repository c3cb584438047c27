"""Idempotent create-or-patch of owned objects, as pure decisions plus one async driver.

Without server-side apply (and without PUT, which the test API server lacks),
an object is made to match its rendering by: create when absent; otherwise a
JSON merge patch of the rendered fields, sent only when the live object does
not already contain them (so a steady state sends no writes). ConfigMap keys
that the rendering dropped are deleted (null in the patch). Objects controlled
by someone else are never taken over (:class:`ForeignOwnerError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.operator.kube import ApiClient, Conflict


class ForeignOwnerError(Exception):
    """An object with the rendered name exists and is controlled by another owner."""


def contains(live: Any, wanted: Any) -> bool:
    """``live`` has every field of ``wanted`` (server-added fields are ignored; lists match item by item)."""
    if isinstance(wanted, Mapping):
        return isinstance(live, Mapping) and all(k in live and contains(live[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(contains(a, b) for a, b in zip(live, wanted, strict=True))
    return bool(live == wanted)


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def merge_patch(live: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes ``live`` match ``wanted``, or None when it already does."""
    owner = _controller_uid(wanted)
    live_owner = _controller_uid(live)
    if live_owner is not None and owner is not None and live_owner != owner:
        meta = wanted["metadata"]
        raise ForeignOwnerError(f"{wanted['kind']} {meta['namespace']}/{meta['name']} is controlled by another object (uid {live_owner})")
    body: dict[str, Any] = {k: v for k, v in wanted.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = wanted.get("metadata") or {}
    body["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    if wanted.get("kind") in ("ConfigMap", "Secret"):
        for section in ("data", "binaryData"):
            stale = set(live.get(section) or {}) - set(wanted.get(section) or {})
            if stale:
                body.setdefault(section, {})
                body[section] = {**body[section], **dict.fromkeys(sorted(stale))}
    if contains(live, body):
        return None
    return body


async def apply(api: ApiClient, obj: Mapping[str, Any]) -> str:
    """Create or patch ``obj``; returns ``created``, ``patched`` or ``unchanged``."""
    meta = obj["metadata"]
    live = await api.get_or_none(obj["kind"], meta["namespace"], meta["name"])
    if live is None:
        try:
            await api.create(obj)
            return "created"
        except Conflict:  # created meanwhile: fall through to a patch
            live = await api.get(obj["kind"], meta["namespace"], meta["name"])
    body = merge_patch(live, obj)
    if body is None:
        return "unchanged"
    await api.patch(obj["kind"], meta["namespace"], meta["name"], body)
    return "patched"
