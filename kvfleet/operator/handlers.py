"""kopf handlers: KVCachePool reconciliation, status refresh, InferencePool checks.

:func:`build_registry` returns a fresh :class:`kopf.OperatorRegistry` bound to one
:class:`Runtime` (settings, the API client), so tests
run the real kopf runtime with their own registry and nothing is global.

Error policy (typed, never by message):

* :class:`~kvfleet.operator.spec.InvalidSpecError` → status ``InvalidSpec`` +
  Warning Event + :class:`kopf.PermanentError` (no retries until the spec changes);
* :class:`~kvfleet.operator.kube.Transient` (5xx, 429, no answer) →
  :class:`kopf.TemporaryError` with ``operator.retry_backoff_s``;
* :class:`~kvfleet.operator.kube.Rejected` (the API refused a rendered child) →
  ``Degraded`` + Warning Event + :class:`kopf.PermanentError`;
* :class:`~kvfleet.operator.apply.ForeignOwnerError` → ``Degraded`` + Warning
  Event, retried slowly (the other owner may go away);
* a Secret the pool references (the transfer secret, the remote tier's Redis URL)
  missing, or lacking its key → ``Ready=False``/``Degraded`` with reason
  ``SecretNotFound`` naming the Secret, key and field, a Warning Event, and a slow
  retry (the Secret may be created later); nothing is applied until it exists.

A condition that persists (SecretNotFound, ForeignOwner) is retried with exponential back-off
(:func:`retry_delay`) and its Warning Event is written when the condition appears or changes,
not on every retry; the status condition stays current on each one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvfleet.config import Settings
from kvfleet.operator import inferencepools
from kvfleet.operator.apply import ForeignOwnerError, apply, controller_uid
from kvfleet.operator.kube import ApiClient, NotFound, Rejected, Transient
from kvfleet.operator.manifests import (
    GROUP,
    IP_GROUP,
    IP_VERSION,
    LABEL_POOL,
    PLURAL,
    VERSION,
    inferencepool_name,
    render_children,
    shard_name,
)
from kvfleet.operator.spec import InvalidSpecError, PoolSpec, parse_spec
from kvfleet.operator.status import degraded_conditions, healthy_conditions, invalid_conditions, role_counts


@dataclass
class Runtime:
    """What the handlers share: settings, the API client, the problems last reported per InferencePool."""

    settings: Settings = field(default_factory=Settings)
    connection: kopf.ConnectionInfo | None = None
    _api: ApiClient | None = None
    #: ``(namespace, name)`` → the problems last posted as Warning Events, so an unchanged pool is not
    #: reported again.
    pool_problems: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    #: ``(namespace, name)`` of a KVCachePool → the (reason, message) of the lasting condition last posted
    #: as a Warning Event (a missing Secret, a foreign owner): a retry that finds it unchanged posts none.
    pool_warnings: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def warn_once(self, body: kopf.Body, reason: str, message: str) -> None:
        """A Warning Event for ``reason``/``message`` unless it is the pool's last one."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if self.pool_warnings.get(key) != (reason, message):
            self.pool_warnings[key] = (reason, message)
            kopf.warn(body, reason=reason, message=message)

    @property
    def api(self) -> ApiClient:
        if self._api is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
            self._api = ApiClient(self.connection)
        return self._api

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None


#: Degraded reasons under which nothing is applied until the reconcile succeeds (its retries keep them)
BLOCKED = frozenset({"SecretNotFound", "ForeignOwner", "ChildRejected"})
#: the longest delay between retries of a persisting condition (a missing Secret, a foreign owner)
MAX_RETRY_DELAY_S = 300.0


def retry_delay(base_s: float, retry: int) -> float:
    """``base_s · 2^retry``, at most :data:`MAX_RETRY_DELAY_S`: the n-th retry of a lasting condition."""
    return min(MAX_RETRY_DELAY_S, base_s * 2.0 ** min(max(retry, 0), 30))


def _temporary(exc: Exception, delay: float) -> kopf.TemporaryError:
    return kopf.TemporaryError(f"transient API error, retrying in {delay:g}s: {exc}", delay=delay)


async def _patch_status(rt: Runtime, namespace: str, name: str, status: Mapping[str, Any]) -> None:
    await rt.api.patch("KVCachePool", namespace, name, {"status": dict(status)}, subresource="status")


async def _deployments(rt: Runtime, namespace: str, name: str,
                       spec: PoolSpec) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for i in range(spec.pools):
        for r in spec.roles:
            dname = f"{shard_name(name, i)}-{r.name}"
            out[dname] = await rt.api.get_or_none("Deployment", namespace, dname)
    return out


#: The kinds of a KVCachePool's children, found by label selector when pruning.
CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "InferencePool")


async def _delete_stale(
    rt: Runtime, body: Mapping[str, Any], desired: set[tuple[str, str]],
    old_inference_pools: Sequence[str] = (),
) -> list[str]:
    """Delete owned children that the current spec does not render (fewer pools, other roles).

    Children are found by label selector (``kvfleet.io/pool=<name>``) and deleted only when
    this KVCachePool controls them. So are the InferencePools its status lists that the
    rendering lacks: a pool reconciled under the per-shard layout (one ``<pool>-p<i>`` per
    shard) lists those, and is left with exactly one.
    """
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid")
    candidates: dict[tuple[str, str], Mapping[str, Any] | None] = {}
    for kind in CHILD_KINDS:
        for obj in await rt.api.list(kind, namespace, {LABEL_POOL: name}):
            candidates[(kind, obj["metadata"]["name"])] = obj
    for old in old_inference_pools:
        candidates.setdefault(("InferencePool", str(old)), None)
    deleted = []
    for (kind, cname), listed in sorted(candidates.items()):
        if (kind, cname) in desired:
            continue
        live = listed if listed is not None else await rt.api.get_or_none(kind, namespace, cname)
        if live is None or controller_uid(live) != uid:
            continue
        try:
            await rt.api.delete(kind, namespace, cname)
            deleted.append(f"{kind}/{cname}")
        except NotFound:
            pass
    return deleted


async def missing_secrets(rt: Runtime, namespace: str, spec: PoolSpec) -> list[str]:
    """What is wrong with the Secrets ``spec`` references, one readable line each (empty: all there).

    Without the right to read Secrets (403) nothing is reported: the pods' own events will say it."""
    op = rt.settings.operator
    refs = [(spec.transfer.secret.name if spec.transfer.secret else op.transfer_secret,
             spec.transfer.secret.key if spec.transfer.secret else op.transfer_secret_key,
             "spec.transfer.secretRef" if spec.transfer.secret else "the chart's transfer secret")]
    remote = spec.tier("remote")
    if remote is not None and remote.redis_url is not None:
        refs.append((remote.redis_url.name, remote.redis_url.key, "spec.tiers[remote].redis.urlSecretRef"))
    out: list[str] = []
    for secret, key, where in refs:
        try:
            obj = await rt.api.get_or_none("Secret", namespace, secret)
        except Rejected:
            return []
        if obj is None:
            out.append(f"Secret {secret!r} ({where}) not found in namespace {namespace!r}")
        elif key not in (obj.get("data") or {}) and key not in (obj.get("stringData") or {}):
            out.append(f"Secret {secret!r} ({where}) has no key {key!r}")
    return out


async def reconcile(rt: Runtime, body: kopf.Body,
                    logger: logging.Logger | logging.LoggerAdapter[Any], retry: int = 0) -> dict[str, Any]:
    """Make a KVCachePool's children match its spec and report status (``retry``: kopf's count of
    earlier failed attempts of this change)."""
    meta, status = body["metadata"], body.get("status") or {}
    namespace, name = meta["namespace"], meta["name"]
    generation = int(meta.get("generation") or 1)
    conditions = list(status.get("conditions") or [])
    try:
        spec = parse_spec(body.get("spec"), name)
        # pure; what the engine version cannot do is invalid too
        children = render_children(body, spec, rt.settings)
    except InvalidSpecError as exc:
        await _patch_status(rt, namespace, name,
                            {"observedGeneration": generation,
                             "conditions": invalid_conditions(conditions, str(exc), generation)})
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    backoff = rt.settings.operator.retry_backoff_s
    try:
        missing = await missing_secrets(rt, namespace, spec)
    except Transient as exc:
        raise _temporary(exc, backoff) from exc
    if missing:
        msg = "; ".join(missing)
        await _patch_status(rt, namespace, name, {"observedGeneration": generation,
                                                  "conditions": degraded_conditions(
                                                      conditions, "SecretNotFound", msg, generation)})
        rt.warn_once(body, "SecretNotFound", msg)
        raise kopf.TemporaryError(msg, delay=retry_delay(backoff, retry))
    results: dict[str, int] = {"created": 0, "patched": 0, "unchanged": 0}
    try:
        for child in children:
            results[await apply(rt.api, child)] += 1
        deleted = await _delete_stale(rt, body, {(c["kind"], c["metadata"]["name"]) for c in children},
                                      list(status.get("inferencePools") or []))
        deployments = await _deployments(rt, namespace, name, spec)
    except Transient as exc:
        raise _temporary(exc, backoff) from exc
    except (Rejected, ForeignOwnerError) as exc:
        reason = "ChildRejected" if isinstance(exc, Rejected) else "ForeignOwner"
        await _patch_status(rt, namespace, name,
                            {"observedGeneration": generation,
                             "conditions": degraded_conditions(conditions, reason, str(exc), generation)})
        if isinstance(exc, Rejected):
            kopf.warn(body, reason=reason, message=str(exc))
        else:
            rt.warn_once(body, reason, str(exc))
        if isinstance(exc, Rejected):
            raise kopf.PermanentError(str(exc)) from exc
        raise kopf.TemporaryError(str(exc), delay=max(60.0, retry_delay(backoff, retry))) from exc
    new_status = {
        "observedGeneration": generation,
        "pools": spec.pools,
        "inferencePools": [inferencepool_name(name)],
        "roles": role_counts(name, spec, deployments),
        "conditions": healthy_conditions(conditions, name, spec, deployments, generation),
    }
    await _patch_status(rt, namespace, name, new_status)
    rt.pool_warnings.pop((namespace, name), None)
    if results["created"] or results["patched"] or deleted:
        msg = f"{results['created']} created, {results['patched']} updated, {len(deleted)} deleted"
        kopf.info(body, reason="Reconciled", message=msg)
        logger.info("reconciled: %s", msg)
    return results


async def refresh_status(rt: Runtime, body: kopf.Body) -> None:
    """Ready counts and conditions from the Deployments; writes only when something changed."""
    meta, status = body["metadata"], body.get("status") or {}
    generation = int(meta.get("generation") or 1)
    if status.get("observedGeneration") != generation:
        return  # the reconcile of this generation has not finished (or failed): it owns the status
    try:
        spec = parse_spec(body.get("spec"), meta["name"])
    except InvalidSpecError:
        return
    conditions = list(status.get("conditions") or [])
    if any(c.get("type") == "InvalidSpec" and c.get("status") == "True" for c in conditions):
        return
    if any(c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") in BLOCKED
           for c in conditions):
        return  # the reconcile, retried with back-off, owns the status until what blocks it is gone
    try:
        deployments = await _deployments(rt, meta["namespace"], meta["name"], spec)
    except Transient:
        return  # the next tick retries
    roles = role_counts(meta["name"], spec, deployments)
    new_conditions = healthy_conditions(conditions, meta["name"], spec, deployments, generation)
    if roles != status.get("roles") or new_conditions != conditions:
        await _patch_status(rt, meta["namespace"], meta["name"],
                            {"roles": roles, "conditions": new_conditions})


async def check_inferencepool(rt: Runtime, event_type: str | None, body: kopf.Body,
                              logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Check an InferencePool that names the kvfleet EPP; each new set of problems becomes Warning Events."""
    meta = body.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    op = rt.settings.operator
    if event_type == "DELETED" or not inferencepools.names_kvfleet_epp(body, op):
        rt.pool_problems.pop(key, None)
        return
    pods = await rt.api.list("Pod", meta.get("namespace"))
    problems = tuple(inferencepools.validate(body, pods, op))
    if rt.pool_problems.get(key) == problems:
        return
    rt.pool_problems[key] = problems
    for problem in problems:
        kopf.warn(body, reason="InvalidInferencePool", message=problem)
    logger.info("InferencePool checked: %s", "sound" if not problems else f"{len(problems)} problem(s)")


def build_registry(rt: Runtime, *, login: bool = True) -> kopf.OperatorRegistry:
    """All handlers of ``kvfleet operator``, bound to ``rt``."""
    registry = kopf.OperatorRegistry()
    op = rt.settings.operator

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf keeps this finalizer on each KVCachePool while its status timer runs and releases it on
        # deletion; the children go by garbage collection (owner references), no delete handler needed.
        settings.persistence.finalizer = "kvfleet.io/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvfleet.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvfleet.io", key="last-handled-configuration")
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.queueing.error_delays = [1, 2, 5, 10, 30]

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await rt.close()

    if login:
        @kopf.on.login(registry=registry)
        def authenticate(**kwargs: Any) -> kopf.ConnectionInfo | None:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
            rt.connection = info
            return info

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    async def kvcachepool_reconcile(body: kopf.Body, logger: kopf.Logger, retry: int,
                                    **_: Any) -> dict[str, Any]:
        return await reconcile(rt, body, logger, retry)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=op.status_interval_s, registry=registry)
    async def kvcachepool_status(body: kopf.Body, **_: Any) -> None:
        await refresh_status(rt, body)

    @kopf.on.event(IP_GROUP, IP_VERSION, "inferencepools", registry=registry)
    async def inferencepool_event(type: str | None, body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        try:
            await check_inferencepool(rt, type, body, logger)
        except Transient as exc:
            logger.warning("InferencePool not checked (will retry on the next event): %s", exc)

    return registry
