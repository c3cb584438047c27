"""The operator's Kubernetes API access, on lightkube, with server-side apply.

kopf watches and patches the resources it handles; the operator's children
(ConfigMaps, Deployments, Services, InferencePools) are written through this
client, with the same credentials kopf logged in with (:class:`kopf.ConnectionInfo`):

* children are **server-side applied** (``PATCH application/apply-patch+yaml``, field
  manager ``kvfleet-operator``, forced): the rendering is the whole intent, so a field
  the rendering drops is removed by the API server, and fields other managers own
  (an HPA's ``replicas``, a mesh's injected annotation) are left alone;
* owned children are found by **label selector** (``kvfleet.io/pool=<name>``);
* status is a JSON merge patch (several writers, one key each).

HTTP failures become typed errors whose type decides what happens next
(:class:`Transient` → retry with back-off, :class:`Rejected` → a permanent condition
on the owner, :class:`NotFound` / :class:`Conflict` → handled by the caller).
Objects are sent as the dicts the renderer made (no typed-model round trip that could
drop a field); answers are returned as plain dicts.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import httpx2 as _httpx  # lightkube's HTTP client
import kopf
from lightkube import ApiError as _LightkubeError
from lightkube import AsyncClient, KubeConfig, codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import ConfigMap, Event, Pod, Secret, Service
from lightkube.types import CascadeType, PatchType

FIELD_MANAGER = "kvfleet-operator"

KVCachePool = create_namespaced_resource("kvfleet.io", "v1alpha1", "KVCachePool", "kvcachepools")
InferencePool = create_namespaced_resource("inference.networking.k8s.io", "v1", "InferencePool",
                                           "inferencepools")

#: kind → lightkube resource of what the operator reads and writes.
RESOURCES: dict[str, Any] = {
    "ConfigMap": ConfigMap,
    "Service": Service,
    "Pod": Pod,
    "Secret": Secret,
    "Event": Event,
    "Deployment": Deployment,
    "InferencePool": InferencePool,
    "KVCachePool": KVCachePool,
}


class ApiError(Exception):
    """An API request failed; ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class NotFound(ApiError):
    """404: the object (or its resource type) does not exist."""


class Conflict(ApiError):
    """409: the object exists already, or a write lost a race."""


class Rejected(ApiError):
    """400/403/422 and other 4xx: the server refuses this object as sent; retrying will not help."""


class Transient(ApiError):
    """5xx, 429 or no answer: worth retrying later."""


def resource(kind: str) -> Any:
    try:
        return RESOURCES[kind]
    except KeyError:
        raise KeyError(f"unknown kind {kind!r}; known: {', '.join(sorted(RESOURCES))}") from None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _b64(value: str | bytes) -> str:
    """kubeconfig ``*-data`` fields: base64 of PEM (kopf passes them on as read; PEM given raw is encoded)."""
    text = _text(value).strip()
    return base64.b64encode(text.encode()).decode() if text.startswith("-----BEGIN") else text


def kubeconfig(info: kopf.ConnectionInfo) -> dict[str, Any]:
    """A one-context kubeconfig (as a dict) carrying the credentials kopf logged in with."""
    cluster: dict[str, Any] = {"server": info.server}
    if info.insecure:
        cluster["insecure-skip-tls-verify"] = True
    if info.ca_path:
        cluster["certificate-authority"] = info.ca_path
    elif info.ca_data:
        cluster["certificate-authority-data"] = _b64(info.ca_data)
    user: dict[str, Any] = {}
    if info.token:
        user["token"] = info.token
    if info.username:
        user["username"], user["password"] = info.username, info.password or ""
    if info.certificate_path:
        user["client-certificate"] = info.certificate_path
    elif info.certificate_data:
        user["client-certificate-data"] = _b64(info.certificate_data)
    if info.private_key_path:
        user["client-key"] = info.private_key_path
    elif info.private_key_data:
        user["client-key-data"] = _b64(info.private_key_data)
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "kopf",
        "clusters": [{"name": "kopf", "cluster": cluster}],
        "users": [{"name": "kopf", "user": user}],
        "contexts": [{"name": "kopf", "context": {"cluster": "kopf", "user": "kopf",
                                                   "namespace": info.default_namespace or "default"}}],
    }


def _plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return out


class ApiClient:
    """The operator's API client (one lightkube :class:`AsyncClient`, opened on first use)."""

    def __init__(self, info: kopf.ConnectionInfo, timeout_s: float = 30.0,
                 field_manager: str = FIELD_MANAGER) -> None:
        self.info = info
        self.field_manager = field_manager
        self._timeout_s = timeout_s
        self._client: AsyncClient | None = None

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            config = KubeConfig.from_dict(kubeconfig(self.info))
            self._client = AsyncClient(config=config, timeout=_httpx.Timeout(self._timeout_s),
                                       field_manager=self.field_manager, trust_env=bool(self.info.trust_env))
        return self._client

    @staticmethod
    def _error(what: str, exc: Exception) -> ApiError:
        """The typed error of a failed request: by HTTP status (Status body or not), else no answer
        (:class:`Transient`)."""
        if not isinstance(exc, _httpx.HTTPStatusError):
            return Transient(0, f"{what}: {exc!r}")
        status = exc.response.status_code
        if isinstance(exc, _LightkubeError):
            message = f"{what}: {exc.status.message or exc}"
        else:  # an error answer without a Status body
            message = f"{what}: {exc.response.reason_phrase} {exc.response.text[:200]!r}"
        if status == 404:
            return NotFound(status, message)
        if status == 409:
            return Conflict(status, message)
        if status == 429 or status >= 500:
            return Transient(status, message)
        return Rejected(status, message)

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any]:
        try:
            return _plain(await self.client.get(resource(kind), name, namespace=namespace))
        except (_LightkubeError, _httpx.HTTPError, OSError) as exc:
            raise self._error(f"GET {kind} {namespace}/{name}", exc) from exc

    async def get_or_none(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.get(kind, namespace, name)
        except NotFound:
            return None

    async def list(self, kind: str, namespace: str | None,
                   labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Every ``kind`` in ``namespace`` (all namespaces when None), filtered by a label selector
        (equality)."""
        try:
            return [_plain(o) async for o in self.client.list(resource(kind), namespace=namespace or "*",
                                                              labels=dict(labels or {}) or None)]
        except (_LightkubeError, _httpx.HTTPError, OSError) as exc:
            raise self._error(f"LIST {kind} {namespace}", exc) from exc

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` (409 :class:`Conflict` when it exists)."""
        meta = obj["metadata"]
        try:
            created = codecs.from_dict(dict(obj))
            result = await self.client.create(  # type: ignore[call-overload]
                created, namespace=meta.get("namespace"))
            return _plain(result)
        except (_LightkubeError, _httpx.HTTPError, OSError) as exc:
            raise self._error(f"POST {obj['kind']} {meta.get('namespace')}/{meta.get('name')}", exc) from exc

    async def apply(self, obj: Mapping[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply of ``obj`` as this client's field manager; creates it when absent."""
        meta = obj["metadata"]
        try:
            result = await self.client.patch(resource(obj["kind"]), meta["name"], dict(obj),
                                             namespace=meta.get("namespace"),
                                             patch_type=PatchType.APPLY, field_manager=self.field_manager,
                                             force=force)
        except (_LightkubeError, _httpx.HTTPError, OSError) as exc:
            raise self._error(f"APPLY {obj['kind']} {meta.get('namespace')}/{meta['name']}", exc) from exc
        return _plain(result)

    async def patch(self, kind: str, namespace: str | None, name: str, body: Mapping[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): maps merge, lists and scalars replace, null deletes. ``subresource``:
        ``status``."""
        res = resource(kind)
        if subresource == "status":
            res = res.Status
        elif subresource is not None:
            raise ValueError(f"unsupported subresource {subresource!r}")
        try:
            return _plain(await self.client.patch(res, name, dict(body), namespace=namespace,
                                                  patch_type=PatchType.MERGE))
        except (_LightkubeError, _httpx.HTTPError, OSError) as exc:
            raise self._error(f"PATCH {kind}{'/' + subresource if subresource else ''} {namespace}/{name}",
                              exc) from exc

    async def delete(self, kind: str, namespace: str | None, name: str) -> None:
        try:
            await self.client.delete(resource(kind), name, namespace=namespace,
                                     cascade=CascadeType.BACKGROUND)
        except (_LightkubeError, _httpx.HTTPError, OSError) as exc:
            raise self._error(f"DELETE {kind} {namespace}/{name}", exc) from exc

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
