"""Rendering a KVCachePool into Kubernetes objects (pure functions).

Covers: the set and names of children per pool and role; owner references on
every object; every built-in object valid for Kubernetes 1.33 (kubernetes-validate,
strict); the one rendered InferencePool valid against the GIE v1.6 CRD and
selecting every shard's pods (shards are pod subsets by label); pods carry
the agent sidecar, the shared in-memory emptyDir, the ssd volume and GPU limits
in GPU mode; the per-role config.yaml loads as kvfleet Settings with the pool's
fields; the config hash changes with tiers but not with replicas; an object
controlled by another owner is never applied over (server-side apply itself is
tested against the real API server in tests/cluster/test_operator.py).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from kvfleet.config import Settings, from_dict
from kvfleet.operator.apply import ForeignOwnerError, check_owner
from kvfleet.operator.inferencepools import selected_pods
from kvfleet.operator.manifests import (
    AGENT_CONTAINER,
    ANN_CONFIG_HASH,
    ANN_EPP_REPLICAS,
    ANN_FALLBACK,
    ANN_ROUTING,
    LABEL_AGENT,
    LABEL_POOL,
    LABEL_SHARD,
    config_hash,
    pool_settings,
    render_children,
)
from kvfleet.operator.spec import parse_spec
from tests.operator import samples
from tests.operator.k8s import admit, load_crd, validate_builtin

INFP = load_crd("inferencepool.yaml")


def _render(obj: dict[str, Any], settings: Settings | None = None) -> list[dict[str, Any]]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["uid"] = "0b4d3c9e-1111-2222-3333-444455556666"
    return render_children(obj, parse_spec(obj["spec"], obj["metadata"]["name"]), settings or Settings())


@pytest.mark.parametrize("name", sorted(samples.VALID))
def test_rendered_builtin_objects_are_valid_kubernetes(name: str) -> None:
    """ConfigMaps, Deployments and Services pass kubernetes-validate (strict, no unknown fields)."""
    assert validate_builtin(_render(samples.VALID[name])) == []


@pytest.mark.parametrize("name", sorted(samples.VALID))
def test_rendered_inferencepool_is_a_valid_custom_object(name: str) -> None:
    """One InferencePool per KVCachePool, named like it, passing the CRD's schema and CEL rules and naming the
    kvfleet EPP."""
    obj = samples.VALID[name]
    (pool,) = [c for c in _render(obj) if c["kind"] == "InferencePool"]
    _, errors = admit(INFP, pool)
    assert errors == []
    assert pool["metadata"]["name"] == obj["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["name"] == Settings().operator.epp_service
    assert pool["spec"]["selector"]["matchLabels"] == {LABEL_POOL: obj["metadata"]["name"],
                                                       LABEL_AGENT: "true"}


def test_inferencepool_selects_every_shard_and_shards_are_pod_subsets() -> None:
    """The InferencePool selects the pods of all shards (no shard label); each Deployment's pods carry their
    shard."""
    children = _render(samples.FULL_GPU)
    (pool,) = [c for c in children if c["kind"] == "InferencePool"]
    assert (LABEL_SHARD not in pool["spec"]["selector"]["matchLabels"]
            and LABEL_SHARD not in pool["metadata"]["labels"])
    routing = json.loads(pool["metadata"]["annotations"][ANN_ROUTING])
    assert routing["shards"] == 2 and "shard" not in routing and routing["blockSize"] == 16
    templates = [{"metadata": {"name": c["metadata"]["name"], **c["spec"]["template"]["metadata"]},
                  "spec": c["spec"]["template"]["spec"]}
                 for c in children if c["kind"] == "Deployment"]
    assert len(selected_pods(pool, templates)) == len(templates) == 4
    assert sorted(t["metadata"]["labels"][LABEL_SHARD] for t in templates) == ["0", "0", "1", "1"]
    for c in children:
        if c["kind"] in ("Deployment", "Service"):
            shard = c["metadata"]["name"].removeprefix("llama-p").split("-")[0]
            selector = (c["spec"]["selector"]["matchLabels"] if c["kind"] == "Deployment"
                        else c["spec"]["selector"])
            assert selector[LABEL_SHARD] == shard


def test_inferencepool_names_its_shards_services_for_a_gateways_fail_open() -> None:
    """Envoy Gateway's kvfleet extension reads the FailOpen targets from the pool: every shard's headless
    Service at the engine port, parsed as that extension parses them."""
    from kvfleet.epp.gateway_extension import ANN_EPP_REPLICAS as READ_REPLICAS
    from kvfleet.epp.gateway_extension import ANN_FALLBACK as READ
    from kvfleet.epp.gateway_extension import parse_pool

    children = _render(samples.FULL_GPU)
    (pool,) = [c for c in children if c["kind"] == "InferencePool"]
    services = [c["metadata"]["name"] for c in children if c["kind"] == "Service"]
    port = next(c for c in children if c["kind"] == "Service")["spec"]["ports"][0]["port"]
    assert READ == ANN_FALLBACK and pool["metadata"]["annotations"][ANN_FALLBACK] == ",".join(
        f"{s}:{port}" for s in services)
    parsed = parse_pool({**pool, "metadata": {**pool["metadata"], "namespace": "ns"}})
    assert parsed is not None and not parsed.error and parsed.fallback == tuple((s, port) for s in services)
    # and the EPP's replicas by address: the chart's headless <epp>-replicas Service
    assert READ_REPLICAS == ANN_EPP_REPLICAS and parsed.replicas == ("kvfleet-epp-replicas", 9002)


def test_children_names_and_owner_references() -> None:
    """2 shards × P/D → per shard: ConfigMap, prefill and decode Deployments, Service; then one InferencePool;
    all owned."""
    children = _render(samples.FULL_GPU)
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert names == [
        ("ConfigMap", "llama-p0"), ("Deployment", "llama-p0-prefill"), ("Deployment", "llama-p0-decode"),
        ("Service", "llama-p0"),
        ("ConfigMap", "llama-p1"), ("Deployment", "llama-p1-prefill"), ("Deployment", "llama-p1-decode"),
        ("Service", "llama-p1"),
        ("InferencePool", "llama"),
    ]
    for c in children:
        (ref,) = c["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "kvfleet.io/v1alpha1", "kind": "KVCachePool", "name": "llama",
                       "uid": "0b4d3c9e-1111-2222-3333-444455556666", "controller": True,
                       "blockOwnerDeletion": True}


def test_gpu_pod_shape() -> None:
    """GPU mode: vLLM engine with nvidia.com/gpu, agent sidecar, /dev/shm memory emptyDir, ssd hostPath,
    secrets by reference."""
    dep = next(c for c in _render(samples.FULL_GPU) if c["metadata"]["name"] == "llama-p0-decode")
    assert dep["spec"]["replicas"] == 4
    pod = dep["spec"]["template"]["spec"]
    engine, agent = pod["containers"]
    assert engine["command"] == ["vllm", "serve"] and engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert agent["name"] == AGENT_CONTAINER and agent["command"] == ["kvfleet", "agent"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["ssd"]["hostPath"]["path"] == "/mnt/nvme/kv"
    for container in (engine, agent):
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm", "/var/lib/kvfleet/ssd",
                                                                       "/etc/kvfleet/config.yaml"}
    env = {e["name"]: e for e in engine["env"]}
    assert env["KVFLEET_TRANSFER_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "kv-transfer",
                                                                           "key": "secret"}
    assert env["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "kv-redis", "key": "url"}
    assert env["LMCACHE_REMOTE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "kv-redis"


@pytest.mark.parametrize("sample", ["FULL_GPU", "SIM_PD"])
def test_every_engine_container_has_a_read_only_root_and_a_writable_tmp(sample: str) -> None:
    """Pod Security "restricted" as a real runtime enforces it: each container's root filesystem is
    read-only, and /tmp (vLLM's and SGLang's $HOME) is a pod volume, the only place besides /dev/shm and
    the ssd tier where the processes write."""
    for dep in (c for c in _render(getattr(samples, sample)) if c["kind"] == "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["tmp"]
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], c["name"]
        engine = pod["containers"][0]
        if engine["command"][0] != "kvfleet":
            assert {"name": "HOME", "value": "/tmp"} in engine["env"]


def test_sim_pod_has_no_gpu_and_runs_kvfleet_engine() -> None:
    """CPU fallback: `kvfleet engine --config`, no GPU resources, ssd tier on an emptyDir of its capacity."""
    dep = next(c for c in _render(samples.SIM_PD) if c["kind"] == "Deployment")
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    assert (engine["command"] == ["kvfleet", "engine"]
            and engine["args"][:2] == ["--config", "/etc/kvfleet/config.yaml"])
    assert "nvidia.com/gpu" not in (engine["resources"].get("limits") or {})
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ssd"]["emptyDir"]["sizeLimit"] == str(8 * 1024**3)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_role_config_loads_as_settings(role: str) -> None:
    """Each role's config.yaml in the ConfigMap is a loadable kvfleet Settings carrying the pool's fields."""
    cm = next(c for c in _render(samples.SIM_PD) if c["kind"] == "ConfigMap")
    loaded = from_dict(Settings, yaml.safe_load(cm["data"][f"{role}.yaml"]))
    assert loaded.cache.block_size == 16
    assert loaded.engine.model == samples.SIM_PD["spec"]["model"]["name"]
    assert (loaded.engine.role == role and loaded.engine.pool == "sim-pd-p0"
            and loaded.engine.host == "0.0.0.0")
    assert loaded.engine.tiers.cpu_blocks == 2 * 1024**3 // (131072 * 16)
    pool = yaml.safe_load(cm["data"]["pool.yaml"])
    assert [t["name"] for t in pool["tiers"]] == ["gpu", "cpu", "ssd"]
    assert pool["tiers"][1] == {"name": "cpu", "gpu_share": None, "capacity_bytes": 2 * 1024**3,
                                "codec": "fp8_e4m3", "watermarks": {"high": 0.9, "low": 0.7}, "path": None,
                                "url_env": None}


def test_sim_pd_engines_know_their_prefill_peers() -> None:
    """Simulated P/D engines admit their shard's headless Service (DNS name, engine port) as prefill peers;
    unified and vLLM pools none."""
    obj = samples.kvcachepool(name="sim-pd", namespace="serving", pools=2,
                              roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    children = _render(obj)
    port = Settings().operator.engine_port
    services = {c["metadata"]["name"] for c in children if c["kind"] == "Service"}
    for shard in range(2):
        cm = next(c for c in children
                  if c["kind"] == "ConfigMap" and c["metadata"]["name"] == f"sim-pd-p{shard}")
        for role in ("prefill", "decode"):
            loaded = from_dict(Settings, yaml.safe_load(cm["data"][f"{role}.yaml"]))
            assert loaded.engine.prefill_peers == (f"sim-pd-p{shard}.serving.svc:{port}",)
            host = loaded.engine.prefill_peers[0].split(".")[0]
            assert host in services
    for sample in (samples.MINIMAL, samples.FULL_GPU):
        for cm in (c for c in _render(sample) if c["kind"] == "ConfigMap"):
            for key, text in cm["data"].items():
                if key != "pool.yaml":
                    assert from_dict(Settings, yaml.safe_load(text)).engine.prefill_peers == ()


def test_every_spec_path_has_a_home_in_settings() -> None:
    """The paths the operator writes exist in Settings today (a rename elsewhere shows up here)."""
    spec = parse_spec(samples.SIM_PD["spec"])
    _, missing = pool_settings(spec, "sim-pd", 0, "prefill", Settings())
    assert missing == []


def test_config_hash_rolls_on_tiers_not_on_replicas() -> None:
    """Scaling changes no pod template; a tier change does (the pods restart with the new tiers)."""
    base = parse_spec(samples.MINIMAL["spec"])
    scaled = parse_spec({**samples.MINIMAL["spec"], "roles": {"unified": {"replicas": 5}}})
    tiered = parse_spec({**samples.MINIMAL["spec"],
                         "tiers": [{"name": "gpu", "gpuShare": 0.9}, {"name": "cpu", "capacity": "1Gi"}]})
    assert config_hash(base, Settings()) == config_hash(scaled, Settings())
    assert config_hash(base, Settings()) != config_hash(tiered, Settings())
    dep = next(c for c in _render(samples.MINIMAL) if c["kind"] == "Deployment")
    assert (dep["spec"]["template"]["metadata"]["annotations"][ANN_CONFIG_HASH]
            == config_hash(base, Settings()))


def test_apply_never_takes_over_foreign_objects() -> None:
    """An object controlled by another owner is not patched."""
    svc = next(c for c in _render(samples.MINIMAL) if c["kind"] == "Service")
    live = copy.deepcopy(svc)
    live["metadata"]["ownerReferences"] = [{**svc["metadata"]["ownerReferences"][0], "uid": "someone-else"}]
    with pytest.raises(ForeignOwnerError):
        check_owner(live, svc)
    check_owner(None, svc)  # absent: created
    check_owner(copy.deepcopy(svc), svc)  # ours: applied
    unowned = copy.deepcopy(svc)
    del unowned["metadata"]["ownerReferences"]
    check_owner(unowned, svc)  # nobody's controller: adopted by the apply


@pytest.mark.parametrize(("image", "events"), [("lmsysorg/sglang:v0.5.3-cu126", False),
                                               ("lmsysorg/sglang:v0.5.6", True),
                                               ("lmsysorg/sglang:v0.5.23", True),
                                               ("lmsysorg/sglang:latest", True)])
def test_sglang_pods_publish_kv_events_only_where_they_can_be_indexed(image: str, events: bool) -> None:
    """SGLang before 0.5.6 hashes a page by its tokens alone and gives a radix node's first page no parent:
    its pods get no ``--kv-events-config`` and empty KV-event annotations, so the EPP subscribes to nothing
    there and keeps its picks on them as an approximate index (tests/interop/test_sglang_events.py shows what
    its events lose)."""
    obj = copy.deepcopy(samples.MINIMAL)
    obj["spec"]["engine"] = {"kind": "sglang", "image": image}
    (dep,) = [c for c in _render(obj) if c["kind"] == "Deployment"]
    pod = dep["spec"]["template"]
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] != AGENT_CONTAINER]
    assert ("--kv-events-config" in engine["args"]) is events
    ann = pod["metadata"]["annotations"]
    assert (ann["kvfleet.io/kv-events-port"], ann["kvfleet.io/kv-replay-port"]) == (
        ("5557", "5558") if events else ("", ""))


@pytest.mark.parametrize(("model", "engine", "tokenizer", "dialect"), [
    ({"name": "Qwen/Qwen2.5-7B-Instruct"}, {"kind": "vllm"}, "hf:Qwen/Qwen2.5-7B-Instruct", "vllm"),
    ({"name": "qwen", "tokenizer": "/models/qwen2.5-7b"}, {"kind": "vllm"}, "/models/qwen2.5-7b", "vllm"),
    ({"name": "m", "tokenizer": "builtin:qwen2.5"}, {"kind": "sim"}, "builtin:qwen2.5", "vllm"),
    ({"name": "m", "tokenizer": "Qwen/Qwen2.5-7B"}, {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.3"},
     "hf:Qwen/Qwen2.5-7B", "sglang-0.5.3"),
    ({"name": "m", "tokenizer": "Qwen/Qwen2.5-7B"}, {"kind": "sglang"}, "hf:Qwen/Qwen2.5-7B", "sglang"),
    ({"name": "llama"}, {"kind": "sim"}, None, "vllm"),
])
def test_the_pool_tells_the_epp_how_its_engines_tokenize(
    model: dict[str, str], engine: dict[str, str], tokenizer: str | None, dialect: str,
) -> None:
    """The InferencePool's routing annotation carries the engines' tokenizer (an HF name becomes the EPP's hub
    spec, a path stays a path on the mounted model cache) and their chat dialect (engine kind and version)."""
    obj = copy.deepcopy(samples.MINIMAL)
    obj["spec"] = {**obj["spec"], "model": {**obj["spec"].get("model", {}), **model}, "engine": engine}
    (pool,) = [c for c in _render(obj) if c["kind"] == "InferencePool"]
    routing = json.loads(pool["metadata"]["annotations"][ANN_ROUTING])
    assert routing.get("tokenizer") == tokenizer and routing["chatDialect"] == dialect
