"""The built-in filters, scorers and pickers. Each docstring is the plugin's contract and formula.

Scorers are in **seconds** (of prefill saved or of queueing suffered) so that
the profile's weighted sum is the cost model's TTFT estimate with its sign
flipped: with weights 1, ``score = hit_s − queue_s − w_kv·kv``.

The plugins read the candidates' columns (:func:`~kvfleet.epp.scheduling.framework.column`), not one
object per candidate: a cycle builds the :class:`Candidate` objects of the picker's order only.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from kvfleet.epp.scheduling.framework import Candidate, Candidates, SchedulingRequest, column, register


@register("ready-filter", "filter")
class ReadyFilter:
    """Keeps pods marked ready by the datastore."""

    def __init__(self, params: Mapping[str, float]) -> None:
        pass

    def filter(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        ready = [p.ready for p in column(cands, "pod")]
        if all(ready):
            return cands
        return Candidates.of(cands).take([i for i, r in enumerate(ready) if r])


@register("saturation-filter", "filter")
class SaturationFilter:
    """Drops pods with ``waiting ≥ max_waiting`` (fresh metrics, else the picker's pending requests);
    keeps all when every pod is saturated (the pool-level spill and shedding decide then)."""

    def __init__(self, params: Mapping[str, float]) -> None:
        self.max_waiting = float(params.get("max_waiting", 32))

    def filter(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        below = waiting(cands) < self.max_waiting
        if below.all() or not below.any():
            return cands
        return Candidates.of(cands).take(np.flatnonzero(below).tolist())


def waiting(cands: Sequence[Candidate]) -> npt.NDArray[np.float64]:
    """The requests waiting on each candidate's pod: ``max(waiting, pending_requests)`` with fresh metrics
    (the engine's count, at least the picker's pending), else ``pending_requests``."""
    pending = column(cands, "pending_requests")
    return np.array([max(pm.waiting, n) if pm is not None else float(n)
                     for pm, n in zip(column(cands, "metrics"), pending, strict=True)], dtype=np.float64)


def mean_queue_rho(req: SchedulingRequest, cands: Sequence[Candidate]) -> float:
    """``ρ = q̄ / (q̄ + prefill_s(request))`` with ``q̄`` the candidates' mean queued prefill seconds (0 when
    idle)."""
    if not cands:
        return 0.0
    q = sum(column(cands, "pending_tokens")) / len(cands) * req.prefill_s_per_token
    return q / (q + req.prefill_s) if q > 0 else 0.0


#: seconds a request costs an engine beyond its prefill: at least one engine step (the queue scorer's
#: ``overhead_s`` default and the followers' load)
STEP_S = 0.01


def followers(req: SchedulingRequest, cands: Sequence[Candidate], step_s: float = STEP_S) -> list[float]:
    """The hot prefix's requests waiting on each candidate that a copy of the prefix elsewhere would relieve:
    ``same_prefix``, except while the pod is still computing the prefix (only the picker's speculative
    entries vouch for its hit: ``spec_blocks ≥ hit_blocks``) for followers that come slower than it serves
    them (``ρ_f = prefix_arrivals · step_s + prefix_rate · prefill_s_per_token < 1``: their requests and
    uncached tokens per second, :attr:`~kvfleet.epp.inflight.PodView.prefix_rate`) and no other
    candidate could have a copy ready before the pod's queue is through (its queued prefill seconds, as
    the queue scorer counts them with ``overhead_s = step_s``, plus the prefill of the blocks it lacks of the
    longest held prefix): then 0.

    A copy started now is ready after a whole prefill; the holder started the same prefill earlier and
    finishes it first, then serves its followers as they come and its queue drains. Each follower then has
    the seeds' choice to make on its own (the wait there against recomputing elsewhere), and a hit damped
    below that wait sent it to recompute: the readers of a new long document queued behind its first
    prefill (ρ_f ≈ 0.5) recomputed it on an idle pod, 2.68 s against a 2.2 s wait, and the workload
    family's documents had TTFT p99 1.16 × the best peer's. A holder whose own queue is longer than a
    copy elsewhere takes is not through first, and followers piled there near saturation (agent trees at
    ρ* 0.5 on 8 pods: p90 1.33 ×). Followers coming faster than the holder serves them (ρ_f from 4 to 134
    over 90 % of the family's storm decisions) grow its queue for as long as they come, and a copy serves
    those that follow: undamped, the family's storms went to p99 1.23 × the best peer's. Once the prefix is
    cached (its KV events arrived) the damping is as before: off there too for slow followers, an agent
    tree's sibling branches piled onto its holder (TTFT p90 1.54 × on the family's agents at ρ* 0.5 with
    250-block caches on 8 pods; ``docs/epp.md``)."""
    if isinstance(cands, Candidates):  # the prefix and recompute-load scorers both read it in one cycle
        return cands.memo(("followers", id(req), step_s), lambda: _followers(req, cands, step_s))
    return _followers(req, cands, step_s)


def _followers(req: SchedulingRequest, cands: Sequence[Candidate], step_s: float) -> list[float]:
    same = column(cands, "same_prefix")
    out = [float(x) for x in same]
    waiting = [i for i, x in enumerate(same) if x]
    if not waiting:
        return out
    per_token = req.prefill_s_per_token
    spec, hits = column(cands, "spec_blocks"), column(cands, "hit_blocks")
    arrivals, rates = column(cands, "prefix_arrivals"), column(cands, "prefix_rate")
    spared = [i for i in waiting if spec[i] >= hits[i] and arrivals[i] * step_s + rates[i] * per_token < 1.0]
    if not spared:
        return out
    block_s = req.block_size * per_token
    queue = [t * per_token + k * step_s - e
             for t, k, e in zip(column(cands, "pending_tokens"), column(cands, "pending_requests"),
                                column(cands, "pending_elapsed_s"), strict=True)]
    queue = [q if q > 0.0 else 0.0 for q in queue]
    top = max(hits)
    # when a copy of the longest held prefix would be ready on each pod: the two soonest, so that each
    # spared candidate compares itself with the soonest other
    ready = [q + (top - h) * block_s for q, h in zip(queue, hits, strict=True)]
    soonest = min(ready)
    first = ready.index(soonest)
    others = ready[:first] + ready[first + 1:]
    second = min(others) if others else 0.0
    for i in spared:
        if (second if i == first else soonest) >= queue[i]:
            out[i] = 0.0
    return out


def followups(req: SchedulingRequest, bound: float) -> float:
    """``F = min(bound, f / (1 − f))``: the requests expected to follow this one to its pod, ``f`` the share
    of the pool's recent prompts a live pick covered (:class:`QueueScorer`)."""
    f = min(1.0, max(0.0, req.followup_share))
    return bound if f >= 1.0 else min(bound, f / (1.0 - f))


@register("prefix-cache-scorer", "scorer")
class PrefixCacheScorer:
    """Prefill seconds the pod's cached prefix saves, damped on hot spots.

    ``hit_s = hit_weighted · block_size · prefill_s_per_token · gain / (1 + β · followers)``
    where ``hit_weighted = Σ over matched prefix blocks of weight(tier)`` and
    ``weight(tier) = max(0, 1 − load_s_per_token(tier) / prefill_s_per_token)``
    (a CPU/SSD hit is worth what it saves after its load cost); ``followers`` the
    picker's requests on the pod for the same longest-matched prefix that are still
    waiting for their first token (the router's hot key; seed 5.4: without it every
    same-prefix request piles onto one pod), not counted while the pod is still computing
    the prefix for followers slower than it (:func:`followers`), ``β`` = hotspot_beta
    (param ``beta`` overrides it).

    With the queue scorer this is the seeds' rule: a request goes to the pod holding
    its prefix while the wait there costs less than recomputing the prefix elsewhere.
    ``gain`` (param ``load_gain`` ``g``, default 0: ``gain = 1``) values hits above
    the latency they save under load, ``gain = 1 + g·ρ`` with ``ρ = q̄ / (q̄ + prefill_s)``
    and ``q̄`` the candidates' mean queued prefill seconds, on pods with no queued
    request of the prefix. It was on by default (``g = 20``) until the workload family
    of ``bench.routing --family`` showed what it does off the configs it was tuned on:
    ``ρ`` is near 1 for any short follow-up behind any queue, so a held prefix was worth
    up to 21 × its prefill and sessions, agents and documents piled onto their holders
    (TTFT p90 up to 14 × the best peer's; ``docs/epp.md``).
    """

    def __init__(self, params: Mapping[str, float]) -> None:
        self.beta = params.get("beta")
        self.load_gain = float(params.get("load_gain", 0.0))

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        beta = req.hotspot_beta if self.beta is None else float(self.beta)
        unit = req.block_size * req.prefill_s_per_token
        gain = 1.0 + self.load_gain * mean_queue_rho(req, cands) if self.load_gain else 1.0
        return [x * unit / (1.0 + beta * f) if same else x * unit * gain
                for x, same, f in zip(column(cands, "hit_weighted"), column(cands, "same_prefix"),
                                      followers(req, cands), strict=True)]


@register("queue-scorer", "scorer")
class QueueScorer:
    """Minus the seconds of prefill queued on the pod ahead of this request.

    ``queue_s = max(0, pending_tokens · prefill_s_per_token + pending_requests · overhead_s − elapsed_s)
    + expected_weight · expected_wait_s + running · running_s
    + max(0, waiting − scrape_pending) · prefill_s(request)``
    where ``pending_tokens`` are the predicted uncached tokens of the picker's own
    ``pending_requests`` not yet answered (each also costs ``overhead_s``, param,
    default 0.01 s: at least one engine step), ``elapsed_s`` the seconds the pod has
    already worked on them (``Candidate.pending_elapsed_s``: a work-conserving server has
    done that much of the queued work, in whatever order; without it a pod deep into a
    long prefill looked as loaded as when it took it), ``running`` its requests already decoding there
    (each slows a new prefill by ``running_s``, param, default 0.01 s: the
    decode steps interleaved with it), and ``waiting`` (fresh metrics only) adds
    requests the picker did not route, each assumed as long as this one: ``scrape_pending``
    is how many of the picker's own requests were waiting when ``waiting`` was scraped
    (``pending_requests`` when unknown). Subtracting the pending count *now* instead
    turned each of the picker's requests whose first token came back since the scrape
    into a phantom foreign request costing a whole prefill, which overrode hits of
    thousands of tokens (``docs/epp.md``).

    ``expected_wait_s`` is the wait the pod's recent busy time predicts (``Candidate.expected_wait_s``, at
    most its mean prefill): a new context stays where it is placed and its later requests meet the pod's
    load, which the instantaneous queue (empty most of the time below saturation) does not show. It counts
    ``expected_weight · (1 + F)`` times (param ``expected_weight``, default 1): once for this request and
    once for each of the ``F`` requests expected to follow it there while the pod's recent load still
    predicts theirs, ``F = min(max_followups, f / (1 − f))`` with ``f`` the share of the pool's recent
    prompts a live pick covered (``SchedulingRequest.followup_share``: how often a request follows an
    earlier one within the speculative TTL; a chain of follow-ups each coming with probability ``f`` has
    ``f / (1 − f)`` of them on average). Counted once, the next steps an agent tree's placement attracts
    were free, and the trees piled onto busy pods (TTFT p90 up to 1.31 × GIE's picker on the workload
    family). The bound (param ``max_followups``, default 4): beyond a few follow-ups the pods' loads have
    moved on; with 8 or none, documents read by many close readers were copied to idle pods to escape a
    wait shorter than their recompute (``docs/epp.md``).
    """

    def __init__(self, params: Mapping[str, float]) -> None:
        self.running_s = float(params.get("running_s", 0.01))
        self.overhead_s = float(params.get("overhead_s", STEP_S))
        self.expected = float(params.get("expected_weight", 1.0))
        self.max_followups = max(0.0, float(params.get("max_followups", 4.0)))

    def followups(self, req: SchedulingRequest) -> float:
        """``F``: the requests expected to follow this one to its pod (the class doc)."""
        return followups(req, self.max_followups)

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        out = []
        expected = self.expected * (1.0 + self.followups(req))
        per_token, overhead, running = req.prefill_s_per_token, self.overhead_s, self.running_s
        prefill = req.prefill_s
        for n, tokens, elapsed, wait, inflight, pm, scraped in zip(
                column(cands, "pending_requests"), column(cands, "pending_tokens"),
                column(cands, "pending_elapsed_s"), column(cands, "expected_wait_s"),
                column(cands, "inflight"), column(cands, "metrics"), column(cands, "scrape_pending"),
                strict=True):
            q = tokens * per_token + n * overhead - elapsed  # max(0, x) written out: runs for every candidate
            q = (q if q > 0.0 else 0.0) + expected * wait
            if inflight > n:
                q += (inflight - n) * running
            if pm is not None:
                foreign = pm.waiting - (n if scraped is None else scraped)
                if foreign > 0.0:
                    q += foreign * prefill
            out.append(-q)
        return out


@register("prefix-affinity-scorer", "scorer")
class PrefixAffinityScorer:
    """``affinity_s`` seconds (param, default 0.02) for the prefix shard's home, 0 for the others.

    The home is the pod that ranks first by rendezvous hashing (``xxh3(pod name, seed = shard)``) among
    the pods that hold the shard's prefix (its first ``min(K, n)`` blocks, or as many of them as any pod
    holds); when none holds any of it, among the pods whose GPU tier holds nothing yet; else among all.
    Keeps a prefix family on one pod when nothing else separates the candidates (several hold the same
    amount, or none holds it), so its next requests find it cached instead of scattering copies over
    the pool.

    Every input is the exact index's (the same on every EPP replica, as each receives every pod's KV
    events) and the candidates' names, so replicas agree on a shard's home. The hash over all pods alone
    put several families on one pod while others stood empty (seven applications over twelve pods: two on
    one pod, four pods idle); a family that already has a holder keeps it, a new one starts on an empty pod.
    """

    def __init__(self, params: Mapping[str, float]) -> None:
        self.affinity_s = float(params.get("affinity_s", 0.02))
        #: (shard, candidate names) → positions by rank, best first (a prefix family repeats its shard)
        self._order: dict[tuple[int, tuple[str, ...]], tuple[int, ...]] = {}

    def _ranked(self, shard: int, names: tuple[str, ...]) -> tuple[int, ...]:
        order = self._order.get((shard, names))
        if order is None:
            seed = shard & 0xFFFFFFFFFFFFFFFF
            ranks = [xxhash.xxh3_64_intdigest(n.encode(), seed=seed) for n in names]
            order = tuple(sorted(range(len(names)), key=ranks.__getitem__, reverse=True))
            if len(self._order) >= 4096:
                self._order.clear()
            self._order[shard, names] = order
        return order

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        if not cands:
            return []
        names = tuple(cands.names if isinstance(cands, Candidates) else [c.pod.name for c in cands])
        order = self._ranked(req.shard, names)
        hits = column(cands, "hit_blocks")
        most = max(hits)
        top = order[0]
        if most > 0:
            need = min(req.shard_blocks, most) if req.shard_blocks > 0 else most
            top = next(i for i in order if hits[i] >= need)
        else:
            held = column(cands, "held_blocks")
            top = next((i for i in order if held[i] == 0), top)
        out = [0.0] * len(cands)
        out[top] = self.affinity_s
        return out


@register("kv-cache-utilization-scorer", "scorer")
class KVUtilizationScorer:
    """Minus the pod's KV-cache utilisation (``vllm:kv_cache_usage_perc``, 0..1; 0 when stale)."""

    def __init__(self, params: Mapping[str, float]) -> None:
        pass

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        return [-(pm.kv_usage if pm is not None else 0.0) for pm in column(cands, "metrics")]


@register("least-inflight-scorer", "scorer")
class LeastInflightScorer:
    """Minus the picker's in-flight requests on the pod (least-load routing on its own)."""

    def __init__(self, params: Mapping[str, float]) -> None:
        pass

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        return [-float(n) for n in column(cands, "inflight")]


@register("max-score-picker", "picker")
class MaxScorePicker:
    """Highest total score first; ties go to fewer in-flight requests, then at random.
    Returns the pick plus up to ``fallbacks`` next-best pods."""

    def __init__(self, params: Mapping[str, float]) -> None:
        self.fallbacks = int(params.get("fallbacks", 2))
        self._rng = random.Random(int(params.get("seed", 0)))

    def pick(self, req: SchedulingRequest, cands: Sequence[Candidate],
             scores: Sequence[float]) -> list[Candidate]:
        if len(scores) != len(cands):
            raise ValueError(f"{len(scores)} scores for {len(cands)} candidates")
        rnd = self._rng.random  # one draw per candidate, in candidate order: ties break the same way always
        draws = [rnd() for _ in scores]
        k = 1 + self.fallbacks
        near: Sequence[int] = range(len(scores))
        if len(scores) > 4 * k:
            # keys only for the candidates that can rank among the first k: round(s, 9) is monotone and moves
            # a score by at most 0.5e-9, so a score more than 1e-8 below the k-th highest ranks below it
            floor = heapq.nlargest(k, scores)[-1] - 1e-8
            if floor == floor:  # not NaN
                near = [i for i, s in enumerate(scores) if s >= floor]
        inflight = column(cands, "inflight")
        keys = {i: (-round(scores[i], 9), inflight[i], draws[i]) for i in near}
        return [cands[i] for i in heapq.nsmallest(k, near, key=keys.__getitem__)]


@register("random-picker", "picker")
class RandomPicker:
    """A uniformly random order (baseline); ``fallbacks`` as for max-score-picker."""

    def __init__(self, params: Mapping[str, float]) -> None:
        self.fallbacks = int(params.get("fallbacks", 2))
        self._rng = random.Random(int(params.get("seed", 0)))

    def pick(self, req: SchedulingRequest, cands: Sequence[Candidate],
             scores: Sequence[float]) -> list[Candidate]:
        order = list(cands)
        self._rng.shuffle(order)
        return order[: 1 + self.fallbacks]


@register("round-robin-picker", "picker")
class RoundRobinPicker:
    """Candidates in turn (baseline; scores ignored); ``fallbacks`` as for max-score-picker.

    One turn counter per candidate set: a P/D pick's second cycle (over the prefill
    pods) must not advance the serving pods' turn, or they are not served evenly."""

    def __init__(self, params: Mapping[str, float]) -> None:
        self.fallbacks = int(params.get("fallbacks", 2))
        self._next: dict[tuple[str, ...], int] = {}

    def pick(self, req: SchedulingRequest, cands: Sequence[Candidate],
             scores: Sequence[float]) -> list[Candidate]:
        if not cands:
            return []
        order = sorted(cands, key=lambda c: c.name)
        names = tuple(c.name for c in order)
        turn = self._next.get(names, 0)
        self._next[names] = turn + 1
        i = turn % len(order)
        return (order[i:] + order[:i])[: 1 + self.fallbacks]


@register("recompute-load-scorer", "scorer")
class RecomputeLoadScorer:
    """Minus the delay a recompute puts on the pod's later requests.

    ``score = −(H − hit_weighted) · block_size · prefill_s_per_token · u / (1 − u) / (1 + β · Σ followers)``
    with ``H`` the largest ``hit_weighted`` among the candidates, ``u = min(max_busy, busy_share)`` the pod's
    recent utilisation (``Candidate.busy_share``; param ``max_busy``, default 0.8, so ``u / (1 − u) ≤ 4``)
    and ``Σ followers`` the picker's requests of the same hot key still waiting for their first token on
    all candidates, counted as the prefix scorer counts them (:func:`followers`; ``β`` = hotspot_beta).

    The prefix scorer prices a hit at the prefill it saves *this* request. Placed on a pod that lacks a prefix
    another candidate holds, the request also makes that pod compute the missing blocks, and on a busy pod
    that work delays every request arriving behind it while it runs: in an M/M/1 queue at utilisation ``u``,
    work ``S`` adds about ``S · u / (1 − u)`` to the waits of those who come after. An idle pod's spare
    capacity costs nobody anything, so the term is 0 there, and it is 0 for every candidate when none holds
    more than the others (a request that misses everywhere is placed by the queue alone). A hot prefix is
    worth a copy on another pod (the copy serves the requests that follow), so the term is damped by the
    requests of the prefix in flight as the prefix scorer damps a hit; undamped, the storm config's p90 went
    from 0.96 to 1.17 × the oracle's (1.04 damped) for the same family figures. Without it, near
    saturation the picker traded hits for a shorter queue on pods that were just as busy, the recomputes
    took the capacity the next requests queued for, and sessions at 8 pods waited 2 × longer than behind
    GIE's picker (``docs/epp.md``).

    ``u`` counts up to 0.8, not 0.5 as for the queue scorer's expected wait: that cap keeps the expected
    wait from counting the pod's known queue a second time, but nothing else counts the delay a recompute
    puts on the requests after it, and near saturation that delay is several times the recompute. Held at
    0.5 (the charge at most the recompute itself), a pool near its capacity traded hits for queues on pods
    just as busy, the recomputes deepened every queue, and sessions on 10 pods waited 1.8 × longer (mean)
    than behind GIE's picker, an overloaded agents case 1.28 × (``docs/epp.md``).
    """

    def __init__(self, params: Mapping[str, float]) -> None:
        self.max_busy = min(0.95, max(0.0, float(params.get("max_busy", 0.8))))

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        if not cands:
            return []
        hits = column(cands, "hit_weighted")
        top = max(hits)
        # a hot prefix (requests of it still waiting for their first token) is worth a copy on another pod
        unit = req.block_size * req.prefill_s_per_token / (1.0 + req.hotspot_beta
                                                           * sum(followers(req, cands)))
        mb = self.max_busy
        out = []
        for x, u in zip(hits, column(cands, "busy_share"), strict=True):
            if u > mb:
                u = mb
            out.append(-(top - x) * unit * u / (1.0 - u) if u > 0.0 else 0.0)
        return out


@register("copy-value-scorer", "scorer")
class CopyValueScorer:
    """The wait a copy of the hot prefix saves the requests that will follow it there.

    ``score = (N / (k + 1) − F) · (e_h − e_c) · (1 − u_c / max_busy)`` for a candidate ``c`` lacking the
    prefix the best candidates hold (``hit_weighted < H``), where it is positive (else 0; 0 on the holders),
    with

    - ``N`` the hot key's requests expected to follow (``SchedulingRequest.hot_followers``: its requests per
      second × the age of its popularity run, :meth:`~kvfleet.epp.inflight.InflightTracker.popularity`, the
      age counted up to ``COPY_HORIZON_S`` = 30 s: a popularity that has lasted ``t`` is expected to last
      about ``t`` more; 0 while the run is younger than ``COPY_MIN_AGE_S`` = 10 s, the pods' load history),
      of which a copy takes ``1 / (k + 1)``, ``k`` the candidates holding the prefix (copies still being
      computed included);
    - ``F`` the follow-ups the queue scorer already counts for every placement (:func:`followups`, param
      ``max_followups``, default 4, as the queue scorer's);
    - ``e_h − e_c`` the expected wait (``expected_wait_s``) each of them saves on ``c`` rather than the
      least loaded holder whose hit is not only speculative (none: 0 everywhere);
    - ``1 − u_c / max_busy`` the pod's spare capacity (``busy_share``; param ``max_busy``, default 0.5:
      nothing at half busy or more).

    The hot-spot damping makes a copy while requests of the prefix wait for their first token. A document
    read by many, once cached, has one or two of those at a time: each reader's wait at its holder stays
    below recomputing the document, and no copy was ever made, though the readers kept coming for
    minutes. Without this scorer a document read by 60 % of the requests stayed on one pod (the workload
    family's documents at ρ 0.95, seed 3: p90 0.116 s against 0.102 s). Each factor is pinned on 8 pods
    near capacity (``tests/epp/test_routing_family.py``): without the minimum age, an agent tree's burst
    of sibling steps counted as a popularity (agents at ρ* 0.5: p90 3.3 → 5.9 s); without ``− F``, the
    follow-ups the queue scorer weighs were counted twice (4.9 s); without the spare capacity, copies went
    to pods as busy as the holder (sessions at ρ* 0.5: p90 1.02 → 1.13 × GIE's; ``docs/epp.md``).
    """

    def __init__(self, params: Mapping[str, float]) -> None:
        self.max_followups = max(0.0, float(params.get("max_followups", 4.0)))
        self.max_busy = float(params.get("max_busy", 0.5))

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        n = req.hot_followers
        if not cands or n <= 0.0:
            return [0.0] * len(cands)
        hits = column(cands, "hit_weighted")
        top = max(hits)
        if top <= 0.0:
            return [0.0] * len(cands)
        waits = column(cands, "expected_wait_s")
        held = [w for x, w, sp, h in zip(hits, waits, column(cands, "spec_blocks"),
                                         column(cands, "hit_blocks"), strict=True) if x >= top and sp < h]
        if not held:
            return [0.0] * len(cands)
        eh = min(held)
        k = n / (sum(1 for x in hits if x >= top) + 1) - followups(req, self.max_followups)
        if k <= 0.0:
            return [0.0] * len(cands)
        mb = self.max_busy
        return [k * (eh - w) * (1.0 - u / mb) if x < top and w < eh and u < mb else 0.0
                for x, w, u in zip(hits, waits, column(cands, "busy_share"), strict=True)]


@register("eviction-cost-scorer", "scorer")
class EvictionCostScorer:
    """Minus the prefill seconds of the cached blocks the pick would evict from a full cache.

    ``evict = max(0, new_blocks − free_blocks)`` where ``new_blocks`` are the request's blocks the pod does
    not hold (the pick stores them) and ``free_blocks = capacity − held``: ``capacity`` from the pod's
    ``vllm:cache_config_info`` (``num_gpu_blocks × block_size`` tokens, in the picker's blocks; no score
    when the engine does not publish it), ``held`` the blocks the index holds for it.
    ``score = −evict · block_size · prefill_s_per_token``: a block a full cache gives up is worth what it
    cost to compute (what its next hit would have saved).

    The per-request rule of the other scorers (TTFT now) is blind to what a placement leaves behind: a new
    context written into a pod full of live sessions costs their next turns a recompute, the same context
    on an idle pod with free blocks costs nothing. Without this term the picker concentrated new sessions,
    agent tasks and documents on the few pods that held their system prompt while the others stayed
    empty, and copied whole documents over the contexts of other pods under load (``docs/epp.md``,
    workloads it was not tuned on).
    """

    def __init__(self, params: Mapping[str, float]) -> None:
        pass

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        unit = req.block_size * req.prefill_s_per_token
        blocks = -(-req.num_tokens // req.block_size)
        out = []
        capacities = Candidates.of(cands).capacity(req.block_size)
        for capacity, hit, held in zip(capacities, column(cands, "hit_blocks"), column(cands, "held_blocks"),
                                       strict=True):
            if capacity is None:
                out.append(0.0)
                continue
            free = capacity - held
            evict = blocks - hit - (free if free > 0 else 0)
            out.append(-evict * unit if evict > 0 else 0.0)
        return out
