"""bench.gossip — how fresh a replica's view of its peer's picks is when it routes, and what gossip costs.

Two EPP replicas' gossip (:class:`kvfleet.epp.gossip.ReplicaGossip`: real ZMQ over loopback, msgpack, the
receiving :class:`~kvfleet.epp.gossip.PeerApplier` on a real index and in-flight tracker, the gossip
thread) in two processes. The publishing process plays an EPP's pick path: each decision holds the GIL for
``--decision-ms`` of work (the picker's own, ≈ 0.5 ms), then opens the request's ticket and publishes its
pick as the router does (the ticket's ``open``, then the pick with its
:class:`~kvfleet.epp.index.PickOrigin`, then the decision's end); the first token comes ``FIRST_S`` later
and the stream ends ``CLOSE_S`` after that (two more ticket changes). The receiving process stamps each
pick when its applier takes it, in one of three modes:

* ``idle``: it routes nothing; its gossip thread applies what comes (one go per
  :data:`~kvfleet.epp.gossip.APPLY_WINDOW_S`: nothing needs them before a decision);
* ``busy, thread``: it routes the same pattern at the same instants (a storm reaches every replica), each
  decision ``--decision-ms`` of GIL-held work, and only its gossip thread applies (the baseline: the release
  before applied peers' messages this way, and sent its own from that thread too);
* ``busy, pick path``: the same, applying what has come before each decision
  (:meth:`~kvfleet.epp.gossip.ReplicaGossip.receive`, as the router does).

Two arrival patterns: ``poisson`` (``--rate`` decisions/s) and ``burst`` (``BURST`` decisions back to back
every ``BURST_GAP_S``: a storm's front). Printed per pattern and mode: the latency from a pick's
publication to its application on the peer (p50 / p90 / p99, ms); on a peer that routes, what its
decisions missed: at each decision, the age of the oldest pick published before it and not applied by then
(0 when none; p90 / p99, ms: a pick applied between two decisions and one applied as the second begins
count alike, the second is what a decision sees); messages per decision, the pick path's
own cost per decision (publishing and flushing on the sender; receiving and applying on the receiver, µs
of wall time in those calls) and the receiver's gossip thread CPU per decision. Last line: one JSON object,
``gossip_{pattern}_{p50,p90,p99}_ms`` (busy, pick path), ``gossip_{pattern}_stale_{p90,p99}_ms`` (what its
decisions missed; ``_thread_stale_`` the baseline's), ``gossip_{pattern}_p90_vs_thread`` (÷ the baseline),
``gossip_{pattern}_idle_p90_ms``, ``gossip_publish_us``, ``gossip_receive_us``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvfleet.cache import threadnames
from kvfleet.demo.stack import free_port
from kvfleet.epp.gossip import Pick, ReplicaGossip
from kvfleet.epp.index import BlockIndex, PickOrigin
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.speculative import spec_positions

PODS = [f"pod-{i}" for i in range(16)]
#: a decision's ticket gets its first token this long after the pick, and its stream ends this long after that
FIRST_S = 0.03
CLOSE_S = 0.2
BURST = 50
BURST_GAP_S = 0.25
#: receiver modes: (label, routes, applies before each decision)
MODES = (("idle", False, False), ("busy, thread", True, False), ("busy, pick path", True, True))
THREAD = "epp-gossip"


def _gossip_cpu() -> float:
    """CPU seconds of this process's gossip thread (by its OS name; the kernel counts in ticks)."""
    return sum(cpu for name, cpu in threadnames.thread_cpu().values() if name == THREAD)


def _spin(seconds: float) -> None:
    """Hold the GIL ``seconds``, as a decision's work does."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def arrivals(pattern: str, seconds: float, rate: float, rng: random.Random) -> list[float]:
    """Decision times (s from the start)."""
    out: list[float] = []
    if pattern == "poisson":
        t = rng.expovariate(rate)
        while t < seconds:
            out.append(t)
            t += rng.expovariate(rate)
    else:
        t = 0.0
        while t < seconds:
            out.extend(t + 1e-4 * k for k in range(BURST))  # one after the other, as fast as they are decided
            t += BURST_GAP_S
    return out


def _wait_until(t0: float, at: float, later: list[tuple[float, Callable[[], None]]]) -> None:
    """An event loop's idle time: run what falls due (first tokens, stream ends) until ``at``."""
    while True:
        now = time.monotonic() - t0
        while later and later[0][0] <= now:
            later.pop(0)[1]()
        if now >= at:
            return
        time.sleep(min(at - now, later[0][0] - now if later else at - now, 0.001))


@dataclass(frozen=True)
class Setup:
    pattern: str
    seconds: float
    rate: float
    decision_s: float
    seed: int
    switch_s: float


def _receiver(port: int, peer: int, setup: Setup, routes: bool, pick_path: bool, conn: Connection) -> None:
    """The receiving replica: applies what its peer sends (stamping each pick), routing or not."""
    threadnames.configure()
    sys.setswitchinterval(setup.switch_s)
    g = ReplicaGossip(BlockIndex(), host="127.0.0.1", port=port, peers=[f"127.0.0.1:{peer}"], ttl_s=30.0,
                      known_pod=lambda pod: True, tracker=InflightTracker(), replica="receiver")
    stamps: dict[int, float] = {}
    applier = g.peers_applier
    take = applier.pick

    def pick(origin: str, p: Pick) -> str:
        stamps[p.ticket] = time.monotonic()
        return take(origin, p)

    applier.pick = pick  # type: ignore[assignment]
    g.start()
    conn.send("ready")
    conn.recv()  # the run starts
    t0 = time.monotonic()
    cpu0 = _gossip_cpu()
    spent, calls = 0.0, 0
    decided: list[float] = []  # when each decision routed (with what was applied by then)
    if routes:
        rng = random.Random(setup.seed + 1)
        for at in arrivals(setup.pattern, setup.seconds, setup.rate, rng):
            _wait_until(t0, at, [])
            if pick_path:
                c = time.perf_counter()
                g.receive()
                spent += time.perf_counter() - c
                calls += 1
            decided.append(time.monotonic())
            _spin(setup.decision_s)
    conn.recv()  # the run ended (and its last messages had time to come)
    conn.send((stamps, decided, _gossip_cpu() - cpu0, spent / max(1, calls)))
    g.stop()


@dataclass
class Run:
    pattern: str
    mode: str
    latency_ms: np.ndarray
    #: per decision of a routing peer, the age of the oldest pick published before it and not applied (ms)
    stale_ms: np.ndarray
    decisions: int
    sent_messages: int
    receiver_thread_cpu_s: float
    publish_s: float
    receive_s: float

    def q(self, p: float) -> float:
        return _quantile(self.latency_ms, p)

    def stale(self, p: float) -> float:
        return _quantile(self.stale_ms, p)


def _quantile(x: np.ndarray, p: float) -> float:
    return float(np.quantile(x, p)) if len(x) else float("nan")


def missed(published: dict[int, float], applied: dict[int, float], decided: list[float]) -> np.ndarray:
    """At each decision (its time), the age in ms of the oldest pick published before it and not applied by
    then (0 when none). One clock: ``time.monotonic`` is the system's in every process."""
    ids = list(published)
    pub = np.array([published[i] for i in ids])
    got = np.array([applied.get(i, np.inf) for i in ids])
    out = np.zeros(len(decided))
    for k, d in enumerate(decided):
        late = pub[(pub < d) & (got > d)]
        if len(late):
            out[k] = 1e3 * (d - float(late.min()))
    return out


def run_one(setup: Setup, mode: str, routes: bool, pick_path: bool) -> Run:
    ctx = mp.get_context("spawn")
    port, peer_port = free_port(), free_port()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(peer_port, port, setup, routes, pick_path, there), daemon=True)
    proc.start()
    tracker = InflightTracker()
    g = ReplicaGossip(BlockIndex(), host="127.0.0.1", port=port, peers=[f"127.0.0.1:{peer_port}"], ttl_s=30.0,
                      known_pod=lambda pod: True, tracker=tracker, replica="sender")
    tracker.on_ticket = g.publish_ticket
    g.start()
    try:
        if not here.poll(30):
            raise RuntimeError("gossip bench: the receiving replica did not start")
        here.recv()
        deadline = time.monotonic() + 10
        while g.live_peers < 1 and time.monotonic() < deadline:  # both sides connected: heartbeats seen
            time.sleep(0.05)
        time.sleep(0.2)
        rng = random.Random(setup.seed)
        later: list[tuple[float, Callable[[], None]]] = []
        published: dict[int, float] = {}
        sent0, spent = g.messages["sent"], 0.0
        here.send("start")
        t0 = time.monotonic()
        for at in arrivals(setup.pattern, setup.seconds, setup.rate, rng):
            _wait_until(t0, at, later)
            _spin(setup.decision_s)
            pod = rng.choice(PODS)
            keys = [rng.getrandbits(63) for _ in range(64)]
            c = time.perf_counter()
            t = tracker.open((pod,), 0, 1000.0)
            sampled = [keys[i] for i in spec_positions(len(keys))]
            g.publish(pod, sampled, len(keys), PickOrigin(t.id, 0.5, "p"))
            g.flush()
            spent += time.perf_counter() - c
            published[t.id] = time.monotonic()
            now = time.monotonic() - t0
            later.extend(((now + FIRST_S, t.first_byte), (now + FIRST_S + CLOSE_S, t.close)))
            later.sort(key=lambda x: x[0])
        for _, f in later:
            f()
        time.sleep(0.3)
        sent = g.messages["sent"] - sent0
        here.send("end")
        stamps, decided, rcpu, receive_s = here.recv()
    finally:
        g.stop()
        proc.join(10)
    lat = np.array([1e3 * (stamps[i] - t) for i, t in published.items() if i in stamps])
    if len(lat) < len(published):
        raise RuntimeError(f"gossip bench: {len(published) - len(lat)} of {len(published)} picks not applied")
    n = max(1, len(published))
    return Run(setup.pattern, mode, lat, missed(published, stamps, decided), len(published), sent, rcpu,
               spent / n, receive_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gossip", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1.5 s per run instead of 4 s")
    ap.add_argument("--rate", type=float, default=400.0, help="decisions/s of the poisson pattern")
    ap.add_argument("--decision-ms", type=float, default=0.5,
                    help="the pick path's work per decision (GIL held)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--switch-interval-ms", type=float, default=0.0,
                    help="the interpreter's switch interval in both processes (0: Python's, 5 ms)")
    args = ap.parse_args(argv)
    threadnames.configure()
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    seconds = 1.5 if args.quick else 4.0
    print(f"gossip between two replicas on loopback: {args.decision_ms:g} ms of work per decision, switch "
          f"interval {1e3 * sys.getswitchinterval():g} ms, {seconds:g} s per run", flush=True)
    print(f"  {'pattern':8s} {'receiver':16s} {'picks':>6s} {'p50 ms':>7s} {'p90 ms':>7s} {'p99 ms':>7s} "
          f"{'missed p90':>10s} {'missed p99':>10s} {'msgs/pick':>9s} {'publish µs':>10s} "
          f"{'receive µs':>10s} {'recv thread µs':>14s}", flush=True)
    runs: dict[tuple[str, str], Run] = {}
    for pattern in ("poisson", "burst"):
        setup = Setup(pattern, seconds, args.rate, args.decision_ms / 1e3, args.seed, sys.getswitchinterval())
        for mode, routes, pick_path in MODES:
            r = run_one(setup, mode, routes, pick_path)
            runs[pattern, mode] = r
            n = max(1, r.decisions)
            print(f"  {pattern:8s} {mode:16s} {r.decisions:6d} {r.q(0.5):7.3f} {r.q(0.9):7.3f} "
                  f"{r.q(0.99):7.3f} {r.stale(0.9):10.3f} {r.stale(0.99):10.3f} "
                  f"{r.sent_messages / n:9.2f} {1e6 * r.publish_s:10.1f} "
                  f"{1e6 * r.receive_s if pick_path else float('nan'):10.1f} "
                  f"{1e6 * r.receiver_thread_cpu_s / n:14.1f}", flush=True)
    out: dict[str, Any] = {"bench": "gossip", "quick": args.quick}
    for pattern in ("poisson", "burst"):
        d, base, idle = runs[pattern, MODES[2][0]], runs[pattern, MODES[1][0]], runs[pattern, MODES[0][0]]
        for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            out[f"gossip_{pattern}_{q}_ms"] = round(d.q(p), 4)
        for q, p in (("p90", 0.9), ("p99", 0.99)):
            out[f"gossip_{pattern}_stale_{q}_ms"] = round(d.stale(p), 4)
            out[f"gossip_{pattern}_thread_stale_{q}_ms"] = round(base.stale(p), 4)
        out[f"gossip_{pattern}_p90_vs_thread"] = round(d.q(0.9) / max(1e-9, base.q(0.9)), 4)
        out[f"gossip_{pattern}_thread_p90_ms"] = round(base.q(0.9), 4)
        out[f"gossip_{pattern}_idle_p90_ms"] = round(idle.q(0.9), 4)
        out[f"gossip_{pattern}_messages_per_pick"] = round(d.sent_messages / max(1, d.decisions), 3)
    every = list(runs.values())
    out["gossip_publish_us"] = round(1e6 * float(np.mean([r.publish_s for r in every])), 2)
    receiving = [r.receive_s for r in every if r.mode == MODES[2][0]]
    out["gossip_receive_us"] = round(1e6 * float(np.mean(receiving)), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
