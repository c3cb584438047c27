"""Per-pool cache settings: each pool's block size, hash and routing weights come from the pool, not one
global.

Covers: the static pods file's and the operator's annotation (``kvfleet.io/routing``) forms, validation
with the entry named; the router keys a prompt with its pool's block size (a pool of 64-token engines
behind a picker whose own default is 16: full hits predicted and routed, as the engine reports them);
routing weights scale the profile's prefix and load scorers and ``hotspotDecay`` is the pool's β; a pool
whose engines hash differently from what it declares is detected from predicted vs reported cached
tokens through a real Envoy (gauge ``kvfleet_epp_pool_key_mismatch``), and a matching pool is not.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kvfleet.config import load
from kvfleet.demo.envoy import EnvoyProcess
from kvfleet.epp.app import Epp
from kvfleet.epp.datastore import PoolCache, StaticDatastore, pools_from_dict
from kvfleet.epp.errors import DatastoreError
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.keycheck import KeyCheck
from kvfleet.epp.kube import routing_cache
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.tokenize import load_tokenizer
from tests.conftest import wait_for
from tests.epp.pods import PodFleet, post

PROMPT = "Per-pool block sizes and hashes decide what the index can match. " * 12
EnvoyF = Callable[..., EnvoyProcess]


def _pool(**extra: Any) -> dict[str, Any]:
    return {"pools": [{"name": "p", "models": ["m"],
                       "pods": [{"name": "a", "address": "10.0.0.1", "port": 1},
                                {"name": "b", "address": "10.0.0.2", "port": 1}], **extra}]}


def test_pool_cache_from_the_file_and_the_annotation() -> None:
    """Both spellings give the same PoolCache; bad values name the pool entry."""
    (pool,) = pools_from_dict(_pool(block_size=64, hash_algo="sha256_cbor", tokenizer="hf:Qwen/Qwen2.5-7B",
                                    chat_dialect="sglang",
                                    weights={"prefix": 2, "load": 0.5, "hotspotDecay": 0.3}))
    want = PoolCache(block_size=64, hash_algo="sha256_cbor", prefix_weight=2.0, load_weight=0.5,
                     hotspot_decay=0.3, tokenizer="hf:Qwen/Qwen2.5-7B", chat_dialect="sglang")
    assert pool.cache == want
    ann = json.dumps({"blockSize": 64, "hashAlgo": "sha256_cbor", "prefix_weight": 2, "load_weight": 0.5,
                      "hotspot_decay": 0.3, "failure_mode": "FailOpen", "shards": 2, "disaggregated": False,
                      "tokenizer": "hf:Qwen/Qwen2.5-7B", "chatDialect": "sglang"})
    assert routing_cache("p", ann) == want
    assert routing_cache("p", "{not json") == PoolCache() and routing_cache("p", None) == PoolCache()
    assert routing_cache("p", json.dumps({"blockSize": -1})) == PoolCache()
    for bad in ({"block_size": 0}, {"hash_algo": "md5"}, {"weights": {"prefix": -1}}, {"chat_dialect": "tgi"},
                {"tokenizer": " "},
                {"weights": {"nope": 1}}, {"colour": 1}):
        with pytest.raises(DatastoreError, match="pools\\[0\\]"):
            pools_from_dict(_pool(**bad))


def _router(data: dict[str, Any], **over: Any) -> Router:
    s = load(overrides={"epp": over})
    return Router(s.epp, s.cache, StaticDatastore(data=data), BlockIndex(), MetricsStore(),
                  load_tokenizer("bytes"))


def test_router_keys_with_the_pools_block_size() -> None:
    """A pool declaring 64-token blocks: its engines' keys (64) match the prompt, every full block
    predicted."""
    r = _router(_pool(block_size=64))
    (pool,) = r.datastore.pools()
    hasher = r.hasher_for(pool)
    assert hasher.block_size == 64 and r.hasher.block_size == 16
    tokens = r.tokenizer.encode(PROMPT)
    r.index.add("b", r.keys_of(tokens, None, pool))
    d = r.route(InferenceRequest(model="m", prompt=PROMPT))
    assert d.pod == "b" and d.block_size == 64 and d.predicted_hit_tokens == len(tokens) // 64 * 64


def test_routing_weights_scale_the_profile() -> None:
    """``prefix: 0`` makes a pool route by load alone: the holder of the prefix is no longer preferred."""
    plugins = [{"type": "prefix-cache-scorer"}, {"type": "queue-scorer"}, {"type": "max-score-picker"}]
    for weights, holder_wins in (({}, True), ({"prefix": 0.0}, False)):
        r = _router(_pool(weights=weights), plugins=plugins)
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        r.index.add("b", keys)
        r.tracker.open(("b",), 0, 500.0)  # b is busier
        assert (r.route(InferenceRequest(model="m", prompt=PROMPT)).pod == "b") is holder_wins
    r = _router(_pool(weights={"hotspotDecay": 0.7}))
    (pool,) = r.datastore.pools()
    assert r.profile_for(pool.cache) is r.profile  # weights 1/1: the configured profile itself
    default_prefix = r.profile.scorers[0][0]
    assert r.profile_for(PoolCache(prefix_weight=2.0)).scorers[0][0] == 2.0 * default_prefix


def test_keycheck_flags_and_clears() -> None:
    """Under-predicted hits in most of the window flag the pool; agreeing ones clear it; misses are
    ignored."""
    changes: list[tuple[str, bool]] = []
    kc = KeyCheck(window=20, min_hits=10, on_change=lambda p, bad: changes.append((p, bad)))
    for _ in range(50):
        kc.observe("p", 0, 16, 16)  # below two blocks: not evidence
    assert kc.flagged() == set()
    for _ in range(10):
        kc.observe("p", 0, 320, 16)
    assert kc.flagged() == {"p"} and changes == [("p", True)]
    for _ in range(15):
        kc.observe("p", 320, 320, 16)
    assert kc.flagged() == set() and changes == [("p", True), ("p", False)]


def _mismatch(epp: Epp) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=2) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('kvfleet_epp_pool_key_mismatch{pool="pool-a"}'):
                return float(line.split()[-1])
    return None


@pytest.mark.e2e
@pytest.mark.parametrize("declared", [16, 64])
def test_engines_hashing_otherwise_are_detected(envoy_factory: EnvoyF, declared: int) -> None:
    """Engines with 64-token blocks: a pool declaring 16 is flagged after repeated prompts whose hits the
    index never predicted; a pool declaring 64 predicts them (routes to the holder) and is not flagged.

    The pool declaring 16 has one pod, so that every repeat lands where its prompt ran: with two, nothing
    the picker knows ties a repeat to that pod (its keys match no event), the pods' recent load decides, and
    on a fast host half the repeats went to the other pod, leaving fewer hits than the check needs; and a
    repeat waits out the 1 ms speculative entry of its prompt's pick, which a fast client beat."""
    fleet = PodFleet(1 if declared == 16 else 2, block_size=64).start()
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0, "speculative_ttl_s": 0.001}})
    data = fleet.pools_config()
    data["pools"][0]["block_size"] = declared
    epp = Epp(settings, datastore=StaticDatastore(data=data)).start()
    epp.servicer.keycheck.min_hits = 8
    try:
        env = envoy_factory(epp_port=epp.grpc_port)
        url = f"http://127.0.0.1:{env.listen_port}/v1/completions"
        def indexed() -> int:
            return sum(epp.index.num_pod_keys(p.name) for p in fleet.pods)

        for i in range(10):
            prompt = f"{i:03d} " + PROMPT
            before = indexed()
            assert post(url, {"model": "m", "prompt": prompt})[0] == 200
            # the index can hold these keys: wait for the events (else nothing matches anyway)
            if declared == 64:
                wait_for(lambda before=before: indexed() > before, what="events indexed")  # type: ignore[misc]
            else:  # the pick's own speculative entry (1 ms after its first token) must not predict the repeat
                time.sleep(0.02)
            status, _, body = post(url, {"model": "m", "prompt": prompt + " again"})
            assert status == 200
            cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
            if declared == 64:
                assert cached >= len(prompt.encode()) // 64 * 64 - 64, (i, cached)
        if declared == 16:
            wait_for(lambda: _mismatch(epp) == 1.0, what="the pool flagged")
        else:
            assert _mismatch(epp) in (None, 0.0)
    finally:
        epp.stop()
        fleet.stop()
