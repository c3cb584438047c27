"""The operator under the real kopf runtime against the kmock API emulator.

Covers: create → every child exists with an owner reference (per shard
ConfigMap, Deployment, Service; one InferencePool over all shards), status has
observedGeneration, role counts and conditions, the EPP pool registry lists the
one InferencePool; ready replicas → Ready=True; an invalid spec → InvalidSpec
condition + one Warning Event and no retry loop, then a fix recovers; scaling
down the pools deletes the extra shard and a tier change rolls the pods;
upgrading from one InferencePool per shard deletes the old ones (and their
registry entries), never someone else's; delete → registry cleaned and the
finalizer released; a user InferencePool naming the kvfleet EPP is validated
against its pods, one without endpointPickerRef is not ours.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import yaml

from kvfleet.config import Settings
from kvfleet.operator.handlers import Runtime
from kvfleet.operator.kube import ApiClient
from kvfleet.operator.manifests import (
    ANN_CONFIG_HASH,
    ANN_ROUTING,
    LABEL_AGENT,
    LABEL_POOL,
    LABEL_SHARD,
)
from tests.kmockapi import Emulator
from tests.operator import samples
from tests.operator.conftest import eventually, running_operator

NS = "default"


def _cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def _events(api: ApiClient, reason: str) -> list[dict[str, Any]]:
    return [e for e in await api.list("Event", NS) if e.get("reason") == reason]


async def test_create_renders_children_status_and_registry(operator: Runtime, api: ApiClient) -> None:
    """A KVCachePool with 2 shards gets 2×(ConfigMap, Deployment, Service) and one InferencePool, all owned; status and registry follow."""
    body = samples.kvcachepool(pools=2)
    created = await api.create(body)
    uid = created["metadata"]["uid"]

    async def children() -> bool:
        for kind, name in [*((k, f"llama-p{i}") for i in range(2) for k in ("ConfigMap", "Service")),
                           *(("Deployment", f"llama-p{i}-unified") for i in range(2)), ("InferencePool", "llama")]:
            obj = await api.get_or_none(kind, NS, name)
            assert obj is not None, f"{kind}/{name} missing"
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        return True

    await eventually(children)
    (ip,) = [p for p in await api.list("InferencePool", NS)]
    assert ip["spec"]["selector"]["matchLabels"] == {LABEL_POOL: "llama", LABEL_AGENT: "true"}
    assert yaml.safe_load(ip["metadata"]["annotations"][ANN_ROUTING])["shards"] == 2
    for i in range(2):
        dep = await api.get("Deployment", NS, f"llama-p{i}-unified")
        assert dep["spec"]["template"]["metadata"]["labels"][LABEL_SHARD] == str(i)
    pool = await eventually(lambda: _status_with(api, "llama", "observedGeneration"))
    assert pool["status"]["observedGeneration"] == 1
    assert pool["status"]["inferencePools"] == ["llama"]
    assert pool["status"]["roles"] == {"unified": {"desired": 2, "ready": 0}}
    assert _cond(pool, "InvalidSpec")["status"] == "False"
    assert _cond(pool, "Ready")["status"] == "False"
    assert _cond(pool, "Progressing")["status"] == "True"

    async def registry() -> dict[str, Any]:
        cm = await api.get("ConfigMap", "kvfleet-system", operator.settings.operator.pool_registry)
        assert "default.llama" in (cm.get("data") or {})
        return cm

    cm = await eventually(registry)
    assert sorted(cm["data"]) == ["default.llama"]
    entry = yaml.safe_load(cm["data"]["default.llama"])
    assert entry["valid"] is True and entry["model"] == samples.MINIMAL["spec"]["model"]["name"]
    assert entry["routing"]["shards"] == 2

    for i in range(2):
        await api.patch("Deployment", NS, f"llama-p{i}-unified", {"status": {"readyReplicas": 1, "replicas": 1}}, subresource="status")

    async def ready() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", NS, "llama")
        return obj if _cond(obj, "Ready").get("status") == "True" else None

    pool = await eventually(ready)
    assert pool["status"]["roles"] == {"unified": {"desired": 2, "ready": 2}}
    assert _cond(pool, "Progressing")["status"] == "False"


async def _status_with(api: ApiClient, name: str, key: str) -> dict[str, Any] | None:
    obj = await api.get("KVCachePool", NS, name)
    return obj if key in (obj.get("status") or {}) else None


async def test_invalid_spec_sets_condition_and_event_without_retry_loop(operator: Runtime, api: ApiClient) -> None:
    """Tiers out of order → InvalidSpec=True with the message, one Warning Event, no children, no retries; a fix recovers."""
    bad, message = samples.INVALID["tiers-out-of-order"]
    await api.create(bad)

    async def invalid() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", NS, "llama")
        return obj if _cond(obj, "InvalidSpec").get("status") == "True" else None

    pool = await eventually(invalid)
    assert message in _cond(pool, "InvalidSpec")["message"]
    assert _cond(pool, "Ready")["reason"] == "InvalidSpec"
    await eventually(lambda: _events(api, "InvalidSpec"))
    # Several status refresh intervals and retry back-offs later: still exactly one event, nothing rendered.
    await asyncio.sleep(2.0)
    assert len(await _events(api, "InvalidSpec")) == 1
    assert await api.get_or_none("Deployment", NS, "llama-p0-unified") is None

    fixed = copy.deepcopy(samples.MINIMAL["spec"])
    await api.patch("KVCachePool", NS, "llama", {"spec": {"tiers": [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "1Gi"}]}})

    async def recovered() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", NS, "llama")
        return obj if _cond(obj, "InvalidSpec").get("status") == "False" and obj["status"].get("observedGeneration") == 2 else None

    await eventually(recovered)
    assert await api.get_or_none("Deployment", NS, "llama-p0-unified") is not None
    assert samples.MINIMAL["spec"] == fixed  # the shared sample itself stays untouched


async def test_missing_secret_is_a_clear_condition(operator: Runtime, api: ApiClient) -> None:
    """A remote tier whose Redis Secret does not exist: Ready=False/Degraded with reason SecretNotFound naming the
    Secret and the field, a Warning Event, nothing rendered; once the Secret exists the pool reconciles."""
    pool = samples.kvcachepool(tiers=[{"name": "gpu", "gpuShare": 0.8},
                                      {"name": "remote", "capacity": "1Ti", "redis": {"urlSecretRef": {"name": "late-redis"}}}])
    await api.create(pool)

    async def blocked() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", NS, "llama")
        return obj if _cond(obj, "Ready").get("reason") == "SecretNotFound" else None

    obj = await eventually(blocked)
    msg = _cond(obj, "Degraded")["message"]
    assert "'late-redis'" in msg and "urlSecretRef" in msg and _cond(obj, "Degraded")["status"] == "True"
    await eventually(lambda: _events(api, "SecretNotFound"))
    assert await api.get_or_none("Deployment", NS, "llama-p0-unified") is None
    await api.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "late-redis", "namespace": NS}, "data": {"url": "eA=="}})
    await eventually(lambda: api.get_or_none("Deployment", NS, "llama-p0-unified"))


async def test_scale_down_and_tier_change(operator: Runtime, api: ApiClient) -> None:
    """pools 2→1 deletes the second shard's objects; replicas follow; a tier change changes the pods' config hash."""
    await api.create(samples.kvcachepool(pools=2))
    await eventually(lambda: api.get_or_none("Deployment", NS, "llama-p1-unified"))
    before = (await api.get("Deployment", NS, "llama-p0-unified"))["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH]
    await api.patch("KVCachePool", NS, "llama", {"spec": {"pools": 1, "roles": {"unified": {"replicas": 3}},
                                                          "tiers": [{"name": "gpu", "gpuShare": 0.9}, {"name": "cpu", "capacity": "2Gi"}]}})

    async def scaled() -> bool:
        assert await api.get_or_none("Deployment", NS, "llama-p1-unified") is None
        assert await api.get_or_none("Service", NS, "llama-p1") is None
        ip = await api.get("InferencePool", NS, "llama")
        assert yaml.safe_load(ip["metadata"]["annotations"][ANN_ROUTING])["shards"] == 1
        dep = await api.get("Deployment", NS, "llama-p0-unified")
        assert dep["spec"]["replicas"] == 3
        return bool(dep["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH] != before)

    await eventually(scaled)
    pool = await api.get("KVCachePool", NS, "llama")
    assert pool["status"]["pools"] == 1


async def test_upgrade_from_one_inferencepool_per_shard(k8s: Emulator, api: ApiClient, settings: Settings) -> None:
    """The old layout (InferencePool <pool>-p<i> per shard, registered) becomes one InferencePool <pool> when the operator resumes.

    The old per-shard InferencePools it controls are deleted and leave the registry;
    one of the same name pattern controlled by someone else stays.
    """
    created = await api.create(samples.kvcachepool(pools=2))
    uid = created["metadata"]["uid"]
    await api.patch("KVCachePool", NS, "llama", {"status": {"observedGeneration": 1, "pools": 3, "inferencePools": ["llama-p0", "llama-p1", "llama-p2"]}},
                    subresource="status")
    for i in range(3):
        old = samples.inferencepool(name=f"llama-p{i}", selector={"matchLabels": {LABEL_POOL: "llama", LABEL_SHARD: str(i), LABEL_AGENT: "true"}})
        old["metadata"]["ownerReferences"] = [{"apiVersion": "kvfleet.io/v1alpha1", "kind": "KVCachePool", "name": "llama",
                                               "uid": uid if i < 2 else "someone-else", "controller": True, "blockOwnerDeletion": True}]
        await api.create(old)

    async with running_operator(settings) as rt:
        async def upgraded() -> bool:
            assert await api.get_or_none("InferencePool", NS, "llama-p0") is None
            assert await api.get_or_none("InferencePool", NS, "llama-p1") is None
            ip = await api.get("InferencePool", NS, "llama")
            assert ip["spec"]["selector"]["matchLabels"] == {LABEL_POOL: "llama", LABEL_AGENT: "true"}
            obj = await api.get("KVCachePool", NS, "llama")
            assert obj["status"]["inferencePools"] == ["llama"] and obj["status"]["pools"] == 2
            cm = await api.get("ConfigMap", "kvfleet-system", rt.settings.operator.pool_registry)
            assert {k for k in cm.get("data") or {} if (cm["data"][k] is not None)} == {"default.llama", "default.llama-p2"}
            return True

        await eventually(upgraded)
        assert await api.get_or_none("InferencePool", NS, "llama-p2") is not None  # not ours: kept
        assert await api.get_or_none("Service", NS, "llama-p1") is not None  # shards stay pod subsets with their Services


async def test_delete_cleans_registry_and_releases_finalizer(operator: Runtime, api: ApiClient) -> None:
    """Deleting a KVCachePool runs the delete handler: registry entries go, the object goes."""
    await api.create(samples.kvcachepool())
    name = operator.settings.operator.pool_registry

    async def registered() -> bool:
        cm = await api.get_or_none("ConfigMap", "kvfleet-system", name)
        return cm is not None and "default.llama" in (cm.get("data") or {})

    await eventually(registered)
    await eventually(lambda: _status_with(api, "llama", "inferencePools"))
    await api.delete("KVCachePool", NS, "llama")

    async def gone() -> bool:
        assert await api.get_or_none("KVCachePool", NS, "llama") is None
        cm = await api.get("ConfigMap", "kvfleet-system", name)
        data: dict[str, str] = cm.get("data") or {}
        return data.get("default.llama") is None

    await eventually(gone)


async def test_user_inferencepool_is_validated(operator: Runtime, api: ApiClient) -> None:
    """A user InferencePool naming the kvfleet EPP with a wrong port and agent-less pods is registered invalid, with Warning Events."""
    await api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm-0", "namespace": NS, "labels": {"app": "vllm", "kvfleet.io/agent": "true"}},
                      "spec": {"containers": [{"name": "vllm", "image": "vllm", "ports": [{"containerPort": 8000}]}]}})
    await api.create(samples.inferencepool(name="user-pool", endpointPickerRef={"name": "kvfleet-epp", "port": {"number": 9999}}))

    async def registered() -> dict[str, Any] | None:
        cm = await api.get_or_none("ConfigMap", "kvfleet-system", operator.settings.operator.pool_registry)
        text = ((cm or {}).get("data") or {}).get("default.user-pool")
        return yaml.safe_load(text) if text else None

    entry = await eventually(registered)
    assert entry["valid"] is False
    assert any("9999" in p for p in entry["problems"])
    assert any("vllm-0" in p and "agent" in p for p in entry["problems"])
    await eventually(lambda: _events(api, "InvalidInferencePool"))

    # Pools that name another endpoint picker, or none (optional since GIE v1.6), are not ours: never registered.
    await api.create(samples.inferencepool(name="other", endpointPickerRef={"name": "someone-else", "port": {"number": 9002}}))
    no_epp = samples.inferencepool(name="no-epp")
    del no_epp["spec"]["endpointPickerRef"]
    await api.create(no_epp)
    await asyncio.sleep(0.5)
    cm = await api.get("ConfigMap", "kvfleet-system", operator.settings.operator.pool_registry)
    assert "default.other" not in (cm.get("data") or {}) and "default.no-epp" not in (cm.get("data") or {})
