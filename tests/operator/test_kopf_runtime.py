"""The operator under the real kopf runtime against the kmock API emulator.

Covers: create → every child exists with an owner reference, status has
observedGeneration, role counts and conditions, the EPP pool registry lists the
InferencePools; ready replicas → Ready=True; an invalid spec → InvalidSpec
condition + one Warning Event and no retry loop, then a fix recovers; scaling
down the pools deletes the extra shard and a tier change rolls the pods;
delete → registry cleaned and the finalizer released; a user InferencePool
naming the kvfleet EPP is validated against its pods.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import yaml

from kvfleet.operator.handlers import Runtime
from kvfleet.operator.kube import ApiClient
from kvfleet.operator.manifests import AGENT_CONTAINER, ANN_CONFIG_HASH
from tests.operator import samples
from tests.operator.conftest import eventually

NS = "default"


def _cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def _events(api: ApiClient, reason: str) -> list[dict[str, Any]]:
    return [e for e in await api.list("Event", NS) if e.get("reason") == reason]


async def test_create_renders_children_status_and_registry(operator: Runtime, api: ApiClient) -> None:
    """A KVCachePool with 2 pools gets 2×(ConfigMap, Deployment, Service, InferencePool), all owned; status and registry follow."""
    body = samples.kvcachepool(pools=2)
    created = await api.create(body)
    uid = created["metadata"]["uid"]

    async def children() -> bool:
        for i in range(2):
            for kind, name in (("ConfigMap", f"llama-p{i}"), ("Deployment", f"llama-p{i}-unified"), ("Service", f"llama-p{i}"), ("InferencePool", f"llama-p{i}")):
                obj = await api.get_or_none(kind, NS, name)
                assert obj is not None, f"{kind}/{name} missing"
                assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        return True

    await eventually(children)
    pool = await eventually(lambda: _status_with(api, "llama", "observedGeneration"))
    assert pool["status"]["observedGeneration"] == 1
    assert pool["status"]["inferencePools"] == ["llama-p0", "llama-p1"]
    assert pool["status"]["roles"] == {"unified": {"desired": 2, "ready": 0}}
    assert _cond(pool, "InvalidSpec")["status"] == "False"
    assert _cond(pool, "Ready")["status"] == "False"
    assert _cond(pool, "Progressing")["status"] == "True"

    async def registry() -> dict[str, Any]:
        cm = await api.get("ConfigMap", "kvfleet-system", operator.settings.operator.pool_registry)
        assert {"default.llama-p0", "default.llama-p1"} <= set(cm.get("data") or {})
        return cm

    cm = await eventually(registry)
    entry = yaml.safe_load(cm["data"]["default.llama-p0"])
    assert entry["valid"] is True and entry["model"] == samples.MINIMAL["spec"]["model"]["name"]

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
    assert fixed  # the sample itself stays untouched


async def test_scale_down_and_tier_change(operator: Runtime, api: ApiClient) -> None:
    """pools 2→1 deletes the second shard's objects; replicas follow; a tier change changes the pods' config hash."""
    await api.create(samples.kvcachepool(pools=2))
    await eventually(lambda: api.get_or_none("Deployment", NS, "llama-p1-unified"))
    before = (await api.get("Deployment", NS, "llama-p0-unified"))["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH]
    await api.patch("KVCachePool", NS, "llama", {"spec": {"pools": 1, "roles": {"unified": {"replicas": 3}},
                                                          "tiers": [{"name": "gpu", "gpuShare": 0.9}, {"name": "cpu", "capacity": "2Gi"}]}})

    async def scaled() -> bool:
        assert await api.get_or_none("Deployment", NS, "llama-p1-unified") is None
        assert await api.get_or_none("InferencePool", NS, "llama-p1") is None
        dep = await api.get("Deployment", NS, "llama-p0-unified")
        assert dep["spec"]["replicas"] == 3
        return bool(dep["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH] != before)

    await eventually(scaled)
    pool = await api.get("KVCachePool", NS, "llama")
    assert pool["status"]["pools"] == 1


async def test_delete_cleans_registry_and_releases_finalizer(operator: Runtime, api: ApiClient) -> None:
    """Deleting a KVCachePool runs the delete handler: registry entries go, the object goes."""
    await api.create(samples.kvcachepool())
    name = operator.settings.operator.pool_registry

    async def registered() -> bool:
        cm = await api.get_or_none("ConfigMap", "kvfleet-system", name)
        return cm is not None and "default.llama-p0" in (cm.get("data") or {})

    await eventually(registered)
    await eventually(lambda: _status_with(api, "llama", "inferencePools"))
    await api.delete("KVCachePool", NS, "llama")

    async def gone() -> bool:
        assert await api.get_or_none("KVCachePool", NS, "llama") is None
        cm = await api.get("ConfigMap", "kvfleet-system", name)
        data: dict[str, str] = cm.get("data") or {}
        return data.get("default.llama-p0") is None

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

    # Pools that name another endpoint picker are not ours: never registered.
    await api.create(samples.inferencepool(name="other", endpointPickerRef={"name": "someone-else", "port": {"number": 9002}}))
    await asyncio.sleep(0.5)
    cm = await api.get("ConfigMap", "kvfleet-system", operator.settings.operator.pool_registry)
    assert "default.other" not in (cm.get("data") or {})
    assert AGENT_CONTAINER == "kvfleet-agent"
