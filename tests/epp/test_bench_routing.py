"""bench.routing's policies behave like the systems they model, and its kvfleet policy follows the EPP's
ticket semantics."""

from __future__ import annotations

from bench.routing import (
    MT_APPS,
    MT_SYSTEM,
    Kvfleet,
    KvfleetReplicas,
    Oracle,
    Req,
    SglangCacheAware,
    SimConfig,
    SimPod,
    kvfleet_plugins,
    multiturn_requests,
    simulate,
    storm_requests,
    utilisation,
)


def cluster(n: int = 3, **kw: int) -> tuple[SimConfig, list[SimPod]]:
    cfg = SimConfig(pods=n, **kw)
    return cfg, [SimPod(cfg) for _ in range(n)]


def req(blocks: list[int], t: float = 0.0, output: int = 10) -> Req:
    return Req(arrival=t, tokens=len(blocks) * 512, blocks=blocks, output=output)


class TestSglangPeer:
    """sglang-router's cache_aware policy: best match above the threshold, else the smallest tree;
    imbalanced running counts → the least-running worker."""

    def test_low_match_goes_to_the_smallest_tree(self) -> None:
        cfg, pods = cluster(3)
        p = SglangCacheAware(cfg, pods)
        p.routed(req(list(range(100, 140))), 0, 0.0, 0.0)  # 40 blocks in pod 0's tree
        p.routed(req(list(range(200, 210))), 1, 0.0, 0.0)  # 10 in pod 1's
        p.routed(req(list(range(300, 320))), 2, 0.0, 0.0)  # 20 in pod 2's
        # shares 2 of its 10 blocks with pod 0 (match rate 0.2 ≤ 0.3): not the match, the smallest tree
        assert {p.route(req([100, 101, *range(900, 908)]), 0.0) for _ in range(10)} == {1}

    def test_high_match_goes_to_the_matching_tree(self) -> None:
        cfg, pods = cluster(3)
        p = SglangCacheAware(cfg, pods)
        p.routed(req(list(range(100, 140))), 0, 0.0, 0.0)
        p.routed(req(list(range(200, 210))), 1, 0.0, 0.0)
        assert p.route(req([*range(100, 110), 999]), 0.0) == 0

    def test_imbalance_goes_to_the_least_running_and_streams_end(self) -> None:
        cfg, pods = cluster(2)
        p = SglangCacheAware(cfg, pods)
        tokens = [p.routed(req(list(range(100, 140))), 0, 0.0, 0.0) for _ in range(70)]
        assert p.route(req(list(range(100, 140))), 0.0) == 1  # 70 − 0 > 64 and 70 > 1.5·0
        for t in tokens[:10]:
            p.stream_end(t, 1.0)  # running counts drop at the stream's end, not at the first token
        assert p.running == [60, 0] and p.route(req(list(range(100, 140))), 1.0) == 0


class TestOracle:
    def test_picks_the_minimum_ttft_from_true_caches_and_queues(self) -> None:
        cfg, pods = cluster(2)
        oracle = Oracle(cfg, pods)
        prompt = list(range(1, 21))
        pods[0].serve(req(prompt), 0.0)  # pod 0 computes the prompt: it holds it, busy for its prefill
        busy = pods[0].busy_until
        assert oracle.route(req([*prompt, 99], t=0.0), 0.0) == 1  # the holder's queue costs more than a miss
        assert oracle.route(req([*prompt, 99], t=busy), busy) == 0  # free again: the hit wins


class TestKvfleetTickets:
    def test_tickets_follow_the_epp(self) -> None:
        """Opened at the pick; first token → no pending work, still in flight; stream end → closed."""
        cfg, pods = cluster(2)
        k = Kvfleet(cfg, pods, kvfleet_plugins(), 0.1, 10.0)
        r = req(list(range(1, 9)))
        pod = k.route(r, 0.0)
        token = k.routed(r, pod, 0.0, 0.3)
        name = f"pod-{pod}"
        hot = token.prefix
        assert k.router.tracker.load(name)[0] == 1 and k.router.tracker.load(name)[2] == 1
        assert k.router.tracker.same_prefix(name, hot) == 1
        k.first_token(token, 0.3)
        assert k.router.tracker.load(name)[:3:2] == (1, 0) and k.router.tracker.same_prefix(name, hot) == 0
        k.stream_end(token, 1.0)
        assert k.router.tracker.load(name)[0] == 0


class TestWorkloads:
    def test_storm_and_sessions_run_at_their_utilisation(self) -> None:
        storm = storm_requests(200, 1.0)
        assert sum(r.group == "storm" for r in storm) == 400
        sessions = multiturn_requests(30, 1.0)
        prompts = {tuple(r.blocks) for r in sessions}
        # one system prompt per application
        assert len({tuple(r.blocks[:MT_SYSTEM]) for r in sessions}) == MT_APPS
        for r in sessions:  # a later turn extends its session's last prompt by an answer and a user message
            if len(r.blocks) > MT_SYSTEM + 2:
                assert any(tuple(r.blocks[: len(r.blocks) - n]) in prompts for n in (2, 3))
        cfg = SimConfig(pods=4)
        assert utilisation([r for r in storm if not r.group], cfg) > 0
        res = simulate(storm, cfg, Oracle)
        assert set(res.groups) == {"storm"} and res.groups["storm"]["p90"] > 0


class TestReplicas:
    """Several EPP replicas in the simulation: streams alternate between them; with gossip a pick made by one
    is a speculative hit on the others and its ticket counts in their in-flight load until the stream ends (as
    kvfleet/epp/gossip.py shares them), after the gossip delay; without it each sees only its own."""

    def test_gossip_shares_in_flight_load_until_the_stream_ends(self) -> None:
        p = self.policy(True)
        pod = p.route(req(list(range(2000, 2040))), 0.0)
        name, ticket = p.reps[0].names[pod], p.routed(req([]), pod, 0.0, 1.0)
        own = p.reps[0].router.tracker.load(name)
        assert own[0] == 1 and own[2] == 1
        assert all(rep.router.tracker.load(name) == (0, 0.0, 0) for rep in p.reps[1:])  # in transit
        p._at(0.01)
        assert all(rep.router.tracker.load(name) == own for rep in p.reps[1:])
        p.first_token(ticket, 0.5)
        p._at(0.51)
        assert all(rep.router.tracker.load(name) == (1, 0.0, 0) for rep in p.reps)
        p.stream_end(ticket, 1.0)
        p._at(1.01)
        assert all(rep.router.tracker.load(name) == (0, 0.0, 0) for rep in p.reps)
        quiet = self.policy(False)
        pod = quiet.route(req(list(range(2000, 2040))), 0.0)
        quiet._at(0.01)
        assert all(rep.router.tracker.load(quiet.reps[0].names[pod]) == (0, 0.0, 0) for rep in quiet.reps[1:])

    def policy(self, gossip: bool) -> KvfleetReplicas:
        cfg, pods = cluster(4)
        return KvfleetReplicas(cfg, pods, kvfleet_plugins(1.0, 20.0, seed=0), 0.1, 10.0, 3, gossip)

    def test_gossip_shares_a_pick_with_every_other_replica(self) -> None:
        blocks = list(range(1000, 1040))
        later = KvfleetReplicas.GOSSIP_DELAY_S * 2
        for gossip in (True, False):
            p = self.policy(gossip)
            pod = p.route(req(blocks), 0.0)  # replica 0 picks
            name = p.reps[0].names[pod]
            # in transit
            assert [rep.index.match(blocks, [name], now=0.0).get(name) for rep in p.reps[1:]] == [None, None]
            p._at(later)
            held = [rep.index.match(blocks, [name], now=later).get(name) for rep in p.reps[1:]]
            if gossip:
                assert all(m is not None and m.blocks == 40 and m.speculative == 40 for m in held)
                assert p.route(req(blocks), later) == pod  # replica 1 routes the prefix to the same pod
            else:
                assert held == [None, None]
            assert p.turn == (2 if gossip else 1)
