"""A small asyncio Kubernetes API client for the objects the operator owns.

kopf watches and patches the resources it handles; the operator's children
(ConfigMaps, Deployments, Services, InferencePools) are written through this
client, with the same credentials kopf logged in with (:class:`kopf.ConnectionInfo`).
It speaks only what the operator needs — GET, POST, JSON merge PATCH, DELETE,
namespace LIST without selectors — and turns HTTP failures into typed errors
whose type decides what happens next (:class:`Transient` → retry with back-off,
:class:`Rejected` → a permanent condition on the owner, :class:`NotFound` /
:class:`Conflict` → handled by the caller).
"""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

#: kind → (api prefix, plural) of what the operator reads and writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("api/v1", "configmaps"),
    "Service": ("api/v1", "services"),
    "Pod": ("api/v1", "pods"),
    "Secret": ("api/v1", "secrets"),
    "Event": ("api/v1", "events"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "InferencePool": ("apis/inference.networking.k8s.io/v1", "inferencepools"),
    "KVCachePool": ("apis/kvfleet.io/v1alpha1", "kvcachepools"),
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


def path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    """The API path of a kind (collection when ``name`` is None)."""
    try:
        prefix, plural = RESOURCES[kind]
    except KeyError:
        raise KeyError(f"unknown kind {kind!r}; known: {', '.join(sorted(RESOURCES))}") from None
    out = f"/{prefix}/namespaces/{namespace}/{plural}" if namespace else f"/{prefix}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ctx = ssl.create_default_context()
    if info.ca_path:
        ctx.load_verify_locations(cafile=info.ca_path)
    elif info.ca_data:
        data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        ctx.load_verify_locations(cadata=data)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        files = []
        for blob in (info.certificate_data, info.private_key_data):
            f = tempfile.NamedTemporaryFile(prefix="kvfleet-", suffix=".pem", delete=False)  # noqa: SIM115
            f.write(blob if isinstance(blob, bytes) else blob.encode())
            f.close()
            files.append(f.name)
        cert, key = files
    if cert:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    return ctx


class ApiClient:
    """JSON over HTTP to the API server; one aiohttp session per client."""

    def __init__(self, info: kopf.ConnectionInfo, timeout_s: float = 30.0) -> None:
        self.info = info
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.info.token:
            headers["Authorization"] = f"{self.info.scheme or 'Bearer'} {self.info.token}"
        return headers

    async def _request(self, method: str, url_path: str, body: Any = None, content_type: str = "application/json") -> Any:
        if self._session is None:
            auth = aiohttp.BasicAuth(self.info.username, self.info.password or "") if self.info.username else None
            connector = aiohttp.TCPConnector(ssl=_ssl_context(self.info))
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auth=auth)
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            async with self._session.request(method, self.info.server.rstrip("/") + url_path, json=body, headers=headers) as resp:
                if resp.status < 400:
                    return await resp.json(content_type=None)
                text = (await resp.text())[:500]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Transient(0, f"{method} {url_path}: {exc!r}") from exc
        status = resp.status
        message = f"{method} {url_path}: {text}"
        if status == 404:
            raise NotFound(status, message)
        if status == 409:
            raise Conflict(status, message)
        if status == 429 or status >= 500:
            raise Transient(status, message)
        raise Rejected(status, message)

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("GET", path(kind, namespace, name))
        return result

    async def get_or_none(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.get(kind, namespace, name)
        except NotFound:
            return None

    async def list(self, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        result = await self._request("GET", path(kind, namespace))
        return list(result.get("items") or [])

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        result: dict[str, Any] = await self._request("POST", path(obj["kind"], meta.get("namespace")), dict(obj))
        return result

    async def patch(self, kind: str, namespace: str | None, name: str, body: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): maps merge, lists and scalars replace, null deletes."""
        result: dict[str, Any] = await self._request(
            "PATCH", path(kind, namespace, name, subresource), dict(body), "application/merge-patch+json"
        )
        return result

    async def delete(self, kind: str, namespace: str | None, name: str) -> None:
        await self._request("DELETE", path(kind, namespace, name), {"propagationPolicy": "Background"})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
