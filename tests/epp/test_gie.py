"""GIE's default EPP as kvfleet plugins (``kvfleet.epp.scheduling.gie``), pinned against GIE v1.5.0's
algorithm.

Covers: prompt hashing (a seed of model + cache salt, chained xxh64 over blocks of block_size × 4 bytes,
shorter-than-a-block prompts and the max-blocks cut, token-id prompts as 4-byte ids) against a reference
written here from GIE's ``hashing.go``; the per-pod LRU index (eviction in add order, touch on re-add,
holders dropped on eviction, the longest-prefix walk stopping at the first unheld block); the prefix score
as matched ÷ prompt blocks; the index filled only by the profile's own picks (both picks of a P/D request),
sized by the pod's scraped GPU blocks; its predicted cached tokens; the queue and KV-utilisation scorers and
the default weights 3/2/2; the max-score picker; the server's decision log carrying the request id and the
plugin's prediction through a real Envoy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import xxhash

from kvfleet.config import load
from kvfleet.config.epp import PluginSpec
from kvfleet.demo.envoy import EnvoyProcess
from kvfleet.epp.app import Epp
from kvfleet.epp.datastore import Pod, StaticDatastore
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.podmetrics import MetricsStore, PodMetrics
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.scheduling import Candidate, Profile, RequestContext, SchedulingRequest, routing_request
from kvfleet.epp.scheduling.gie import (
    GiePrefixCacheScorer,
    LRUIndexer,
    default_profile,
    hash_prompt,
    prompt_bytes,
)
from kvfleet.epp.tokenize import load_tokenizer
from tests.conftest import wait_for
from tests.epp.pods import PodFleet, post

BLOCK = 16 * 4  # GIE's default block: 16 tokens × 4 characters


def reference_hashes(data: bytes, model: str, salt: str, block: int, max_blocks: int) -> list[int]:
    """GIE's hashPrompt, transcribed: streaming xxh64 writes as Go's ``h.Write`` calls."""
    if len(data) < block:
        return []
    data = data[: max_blocks * block]
    h = xxhash.xxh64()
    h.update(model.encode())
    if salt:
        h.update(salt.encode())
    prev = h.intdigest()
    out = []
    for i in range(0, len(data) - block + 1, block):
        h.reset()
        h.update(data[i : i + block])
        h.update(struct.pack("<Q", prev))
        prev = h.intdigest()
        out.append(prev)
    return out


def cand(name: str, **kw: Any) -> Candidate:
    return Candidate(pod=Pod(name=name, address="10.0.0.1", port=8000), **kw)


def gie_profile(**prefix_params: float) -> Profile:
    specs = [PluginSpec(type=p["type"], weight=float(p.get("weight", 1.0)),  # type: ignore[arg-type]
                        params=dict(prefix_params) if p["type"] == "gie-prefix-cache-scorer" else {})
             for p in default_profile()]
    return Profile(specs)


def prefix_scorer(prof: Profile) -> GiePrefixCacheScorer:
    return next(s for _, s in prof.scorers if isinstance(s, GiePrefixCacheScorer))


def run(
    prof: Profile, prompt: str, cands: Sequence[Candidate], model: str = "m"
) -> tuple[str, dict[str, float], RequestContext]:
    """One scheduling cycle for ``prompt`` inside a routing context; (pick, prefix score per pod, context)."""
    ctx = RequestContext(model=model, prompt=prompt)
    req = SchedulingRequest(num_tokens=len(prompt) // 4, block_size=16)
    with routing_request(ctx):
        scores = dict(zip([c.name for c in cands], prefix_scorer(prof).score(req, cands), strict=True))
        ranked = prof.run(req, cands)
    return ranked.pods[0].name, scores, ctx


class TestHashing:
    def test_xxh64_is_the_standard_one(self) -> None:
        # XXH64 of "" (seed 0), as cespare/xxhash's Sum64
        assert xxhash.xxh64_intdigest(b"") == 0xEF46DB3751D8E999

    def test_chained_blocks_match_the_reference(self) -> None:
        text = "".join(chr(ord("a") + i % 26) for i in range(3 * BLOCK + 10))
        got = hash_prompt(text.encode(), "llama", "salty", 16, 256)
        # partial block: no hash
        assert got == reference_hashes(text.encode(), "llama", "salty", BLOCK, 256) and len(got) == 3
        assert (hash_prompt(text.encode(), "llama", None, 16, 256)
                == reference_hashes(text.encode(), "llama", "", BLOCK, 256))

    def test_chain_model_salt_and_limits(self) -> None:
        a = ("x" * BLOCK + "y" * BLOCK + "z" * BLOCK).encode()
        b = ("x" * BLOCK + "y" * BLOCK + "w" * BLOCK).encode()
        c = ("v" * BLOCK + "y" * BLOCK + "z" * BLOCK).encode()
        ha, hb, hc = (hash_prompt(d, "m", None, 16, 256) for d in (a, b, c))
        assert ha[:2] == hb[:2] and ha[2] != hb[2]  # a shared prefix shares its hashes
        assert all(x != y for x, y in zip(ha, hc, strict=True))  # a hash stands for its whole prefix
        assert hash_prompt(a, "other", None, 16, 256)[0] != ha[0]
        assert hash_prompt(a, "m", "tenant", 16, 256)[0] != ha[0]
        assert hash_prompt(a[: BLOCK - 1], "m", None, 16, 256) == []
        assert hash_prompt(a, "m", None, 16, 2) == ha[:2]
        assert len(hash_prompt(a, "m", None, 8, 256)) == 6  # 32-byte blocks

    def test_token_ids_are_four_byte_blocks(self) -> None:
        ids = list(range(1000, 1040))
        data = prompt_bytes(None, ids)
        assert data == struct.pack("<40I", *ids)
        assert hash_prompt(data, "m", None, 16, 256) == reference_hashes(data, "m", "", BLOCK, 256)
        assert len(hash_prompt(data, "m", None, 16, 256)) == 2  # 16 tokens per block
        assert prompt_bytes("héllo", None) == "héllo".encode()


class TestIndexer:
    def test_lru_eviction_touch_and_holders(self) -> None:
        idx = LRUIndexer(default_capacity=3)
        idx.add([1, 2, 3], "a")
        idx.add([4], "a")  # over capacity: the least recently added (1) goes
        assert idx.get(1) == set() and idx.get(4) == {"a"}
        idx.add([2], "a")  # touched: now 3 is the oldest
        idx.add([5], "a")
        assert idx.get(3) == set() and idx.get(2) == {"a"}
        idx.add([2], "b")
        idx.add([6, 7, 8], "a")  # a evicts 2 (and 4, 5); b still holds it
        assert idx.get(2) == {"b"} and idx.get(4) == set()

    def test_capacity_fixed_at_first_add(self) -> None:
        idx = LRUIndexer(default_capacity=100)
        idx.add([1, 2], "a", capacity=2)
        idx.add([3], "a", capacity=50)  # GIE sizes a pod's LRU once
        assert idx.capacity["a"] == 2 and idx.get(1) == set()
        idx.add([9], "b")
        assert idx.capacity["b"] == 100

    def test_an_add_longer_than_the_lru_lists_every_hash(self) -> None:
        """As GIE's indexer: the hash → pods map is written after the LRU, so hashes this add evicted stay
        listed."""
        idx = LRUIndexer(default_capacity=2)
        idx.add([1, 2, 3], "a")
        assert list(idx.pod_lru["a"]) == [2, 3] and idx.get(1) == {"a"}

    def test_longest_prefix_walk(self) -> None:
        idx = LRUIndexer()
        idx.add([1, 2, 4], "a")
        idx.add([1], "b")
        assert idx.match_longest_prefix([1, 2, 3, 4]) == {"a": 2, "b": 1}  # stops at 3: nobody holds it
        assert idx.match_longest_prefix([9, 1]) == {}
        idx.remove_pod("a")
        assert idx.match_longest_prefix([1, 2]) == {"b": 1}


class TestPrefixScorer:
    PODS = ("p0", "p1", "p2")

    def cands(self, **metrics: PodMetrics) -> list[Candidate]:
        return [cand(n, metrics=metrics.get(n)) for n in self.PODS]

    def test_index_filled_by_its_own_picks(self) -> None:
        prof = gie_profile()
        prompt = "s" * (4 * BLOCK)
        first, scores, ctx = run(prof, prompt, self.cands())
        assert set(scores.values()) == {0.0} and ctx.predicted_hit_tokens == 0
        again, scores, ctx = run(prof, prompt, self.cands())
        assert again == first and scores[first] == 1.0 and sum(scores.values()) == 1.0
        assert ctx.predicted_hit_tokens == 4 * 16

    def test_score_is_the_matched_fraction(self) -> None:
        prof = gie_profile()
        first, _, _ = run(prof, "a" * (2 * BLOCK) + "b" * (2 * BLOCK), self.cands())
        pick, scores, ctx = run(prof, "a" * (2 * BLOCK) + "c" * (6 * BLOCK) + "tail", self.cands())
        assert scores[first] == pytest.approx(2 / 8)
        assert pick == first and ctx.predicted_hit_tokens == 2 * 16  # its matched blocks' tokens
        _, scores, _ = run(prof, "a" * (2 * BLOCK) + "b" * BLOCK + "c" * BLOCK, self.cands())
        assert scores[first] == pytest.approx(3 / 4)
        _, scores, _ = run(prof, "short", self.cands())
        assert set(scores.values()) == {0.0}

    def test_no_routing_context_scores_zero_and_records_nothing(self) -> None:
        prof = gie_profile()
        req = SchedulingRequest(num_tokens=100)
        prof.run(req, self.cands())
        assert prefix_scorer(prof).score(req, self.cands()) == [0.0] * 3
        assert prefix_scorer(prof).indexer.pod_lru == {}

    def test_lru_sized_by_the_pods_gpu_blocks(self) -> None:
        """autoTune: a pod's LRU holds its scraped num_gpu_blocks hashes, so older prefixes fall out."""
        prof = gie_profile()
        small = {n: PodMetrics(num_gpu_blocks=4, block_size=16) for n in self.PODS}
        first, _, _ = run(prof, "a" * (4 * BLOCK), self.cands(**small))
        assert prefix_scorer(prof).indexer.capacity[first] == 4
        # the same pod wins the next prompt only if it is the tie-break's pick; force it: only it is a
        # candidate
        run(prof, "b" * (4 * BLOCK), [cand(first, metrics=small[first])])
        _, scores, _ = run(prof, "a" * (4 * BLOCK), self.cands(**small))
        assert scores[first] == 0.0  # evicted by the second prompt's four blocks

    def test_block_size_from_the_pods_metrics(self) -> None:
        prof = gie_profile()
        m = PodMetrics(block_size=8)
        first, _, _ = run(prof, "q" * (2 * BLOCK), [cand("p0", metrics=m)])
        assert len(prefix_scorer(prof).indexer.pod_lru[first]) == 4  # 32-byte blocks
        off = gie_profile(auto_tune=0.0)
        run(off, "q" * (2 * BLOCK), [cand("p0", metrics=m)])
        assert len(prefix_scorer(off).indexer.pod_lru["p0"]) == 2


class TestLoadScorersAndWeights:
    def test_queue_and_kv_scores(self) -> None:
        prof = Profile([PluginSpec(type="gie-queue-scorer"),
                        PluginSpec(type="gie-max-score-picker", params={"max_num_of_endpoints": 3})])
        cs = [cand(f"p{i}", metrics=PodMetrics(waiting=w)) for i, w in enumerate((0, 5, 10))]
        ranked = prof.run(SchedulingRequest(), cs)
        assert [c.name for c in ranked.pods] == ["p0", "p1", "p2"] and ranked.scores == (1.0, 0.5, 0.0)
        stale = prof.run(SchedulingRequest(), [cand("a", metrics=PodMetrics(waiting=3)), cand("b")])
        assert [c.name for c in stale.pods] == ["b", "a"] and stale.scores == (1.0, 0.0)  # stale: 0 waiting
        same = prof.run(SchedulingRequest(),
                        [cand("a", metrics=PodMetrics(waiting=3)), cand("b", metrics=PodMetrics(waiting=3))])
        assert same.scores == (1.0, 1.0)
        kv = Profile([PluginSpec(type="gie-kv-cache-utilization-scorer")])
        r = kv.run(SchedulingRequest(), [cand("a", metrics=PodMetrics(kv_usage=0.25))])
        assert r.scores == (0.75,)

    @pytest.mark.parametrize(("kv_usage", "winner"), [(0.2, "holder"), (0.6, "idle")])
    def test_default_weights_three_two_two(self, kv_usage: float, winner: str) -> None:
        """The holder of the whole prompt (prefix 1) with the longest queue (queue 0) scores 3 + 2·(1 − kv)
        against an idle empty pod's 2 + 2: it wins below kv 0.5 and loses above."""
        prof = gie_profile()
        prompt = "h" * (4 * BLOCK)
        run(prof, prompt, [cand("holder")])
        holder = cand("holder", metrics=PodMetrics(waiting=6, kv_usage=kv_usage))
        idle = cand("idle", metrics=PodMetrics(waiting=0, kv_usage=0.0))
        pick, _, _ = run(prof, prompt, [holder, idle])
        assert pick == winner

    def test_picker_breaks_ties_at_random_and_returns_one(self) -> None:
        prof = Profile([PluginSpec(type="gie-max-score-picker")])
        picks = {prof.run(SchedulingRequest(), [cand("a"), cand("b"), cand("c")]).pods[0].name
                 for _ in range(60)}
        assert picks == {"a", "b", "c"}
        assert len(prof.run(SchedulingRequest(), [cand("a"), cand("b")]).pods) == 1


def gie_router(roles: list[str]) -> Router:
    data = {"pools": [{"name": "pool", "models": ["m"], "pods": [
        {"name": f"p{i}", "address": "10.0.0.1", "port": 8000 + i, "role": r} for i, r in enumerate(roles)]}]}
    s = load(overrides={"epp": {"prefix_shard_pools": False, "events_enabled": False,
                                "plugins": default_profile(), "pd_min_uncached_tokens": 1}})
    return Router(s.epp, s.cache, StaticDatastore(data=data), BlockIndex(), MetricsStore(),
                  load_tokenizer("bytes"))


class TestThroughTheRouter:
    def test_same_prompt_same_pod_and_pd_records_both_picks(self) -> None:
        r = gie_router(["prefill", "decode"])
        prompt = "A system prompt shared by every turn. " * 20
        ctx = RequestContext(model="m", prompt=prompt)
        with routing_request(ctx):
            d = r.route(InferenceRequest(model="m", prompt=prompt))
        assert d.pod == "p1" and d.prefiller == "10.0.0.1:8000"
        idx = prefix_scorer(r.profile).indexer
        assert set(idx.pod_lru) == {"p0", "p1"}  # GIE records the primary and the prefill profile's targets
        ctx2 = RequestContext(model="m", prompt=prompt + "next turn")
        with routing_request(ctx2):
            r.route(InferenceRequest(model="m", prompt=prompt + "next turn"))
        assert ctx2.predicted_hit_tokens == len(prompt.encode()) // BLOCK * 16

    def test_unified_pool_keeps_a_prompt_on_its_pod(self) -> None:
        r = gie_router(["both"] * 4)
        pods = set()
        for turn in range(5):
            prompt = "conversation seven " * 30 + "turn " * turn
            with routing_request(RequestContext(model="m", prompt=prompt)):
                pods.add(r.route(InferenceRequest(model="m", prompt=prompt)).pod)
        assert len(pods) == 1


@pytest.mark.e2e
def test_decision_log_has_the_request_id_and_the_plugins_prediction(
    fleet: PodFleet, epp_factory: Callable[..., Epp], envoy_factory: Callable[..., EnvoyProcess],
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through Envoy: the client's x-request-id reaches the EPP's decision log, whose ``predicted`` is the
    GIE scorer's (all full 64-byte blocks of the repeated prompt × 16 tokens), not the block index's."""
    log = tmp_path / "decisions.jsonl"
    monkeypatch.setenv("KVFLEET_EPP_DECISION_LOG", str(log))
    epp = epp_factory(events_enabled=False, prefix_shard_pools=False, plugins=default_profile())
    env = envoy_factory(epp_port=epp.grpc_port)
    prompt = "Route me where I went before. " * 20
    url = f"http://127.0.0.1:{env.listen_port}/v1/completions"
    for rid in ("first-1", "second-2"):
        status, _, body = post(url, {"model": "m", "prompt": prompt}, headers={"x-request-id": rid})
        assert status == 200, body
    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 2, what="two decision log lines")
    rows = {r["id"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"first-1", "second-2"}
    assert rows["first-1"]["predicted"] == 0 and rows["second-2"]["pod"] == rows["first-1"]["pod"]
    assert rows["second-2"]["predicted"] == len(prompt.encode()) // BLOCK * 16
