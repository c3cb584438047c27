"""The engine with the node agent's tier manager below its GPU stand-in (``engine.tiers.backend: agent``).

Covers: blocks reclaimed from the GPU go into the agent's cpu tier (KV events with
medium CPU), a later request for the same prompt is served from there
(``cached_tokens`` > 0, promotion priced by the cost model) and produces the same
output as the first time, i.e. the bytes came back intact.
"""

from __future__ import annotations

from pathlib import Path

from kvfleet.cache.events import BlockStored
from tests.engine.conftest import EngineFactory

MODEL = "llama-3-8b"


async def test_demoted_blocks_come_back_from_the_agent_cpu_tier(make_engine: EngineFactory, tmp_path: Path) -> None:
    agent = {"tiers": {"calibrate": False, "cpu": {"capacity_bytes": 1 << 20, "slab_bytes": 1 << 16},
                       "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 1 << 20}}}
    eng = await make_engine(num_gpu_blocks=48, tiers={"backend": "agent"}, sections=agent)
    server = eng.server
    assert server.agent_tiers is not None
    stored_media: set[str | None] = set()
    sink = server.events

    def spy(event: object) -> None:
        if isinstance(event, BlockStored):
            stored_media.add(event.medium)
        sink(event)  # type: ignore[arg-type]

    server.kv.out_sink = spy
    server.agent_tiers.mgr.sink = spy

    prompt = list(range(5000, 5000 + 320))  # 20 blocks
    st, first, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5})
    assert st == 200
    for base in (100_000, 200_000):  # 40 blocks each: reclaim every block of the first prompt
        st, _, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": list(range(base, base + 640)), "max_tokens": 1})
        assert st == 200
    assert "CPU" in stored_media
    st, again, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5})
    assert st == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 19 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert server.kv.tier_hits["cpu"] >= 19
