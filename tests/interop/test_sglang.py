"""The operator's SGLang pods against real SGLang: every rendered ``sglang.launch_server`` command line
checked by SGLang.

For each supported release (:data:`kvfleet.operator.engines.SGLANG_TESTED`: 0.5.3, and 0.5.23, the chart's
default image), a matrix of KVCachePools (unified and prefill/decode × tiers gpu, gpu+cpu, gpu+ssd,
gpu+cpu+ssd × P/D backends nixl, mooncake, tcp (from 0.5.23; before, an InvalidSpec) × page sizes 16 and 64)
is rendered by the operator and every engine container's arguments go through SGLang's own
``prepare_server_args`` and ``ServerArgs.resolve_once()`` (tests/interop/sglang_check.py in the release's
venv; a local 2-layer Llama config in place of the weights: ``--model-path DIR``, and ``--device cpu``). What
SGLang resolved must be what the pool asked for: the page size, HiCache with its host size and ``file``
storage on prefill/unified pods and not on decode pods (SGLang's decode mode refuses it), the disaggregation
mode and transfer backend, the KV events with their replay endpoint. The check can fail: an unknown flag, and
``--enable-hierarchical-cache`` on a decode pod (what the operator rendered before for a cpu tier) are
refused. """

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.operator.engines import (
    SGLANG_CHAINED_EVENTS,
    SGLANG_MOONCAKE_TCP,
    SGLANG_TESTED,
    EngineVersionError,
)
from tests.interop.conftest import TINY, engine_args, release, run_checker

VERSIONS = [".".join(map(str, v)) for v in SGLANG_TESTED]
TIERS: dict[str, list[dict[str, Any]]] = {
    "gpu": [{"name": "gpu", "gpuShare": 0.8}],
    "cpu": [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "2Gi"}],
    "ssd": [{"name": "gpu", "gpuShare": 0.8}, {"name": "ssd", "capacity": "20Gi"}],
    "cpu-ssd": [{"name": "gpu", "gpuShare": 0.8}, {"name": "cpu", "capacity": "2Gi"},
                {"name": "ssd", "capacity": "20Gi"}],
}


def _pool(version: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "engine": {"kind": "sglang", "image": f"lmsysorg/sglang:v{version}"}, **spec}
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": body}


def _matrix(version: str) -> dict[str, dict[str, Any]]:
    pools: dict[str, dict[str, Any]] = {}
    tcp = ("tcp",) if release(version) >= SGLANG_MOONCAKE_TCP else ()  # before: an InvalidSpec (test below)
    for tiers, tier_spec in TIERS.items():
        pools[f"unified-{tiers}"] = _pool(version, tiers=tier_spec)
        for backend in ("nixl", "mooncake", *tcp):
            pools[f"pd-{tiers}-{backend}"] = _pool(
                version, tiers=tier_spec, roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                transfer={"backends": [backend]})
    pools["page64"] = _pool(version, blockSize=64, tiers=TIERS["cpu"])
    return pools


def _local(args: list[str]) -> list[str]:
    args[args.index("--model-path") + 1] = str(TINY)
    return [*args, "--device", "cpu"]


def _argv(pool: dict[str, Any]) -> dict[str, list[str]]:
    return engine_args(pool, ["python3", "-m", "sglang.launch_server"], _local)


def run_sglang(version: str, cases: dict[str, list[str]], tmp: Path) -> dict[str, dict[str, Any]]:
    return run_checker("sglang", version, "sglang_check.py", cases, tmp, {})


@pytest.fixture(scope="module", params=VERSIONS)
def checked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, Any], dict[str, dict[str, Any]]]:
    version: str = request.param
    pools = _matrix(version)
    cases = {f"{name}/{role}": argv for name, pool in pools.items() for role, argv in _argv(pool).items()}
    return version, pools, run_sglang(version, cases, tmp_path_factory.mktemp("sglang"))


def test_every_rendered_pod_is_accepted(
    checked: tuple[str, dict[str, Any], dict[str, dict[str, Any]]],
) -> None:
    version, _, results = checked
    refused = {k: (r["stage"], r["error"]) for k, r in results.items() if not r["ok"]}
    assert not refused, f"SGLang {version} refused: {json.dumps(refused, indent=1)}"


def test_sglang_resolves_what_the_pool_asked_for(
    checked: tuple[str, dict[str, Any], dict[str, dict[str, Any]]],
) -> None:
    version, pools, results = checked
    for case, r in results.items():
        if not r["ok"]:
            continue
        name, role = case.split("/")
        spec = pools[name]["spec"]
        tiers = {t["name"] for t in spec.get("tiers") or []}
        assert r["page_size"] == spec.get("blockSize", 16), case
        if release(version) >= SGLANG_CHAINED_EVENTS:
            events = json.loads(r["kv_events_config"])
            assert events["publisher"] == "zmq" and events["endpoint"] == "tcp://*:5557", case
            assert events["replay_endpoint"] == "tcp://*:5558" and events["topic"] == "kv-events", case
        else:  # events SGLang cannot place in their prompts are not published (test_sglang_events.py)
            assert r["kv_events_config"] is None, case
        wants_hicache = role != "decode" and bool(tiers & {"cpu", "ssd"})
        assert r["hicache"] is wants_hicache, (case, r)
        if wants_hicache and "cpu" in tiers:
            assert r["hicache_size"] == 2, (case, r)
        if wants_hicache and "ssd" in tiers:
            assert r["hicache_storage_backend"] == "file", (case, r)
        if role in ("prefill", "decode"):
            backend = {"nixl": "nixl", "mooncake": "mooncake", "tcp": "mooncake_tcp"}[
                spec["transfer"]["backends"][0]]
            assert r["disaggregation"] == [role, backend], (case, r)


def test_what_sglang_refuses_fails_the_check(tmp_path: Path) -> None:
    """An unknown flag, and HiCache on a decode pod (SGLang's decode mode runs without the radix cache)."""
    for version in VERSIONS:
        pd = {"roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
              "transfer": {"backends": ["nixl"]}}
        decode = _argv(_pool(version, **pd))["decode"]
        cases = {"unknown": [*_argv(_pool(version))["unified"], "--no-such-flag", "1"],
                 "decode-hicache": [*decode, "--enable-hierarchical-cache", "--hicache-size", "2"]}
        results = run_sglang(version, cases, tmp_path)
        assert not results["unknown"]["ok"] and "--no-such-flag" in " ".join(results["unknown"]["error"]), (
            results["unknown"])
        assert not results["decode-hicache"]["ok"], results["decode-hicache"]


def test_tcp_transfer_before_mooncake_tcp_is_an_invalid_spec() -> None:
    for version in VERSIONS:
        pool = _pool(version, roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                     transfer={"backends": ["tcp"]})
        if release(version) >= SGLANG_MOONCAKE_TCP:
            assert "mooncake_tcp" in _argv(pool)["decode"]
        else:
            with pytest.raises(EngineVersionError, match="no TCP transfer backend"):
                _argv(pool)
