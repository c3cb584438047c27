"""The OpenAI-compatible API over real HTTP: completions, chat, SSE streaming, models, health, errors.

Covers: responses carry ``usage.prompt_tokens_details.cached_tokens`` (0 on a cold
prompt, the shared full blocks on a repeat), token-id prompts and text prompts
(byte-level tokenizer, so text of N bytes is N tokens), deterministic output,
SSE framing (role on the first chat delta, finish chunk, usage chunk, ``[DONE]``),
and OpenAI-style error JSON with the right status for bad input.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.engine.conftest import EngineFactory

MODEL = "llama-3-8b"


async def test_completion_reports_cached_prefix_on_repeat(make_engine: EngineFactory) -> None:
    eng = await make_engine()
    prompt = list(range(1000, 1100))  # 100 tokens = 6 full blocks + 4
    st, first, hdrs = await eng.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert st == 200
    assert first["usage"]["prompt_tokens"] == 100
    assert first["usage"]["completion_tokens"] == 4
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hdrs["x-kvfleet-pod"] == "sim-0"
    st, again, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # A prompt that shares only the first 40 tokens hits two full blocks.
    st, other, _ = await eng.post("/v1/completions",
                                  {"model": MODEL, "prompt": prompt[:40] + [7] * 30, "max_tokens": 4})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_text_prompt_is_byte_tokenized_and_salt_separates_caches(make_engine: EngineFactory) -> None:
    eng = await make_engine(tokenizer="bytes")
    text = "x" * 40
    _, a, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert a["usage"]["prompt_tokens"] == 40
    _, b, _ = await eng.post("/v1/completions",
                             {"model": MODEL, "prompt": text, "max_tokens": 1, "cache_salt": "tenant-a"})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, c, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_default_tokenizer_is_the_models_as_vllm_applies_it(make_engine: EngineFactory) -> None:
    """The simulator's default is a real model's files (Qwen2.5): its token counts are the model's, chat
    prompts go through its chat template, and a conversation the template rejects is a 400 as in vLLM."""
    from kvfleet.cache.modeltok import ChatRequest, load_model_tokenizer

    tok = load_model_tokenizer("builtin:qwen2.5")
    eng = await make_engine()
    text = "The quick brown fox jumps over the lazy dog. " * 8
    _, a, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert a["usage"]["prompt_tokens"] == len(tok.encode_prompt(text)) < len(text) // 2
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    _, b, _ = await eng.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
    assert b["usage"]["prompt_tokens"] == len(tok.encode_chat(ChatRequest(msgs)))
    nemo = await make_engine(tokenizer="builtin:mistral-nemo")
    st, c, _ = await nemo.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    assert st == 400 and "alternate" in c["error"]["message"]


@pytest.mark.parametrize("tokenizer", ["builtin:qwen2.5", "builtin:mistral-nemo", "bytes"])
async def test_the_model_writes_letters_and_spaces_in_its_tokenizer(make_engine: EngineFactory,
                                                                   tokenizer: str) -> None:
    """The simulated model's output tokens are the tokenizer's ids of letters and spaces, so the text a
    client reads is plain (not stray byte tokens that decode to U+FFFD)."""
    eng = await make_engine(tokenizer=tokenizer)
    _, r, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 24})
    text = r["choices"][0]["text"]
    assert len(text) == 24 and set(text) <= set("abcdefghijklmnopqrstuvwxyz "), text


async def test_chat_stream_sse_framing(make_engine: EngineFactory) -> None:
    eng = await make_engine()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "max_tokens": 3}
    async with aiohttp.ClientSession() as s, s.post(eng.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [ln[6:] for ln in raw.split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text) == 3
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # The same request without streaming gives the same text.
    _, whole, _ = await eng.post("/v1/chat/completions", {**body, "stream": False})
    assert whole["choices"][0]["message"]["content"] == text


async def test_models_and_health(make_engine: EngineFactory) -> None:
    eng = await make_engine(model="m-test")
    async with aiohttp.ClientSession() as s:
        async with s.get(eng.url + "/v1/models") as r:
            models = await r.json()
        async with s.get(eng.url + "/health") as r:
            assert r.status == 200
    assert [m["id"] for m in models["data"]] == ["m-test"]


async def test_errors_are_openai_shaped(make_engine: EngineFactory) -> None:
    eng = await make_engine()
    async with aiohttp.ClientSession() as s, s.post(eng.url + "/v1/completions", data=b"{not json") as r:
        assert r.status == 400
        err = await r.json()
    assert err["error"]["type"] == "invalid_request_error"
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"model": "nope", "prompt": "a"}, 404, "model"),
        ({"model": MODEL, "prompt": list(range(131072))}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "a", "temperature": 2.5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "a", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "a", "top_p": 2}, 400, "top_p"),
        ({"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "a", "top_k": -5}, 400, "top_k"),
        ({"model": MODEL, "prompt": "a", "min_p": 1.5}, 400, "min_p"),
        ({"model": MODEL, "prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "frequency_penalty": -9}, 400,
         "frequency_penalty"),
        # the fields vLLM's request models check (tests/interop/test_vllm_requests.py: same answers)
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": 5}, 400, "logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, 400,
         "top_logprobs"),
        ({"model": MODEL, "prompt": "a", "logprobs": -3}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "a", "cache_salt": ""}, 400, "cache_salt"),
        ({"model": MODEL, "prompt": "a", "logit_bias": [1]}, 400, "logit_bias"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "tools": ["f"]}, 400, "tools"),
    ]
    for body, status, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        st, data, _ = await eng.post(path, body)
        assert st == status, body
        assert data["error"]["code"] == status and data["error"]["param"] == param
    st, data, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": -1})
    assert data["error"]["message"] == "temperature must be non-negative, got -1."  # vLLM's words
    # The engine keeps serving after bad input; valid sampling values (and nulls) are accepted.
    st, _, _ = await eng.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1,
                                                  "temperature": 0, "top_p": 1, "top_k": -1, "n": 1,
                                                  "min_p": None})
    assert st == 200


async def test_prompt_larger_than_the_kv_pool_is_rejected(make_engine: EngineFactory) -> None:
    eng = await make_engine(num_gpu_blocks=4)
    st, data, _ = await eng.post("/v1/completions",
                                 {"model": MODEL, "prompt": list(range(100)), "max_tokens": 1})
    assert st == 400 and "KV blocks" in data["error"]["message"]
