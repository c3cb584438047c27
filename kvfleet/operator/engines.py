"""Engine containers: what each ``engine.kind`` runs, rendered from the same KVCachePool fields.

A registry maps the engine kind to a renderer (``sim``, ``vllm``, ``sglang``);
each returns the container's command, arguments and extra environment. The
field-by-field mapping is documented in docs/operator.md; the vLLM arguments
are checked against vLLM's documented flags in tests/operator/test_engines.py.

GPU mode (vLLM):

==========================  ===============================================================
KVCachePool field           vLLM argument
==========================  ===============================================================
model.name / tokenizer      ``vllm serve NAME`` / ``--tokenizer``
blockSize                   ``--block-size``
(always)                    ``--enable-prefix-caching``
hashAlgo                    ``--prefix-caching-hash-algo`` (sha256_cbor → sha256_cbor,
                            xxh3_64 → xxhash: a different digest, so the EPP re-keys
                            blocks from the events' token_ids)
tiers[gpu].gpuShare         ``--gpu-memory-utilization``
tiers[gpu].codec fp8_e4m3   ``--kv-cache-dtype fp8_e4m3``
(always)                    ``--kv-events-config`` zmq publisher on ``tcp://*:<kv_events_port>``
tiers[cpu] only             ``--kv-transfer-config`` OffloadingConnector, num_cpu_blocks
                            = capacity / (kvBytesPerToken × blockSize)
tiers[ssd|remote]           LMCacheConnectorV1 + ``LMCACHE_*`` environment (cpu, disk, redis)
roles prefill/decode        NixlConnector (or MooncakeConnector), kv_role kv_both
several connectors          MultiConnector wrapping them in that order
engine.args                 appended last (they win)
==========================  ===============================================================
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.spec import PoolSpec, TierSpec

#: Where the ssd tier's volume is mounted in every container of an engine pod.
SSD_MOUNT = "/var/lib/kvfleet/ssd"
CONFIG_PATH = "/etc/kvfleet/config.yaml"
GiB = 1024**3


@dataclass(frozen=True)
class EngineContainer:
    """What an engine container runs: image, command + args, extra env (core/v1 EnvVar dicts)."""

    image: str = ""
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)


Renderer = Callable[[PoolSpec, str, OperatorSettings], EngineContainer]


class UnknownEngineError(KeyError):
    """No renderer is registered for this engine kind."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:g}"


def kv_events_config(settings: OperatorSettings) -> dict[str, Any]:
    """vLLM/SGLang KVEventsConfig: ZMQ PUB on every interface of the pod, the EPP subscribes."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{settings.kv_events_port}",
        "topic": "kv-events",
    }


def _lmcache_env(spec: PoolSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "LMCACHE_CHUNK_SIZE", "value": str(max(256, spec.block_size))},
        {"name": "LMCACHE_USE_EXPERIMENTAL", "value": "True"},
    ]
    cpu, ssd, remote = spec.tier("cpu"), spec.tier("ssd"), spec.tier("remote")
    env.append({"name": "LMCACHE_LOCAL_CPU", "value": "True" if cpu else "False"})
    if cpu and cpu.capacity_bytes:
        env.append({"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": _gib(cpu.capacity_bytes)})
    if ssd and ssd.capacity_bytes:
        env.append({"name": "LMCACHE_LOCAL_DISK", "value": f"file://{SSD_MOUNT}/"})
        env.append({"name": "LMCACHE_MAX_LOCAL_DISK_SIZE", "value": _gib(ssd.capacity_bytes)})
    if remote and remote.redis_url:
        env.append({
            "name": "LMCACHE_REMOTE_URL",
            "valueFrom": {"secretKeyRef": {"name": remote.redis_url.name, "key": remote.redis_url.key}},
        })
        env.append({"name": "LMCACHE_REMOTE_SERDE", "value": "naive"})
    return env


def vllm_connectors(spec: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The KV connectors (vLLM KVTransferConfig dicts) and the env they need, in order."""
    connectors: list[dict[str, Any]] = []
    env: list[dict[str, Any]] = []
    if spec.disaggregated:
        name = "NixlConnector" if "nixl" in spec.transfer.backends or "mooncake" not in spec.transfer.backends else "MooncakeConnector"
        connectors.append({"kv_connector": name, "kv_role": "kv_both"})
    cpu: TierSpec | None = spec.tier("cpu")
    if spec.tier("ssd") or spec.tier("remote"):
        connectors.append({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
        env += _lmcache_env(spec)
    elif cpu is not None and cpu.capacity_bytes:
        block_bytes = spec.model.profile.kv_bytes_per_token * spec.block_size
        connectors.append({
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": max(1, cpu.capacity_bytes // block_bytes), "block_size": spec.block_size},
        })
    return connectors, env


def vllm_args(spec: PoolSpec, role: str, settings: OperatorSettings) -> EngineContainer:
    """``vllm serve`` realising the pool: prefix caching, KV events, offloading, P/D connector."""
    gpu = spec.tier("gpu")
    args = [
        spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(settings.engine_port),
        "--block-size", str(spec.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor" if spec.hash_algo == "sha256_cbor" else "xxhash",
        "--kv-events-config", json.dumps(kv_events_config(settings), separators=(",", ":")),
    ]
    if spec.model.tokenizer:
        args += ["--tokenizer", spec.model.tokenizer]
    if gpu is not None and gpu.gpu_share is not None:
        args += ["--gpu-memory-utilization", f"{gpu.gpu_share:g}"]
    if gpu is not None and gpu.codec == "fp8_e4m3":
        args += ["--kv-cache-dtype", "fp8_e4m3"]
    connectors, env = vllm_connectors(spec)
    if len(connectors) == 1:
        args += ["--kv-transfer-config", json.dumps(connectors[0], separators=(",", ":"))]
    elif connectors:
        multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": connectors}}
        args += ["--kv-transfer-config", json.dumps(multi, separators=(",", ":"))]
    args += list(spec.engine.args)
    return EngineContainer(image=spec.engine.image or settings.vllm_image, command=("vllm", "serve"), args=tuple(args), env=tuple(env))


def sglang_args(spec: PoolSpec, role: str, settings: OperatorSettings) -> EngineContainer:
    """``sglang.launch_server``: page size, KV events, hierarchical (CPU) cache, P/D mode."""
    gpu, cpu = spec.tier("gpu"), spec.tier("cpu")
    args = [
        "--model-path", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(settings.engine_port),
        "--page-size", str(spec.block_size),
        "--enable-metrics",
        "--kv-events-config", json.dumps(kv_events_config(settings), separators=(",", ":")),
    ]
    if spec.model.tokenizer:
        args += ["--tokenizer-path", spec.model.tokenizer]
    if gpu is not None and gpu.gpu_share is not None:
        args += ["--mem-fraction-static", f"{gpu.gpu_share:g}"]
    if cpu is not None and cpu.capacity_bytes:
        args += ["--enable-hierarchical-cache", "--hicache-size", str(max(1, cpu.capacity_bytes // GiB))]
    if role in ("prefill", "decode"):
        backend = "nixl" if "nixl" in spec.transfer.backends else "mooncake"
        args += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend]
    args += list(spec.engine.args)
    return EngineContainer(
        image=spec.engine.image or settings.sglang_image,
        command=("python3", "-m", "sglang.launch_server"),
        args=tuple(args),
    )


def sim_args(spec: PoolSpec, role: str, settings: OperatorSettings) -> EngineContainer:
    """The CPU-fallback simulator: ``kvfleet engine --config``; the pool's ConfigMap carries the rest."""
    return EngineContainer(
        image=spec.engine.image or settings.image,
        command=("kvfleet", "engine"),
        args=("--config", CONFIG_PATH, *spec.engine.args),
    )


RENDERERS: dict[str, Renderer] = {"sim": sim_args, "vllm": vllm_args, "sglang": sglang_args}


def render_engine(spec: PoolSpec, role: str, settings: OperatorSettings) -> EngineContainer:
    """The engine container for ``spec.engine.kind``; :class:`UnknownEngineError` lists the known kinds."""
    try:
        renderer = RENDERERS[spec.engine.kind]
    except KeyError:
        raise UnknownEngineError(f"unknown engine kind {spec.engine.kind!r}; known: {', '.join(sorted(RENDERERS))}") from None
    return renderer(spec, role, settings)
