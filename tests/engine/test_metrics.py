"""``/metrics`` exposes vLLM's metric names with live values (the EPP scrapes these as from a vLLM pod)."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import eventually
from tests.engine.conftest import EngineFactory

VLLM_NAMES = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds",
}


async def test_vllm_metric_names_and_prefix_counters(make_engine: EngineFactory) -> None:
    eng = await make_engine(num_gpu_blocks=128)
    prompt = list(range(64))
    for _ in range(2):
        await eng.post("/v1/completions", {"model": "llama-3-8b", "prompt": prompt, "max_tokens": 2})
    async with aiohttp.ClientSession() as s, s.get(eng.url + "/metrics") as r:
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert VLLM_NAMES <= set(fams)
    sample = {s.name: s for f in fams.values() for s in f.samples}
    assert sample["vllm:prefix_cache_queries_total"].value == 128
    assert sample["vllm:prefix_cache_hits_total"].value == 64
    assert sample["vllm:cache_config_info"].labels["num_gpu_blocks"] == "128"
    assert sample["vllm:num_requests_running"].labels == {"model_name": "llama-3-8b"}


async def test_replay_buffer_bytes_and_bound(make_engine: EngineFactory) -> None:
    """The replay buffer's gauges are the publisher's own figures: held bytes grow with the batches
    published and stay within the configured bound (the oldest batches dropped above it)."""
    eng = await make_engine(num_gpu_blocks=256, replay_buffer_bytes=4096)

    async def gauges() -> dict[str, float]:
        async with aiohttp.ClientSession() as s, s.get(eng.url + "/metrics") as r:
            text = await r.text()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("kvfleet_engine_kv_event_replay")}

    assert await gauges() == {"kvfleet_engine_kv_event_replay_bytes": 0.0,
                              "kvfleet_engine_kv_event_replay_cap_bytes": 4096.0}
    for k in range(40):  # distinct prompts: every one publishes a batch of BlockStored events
        prompt = list(range(1000 * k, 1000 * k + 64))
        await eng.post("/v1/completions", {"model": "llama-3-8b", "prompt": prompt, "max_tokens": 1})
    pub = eng.server.publisher
    assert pub is not None
    await eventually(lambda: pub.buffer_bytes > 2048, "the replay buffer filled")
    held = (await gauges())["kvfleet_engine_kv_event_replay_bytes"]
    assert 2048 < held <= 4096
    assert held == pub.buffer_bytes
