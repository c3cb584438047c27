"""The engine over HTTP with the node agent's tier manager below its GPU stand-in (``engine.tiers``).

Covers: blocks reclaimed from the GPU go into the agent's cpu tier (KV events with
medium CPU), a later request for the same prompt is served from there
(``cached_tokens`` > 0, promotion priced by the cost model) and produces the same
output as the first time, i.e. the bytes came back intact; the engine's
``/metrics`` carries the tier manager's ``kvfleet_tier_*`` series next to vLLM's;
with a lossy cpu codec the promoted blocks change the answer; a cache reset empties
the tiers, blocks recovered from an earlier run included; the KV events the tier
manager's threads add while the engine is idle (writes landing on SSD) are published
without waiting for a request.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.cache.events import AnyEvent, BlockRemoved, BlockStored, stored
from kvfleet.engine.tiers import AgentTiers
from tests.conftest import eventually
from tests.engine.conftest import EngineFactory, RunningEngine

MODEL = "llama-3-8b"


def tee(eng: RunningEngine) -> list[AnyEvent]:
    """Every KV event the engine emits from now on (its GPU stand-in's and its tier manager's)."""
    seen: list[AnyEvent] = []
    sink = eng.server.events

    def spy(event: Any) -> None:
        seen.append(event)
        sink(event)

    eng.server.kv.out_sink = spy
    tiers = eng.server.kv.tiers
    assert isinstance(tiers, AgentTiers)
    tiers.mgr.sink = spy
    return seen


async def complete(eng: RunningEngine, prompt: list[int], max_tokens: int = 5) -> dict[str, Any]:
    st, body, _ = await eng.post("/v1/completions",
                                 {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert st == 200, body
    out: dict[str, Any] = body
    return out


async def push_out(eng: RunningEngine) -> None:
    """Two fresh prompts of 40 blocks: every block of a 48-block GPU cached before is reclaimed."""
    for base in (100_000, 200_000):
        await complete(eng, list(range(base, base + 640)), max_tokens=1)


async def metrics(eng: RunningEngine) -> dict[tuple[str, str], float]:
    """``(sample name, tier label)`` → value, from the engine's ``/metrics``."""
    async with aiohttp.ClientSession() as s, s.get(eng.url + "/metrics") as r:
        text = await r.text()
    return {(x.name, x.labels.get("tier", "")): x.value
            for f in text_string_to_metric_families(text) for x in f.samples}


PROMPT = list(range(5000, 5000 + 320))  # 20 blocks


async def test_demoted_blocks_come_back_from_the_agent_cpu_tier(make_engine: EngineFactory) -> None:
    eng = await make_engine(num_gpu_blocks=48, tiers={"cpu_blocks": 64})
    seen = tee(eng)
    first = await complete(eng, PROMPT)
    await push_out(eng)
    assert {"GPU", "CPU"} <= {e.medium for e in seen if isinstance(e, BlockStored)}
    again = await complete(eng, PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 19 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert eng.server.kv.tier_hits["cpu"] >= 19
    m = await metrics(eng)
    assert m[("kvfleet_engine_tier_hit_blocks_total", "cpu")] >= 19
    assert m[("kvfleet_tier_blocks", "cpu")] == 64 and m[("kvfleet_tier_stores_total", "cpu")] > 64
    assert m[("kvfleet_tier_capacity_bytes", "cpu")] == 64 * 256  # 16 tokens × 8 fp16 values per block
    assert ("kvfleet_tier_blocks", "gpu") not in m or m[("kvfleet_tier_blocks", "gpu")] == 0


async def test_a_lossy_cpu_codec_changes_the_answer(make_engine: EngineFactory) -> None:
    eng = await make_engine(num_gpu_blocks=48, tiers={"cpu_blocks": 64},
                            sections={"tiers": {"cpu": {"codec": "int4"}}})
    first = await complete(eng, PROMPT)
    await push_out(eng)
    again = await complete(eng, PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 19 * 16
    assert again["choices"][0]["text"] != first["choices"][0]["text"]


async def test_reset_empties_the_tiers_with_the_blocks_recovered_at_start(
    make_engine: EngineFactory, pool_secret: bytes, tmp_path: Path
) -> None:
    tiers = {"cpu_blocks": 0, "ssd_dir": str(tmp_path), "ssd_blocks": 256}
    eng = await make_engine(num_gpu_blocks=48, tiers=tiers)
    await complete(eng, PROMPT)
    await push_out(eng)
    # the first engine's tiers close (its writes land); its SSD blocks stay
    await asyncio.to_thread(eng.server.kv.close)
    eng = await make_engine(num_gpu_blocks=48, tiers=tiers)
    agent = eng.server.kv.tiers
    assert isinstance(agent, AgentTiers)
    held = agent.mgr.blocks_in(agent.top)
    assert held >= 20
    seen = tee(eng)
    st, out, _ = await eng.call("POST", "/kvfleet/v1/reset", signed=True)
    assert st == 200, out
    assert agent.mgr.blocks_in(agent.top) == 0
    assert len([h for e in seen if isinstance(e, BlockRemoved) and e.medium == "SSD"
                for h in e.block_hashes]) == held
    again = await complete(eng, PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.timeout(30)
async def test_events_of_writes_landing_on_ssd_are_published_while_idle(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    eng = await make_engine(num_gpu_blocks=48,
                            tiers={"cpu_blocks": 0, "ssd_dir": str(tmp_path), "ssd_blocks": 256})
    published: list[AnyEvent] = []
    publish = eng.server.flush_events

    def spy() -> None:
        batch = eng.server.events.drain()
        if batch is not None:
            published.extend(batch.events)
            assert eng.server.publisher is not None
            eng.server.publisher.publish(batch)

    eng.server.flush_events = spy  # type: ignore[method-assign]
    await complete(eng, PROMPT)
    await push_out(eng)  # the last step returns before the writer thread has written the blocks

    def on_ssd() -> int:
        return sum(len(e.block_hashes) for e in published if isinstance(e, BlockStored) and e.medium == "SSD")

    assert await eventually(lambda: on_ssd() >= 20, "the SSD writes published with no request running",
                            timeout_s=10)
    # an event a tier thread adds while no request runs (as the writer does) goes out on its own
    late = stored([12345], None, list(range(16)), 16, "SSD")
    threading.Thread(target=eng.server.events, args=(late,)).start()
    assert await eventually(lambda: late in published,
                            "an event added by another thread published while idle", timeout_s=5)
    eng.server.flush_events = publish  # type: ignore[method-assign]
