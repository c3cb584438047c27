"""bench.routing: discrete-event cluster simulation of routing policies on the Mooncake traces.

N pods, each a FIFO prefill server at the cost model's speed with a GPU prefix
cache of C blocks (the trace's 512-token blocks, LRU); kvfleet's tiered runs add
CPU and SSD tiers (exclusive, demote on eviction, promote on a hit at the
cost model's read bandwidth). TTFT = queueing + prefill of the uncached suffix
+ tier loads + one decode step. Arrivals replay the trace at ×1, ×2, ×4 its rate.

Policies (the same arrivals for all):

- ``random``, ``round-robin``, ``least-load`` (fewest outstanding requests);
- ``gie-approx-prefix``: GIE's approximate prefix scorer (the router's own
  per-pod LRU of the blocks it routed) weight 3 + queue-depth scorer (min-max) 2
  + KV-utilisation scorer 2, max score wins;
- ``sglang-cache-aware`` (sglang-router 0.3): the router's own per-pod prefix
  tree; match rate > 0.3 → best match, else least-loaded; when
  ``max − min load > 64`` and ``max > 1.5·min`` → least-loaded;
- ``kvfleet``: kvfleet's EPP router itself (``kvfleet.epp.router.Router.route_keys``:
  its scheduling profile, :class:`BlockIndex`, in-flight tracker and speculative
  picks, on the simulation's clock), fed by the pods' KV events after
  ``event_delay_s``; GPU-only caches;
- ``kvfleet-tiered``: the same with CPU/SSD tiers on the pods; tier weights from
  the cost model.

Reported per trace, load and cache size: token hit rate and its ratio to the
one-node ideal (a single LRU of N·C blocks, infinite compute, arrival order),
TTFT p50/mean/p90/p99, max/mean busy time over pods. Last line: one JSON
object with ``hit_vs_ideal`` (kvfleet GPU-only, worst config),
``ttft_vs_best_peer`` (largest kvfleet/best-peer ratio over configs and over
p50/mean/p90) and ``tiered_ttft_p90_vs_best_peer`` (synthetic, ×4, small GPU
caches: kvfleet-tiered p90 / best GPU-only peer p90).

Every policy runs the same arrivals with the same picker seeds (paired); rows show
means over seeds and the min–max of ``hit / ideal``; the JSON adds ``*_spread``
(mean, min, max, half-width of the 95 % t-interval over seeds) and ``*_at`` (the
config that set the figure). Simulations run on ``--jobs`` worker processes.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import os
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench import _traces as traces
from kvfleet.cache.tiers import Tier
from kvfleet.config.cache import CacheSettings
from kvfleet.config.epp import CostModelSettings, EppSettings, PluginSpec
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.router import Router
from kvfleet.epp.tokenize import load_tokenizer

BLOCK = traces.TRACE_BLOCK


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster (cost model of an 8B model on one H100 per pod)."""

    pods: int = 8
    gpu_blocks: int = 1000
    cpu_blocks: int = 0
    ssd_blocks: int = 0
    prefill_tokens_per_s: float = 16_000.0
    decode_step_s: float = 0.009
    kv_bytes_per_token: int = 131_072
    cpu_gbps: float = 20.0
    ssd_gbps: float = 3.0
    event_delay_s: float = 0.02
    seed: int = 0

    @property
    def block_prefill_s(self) -> float:
        return BLOCK / self.prefill_tokens_per_s

    def load_s(self, tier: Tier) -> float:
        bw = self.cpu_gbps if tier is Tier.CPU else self.ssd_gbps
        return BLOCK * self.kv_bytes_per_token / (bw * 1e9)


@dataclass
class Req:
    arrival: float
    tokens: int
    blocks: list[int]


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
                self.gpu.move_to_end(b)
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
        stored = promoted_cpu + promoted_ssd + new
        if stored:
            events.append(("stored", stored, Tier.GPU))
        self._spill(events)
        return finish, hit_tokens, events

    def _spill(self, events: list[tuple[str, list[int], Tier]]) -> None:
        cfg = self.cfg
        tiers = [(self.gpu, cfg.gpu_blocks, Tier.GPU), (self.cpu, cfg.cpu_blocks, Tier.CPU), (self.ssd, cfg.ssd_blocks, Tier.SSD)]
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
        """Bookkeeping after the pick (the router's own view); returns a token for :meth:`prefill_done`."""
        return None

    def prefill_done(self, token: Any, now: float) -> None:
        pass

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


class GieApproxPrefix(Policy):
    name = "gie-approx-prefix"

    def __init__(self, cfg: SimConfig, pods: list[SimPod]) -> None:
        super().__init__(cfg, pods)
        self.lru = [_RouterLRU(cfg.gpu_blocks) for _ in pods]

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

    def routed(self, r: Req, pod: int, now: float, finish: float) -> None:
        self.lru[pod].insert(r.blocks)


class SglangCacheAware(Policy):
    name = "sglang-cache-aware"

    def __init__(self, cfg: SimConfig, pods: list[SimPod]) -> None:
        super().__init__(cfg, pods)
        self.tree = [_RouterLRU(1 << 15) for _ in pods]

    def route(self, r: Req, now: float) -> int:
        for p in self.pods:
            p.waiting_running(now)
        loads = [len(p.outstanding) for p in self.pods]
        if max(loads) - min(loads) > 64 and max(loads) > 1.5 * min(loads):
            return self.least_loaded(now)
        n = max(1, len(r.blocks))
        matches = [t.match(r.blocks) for t in self.tree]
        m = max(matches)
        if m / n > 0.3:
            cands = [i for i, v in enumerate(matches) if v == m]
            lo = min(loads[i] for i in cands)
            return self.rng.choice([i for i in cands if loads[i] == lo])
        return self.least_loaded(now)

    def routed(self, r: Req, pod: int, now: float, finish: float) -> None:
        self.tree[pod].insert(r.blocks)


class Kvfleet(Policy):
    """kvfleet's EPP :class:`~kvfleet.epp.router.Router` itself (its profile, :class:`BlockIndex`,
    :class:`InflightTracker` and speculative picks), on the simulation's clock, fed by the pods' KV events."""

    name = "kvfleet"

    def __init__(self, cfg: SimConfig, pods: list[SimPod], plugins: Sequence[PluginSpec], hotspot_beta: float, spec_ttl_s: float) -> None:
        super().__init__(cfg, pods)
        self.now = 0.0
        self.names = [f"pod-{i}" for i in range(len(pods))]
        self.pos = {n: i for i, n in enumerate(self.names)}
        cost = CostModelSettings(
            prefill_tokens_per_s=cfg.prefill_tokens_per_s, kv_bytes_per_token=cfg.kv_bytes_per_token,
            cpu_gbps=cfg.cpu_gbps, ssd_gbps=cfg.ssd_gbps, remote_gbps=cfg.ssd_gbps / 2,
        )
        settings = EppSettings(plugins=tuple(plugins), hotspot_beta=hotspot_beta, speculative_ttl_s=spec_ttl_s, cost=cost)
        data = {"pools": [{"name": "pool", "models": ["m"], "pods": [
            {"name": n, "address": "10.0.0.1", "port": 8000 + i} for i, n in enumerate(self.names)]}]}
        clock = lambda: self.now  # noqa: E731
        self.index = BlockIndex(clock=clock)
        self.router = Router(
            settings, CacheSettings(block_size=BLOCK), StaticDatastore(data=data), self.index, MetricsStore(),
            load_tokenizer("bytes"), InflightTracker(clock=clock),
        )
        self._last: Any = None

    def route(self, r: Req, now: float) -> int:
        self.now = now
        d = self.router.route_keys("m", r.blocks, r.tokens)
        self._last = d.ticket
        return self.pos[d.pod]

    def routed(self, r: Req, pod: int, now: float, finish: float) -> Any:
        return self._last

    def prefill_done(self, token: Any, now: float) -> None:
        self.now = now
        token.first_byte()  # as the EPP on response headers: the speculative TTL counts from here
        token.close()

    def on_events(self, pod: int, events: list[tuple[str, list[int], Tier]]) -> None:
        name = self.names[pod]
        for kind, keys, tier in events:
            if kind == "stored":
                self.index.add(name, keys, tier)
            else:
                self.index.remove(name, keys, tier)


# --- the simulation -------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    hit_rate: float
    ttft: dict[str, float]
    load_max_over_mean: float
    seconds: float


def simulate(reqs: list[Req], cfg: SimConfig, make: Callable[[SimConfig, list[SimPod]], Policy]) -> Result:
    t0 = time.perf_counter()
    pods = [SimPod(cfg) for _ in range(cfg.pods)]
    pol = make(cfg, pods)
    heap: list[tuple[float, int, int, Any]] = []  # (time, seq, kind 0=events 1=prefill done, payload)
    seq = 0
    ttft = np.empty(len(reqs))
    hit_tokens = 0
    total_tokens = 0
    for k, r in enumerate(reqs):
        now = r.arrival
        while heap and heap[0][0] <= now:
            t, _, kind, payload = heapq.heappop(heap)
            if kind == 0:
                pol.on_events(*payload)
            else:
                pol.prefill_done(payload, t)
        i = pol.route(r, now)
        finish, hit, events = pods[i].serve(r, now)
        token = pol.routed(r, i, now, finish)
        seq += 1
        heapq.heappush(heap, (finish, seq, 1, token))
        if events:
            seq += 1
            heapq.heappush(heap, (finish + cfg.event_delay_s, seq, 0, (i, events)))
        ttft[k] = finish - now
        hit_tokens += hit
        total_tokens += r.tokens
    busy = np.array([p.busy_s for p in pods])
    return Result(
        policy=pol.name,
        hit_rate=hit_tokens / max(1, total_tokens),
        ttft={"p50": float(np.percentile(ttft, 50)), "mean": float(ttft.mean()),
              "p90": float(np.percentile(ttft, 90)), "p99": float(np.percentile(ttft, 99))},
        load_max_over_mean=float(busy.max() / max(1e-9, busy.mean())),
        seconds=time.perf_counter() - t0,
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
        return {"mean": round(self.mean, nd), "min": round(self.lo, nd), "max": round(self.hi, nd), "ci95": round(self.ci95, nd)}


#: Student's t 97.5 % quantiles by degrees of freedom (index 0 unused), then the normal value
_T95 = (0.0, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 1.96)


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

    def per_seed(self, q: str, n: int) -> list[float]:
        """``q`` for seeds ``0 … n − 1`` (a deterministic policy ran once: its value repeats)."""
        return [self.results[min(k, len(self.results) - 1)].ttft[q] for k in range(n)]

    def load(self) -> float:
        return float(np.mean([r.load_max_over_mean for r in self.results]))


def ideal_hit_rate(reqs: list[Req], capacity: int) -> float:
    """One node, one LRU of ``capacity`` blocks, infinite compute, arrival order."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit_tokens = total = 0
    for r in reqs:
        hit = 0
        for b in r.blocks:
            if b not in lru:
                break
            hit += 1
        for b in r.blocks:
            lru[b] = None
            lru.move_to_end(b)
        while len(lru) > capacity:
            lru.popitem(last=False)
        hit_tokens += min(hit * BLOCK, r.tokens)
        total += r.tokens
    return hit_tokens / max(1, total)


def load_requests(name: str, limit: int | None, speed: float, offset: int = 0) -> list[Req]:
    """Rows ``offset … offset + limit`` of a trace, arrivals from the slice's first row, ``speed``× the trace rate."""
    rows = traces.load(name, None if limit is None else offset + limit)[offset:]
    if not rows:
        raise SystemExit(f"bench.routing: trace {name!r} has no rows from {offset}")
    t0 = rows[0].timestamp_ms
    return [Req(arrival=(row.timestamp_ms - t0) / 1000.0 / speed, tokens=row.input_length, blocks=list(row.hash_ids)) for row in rows]


def kvfleet_plugins(
    hit_weight: float = 1.0, load_gain: float = 20.0, kv_weight: float = 0.05, overhead_s: float = 0.009, seed: int = 0,
    affinity_s: float = 0.02,
) -> list[PluginSpec]:
    return [
        PluginSpec(type="prefix-cache-scorer", weight=hit_weight, params={"load_gain": load_gain}),
        # the simulation has no decode interference; each request costs one decode step
        PluginSpec(type="queue-scorer", weight=1.0, params={"running_s": 0.0, "overhead_s": overhead_s}),
        PluginSpec(type="kv-cache-utilization-scorer", weight=kv_weight),
        PluginSpec(type="prefix-affinity-scorer", weight=1.0, params={"affinity_s": affinity_s}),
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
DETERMINISTIC = frozenset({"round-robin"})


@dataclass(frozen=True)
class Knobs:
    """kvfleet's settings under test (the EPP's defaults unless overridden on the command line)."""

    hit_weight: float = 1.0
    load_gain: float = 20.0
    affinity_s: float = 0.02
    beta: float = 0.1
    spec_ttl_s: float = 10.0


def make_policy(name: str, knobs: Knobs) -> Callable[[SimConfig, list[SimPod]], Policy]:
    if name in peers():
        return peers()[name]
    if name not in ("kvfleet", "kvfleet-tiered"):
        raise ValueError(f"unknown policy {name!r}; known: {', '.join([*peers(), 'kvfleet', 'kvfleet-tiered'])}")

    def build(cfg: SimConfig, pods: list[SimPod]) -> Policy:
        plugins = kvfleet_plugins(knobs.hit_weight, knobs.load_gain, seed=cfg.seed, affinity_s=knobs.affinity_s)
        p = Kvfleet(cfg, pods, plugins, knobs.beta, knobs.spec_ttl_s)
        p.name = name
        return p

    return build


@dataclass(frozen=True)
class Workload:
    """A slice of a trace replayed at ``speed``× its rate."""

    trace: str
    limit: int | None
    offset: int
    speed: int


@functools.lru_cache(maxsize=8)
def _requests(w: Workload) -> list[Req]:
    return load_requests(w.trace, w.limit, w.speed, w.offset)


def run_one(task: tuple[Workload, SimConfig, str, Knobs]) -> Result:
    """One simulation (a unit of work for the process pool): workload, cluster with its seed, policy."""
    w, cfg, name, knobs = task
    return simulate(_requests(w), cfg, make_policy(name, knobs))


def run_all(tasks: list[tuple[Workload, SimConfig, str, Knobs]], jobs: int) -> list[Result]:
    """Every task, in order; ``jobs`` processes (the simulation is single-threaded Python)."""
    if jobs <= 1:
        return [run_one(t) for t in tasks]
    order = sorted(range(len(tasks)), key=lambda i: -(tasks[i][0].limit or 1 << 20))  # long slices first
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        done = dict(zip(order, ex.map(run_one, [tasks[i] for i in order], chunksize=1), strict=True))
    return [done[i] for i in range(len(tasks))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a prefix of each trace, GPU-only grid (fits in 60 s)")
    ap.add_argument("--pods", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=0,
                    help="runs per policy (picker seeds: random tie-breaks), paired across policies; default 8 quick, 12 full")
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (default: the CPU count, at most 4)")
    ap.add_argument("--beta", type=float, default=0.1, help="hot-spot decay β of the prefix scorer (the EPP's default)")
    ap.add_argument("--hit-weight", type=float, default=1.0, help="weight of the prefix-cache scorer")
    ap.add_argument("--load-gain", type=float, default=20.0, help="load_gain of the prefix-cache scorer")
    ap.add_argument("--affinity", type=float, default=0.02, help="affinity_s of the prefix-affinity scorer")
    ap.add_argument("--spec-ttl", type=float, default=10.0, help="speculative index TTL (s)")
    ap.add_argument("--offset", type=str, default="0,0",
                    help="first row of the conversation,synthetic slices (default 0,0; the held-out check of the "
                         "weights chosen on rows 0… is --offset 4000,2000)")
    args = ap.parse_args(argv)
    if args.seeds <= 0:
        args.seeds = 8 if args.quick else 12
    if args.jobs <= 0:
        args.jobs = max(1, min(4, os.cpu_count() or 1))
    limits: dict[str, int | None] = {"conversation": 4000, "synthetic": 2000} if args.quick else {"conversation": None, "synthetic": None}
    try:
        off_c, off_s = (int(x) for x in args.offset.split(","))
    except ValueError:
        ap.error("--offset takes two row numbers: CONVERSATION,SYNTHETIC")
    offsets = {"conversation": off_c, "synthetic": off_s}
    knobs = Knobs(args.hit_weight, args.load_gain, args.affinity, args.beta, args.spec_ttl)
    loads = (1, 2, 4)
    gpu_sizes = (1000, 250)
    t_start = time.perf_counter()

    # every config × policy × seed is one task; the grid's kvfleet-tiered rows only in the full run (in --quick
    # the tiering headline below has its own run)
    grid_policies = [*peers(), "kvfleet"] + ([] if args.quick else ["kvfleet-tiered"])
    configs: list[tuple[Workload, SimConfig, bool]] = []
    for trace in ("conversation", "synthetic"):
        for gpu in gpu_sizes:
            for speed in loads:
                configs.append((Workload(trace, limits[trace], offsets[trace], speed), SimConfig(pods=args.pods, gpu_blocks=gpu), True))
    # the tiering headline: the whole synthetic trace at ×4 with small GPU caches
    configs.append((Workload("synthetic", None, 0, 4), SimConfig(pods=args.pods, gpu_blocks=gpu_sizes[1]), False))
    head_seeds = 2 if args.quick else args.seeds
    tasks: list[tuple[Workload, SimConfig, str, Knobs]] = []
    slots: list[tuple[int, str]] = []
    for ci, (w, cfg, grid) in enumerate(configs):
        policies = grid_policies if grid else [*peers(), "kvfleet-tiered"]
        for name in policies:
            c = cfg if name != "kvfleet-tiered" else replace(cfg, cpu_blocks=4 * cfg.gpu_blocks, ssd_blocks=16 * cfg.gpu_blocks)
            for k in range(1 if name in DETERMINISTIC else (args.seeds if grid else head_seeds)):
                tasks.append((w, replace(c, seed=k), name, knobs))
                slots.append((ci, name))
    print(f"{len(tasks)} simulations on {args.jobs} processes, {args.seeds} seeds per policy", flush=True)
    results = run_all(tasks, args.jobs)
    by_config: list[dict[str, Runs]] = [{} for _ in configs]
    for (ci, name), r in zip(slots, results, strict=True):
        by_config[ci].setdefault(name, Runs(name, [])).results.append(r)

    rows: list[dict[str, Any]] = []
    hit_stats: list[tuple[Stat, str]] = []
    ttft_ratios: list[tuple[float, Stat, str]] = []
    tiered_ratio = float("nan")
    for (w, cfg, grid), runs in zip(configs, by_config, strict=True):
        reqs = _requests(w)
        ideal = ideal_hit_rate(reqs, cfg.pods * cfg.gpu_blocks)
        label = f"{w.trace} ×{w.speed} gpu={cfg.gpu_blocks}/pod"
        peer_runs = [r for n, r in runs.items() if not n.startswith("kvfleet")]
        nseeds = max(len(r.results) for r in runs.values())
        print(f"\n{label} ({len(reqs)} req from row {w.offset}, ideal hit {ideal:.3f}; mean [min–max] over {nseeds} seeds)")
        print(f"  {'policy':<20} {'hit':>6} {'/ideal':>7} {'[min–max]':>13} {'p50':>7} {'mean':>7} {'p90':>7} {'p99':>7} {'max/mean':>8}")
        for name, run in runs.items():
            h = run.hit()
            rel = Stat.of([r.hit_rate / ideal if ideal > 0 else 1.0 for r in run.results])
            tt = {q: run.ttft(q) for q in ("p50", "mean", "p90", "p99")}
            print(f"  {name:<20} {h.mean:6.3f} {rel.mean:7.3f} {f'[{rel.lo:.3f}–{rel.hi:.3f}]':>13} "
                  + " ".join(f"{tt[q].mean:7.3f}" for q in tt) + f" {run.load():8.2f}")
            rows.append({"trace": w.trace, "load": w.speed, "gpu_blocks": cfg.gpu_blocks, "policy": name,
                         "hit": round(h.mean, 4), "hit_vs_ideal": rel.js(), **{q: tt[q].js() for q in tt}})
            if grid and name == "kvfleet":
                hit_stats.append((rel, label))
        if grid:
            kv = runs["kvfleet"]
            for q in ("p50", "mean", "p90"):
                # the best peer on seed-averaged values; the spread from the paired per-seed ratios against it
                best = min(peer_runs, key=lambda r: r.ttft(q).mean)
                ratio = kv.ttft(q).mean / best.ttft(q).mean
                paired = Stat.of([a / b for a, b in zip(kv.per_seed(q, nseeds), best.per_seed(q, nseeds), strict=True)])
                ttft_ratios.append((ratio, paired, f"{label} {q} vs {best.policy}"))
        else:
            best_p90 = min(r.ttft("p90").mean for r in peer_runs)
            tiered_ratio = runs["kvfleet-tiered"].ttft("p90").mean / best_p90
        sys.stdout.flush()
    worst_hit, worst_hit_at = min(hit_stats, key=lambda x: x[0].mean)
    worst_ttft, worst_paired, worst_ttft_at = max(ttft_ratios, key=lambda x: x[0])
    summary = {
        "bench": "routing",
        "quick": args.quick,
        "pods": args.pods,
        "hit_vs_ideal": round(worst_hit.mean, 4),
        "hit_vs_ideal_spread": worst_hit.js(),
        "hit_vs_ideal_at": worst_hit_at,
        "ttft_vs_best_peer": round(worst_ttft, 4),
        "ttft_vs_best_peer_spread": worst_paired.js(),
        "ttft_vs_best_peer_at": worst_ttft_at,
        "tiered_ttft_p90_vs_best_peer": round(tiered_ratio, 4),
        "configs": len(hit_stats),
        "requests_per_config": {t: len(_requests(w)) for w, _, grid in configs if grid for t in [w.trace]},
        "offset": args.offset,
        "seeds": args.seeds,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(f"\n{len(rows)} rows; wall {summary['seconds']} s")
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
