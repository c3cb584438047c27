"""GPU-mode wiring: the vLLM (and SGLang) command lines rendered from KVCachePool fields, per engine version.

A fast structural check of the renderer: flags from `vllm serve`'s documented engine
arguments, JSON values with KVEventsConfig / KVTransferConfig fields, and what each
vLLM version gets (offloading sized in blocks before 0.14, in bytes from 0.14;
MooncakeConnector only from 0.13; the version read from the image tag). Whether
vLLM itself accepts them is tests/interop (vLLM's own parser and engine config).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.config.operator import OperatorSettings
from kvfleet.operator.engines import (
    RENDERERS,
    EngineVersionError,
    UnknownEngineError,
    image_version,
    render_engine,
    vllm_args,
)
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
KV_EVENTS_FIELDS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
                    "hwm", "max_queue_size", "topic"}
# vllm.config.kv_transfer.KVTransferConfig fields.
KV_TRANSFER_FIELDS = {"kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role",
                      "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config",
                      "kv_connector_module_path", "enable_permute_local_kv"}
KV_CONNECTORS = {"OffloadingConnector", "LMCacheConnectorV1", "NixlConnector", "MooncakeConnector",
                 "MultiConnector", "P2pNcclConnector"}
KV_ROLES = {"kv_producer", "kv_consumer", "kv_both"}
LMCACHE_ENV = {"LMCACHE_CHUNK_SIZE", "LMCACHE_USE_EXPERIMENTAL", "LMCACHE_LOCAL_CPU",
               "LMCACHE_MAX_LOCAL_CPU_SIZE", "LMCACHE_LOCAL_DISK", "LMCACHE_MAX_LOCAL_DISK_SIZE",
               "LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_SERDE"}


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
    """The full sample: prefix caching + sha256_cbor, KV events on the ZMQ port, fp8 KV, NIXL + LMCache via
    MultiConnector."""
    spec = parse_spec(samples.FULL_GPU["spec"])
    container = vllm_args(spec, "decode", OperatorSettings())
    model, flags = _parse_vllm(container.args)
    assert model == "meta-llama/Llama-3.1-8B-Instruct"
    assert flags["--block-size"] == 16 and flags["--enable-prefix-caching"] is True
    assert flags["--prefix-caching-hash-algo"] == "sha256_cbor"
    assert flags["--gpu-memory-utilization"] == 0.9 and flags["--kv-cache-dtype"] == "fp8_e4m3"
    events = flags["--kv-events-config"]
    assert set(events) <= KV_EVENTS_FIELDS
    assert (events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
            and events["endpoint"] == "tcp://*:5557")
    assert _check_connector(flags["--kv-transfer-config"]) == ["NixlConnector", "LMCacheConnectorV1"]
    assert flags["--max-model-len"] == 32768  # engine.args come last
    env = {e["name"]: e for e in container.env}
    assert set(env) <= LMCACHE_ENV
    assert (env["LMCACHE_MAX_LOCAL_CPU_SIZE"]["value"] == "64"
            and env["LMCACHE_MAX_LOCAL_DISK_SIZE"]["value"] == "1024")
    assert env["LMCACHE_LOCAL_DISK"]["value"] == "file:///var/lib/kvfleet/ssd/"


def test_cpu_tier_only_uses_vllm_native_offloading() -> None:
    """A cpu tier alone → OffloadingConnector: vLLM 0.11 sizes it in blocks (capacity / (bytes per token ×
    block size)), from 0.14 in bytes (``cpu_bytes_to_use``); a tag naming no version gets the newest form."""
    tiers = [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "8Gi"}]
    for image, extra in (("vllm/vllm-openai:v0.11.0",
                          {"num_cpu_blocks": 8 * 1024**3 // (131072 * 16), "block_size": 16}),
                         ("vllm/vllm-openai:v0.33.0", {"cpu_bytes_to_use": 8 * 1024**3}),
                         ("vllm/vllm-openai:latest", {"cpu_bytes_to_use": 8 * 1024**3})):
        _, flags = _parse_vllm(vllm_args(_spec(tiers=tiers, engine={"kind": "vllm", "image": image}),
                                         "unified", OperatorSettings()).args)
        cfg = flags["--kv-transfer-config"]
        assert _check_connector(cfg) == ["OffloadingConnector"], image
        assert cfg["kv_connector_extra_config"] == extra, image


def test_pd_with_cpu_tier_keeps_both_connectors() -> None:
    """P/D + a cpu tier on vLLM 0.33 → MultiConnector [Nixl, Offloading] (``--kv-offloading-size`` would
    replace Nixl)."""
    spec = _spec(tiers=[{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "2Gi"}],
                 engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.33.0"},
                 roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                 transfer={"backends": ["nixl"]})
    _, flags = _parse_vllm(vllm_args(spec, "prefill", OperatorSettings()).args)
    assert "--kv-offloading-size" not in flags
    cfg = flags["--kv-transfer-config"]
    assert (cfg["kv_connector"] == "MultiConnector"
            and _check_connector(cfg) == ["NixlConnector", "OffloadingConnector"])


def test_mooncake_needs_vllm_0_13() -> None:
    pd = {"roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
          "transfer": {"backends": ["mooncake"]}}
    with pytest.raises(EngineVersionError, match=r"MooncakeConnector.*0\.13"):
        vllm_args(_spec(engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"}, **pd), "prefill",
                  OperatorSettings())
    _, flags = _parse_vllm(vllm_args(_spec(engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.33.0"},
                                           **pd), "prefill", OperatorSettings()).args)
    assert _check_connector(flags["--kv-transfer-config"]) == ["MooncakeConnector"]


@pytest.mark.parametrize(("image", "version"), [("vllm/vllm-openai:v0.11.0", (0, 11, 0)),
                                                ("lmsysorg/sglang:v0.5.3-cu126", (0, 5, 3)),
                                                ("registry:5000/vllm:0.33.0", (0, 33, 0)),
                                                ("vllm/vllm-openai:latest", None),
                                                ("registry:5000/vllm", None), ("vllm@sha256:abcd", None)])
def test_image_version(image: str, version: tuple[int, int, int] | None) -> None:
    assert image_version(image) == version


def test_gpu_only_pool_has_no_connector_and_hash_flag_follows_the_pool() -> None:
    """No slower tier and no P/D → no KV connector; xxh3_64 keeps vLLM's default hash (the EPP re-keys from
    token ids), sha256_cbor asks vLLM for it (the EPP's keys then equal vLLM's); the KV events come with a
    replay endpoint."""
    _, flags = _parse_vllm(vllm_args(_spec(), "unified", OperatorSettings()).args)
    assert "--kv-transfer-config" not in flags
    assert "--prefix-caching-hash-algo" not in flags
    assert flags["--kv-events-config"]["replay_endpoint"] == "tcp://*:5558"
    _, flags = _parse_vllm(vllm_args(_spec(hashAlgo="sha256_cbor"), "unified", OperatorSettings()).args)
    assert flags["--prefix-caching-hash-algo"] == "sha256_cbor"


def test_kv_events_port_follows_settings() -> None:
    """The ZMQ endpoint uses operator.kv_events_port (what the pods expose and the EPP subscribes to)."""
    _, flags = _parse_vllm(vllm_args(_spec(), "unified", OperatorSettings(kv_events_port=6000)).args)
    assert flags["--kv-events-config"]["endpoint"] == "tcp://*:6000"


def _sglang(tiers: list[dict[str, Any]] | None = None, image: str = "lmsysorg/sglang:v0.5.23",
            **changes: Any) -> PoolSpec:
    pd = {"roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
          "transfer": {"backends": ["nixl"]}}
    return parse_spec({**samples.MINIMAL["spec"], "engine": {"kind": "sglang", "image": image}, **pd,
                       "tiers": tiers or [{"name": "gpu", "gpuShare": 0.8}], **changes})


def test_sglang_pd_roles() -> None:
    """SGLang P/D pods get --disaggregation-mode per role and the preferred transfer backend; tcp alone is
    mooncake_tcp where SGLang has it (0.5.23), an InvalidSpec before."""
    args = render_engine(_sglang(), "prefill", OperatorSettings()).args
    assert args[args.index("--disaggregation-mode") + 1] == "prefill"
    assert args[args.index("--disaggregation-transfer-backend") + 1] == "nixl"
    assert args[args.index("--page-size") + 1] == "16"
    tcp: dict[str, Any] = {"transfer": {"backends": ["tcp"]}}
    args = render_engine(_sglang(**tcp), "decode", OperatorSettings()).args
    assert args[args.index("--disaggregation-transfer-backend") + 1] == "mooncake_tcp"
    with pytest.raises(EngineVersionError, match="TCP transfer backend"):
        render_engine(_sglang(image="lmsysorg/sglang:v0.5.3-cu126", **tcp), "decode", OperatorSettings())


def test_sglang_tiers() -> None:
    """cpu tier → HiCache in whole GiB, ssd tier → HiCache's file storage in the ssd volume; decode pods (no
    radix cache in SGLang's decode mode) get neither; a capacity SGLang cannot express and a remote tier are
    InvalidSpec."""
    tiers: list[dict[str, Any]] = [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "2Gi"},
                                   {"name": "ssd", "capacity": "20Gi"}]
    c = render_engine(_sglang(tiers), "prefill", OperatorSettings())
    assert "--enable-hierarchical-cache" in c.args and c.args[c.args.index("--hicache-size") + 1] == "2"
    assert c.args[c.args.index("--hicache-storage-backend") + 1] == "file"
    assert {"name": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "value": "/var/lib/kvfleet/ssd"} in c.env
    d = render_engine(_sglang(tiers), "decode", OperatorSettings())
    assert "--enable-hierarchical-cache" not in d.args and "--hicache-size" not in d.args
    with pytest.raises(EngineVersionError, match="whole GiB"):
        render_engine(_sglang([tiers[0], {"name": "cpu", "capacity": "1536Mi"}]), "prefill",
                      OperatorSettings())
    with pytest.raises(EngineVersionError, match="no Redis storage backend"):
        render_engine(_sglang([tiers[0], {"name": "remote", "capacity": "1Ti",
                                          "redis": {"urlSecretRef": {"name": "r"}}}]), "prefill",
                      OperatorSettings())


def test_unknown_engine_lists_known_ones() -> None:
    """The renderer registry names the known engines in its error."""
    spec = PoolSpec()
    bad = PoolSpec(engine=type(spec.engine)(kind="trtllm"))
    with pytest.raises(UnknownEngineError, match="known: sglang, sim, vllm"):
        render_engine(bad, "unified", OperatorSettings())
    assert set(RENDERERS) == {"sim", "vllm", "sglang"}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_default_images_are_the_newest_checked_and_publish_kv_events(kind: str) -> None:
    """A pool that names no image gets the newest release the interop suite checks (VLLM_TESTED,
    SGLANG_TESTED), and its pods publish KV events the EPP indexes (``--kv-events-config``)."""
    from kvfleet.operator.engines import SGLANG_TESTED, VLLM_TESTED

    settings = OperatorSettings()
    default = settings.vllm_image if kind == "vllm" else settings.sglang_image
    assert image_version(default) == max(VLLM_TESTED if kind == "vllm" else SGLANG_TESTED)
    spec = parse_spec({**samples.MINIMAL["spec"], "engine": {"kind": kind}})
    for role in spec.roles:
        container = render_engine(spec, role.name, settings)
        assert container.image == default and container.kv_events
        assert "--kv-events-config" in container.args
