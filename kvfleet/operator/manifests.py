"""KVCachePool → the Kubernetes objects that realise it, as pure functions.

One InferencePool ``<pool>`` (named like the KVCachePool) selects every pod of
the pool (labels ``kvfleet.io/pool`` and ``kvfleet.io/agent``); its
``endpointPickerRef`` names the kvfleet EPP Service with the chosen failure
mode, and its annotation ``kvfleet.io/routing`` carries the routing weights,
block size, hash and the shard count. The ``spec.pools`` prefix shards are pod
subsets of that one InferencePool, labelled ``kvfleet.io/shard: "<i>"``: the
EPP picks a shard by the prompt's first blocks, then a pod in it, and never
leaves the InferencePool the route invoked (what GIE v1.6 requires). For each
shard ``i`` (named ``<pool>-p<i>``):

* a ConfigMap ``<pool>-p<i>`` with ``config.yaml`` (the kvfleet Settings every
  container in the shard reads, with the KVCachePool's fields written in) and
  ``pool.yaml`` (the normalised pool: tiers in bytes, codecs, watermarks, transfer);
* a Deployment per role (``unified``, or ``prefill`` and ``decode``): the engine
  container plus the ``kvfleet agent`` sidecar, sharing a memory-backed emptyDir
  at /dev/shm (the cpu tier and same-node transfer), the ssd tier's volume, GPU
  resources in GPU mode, and a ``kvfleet.io/config-hash`` annotation so that a
  change of tiers, scale-independent config or images rolls the pods;
* a headless Service ``<pool>-p<i>`` over the shard's pods (HTTP, KV events,
  transfer); simulated P/D engines find their prefill peers by its DNS name.

Every object carries an owner reference to the KVCachePool (controller=true),
so deleting the KVCachePool deletes them all (Kubernetes garbage collection).

Size: about 500 lines on purpose: the InferencePool, ConfigMaps, Deployments and Services of a pool are
rendered from one normalised spec and must agree on names, labels, ports and the config hash; the engine
flags live in :mod:`.engines`, the validation in :mod:`.spec`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from kvfleet.cache.modeltok import dialect_for
from kvfleet.config import Settings, to_dict
from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.engines import CONFIG_PATH, SSD_MOUNT, image_version, render_engine
from kvfleet.operator.spec import PoolSpec

GROUP = "kvfleet.io"
VERSION = "v1alpha1"
KIND = "KVCachePool"
PLURAL = "kvcachepools"
IP_GROUP = "inference.networking.k8s.io"
IP_VERSION = "v1"

LABEL_POOL = "kvfleet.io/pool"
LABEL_SHARD = "kvfleet.io/shard"
LABEL_ROLE = "kvfleet.io/role"
#: Pods carrying the kvfleet agent sidecar (what the EPP and InferencePool validation look for).
LABEL_AGENT = "kvfleet.io/agent"
MANAGED_BY = "kvfleet-operator"
ANN_CONFIG_HASH = "kvfleet.io/config-hash"
ANN_MODEL = "kvfleet.io/model"
#: read by the EPP's Kubernetes datastore (kvfleet/epp/kube.py): served models, KV-event ports.
ANN_MODELS = "kvfleet.io/models"
ANN_EVENTS = "kvfleet.io/kv-events-port"
ANN_REPLAY = "kvfleet.io/kv-replay-port"
ANN_ROUTING = "kvfleet.io/routing"
#: read by ``kvfleet gateway-extension`` (Envoy Gateway): the shards' headless Services, where a FailOpen
#: request goes with the picker down
ANN_FALLBACK = "kvfleet.io/fallback-services"
#: also read by ``kvfleet gateway-extension``: the EPP's replicas by address (the chart's headless
#: ``<epp>-replicas`` Service), so a gateway spreads its ext_proc streams over all of them
ANN_EPP_REPLICAS = "kvfleet.io/epp-replicas"
AGENT_CONTAINER = "kvfleet-agent"
ENGINE_CONTAINER = "engine"

#: Pod Security "restricted" for every engine pod: non-root (the kvfleet image's uid 10001, also for
#: vLLM and SGLang images), the runtime's default seccomp profile, volumes group-owned by 10001.
POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
#: ... and for each container: no privilege escalation, no capabilities, a read-only root filesystem
#: (what a process writes goes to the pod's volumes: /tmp, /dev/shm, the ssd tier).
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                      "readOnlyRootFilesystem": True}

#: engine role name in kvfleet Settings (``engine.role``) per KVCachePool role.
ENGINE_ROLE = {"unified": "both", "prefill": "prefill", "decode": "decode"}


def shard_name(pool_name: str, shard: int) -> str:
    """Name of shard ``shard``'s ConfigMap and headless Service (its Deployments add ``-<role>``)."""
    return f"{pool_name}-p{shard}"


def inferencepool_name(pool_name: str) -> str:
    """The one InferencePool of a KVCachePool is named like it."""
    return pool_name


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The controller owner reference pointing at a KVCachePool."""
    meta = obj["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pool_selector(pool_name: str) -> dict[str, str]:
    """The InferencePool's selector: every pod of the KVCachePool carrying the agent sidecar (all shards)."""
    return {LABEL_POOL: pool_name, LABEL_AGENT: "true"}


def selector_labels(pool_name: str, shard: int, role: str | None = None) -> dict[str, str]:
    labels = {LABEL_POOL: pool_name, LABEL_SHARD: str(shard)}
    if role is not None:
        labels[LABEL_ROLE] = role
    return labels


def _labels(pool_name: str, shard: int | None, role: str | None, component: str) -> dict[str, str]:
    """Common labels; ``shard`` None for pool-wide objects (the InferencePool)."""
    return {
        "app.kubernetes.io/name": "kvfleet",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **(selector_labels(pool_name, shard, role) if shard is not None else {LABEL_POOL: pool_name}),
    }


def _meta(obj: Mapping[str, Any], name: str, labels: dict[str, str],
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": obj["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(obj)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


# --- kvfleet Settings for the pool's containers ------------------------------------


def settings_paths(cls: type = Settings, prefix: str = "") -> set[str]:
    """Every dotted settings path (``engine.tiers.cpu_blocks``) that :class:`Settings` accepts."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.add(path)
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out |= settings_paths(tp, f"{path}.")
    return out


def shard_service_host(pool_name: str, shard: int, namespace: str) -> str:
    """DNS name of shard ``shard``'s headless Service: resolves to every ready pod of the shard."""
    return f"{shard_name(pool_name, shard)}.{namespace}.svc"


def prefill_peers(spec: PoolSpec, pool_name: str, shard: int, namespace: str,
                  op: OperatorSettings) -> list[str]:
    """``engine.prefill_peers`` of a simulated engine: the shard's headless Service at the engine port in a
    P/D pool, else none.

    A name counts for every address it resolves to, so every ready pod of the
    shard (the Service selects the whole shard, prefill and decode pods alike)
    is admitted as a prefiller, and pods of other shards or pools are not.
    Unified pools and other engines get none (an empty list refuses every prefiller).
    """
    if spec.engine.kind != "sim" or not spec.disaggregated:
        return []
    return [f"{shard_service_host(pool_name, shard, namespace)}:{op.engine_port}"]


def pool_settings(
    spec: PoolSpec, pool_name: str, shard: int, role: str, base: Settings, namespace: str = "default",
) -> tuple[dict[str, Any], list[str]]:
    """``config.yaml`` for one role of one shard: ``base`` with the KVCachePool's fields written in.

    Only paths that :class:`Settings` knows are written (so the file always loads);
    the second value lists the spec-derived paths that had no home in Settings.
    """
    op = base.operator
    block_bytes = spec.model.profile.kv_bytes_per_token * spec.block_size
    cpu, ssd = spec.tier("cpu"), spec.tier("ssd")
    wanted: dict[str, Any] = {
        "cache.block_size": spec.block_size,
        "cache.hash_algo": spec.hash_algo,
        "engine.model": spec.model.name,
        "engine.host": "0.0.0.0",
        "engine.port": op.engine_port,
        "engine.kv_events_port": op.kv_events_port,
        "engine.kv_events_replay_port": op.kv_events_replay_port,
        "engine.pool": shard_name(pool_name, shard),
        "engine.role": ENGINE_ROLE[role],
        "engine.prefill_peers": prefill_peers(spec, pool_name, shard, namespace, op),
        "tiers.model.name": spec.model.name,
        "tiers.model.kv_bytes_per_token": spec.model.profile.kv_bytes_per_token,
        "tiers.model.prefill_tokens_per_s": float(spec.model.profile.prefill_tokens_per_second),
        "tiers.model.block_size": spec.block_size,
        "engine.decode_ms_per_step": float(spec.model.profile.decode_ms_per_token),
        "engine.tiers.cpu_blocks": (cpu.capacity_bytes or 0) // block_bytes if cpu else 0,
        "engine.tiers.ssd_dir": SSD_MOUNT if ssd else "",
        "engine.tiers.ssd_blocks": (ssd.capacity_bytes or 0) // block_bytes if ssd else 0,
        "transfer.listen_host": "0.0.0.0",
        "transfer.port": op.transfer_port,
        "transfer.streams": spec.transfer.streams,
        "transfer.backends": list(spec.transfer.backends),
        "transfer.secret_env": "KVFLEET_TRANSFER_SECRET",
    }
    known = settings_paths()
    data = to_dict(base)
    missing: list[str] = []
    for path, value in wanted.items():
        if path not in known:
            missing.append(path)
            continue
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
        node[leaf] = value
    return data, missing


def pool_descriptor(spec: PoolSpec, pool_name: str, shard: int) -> dict[str, Any]:
    """``pool.yaml``: the normalised KVCachePool for the agent (tiers in bytes, codecs, watermarks)."""
    return {
        "pool": shard_name(pool_name, shard),
        "kvcachepool": pool_name,
        "shard": shard,
        "shards": spec.pools,
        "model": {"name": spec.model.name, "tokenizer": spec.model.tokenizer,
                  **dataclasses.asdict(spec.model.profile)},
        "block_size": spec.block_size,
        "hash_algo": spec.hash_algo,
        "engine": spec.engine.kind,
        "roles": {r.name: r.replicas for r in spec.roles},
        "tiers": [
            {
                "name": t.name,
                "gpu_share": t.gpu_share,
                "capacity_bytes": t.capacity_bytes,
                "codec": t.codec,
                "watermarks": {"high": t.watermarks.high, "low": t.watermarks.low},
                "path": SSD_MOUNT if t.name == "ssd" else None,
                "url_env": "KVFLEET_REDIS_URL" if t.name == "remote" else None,
            }
            for t in spec.tiers
        ],
        "transfer": {"backends": list(spec.transfer.backends), "streams": spec.transfer.streams},
        "routing": dataclasses.asdict(spec.routing),
    }


def render_configmap(obj: Mapping[str, Any], spec: PoolSpec, shard: int, base: Settings) -> dict[str, Any]:
    name = obj["metadata"]["name"]
    data = {"pool.yaml": yaml.safe_dump(pool_descriptor(spec, name, shard), sort_keys=False)}
    for role in spec.roles:
        cfg, _ = pool_settings(spec, name, shard, role.name, base, obj["metadata"]["namespace"])
        data[f"{role.name}.yaml"] = yaml.safe_dump(cfg, sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(obj, shard_name(name, shard), _labels(name, shard, None, "config")),
        "data": data,
    }


# --- workloads ----------------------------------------------------------------


def _env_common(spec: PoolSpec, op: OperatorSettings) -> list[dict[str, Any]]:
    secret = spec.transfer.secret
    env: list[dict[str, Any]] = [
        {"name": "KVFLEET_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KVFLEET_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "KVFLEET_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {
            "name": "KVFLEET_TRANSFER_SECRET",
            "valueFrom": {"secretKeyRef": {
                "name": secret.name if secret else op.transfer_secret,
                "key": secret.key if secret else op.transfer_secret_key,
            }},
        },
    ]
    remote = spec.tier("remote")
    if remote is not None and remote.redis_url is not None:
        env.append({"name": "KVFLEET_REDIS_URL", "valueFrom": {
            "secretKeyRef": {"name": remote.redis_url.name, "key": remote.redis_url.key}}})
    return env


def _resources(spec: PoolSpec, resources: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = copy.deepcopy(dict(resources))
    if spec.engine.gpu:
        limits = out.setdefault("limits", {})
        requests = out.get("requests", {})
        if "nvidia.com/gpu" not in limits:
            limits["nvidia.com/gpu"] = requests.get("nvidia.com/gpu", 1)
    return out


def _volumes(spec: PoolSpec, config_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cpu, ssd = spec.tier("cpu"), spec.tier("ssd")
    shm: dict[str, Any] = {"medium": "Memory"}
    if cpu is not None and cpu.capacity_bytes:
        shm["sizeLimit"] = str(cpu.capacity_bytes + 1024**3)  # the tier plus 1 GiB for transfer staging
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_name}},
        {"name": "shm", "emptyDir": shm},
        # the root filesystem is read-only: /tmp (and $HOME=/tmp of vLLM and SGLang, their caches) here
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "config", "mountPath": "/etc/kvfleet"},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if ssd is not None:
        source: dict[str, Any] = dict(ssd.volume) if ssd.volume else {
            "emptyDir": {"sizeLimit": str(ssd.capacity_bytes)}}
        volumes.append({"name": "ssd", **source})
        mounts.append({"name": "ssd", "mountPath": SSD_MOUNT})
    return volumes, mounts


def render_deployment(obj: Mapping[str, Any], spec: PoolSpec, shard: int, role: str, base: Settings,
                      config_hash: str) -> dict[str, Any]:
    op = base.operator
    name = obj["metadata"]["name"]
    replicas = next(r for r in spec.roles if r.name == role)
    labels = {**_labels(name, shard, role, "engine"), LABEL_AGENT: "true"}
    engine = render_engine(spec, role, op)
    volumes, mounts = _volumes(spec, shard_name(name, shard))
    env = _env_common(spec, op)
    config_mounts = [*mounts]
    # Each role reads its own settings file from the shard's ConfigMap as /etc/kvfleet/config.yaml.
    config_mounts[0] = {"name": "config", "mountPath": CONFIG_PATH, "subPath": f"{role}.yaml",
                        "readOnly": True}
    pool_mount = {"name": "config", "mountPath": "/etc/kvfleet/pool.yaml", "subPath": "pool.yaml",
                  "readOnly": True}
    # Non-root (POD_SECURITY): vLLM and SGLang images keep caches under $HOME, which uid 10001 has none of.
    home = [{"name": "HOME", "value": "/tmp"}] if spec.engine.kind != "sim" else []
    engine_container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": engine.image,
        "imagePullPolicy": op.image_pull_policy,
        "command": list(engine.command),
        "args": list(engine.args),
        "env": [*env, *home, *(dict(e) for e in engine.env), *(dict(e) for e in spec.engine.env)],
        "ports": [
            {"name": "http", "containerPort": op.engine_port, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": op.kv_events_port, "protocol": "TCP"},
            # the simulator serves its P/D KV itself (kvfleet's transfer engine)
            *([{"name": "transfer", "containerPort": op.transfer_port, "protocol": "TCP"}]
              if spec.engine.kind == "sim" else []),
        ],
        "volumeMounts": [*config_mounts, pool_mount],
        "resources": _resources(spec, replicas.resources),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 30},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    agent: dict[str, Any] = {
        "name": AGENT_CONTAINER,
        "image": op.image,
        "imagePullPolicy": op.image_pull_policy,
        "command": ["kvfleet", "agent"],
        # its own ports: the engine container shares the pod's network namespace
        "args": ["--config", CONFIG_PATH,
                 "--transfer-port", str(op.agent_transfer_port),
                 "--metrics-port", str(op.agent_metrics_port),
                 "--kv-events-port", str(op.agent_kv_events_port),
                 "--kv-events-replay-port", str(op.agent_kv_events_port + 1)],
        "env": env,
        "ports": [
            {"name": "agent-metrics", "containerPort": op.agent_metrics_port, "protocol": "TCP"},
            {"name": "agent-transfer", "containerPort": op.agent_transfer_port, "protocol": "TCP"},
        ],
        "volumeMounts": [*config_mounts, pool_mount],
        "readinessProbe": {"tcpSocket": {"port": "agent-transfer"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "agent-metrics"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(obj, f"{shard_name(name, shard)}-{role}", labels, {ANN_MODEL: spec.model.name}),
        "spec": {
            "replicas": replicas.replicas,
            "selector": {"matchLabels": selector_labels(name, shard, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        ANN_CONFIG_HASH: config_hash,
                        ANN_MODEL: spec.model.name,
                        # "": the engine publishes no KV events the EPP can index (it keeps the pod's
                        # picks instead)
                        ANN_EVENTS: str(op.kv_events_port) if engine.kv_events else "",
                        ANN_REPLAY: str(op.kv_events_replay_port) if engine.kv_events else "",
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(op.engine_port),
                    },
                },
                "spec": {
                    "containers": [engine_container, agent],
                    "volumes": volumes,
                    "securityContext": copy.deepcopy(POD_SECURITY),
                    "terminationGracePeriodSeconds": 30,
                },
            },
        },
    }


def render_service(obj: Mapping[str, Any], spec: PoolSpec, shard: int, base: Settings) -> dict[str, Any]:
    op = base.operator
    name = obj["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(obj, shard_name(name, shard), _labels(name, shard, None, "engine")),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(name, shard),
            "ports": [
                {"name": "http", "port": op.engine_port, "targetPort": "http", "protocol": "TCP"},
                {"name": "kv-events", "port": op.kv_events_port, "targetPort": "kv-events",
                 "protocol": "TCP"},
                *([{"name": "transfer", "port": op.transfer_port, "targetPort": "transfer",
                    "protocol": "TCP"}] if spec.engine.kind == "sim" else []),
                {"name": "agent-transfer", "port": op.agent_transfer_port, "targetPort": "agent-transfer",
                 "protocol": "TCP"},
                {"name": "agent-metrics", "port": op.agent_metrics_port, "targetPort": "agent-metrics",
                 "protocol": "TCP"},
            ],
        },
    }


def routing_annotation(spec: PoolSpec) -> str:
    """``kvfleet.io/routing``: weights, failure mode, block size, hash, shard count, P/D, and how the engines
    tokenize (:func:`picker_tokenizer`, :func:`~kvfleet.cache.modeltok.dialect_for`)."""
    routing = {**dataclasses.asdict(spec.routing), "blockSize": spec.block_size, "hashAlgo": spec.hash_algo,
               "shards": spec.pools, "disaggregated": spec.disaggregated}
    tokenizer = picker_tokenizer(spec)
    if tokenizer:
        routing["tokenizer"] = tokenizer
    routing["chatDialect"] = dialect_for(spec.engine.kind, image_version(spec.engine.image)
                                         if spec.engine.image else None)
    return json.dumps(routing, sort_keys=True)


def picker_tokenizer(spec: PoolSpec) -> str:
    """The EPP's tokenizer spec for the pool (kvfleet/epp/tokenize.py): the engines' own.

    ``model.tokenizer`` (else ``model.name``, which is what vLLM and SGLang load): ``bytes`` and
    ``builtin:NAME`` as they are (the simulator's), a path as it is (the chart mounts the model cache
    volume at the same path in the EPP), a Hugging Face repository ``ORG/NAME`` as ``hf:ORG/NAME`` (fetched
    by the EPP). Empty when neither is set: the picker's ``epp.tokenizer``."""
    name = spec.model.tokenizer or spec.model.name
    if not name or name == "bytes" or name.startswith(("builtin:", "hf:", "/")):
        return name
    if name.count("/") == 1 and not name.startswith("."):
        return f"hf:{name}"
    return ""


def render_inferencepool(obj: Mapping[str, Any], spec: PoolSpec, base: Settings) -> dict[str, Any]:
    """The KVCachePool's one InferencePool: all its pods, every shard; the kvfleet EPP picks among them."""
    op = base.operator
    name = obj["metadata"]["name"]
    return {
        "apiVersion": f"{IP_GROUP}/{IP_VERSION}",
        "kind": "InferencePool",
        "metadata": _meta(obj, inferencepool_name(name), _labels(name, None, None, "inferencepool"),
                          {ANN_MODEL: spec.model.name, ANN_MODELS: spec.model.name,
                           ANN_ROUTING: routing_annotation(spec),
                           ANN_FALLBACK: ",".join(f"{shard_name(name, i)}:{op.engine_port}"
                                                  for i in range(spec.pools)),
                           ANN_EPP_REPLICAS: f"{op.epp_service}-replicas:{op.epp_port}"}),
        "spec": {
            "selector": {"matchLabels": pool_selector(name)},
            "targetPorts": [{"number": op.engine_port}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": op.epp_service,
                "port": {"number": op.epp_port},
                "failureMode": spec.routing.failure_mode,
            },
        },
    }


def config_hash(spec: PoolSpec, base: Settings) -> str:
    """Hash of everything a pod reads at start (not replicas): a change rolls the pods."""
    material = {
        "spec": dataclasses.asdict(
            dataclasses.replace(spec, roles=tuple(dataclasses.replace(r, replicas=0) for r in spec.roles))),
        "settings": to_dict(base),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]


def render_children(obj: Mapping[str, Any], spec: PoolSpec, base: Settings) -> list[dict[str, Any]]:
    """Every object a KVCachePool owns, in apply order: per shard config, workloads and
    Service, then the one InferencePool over all shards."""
    digest = config_hash(spec, base)
    out: list[dict[str, Any]] = []
    for shard in range(spec.pools):
        out.append(render_configmap(obj, spec, shard, base))
        out += [render_deployment(obj, spec, shard, r.name, base, digest) for r in spec.roles]
        out.append(render_service(obj, spec, shard, base))
    out.append(render_inferencepool(obj, spec, base))
    return out
