"""``bench.routing``'s simulated pods keep and evict prefix blocks as vLLM's own KV cache manager does.

One random forest of contexts (each request a randomly chosen earlier request's prompt, or a new root,
extended by 1–4 new blocks: sessions, agent branches), served one request after another: the hits of a
:class:`~bench.routing.SimPod` and those of vLLM's ``KVCacheManager`` (tests/interop/vllm_evict_check.py,
in each tested release's venv) with the same number of blocks, request by request. vLLM frees a finished
request's blocks tail first, so a full cache gives up the end of its least recently used context before
its beginning; a pod that evicted beginnings first lost whole contexts to one eviction (the routing
simulation's small caches judged placements by that)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from bench.routing import BLOCK, Req, SimConfig, SimPod
from kvfleet.operator.engines import VLLM_TESTED
from tests.interop.conftest import engine_python

HERE = Path(__file__).parent
VERSIONS = [".".join(map(str, v)) for v in VLLM_TESTED]
CAPACITY = 48


def forest(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 30))
    out: list[list[int]] = []
    for _ in range(n):
        base = rng.choice(out) if out and rng.random() < 0.8 else []
        grow = rng.randint(1, 4)
        if len(base) + grow > CAPACITY // 2:
            base = []
        out.append([*base, *(next(ids) for _ in range(grow))])
    return out


def simulated_hits(requests: list[list[int]]) -> list[int]:
    pod = SimPod(SimConfig(pods=1, gpu_blocks=CAPACITY))
    hits = []
    for i, blocks in enumerate(requests):
        _, hit_tokens, _ = pod.serve(Req(float(i), len(blocks) * BLOCK, blocks), pod.busy_until)
        hits.append(hit_tokens // BLOCK)
    return hits


@pytest.mark.parametrize("version", VERSIONS)
def test_simulated_pods_evict_as_vllm(version: str, tmp_path: Path) -> None:
    py = engine_python("vllm", version)
    requests = forest(400, seed=7)
    path = tmp_path / "requests.json"
    path.write_text(json.dumps({"capacity": CAPACITY, "block_size": 16, "requests": requests}))
    proc = subprocess.run([str(py), str(HERE / "vllm_evict_check.py"), str(path)], capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    vllm_hits = json.loads(lines[0])
    ours = simulated_hits(requests)
    assert sum(vllm_hits) > len(requests)  # the cache is hit and also overflows (the check can tell orders)
    assert sum(vllm_hits) < sum(len(r) for r in requests) - len(requests) * 2
    differ = [(i, vllm_hits[i], ours[i]) for i in range(len(requests)) if vllm_hits[i] != ours[i]]
    assert not differ, f"vLLM {version}: (request, its hit blocks, the simulated pod's) {differ[:10]}"
