"""Engine containers: what each ``engine.kind`` runs, rendered from the same KVCachePool fields.

A registry maps the engine kind to a renderer (``sim``, ``vllm``, ``sglang``);
each returns the container's command, arguments and extra environment. The
field-by-field mapping is documented in docs/operator.md; the rendered command
lines are checked by the real engines' own parsers and config classes in
tests/interop (vLLM :data:`VLLM_TESTED`, SGLang :data:`SGLANG_TESTED`).

GPU mode (vLLM):

==========================  ===============================================================
KVCachePool field           vLLM argument
==========================  ===============================================================
model.name / tokenizer      ``vllm serve NAME`` / ``--tokenizer``
blockSize                   ``--block-size``
(always)                    ``--enable-prefix-caching``
hashAlgo                    sha256_cbor → ``--prefix-caching-hash-algo sha256_cbor`` (the
                            EPP's keys equal vLLM's); xxh3_64 → vLLM's default (sha256:
                            every version has it, and vLLM's ``xxhash`` needs a package its
                            images may lack); the EPP re-keys blocks from the events' token_ids
tiers[gpu].gpuShare         ``--gpu-memory-utilization``
tiers[gpu].codec fp8_e4m3   ``--kv-cache-dtype fp8_e4m3``
(always)                    ``--kv-events-config`` zmq publisher on ``tcp://*:<kv_events_port>``,
                            replay on ``tcp://*:<kv_events_replay_port>``
tiers[cpu]                  OffloadingConnector: from vLLM 0.14 ``cpu_bytes_to_use`` = capacity
                            (what its CPU spec requires; not ``--kv-offloading-size``, which
                            replaces any other connector, a P/D one included), before 0.14
                            num_cpu_blocks = capacity / (kvBytesPerToken × blockSize)
tiers[ssd|remote]           LMCacheConnectorV1 + ``LMCACHE_*`` environment (cpu, disk, redis)
roles prefill/decode        NixlConnector (or MooncakeConnector, vLLM >= 0.13), kv_role kv_both
several connectors          MultiConnector wrapping them in that order
engine.args                 appended last (they win)
==========================  ===============================================================

The vLLM version is read from the engine image's tag (``vllm/vllm-openai:v0.11.0``); a tag
naming no version (``latest``, a digest) gets the newest rendering. Supported and checked
against the real ``vllm serve`` parser and engine config of each (tests/interop):
:data:`VLLM_TESTED`. What a version cannot do is an :class:`EngineVersionError`, reported
on the pool as InvalidSpec.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.spec import InvalidSpecError, PoolSpec, TierSpec

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
    #: the engine publishes KV events the EPP can index (False: the EPP routes the pod on its own picks)
    kv_events: bool = True


Renderer = Callable[[PoolSpec, str, OperatorSettings], EngineContainer]


class UnknownEngineError(KeyError):
    """No renderer is registered for this engine kind."""


class EngineVersionError(InvalidSpecError):
    """The pool asks for something its engine image's version does not have."""


Version = tuple[int, int, int]
#: vLLM releases whose rendered flags are checked against vLLM's own parser (tests/interop).
VLLM_TESTED: tuple[Version, ...] = ((0, 11, 0), (0, 33, 0))
#: From this vLLM on, the CPU offloading spec sizes its tier in bytes (``cpu_bytes_to_use``).
VLLM_OFFLOAD_BYTES: Version = (0, 14, 0)
#: The first vLLM with MooncakeConnector.
VLLM_MOONCAKE: Version = (0, 13, 0)


def image_version(image: str) -> Version | None:
    """The release an image tag names (``vllm/vllm-openai:v0.11.0`` → (0, 11, 0),
    ``…:v0.5.3-cu126`` → (0, 5, 3)), None for a tag that names none (``latest``, a digest, no tag)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", last.rsplit(":", 1)[1])
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _dotted(version: Version | None) -> str:
    return ".".join(map(str, version)) if version else "(unversioned)"


def _at_least(version: Version | None, wanted: Version) -> bool:
    return version is None or version >= wanted


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:g}"


def kv_events_config(settings: OperatorSettings) -> dict[str, Any]:
    """vLLM/SGLang KVEventsConfig: ZMQ PUB on every interface of the pod, the EPP subscribes; the replay
    ROUTER lets an EPP that joins late (or restarts) catch up instead of resyncing."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{settings.kv_events_port}",
        "replay_endpoint": f"tcp://*:{settings.kv_events_replay_port}",
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


def vllm_connectors(spec: PoolSpec,
                    version: Version | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The KV connectors (vLLM KVTransferConfig dicts) and the env they need, in order, for vLLM
    ``version``."""
    connectors: list[dict[str, Any]] = []
    env: list[dict[str, Any]] = []
    if spec.disaggregated:
        backends = spec.transfer.backends
        name = "NixlConnector" if "nixl" in backends or "mooncake" not in backends else "MooncakeConnector"
        if name == "MooncakeConnector" and not _at_least(version, VLLM_MOONCAKE):
            raise EngineVersionError("transfer.backends",
                                     f"vLLM {_dotted(version)} has no MooncakeConnector (it came in "
                                     "0.13): list nixl in transfer.backends or use a newer engine.image")
        connectors.append({"kv_connector": name, "kv_role": "kv_both"})
    cpu: TierSpec | None = spec.tier("cpu")
    if spec.tier("ssd") or spec.tier("remote"):
        connectors.append({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
        env += _lmcache_env(spec)
    elif cpu is not None and cpu.capacity_bytes:
        if _at_least(version, VLLM_OFFLOAD_BYTES):
            extra: dict[str, Any] = {"cpu_bytes_to_use": cpu.capacity_bytes}
        else:
            block_bytes = spec.model.profile.kv_bytes_per_token * spec.block_size
            extra = {"num_cpu_blocks": max(1, cpu.capacity_bytes // block_bytes),
                     "block_size": spec.block_size}
        connectors.append(
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    return connectors, env


def vllm_args(spec: PoolSpec, role: str, settings: OperatorSettings) -> EngineContainer:
    """``vllm serve`` realising the pool: prefix caching, KV events, offloading, P/D connector."""
    gpu = spec.tier("gpu")
    image = spec.engine.image or settings.vllm_image
    version = image_version(image)
    args = [
        spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(settings.engine_port),
        "--block-size", str(spec.block_size),
        "--enable-prefix-caching",
        *(["--prefix-caching-hash-algo", "sha256_cbor"] if spec.hash_algo == "sha256_cbor" else []),
        "--kv-events-config", json.dumps(kv_events_config(settings), separators=(",", ":")),
    ]
    if spec.model.tokenizer:
        args += ["--tokenizer", spec.model.tokenizer]
    if gpu is not None and gpu.gpu_share is not None:
        args += ["--gpu-memory-utilization", f"{gpu.gpu_share:g}"]
    if gpu is not None and gpu.codec == "fp8_e4m3":
        args += ["--kv-cache-dtype", "fp8_e4m3"]
    connectors, env = vllm_connectors(spec, version)
    if len(connectors) == 1:
        args += ["--kv-transfer-config", json.dumps(connectors[0], separators=(",", ":"))]
    elif connectors:
        multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"connectors": connectors}}
        args += ["--kv-transfer-config", json.dumps(multi, separators=(",", ":"))]
    args += list(spec.engine.args)
    return EngineContainer(image=image, command=("vllm", "serve"), args=tuple(args), env=tuple(env))


#: The first SGLang with ``--disaggregation-transfer-backend mooncake_tcp`` known here (0.5.3 lacks it).
SGLANG_MOONCAKE_TCP: Version = (0, 5, 23)
#: The first SGLang whose KV events place a page in its prompt: a position-aware hash chain and the parent
#: link of a node's first page (0.5.6). Older releases hash a page by its tokens alone and give every radix
#: node's first page no parent, so follow-up turns and split nodes cannot be indexed
#: (tests/interop/test_sglang_events.py): those images publish no KV events and the EPP keeps their picks as
#: an approximate index instead.
SGLANG_CHAINED_EVENTS: Version = (0, 5, 6)
#: SGLang releases whose rendered flags are checked against SGLang's own ServerArgs (tests/interop).
SGLANG_TESTED: tuple[Version, ...] = ((0, 5, 3), (0, 5, 23))


def sglang_args(spec: PoolSpec, role: str, settings: OperatorSettings) -> EngineContainer:
    """``sglang.launch_server``: page size, KV events, hierarchical cache (cpu tier, ssd tier as HiCache's
    ``file`` storage), P/D mode. SGLang's decode mode runs without the radix cache, which HiCache needs, so
    decode pods keep the GPU tier only; SGLang has no Redis storage backend, so a remote tier is refused."""
    gpu, cpu, ssd = spec.tier("gpu"), spec.tier("cpu"), spec.tier("ssd")
    image = spec.engine.image or settings.sglang_image
    version = image_version(image)
    if spec.tier("remote") is not None:
        raise EngineVersionError("tiers", "SGLang has no Redis storage backend for a remote tier "
                                          "(its HiCache storage: file, mooncake, hf3fs, nixl): drop the "
                                          "remote tier or use engine.kind vllm")
    args = [
        "--model-path", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(settings.engine_port),
        "--page-size", str(spec.block_size),
        "--enable-metrics",
    ]
    events = _at_least(version, SGLANG_CHAINED_EVENTS)
    if events:
        args += ["--kv-events-config", json.dumps(kv_events_config(settings), separators=(",", ":"))]
    env: list[dict[str, Any]] = []
    if spec.model.tokenizer:
        args += ["--tokenizer-path", spec.model.tokenizer]
    if gpu is not None and gpu.gpu_share is not None:
        args += ["--mem-fraction-static", f"{gpu.gpu_share:g}"]
    if role != "decode" and (cpu is not None or ssd is not None):
        args.append("--enable-hierarchical-cache")
        if cpu is not None and cpu.capacity_bytes:
            if cpu.capacity_bytes % GiB:
                raise EngineVersionError("tiers[cpu].capacity",
                                         f"SGLang's --hicache-size takes whole GiB; {cpu.capacity_bytes} "
                                         "bytes is not (write the capacity in Gi)")
            args += ["--hicache-size", str(cpu.capacity_bytes // GiB)]
        if ssd is not None:
            args += ["--hicache-storage-backend", "file"]
            env.append({"name": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "value": SSD_MOUNT})
    if role in ("prefill", "decode"):
        backends = spec.transfer.backends
        if "nixl" in backends:
            backend = "nixl"
        elif "mooncake" in backends:
            backend = "mooncake"
        elif _at_least(version, SGLANG_MOONCAKE_TCP):
            backend = "mooncake_tcp"
        else:
            raise EngineVersionError("transfer.backends",
                                     f"SGLang {_dotted(version)} has no TCP transfer backend "
                                     "(mooncake_tcp came by 0.5.23): list nixl or mooncake, or use a newer "
                                     "engine.image")
        args += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend]
    args += list(spec.engine.args)
    return EngineContainer(image=image, command=("python3", "-m", "sglang.launch_server"), args=tuple(args),
                           env=tuple(env), kv_events=events)


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
        raise UnknownEngineError(
            f"unknown engine kind {spec.engine.kind!r}; known: {', '.join(sorted(RENDERERS))}") from None
    return renderer(spec, role, settings)
