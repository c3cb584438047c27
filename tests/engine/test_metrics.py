"""``/metrics`` exposes vLLM's metric names with live values (the EPP scrapes these as from a vLLM pod)."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

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
