"""The operator's vLLM pods against real vLLM: every rendered ``vllm serve`` command line checked by vLLM
itself.

For each supported release (:data:`kvfleet.operator.engines.VLLM_TESTED`: v0.11.0 and v0.33.0, the chart's
default image), a matrix of KVCachePools (unified and prefill/decode × tiers gpu, gpu+cpu, gpu+ssd,
gpu+cpu+ssd+remote × both hash algorithms, plus fp8 KV, block size 32 and MooncakeConnector) is rendered by
the operator (``render_children``: every engine container of every Deployment), and vLLM's own parser,
``validate_parsed_serve_args``, ``AsyncEngineArgs`` and ``create_engine_config`` (vLLM's CPU platform, a local
2-layer Llama config in place of the weights: ``--model DIR --skip-tokenizer-init`` instead of the model name)
must accept each (tests/interop/vllm_check.py runs in the release's own venv). Then what vLLM built from them
must be what the pool asked for: the KV events with their replay endpoint, the block size and prefix caching,
sha256_cbor where asked, and the connectors (the P/D connector, CPU offloading sized in bytes from 0.14,
LMCache for ssd/remote). vLLM 0.11's CPU platform cannot build block size 32 (without
intel_extension_for_pytorch) nor fp8 KV with prefix caching: those cases passes the parser, validation and
engine arguments and is reported, not failed (a GPU build has no such limit). A flag a release does not know
fails the check (a rendered unknown flag, and the xxhash algorithm that v0.11 lacks and the operator used to
render). """

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.operator.engines import VLLM_MOONCAKE, VLLM_OFFLOAD_BYTES, VLLM_TESTED, EngineVersionError
from tests.interop.conftest import TINY, engine_args, release, run_checker

VERSIONS = [".".join(map(str, v)) for v in VLLM_TESTED]

TIERS: dict[str, list[dict[str, Any]]] = {
    "gpu": [{"name": "gpu", "gpuShare": 0.8}],
    "cpu": [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "2Gi"}],
    "ssd": [{"name": "gpu", "gpuShare": 0.8}, {"name": "ssd", "capacity": "20Gi"}],
    "all": [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "2Gi"},
            {"name": "ssd", "capacity": "20Gi"},
            {"name": "remote", "capacity": "1Ti", "redis": {"urlSecretRef": {"name": "kv-redis"}}}],
}
ROLES = {"unified": {"unified": {"replicas": 1}},
         "pd": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}


def _pool(version: str, name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "engine": {"kind": "vllm", "image": f"vllm/vllm-openai:v{version}"}, **spec}
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": body}


def _matrix(version: str) -> dict[str, dict[str, Any]]:
    pools: dict[str, dict[str, Any]] = {}
    for roles, role_spec in ROLES.items():
        for tiers, tier_spec in TIERS.items():
            for algo in ("xxh3_64", "sha256_cbor"):
                extra: dict[str, Any] = {"transfer": {"backends": ["nixl", "tcp"]}} if roles == "pd" else {}
                pools[f"{roles}-{tiers}-{algo}"] = _pool(version, "p", roles=role_spec, tiers=tier_spec,
                                                        hashAlgo=algo, **extra)
    pools["fp8"] = _pool(version, "p", tiers=[{"name": "gpu", "gpuShare": 0.9, "codec": "fp8_e4m3"}])
    pools["block32"] = _pool(version, "p", blockSize=32, tiers=TIERS["cpu"])
    if release(version) >= VLLM_MOONCAKE:
        pools["pd-mooncake-cpu"] = _pool(version, "p", roles=ROLES["pd"], tiers=TIERS["cpu"],
                                         transfer={"backends": ["mooncake"]})
    return pools


def _local(args: list[str]) -> list[str]:
    model, *rest = args
    assert model == "meta-llama/Llama-3.1-8B-Instruct"
    return ["--model", str(TINY), "--skip-tokenizer-init", *rest]


def _engine_argv(pool: dict[str, Any]) -> dict[str, list[str]]:
    """role → the engine container's arguments, the model name replaced by the local config (no weights, no
    hub)."""
    return engine_args(pool, ["vllm", "serve"], _local)


def run_vllm(version: str, cases: dict[str, list[str]], tmp: Path) -> dict[str, dict[str, Any]]:
    """vllm_check.py in vLLM ``version``'s venv over ``cases`` (id → argv); id → its result."""
    results = run_checker("vllm", version, "vllm_check.py", cases, tmp, {
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "ERROR"})
    assert all(r["vllm"] == version for r in results.values())
    return results


def _connectors(kv: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    if not kv or not kv.get("kv_connector"):
        return []
    extra = kv.get("kv_connector_extra_config") or {}
    if kv["kv_connector"] == "MultiConnector":
        return [c for inner in extra.get("connectors") or [] for c in _connectors(inner)]
    return [(kv["kv_connector"], extra)]


@pytest.fixture(scope="module", params=VERSIONS)
def checked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, Any], dict[str, dict[str, Any]]]:
    version: str = request.param
    pools = _matrix(version)
    cases = {f"{name}/{role}": argv
             for name, pool in pools.items() for role, argv in _engine_argv(pool).items()}
    return version, pools, run_vllm(version, cases, tmp_path_factory.mktemp("vllm"))


#: Refusals of vLLM's CPU platform itself (``CpuPlatform.check_and_update_config``), which a GPU build does
#: not make: the case's arguments passed the parser, validation and the engine arguments, the CPU platform
#: cannot build it.
CPU_PLATFORM_ONLY = ("requires intel_extension_for_pytorch", "on the CPU backend is not compatible")


def _cpu_platform_only(r: dict[str, Any]) -> bool:
    return r["stage"] == "engine_config" and any(m in e for e in r["error"] for m in CPU_PLATFORM_ONLY)


def test_every_rendered_pod_is_accepted(
    checked: tuple[str, dict[str, Any], dict[str, dict[str, Any]]],
) -> None:
    version, _, results = checked
    refused = {k: (r["stage"], r["error"]) for k, r in results.items()
               if not r["ok"] and not _cpu_platform_only(r)}
    assert not refused, f"vLLM {version} refused: {json.dumps(refused, indent=1)}"
    cpu_only = sorted(k for k, r in results.items() if not r["ok"] and _cpu_platform_only(r))
    if cpu_only:
        print(f"vLLM {version}: parsed and validated, not buildable on the CPU platform: {cpu_only}")


def test_vllm_builds_what_the_pool_asked_for(
    checked: tuple[str, dict[str, Any], dict[str, dict[str, Any]]],
) -> None:
    version, pools, results = checked
    v = release(version)
    for case, r in results.items():
        if not r["ok"]:
            continue  # reported by the test above
        name, role = case.split("/")
        spec = pools[name]["spec"]
        tiers = {t["name"] for t in spec.get("tiers") or []}
        ev = r["kv_events"]
        assert ev["enable_kv_cache_events"] and ev["publisher"] == "zmq", case
        assert (ev["endpoint"], ev["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558"), case
        assert r["block_size"] == spec.get("blockSize", 16) and r["prefix_caching"], case
        if spec.get("hashAlgo") == "sha256_cbor":
            assert r["hash_algo"] == "sha256_cbor", case
        names = [n for n, _ in _connectors(r["kv_transfer"])]
        if role in ("prefill", "decode"):
            assert ("MooncakeConnector" if "mooncake" in name else "NixlConnector") in names, (case, names)
        if tiers & {"ssd", "remote"}:
            assert "LMCacheConnectorV1" in names, (case, names)
        elif "cpu" in tiers:
            (extra,) = [e for n, e in _connectors(r["kv_transfer"]) if n == "OffloadingConnector"]
            # vLLM's CPU offloading spec from 0.14 sizes the tier in bytes and refuses a config without them
            assert ("cpu_bytes_to_use" in extra) == (v >= VLLM_OFFLOAD_BYTES), (case, extra)
        if tiers == {"gpu"} and role == "unified":
            assert names == [], (case, names)


def test_a_flag_a_release_does_not_know_fails(tmp_path: Path) -> None:
    """The check can fail: an unknown flag (through engine.args) on every release, and vLLM's ``xxhash``
    prefix hash, which the operator rendered for xxh3_64 pools before and v0.11 does not have."""
    for version in VERSIONS:
        pool = _pool(version, "p", engine={"kind": "vllm", "image": f"vllm/vllm-openai:v{version}",
                                           "args": ["--no-such-flag", "1"]})
        bad_xxhash = copy.deepcopy(_pool(version, "p"))
        bad_xxhash["spec"]["engine"]["args"] = ["--prefix-caching-hash-algo", "xxhash"]
        cases = {"unknown": _engine_argv(pool)["unified"], "xxhash": _engine_argv(bad_xxhash)["unified"]}
        results = run_vllm(version, cases, tmp_path)
        assert not results["unknown"]["ok"] and results["unknown"]["stage"] == "parse", results["unknown"]
        assert "--no-such-flag" in " ".join(results["unknown"]["error"]), results["unknown"]
        assert results["xxhash"]["ok"] is (version != "0.11.0"), results["xxhash"]


def test_mooncake_on_a_release_without_it_is_an_invalid_spec() -> None:
    pool = _pool("0.11.0", "p", roles=ROLES["pd"], transfer={"backends": ["mooncake"]})
    with pytest.raises(EngineVersionError, match="MooncakeConnector"):
        _engine_argv(pool)
