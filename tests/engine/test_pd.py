"""Prefill/decode between engines over loopback: pool membership, the transfer engine, byte-checked KV.

Covers: a decode engine given ``x-prefiller-host-port`` naming a member of
``engine.prefill_peers`` has that engine prefill the prompt (a signed
``kv_transfer_params.do_remote_decode`` request), pulls every full block through
the agent's transfer engine, decodes the same text as a unified engine, reports
no mismatched block, and the prefill engine frees what it held; a DNS name in
``prefill_peers`` admits the addresses it resolves to (resolved once per TTL)
and a header naming it connects to a resolved address; a prefiller outside the
pool (or any prefiller with empty ``prefill_peers``) is refused with 403 and an
OpenAI-shaped error before any connection is made (a listening socket sees no
accept); without a transfer secret P/D is refused; hostile header values are a
400 with no connection; a block whose bytes were forged on the prefill engine is
dropped, counted, and recomputed, so the output and ``cached_tokens`` are those
of a local computation and the forged bytes never reach the decode engine's
cache; a busy member (503 at its hold cap) leaves the prompt to the decode
engine; an unreachable member is a clear 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from kvfleet.engine.pd import PREFILLER_HEADER, TransferKVPuller
from kvfleet.engine.peer import PrefillPeers
from kvfleet.engine.tiers import SlowBlock
from tests.engine.conftest import EngineFactory, RunningEngine, free_port

MODEL = "llama-3-8b"


class Listener:
    """A TCP listener that records every connection it accepts (and answers nothing)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        writer.close()

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    rec = Listener()
    rec.server = await asyncio.start_server(rec._on_conn, "127.0.0.1", 0)
    rec.port = rec.server.sockets[0].getsockname()[1]
    yield rec
    rec.server.close()
    await rec.server.wait_closed()


def body(prompt: Sequence[int], max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens}


async def post_headers(
    eng: RunningEngine, headers: CIMultiDict[str], prompt: Sequence[int]
) -> tuple[int, Any]:
    async with (aiohttp.ClientSession() as s,
                s.post(eng.url + "/v1/completions", json=body(prompt), headers=headers) as r):
        return r.status, await r.json(content_type=None)


def is_openai_error(out: Any, status: int) -> bool:
    return (isinstance(out, dict) and set(out) == {"error"}
            and set(out["error"]) == {"message", "type", "param", "code"} and out["error"]["code"] == status)


async def test_pd_with_a_member_equals_single_engine(make_engine: EngineFactory, pool_secret: bytes) -> None:
    single = await make_engine()
    prefill = await make_engine(role="prefill")
    decode = await make_engine(role="decode", prefill_peers=[prefill.host_port])
    prompt = list(range(7000, 7000 + 150))
    _, ref, _ = await single.post("/v1/completions", body(prompt, 12))
    st, out, hdrs = await decode.post("/v1/completions", body(prompt, 12),
                                      headers={PREFILLER_HEADER: prefill.host_port})
    assert st == 200, out
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert "kv_transfer_params" not in out
    assert hdrs["x-kvfleet-pod"] == decode.server.es.pod_name
    assert isinstance(decode.server.puller, TransferKVPuller)
    assert prefill.server.transfer_server is not None
    assert decode.server.kv.mismatched_blocks == 0
    assert decode.server.sched.stats.prefill_tokens == 150 - 9 * 16  # only the partial tail computed here
    assert prefill.server.sched.held == {} and prefill.server.holds == {}
    assert prefill.server.sched.stats.prompt_tokens == 150
    # A second P/D request (prefill now hits its own cache) gives the same text again.
    st, again, _ = await decode.post("/v1/completions", body(prompt, 12),
                                     headers={PREFILLER_HEADER: prefill.host_port})
    assert st == 200 and again["choices"][0]["text"] == ref["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 144


async def test_a_dns_name_admits_its_addresses(make_engine: EngineFactory, pool_secret: bytes) -> None:
    prefill = await make_engine(role="prefill")
    port = prefill.server.es.port
    name = f"prefill-pool.ns.svc:{port}"
    decode = await make_engine(role="decode", prefill_peers=[name])
    answers = ["127.0.0.1", "10.255.0.9"]
    lookups: list[str] = []

    async def resolver(host: str, p: int) -> list[str]:
        lookups.append(host)
        return list(answers)

    decode.server.prefill_peers = PrefillPeers([name], resolver=resolver)
    prompt = list(range(500, 580))
    for _ in range(2):  # one lookup serves both (cached for the TTL)
        st, out, _ = await decode.post("/v1/completions", body(prompt),
                                       headers={PREFILLER_HEADER: f"127.0.0.1:{port}"})
        assert st == 200, out
    assert lookups == ["prefill-pool.ns.svc"]
    # Another port on a resolved address is not a member; nor is a name that is not configured (never
    # resolved).
    for other in (f"127.0.0.1:{free_port()}", f"other.ns.svc:{port}", f"10.255.0.10:{port}"):
        st, out, _ = await decode.post("/v1/completions", body(prompt), headers={PREFILLER_HEADER: other})
        assert st == 403 and is_openai_error(out, 403), out
    assert lookups == ["prefill-pool.ns.svc"]
    # The configured name itself: the engine connects to an address the name resolves to.
    answers[:] = ["127.0.0.1"]
    decode.server.prefill_peers = PrefillPeers([name], resolver=resolver)
    st, out, _ = await decode.post("/v1/completions", body(prompt),
                                   headers={PREFILLER_HEADER: f"Prefill-Pool.ns.svc.:{port}"})
    assert st == 200, out
    assert decode.server.kv.mismatched_blocks == 0


@pytest.mark.parametrize("peers", [[], ["10.0.0.7:8000"]], ids=["no-peers", "not-a-member"])
async def test_a_non_member_prefiller_is_refused_without_a_connection(
    make_engine: EngineFactory, pool_secret: bytes, listener: Listener, peers: list[str]
) -> None:
    for role in ("decode", "both"):
        eng = await make_engine(role=role, prefill_peers=peers)
        st, out, _ = await eng.post("/v1/completions", body(range(64)),
                                    headers={PREFILLER_HEADER: listener.host_port})
        assert st == 403 and is_openai_error(out, 403), out
        assert out["error"]["type"] == "permission_error" and out["error"]["param"] == PREFILLER_HEADER
        assert "engine.prefill_peers" in out["error"]["message"]
        assert eng.server.sched.stats.prompt_tokens == 0
    # a time gap: a connection to the prefiller, had one been made, would have arrived
    await asyncio.sleep(0.2)
    assert listener.accepted == 0


async def test_without_a_transfer_secret_pd_is_refused(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, listener: Listener
) -> None:
    monkeypatch.delenv("KVFLEET_TRANSFER_SECRET", raising=False)
    decode = await make_engine(role="decode", prefill_peers=[listener.host_port])
    assert decode.server.puller is None
    st, out, _ = await decode.post("/v1/completions", body(range(64)),
                                   headers={PREFILLER_HEADER: listener.host_port})
    assert st == 403 and is_openai_error(out, 403), out
    assert ("transfer secret" in out["error"]["message"]
            and "KVFLEET_TRANSFER_SECRET" in out["error"]["message"])
    # a time gap: a connection to the prefiller, had one been made, would have arrived
    await asyncio.sleep(0.2)
    assert listener.accepted == 0


async def test_hostile_header_values_are_a_400(
    make_engine: EngineFactory, pool_secret: bytes, listener: Listener
) -> None:
    decode = await make_engine(role="decode", prefill_peers=[listener.host_port])
    member = listener.host_port
    cases: list[list[str]] = [
        [""],
        [member, member],
        [f"{member},{member}"],
        ["127.0.0.1:99999"],
        ["[::1]:x"],
        ["::1:8000"],
        ["127.0.0.1:0"],
        [f"user@{member}"],
        [f"{member}/path"],
        ["a" * 5_000 + ":1"],
        [f"127.0.0.1:{listener.port}" + "0" * 5_000],
    ]
    for values in cases:
        headers: CIMultiDict[str] = CIMultiDict((PREFILLER_HEADER, v) for v in values)
        st, out = await post_headers(decode, headers, range(64))
        assert st == 400 and is_openai_error(out, 400), (values[0][:40], st, out)
        assert out["error"]["param"] == PREFILLER_HEADER
    # 10 kB: over the HTTP server's header-line limit, refused (400) before the handler runs.
    async with aiohttp.ClientSession() as s, s.post(
        decode.url + "/v1/completions", json=body(range(64)), headers={PREFILLER_HEADER: "a" * 10_000 + ":1"}
    ) as r:
        assert r.status == 400
    assert decode.server.sched.stats.prompt_tokens == 0
    # a time gap: a connection to the prefiller, had one been made, would have arrived
    await asyncio.sleep(0.2)
    assert listener.accepted == 0


async def test_a_forged_block_is_dropped_and_recomputed(
    make_engine: EngineFactory, pool_secret: bytes
) -> None:
    """A member prefill engine serving forged bytes: the decode engine answers as if it computed the prompt
    itself."""
    single = await make_engine()
    prefill = await make_engine(role="prefill")
    decode = await make_engine(role="decode", prefill_peers=[prefill.host_port])
    prompt = list(range(3000, 3000 + 70))  # 4 full blocks + a 6-token tail
    _, ref, _ = await single.post("/v1/completions", body(prompt))
    # The prefill engine computes the prompt once, then its cached blocks are overwritten with forged bytes.
    st, _, _ = await prefill.post("/v1/completions", body(prompt, 1))
    assert st == 200
    forged = 0
    for h, blk in list(prefill.server.kv.gpu_data.items()):
        prefill.server.kv.gpu_data[h] = SlowBlock(blk.block_hash, blk.parent, blk.token_ids,
                                                  bytes(len(blk.data)))
        forged += 1
    assert forged == 4
    st, out, _ = await decode.post("/v1/completions", body(prompt),
                                   headers={PREFILLER_HEADER: prefill.host_port})
    assert st == 200, out
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing usable was cached anywhere
    assert decode.server.kv.mismatched_blocks == 4
    assert decode.server.sched.stats.prefill_tokens == 70  # the refused blocks were charged as prefill here
    assert all(b.data != bytes(len(b.data)) for b in decode.server.kv.gpu_data.values())
    assert prefill.server.sched.held == {}
    # The same prompt sent straight to the decode engine: its cache holds its own bytes, not the forged ones.
    st, again, _ = await decode.post("/v1/completions", body(prompt))
    assert st == 200
    assert again["choices"][0]["text"] == ref["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_a_busy_prefiller_leaves_the_prompt_to_the_decode_engine(
    make_engine: EngineFactory, pool_secret: bytes
) -> None:
    """A member at its hold cap answers 503; the decode engine then prefills the prompt itself."""
    single = await make_engine()
    prefill = await make_engine(role="prefill", num_gpu_blocks=64)  # cap: 32 blocks
    decode = await make_engine(role="decode", prefill_peers=[prefill.host_port])
    prompt = list(range(9000, 9000 + 600))  # 38 blocks: over the prefill engine's cap
    _, ref, _ = await single.post("/v1/completions", body(prompt))
    st, out, _ = await decode.post("/v1/completions", body(prompt),
                                   headers={PREFILLER_HEADER: prefill.host_port})
    assert st == 200, out
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert prefill.server.sched.stats.prompt_tokens == 0 and prefill.server.holds == {}
    assert decode.server.sched.stats.prefill_tokens == 600


async def test_unreachable_member_is_a_clear_503(make_engine: EngineFactory, pool_secret: bytes) -> None:
    gone = f"127.0.0.1:{free_port()}"
    decode = await make_engine(role="decode", prefill_peers=[gone])
    st, out, _ = await decode.post("/v1/completions", body(range(40), 2), headers={PREFILLER_HEADER: gone})
    assert st == 503 and is_openai_error(out, 503), out
    assert "prefill engine" in out["error"]["message"]
