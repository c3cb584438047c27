"""``cache_salt`` keys line up across vLLM, the engine simulator and the EPP.

Covers: for a salted request, the block hashes the engine publishes in its KV
events, the keys the EPP's router computes for the same request, and vLLM's own
``sha256_cbor`` vector (``cache_salt_first_block``: extra keys ``[("my-salt",), None]``)
are the same three lists; the unsalted keys differ from them in every block.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvfleet.cache import kvwire
from kvfleet.cache.events import BlockStored, decode_batch
from kvfleet.cache.hashing import to_int64
from kvfleet.cache.tokens import salt_extra_keys
from kvfleet.config import load
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.tokenize import load_tokenizer
from tests.engine.conftest import EngineFactory

VECTORS = Path(__file__).parents[1] / "cache" / "data" / "vllm_sha256_cbor_vectors.json"
CACHE = {"hash_algo": "sha256_cbor", "hash_seed": "vllm-none-hash", "block_size": 16}


def _vector() -> dict[str, Any]:
    cases = json.loads(VECTORS.read_text())["cases"]
    case: dict[str, Any] = next(c for c in cases if c["name"] == "cache_salt_first_block")
    return case


def _epp_router() -> Router:
    s = load(overrides={"cache": CACHE})
    pools = {"pools": [{"name": "a", "models": ["m"],
                        "pods": [{"name": "p", "address": "127.0.0.1", "port": 1}]}]}
    return Router(s.epp, s.cache, StaticDatastore(data=pools), BlockIndex(), MetricsStore(),
                  load_tokenizer("bytes"))


async def _published_hashes(replay_port: int) -> list[int]:
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    out: list[int] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            seq, payload = kvwire.parse_replay_answer(await asyncio.wait_for(dealer.recv_multipart(), 5))
            if seq == kvwire.END:
                return out
            for ev in decode_batch(payload).events:
                if isinstance(ev, BlockStored):
                    out.extend(to_int64(h) for h in ev.block_hashes)
    finally:
        dealer.close(0)


def test_salt_extra_keys_is_vllms_rule() -> None:
    """The one-element tuple on block 0 only; an empty or missing salt adds nothing (vLLM skips a falsy
    salt)."""
    assert salt_extra_keys("my-salt") == [("my-salt",)]
    assert salt_extra_keys("") is None and salt_extra_keys(None) is None


async def test_epp_keys_equal_engine_events_and_vllm_vector(make_engine: EngineFactory) -> None:
    case = _vector()
    assert case["extra_keys"][0] == ["my-salt"] and case["block_size"] == 16
    tokens: list[int] = case["token_ids"]
    vllm = [to_int64(bytes.fromhex(h)) for h in case["block_hashes"]]

    router = _epp_router()
    epp_salted = router.keys_of(router.tokens_of(InferenceRequest(model="m", prompt_token_ids=tuple(tokens))),
                                "my-salt")
    assert epp_salted == vllm

    eng = await make_engine(cache=CACHE)
    es = eng.server.es
    st, body, _ = await eng.post("/v1/completions", {"model": es.model, "prompt": tokens, "max_tokens": 1,
                                                     "cache_salt": "my-salt"})
    assert st == 200, body
    assert await _published_hashes(es.kv_events_replay_port) == vllm

    unsalted = router.keys_of(router.tokens_of(InferenceRequest(model="m", prompt_token_ids=tuple(tokens))),
                              None)
    assert all(a != b for a, b in zip(unsalted, vllm, strict=True))
