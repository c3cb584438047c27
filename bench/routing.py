"""bench.routing: discrete-event cluster simulation of routing policies on the Mooncake traces and on
two workloads of its own (a hot-prefix storm, multi-turn sessions).

N pods, each a FIFO prefill server at the cost model's speed with a GPU prefix
cache of C blocks (the trace's 512-token blocks, LRU, a served request's blocks
touched from its end to its beginning: a full cache gives up the end of its least
recently used context first, as vLLM's KV cache manager frees a request's blocks;
tests/interop/test_vllm_eviction.py compares the hits with vLLM's own, request by
request); kvfleet's tiered runs add
CPU and SSD tiers (exclusive, demote on eviction, promote on a hit at the
cost model's read bandwidth). TTFT = queueing + prefill of the uncached suffix
+ tier loads + one decode step; the stream then lasts ``output tokens × itl_s``
(decoding does not occupy the prefill server). Load is stated as utilisation:
``ρ`` = the arrivals' prefill work with no cache hit (plus one decode step each)
÷ (pods × the arrival span); each trace is replayed at the speed that gives the
config's target ``ρ`` (``--rho``), and every config prints ``ρ`` and the
utilisation left at the one-node ideal hit rate (``ρ_ideal``).

Policies (the same arrivals for all):

- ``random``, ``round-robin``, ``least-load`` (fewest requests waiting for their prefill);
- ``gie-approx-prefix``: GIE's approximate prefix scorer (the router's own
  per-pod LRU of the blocks it routed, sized to the pod's cache) weight 3 +
  queue-depth scorer (min-max) 2 + KV-utilisation scorer 2, max score wins;
- ``sglang-cache-aware`` (sglang-router's ``cache_aware`` policy): the router's own
  per-pod prefix tree and running-request counts (+1 at the pick, −1 at the stream's
  end); match rate > 0.3 → the best-matching pod, else the pod with the *smallest
  tree*; when ``max − min running > 64`` and ``max > 1.5·min`` → the least-running pod;
- ``oracle`` (the yardstick, not a peer): sees every pod's true cache (all tiers) and
  queue and picks the minimum TTFT under the simulation's own cost model (greedy;
  ties at random);
- ``kvfleet``: kvfleet's EPP router itself (``kvfleet.epp.router.Router.route_keys``:
  its scheduling profile, :class:`BlockIndex`, in-flight tracker and speculative
  picks, on the simulation's clock), fed by the pods' KV events after
  ``event_delay_s``; its tickets follow the EPP's semantics exactly: opened at
  the pick, ``first_byte`` at the first token (pending work and the hot-spot
  count end), ``close`` at the stream's end (in-flight count ends);
- ``kvfleet-prev`` (``--prev``): the same router with the scorer and hot-spot
  counter before issue 15 (hit gain from the mean queue, hot spots per prefix shard
  counted until the stream's end), for before/after in one run;
- ``NAME-tiered``: a policy on pods with CPU/SSD tiers (kvfleet's tier weights from the cost model).

Workloads: the Mooncake ``conversation`` and ``synthetic`` traces; ``storm`` (background
traffic of application prefixes and unique prompts, and in its middle a burst of 400
requests sharing one 16-block prefix within 2 s); ``multiturn`` (sessions of 2–20
turns over four applications: a 6-block system prompt shared per application, so all
of one application's sessions share a prefix shard, then the session's own history,
each turn extending the last).

Reported per config: token hit rate and its ratio to the one-node ideal (a single LRU
of N·C blocks, infinite compute, arrival order), TTFT p50/mean/p90/p99, p90 ÷ the
oracle's, max/mean busy time over pods. Last line: one JSON object with
``hit_vs_ideal`` (kvfleet GPU-only, worst trace config), ``ttft_vs_best_peer``
(largest kvfleet/best-peer ratio over the trace configs and p50/mean/p90/p99),
``worst_vs_best_peer`` (the same over every config, storm and multi-turn included),
``storm_p90_vs_oracle`` (TTFT p90 of the storm's burst requests, kvfleet ÷ oracle),
``multiturn_hit_vs_ideal``, ``tiered_capacity_gain_p90`` (whole synthetic trace at the
highest load with small GPU caches: kvfleet GPU-only p90 ÷ kvfleet-tiered p90),
``tiered_routing_gain_p90`` (best peer on the same tiered pods p90 ÷ kvfleet-tiered p90;
both gains > 1 mean kvfleet-tiered is faster) and ``tiered_ttft_p90_vs_best_peer``
(kvfleet-tiered p90 ÷ the best GPU-only peer: capacity and routing together).

Every policy runs the same arrivals with the same picker seeds (paired); rows show
means over seeds and the min–max of ``hit / ideal``; the JSON adds ``*_spread``
(mean, min, max, half-width of the 95 % t-interval over seeds) and ``*_at`` (the
config that set the figure). Simulations run on ``--jobs`` worker processes.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import os
import random
import re
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench import _traces as traces
from kvfleet.cache import cost
from kvfleet.cache.tiers import Tier
from kvfleet.config.cache import CacheSettings
from kvfleet.config.epp import CostModelSettings, EppSettings, PluginSpec
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.gossip import PeerApplier, pick_message, ticket_change
from kvfleet.epp.index import BlockIndex, PickOrigin
from kvfleet.epp.inflight import InflightTracker, Ticket, TicketEvent
from kvfleet.epp.podmetrics import MetricsStore, PodMetrics
from kvfleet.epp.router import Router
from kvfleet.epp.scheduling import Candidate, SchedulingRequest
from kvfleet.epp.scheduling.framework import register
from kvfleet.epp.scheduling.plugins import mean_queue_rho
from kvfleet.epp.tokenize import load_tokenizer

BLOCK = traces.TRACE_BLOCK


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster (cost model of an 8B model on one H100 per pod: a faster prefill than the
    product's default profile, :data:`kvfleet.cache.cost.DEFAULT_PREFILL_TOKENS_PER_S`; the rule is the same
    module's)."""

    pods: int = 8
    gpu_blocks: int = 1000
    cpu_blocks: int = 0
    ssd_blocks: int = 0
    prefill_tokens_per_s: float = 16_000.0
    decode_step_s: float = 0.009
    #: inter-token latency while decoding in a batch: a stream lasts ``output tokens × itl_s`` after its first
    #: token
    itl_s: float = 0.025
    kv_bytes_per_token: int = 131_072
    cpu_gbps: float = 20.0
    ssd_gbps: float = 3.0
    event_delay_s: float = 0.02
    seed: int = 0

    @property
    def block_prefill_s(self) -> float:
        return cost.prefill_s(BLOCK, self.prefill_tokens_per_s)

    def load_s(self, tier: Tier) -> float:
        bw = self.cpu_gbps if tier is Tier.CPU else self.ssd_gbps
        return cost.move_s(BLOCK * self.kv_bytes_per_token, bw * 1e9)


@dataclass
class Req:
    arrival: float
    tokens: int
    blocks: list[int]
    #: output tokens (the stream's length after the first token)
    output: int = 0
    #: a workload's request class ("storm": the burst of the storm workload), "" for the rest
    group: str = ""


@dataclass
class SimPod:
    """A pod: exclusive GPU/CPU/SSD LRU tiers and a FIFO prefill server."""

    cfg: SimConfig
    gpu: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cpu: OrderedDict[int, None] = field(default_factory=OrderedDict)
    ssd: OrderedDict[int, None] = field(default_factory=OrderedDict)
    busy_until: float = 0.0
    busy_s: float = 0.0
    outstanding: deque[tuple[float, float]] = field(default_factory=deque)  # (start, finish)

    def predict(self, r: Req, now: float) -> float:
        """The TTFT ``r`` would get here, from the true cache and queue (nothing changes)."""
        cfg = self.cfg
        hit = 0
        load = 0.0
        for b in r.blocks:
            if b in self.gpu:
                pass
            elif b in self.cpu:
                load += cfg.load_s(Tier.CPU)
            elif b in self.ssd:
                load += cfg.load_s(Tier.SSD)
            else:
                break
            hit += 1
        hit_tokens = min(hit * BLOCK, r.tokens)
        return (max(now, self.busy_until) - now + (r.tokens - hit_tokens) / cfg.prefill_tokens_per_s + load
                + cfg.decode_step_s)

    def serve(self, r: Req, now: float) -> tuple[float, int, list[tuple[str, list[int], Tier]]]:
        """Queue ``r``; returns (finish time, hit tokens, KV events the pod emits at finish)."""
        cfg = self.cfg
        start = max(now, self.busy_until)
        hit = 0
        load = 0.0
        events: list[tuple[str, list[int], Tier]] = []
        promoted_cpu: list[int] = []
        promoted_ssd: list[int] = []
        for b in r.blocks:
            if b in self.gpu:
                pass  # touched below, with the rest of the request's blocks
            elif b in self.cpu:
                del self.cpu[b]
                promoted_cpu.append(b)
                load += cfg.load_s(Tier.CPU)
            elif b in self.ssd:
                del self.ssd[b]
                promoted_ssd.append(b)
                load += cfg.load_s(Tier.SSD)
            else:
                break
            hit += 1
        hit_tokens = min(hit * BLOCK, r.tokens)
        service = (r.tokens - hit_tokens) / cfg.prefill_tokens_per_s + load + cfg.decode_step_s
        finish = start + service
        self.busy_until = finish
        self.busy_s += service
        self.outstanding.append((start, finish))
        if promoted_cpu:
            events.append(("removed", promoted_cpu, Tier.CPU))
        if promoted_ssd:
            events.append(("removed", promoted_ssd, Tier.SSD))
        new: list[int] = []
        for b in r.blocks[hit:]:
            if b not in self.gpu:
                new.append(b)
        for b in promoted_cpu + promoted_ssd + new:
            self.gpu[b] = None
        # the request's blocks end up newest at its beginning: an eviction takes the end of the least recently
        # used context first, as vLLM frees a finished request's blocks in reverse order (and SGLang's radix
        # cache evicts leaves); the beginning first, one eviction cut a whole context off its prefix
        gpu = self.gpu
        for b in reversed(r.blocks):
            if b in gpu:
                gpu.move_to_end(b)
        stored = promoted_cpu + promoted_ssd + new
        if stored:
            events.append(("stored", stored, Tier.GPU))
        self._spill(events)
        return finish, hit_tokens, events

    def _spill(self, events: list[tuple[str, list[int], Tier]]) -> None:
        cfg = self.cfg
        tiers = [(self.gpu, cfg.gpu_blocks, Tier.GPU), (self.cpu, cfg.cpu_blocks, Tier.CPU),
                 (self.ssd, cfg.ssd_blocks, Tier.SSD)]
        for i, (cache, cap, tier) in enumerate(tiers):
            if len(cache) <= cap:
                continue
            out: list[int] = []
            while len(cache) > cap:
                b, _ = cache.popitem(last=False)
                out.append(b)
            events.append(("removed", out, tier))
            nxt = next(((c, cp, t) for c, cp, t in tiers[i + 1 :] if cp > 0), None)
            if nxt is not None:
                for b in out:
                    nxt[0][b] = None
                events.append(("stored", out, nxt[2]))

    def waiting_running(self, now: float) -> tuple[int, int]:
        while self.outstanding and self.outstanding[0][1] <= now:
            self.outstanding.popleft()
        waiting = sum(1 for s, _ in self.outstanding if s > now)
        return waiting, len(self.outstanding) - waiting


# --- policies -------------------------------------------------------------------------------


class Policy:
    name = "base"

    def __init__(self, cfg: SimConfig, pods: list[SimPod]) -> None:
        self.cfg, self.pods = cfg, pods
        self.rng = random.Random(cfg.seed)

    def route(self, r: Req, now: float) -> int:
        raise NotImplementedError

    def routed(self, r: Req, pod: int, now: float, finish: float) -> Any:
        """Bookkeeping after the pick (the router's own view); returns a token for :meth:`first_token`
        and :meth:`stream_end`."""
        return pod

    def first_token(self, token: Any, now: float) -> None:
        """The request's first token came back (its prefill is done)."""

    def stream_end(self, token: Any, now: float) -> None:
        """The request's stream ended (its last token came back)."""

    def on_events(self, pod: int, events: list[tuple[str, list[int], Tier]]) -> None:
        pass

    def least_loaded(self, now: float) -> int:
        loads = [len(p.outstanding) for p in self.pods]
        lo = min(loads)
        return self.rng.choice([i for i, v in enumerate(loads) if v == lo])


class RandomPolicy(Policy):
    name = "random"

    def route(self, r: Req, now: float) -> int:
        return self.rng.randrange(len(self.pods))


class RoundRobin(Policy):
    name = "round-robin"
    _i = 0

    def route(self, r: Req, now: float) -> int:
        self._i = (self._i + 1) % len(self.pods)
        return self._i


class LeastLoad(Policy):
    name = "least-load"

    def route(self, r: Req, now: float) -> int:
        for p in self.pods:
            p.waiting_running(now)
        return self.least_loaded(now)


class Oracle(Policy):
    """The yardstick: every pod's true cache (all tiers) and queue; the minimum TTFT under the
    simulation's own cost model (:meth:`SimPod.predict`), ties at random."""

    name = "oracle"

    def route(self, r: Req, now: float) -> int:
        best: list[int] = []
        best_t = float("inf")
        for i, p in enumerate(self.pods):
            t = p.predict(r, now)
            if t < best_t - 1e-12:
                best, best_t = [i], t
            elif t <= best_t + 1e-12:
                best.append(i)
        return best[0] if len(best) == 1 else self.rng.choice(best)


class _RouterLRU:
    """The router's own per-pod record of routed blocks (LRU, capacity in blocks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: Sequence[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.blocks:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self.blocks)


class GieApproxPrefix(Policy):
    name = "gie-approx-prefix"

    def __init__(self, cfg: SimConfig, pods: list[SimPod]) -> None:
        super().__init__(cfg, pods)
        # the plugin's per-server LRU is sized to the pod's cache (every tier: what an operator would
        # configure)
        self.lru = [_RouterLRU(cfg.gpu_blocks + cfg.cpu_blocks + cfg.ssd_blocks) for _ in pods]

    def route(self, r: Req, now: float) -> int:
        n = max(1, len(r.blocks))
        wr = [p.waiting_running(now) for p in self.pods]
        qs = [w for w, _ in wr]
        qmin, qmax = min(qs), max(qs)
        best, best_s = [], -1e18
        for i, p in enumerate(self.pods):
            prefix = self.lru[i].match(r.blocks) / n
            queue = 1.0 if qmax == qmin else (qmax - qs[i]) / (qmax - qmin)
            kv = 1.0 - len(p.gpu) / self.cfg.gpu_blocks
            s = 3 * prefix + 2 * queue + 2 * kv
            if s > best_s + 1e-12:
                best, best_s = [i], s
            elif abs(s - best_s) <= 1e-12:
                best.append(i)
        return self.rng.choice(best)

    def routed(self, r: Req, pod: int, now: float, finish: float) -> int:
        self.lru[pod].insert(r.blocks)
        return pod


class SglangCacheAware(Policy):
    """sglang-router's ``cache_aware`` policy: imbalanced running counts → the least-running pod; else
    match rate > ``cache_threshold`` → the pod of the longest match, else the pod with the smallest tree.
    Running counts are the router's own (+1 at the pick, −1 at the stream's end)."""

    name = "sglang-cache-aware"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5

    def __init__(self, cfg: SimConfig, pods: list[SimPod]) -> None:
        super().__init__(cfg, pods)
        self.tree = [_RouterLRU(1 << 15) for _ in pods]
        self.running = [0] * len(pods)

    def route(self, r: Req, now: float) -> int:
        run = self.running
        lo, hi = min(run), max(run)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return self.rng.choice([i for i, v in enumerate(run) if v == lo])
        n = max(1, len(r.blocks))
        matches = [t.match(r.blocks) for t in self.tree]
        m = max(matches)
        if m / n > self.cache_threshold:
            return self.rng.choice([i for i, v in enumerate(matches) if v == m])
        sizes = [len(t) for t in self.tree]
        small = min(sizes)
        return self.rng.choice([i for i, v in enumerate(sizes) if v == small])

    def routed(self, r: Req, pod: int, now: float, finish: float) -> int:
        self.tree[pod].insert(r.blocks)
        self.running[pod] += 1
        return pod

    def stream_end(self, token: Any, now: float) -> None:
        self.running[token] -= 1


class Kvfleet(Policy):
    """kvfleet's EPP :class:`~kvfleet.epp.router.Router` itself (its profile, :class:`BlockIndex`,
    :class:`InflightTracker` and speculative picks), on the simulation's clock, fed by the pods' KV events."""

    name = "kvfleet"

    def __init__(
        self, cfg: SimConfig, pods: list[SimPod], plugins: Sequence[PluginSpec], hotspot_beta: float,
        spec_ttl_s: float, prev: bool = False,
    ) -> None:
        super().__init__(cfg, pods)
        self.now = 0.0
        self.names = [f"pod-{i}" for i in range(len(pods))]
        self.pos = {n: i for i, n in enumerate(self.names)}
        cost = CostModelSettings(
            prefill_tokens_per_s=cfg.prefill_tokens_per_s, kv_bytes_per_token=cfg.kv_bytes_per_token,
            cpu_gbps=cfg.cpu_gbps, ssd_gbps=cfg.ssd_gbps, remote_gbps=cfg.ssd_gbps / 2,
        )
        settings = EppSettings(plugins=tuple(plugins), hotspot_beta=hotspot_beta,
                               speculative_ttl_s=spec_ttl_s, cost=cost)
        # every pod publishes KV events (the simulation delivers them): picks count as cached for
        # speculative_ttl_s after their first token, not the approximate mode's approximate_ttl_s
        data = {"pools": [{"name": "pool", "models": ["m"], "pods": [
            {"name": n, "address": "10.0.0.1", "port": 8000 + i, "events": f"tcp://10.0.0.1:{5557 + i}"}
            for i, n in enumerate(self.names)]}]}
        clock = lambda: self.now  # noqa: E731
        self.index = BlockIndex(clock=clock)
        cls = PrevRouter if prev else Router
        self.router = cls(
            settings, CacheSettings(block_size=BLOCK), StaticDatastore(data=data), self.index,
            MetricsStore(clock=clock), load_tokenizer("bytes"),
            InflightTracker(clock=clock, hot_until_close=prev),
        )
        self._last: Any = None
        self._next_scrape = 0.0

    def scrape(self, now: float) -> None:
        """The EPP's metrics scrape (every ``SCRAPE_S``, as ``epp.scrape_interval_s``): each pod's waiting and
        running requests and KV usage, as vLLM reports them, into the router's metrics store."""
        if now < self._next_scrape:
            return
        for name, pod in zip(self.names, self.pods, strict=True):
            waiting, running = pod.waiting_running(now)
            usage = len(pod.gpu) / max(1, self.cfg.gpu_blocks)
            self.router.metrics.put(name, PodMetrics(waiting=waiting, running=running, kv_usage=usage,
                                                     block_size=BLOCK, num_gpu_blocks=self.cfg.gpu_blocks,
                                                     scraped_at=now))
        self._next_scrape = now + SCRAPE_S

    def route(self, r: Req, now: float) -> int:
        self.now = now
        self.scrape(now)
        d = self.router.route_keys("m", r.blocks, r.tokens)
        self._last = d.ticket
        return self.pos[d.pod]

    def routed(self, r: Req, pod: int, now: float, finish: float) -> Any:
        return self._last

    def first_token(self, token: Any, now: float) -> None:
        self.now = now
        token.first_byte()  # as the EPP on response headers: pending work ends, the speculative TTL starts

    def stream_end(self, token: Any, now: float) -> None:
        self.now = now
        token.close()  # as the EPP at the stream's end: the in-flight count ends

    def on_events(self, pod: int, events: list[tuple[str, list[int], Tier]]) -> None:
        name = self.names[pod]
        for kind, keys, tier in events:
            if kind == "stored":
                self.index.add(name, keys, tier)
            else:
                self.index.remove(name, keys, tier)


#: the EPP's metrics scrape interval (``epp.scrape_interval_s``), in simulated seconds
SCRAPE_S = 0.5


class KvfleetReplicas(Policy):
    """``n`` kvfleet pickers behind one gateway (active-active EPP replicas): streams go to them round-robin,
    as Envoy spreads them; each has its own index, speculative picks and in-flight tickets (its own view of
    the load); every pod's KV events reach all of them. With ``gossip`` every pick and every change of a
    ticket (open, first token, close) reaches the others ``GOSSIP_DELAY_S`` later through the EPP's own
    receiving side (kvfleet/epp/gossip.py's :class:`PeerApplier`): a peer's pick lives as its picker's own
    (until its ticket's first token, then the speculative TTL) and carries its follow-up sample; a ticket
    becomes a peer's ticket in their in-flight trackers."""

    GOSSIP_TTL_S = 30.0
    #: a gossip message's delivery delay (sim seconds): a pick or ticket change reaches the other replicas
    #: this much later. The EPP sends a decision's changes as it makes the pick and a replica applies its
    #: peers' messages before each decision (epp/gossip.py); ``python -m bench.gossip`` measures pick to
    #: application at p50 0.6 ms under Poisson decisions and 1.5 ms in bursts of back-to-back decisions on
    #: two shared cores (p90 1.6 and 4.2 ms; the release before: p50 1.2 and 3.8 ms, p90 2.2 and 10 ms,
    #: and this simulation assumed 2 ms)
    GOSSIP_DELAY_S = 0.001

    def __init__(self, cfg: SimConfig, pods: list[SimPod], plugins: Sequence[PluginSpec], hotspot_beta: float,
                 spec_ttl_s: float, n: int, gossip: bool) -> None:
        super().__init__(cfg, pods)
        self.reps = [Kvfleet(cfg, pods, plugins, hotspot_beta, spec_ttl_s) for _ in range(n)]
        self.turn = 0
        self.now = 0.0
        self._last: Any = None
        self._mail: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        if gossip:
            # each replica receives through the EPP's own receiving side (epp/gossip.py's PeerApplier), the
            # messages built as its publisher builds them
            appliers = [PeerApplier(o.index, o.router.tracker, lambda pod: True, self.GOSSIP_TTL_S,
                                    o.router.director.pick_ttl_of, o.router.director.peer_followup)
                        for o in self.reps]
            for i, rep in enumerate(self.reps):
                others = [a for j, a in enumerate(appliers) if j != i]

                def share(pod: str, sampled: list[int], blocks: int, origin: PickOrigin | None,
                          others: list[PeerApplier] = others, name: str = str(i)) -> None:
                    pick = pick_message(pod, sampled, blocks, origin)

                    def deliver() -> None:
                        for a in others:
                            a.pick(name, pick)
                    self._send(deliver)

                def tickets(event: TicketEvent, t: Ticket, moved: tuple[str, str] | None,
                            others: list[PeerApplier] = others, name: str = str(i)) -> None:
                    change = ticket_change(event, t, moved)

                    def deliver() -> None:
                        for a in others:
                            a.ticket(name, change)
                    self._send(deliver)

                rep.index.on_pick = share
                rep.router.tracker.on_ticket = tickets

    def _send(self, deliver: Callable[[], None]) -> None:
        heapq.heappush(self._mail, (self.now + self.GOSSIP_DELAY_S, next(self._seq), deliver))

    def _at(self, now: float) -> None:
        while self._mail and self._mail[0][0] <= now:
            at, _, deliver = heapq.heappop(self._mail)
            for rep in self.reps:
                rep.now = at
            deliver()
        self.now = now
        for rep in self.reps:
            rep.now = now

    def route(self, r: Req, now: float) -> int:
        self._at(now)
        rep = self.reps[self.turn % len(self.reps)]
        self.turn += 1
        pod = rep.route(r, now)
        self._last = rep._last
        return pod

    def routed(self, r: Req, pod: int, now: float, finish: float) -> Any:
        return self._last

    def first_token(self, token: Any, now: float) -> None:
        self._at(now)
        token.first_byte()

    def stream_end(self, token: Any, now: float) -> None:
        self._at(now)
        token.close()

    def on_events(self, pod: int, events: list[tuple[str, list[int], Tier]]) -> None:
        for rep in self.reps:
            rep.on_events(pod, events)


class PrevRouter(Router):
    """The router before issue 15: hot spots counted per prefix shard (with the tracker's
    ``hot_until_close``: until the stream's end)."""

    def hotspot_key(self, keys: Sequence[int], longest: int, shard: int) -> int:
        return shard


@register("prefix-cache-scorer-prev", "scorer")
class PrevPrefixCacheScorer:
    """The prefix-cache scorer before issue 15 (for comparisons): the hit gain ``1 + g·ρ`` with
    ``ρ = q̄ / (q̄ + prefill_s)`` and ``q̄`` the candidates' *mean* queued prefill seconds."""

    def __init__(self, params: Mapping[str, float]) -> None:
        self.beta = params.get("beta")
        self.load_gain = float(params.get("load_gain", 20.0))

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        beta = req.hotspot_beta if self.beta is None else float(self.beta)
        unit = req.block_size * req.prefill_s_per_token
        if self.load_gain:
            unit *= 1.0 + self.load_gain * mean_queue_rho(req, cands)
        return [c.hit_weighted * unit / (1.0 + beta * c.same_prefix) for c in cands]


# --- the simulation -------------------------------------------------------------------------


def _quantiles(x: np.ndarray) -> dict[str, float]:
    if not len(x):
        return {"p50": 0.0, "mean": 0.0, "p90": 0.0, "p99": 0.0}
    return {"p50": float(np.percentile(x, 50)), "mean": float(x.mean()),
            "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99))}


@dataclass
class Result:
    policy: str
    hit_rate: float
    ttft: dict[str, float]
    load_max_over_mean: float
    seconds: float
    #: TTFT quantiles of each named request group (``Req.group``), e.g. the storm's burst
    groups: dict[str, dict[str, float]] = field(default_factory=dict)


#: event kinds, in the order they run at one instant: KV events, first tokens, stream ends
_EVENTS, _FIRST, _END = 0, 1, 2


def simulate(reqs: list[Req], cfg: SimConfig, make: Callable[[SimConfig, list[SimPod]], Policy]) -> Result:
    t0 = time.perf_counter()
    pods = [SimPod(cfg) for _ in range(cfg.pods)]
    pol = make(cfg, pods)
    heap: list[tuple[float, int, int, Any]] = []  # (time, kind, seq, payload)
    seq = 0
    ttft = np.empty(len(reqs))
    hit_tokens = 0
    total_tokens = 0
    for k, r in enumerate(reqs):
        now = r.arrival
        while heap and heap[0][0] <= now:
            t, kind, _, payload = heapq.heappop(heap)
            if kind == _EVENTS:
                pol.on_events(*payload)
            elif kind == _FIRST:
                pol.first_token(payload, t)
            else:
                pol.stream_end(payload, t)
        i = pol.route(r, now)
        finish, hit, events = pods[i].serve(r, now)
        token = pol.routed(r, i, now, finish)
        heapq.heappush(heap, (finish, _FIRST, seq, token))
        heapq.heappush(heap, (finish + r.output * cfg.itl_s, _END, seq + 1, token))
        seq += 2
        if events:
            heapq.heappush(heap, (finish + cfg.event_delay_s, _EVENTS, seq, (i, events)))
            seq += 1
        ttft[k] = finish - now
        hit_tokens += hit
        total_tokens += r.tokens
    busy = np.array([p.busy_s for p in pods])
    names = sorted({r.group for r in reqs} - {""})
    groups = {g: _quantiles(ttft[np.array([r.group == g for r in reqs])]) for g in names}
    return Result(
        policy=pol.name,
        hit_rate=hit_tokens / max(1, total_tokens),
        ttft=_quantiles(ttft),
        load_max_over_mean=float(busy.max() / max(1e-9, busy.mean())),
        seconds=time.perf_counter() - t0,
        groups=groups,
    )


@dataclass(frozen=True)
class Stat:
    """One metric over seeds: mean, min, max and the half-width of its 95 % t-interval (0 with one seed)."""

    mean: float = 0.0
    lo: float = 0.0
    hi: float = 0.0
    ci95: float = 0.0

    @staticmethod
    def of(values: Sequence[float]) -> Stat:
        v = np.asarray(values, dtype=float)
        n = len(v)
        half = float(_T95[min(n - 1, len(_T95) - 1)] * v.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
        return Stat(float(v.mean()), float(v.min()), float(v.max()), half)

    def js(self, nd: int = 4) -> dict[str, float]:
        return {"mean": round(self.mean, nd), "min": round(self.lo, nd), "max": round(self.hi, nd),
                "ci95": round(self.ci95, nd)}


#: Student's t 97.5 % quantiles by degrees of freedom (index 0 unused), then the normal value
_T95 = (0.0, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 1.96)


@dataclass
class Runs:
    """One policy's runs on one config, one :class:`Result` per seed (seed ``k`` is the ``k``-th entry for
    every policy: the same arrivals and the same seed, so ratios between policies are paired)."""

    policy: str
    results: list[Result]

    def hit(self) -> Stat:
        return Stat.of([r.hit_rate for r in self.results])

    def ttft(self, q: str) -> Stat:
        return Stat.of([r.ttft[q] for r in self.results])

    def group(self, g: str, q: str) -> Stat:
        """``q`` of request group ``g`` (e.g. the storm's burst)."""
        return Stat.of([r.groups[g][q] for r in self.results])

    def per_seed(self, q: str, n: int) -> list[float]:
        """``q`` for seeds ``0 … n − 1`` (a deterministic policy ran once: its value repeats)."""
        return [self.results[min(k, len(self.results) - 1)].ttft[q] for k in range(n)]

    def load(self) -> float:
        return float(np.mean([r.load_max_over_mean for r in self.results]))


def ideal_hits(reqs: list[Req], capacity: int) -> list[int]:
    """Each request's hit tokens on one node with one LRU of ``capacity`` blocks, infinite compute, arrival
    order."""
    lru: OrderedDict[int, None] = OrderedDict()
    out = []
    for r in reqs:
        hit = 0
        for b in r.blocks:
            if b not in lru:
                break
            hit += 1
        for b in reversed(r.blocks):  # newest-first from the head, as the pods evict (SimPod.serve)
            lru[b] = None
            lru.move_to_end(b)
        while len(lru) > capacity:
            lru.popitem(last=False)
        out.append(min(hit * BLOCK, r.tokens))
    return out


def ideal_hit_rate(reqs: list[Req], capacity: int) -> float:
    """The one-node ideal's token hit rate (:func:`ideal_hits`)."""
    return sum(ideal_hits(reqs, capacity)) / max(1, sum(r.tokens for r in reqs))


def utilisation(reqs: list[Req], cfg: SimConfig, hits: Sequence[int] | None = None) -> float:
    """ρ: the arrivals' prefill work (uncached tokens: all of them, or all but ``hits``) plus one decode
    step each, ÷ (pods × the arrival span)."""
    if len(reqs) < 2:
        return 0.0
    tokens = sum(r.tokens for r in reqs) - (sum(hits) if hits is not None else 0)
    work = tokens / cfg.prefill_tokens_per_s + len(reqs) * cfg.decode_step_s
    return work / (cfg.pods * max(1e-9, reqs[-1].arrival - reqs[0].arrival))


def load_requests(name: str, limit: int | None, speed: float, offset: int = 0) -> list[Req]:
    """Rows ``offset … offset + limit`` of a trace, arrivals from the slice's first row, ``speed``× the trace
    rate."""
    rows = traces.load(name, None if limit is None else offset + limit)[offset:]
    if not rows:
        raise SystemExit(f"bench.routing: trace {name!r} has no rows from {offset}")
    t0 = rows[0].timestamp_ms
    return [Req(arrival=(row.timestamp_ms - t0) / 1000.0 / speed, tokens=row.input_length,
                blocks=list(row.hash_ids), output=row.output_length) for row in rows]


def _tokens(rng: random.Random, blocks: int) -> int:
    """A prompt of ``blocks`` blocks whose last block is partly filled."""
    return blocks * BLOCK - rng.randrange(BLOCK // 2)


#: the storm's burst: requests, the shared prefix (blocks) and the window they arrive in (s)
STORM_N, STORM_PREFIX, STORM_WINDOW_S = 400, 16, 2.0


def storm_requests(background: int, speed: float, seed: int = 15) -> list[Req]:
    """Background traffic (Poisson, 1 request/s × ``speed``: 60 % start with one of 20 application prefixes
    of 2–12 blocks, Zipf popularity, then 1–10 blocks of their own; the rest 1–16 unique blocks) and, at the
    middle of it, a burst of :data:`STORM_N` requests (group ``storm``) sharing one prefix of
    :data:`STORM_PREFIX` blocks plus one block of their own, arriving within :data:`STORM_WINDOW_S` s
    (the burst does not scale with ``speed``)."""
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 62))
    apps = [[next(ids) for _ in range(rng.randint(2, 12))] for _ in range(20)]
    popularity = [1.0 / (k + 1) for k in range(len(apps))]
    out: list[Req] = []
    t = 0.0
    for _ in range(background):
        t += rng.expovariate(speed)
        if rng.random() < 0.6:
            blocks = list(rng.choices(apps, popularity)[0]) + [next(ids) for _ in range(rng.randint(1, 10))]
        else:
            blocks = [next(ids) for _ in range(rng.randint(1, 16))]
        out.append(Req(t, _tokens(rng, len(blocks)), blocks, output=rng.randint(50, 500)))
    prefix = [next(ids) for _ in range(STORM_PREFIX)]
    start = t / 2
    for _ in range(STORM_N):
        blocks = [*prefix, next(ids)]
        out.append(Req(start + rng.uniform(0, STORM_WINDOW_S), _tokens(rng, len(blocks)), blocks,
                       output=rng.randint(100, 300), group="storm"))
    out.sort(key=lambda r: r.arrival)
    return out


#: the multi-turn workload: applications, their system prompt (blocks), turns per session
MT_APPS, MT_SYSTEM, MT_TURNS = 4, 6, (2, 20)


def multiturn_requests(sessions: int, speed: float, seed: int = 15, itl_s: float = 0.025) -> list[Req]:
    """``sessions`` chat sessions starting as a Poisson process (0.5 per second × ``speed``), each of
    2–20 turns (geometric, mean ≈ 7) in one of :data:`MT_APPS` applications whose
    :data:`MT_SYSTEM`-block system prompt opens every prompt (so one application's sessions share a
    prefix shard). A turn's prompt is the last turn's prompt, its answer (1 block) and a new user
    message (1–2 blocks); the next turn arrives after the answer's stream and a think time
    (exponential, mean 20 s); all times ÷ ``speed``."""
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 62))
    system = [[next(ids) for _ in range(MT_SYSTEM)] for _ in range(MT_APPS)]
    out: list[Req] = []
    start = 0.0
    lo, hi = MT_TURNS
    for _ in range(sessions):
        start += rng.expovariate(0.5)
        blocks = list(rng.choice(system))
        t = start
        turns = lo
        while turns < hi and rng.random() < 1 - 1 / 6:
            turns += 1
        for k in range(turns):
            if k:
                blocks.append(next(ids))  # the last answer
            blocks.extend(next(ids) for _ in range(rng.randint(1, 2)))
            output = rng.randint(150, 500)
            out.append(Req(t / speed, _tokens(rng, len(blocks)), list(blocks), output=output))
            t += 1.0 + output * itl_s + rng.expovariate(1 / 20.0)
    out.sort(key=lambda r: r.arrival)
    return out


def kvfleet_plugins(
    hit_weight: float = 1.0, load_gain: float = 0.0, kv_weight: float = 0.05, overhead_s: float = 0.009,
    seed: int = 0, affinity_s: float = 0.02, prev: bool = False,
) -> list[PluginSpec]:
    return [
        PluginSpec(type="prefix-cache-scorer-prev" if prev else "prefix-cache-scorer", weight=hit_weight,
                   params={"load_gain": load_gain}),
        # the simulation has no decode interference; each request costs one decode step
        PluginSpec(type="queue-scorer", weight=1.0, params={"running_s": 0.0, "overhead_s": overhead_s}),
        PluginSpec(type="kv-cache-utilization-scorer", weight=kv_weight),
        PluginSpec(type="prefix-affinity-scorer", weight=1.0, params={"affinity_s": affinity_s}),
        PluginSpec(type="eviction-cost-scorer", weight=1.0),
        PluginSpec(type="recompute-load-scorer", weight=1.0),
        PluginSpec(type="copy-value-scorer", weight=1.0),
        PluginSpec(type="max-score-picker", params={"fallbacks": 0, "seed": seed}),
    ]


def peers() -> dict[str, Callable[[SimConfig, list[SimPod]], Policy]]:
    return {
        "random": RandomPolicy,
        "round-robin": RoundRobin,
        "least-load": LeastLoad,
        "gie-approx-prefix": GieApproxPrefix,
        "sglang-cache-aware": SglangCacheAware,
    }


#: policies whose routing uses no random numbers: one run stands for every seed
DETERMINISTIC = frozenset({"round-robin", "round-robin-tiered"})
#: the yardstick (not a peer)
ORACLE = "oracle"


@dataclass(frozen=True)
class Knobs:
    """kvfleet's settings under test (the EPP's defaults unless overridden on the command line)."""

    hit_weight: float = 1.0
    load_gain: float = 0.0
    affinity_s: float = 0.02
    beta: float = 0.1
    spec_ttl_s: float = 10.0


def is_kvfleet(name: str) -> bool:
    return name.removesuffix("-tiered") in ("kvfleet", "kvfleet-prev")


#: one kvfleet picker whose ties break on another random sequence (its picker seeded ``seed + RESEED``):
#: how far a single picker's figures move with nothing but its tie-breaks changed, the yardstick for
#: replicas (``bench.routing --family``)
RESEEDED = "kvfleet-reseeded"
RESEED = 1_000_003
#: ``kvfleet-x3``: three EPP replicas sharing their picks; ``kvfleet-x3-nogossip``: each keeping its own
_REPLICAS = re.compile(r"kvfleet-x(\d+)(-nogossip)?")


def make_policy(name: str, knobs: Knobs) -> Callable[[SimConfig, list[SimPod]], Policy]:
    """The policy ``name``; a ``-tiered`` suffix names the same policy (its config gets the tiers)."""
    base = name.removesuffix("-tiered")
    if base in peers() or base == ORACLE:
        cls = peers().get(base, Oracle)

        def build_peer(cfg: SimConfig, pods: list[SimPod]) -> Policy:
            p = cls(cfg, pods)
            p.name = name
            return p

        return build_peer
    if (m := _REPLICAS.fullmatch(name)) is not None:
        n, gossip = int(m.group(1)), m.group(2) is None

        def build_replicas(cfg: SimConfig, pods: list[SimPod]) -> Policy:
            plugins = kvfleet_plugins(knobs.hit_weight, knobs.load_gain, seed=cfg.seed,
                                      affinity_s=knobs.affinity_s)
            p = KvfleetReplicas(cfg, pods, plugins, knobs.beta, knobs.spec_ttl_s, n, gossip)
            p.name = name
            return p

        return build_replicas
    reseeded = name == RESEEDED
    if not is_kvfleet(name) and not reseeded:
        raise ValueError(f"unknown policy {name!r}; "
                         f"known: {', '.join([*peers(), ORACLE, 'kvfleet', 'kvfleet-prev'])} "
                         f"(each also with -tiered), kvfleet-xN[-nogossip], {RESEEDED}")
    prev = base == "kvfleet-prev"

    def build(cfg: SimConfig, pods: list[SimPod]) -> Policy:
        seed = cfg.seed + RESEED if reseeded else cfg.seed
        plugins = kvfleet_plugins(knobs.hit_weight, knobs.load_gain, seed=seed,
                                  affinity_s=knobs.affinity_s, prev=prev)
        p = Kvfleet(cfg, pods, plugins, knobs.beta, knobs.spec_ttl_s, prev=prev)
        p.name = name
        return p

    return build


@dataclass(frozen=True)
class Workload:
    """A slice of a trace (or a generated workload: ``storm``, ``multiturn``; ``limit`` = background
    requests / sessions) replayed at ``speed``× its rate."""

    trace: str
    limit: int | None
    offset: int
    speed: float


GENERATED = ("storm", "multiturn")
#: background requests of the storm, sessions of the multi-turn workload (quick, full)
GENERATED_SIZE = {"storm": (2000, 4000), "multiturn": (400, 800)}


@functools.lru_cache(maxsize=16)
def _requests(w: Workload) -> list[Req]:
    if w.trace == "storm":
        return storm_requests(w.limit or GENERATED_SIZE["storm"][1], w.speed)
    if w.trace == "multiturn":
        return multiturn_requests(w.limit or GENERATED_SIZE["multiturn"][1], w.speed)
    return load_requests(w.trace, w.limit, w.speed, w.offset)


def at_utilisation(w: Workload, cfg: SimConfig, rho: float) -> Workload:
    """``w`` at the speed whose no-cache utilisation (:func:`utilisation`) is ``rho`` on ``cfg``'s pods
    (for the storm: its background's)."""
    reqs = [r for r in _requests(replace(w, speed=1.0)) if r.group != "storm"]
    return replace(w, speed=round(rho / utilisation(reqs, cfg), 4))


def run_one(task: tuple[Workload, SimConfig, str, Knobs]) -> Result:
    """One simulation (a unit of work for the process pool): workload, cluster with its seed, policy."""
    w, cfg, name, knobs = task
    return simulate(_requests(w), cfg, make_policy(name, knobs))


def run_all(tasks: list[tuple[Workload, SimConfig, str, Knobs]], jobs: int) -> list[Result]:
    """Every task, in order; ``jobs`` processes (the simulation is single-threaded Python)."""
    if jobs <= 1:
        return [run_one(t) for t in tasks]
    order = sorted(range(len(tasks)), key=lambda i: -len(_requests(tasks[i][0])))  # long workloads first
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        done = dict(zip(order, ex.map(run_one, [tasks[i] for i in order], chunksize=1), strict=True))
    return [done[i] for i in range(len(tasks))]


@dataclass(frozen=True)
class Config:
    """One simulated config: its workload, cluster, kind (``grid`` trace config, ``storm``, ``multiturn``,
    ``tiered`` headline), target utilisation and label."""

    workload: Workload
    cluster: SimConfig
    kind: str
    rho: float

    @property
    def label(self) -> str:
        return f"{self.workload.trace} ρ={self.rho:g} gpu={self.cluster.gpu_blocks}/pod"


def tiers_of(cfg: SimConfig) -> SimConfig:
    return replace(cfg, cpu_blocks=4 * cfg.gpu_blocks, ssd_blocks=16 * cfg.gpu_blocks)


def _best(runs: Sequence[Runs], q: str) -> Runs:
    return min(runs, key=lambda r: r.ttft(q).mean)


def replica_figures(configs: Sequence[Config], by_config: Sequence[dict[str, Runs]],
                    n: int) -> dict[str, Any]:
    """``n`` EPP replicas against one, with and without pick gossip: the lowest hit ratio and the highest TTFT
    p90 ratio over the configs that ran them (paired seeds)."""
    out: dict[str, Any] = {}
    print(f"\n{n} EPP replicas against one (hit ratio, TTFT p90 ratio; paired seeds):")
    for variant, suffix in (("", ""), ("-nogossip", "_nogossip")):
        hits: list[float] = []
        p90s: list[float] = []
        for c, runs in zip(configs, by_config, strict=True):
            one, many = runs.get("kvfleet"), runs.get(f"kvfleet-x{n}{variant}")
            if one is None or many is None:
                continue
            h = many.hit().mean / max(one.hit().mean, 1e-9)
            t = many.ttft("p90").mean / max(one.ttft("p90").mean, 1e-9)
            hits.append(h)
            p90s.append(t)
            print(f"  {c.label:<40} {'gossip' if not variant else 'no gossip':<10} hit × {h:.3f}  "
                  f"p90 × {t:.3f}")
        if hits:
            out[f"replicas{n}_hit_vs_1{suffix}"] = round(min(hits), 4)
            out[f"replicas{n}_p90_vs_1{suffix}"] = round(max(p90s), 4)
    return out


def figures(configs: Sequence[Config], by_config: Sequence[dict[str, Runs]], kv: str) -> dict[str, Any]:
    """The JSON figures of kvfleet variant ``kv`` (``kvfleet`` or ``kvfleet-prev``)."""
    out: dict[str, Any] = {}
    hit_stats: list[tuple[Stat, str]] = []
    ratios: list[tuple[float, Stat, str, str]] = []  # (ratio, paired spread, where, config kind)
    vs_oracle: list[tuple[float, str]] = []
    for c, runs in zip(configs, by_config, strict=True):
        reqs = _requests(c.workload)
        if c.kind == "tiered":
            tiered = runs[f"{kv}-tiered"].ttft("p90").mean
            gpu_peers = [r for n, r in runs.items() if n in peers()]
            tiered_peers = [r for n, r in runs.items()
                            if n.removesuffix("-tiered") in peers() and n.endswith("-tiered")]
            out["tiered_capacity_gain_p90"] = round(runs[kv].ttft("p90").mean / tiered, 4)
            out["tiered_routing_gain_p90"] = round(_best(tiered_peers, "p90").ttft("p90").mean / tiered, 4)
            out["tiered_routing_gain_p90_at"] = f"{c.label} vs {_best(tiered_peers, 'p90').policy}"
            out["tiered_ttft_p90_vs_best_peer"] = round(tiered / _best(gpu_peers, "p90").ttft("p90").mean, 4)
            continue
        k = runs[kv]
        peer_runs = [r for n, r in runs.items() if n in peers()]
        nseeds = max(len(r.results) for r in runs.values())
        ideal = ideal_hit_rate(reqs, c.cluster.pods * c.cluster.gpu_blocks)
        rel = Stat.of([r.hit_rate / ideal if ideal > 0 else 1.0 for r in k.results])
        if c.kind == "grid":
            hit_stats.append((rel, c.label))
        if c.kind == "multiturn":
            out["multiturn_hit_vs_ideal"] = round(rel.mean, 4)
            out["multiturn_hit_vs_ideal_spread"] = rel.js()
        if c.kind == "storm":
            orc = runs[ORACLE]
            out["storm_p90_vs_oracle"] = round(
                k.group("storm", "p90").mean / orc.group("storm", "p90").mean, 4)
            out["storm_p90_vs_oracle_spread"] = Stat.of(
                [a.groups["storm"]["p90"] / b.groups["storm"]["p90"]
                 for a, b in zip(k.results, orc.results, strict=True)]).js()
            out["storm_p90_s"] = {n: round(r.group("storm", "p90").mean, 3) for n, r in runs.items()}
        if ORACLE in runs:
            vs_oracle.append((k.ttft("p90").mean / runs[ORACLE].ttft("p90").mean, c.label))
        for q in ("p50", "mean", "p90", "p99"):
            # the best peer on seed-averaged values; the spread from the paired per-seed ratios against it
            best = _best(peer_runs, q)
            ratio = k.ttft(q).mean / best.ttft(q).mean
            paired = Stat.of([a / b for a, b in zip(k.per_seed(q, nseeds), best.per_seed(q, nseeds),
                                                    strict=True)])
            ratios.append((ratio, paired, f"{c.label} {q} vs {best.policy}", c.kind))
    if hit_stats:
        worst_hit, worst_hit_at = min(hit_stats, key=lambda x: x[0].mean)
        out |= {"hit_vs_ideal": round(worst_hit.mean, 4), "hit_vs_ideal_spread": worst_hit.js(),
                "hit_vs_ideal_at": worst_hit_at}
    grid = [x for x in ratios if x[3] == "grid"]
    if grid:
        r, paired, at, _ = max(grid, key=lambda x: x[0])
        out |= {"ttft_vs_best_peer": round(r, 4), "ttft_vs_best_peer_spread": paired.js(),
                "ttft_vs_best_peer_at": at}
    if ratios:
        r, paired, at, _ = max(ratios, key=lambda x: x[0])
        out |= {"worst_vs_best_peer": round(r, 4), "worst_vs_best_peer_spread": paired.js(),
                "worst_vs_best_peer_at": at}
    if vs_oracle:
        r2, at2 = max(vs_oracle)
        out |= {"p90_vs_oracle": round(r2, 4), "p90_vs_oracle_at": at2}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true",
                    help="a prefix of each trace, smaller generated workloads, GPU-only grid")
    ap.add_argument("--pods", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=0,
                    help="runs per policy (picker seeds: random tie-breaks), paired across policies; "
                         "default 8 quick, 12 full")
    ap.add_argument("--jobs", type=int, default=0,
                    help="worker processes (default: the CPU count, at most 4)")
    ap.add_argument("--rho", type=str, default="0.3,0.55,0.8",
                    help="target utilisations of the trace configs (no-cache prefill work ÷ capacity)")
    ap.add_argument("--storm-rho", type=float, default=0.5,
                    help="utilisation of the storm's background traffic")
    ap.add_argument("--multiturn-rho", type=float, default=1.5,
                    help="utilisation of the multi-turn workload (no-cache work: at the ideal hit it is "
                         "≈ 0.2)")
    ap.add_argument("--prev", action="store_true",
                    help="also run kvfleet-prev (the scorer and hot-spot counter before issue 15)")
    ap.add_argument("--only", type=str, default="",
                    help="comma-separated config kinds to run (grid, storm, multiturn, tiered)")
    ap.add_argument("--replicas", type=int, default=3,
                    help="on the storm and multi-turn configs, also N EPP replicas with and without pick "
                         "gossip (0: off)")
    ap.add_argument("--beta", type=float, default=0.1,
                    help="hot-spot decay β of the prefix scorer (the EPP's default)")
    ap.add_argument("--hit-weight", type=float, default=1.0, help="weight of the prefix-cache scorer")
    ap.add_argument("--load-gain", type=float, default=0.0,
                    help="load_gain of the prefix-cache scorer (the EPP's default, 0)")
    ap.add_argument("--affinity", type=float, default=0.02, help="affinity_s of the prefix-affinity scorer")
    ap.add_argument("--spec-ttl", type=float, default=10.0, help="speculative index TTL (s)")
    ap.add_argument("--offset", type=str, default="0,0",
                    help="first row of the conversation,synthetic slices (default 0,0; the held-out check of "
                         "the weights chosen on rows 0… is --offset 4000,2000)")
    ap.add_argument("--family", action="store_true",
                    help="the workload family instead (bench/_family.py): documents, tenants, sessions, "
                         "agents and storms over loads and cache sizes, parameters drawn per seed; prints "
                         "the worst kvfleet ÷ best-peer ratio per quantile over every case (--seeds: seeds "
                         "per workload, load and cache, default 2 quick, 4 full)")
    ap.add_argument("--workloads", type=str, default="",
                    help="with --family: comma-separated generators to run (default all)")
    args = ap.parse_args(argv)
    if args.jobs <= 0:
        args.jobs = max(1, min(4, os.cpu_count() or 1))
    if args.family:
        from bench import _family  # imports this module

        knobs = Knobs(args.hit_weight, args.load_gain, args.affinity, args.beta, args.spec_ttl)
        return _family.main(args.quick, args.pods, args.seeds, args.jobs, knobs,
                            [w for w in args.workloads.split(",") if w])
    if args.seeds <= 0:
        args.seeds = 8 if args.quick else 12
    limits: dict[str, int | None] = ({"conversation": 4000, "synthetic": 2000} if args.quick
                                     else {"conversation": None, "synthetic": None})
    try:
        off_c, off_s = (int(x) for x in args.offset.split(","))
        rhos = tuple(float(x) for x in args.rho.split(","))
    except ValueError:
        ap.error("--offset takes two row numbers: CONVERSATION,SYNTHETIC; --rho a list of utilisations")
    offsets = {"conversation": off_c, "synthetic": off_s}
    only = set(args.only.split(",")) - {""} if args.only else {"grid", "storm", "multiturn", "tiered"}
    knobs = Knobs(args.hit_weight, args.load_gain, args.affinity, args.beta, args.spec_ttl)
    gpu_sizes = (1000, 250)
    size = 0 if args.quick else 1
    t_start = time.perf_counter()

    configs: list[Config] = []
    if "grid" in only:
        for trace in ("conversation", "synthetic"):
            for gpu in gpu_sizes:
                for rho in rhos:
                    cfg = SimConfig(pods=args.pods, gpu_blocks=gpu)
                    configs.append(Config(at_utilisation(Workload(trace, limits[trace], offsets[trace], 1.0),
                                                         cfg, rho), cfg, "grid", rho))
    for kind, rho in (("storm", args.storm_rho), ("multiturn", args.multiturn_rho)):
        if kind in only:
            cfg = SimConfig(pods=args.pods, gpu_blocks=gpu_sizes[0])
            configs.append(Config(at_utilisation(Workload(kind, GENERATED_SIZE[kind][size], 0, 1.0), cfg,
                                                 rho), cfg, kind, rho))
    if "tiered" in only:
        # the tiering headline: the whole synthetic trace at the highest load with small GPU caches
        cfg = SimConfig(pods=args.pods, gpu_blocks=gpu_sizes[1])
        configs.append(Config(at_utilisation(Workload("synthetic", None, 0, 1.0), cfg, max(rhos)), cfg,
                              "tiered", max(rhos)))
    head_seeds = 2 if args.quick else args.seeds
    kvs = ["kvfleet"] + (["kvfleet-prev"] if args.prev else [])
    tasks: list[tuple[Workload, SimConfig, str, Knobs]] = []
    slots: list[tuple[int, str]] = []
    for ci, c in enumerate(configs):
        if c.kind == "tiered":
            policies = [*peers(), *(f"{p}-tiered" for p in peers()), *kvs, *(f"{k}-tiered" for k in kvs)]
        else:
            policies = [*peers(), ORACLE, *kvs] + (["kvfleet-tiered"] if not args.quick and c.kind == "grid"
                                                    else [])
            if args.replicas > 1 and c.kind in GENERATED:
                policies += [f"kvfleet-x{args.replicas}", f"kvfleet-x{args.replicas}-nogossip"]
        for name in policies:
            cl = tiers_of(c.cluster) if name.endswith("-tiered") else c.cluster
            for k in range(1 if name in DETERMINISTIC
                           else (head_seeds if c.kind == "tiered" else args.seeds)):
                tasks.append((c.workload, replace(cl, seed=k), name, knobs))
                slots.append((ci, name))
    print(f"{len(tasks)} simulations on {args.jobs} processes, {args.seeds} seeds per policy", flush=True)
    results = run_all(tasks, args.jobs)
    by_config: list[dict[str, Runs]] = [{} for _ in configs]
    for (ci, name), r in zip(slots, results, strict=True):
        by_config[ci].setdefault(name, Runs(name, [])).results.append(r)

    rows: list[dict[str, Any]] = []
    utils: dict[str, list[float]] = {}
    for c, runs in zip(configs, by_config, strict=True):
        w, cfg = c.workload, c.cluster
        reqs = _requests(w)
        hits = ideal_hits(reqs, cfg.pods * cfg.gpu_blocks)
        ideal = sum(hits) / max(1, sum(r.tokens for r in reqs))
        rho, rho_ideal = utilisation(reqs, cfg), utilisation(reqs, cfg, hits)
        utils[c.label] = [round(rho, 3), round(rho_ideal, 3)]
        nseeds = max(len(r.results) for r in runs.values())
        groups = sorted({g for r in runs.values() for g in r.results[0].groups})
        print(f"\n{c.label}{' (tiering headline)' if c.kind == 'tiered' else ''}: {len(reqs)} req"
              f"{f' from row {w.offset}' if w.trace not in GENERATED else ''} at ×{w.speed:g}, ρ {rho:.2f} "
              f"(ρ at the ideal hit {rho_ideal:.2f}), ideal hit {ideal:.3f}; "
              f"mean [min–max] over {nseeds} seeds")
        print(f"  {'policy':<28} {'hit':>6} {'/ideal':>7} {'[min–max]':>13} "
              f"{'p50':>7} {'mean':>7} {'p90':>7} {'p99':>7} "
              f"{'p90/orc':>7} {'max/mean':>8}" + "".join(f"  {g} p50/p90/p99" for g in groups))
        orc = runs.get(ORACLE)
        for name, run in runs.items():
            h = run.hit()
            rel = Stat.of([r.hit_rate / ideal if ideal > 0 else 1.0 for r in run.results])
            tt = {q: run.ttft(q) for q in ("p50", "mean", "p90", "p99")}
            vs = f"{tt['p90'].mean / orc.ttft('p90').mean:7.3f}" if orc is not None else f"{'':>7}"
            extra = "".join(f"  {run.group(g, 'p50').mean:.2f}/{run.group(g, 'p90').mean:.2f}"
                            f"/{run.group(g, 'p99').mean:.2f}"
                            for g in groups)
            print(f"  {name:<28} {h.mean:6.3f} {rel.mean:7.3f} {f'[{rel.lo:.3f}–{rel.hi:.3f}]':>13} "
                  + " ".join(f"{tt[q].mean:7.3f}" for q in tt) + f" {vs} {run.load():8.2f}" + extra)
            rows.append({"trace": w.trace, "rho": c.rho, "gpu_blocks": cfg.gpu_blocks, "policy": name,
                         "hit": round(h.mean, 4), "hit_vs_ideal": rel.js(), **{q: tt[q].js() for q in tt}})
        sys.stdout.flush()
    summary: dict[str, Any] = {"bench": "routing", "quick": args.quick, "pods": args.pods}
    summary |= figures(configs, by_config, "kvfleet")
    if args.prev:
        summary |= {f"prev_{k}": v for k, v in figures(configs, by_config, "kvfleet-prev").items()
                    if not k.endswith(("_spread", "_at")) and not isinstance(v, dict)}
    if args.replicas > 1:
        summary |= replica_figures(configs, by_config, args.replicas)
    summary |= {
        "rho": utils,
        "configs": sum(1 for c in configs if c.kind == "grid"),
        "requests_per_config": {c.workload.trace: len(_requests(c.workload)) for c in configs
                                if c.kind != "tiered"},
        "offset": args.offset,
        "seeds": args.seeds,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(f"\n{len(rows)} rows; wall {summary['seconds']} s")
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
