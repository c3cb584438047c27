"""Routing decisions without a network: plugins registry, scorer formulas, both levels, hot spots, P/D,
shedding."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfleet.config import load
from kvfleet.config.epp import PluginSpec
from kvfleet.epp.datastore import Pod, Pool, StaticDatastore
from kvfleet.epp.errors import NoEndpointError, SheddingError, UnknownModelError, UnknownPluginError
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.podmetrics import MetricsStore, PodMetrics
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.scheduling import (
    REGISTRY,
    Candidate,
    Candidates,
    Profile,
    SchedulingRequest,
    create,
    plugins,
    rendezvous_rank,
)
from kvfleet.epp.scheduling.framework import column
from kvfleet.epp.tokenize import load_tokenizer


def pools(n: int = 3, roles: list[str] | None = None, npools: int = 1, shards: int = 1) -> dict[str, Any]:
    """``npools`` pools of ``n`` pods each; with ``shards`` > 1 the pods of a pool are split round-robin
    into that many prefix shards (labels "0", "1", ...)."""
    out = []
    for p in range(npools):
        pods = [{"name": f"p{p}-{i}", "address": "10.0.0.1", "port": 8000 + 10 * p + i,
                 "role": (roles or ["both"] * n)[i],
                 **({"shard": str(i % shards)} if shards > 1 else {})} for i in range(n)]
        out.append({"name": f"pool-{p}", "models": ["m"], "pods": pods})
    return {"pools": out}


def router(data: Any = None, **over: Any) -> Router:
    s = load(overrides={"epp": over})
    return Router(s.epp, s.cache, StaticDatastore(data=data or pools()), BlockIndex(), MetricsStore(),
                  load_tokenizer("bytes"))


PROMPT = "the same long system prompt " * 40


class TestRegistry:
    """Plugins are found by name; unknown names list the known ones; every plugin documents itself."""

    def test_unknown_plugin_lists_known(self) -> None:
        with pytest.raises(UnknownPluginError) as ei:
            create("nope", {})
        assert "prefix-cache-scorer" in str(ei.value)

    def test_every_plugin_has_a_docstring(self) -> None:
        assert {"ready-filter", "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
                "max-score-picker"} <= set(REGISTRY)
        assert all(r.doc for r in REGISTRY.values())

    def test_round_robin_picker_cycles(self) -> None:
        r = router(plugins=[{"type": "round-robin-picker", "params": {"fallbacks": 0}}])
        picks = [r.route(InferenceRequest(model="m", prompt=PROMPT)).pod for _ in range(6)]
        assert picks == ["p0-0", "p0-1", "p0-2"] * 2

    def test_profile_rejects_two_pickers(self) -> None:
        with pytest.raises(UnknownPluginError):
            Profile([PluginSpec(type="max-score-picker"), PluginSpec(type="random-picker")])


class TestScorers:
    """The default profile's score = hit seconds·decay − queued seconds − w_kv·kv."""

    def cand(self, name: str, **kw: Any) -> Candidate:
        return Candidate(pod=Pod(name=name, address="a", port=1), **kw)

    def test_formula(self) -> None:
        """hit_s·gain/(1+β·followers) − (pending·t + n_pending·overhead) − w_kv·kv, each term checked;
        gain = 1 + g·ρ (ρ from the candidates' mean queue) where no request of the prefix is still queued,
        else 1; followers = same_prefix, except 0 while the pod is still computing the prefix (its hit all
        speculative) for followers slower than it serves them (prefix_rate · prefill_s_per_token < 1)."""
        prof = Profile([
            PluginSpec(type="prefix-cache-scorer", params={"load_gain": 2.0}),
            PluginSpec(type="queue-scorer", params={"overhead_s": 0.0}),
            PluginSpec(type="kv-cache-utilization-scorer", weight=0.05),
            PluginSpec(type="max-score-picker", params={"fallbacks": 5}),
        ])
        req = SchedulingRequest(num_tokens=1600, block_size=16, prefill_s_per_token=1e-4, hotspot_beta=0.5)
        hot = self.cand("hot", hit_blocks=50, hit_weighted=50.0, same_prefix=2, prefix_rate=1e4)
        # the same queued requests of its prefix, coming at half the rate the pod serves them, while the
        # pod still computes the prefix: not damped; once it is cached: damped
        slow = self.cand("slow", hit_blocks=5, hit_weighted=5.0, spec_blocks=5, same_prefix=2,
                         prefix_rate=5e3)
        cached = self.cand("cached", hit_blocks=4, hit_weighted=4.0, same_prefix=2, prefix_rate=5e3)
        busy = self.cand("busy", hit_blocks=100, hit_weighted=100.0, pending_tokens=4800)
        hit = self.cand("hit", hit_blocks=20, hit_weighted=20.0)
        kv = self.cand("kv", metrics=PodMetrics(kv_usage=1.0, scraped_at=0))
        ranked = prof.run(req, [hot, slow, cached, busy, hit, kv])
        scores = dict(zip((c.name for c in ranked.pods), ranked.scores, strict=True))
        q_mean = 4800 / 6 * 1e-4
        gain = 1 + 2.0 * q_mean / (q_mean + 0.16)
        # a burst of its prefix queued there: no gain
        assert scores["hot"] == pytest.approx(50 * 16 * 1e-4 / 2.0)
        assert scores["slow"] == pytest.approx(5 * 16 * 1e-4)
        assert scores["cached"] == pytest.approx(4 * 16 * 1e-4 / 2.0)
        assert scores["busy"] == pytest.approx(100 * 16 * 1e-4 * gain - 0.48)
        assert scores["hit"] == pytest.approx(20 * 16 * 1e-4 * gain)
        assert scores["kv"] == pytest.approx(-0.05)
        assert [c.name for c in ranked.pods] == ["hit", "hot", "slow", "cached", "kv", "busy"]

    def test_idle_cluster_values_hits_at_their_latency(self) -> None:
        """With nothing queued (ρ = 0) the load gain does not apply: a hit is worth the prefill it saves."""
        (score,) = create("prefix-cache-scorer", {"load_gain": 20.0})[1].score(  # type: ignore[union-attr]
            SchedulingRequest(num_tokens=160, block_size=16, prefill_s_per_token=1e-3, hotspot_beta=0.0),
            [self.cand("a", hit_weighted=4.0)],
        )
        assert score == pytest.approx(4 * 16 * 1e-3)

    def test_eviction_cost_prices_what_a_full_cache_gives_up(self) -> None:
        """−(new blocks − free blocks)·block prefill seconds: free room costs nothing, a full cache's blocks
        cost their prefill, a hit stores nothing new; no score without the engine's cache size."""
        _, plugin = create("eviction-cost-scorer", {})
        # 10 blocks of 16 tokens; engine blocks of 16 tokens, 100 of them
        req = SchedulingRequest(num_tokens=160, block_size=16, prefill_s_per_token=1e-3)
        size = PodMetrics(block_size=16, num_gpu_blocks=100, scraped_at=0)
        cands = [
            self.cand("room", held_blocks=50, metrics=size),
            self.cand("tight", held_blocks=96, metrics=size),
            self.cand("full", held_blocks=100, metrics=size),
            self.cand("held", held_blocks=100, hit_blocks=10, metrics=size),
            self.cand("unknown", held_blocks=100),
        ]
        scores = plugin.score(req, cands)  # type: ignore[union-attr]
        assert scores == pytest.approx([0.0, -6 * 16e-3, -10 * 16e-3, 0.0, 0.0])
        # engine blocks of 32 tokens hold twice as many of the picker's 16-token blocks
        big = PodMetrics(block_size=32, num_gpu_blocks=100, scraped_at=0)
        assert plugin.score(req, [self.cand("x", held_blocks=195, metrics=big)]) == pytest.approx(  # type: ignore[union-attr]
            [-5 * 16e-3])

    def test_followers_spare_a_prefix_being_computed_only_while_a_copy_would_be_later(self) -> None:
        """``followers``: a holder still computing the prefix (hit all speculative) for followers slower than
        it serves them counts 0, while no other pod could have a copy ready (its queue + the missing blocks'
        prefill) before the holder's queue is through; once one could, the waiting followers count."""
        req = SchedulingRequest(num_tokens=1600, block_size=16, prefill_s_per_token=1e-4)
        holder = {"hit_blocks": 100, "hit_weighted": 100.0, "spec_blocks": 100, "same_prefix": 3,
                  "prefix_rate": 5e3}
        # queue 0.1 s; a copy on the idle pod needs 100 blocks · 1.6 ms = 0.16 s: later, so not counted
        cands = [self.cand("holder", pending_tokens=1000, **holder), self.cand("idle")]
        assert plugins.followers(req, cands) == [0.0, 0.0]
        # queue 0.3 s: the copy would be ready first
        cands = [self.cand("holder", pending_tokens=3000, **holder), self.cand("idle")]
        assert plugins.followers(req, cands) == [3.0, 0.0]
        # followers faster than the holder serves them (ρ_f = 2e4 · 1e-4 = 2): counted
        fast = {**holder, "prefix_rate": 2e4}
        assert plugins.followers(req, [self.cand("holder", **fast), self.cand("idle")]) == [3.0, 0.0]
        # the prefix cached there (its events came): counted
        cached = {**holder, "spec_blocks": 0}
        assert plugins.followers(req, [self.cand("holder", **cached), self.cand("idle")]) == [3.0, 0.0]

    def test_copy_value_credits_a_copy_with_the_wait_it_saves_the_prefix_s_followers(self) -> None:
        """``N/(k + 1) − F`` followers (k holders, the speculative ones included), each saving the least
        established holder's expected wait less the pod's, scaled by the pod's spare capacity ``1 − 2u``;
        nothing on holders, on pods at least half busy, without expected followers or without an
        established holder."""
        _, plugin = create("copy-value-scorer", {})
        req = SchedulingRequest(num_tokens=1600, block_size=16, prefill_s_per_token=1e-4,
                                hot_followers=24.0, followup_share=0.5)  # F = 1
        cands = [
            self.cand("holder", hit_blocks=50, hit_weighted=50.0, expected_wait_s=0.3),
            self.cand("copying", hit_blocks=50, hit_weighted=50.0, spec_blocks=50, expected_wait_s=0.0),
            self.cand("idle", expected_wait_s=0.1),
            self.cand("quarter", hit_blocks=10, hit_weighted=10.0, expected_wait_s=0.0, busy_share=0.25),
            self.cand("busy", expected_wait_s=0.0, busy_share=0.5),
            self.cand("slower", expected_wait_s=0.4),
        ]
        k = 24.0 / 3 - 1.0  # two holders (one still computing): a third copy takes a third of 24, less F
        scores = plugin.score(req, cands)  # type: ignore[union-attr]
        assert scores == pytest.approx([0.0, 0.0, k * 0.2, k * 0.3 * 0.5, 0.0, 0.0])
        few = SchedulingRequest(num_tokens=1600, block_size=16, prefill_s_per_token=1e-4,
                                hot_followers=3.0, followup_share=0.5)
        assert plugin.score(few, cands) == [0.0] * 6  # type: ignore[union-attr]
        computing = [self.cand("copying", hit_blocks=50, hit_weighted=50.0, spec_blocks=50,
                               expected_wait_s=0.3), self.cand("idle")]
        assert plugin.score(req, computing) == [0.0, 0.0]  # type: ignore[union-attr]

    def test_recompute_load_charges_busy_pods_that_lack_the_prefix(self) -> None:
        """−(H − hit)·block prefill seconds·u/(1 − u): nothing on an idle pod, on the holder, or when no pod
        holds more than another; u capped at ``max_busy``; damped by the hot prefix's requests in flight."""
        _, plugin = create("recompute-load-scorer", {})
        req = SchedulingRequest(num_tokens=160, block_size=16, prefill_s_per_token=1e-3, hotspot_beta=0.5)
        unit = 16e-3
        cands = [
            self.cand("holder", hit_weighted=8.0, busy_share=0.9),
            self.cand("idle", busy_share=0.0),
            self.cand("quarter", hit_weighted=2.0, busy_share=0.25),
            self.cand("busy", busy_share=0.9),
        ]
        scores = plugin.score(req, cands)  # type: ignore[union-attr]
        assert scores == pytest.approx([0.0, 0.0, -6 * unit / 3, -8 * unit * 4])  # 0.9 counts as 0.8: × 4
        assert plugin.score(req, [self.cand("a", busy_share=0.9), self.cand("b", busy_share=0.4)]) == [  # type: ignore[union-attr]
            0.0, 0.0]
        hot = [self.cand("holder", hit_weighted=8.0, same_prefix=2, prefix_rate=1e3),
               self.cand("busy", busy_share=0.9)]
        assert plugin.score(req, hot) == pytest.approx([0.0, -8 * unit * 4 / 2])  # type: ignore[union-attr]
        # still computing the prefix for requests that come at half the rate it serves them: no damping
        slow = [self.cand("holder", hit_blocks=8, hit_weighted=8.0, spec_blocks=8, same_prefix=2,
                          prefix_rate=500.0), self.cand("busy", busy_share=0.9)]
        assert plugin.score(req, slow) == pytest.approx([0.0, -8 * unit * 4])  # type: ignore[union-attr]
        _, half = create("recompute-load-scorer", {"max_busy": 0.5})
        assert half.score(req, cands)[3] == pytest.approx(-8 * unit)  # type: ignore[union-attr]

    def test_expected_wait_adds_to_the_queue(self) -> None:
        """The queue scorer adds the candidate's expected wait (weight ``expected_weight``)."""
        _, plugin = create("queue-scorer", {"overhead_s": 0.0, "running_s": 0.0})
        _, off = create("queue-scorer", {"overhead_s": 0.0, "running_s": 0.0, "expected_weight": 0.0})
        req = SchedulingRequest(num_tokens=160, block_size=16, prefill_s_per_token=1e-3)
        c = self.cand("a", expected_wait_s=0.25, pending_tokens=100, pending_requests=1)
        assert plugin.score(req, [c]) == pytest.approx([-0.35])  # type: ignore[union-attr]
        assert off.score(req, [c]) == pytest.approx([-0.1])  # type: ignore[union-attr]

    def test_expected_wait_counts_the_followups(self) -> None:
        """With a follow-up share ``f`` the expected wait counts ``1 + min(max_followups, f / (1 − f))``
        times: once for the request and once per request expected to follow it to the pod."""
        _, plugin = create("queue-scorer", {"overhead_s": 0.0, "running_s": 0.0})
        _, two = create("queue-scorer", {"overhead_s": 0.0, "running_s": 0.0, "max_followups": 2.0})
        c = self.cand("a", expected_wait_s=0.25, pending_tokens=100, pending_requests=1)
        for f, n in ((0.0, 0.0), (0.5, 1.0), (0.75, 3.0), (0.9, 4.0), (1.0, 4.0)):
            req = SchedulingRequest(num_tokens=160, block_size=16, prefill_s_per_token=1e-3, followup_share=f)
            assert plugin.followups(req) == pytest.approx(n)  # type: ignore[union-attr]
            assert plugin.score(req, [c]) == pytest.approx([-0.1 - 0.25 * (1 + n)])  # type: ignore[union-attr]
            assert two.followups(req) == pytest.approx(min(2.0, n))  # type: ignore[union-attr]

    def test_affinity_is_stable_per_shard(self) -> None:
        """The affinity bonus goes to one pod per shard, the same one every time, spread over pods across
        shards."""
        _, plugin = create("prefix-affinity-scorer", {"affinity_s": 0.5})
        cands = [self.cand(f"p{i}") for i in range(4)]
        tops = set()
        for shard in range(200):
            req = SchedulingRequest(shard=shard)
            first = plugin.score(req, cands)  # type: ignore[union-attr]
            assert first == plugin.score(req, cands) and sorted(first) == [0, 0, 0, 0.5]  # type: ignore[union-attr]
            tops.add(first.index(0.5))
        assert tops == {0, 1, 2, 3}

    def test_affinity_home_is_a_holder_else_an_empty_pod(self) -> None:
        """The home is the rendezvous top among the pods that hold the shard's prefix (as much of its
        ``shard_blocks`` as any pod holds); with no holder, among the pods whose GPU tier holds nothing;
        else among all. Two scorers (two EPP replicas) given the same candidates agree."""
        one, two = (create("prefix-affinity-scorer", {"affinity_s": 0.5})[1] for _ in range(2))

        def home(cands: list[Candidate], shard: int, k: int = 4) -> str:
            req = SchedulingRequest(shard=shard, shard_blocks=k)
            scores = one.score(req, cands)  # type: ignore[union-attr]
            assert scores == two.score(req, cands) and sorted(scores) == [0.0] * (len(cands) - 1) + [0.5]  # type: ignore[union-attr]
            return cands[scores.index(0.5)].pod.name

        bare = [self.cand(f"p{i}") for i in range(6)]
        by_hash = {s: home(bare, s) for s in range(300)}
        assert len(set(by_hash.values())) == 6  # nothing held anywhere: the hash over all pods
        for shard in range(300):
            # p1 and p4 hold the whole shard prefix, p2 part of it: the home is one of the first two
            holders = [self.cand(f"p{i}", hit_blocks=h, held_blocks=50)
                       for i, h in enumerate([0, 6, 2, 0, 4, 0])]
            assert home(holders, shard) in {"p1", "p4"}
            # nobody holds the whole of it: the pods that hold the most do
            partial = [self.cand(f"p{i}", hit_blocks=h, held_blocks=50)
                       for i, h in enumerate([0, 3, 2, 0, 3, 0])]
            assert home(partial, shard) in {"p1", "p4"}
            # a one-block shard: any holder of that block
            assert home(holders, shard, k=1) in {"p1", "p2", "p4"}
            # no holder: the empty pods (p3, p5) before the busy ones; none empty: the hash over all again
            fresh = [self.cand(f"p{i}", held_blocks=0 if i in (3, 5) else 80) for i in range(6)]
            assert home(fresh, shard) in {"p3", "p5"}
            full = [self.cand(f"p{i}", held_blocks=80) for i in range(6)]
            assert home(full, shard) == by_hash[shard]
        # the holder pair and the empty pair each get homes on both of their pods across shards (no fixed
        # favourite)
        assert {home(holders, s) for s in range(40)} == {"p1", "p4"}
        assert {home(fresh, s) for s in range(40)} == {"p3", "p5"}


class TestRouting:
    """Level 2 follows the index, spreads hot prefixes, and errors map to typed exceptions."""

    def test_followup_share_counts_requests_that_follow_a_live_pick(self) -> None:
        """A pool's follow-up share rises with requests whose prefix a pick still live covers (a
        conversation's next turns), and stays 0 while every request is new."""
        r = router()
        seen: list[float] = []
        schedule = r.scheduler.schedule

        def spy(req: SchedulingRequest, *a: Any, **kw: Any) -> Any:
            seen.append(req.followup_share)
            return schedule(req, *a, **kw)

        r.scheduler.schedule = spy  # type: ignore[method-assign]
        for i in range(20):  # distinct prompts: nothing to follow
            r.route(InferenceRequest(model="m", prompt=f"{i:04d} a fresh question " * 20))
        assert seen[-1] == 0.0
        turns = "a conversation " * 20
        for i in range(20):  # each turn extends the last: its prefix is the previous pick
            turns += f"turn {i} " * 8
            r.route(InferenceRequest(model="m", prompt=turns))
        assert 0.05 < seen[-1] < 0.2  # ≈ 19 turns of ≈ 0.9 at an average weight of 1 %
        assert seen == sorted(seen)
        m = EppMetrics()
        m.attach_state(r.index, r.tracker, r.metrics, r.datastore.pools, dict,
                       followups=r.director.followup_shares)
        share = m.registry.get_sample_value("kvfleet_epp_pool_followup_share", {"name": "pool-0"})
        assert share is not None and share > seen[-1]  # the last turn folded in too

    def test_follows_the_index(self) -> None:
        r = router()
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        r.index.add("p0-2", keys)
        d = r.route(InferenceRequest(model="m", prompt=PROMPT))
        assert d.pod == "p0-2" and d.predicted_hit_tokens == len(keys) * 16

    def test_cache_salt_changes_keys(self) -> None:
        r = router()
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        r.index.add("p0-2", keys)
        d = r.route(InferenceRequest(model="m", prompt=PROMPT, cache_salt="tenant-b"))
        assert d.predicted_hit_tokens == 0

    def burst(
        self, beta: float, plugins: list[dict[str, Any]] | None = None, decoding: bool = False
    ) -> list[str]:
        """A computed prefix, then 12 same-prefix requests in flight at once (waiting for their first token,
        or with ``decoding`` already past it)."""
        r = router(hotspot_beta=beta, **({"plugins": plugins} if plugins else {}))
        first = r.route(InferenceRequest(model="m", prompt=PROMPT))
        assert first.ticket is not None
        first.ticket.first_byte()
        out = []
        for i in range(12):
            d = r.route(InferenceRequest(model="m", prompt=PROMPT + f" q{i}"))
            assert d.ticket is not None
            if decoding:
                d.ticket.first_byte()  # prefilled, now decoding: in flight on the pod
            out.append(d.pod)
        return [first.pod, *out]

    def test_follow_up_goes_to_the_cached_pod(self) -> None:
        picks = self.burst(beta=1.0)
        assert picks[1] == picks[0]

    def test_hotspot_decay_spreads_a_burst(self) -> None:
        """Seed 5.4: hot-spot decay lowers the hit value of a pod already busy with the same prefix
        (requests still waiting for their first token there)."""
        spread = self.burst(beta=1.0)
        flat = self.burst(beta=0.0)
        assert len(set(spread)) == 3
        assert spread.count(spread[0]) < flat.count(flat[0])

    def test_decoding_requests_are_no_hot_spot(self) -> None:
        """A request past its first token no longer competes for the pod's prefill: it does not damp the next
        hit of its prefix (counted until the stream's end, a dozen decoding requests spread the burst)."""
        assert len(set(self.burst(beta=1.0, decoding=True))) == 1

    def test_without_decay_and_load_the_burst_piles_up(self) -> None:
        picks = self.burst(beta=0.0, plugins=[{"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}])
        assert len(set(picks)) == 1

    def test_unknown_model_and_no_ready_pod(self) -> None:
        r = router()
        with pytest.raises(UnknownModelError):
            r.route(InferenceRequest(model="other", prompt="x"))
        data = pools(2)
        for p in data["pools"][0]["pods"]:
            p["ready"] = False
        with pytest.raises(NoEndpointError):
            router(data).route(InferenceRequest(model="m", prompt="x"))

    def test_subset_hint_restricts_pods(self) -> None:
        r = router()
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        r.index.add("p0-2", keys)
        d = r.route(InferenceRequest(model="m", prompt=PROMPT), subset=["10.0.0.1:8001"])
        assert d.pod == "p0-1"

    def test_shedding(self) -> None:
        r = router(shed_queue=2.0)
        for i in range(6):
            r.route(InferenceRequest(model="m", prompt=f"{i}" * 100))
        with pytest.raises(SheddingError) as ei:
            r.route(InferenceRequest(model="m", prompt="late"))
        assert ei.value.status == 429


class TestPools:
    """Level 1: rendezvous hashing is stable, capacity-weighted, and spills when saturated."""

    def test_stable_and_weighted(self) -> None:
        ps = [Pool(name="a", weight=1.0), Pool(name="b", weight=3.0)]
        firsts = [rendezvous_rank(k * 7919 + 1, ps)[0].name for k in range(4000)]
        assert firsts == [rendezvous_rank(k * 7919 + 1, ps)[0].name for k in range(4000)]
        assert 0.68 < firsts.count("b") / len(firsts) < 0.82

    def test_same_prefix_same_shard_and_spill(self) -> None:
        """Level 1 inside one pool: a prefix keeps to its shard (a pod subset) until that shard saturates."""
        r = router(pools(6, shards=3), pool_saturation_queue=2.0,
                   plugins=[{"type": "queue-scorer"}, {"type": "max-score-picker"}])
        first = [r.route(InferenceRequest(model="m", prompt=PROMPT + f"{i}")).shard for i in range(4)]
        assert len(set(first)) == 1  # 2 pods × 2 pending each = saturated after 4
        spilled = r.route(InferenceRequest(model="m", prompt=PROMPT + "x"))
        assert spilled.shard != first[0] and spilled.pool == "pool-0"

    def test_every_endpoint_is_in_the_invoked_pool(self) -> None:
        """Two pools serve one model: each answer (pick and fallbacks) names endpoints of one pool only,
        the same prompt always lands in the same pool, and a subset hint picks the pool that holds it."""
        data = pools(3, npools=2, shards=2)
        members = {p["name"]: {f"{q['address']}:{q['port']}" for q in p["pods"]} for p in data["pools"]}
        r = router(data, plugins=[{"type": "queue-scorer"},
                                  {"type": "max-score-picker", "params": {"fallbacks": 5}}])
        seen, widest = set(), 0
        for i in range(40):
            d = r.route(InferenceRequest(model="m", prompt=f"{i} {PROMPT}"))
            assert set(d.endpoints) <= members[d.pool], d
            widest = max(widest, len(d.endpoints))
            assert r.route(InferenceRequest(model="m", prompt=f"{i} {PROMPT}")).pool == d.pool
            seen.add(d.pool)
        assert seen == {"pool-0", "pool-1"} and widest == 2  # fallbacks: the other pod of the pick's shard
        d = r.route(InferenceRequest(model="m", prompt=PROMPT), subset=["10.0.0.1:8011"])
        assert d.pool == "pool-1" and d.endpoints == ("10.0.0.1:8011",)

    def test_fallback_served_moves_the_accounting(self) -> None:
        """The gateway reports a fallback served: in-flight load and the speculative prefix move to it."""
        r = router(pools(3), plugins=[{"type": "queue-scorer"},
                                      {"type": "max-score-picker", "params": {"fallbacks": 2}}])
        d = r.route(InferenceRequest(model="m", prompt=PROMPT))
        other = next(e for e in d.endpoints[1:])
        name = {f"10.0.0.1:{8000 + i}": f"p0-{i}" for i in range(3)}[other]
        assert r.tracker.load(d.pod)[0] == 1 and r.tracker.load(name)[0] == 0
        assert not d.served(d.endpoints[0])
        assert d.served(other)
        assert r.tracker.load(d.pod)[0] == 0 and r.tracker.load(name)[0] == 1
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        hits = r.index.match(keys, [d.pod, name])
        assert d.pod not in hits and hits[name].blocks == len(keys)
        assert d.ticket is not None
        # the same response headers: the TTL refresh must not bring the pick's entry back
        d.ticket.first_byte()
        hits = r.index.match(keys, [d.pod, name])
        assert d.pod not in hits and hits[name].blocks == len(keys)
        d.ticket.close()
        assert r.tracker.load(name)[0] == 0 and not d.served("10.9.9.9:1")

    def test_single_pool_saturated_still_routes_by_score(self) -> None:
        """One pool: nowhere to spill, so saturation does not change the pick (the queue scorer still
        spreads)."""
        r = router(pools(2), pool_saturation_queue=1.0,
                   plugins=[{"type": "queue-scorer"}, {"type": "max-score-picker"}])
        got = [r.route(InferenceRequest(model="m", prompt=PROMPT + f"{i}")) for i in range(6)]
        assert {d.pool for d in got} == {"pool-0"}
        assert sorted(d.pod for d in got) == ["p0-0"] * 3 + ["p0-1"] * 3

    def test_without_sharding_one_cycle_spans_every_shard(self) -> None:
        """``prefix_shard_pools: false`` (baselines): the same prompt is spread over every shard's serving
        pods, and a P/D shard still gets its prefill pod named for an uncached prompt."""
        data = pools(4, roles=["both", "both", "prefill", "decode"])
        for i, pod in enumerate(data["pools"][0]["pods"]):
            pod["shard"] = "a" if i < 2 else "b"
        rr = [{"type": "round-robin-picker", "params": {"fallbacks": 0}}]
        r = router(data, prefix_shard_pools=False, plugins=rr, pd_min_uncached_tokens=256)
        got = [r.route(InferenceRequest(model="m", prompt=f"{i} {PROMPT}")) for i in range(6)]
        # the prefill pod is not a serving pod, and its own cycle does not skew the serving pods' turns
        assert sorted(d.pod for d in got) == ["p0-0", "p0-0", "p0-1", "p0-1", "p0-3", "p0-3"]
        assert {d.prefiller for d in got if d.pod == "p0-3"} == {"10.0.0.1:8002"}
        assert {d.prefiller for d in got if d.pod != "p0-3"} == {None}
        sharded = router(data, plugins=rr)
        assert len({sharded.route(InferenceRequest(model="m", prompt=PROMPT)).shard for _ in range(6)}) == 1


class TestDisaggregated:
    """P/D pools: decode pod picked, prefill pod named only when the uncached part is long."""

    def test_long_uncached_gets_a_prefiller(self) -> None:
        r = router(pools(3, roles=["prefill", "decode", "decode"]), pd_min_uncached_tokens=256)
        d = r.route(InferenceRequest(model="m", prompt=PROMPT))
        assert d.pod in ("p0-1", "p0-2") and d.prefiller == "10.0.0.1:8000"

    def test_prediction_is_the_prefill_pods_hit(self) -> None:
        """With a prefill pod the engine reports the prefill pod's cached tokens: the prediction is its hit,
        not the decode pod's (misprediction compares like with like)."""
        r = router(pools(2, roles=["prefill", "decode"]), pd_min_uncached_tokens=256)
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        r.index.add("p0-0", keys[:10])  # only the prefill pod holds a part of the prompt
        d = r.route(InferenceRequest(model="m", prompt=PROMPT))
        assert d.pod == "p0-1" and d.prefiller == "10.0.0.1:8000" and d.predicted_hit_tokens == 160

    def test_short_uncached_skips_pd(self) -> None:
        r = router(pools(3, roles=["prefill", "decode", "decode"]), pd_min_uncached_tokens=256)
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        r.index.add("p0-2", keys)
        d = r.route(InferenceRequest(model="m", prompt=PROMPT + "tail"))
        assert d.pod == "p0-2" and d.prefiller is None


class TestApproximateMode:
    """Without KV events the index holds the picker's own picks, for approximate_ttl_s after the first
    token."""

    def test_picks_alone_route_a_prefix_back(self) -> None:
        r = router(events_enabled=False, approximate_ttl_s=60.0)
        first = r.route(InferenceRequest(model="m", prompt=PROMPT))
        assert first.ticket is not None
        first.ticket.close()
        again = r.route(InferenceRequest(model="m", prompt=PROMPT + " next turn"))
        # speculative entries: 64 dense blocks, then sampled, and the prompt's last block: all 70 blocks
        # credited
        assert again.pod == first.pod and again.predicted_hit_tokens == (len(PROMPT) // 16) * 16 == 70 * 16


    def test_pods_without_kv_events_keep_picks_for_the_approximate_ttl(self) -> None:
        """With events on, a pod whose engine publishes none (no events endpoint: the operator leaves the
        annotation empty for engines whose events cannot be indexed) keeps its picks for approximate_ttl_s,
        the others until their events take over (speculative_ttl_s)."""
        data = pools(2)
        data["pools"][0]["pods"][0]["events"] = "tcp://10.0.0.1:5557"
        r = router(data, speculative_ttl_s=1.0, approximate_ttl_s=60.0)
        pods = {p.name: p for p in r.datastore.pools()[0].pods}
        assert r.pick_ttl(pods["p0-0"]) == 1.0 and r.pick_ttl(pods["p0-1"]) == 60.0
        assert router(data, events_enabled=False, approximate_ttl_s=60.0).pick_ttl(pods["p0-0"]) == 60.0


class TestScrapedWaiting:
    """The engine's ``waiting`` gauge counts the picker's own requests as they were at the scrape: a request
    whose first token came back since must not become a phantom foreign request that outweighs a hit."""

    def test_pending_at_counts_requests_waiting_at_that_instant(self) -> None:
        now = [0.0]
        from kvfleet.epp.inflight import InflightTracker

        tr = InflightTracker(clock=lambda: now[0])
        a = tr.open(("p",), 1, 100.0)
        now[0] = 1.0
        tr.open(("p",), 1, 100.0)
        now[0] = 2.0
        a.first_byte()
        assert tr.load("p")[2] == 1
        assert tr.pending_at("p", 0.5) == 1  # only a was open then
        assert tr.pending_at("p", 1.5) == 2  # a had not answered yet; the second was queued
        assert tr.pending_at("p", 2.5) == 1
        assert tr.pending_at("q", 1.5) == 0

    def test_expected_wait_is_the_busy_history_of_the_pod(self) -> None:
        """``s̄·u/(1−u)``: a pod busy half of a long past with 1 s requests expects about 1 s of wait; one busy
        90 % of the time with 0.9 s requests is capped at ``s̄`` (``u`` counts up to 0.5); a pod without
        history expects none; the figure decays once the pod idles."""
        now = [0.0]
        from kvfleet.epp.inflight import InflightTracker

        tr = InflightTracker(clock=lambda: now[0], history_s=10.0)
        for k in range(200):  # every 2 s a request that takes 1 s to its first token
            now[0] = 2.0 * k
            t = tr.open(("busy",), 1, 10.0)
            now[0] = 2.0 * k + 1.0
            t.first_byte()
        for at in (399.0, 400.0, 400.5):  # (exponentially weighted: within a period, u moves about 0.5)
            now[0] = at
            assert 0.7 < tr.expected_waits(["busy"])[0] < 1.3
        for k in range(100):  # every second a request that takes 0.9 s
            now[0] = 1000.0 + k
            t = tr.open(("saturated",), 1, 10.0)
            now[0] = 1000.0 + k + 0.9
            t.first_byte()
        assert tr.expected_waits(["saturated"])[0] == pytest.approx(0.9, rel=0.05)
        assert tr.expected_waits(["never"])[0] == 0.0
        # the busy share itself (the recompute-load scorer's u), uncapped
        busy, saturated, never = tr.view(["busy", "saturated", "never"], 0, [None] * 3)
        assert 0.85 < saturated.busy_share < 0.95 and never.busy_share == 0.0
        assert busy.busy_share < 0.01  # a long while idle
        now[0] = 460.0  # a minute idle: u ≈ 0.5·e⁻⁶
        assert tr.expected_waits(["busy"])[0] < 0.01

    def test_a_stale_waiting_gauge_does_not_override_a_hit(self) -> None:
        now = [0.0]
        clock = lambda: now[0]  # noqa: E731
        from kvfleet.epp.inflight import InflightTracker

        s = load(overrides={"epp": {}})
        r = Router(s.epp, s.cache, StaticDatastore(data=pools(2)), BlockIndex(clock=clock),
                   MetricsStore(clock=clock), load_tokenizer("bytes"), InflightTracker(clock=clock))
        keys = r.keys_of(r.tokenizer.encode(PROMPT), None)
        first = r.route(InferenceRequest(model="m", prompt=PROMPT))  # computes the prefix on one pod
        holder = first.pod
        other = next(n for n in ("p0-0", "p0-1") if n != holder)
        # the scrape at t=0.1 saw that request waiting on its pod; the other pod idle
        r.metrics.put(holder, PodMetrics(waiting=1.0, scraped_at=0.1))
        r.metrics.put(other, PodMetrics(waiting=0.0, scraped_at=0.1))
        now[0] = 0.3
        assert first.ticket is not None
        first.ticket.first_byte()
        first.ticket.close()
        r.index.add(holder, keys)  # its events arrived
        now[0] = 0.4
        # a follow-up with a long new suffix: the phantom would cost its whole prefill, more than the hit
        # saves
        d = r.route(InferenceRequest(model="m", prompt=PROMPT + "a new question " * 150))
        assert d.pod == holder and d.predicted_hit_tokens == len(keys) * 16

    def test_foreign_waiting_requests_still_count(self) -> None:
        """Requests the picker did not route (waiting beyond its own at the scrape) still repel."""
        now = [0.0]
        clock = lambda: now[0]  # noqa: E731
        from kvfleet.epp.inflight import InflightTracker

        s = load(overrides={"epp": {}})
        r = Router(s.epp, s.cache, StaticDatastore(data=pools(2)), BlockIndex(clock=clock),
                   MetricsStore(clock=clock), load_tokenizer("bytes"), InflightTracker(clock=clock))
        fresh = "nobody holds this " * 100  # no hit anywhere; its prefill outweighs the affinity bonus
        r.metrics.put("p0-0", PodMetrics(waiting=3.0, scraped_at=0.0))
        r.metrics.put("p0-1", PodMetrics(waiting=0.0, scraped_at=0.0))
        now[0] = 0.1
        assert r.route(InferenceRequest(model="m", prompt=fresh)).pod == "p0-1"


class TestMaxScorePicker:
    """The picker's contract: highest score (rounded to 9 decimals) first, then fewer in-flight requests, then
    one random draw per candidate in candidate order; it builds keys only for the candidates near the k-th
    best score, and must order exactly as keys built for all of them would."""

    @staticmethod
    def by_contract(scores: list[float], cands: list[Candidate], k: int, seed: int) -> list[str]:
        rnd = random.Random(seed).random
        keys = [(-round(s, 9), c.inflight, rnd()) for s, c in zip(scores, cands, strict=True)]
        return [cands[i].name for i in sorted(range(len(cands)), key=keys.__getitem__)[:k]]

    def test_orders_as_keys_for_every_candidate(self) -> None:
        rng = random.Random(3)
        for trial in range(400):
            n = rng.choice([1, 3, 12, 64, 200])
            base = rng.uniform(-5.0, 5.0)
            # near-ties on both sides of the rounding step and of the 1e-8 margin
            steps = [0.0, 3e-10, 4.9e-10, 5.1e-10, 1e-9, 9e-9, 1.1e-8, 1e-6, 0.5]
            scores = [base - rng.choice(steps) * rng.randint(0, 3) for _ in range(n)]
            cands = [Candidate(pod=Pod(name=f"p{i}", address="a", port=1), inflight=rng.randint(0, 2))
                     for i in range(n)]
            fallbacks = rng.randint(0, 4)
            seed = rng.randrange(1 << 30)
            _, picker = create("max-score-picker", {"fallbacks": fallbacks, "seed": seed})
            got = [c.name for c in picker.pick(SchedulingRequest(), cands, scores)]  # type: ignore[union-attr]
            assert got == self.by_contract(scores, cands, 1 + fallbacks, seed), (trial, scores)

    def test_draws_one_number_per_candidate(self) -> None:
        """The random stream advances by one draw per candidate, whatever subset gets keys: the next pick's
        tie-breaks are those of the picker that keyed every candidate."""
        cands = [Candidate(pod=Pod(name=f"p{i}", address="a", port=1)) for i in range(64)]
        _, picker = create("max-score-picker", {"seed": 7})
        picker.pick(SchedulingRequest(), cands, [float(i) for i in range(64)])  # type: ignore[union-attr]
        tied = [picker.pick(SchedulingRequest(), cands, [0.0] * 64)[0].name  # type: ignore[union-attr]
                for _ in range(3)]
        rnd = random.Random(7).random
        for _ in range(64):
            rnd()
        want = []
        for _ in range(3):
            draws = [rnd() for _ in range(64)]
            want.append(f"p{min(range(64), key=draws.__getitem__)}")
        assert tied == want

    def test_scores_of_another_length_are_refused(self) -> None:
        _, picker = create("max-score-picker", {})
        with pytest.raises(ValueError):
            picker.pick(SchedulingRequest(), [Candidate(pod=Pod(name="a", address="a", port=1))],  # type: ignore[union-attr]
                        [1.0, 2.0])


class TestCandidates:
    """A cycle's candidates as columns: the plugins read the columns, a :class:`Candidate` is built only when
    read, and a profile orders and scores a :class:`Candidates` exactly as the list of its objects."""

    @staticmethod
    def mixed(n: int, seed: int) -> list[Candidate]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            pm = (None if rng.random() < 0.3 else
                  PodMetrics(waiting=float(rng.randint(0, 6)), kv_usage=rng.random(), block_size=16,
                             num_gpu_blocks=rng.choice([None, 40, 400])))
            hit = rng.choice([0, 0, 3, 8, 20])
            out.append(Candidate(
                pod=Pod(name=f"p{i}", address="a", port=1, ready=rng.random() > 0.1), hit_blocks=hit,
                hit_weighted=hit * rng.choice([1.0, 0.7]), spec_blocks=rng.randint(0, hit),
                inflight=rng.randint(0, 5), same_prefix=rng.randint(0, 2),
                pending_tokens=rng.uniform(0, 3000), pending_requests=rng.randint(0, 3),
                pending_elapsed_s=rng.uniform(0, 0.2),
                expected_wait_s=rng.uniform(0, 0.1), held_blocks=rng.randint(0, 500), picked_blocks=hit,
                busy_share=rng.choice([0.0, 0.3, 0.9]), metrics=pm,
                scrape_pending=None if pm is None else rng.randint(0, 3)))
        return out

    def test_items_are_built_when_read_and_kept(self) -> None:
        objs = self.mixed(8, 1)
        cols = Candidates.of(objs)
        assert Candidates.of(cols) is cols and len(cols) == 8
        fresh = Candidates(cols.columns)  # same columns, no objects yet
        assert fresh[3] == objs[3] and fresh[3] is fresh[3] and fresh[-1] == objs[-1]
        assert list(fresh) == objs and fresh[2:4] == objs[2:4]
        assert fresh.position(fresh[5]) == 5
        with pytest.raises(ValueError):
            fresh.position(objs[5])  # equal, but not read from there
        assert column(fresh, "inflight") == [c.inflight for c in objs] == column(objs, "inflight")
        taken = fresh.take([5, 1])
        assert taken[0] is fresh[5] and taken[1] == objs[1] and taken.names == ["p5", "p1"]
        with pytest.raises(ValueError):
            Candidates(cols.columns[:-1])

    def test_a_profile_orders_columns_as_the_objects(self) -> None:
        specs = [*load().epp.plugins, PluginSpec(type="saturation-filter", params={"max_waiting": 4}),
                 PluginSpec(type="least-inflight-scorer", weight=0.3)]
        for seed in range(60):
            objs = self.mixed(random.Random(seed).choice([1, 5, 64]), seed)
            req = SchedulingRequest(num_tokens=400, hotspot_beta=0.1, shard=seed, followup_share=0.3)
            by_objects = Profile(specs).run(req, objs)
            by_columns = Profile(specs).run(req, Candidates(Candidates.of(objs).columns))
            assert [c.name for c in by_columns.pods] == [c.name for c in by_objects.pods], seed
            assert by_columns.scores == by_objects.scores, seed
            assert by_columns.pods == by_objects.pods
