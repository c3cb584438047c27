"""GPU-mode wiring: the vLLM (and SGLang) command lines rendered from KVCachePool fields.

vLLM cannot run here (no GPU), so the rendered arguments are checked against
vLLM's documented interface: every flag is one of `vllm serve`'s documented
engine arguments (docs.vllm.ai, "Engine Arguments", v0.11–v0.16), enumerated
values are within the documented choices, and the JSON arguments carry only
documented fields of KVEventsConfig / KVTransferConfig with known connector names.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.engines import RENDERERS, UnknownEngineError, render_engine, vllm_args
from kvfleet.operator.spec import PoolSpec, parse_spec
from tests.operator import samples

# Documented `vllm serve` flags the renderer may emit: flag -> value kind
# ("bool" takes no value; a tuple lists the documented choices).
VLLM_FLAGS: dict[str, Any] = {
    "--host": str,
    "--port": int,
    "--tokenizer": str,
    "--block-size": (1, 8, 16, 32, 64, 128, 256),
    "--enable-prefix-caching": "bool",
    "--prefix-caching-hash-algo": ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
    "--gpu-memory-utilization": float,
    "--kv-cache-dtype": ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"),
    "--kv-events-config": "json",
    "--kv-transfer-config": "json",
    "--max-model-len": int,
}
# vllm.config.kv_events.KVEventsConfig fields.
KV_EVENTS_FIELDS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"}
# vllm.config.kv_transfer.KVTransferConfig fields.
KV_TRANSFER_FIELDS = {"kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank", "kv_parallel_size",
                      "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path", "enable_permute_local_kv"}
KV_CONNECTORS = {"OffloadingConnector", "LMCacheConnectorV1", "NixlConnector", "MooncakeConnector", "MultiConnector", "P2pNcclConnector"}
KV_ROLES = {"kv_producer", "kv_consumer", "kv_both"}
LMCACHE_ENV = {"LMCACHE_CHUNK_SIZE", "LMCACHE_USE_EXPERIMENTAL", "LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE",
               "LMCACHE_LOCAL_DISK", "LMCACHE_MAX_LOCAL_DISK_SIZE", "LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_SERDE"}


def _parse_vllm(args: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """Parse `vllm serve MODEL [flags]` strictly against VLLM_FLAGS."""
    model, rest = args[0], list(args[1:])
    flags: dict[str, Any] = {}
    while rest:
        flag = rest.pop(0)
        assert flag in VLLM_FLAGS, f"{flag} is not a documented vllm serve flag"
        kind = VLLM_FLAGS[flag]
        if kind == "bool":
            flags[flag] = True
            continue
        value = rest.pop(0)
        if kind == "json":
            flags[flag] = json.loads(value)
        elif isinstance(kind, tuple):
            parsed = int(value) if isinstance(kind[0], int) else value
            assert parsed in kind, f"{flag} {value} is not among {kind}"
            flags[flag] = parsed
        else:
            flags[flag] = kind(value)
    return model, flags


def _check_connector(cfg: dict[str, Any]) -> list[str]:
    assert set(cfg) <= KV_TRANSFER_FIELDS, set(cfg) - KV_TRANSFER_FIELDS
    assert cfg["kv_connector"] in KV_CONNECTORS and cfg["kv_role"] in KV_ROLES
    if cfg["kv_connector"] == "MultiConnector":
        return [n for c in cfg["kv_connector_extra_config"]["connectors"] for n in _check_connector(c)]
    return [cfg["kv_connector"]]


def _spec(**changes: Any) -> PoolSpec:
    return parse_spec({**samples.MINIMAL["spec"], "engine": {"kind": "vllm"}, **changes})


def test_full_gpu_pool_renders_documented_flags() -> None:
    """The full sample: prefix caching + sha256_cbor, KV events on the ZMQ port, fp8 KV, NIXL + LMCache via MultiConnector."""
    spec = parse_spec(samples.FULL_GPU["spec"])
    container = vllm_args(spec, "decode", OperatorSettings())
    model, flags = _parse_vllm(container.args)
    assert model == "meta-llama/Llama-3.1-8B-Instruct"
    assert flags["--block-size"] == 16 and flags["--enable-prefix-caching"] is True
    assert flags["--prefix-caching-hash-algo"] == "sha256_cbor"
    assert flags["--gpu-memory-utilization"] == 0.9 and flags["--kv-cache-dtype"] == "fp8_e4m3"
    events = flags["--kv-events-config"]
    assert set(events) <= KV_EVENTS_FIELDS
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq" and events["endpoint"] == "tcp://*:5557"
    assert _check_connector(flags["--kv-transfer-config"]) == ["NixlConnector", "LMCacheConnectorV1"]
    assert flags["--max-model-len"] == 32768  # engine.args come last
    env = {e["name"]: e for e in container.env}
    assert set(env) <= LMCACHE_ENV
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"]["value"] == "64" and env["LMCACHE_MAX_LOCAL_DISK_SIZE"]["value"] == "1024"
    assert env["LMCACHE_LOCAL_DISK"]["value"] == "file:///var/lib/kvfleet/ssd/"


def test_cpu_tier_only_uses_vllm_native_offloading() -> None:
    """A cpu tier alone → OffloadingConnector with num_cpu_blocks = capacity / (bytes per token × block size)."""
    spec = _spec(tiers=[{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "8Gi"}])
    _, flags = _parse_vllm(vllm_args(spec, "unified", OperatorSettings()).args)
    cfg = flags["--kv-transfer-config"]
    assert _check_connector(cfg) == ["OffloadingConnector"]
    assert cfg["kv_connector_extra_config"] == {"num_cpu_blocks": 8 * 1024**3 // (131072 * 16), "block_size": 16}


def test_gpu_only_pool_has_no_connector_and_xxhash() -> None:
    """No slower tier and no P/D → no KV connector; xxh3_64 maps to vLLM's xxhash (EPP re-keys from token ids)."""
    _, flags = _parse_vllm(vllm_args(_spec(), "unified", OperatorSettings()).args)
    assert "--kv-transfer-config" not in flags
    assert flags["--prefix-caching-hash-algo"] == "xxhash"


def test_kv_events_port_follows_settings() -> None:
    """The ZMQ endpoint uses operator.kv_events_port (what the pods expose and the EPP subscribes to)."""
    _, flags = _parse_vllm(vllm_args(_spec(), "unified", OperatorSettings(kv_events_port=6000)).args)
    assert flags["--kv-events-config"]["endpoint"] == "tcp://*:6000"


def test_sglang_pd_roles() -> None:
    """SGLang P/D pods get --disaggregation-mode per role and the preferred transfer backend."""
    spec = parse_spec({**samples.FULL_GPU["spec"], "engine": {"kind": "sglang"}})
    args = render_engine(spec, "prefill", OperatorSettings()).args
    assert args[args.index("--disaggregation-mode") + 1] == "prefill"
    assert args[args.index("--disaggregation-transfer-backend") + 1] == "nixl"
    assert args[args.index("--page-size") + 1] == "16"


def test_unknown_engine_lists_known_ones() -> None:
    """The renderer registry names the known engines in its error."""
    spec = PoolSpec()
    bad = PoolSpec(engine=type(spec.engine)(kind="trtllm"))
    with pytest.raises(UnknownEngineError, match="known: sglang, sim, vllm"):
        render_engine(bad, "unified", OperatorSettings())
    assert set(RENDERERS) == {"sim", "vllm", "sglang"}
