"""The workload family of ``python -m bench.routing --family``: parameterised generators swept over load and
cache size, with parameters drawn per seed, so that a routing change is judged on many workloads instead of
the few it was tuned on.

Not a benchmark of its own (``make bench`` skips modules whose name starts with ``_``): ``bench.routing``
runs it. Five generators, each a function of a ``random.Random`` (every parameter drawn from it) and a
request count, at an arbitrary time scale that :func:`requests` then stretches to the case's load:

- ``documents``: a few long documents (16–128 blocks of 512 tokens: 8–64 k tokens), each queried by many
  readers (Zipf popularity), a short question of its own per request; some readers ask follow-ups;
- ``tenants``: many tenants (8–48), each with a shared system prompt (2–24 blocks), Zipf popularity, a user
  message of its own;
- ``sessions``: multi-turn chats over a few applications' system prompts, each turn extending its session's
  history after the answer's stream and a think time;
- ``agents``: branching agent trees: a task on an agent type's system prompt, steps that append a tool
  result and an action, and forks of 2–4 parallel branches that share everything up to the fork;
- ``storm``: background traffic of application prefixes and unique prompts with 1–3 bursts of 100–400
  requests that share a prefix of 8–48 blocks, each within 0.5–4 s.

Replicas: every case also runs three EPP replicas (``kvfleet-x3``: streams round-robin over three pickers,
gossip 1 ms late, as measured by ``bench.gossip``, through the EPP's own receiving side) and one picker whose
ties break on another random sequence (``kvfleet-reseeded``); the family prints both ÷ one picker
(``family_worst_replicas3_*_vs_1``, ``family_worst_reseeded_*_vs_1``): the second says how far a picker's
figures move by chance alone.

Load: ``ρ`` of a case is the utilisation at the one-node ideal hit (:func:`bench.routing.utilisation` with
:func:`bench.routing.ideal_hits` of one LRU of every pod's blocks): the prefill work that is left when
reuse is perfect (plus one decode step per request) ÷ the pods' time. It is the load any router must
carry at least; a router that recomputes shared prefixes carries more. (The no-cache utilisation of the
Mooncake configs would put the documents' cases, whose ideal reuse is > 90 %, at a few percent of real
load.)
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from bench.routing import (
    BLOCK,
    ORACLE,
    RESEEDED,
    Knobs,
    KvfleetReplicas,
    Req,
    Result,
    SimConfig,
    ideal_hits,
    make_policy,
    peers,
    simulate,
    utilisation,
)


def _ids() -> Iterator[int]:
    return iter(range(1, 1 << 62))


def _tokens(rng: random.Random, blocks: int) -> int:
    """A prompt of ``blocks`` blocks whose last block is partly filled."""
    return blocks * BLOCK - rng.randrange(BLOCK // 2)


def _zipf(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def documents(rng: random.Random, n: int) -> list[Req]:
    """Long shared documents, each queried by many readers: ``D`` documents (3–12) of 16–128 blocks (the
    range drawn per seed), Zipf popularity (exponent 0.6–1.4, ranks in random order), Poisson arrivals;
    1–3 documents exist from the start, the others appear at random points of the first 60 % of the run
    (a new document: its first readers find it nowhere); a request is a live document and a question of
    its own (1–3 blocks); with probability ``f`` (0–0.4) a reader asks a follow-up a think time (exp.,
    mean 2–20) after its last question, on the same document and conversation (its history: question and
    a 1-block answer)."""
    ids = _ids()
    lo = rng.randint(16, 64)
    hi = rng.randint(lo, 128)
    docs = [[next(ids) for _ in range(rng.randint(lo, hi))] for _ in range(rng.randint(3, 12))]
    pop = _zipf(len(docs), rng.uniform(0.6, 1.4))
    rng.shuffle(pop)
    early = rng.randint(1, min(3, len(docs)))
    born = [0.0] * early + sorted(rng.uniform(0.0, 0.6 * n) for _ in range(len(docs) - early))
    follow, think = rng.uniform(0.0, 0.4), rng.uniform(2.0, 20.0)
    out: list[Req] = []
    t = 0.0
    pending: list[tuple[float, list[int]]] = []  # follow-ups: (arrival, prompt)
    while len(out) < n:
        t += rng.expovariate(1.0)
        while pending and pending[0][0] <= t and len(out) < n:
            at, blocks = pending.pop(0)
            out.append(Req(at, _tokens(rng, len(blocks)), blocks, output=rng.randint(30, 300)))
        if len(out) >= n:
            break
        live = [k for k in range(len(docs)) if born[k] <= t]
        doc = docs[rng.choices(live, [pop[k] for k in live])[0]]
        blocks = [*doc, *(next(ids) for _ in range(rng.randint(1, 3)))]
        out.append(Req(t, _tokens(rng, len(blocks)), blocks, output=rng.randint(30, 300)))
        if rng.random() < follow:
            nxt = [*blocks, next(ids), *(next(ids) for _ in range(rng.randint(1, 2)))]
            pending.append((t + rng.expovariate(1.0 / think), nxt))
            pending.sort(key=lambda x: x[0])
    out.sort(key=lambda r: r.arrival)
    return out


def tenants(rng: random.Random, n: int) -> list[Req]:
    """Many tenants with shared system prompts: ``T`` tenants (8–48), system prompts of 2–24 blocks (the
    range drawn per seed), Zipf popularity (0.5–1.3, ranks in random order), half of them from the start
    and the others joining over the first 60 % of the run; a user message of its own of 1–``u`` blocks
    (``u`` 2–10), Poisson arrivals; 0–20 % of the requests are unique prompts of 1–16 blocks."""
    ids = _ids()
    lo = rng.randint(2, 8)
    hi = rng.randint(lo, 24)
    systems = [[next(ids) for _ in range(rng.randint(lo, hi))] for _ in range(rng.randint(8, 48))]
    pop = _zipf(len(systems), rng.uniform(0.5, 1.3))
    rng.shuffle(pop)
    half = len(systems) // 2
    born = [0.0] * half + sorted(rng.uniform(0.0, 0.6 * n) for _ in range(len(systems) - half))
    user, unique = rng.randint(2, 10), rng.uniform(0.0, 0.2)
    out: list[Req] = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        if rng.random() < unique:
            blocks = [next(ids) for _ in range(rng.randint(1, 16))]
        else:
            live = [k for k in range(len(systems)) if born[k] <= t]
            system = systems[rng.choices(live, [pop[k] for k in live])[0]]
            blocks = [*system, *(next(ids) for _ in range(rng.randint(1, user)))]
        out.append(Req(t, _tokens(rng, len(blocks)), blocks, output=rng.randint(50, 500)))
    return out


def sessions(rng: random.Random, n: int) -> list[Req]:
    """Multi-turn sessions with think time: ``A`` applications (2–8) with system prompts of 2–12 blocks;
    sessions start as a Poisson process, each of 2 + geometric turns (mean 3–10); a turn's prompt is the
    last prompt, its answer (1 block) and a user message (1–3 blocks); the next turn comes after the
    answer's stream and a think time (exp., mean 5–60)."""
    ids = _ids()
    systems = [[next(ids) for _ in range(rng.randint(2, 12))] for _ in range(rng.randint(2, 8))]
    mean_turns, think = rng.uniform(3.0, 10.0), rng.uniform(5.0, 60.0)
    out: list[Req] = []
    start = 0.0
    while len(out) < n:
        start += rng.expovariate(0.3)
        blocks = list(rng.choice(systems))
        t = start
        turns = 2
        while turns < 40 and rng.random() < 1 - 1 / max(1.0, mean_turns - 1):
            turns += 1
        for k in range(turns):
            if k:
                blocks.append(next(ids))
            blocks.extend(next(ids) for _ in range(rng.randint(1, 3)))
            output = rng.randint(100, 500)
            out.append(Req(t, _tokens(rng, len(blocks)), list(blocks), output=output))
            t += 1.0 + output * 0.025 + rng.expovariate(1.0 / think)
    out.sort(key=lambda r: r.arrival)
    return out[:n]


def agents(rng: random.Random, n: int) -> list[Req]:
    """Branching agent trees: ``K`` agent types (2–6) with system prompts of 4–16 blocks; tasks start as a
    Poisson process, each a task description (2–8 blocks) on a type's prompt; a step appends a tool result
    (1–6 blocks) and the model's action (1 block) to its branch and comes a tool time (exp., mean 0.5–5)
    after the last; with probability ``b`` (0.1–0.4) a step forks into 2–4 branches that go on in parallel
    from the same context; a branch ends after 3–12 steps of depth."""
    ids = _ids()
    systems = [[next(ids) for _ in range(rng.randint(4, 16))] for _ in range(rng.randint(2, 6))]
    branch, tool = rng.uniform(0.1, 0.4), rng.uniform(0.5, 5.0)
    depth = rng.randint(3, 12)
    out: list[Req] = []
    start = 0.0
    while len(out) < n:
        start += rng.expovariate(0.2)
        root = list(rng.choice(systems)) + [next(ids) for _ in range(rng.randint(2, 8))]
        frontier = [(start, root, 0)]
        budget = 64  # steps per task at most
        while frontier and budget > 0:
            t, blocks, d = frontier.pop()
            output = rng.randint(20, 200)
            out.append(Req(t, _tokens(rng, len(blocks)), list(blocks), output=output))
            budget -= 1
            if d >= depth:
                continue
            forks = rng.randint(2, 4) if rng.random() < branch else 1
            for _ in range(forks):
                nxt = [*blocks, next(ids), *(next(ids) for _ in range(rng.randint(1, 6)))]
                frontier.append((t + 0.5 + output * 0.025 + rng.expovariate(1.0 / tool), nxt, d + 1))
    out.sort(key=lambda r: r.arrival)
    return out[:n]


def storm(rng: random.Random, n: int) -> list[Req]:
    """Hot-prefix storms: background traffic (Poisson; 40–80 % of it on one of 10–30 application prefixes
    of 2–12 blocks, Zipf, then 1–10 blocks of its own; the rest 1–16 unique blocks) and 1–3 bursts of
    100–400 requests (group ``storm``, together at most half of ``n``) sharing a prefix of 8–48 blocks plus
    1–2 blocks of their own, each within 0.5–4 time units, at random points of the background's span."""
    ids = _ids()
    apps = [[next(ids) for _ in range(rng.randint(2, 12))] for _ in range(rng.randint(10, 30))]
    pop = _zipf(len(apps), rng.uniform(0.6, 1.2))
    share = rng.uniform(0.4, 0.8)
    bursts = [rng.randint(100, 400) for _ in range(rng.randint(1, 3))]
    scale = min(1.0, n / 2 / sum(bursts))
    bursts = [max(20, int(b * scale)) for b in bursts]
    background = n - sum(bursts)
    out: list[Req] = []
    t = 0.0
    for _ in range(background):
        t += rng.expovariate(1.0)
        if rng.random() < share:
            blocks = list(rng.choices(apps, pop)[0]) + [next(ids) for _ in range(rng.randint(1, 10))]
        else:
            blocks = [next(ids) for _ in range(rng.randint(1, 16))]
        out.append(Req(t, _tokens(rng, len(blocks)), blocks, output=rng.randint(50, 500)))
    for size in bursts:
        prefix = [next(ids) for _ in range(rng.randint(8, 48))]
        start, window = rng.uniform(0.1, 0.9) * t, rng.uniform(0.5, 4.0)
        for _ in range(size):
            blocks = [*prefix, *(next(ids) for _ in range(rng.randint(1, 2)))]
            out.append(Req(start + rng.uniform(0, window), _tokens(rng, len(blocks)), blocks,
                           output=rng.randint(100, 300), group="storm"))
    out.sort(key=lambda r: r.arrival)
    return out


#: the family: name → generator
GENERATORS: dict[str, Callable[[random.Random, int], list[Req]]] = {
    "documents": documents,
    "tenants": tenants,
    "sessions": sessions,
    "agents": agents,
    "storm": storm,
}
#: a load: (scale, utilisation); scale ``ρ`` is the no-cache utilisation (bench.routing's convention),
#: ``ρ*`` the utilisation at the one-node ideal hit
Load = tuple[str, float]
#: the loads every workload is swept over (quick, full) and the GPU cache sizes (blocks per pod)
LOADS: dict[str, tuple[Load, ...]] = {
    "quick": (("ρ", 0.5), ("ρ", 0.8), ("ρ", 0.95), ("ρ*", 0.5), ("ρ*", 0.8)),
    "full": (("ρ", 0.5), ("ρ", 0.7), ("ρ", 0.85), ("ρ", 0.95), ("ρ*", 0.5), ("ρ*", 0.7), ("ρ*", 0.85)),
}
CACHES = (1000, 250)


@dataclass(frozen=True)
class Case:
    """One case of the family: a workload drawn with ``seed``, stretched to ``load`` on ``cluster``."""

    workload: str
    load: Load
    cluster: SimConfig
    seed: int
    requests: int

    @property
    def label(self) -> str:
        scale, rho = self.load
        return f"{self.workload} {scale}={rho:g} gpu={self.cluster.gpu_blocks}/pod seed={self.seed}"


def at_load(reqs: list[Req], cfg: SimConfig, load: Load) -> list[Req]:
    """``reqs`` with their arrivals stretched (bursts and think times alike) to ``load``: the no-cache
    utilisation (``ρ``) or the utilisation at the one-node ideal hit (``ρ*``) on ``cfg``'s pods."""
    scale, rho = load
    hits = ideal_hits(reqs, cfg.pods * cfg.gpu_blocks) if scale == "ρ*" else None
    factor = utilisation(reqs, cfg, hits) / rho
    return [replace(r, arrival=r.arrival * factor) for r in reqs]


@functools.lru_cache(maxsize=8)
def requests(case: Case) -> list[Req]:
    """The case's requests (deterministic in the case)."""
    rng = random.Random(f"{case.workload}/{case.seed}")
    return at_load(GENERATORS[case.workload](rng, case.requests), case.cluster, case.load)


def cases(pods: int, seeds: int, size: int, workloads: Sequence[str] = tuple(GENERATORS),
          loads: Sequence[Load] = LOADS["quick"], caches: Sequence[int] = CACHES) -> list[Case]:
    """Every (workload, load, cache, seed) case; the cluster's picker seed is the case's seed."""
    return [Case(w, load, SimConfig(pods=pods, gpu_blocks=gpu, seed=seed), seed, size)
            for w in workloads for load in loads for gpu in caches for seed in range(seeds)]


# --- running the family --------------------------------------------------------------------------------

QUANTILES = ("p50", "mean", "p90", "p99")


def run_case(task: tuple[Case, str, Knobs]) -> Result:
    """One simulation of the family (a unit of work for the process pool): case, policy, kvfleet's knobs."""
    case, name, knobs = task
    return simulate(requests(case), case.cluster, make_policy(name, knobs))


@dataclass(frozen=True)
class Ratio:
    """kvfleet ÷ the best peer on one quantile of one case."""

    value: float
    case: Case
    peer: str
    kvfleet: float
    best: float

    @property
    def at(self) -> str:
        return f"{self.case.label} vs {self.peer} ({self.kvfleet:.3f} s vs {self.best:.3f} s)"


def ratios(case: Case, runs: Mapping[str, Result], kv: str = "kvfleet") -> dict[str, Ratio]:
    """Per quantile: ``kv`` ÷ the best peer of the case (the oracle is no peer)."""
    out = {}
    peer_runs = {n: r for n, r in runs.items() if n in peers()}
    for q in QUANTILES:
        peer = min(peer_runs, key=lambda n: peer_runs[n].ttft[q])
        best, mine = peer_runs[peer].ttft[q], runs[kv].ttft[q]
        out[q] = Ratio(mine / max(best, 1e-9), case, peer, mine, best)
    return out


def run_family(cs: Sequence[Case], knobs: Knobs, jobs: int,
               extra: Sequence[str] = ()) -> list[dict[str, Result]]:
    """Every policy on every case: the peers, the oracle, kvfleet (and ``extra`` policies)."""
    names = [*peers(), ORACLE, "kvfleet", *extra]
    tasks = [(c, n, knobs) for c in cs for n in names]
    if jobs <= 1:
        results = [run_case(t) for t in tasks]
    else:
        # a case's policies run on one worker, which generates its requests once
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            results = list(ex.map(run_case, tasks, chunksize=len(names)))
    out: list[dict[str, Result]] = []
    for i, _ in enumerate(cs):
        out.append(dict(zip(names, results[i * len(names):(i + 1) * len(names)], strict=True)))
    return out


def summary(cs: Sequence[Case], by_case: Sequence[Mapping[str, Result]]) -> dict[str, Any]:
    """The family's JSON figures: the worst kvfleet ÷ best-peer ratio per quantile over every case, and the
    case that gives it; per workload, the worst p90 ratio."""
    worst: dict[str, Ratio] = {}
    per_workload: dict[str, float] = {}
    for c, runs in zip(cs, by_case, strict=True):
        for q, r in ratios(c, runs).items():
            if q not in worst or r.value > worst[q].value:
                worst[q] = r
            if q == "p90":
                per_workload[c.workload] = max(per_workload.get(c.workload, 0.0), r.value)
    out: dict[str, Any] = {}
    for q in ("p50", "p90", "p99", "mean"):
        out[f"family_worst_{q}_vs_best_peer"] = round(worst[q].value, 4)
        out[f"family_worst_{q}_vs_best_peer_at"] = worst[q].at
    out["family_worst_p90_vs_best_peer_by_workload"] = {w: round(v, 4) for w, v in per_workload.items()}
    hits = [runs["kvfleet"].hit_rate / max(1e-9, max(r.hit_rate for n, r in runs.items() if n in peers()))
            for runs in by_case]
    out["family_worst_hit_vs_best_peer"] = round(min(hits), 4)
    out["family_cases"] = len(cs)
    return out


#: the replicas the family runs against one picker (``--family``), and the one picker reseeded (its spread)
REPLICAS = "kvfleet-x3"
#: the ratio of a replica figure a case counts as over
REPLICA_OVER = 1.05


def vs_one(runs: Mapping[str, Result], name: str) -> dict[str, float]:
    """``name``'s TTFT quantiles and hit rate ÷ one kvfleet picker's, on one case."""
    one, other = runs["kvfleet"], runs[name]
    out = {q: other.ttft[q] / max(one.ttft[q], 1e-9) for q in QUANTILES}
    out["hit"] = other.hit_rate / max(one.hit_rate, 1e-9)
    return out


def replica_summary(cs: Sequence[Case], by_case: Sequence[Mapping[str, Result]]) -> dict[str, Any]:
    """Three replicas ÷ one picker over every case (the worst per quantile, its case, the lowest hit and the
    cases with p90, p99 or mean over :data:`REPLICA_OVER`), and the same for one picker whose ties break
    on another random sequence: how far a picker's own figures move when nothing but chance changes."""
    out: dict[str, Any] = {}
    for name, tag in ((REPLICAS, "replicas3"), (RESEEDED, "reseeded")):
        if not by_case or name not in by_case[0]:
            continue
        ratios = [vs_one(runs, name) for runs in by_case]
        for q in QUANTILES:
            i = max(range(len(cs)), key=lambda k: ratios[k][q])
            out[f"family_worst_{tag}_{q}_vs_1"] = round(ratios[i][q], 4)
            out[f"family_worst_{tag}_{q}_vs_1_at"] = cs[i].label
        out[f"family_worst_{tag}_hit_vs_1"] = round(min(r["hit"] for r in ratios), 4)
        out[f"family_{tag}_cases_over"] = sum(
            1 for r in ratios if max(r["p90"], r["p99"], r["mean"]) > REPLICA_OVER)
    return out


def print_case(c: Case, runs: Mapping[str, Result]) -> None:
    rs = ratios(c, runs)
    k = runs["kvfleet"]
    orc = runs.get(ORACLE)
    print(f"  {c.label:<44} hit {k.hit_rate:.3f} p50 {k.ttft['p50']:6.3f} mean {k.ttft['mean']:6.3f} "
          f"p90 {k.ttft['p90']:6.3f} p99 {k.ttft['p99']:6.3f} | ÷ best peer "
          + " ".join(f"{q} {rs[q].value:5.2f}" for q in QUANTILES)
          + (f" | p90 ÷ oracle {k.ttft['p90'] / max(orc.ttft['p90'], 1e-9):5.2f}" if orc else "")
          + (" | x3 ÷ 1 " + " ".join(f"{q} {v:4.2f}" for q, v in vs_one(runs, REPLICAS).items() if q != "hit")
             if REPLICAS in runs else ""))


#: requests per case and seeds per (workload, load, cache): quick, full
SIZE = {"quick": (2000, 2), "full": (5000, 4)}


def main(quick: bool, pods: int, seeds: int, jobs: int, knobs: Knobs, workloads: Sequence[str] = ()) -> int:
    """``python -m bench.routing --family``: every case, a line per case, the worst ratios, one JSON line."""
    t0 = time.perf_counter()
    n, default_seeds = SIZE["quick" if quick else "full"]
    unknown = set(workloads) - set(GENERATORS)
    if unknown:
        raise SystemExit(f"bench.routing: unknown workloads {sorted(unknown)}; "
                         f"known: {', '.join(GENERATORS)}")
    cs = cases(pods, seeds or default_seeds, n, tuple(workloads) or tuple(GENERATORS),
               LOADS["quick" if quick else "full"])
    extra = [REPLICAS, RESEEDED]
    names = [*peers(), ORACLE, "kvfleet", *extra]
    print(f"family: {len(cs)} cases ({len(cs) * len(names)} simulations on {jobs} processes), "
          f"{n} requests each (ρ: no-cache utilisation, ρ*: utilisation at the one-node ideal hit); "
          f"{REPLICAS}: three EPP replicas (gossip {1e3 * KvfleetReplicas.GOSSIP_DELAY_S:g} ms late), "
          f"{RESEEDED}: one picker with other tie-breaks",
          flush=True)
    by_case = run_family(cs, knobs, jobs, extra)
    for w in dict.fromkeys(c.workload for c in cs):
        print(f"\n{w}: kvfleet, and kvfleet ÷ the best peer per quantile")
        for c, runs in zip(cs, by_case, strict=True):
            if c.workload == w:
                print_case(c, runs)
    out: dict[str, Any] = {"bench": "routing", "family": True, "quick": quick, "pods": pods}
    out |= summary(cs, by_case)
    out |= replica_summary(cs, by_case)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print()
    for q in ("p50", "p90", "p99", "mean"):
        print(f"worst {q:>4} kvfleet ÷ best peer {out[f'family_worst_{q}_vs_best_peer']:.3f} at "
              f"{out[f'family_worst_{q}_vs_best_peer_at']}")
    for tag, what in (("replicas3", "3 replicas ÷ 1"), ("reseeded", "1 reseeded ÷ 1")):
        print(f"{what}: worst " + ", ".join(
            f"{q} {out[f'family_worst_{tag}_{q}_vs_1']:.3f} ({out[f'family_worst_{tag}_{q}_vs_1_at']})"
            for q in ("p90", "p99", "mean"))
            + f"; hit ≥ {out[f'family_worst_{tag}_hit_vs_1']:.3f}; cases with p90, p99 or mean over "
              f"{REPLICA_OVER}: {out[f'family_{tag}_cases_over']} of {len(cs)}")
    print(json.dumps(out, ensure_ascii=False))
    return 0
