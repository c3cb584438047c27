"""The operator (the real kopf runtime with kvfleet's handlers) against the real kube-apiserver
and kube-controller-manager of tests/conftest.py, one fresh namespace per test.

Covers: every sample KVCachePool reconciled into its children (per shard ConfigMap,
Deployments, Service; one InferencePool over all shards), each with a controlling owner
reference and written by server-side apply as field manager ``kvfleet-operator``, and its
status (observedGeneration, pools, role counts, conditions), its InferencePool checked sound; a
steady state writes nothing (a resync changes no generation and none of the operator's
managedFields entries); spec changes converge
— a removed tier's fields disappear from the children (what a merge patch left behind), a
field another manager added stays; scaling the pools down prunes the extra shard by label
selector; the upgrade from one InferencePool per shard deletes the old ones it controls and
keeps someone else's; a child name taken by another owner is a ForeignOwner condition and
the object is left alone; a missing Secret is a SecretNotFound condition until it exists; a
KVCachePool stored before a CEL rule existed (admission bypassed) gets InvalidSpec and one
Warning Event, no retry loop, and recovers when fixed; deleting a pool releases the
finalizer and the controller-manager's garbage collector removes every child; a user
InferencePool naming the kvfleet EPP is checked against its pods (Warning Events).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import kopf
import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from kvfleet.config import Settings
from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.handlers import Runtime
from kvfleet.operator.kube import FIELD_MANAGER, ApiClient
from kvfleet.operator.manifests import ANN_CONFIG_HASH, ANN_ROUTING, LABEL_AGENT, LABEL_POOL, LABEL_SHARD
from tests.cluster.conftest import KVCP_CRD, Kube
from tests.conftest import eventually
from tests.operator import samples
from tests.operator.runtime import running_operator

SECRETS = (("kvfleet-transfer", "secret"), ("kv-transfer", "secret"), ("kv-redis", "url"))


@pytest.fixture()
def ns(crds: Kube, namespaces: Callable[..., str]) -> str:
    """A fresh namespace with the Secrets the samples reference."""
    name = namespaces("op")
    crds.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": s, "namespace": name},
                 "stringData": {k: "s3cret"}}
                for s, k in SECRETS])
    return name


@pytest.fixture()
def settings() -> Settings:
    return Settings(operator=OperatorSettings(status_interval_s=0.5, retry_backoff_s=0.5))


@pytest.fixture()
def admin_env(control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> ControlPlane:
    """kopf logs in with the admin kubeconfig."""
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
    return control_plane


@pytest.fixture()
async def api(control_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    """The operator's own client, as the admin, for the test's reads and writes."""
    pki = control_plane.pki
    client = ApiClient(kopf.ConnectionInfo(server=control_plane.server, ca_path=str(pki / "ca.crt"),
                                           certificate_path=str(pki / "admin.crt"),
                                           private_key_path=str(pki / "admin.key")),
                       field_manager="kvfleet-test")
    yield client
    await client.close()


@pytest.fixture()
async def operator(ns: str, admin_env: ControlPlane, settings: Settings) -> AsyncIterator[Runtime]:
    async with running_operator(settings, ns) as rt:
        yield rt


def _cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def _events(api: ApiClient, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in await api.list("Event", ns) if e.get("reason") == reason]


async def _status_with(
    api: ApiClient, ns: str, name: str, key: str, value: Any = None,
) -> dict[str, Any] | None:
    obj = await api.get("KVCachePool", ns, name)
    status = obj.get("status") or {}
    return obj if key in status and (value is None or status[key] == value) else None


def _children(spec: dict[str, Any], name: str) -> list[tuple[str, str]]:
    roles = [r for r in ("unified", "prefill", "decode") if r in (spec.get("roles") or {})] or ["unified"]
    out: list[tuple[str, str]] = [("InferencePool", name)]
    for i in range(int(spec.get("pools", 1))):
        out += [("ConfigMap", f"{name}-p{i}"), ("Service", f"{name}-p{i}")] + [
            ("Deployment", f"{name}-p{i}-{r}") for r in roles]
    return out


def _our_writes(obj: dict[str, Any]) -> tuple[Any, ...]:
    """What changes when the operator writes ``obj``: its spec generation and the operator's managedFields
    entries (fields owned, time of the last change). The resourceVersion is not it: the real
    controller-manager writes a Deployment's status on its own schedule."""
    meta = obj["metadata"]
    mine = sorted((m.get("operation"), m.get("subresource", ""), m.get("time"), json.dumps(m.get("fieldsV1")))
                  for m in meta.get("managedFields") or [] if m["manager"] == FIELD_MANAGER)
    # nothing else in this cluster writes a ConfigMap: any new revision of one is the operator's
    version = meta["resourceVersion"] if obj["kind"] == "ConfigMap" else None
    return meta.get("generation"), tuple(mine), version


@pytest.mark.parametrize("sample", sorted(samples.VALID))
async def test_every_sample_reconciles_into_owned_applied_children(
    operator: Runtime, api: ApiClient, ns: str, sample: str,
) -> None:
    body = copy.deepcopy(samples.VALID[sample])
    body["metadata"]["namespace"] = ns
    name = body["metadata"]["name"]
    created = await api.create(body)
    uid = created["metadata"]["uid"]
    pool = await eventually(lambda: _status_with(api, ns, name, "observedGeneration", 1),
                            f"{name} reconciled")
    live = {}
    for kind, cname in _children(body["spec"], name):
        obj = await api.get(kind, ns, cname)
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True and ref["blockOwnerDeletion"] is True
        assert obj["metadata"]["labels"][LABEL_POOL] == name
        managers = {(m["manager"], m["operation"]) for m in obj["metadata"].get("managedFields") or []}
        assert (FIELD_MANAGER, "Apply") in managers, managers
        live[(kind, cname)] = _our_writes(obj)
    # exactly these children carry the pool's label
    listed = {(k, o["metadata"]["name"]) for k in ("Deployment", "Service", "ConfigMap", "InferencePool")
              for o in await api.list(k, ns, {LABEL_POOL: name})}
    assert listed == set(live)
    (ip,) = await api.list("InferencePool", ns)
    assert ip["spec"]["selector"]["matchLabels"] == {LABEL_POOL: name, LABEL_AGENT: "true"}
    assert yaml.safe_load(ip["metadata"]["annotations"][ANN_ROUTING])["shards"] == int(
        body["spec"].get("pools", 1))
    status = pool["status"]
    assert status["inferencePools"] == [name] and status["pools"] == int(body["spec"].get("pools", 1))
    assert all(v["ready"] == 0 for v in status["roles"].values())
    assert _cond(pool, "InvalidSpec")["status"] == "False"
    assert _cond(pool, "Ready")["status"] == "False"  # no node runs the pods here
    assert _cond(pool, "Progressing")["status"] == "True"

    async def checked_sound() -> bool:
        return operator.pool_problems.get((ns, name)) == ()

    await eventually(checked_sound, f"InferencePool {name} checked, with no problem")

    # A resync (kopf's resume on a restart) applies the same rendering: no object gets a new revision.
    await api.patch("KVCachePool", ns, name, {"metadata": {"annotations": {"test/touch": "1"}}})
    await asyncio.sleep(2.0)  # a time gap: the resync has had time to write, if it were going to
    for (kind, cname), ours in live.items():
        now = _our_writes(await api.get(kind, ns, cname))
        assert now == ours, f"{kind}/{cname} rewritten in a steady state"


async def test_removed_tier_fields_disappear_and_foreign_fields_stay(
    operator: Runtime, api: ApiClient, ns: str,
) -> None:
    """cpu + ssd tiers → gpu only: the shm volume loses its size limit, the ssd volume and mount go, the
    ConfigMap's tier settings go; an annotation another manager put on the Deployment stays (server-side apply
    field ownership)."""
    tiers = [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "1Gi"},
             {"name": "ssd", "capacity": "4Gi"}]
    await api.create(samples.kvcachepool("conv", ns, tiers=tiers))
    await eventually(lambda: _status_with(api, ns, "conv", "observedGeneration", 1), "conv reconciled")
    dep = await api.get("Deployment", ns, "conv-p0-unified")
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert "sizeLimit" in vols["shm"]["emptyDir"] and "ssd" in vols
    cm = await api.get("ConfigMap", ns, "conv-p0")
    assert yaml.safe_load(cm["data"]["unified.yaml"])["engine"]["tiers"]["ssd_blocks"] > 0
    await api.patch("Deployment", ns, "conv-p0-unified",
                    {"metadata": {"annotations": {"mesh.example/inject": "true"}}})
    before = dep["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH]

    await api.patch("KVCachePool", ns, "conv", {"spec": {"tiers": [{"name": "gpu", "gpuShare": 0.8}]}})
    await eventually(lambda: _status_with(api, ns, "conv", "observedGeneration", 2),
                     "conv's tier change reconciled")
    dep = await api.get("Deployment", ns, "conv-p0-unified")
    spec = dep["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory"}, vols["shm"]
    assert "ssd" not in vols
    assert all(m["name"] != "ssd" for c in spec["containers"] for m in c["volumeMounts"])
    assert dep["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH] != before
    assert dep["metadata"]["annotations"]["mesh.example/inject"] == "true"
    tiers_cfg = yaml.safe_load(
        (await api.get("ConfigMap", ns, "conv-p0"))["data"]["unified.yaml"])["engine"]["tiers"]
    assert tiers_cfg["ssd_blocks"] == 0 and tiers_cfg["cpu_blocks"] == 0 and tiers_cfg["ssd_dir"] == ""


async def test_fields_an_earlier_rendering_set_are_removed(
    operator: Runtime, api: ApiClient, ns: str, control_plane: ControlPlane,
) -> None:
    """What an earlier rendering set and this one does not is removed: after an earlier server-side apply (an
    older operator version's annotation), and after an earlier kvfleet that wrote by merge patch (manager
    kvfleet-operator, operation Update, migrated to Apply as client-go's csaupgrade does). A merge patch of
    the rendering left both."""
    await api.create(samples.kvcachepool("old", ns))
    await eventually(lambda: _status_with(api, ns, "old", "observedGeneration", 1), "old reconciled")
    pki = control_plane.pki
    older = ApiClient(kopf.ConnectionInfo(server=control_plane.server, ca_path=str(pki / "ca.crt"),
                                          certificate_path=str(pki / "admin.crt"),
                                          private_key_path=str(pki / "admin.key")),
                      field_manager=FIELD_MANAGER)
    try:
        svc = await api.get("Service", ns, "old-p0")
        await older.apply({"apiVersion": "v1", "kind": "Service", "metadata": {
            "name": "old-p0", "namespace": ns, "annotations": {"kvfleet.io/rendered-by-v0": "ssa"},
            "ownerReferences": svc["metadata"]["ownerReferences"]}})
        await older.patch("ConfigMap", ns, "old-p0",
                          {"metadata": {"annotations": {"kvfleet.io/rendered-by-v0": "merge-patch"}}})
    finally:
        await older.close()
    cm = await api.get("ConfigMap", ns, "old-p0")
    assert {(m["manager"], m["operation"]) for m in cm["metadata"]["managedFields"]} >= {
        (FIELD_MANAGER, "Update")}
    await api.patch("KVCachePool", ns, "old", {"spec": {"roles": {"unified": {"replicas": 2}}}})
    await eventually(lambda: _status_with(api, ns, "old", "observedGeneration", 2),
                     "old's replica change reconciled")
    for kind in ("Service", "ConfigMap"):
        obj = await api.get(kind, ns, "old-p0")
        assert "kvfleet.io/rendered-by-v0" not in (obj["metadata"].get("annotations") or {}), (
            kind, obj["metadata"])
    cm = await api.get("ConfigMap", ns, "old-p0")
    assert (FIELD_MANAGER, "Update") not in {
        (m["manager"], m["operation"]) for m in cm["metadata"]["managedFields"]}


async def test_scale_down_prunes_the_extra_shard_by_label(operator: Runtime, api: ApiClient, ns: str) -> None:
    await api.create(samples.kvcachepool("llama", ns, pools=2))
    await eventually(lambda: api.get_or_none("Deployment", ns, "llama-p1-unified"),
                     "the second shard's Deployment")
    await api.patch("KVCachePool", ns, "llama", {"spec": {"pools": 1, "roles": {"unified": {"replicas": 3}}}})

    async def scaled() -> bool:
        for kind, name in (("Deployment", "llama-p1-unified"), ("Service", "llama-p1"),
                           ("ConfigMap", "llama-p1")):
            assert await api.get_or_none(kind, ns, name) is None, f"{kind}/{name} still there"
        ip = await api.get("InferencePool", ns, "llama")
        assert yaml.safe_load(ip["metadata"]["annotations"][ANN_ROUTING])["shards"] == 1
        return bool((await api.get("Deployment", ns, "llama-p0-unified"))["spec"]["replicas"] == 3)

    await eventually(scaled, "the scale-down to one shard")
    # the status is patched at the end of the reconcile that pruned the shard: wait for it, then read it
    await eventually(lambda: _status_with(api, ns, "llama", "pools", 1), "status.pools after the scale-down")
    assert (await api.get("KVCachePool", ns, "llama"))["status"]["pools"] == 1
    # a labelled object that the pool does not control is never pruned
    assert await api.get_or_none("Service", ns, "llama-p0") is not None


async def test_upgrade_from_one_inferencepool_per_shard(
    ns: str, admin_env: ControlPlane, api: ApiClient, settings: Settings,
) -> None:
    """The old layout (InferencePool <pool>-p<i> per shard) becomes one InferencePool <pool> when the operator
    resumes; the old ones it controls are deleted, one controlled by someone else stays."""
    created = await api.create(samples.kvcachepool("llama", ns, pools=2))
    uid = created["metadata"]["uid"]
    await api.patch("KVCachePool", ns, "llama",
                    {"status": {"observedGeneration": 1, "pools": 3,
                                "inferencePools": ["llama-p0", "llama-p1", "llama-p2"]}},
                    subresource="status")
    other = await api.create({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": "someone-else", "namespace": ns}})
    for i in range(3):
        old = samples.inferencepool(name=f"llama-p{i}", namespace=ns,
                                    selector={"matchLabels": {LABEL_POOL: "llama", LABEL_SHARD: str(i),
                                                              LABEL_AGENT: "true"}})
        owner = (("kvfleet.io/v1alpha1", "KVCachePool", "llama", uid) if i < 2
                 else ("v1", "ConfigMap", "someone-else", other["metadata"]["uid"]))
        old["metadata"]["ownerReferences"] = [{"apiVersion": owner[0], "kind": owner[1], "name": owner[2],
                                               "uid": owner[3], "controller": True,
                                               "blockOwnerDeletion": True}]
        await api.create(old)

    async with running_operator(settings, ns):
        async def upgraded() -> bool:
            assert await api.get_or_none("InferencePool", ns, "llama-p0") is None
            assert await api.get_or_none("InferencePool", ns, "llama-p1") is None
            ip = await api.get("InferencePool", ns, "llama")
            assert ip["spec"]["selector"]["matchLabels"] == {LABEL_POOL: "llama", LABEL_AGENT: "true"}
            obj = await api.get("KVCachePool", ns, "llama")
            assert obj["status"]["inferencePools"] == ["llama"] and obj["status"]["pools"] == 2
            return True

        await eventually(upgraded, "one InferencePool in place of the per-shard ones")
        assert await api.get_or_none("InferencePool", ns, "llama-p2") is not None  # not ours: kept
        # shards stay pod subsets with their Services
        assert await api.get_or_none("Service", ns, "llama-p1") is not None


async def test_child_name_taken_by_another_owner_is_left_alone(
    operator: Runtime, api: ApiClient, ns: str,
) -> None:
    other = await api.create({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": "owner", "namespace": ns}})
    await api.create({"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "llama-p0", "namespace": ns, "labels": {"app": "theirs"},
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                             "uid": other["metadata"]["uid"], "controller": True}]},
        "spec": {"ports": [{"port": 80}], "selector": {"app": "theirs"}}})
    await api.create(samples.kvcachepool("llama", ns))

    async def degraded() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", ns, "llama")
        return obj if _cond(obj, "Degraded").get("reason") == "ForeignOwner" else None

    obj = await eventually(degraded, "Degraded=ForeignOwner")
    assert "Service" in _cond(obj, "Degraded")["message"] and "llama-p0" in _cond(obj, "Degraded")["message"]
    svc = await api.get("Service", ns, "llama-p0")
    assert svc["metadata"]["labels"] == {"app": "theirs"} and svc["spec"]["ports"][0]["port"] == 80
    assert all(m["manager"] != FIELD_MANAGER for m in svc["metadata"].get("managedFields") or [])
    await eventually(lambda: _events(api, ns, "ForeignOwner"), "a ForeignOwner Event")


async def test_missing_secret_is_a_clear_condition(operator: Runtime, api: ApiClient, ns: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A remote tier whose Redis Secret does not exist: Ready=False/Degraded with reason SecretNotFound naming
    the Secret and the field, a Warning Event, nothing rendered; once the Secret exists the pool
    reconciles."""
    await api.create(samples.kvcachepool("llama", ns, tiers=[
        {"name": "gpu", "gpuShare": 0.8},
        {"name": "remote", "capacity": "1Ti", "redis": {"urlSecretRef": {"name": "late-redis"}}}]))

    async def blocked() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", ns, "llama")
        return obj if _cond(obj, "Ready").get("reason") == "SecretNotFound" else None

    obj = await eventually(blocked, "Ready=False with reason SecretNotFound")
    msg = _cond(obj, "Degraded")["message"]
    assert "'late-redis'" in msg and "urlSecretRef" in msg and _cond(obj, "Degraded")["status"] == "True"
    await eventually(lambda: _events(api, ns, "SecretNotFound"), "a SecretNotFound Event")
    assert await api.get_or_none("Deployment", ns, "llama-p0-unified") is None
    # the condition lasts: retries back off (0.5, 1, 2, 4 s: 4 attempts in 6 s, not 12) and its Warning
    # Event is written once, while the condition stays current
    await asyncio.sleep(6.0)
    assert len(await _events(api, ns, "SecretNotFound")) == 1
    retries = [r for r in caplog.records if "failed temporarily" in r.getMessage()
               and "late-redis" in r.getMessage()]
    assert 2 <= len(retries) <= 6, [r.getMessage() for r in retries]
    assert _cond(await api.get("KVCachePool", ns, "llama"), "Ready").get("reason") == "SecretNotFound"
    await api.create({"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": "late-redis", "namespace": ns}, "stringData": {"url": "x"}})
    await eventually(lambda: api.get_or_none("Deployment", ns, "llama-p0-unified"),
                     "the Deployment once the Secret exists")


@pytest.fixture()
def relaxed_crd(crds: Kube) -> Iterator[None]:
    """The KVCachePool CRD without its ``spec.tiers`` CEL rules for the test's first steps (as a cluster that
    still serves an older CRD); the shipped CRD is restored afterwards, whatever happens."""
    original = crds.get("crd", KVCP_CRD)
    relaxed = copy.deepcopy(original)
    for version in relaxed["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["tiers"].pop(
            "x-kubernetes-validations", None)
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        relaxed["metadata"].pop(key, None)
    relaxed.pop("status", None)
    crds.kubectl("replace", "-f", "-", input=json.dumps(relaxed))
    try:
        yield
    finally:
        restore = copy.deepcopy(original)
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            restore["metadata"].pop(key, None)
        restore.pop("status", None)
        crds.kubectl("replace", "-f", "-", input=json.dumps(restore))


async def test_spec_that_bypassed_admission_is_invalid_without_retry_loop(
    relaxed_crd: None, operator: Runtime, api: ApiClient, ns: str, crds: Kube,
) -> None:
    """Tiers out of order stored under an older CRD: InvalidSpec=True with the operator's message, one Warning
    Event, no children, no retries; fixed under the shipped CRD, the pool reconciles."""
    bad, message = samples.INVALID["tiers-out-of-order"]
    bad = copy.deepcopy(bad)
    bad["metadata"]["namespace"] = ns
    await api.create(bad)

    async def invalid() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", ns, "llama")
        return obj if _cond(obj, "InvalidSpec").get("status") == "True" else None

    pool = await eventually(invalid, "InvalidSpec=True")
    assert message in _cond(pool, "InvalidSpec")["message"]
    assert _cond(pool, "Ready")["reason"] == "InvalidSpec"
    await eventually(lambda: _events(api, ns, "InvalidSpec"), "an InvalidSpec Event")
    await asyncio.sleep(2.0)  # several status intervals and retry back-offs
    (event,) = await _events(api, ns, "InvalidSpec")
    assert int(event.get("count") or 1) == 1
    assert await api.get_or_none("Deployment", ns, "llama-p0-unified") is None

    await api.patch("KVCachePool", ns, "llama", {"spec": {"tiers": [{"name": "gpu", "gpuShare": 0.8},
                                                                    {"name": "cpu", "capacity": "1Gi"}]}})

    async def recovered() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", ns, "llama")
        return obj if (_cond(obj, "InvalidSpec").get("status") == "False"
                       and obj["status"].get("observedGeneration") == 2) else None

    await eventually(recovered, "the fixed spec reconciled")
    assert await api.get_or_none("Deployment", ns, "llama-p0-unified") is not None


async def test_delete_releases_the_finalizer_and_garbage_collects_children(
    operator: Runtime, api: ApiClient, ns: str, kube: Kube,
) -> None:
    body = samples.kvcachepool("gc", ns, roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                               transfer={"backends": ["tcp"]})
    await api.create(body)
    await eventually(lambda: _status_with(api, ns, "gc", "inferencePools"), "gc reconciled")
    children = _children(body["spec"], "gc")
    for kind, name in children:
        assert await api.get_or_none(kind, ns, name) is not None
    await eventually(
        lambda: asyncio.to_thread(
            lambda: len(kube.get("replicasets", None, ns, "-l", f"{LABEL_POOL}=gc")["items"]) == 2),
        "gc's two ReplicaSets")
    await api.delete("KVCachePool", ns, "gc")

    async def collected() -> bool:
        assert await api.get_or_none("KVCachePool", ns, "gc") is None, "finalizer not released"
        for kind, name in children:
            assert await api.get_or_none(kind, ns, name) is None, f"{kind}/{name} not garbage-collected"
        replicasets = await asyncio.to_thread(kube.get, "replicasets", None, ns, "-l", f"{LABEL_POOL}=gc")
        assert not replicasets["items"], "ReplicaSets not garbage-collected"
        return True

    await eventually(collected, "gc and its children gone", timeout_s=90)


async def test_user_inferencepool_is_checked(operator: Runtime, api: ApiClient, ns: str) -> None:
    """A user InferencePool naming the kvfleet EPP with a wrong port and agent-less pods gets a Warning Event
    per problem, once; pools that name another picker or none are not ours."""
    await api.create({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": "vllm-0", "namespace": ns,
                                   "labels": {"app": "vllm", "kvfleet.io/agent": "true"}},
                      "spec": {"containers": [{"name": "vllm", "image": "vllm",
                                               "ports": [{"containerPort": 8000}]}]}})
    await api.create(samples.inferencepool(
        name="user-pool", namespace=ns, endpointPickerRef={"name": "kvfleet-epp", "port": {"number": 9999}}))

    async def warned() -> list[str] | None:
        messages = [e.get("message") or "" for e in await _events(api, ns, "InvalidInferencePool")
                    if (e.get("involvedObject") or {}).get("name") == "user-pool"]
        return messages if len(messages) >= 2 else None

    messages = await eventually(warned, "two InvalidInferencePool Events on user-pool")
    assert any("9999" in m for m in messages), messages
    assert any("vllm-0" in m and "agent" in m for m in messages), messages
    await api.patch("InferencePool", ns, "user-pool", {"metadata": {"annotations": {"test/touch": "1"}}})
    await api.create(samples.inferencepool(
        name="other", namespace=ns, endpointPickerRef={"name": "someone-else", "port": {"number": 9002}}))
    no_epp = samples.inferencepool(name="no-epp", namespace=ns)
    del no_epp["spec"]["endpointPickerRef"]
    await api.create(no_epp)

    # a time gap: the three events above reach the operator (nothing observable marks "ignored")
    await asyncio.sleep(1.0)
    assert set(operator.pool_problems) == {(ns, "user-pool")}, operator.pool_problems
    events = await _events(api, ns, "InvalidInferencePool")
    assert {(e.get("involvedObject") or {}).get("name") for e in events} == {"user-pool"}
    assert sum(int(e.get("count") or 1) for e in events) == len(messages), (
        "an unchanged pool was reported again")


async def test_what_the_engine_version_cannot_do_is_an_invalid_spec(
    operator: Runtime, api: ApiClient, ns: str,
) -> None:
    """A P/D pool on MooncakeConnector with vLLM 0.11 (no such connector before 0.13): InvalidSpec naming the
    field and the version, nothing rendered; the same pool on vLLM 0.33 reconciles."""
    pd = {"roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
          "transfer": {"backends": ["mooncake"]}}
    await api.create(samples.kvcachepool("mc", ns,
                                         engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"}, **pd))

    async def invalid() -> dict[str, Any] | None:
        obj = await api.get("KVCachePool", ns, "mc")
        return obj if _cond(obj, "InvalidSpec").get("status") == "True" else None

    msg = _cond(await eventually(invalid, "InvalidSpec=True"), "InvalidSpec")["message"]
    assert "transfer.backends" in msg and "MooncakeConnector" in msg and "0.11.0" in msg, msg
    assert await api.get_or_none("Deployment", ns, "mc-p0-prefill") is None
    await api.patch("KVCachePool", ns, "mc", {"spec": {"engine": {"image": "vllm/vllm-openai:v0.33.0"}}})
    await eventually(lambda: api.get_or_none("Deployment", ns, "mc-p0-prefill"),
                     "the pool on vLLM 0.33 rendered")
