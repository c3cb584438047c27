"""bench.chaos: the one-machine stack under steady load while its processes are killed and its inputs
abused.

The stack: four simulated engines (two unified pods and a prefill/decode pair, in one pool of two prefix
shards, each with a CPU tier), two EPP replicas (each subscribes to every pod's KV events; they gossip their
picks and in-flight load), one Envoy in front of both (ext_proc cluster health-checked, FailClose; pods
reached by ``routing="override_host"``, so a pick onto a pod that just died is retried on the picker's next
endpoint — the picker returns two fallbacks), all real processes on loopback. Clients stream
chat-style requests that share a few long system prompts; TTFT is the time to the first SSE chunk.

Faults, in this order (times after warm-up, ``--quick`` halves the gaps):

1. ``kill -9`` one EPP replica, restart it 2 s later;
2. ``kill -9`` a unified engine, restart it 3 s later on the same ports;
3. a rogue publisher joins the pods file: its KV events carry a token id ≥ 2^32, a malformed batch, a
   wrong topic and a 4 MiB batch (its HTTP port is dead, so no request is routed to it);
4. a flood of distinct 4k-token prompts at 4 × the steady concurrency.

Warm-up: steady load, then floods of as many distinct 4k-token prompts as the fault's flood until every
engine's KV-event replay buffer is ``REPLAY_FULL`` of its byte bound (at most ``MAX_WARM_FLOODS``), so every
cache and buffer is full before the baseline RSS is taken. Measured: ``lost_requests`` (failed requests
other than those in flight on a killed process at its kill — for a killed EPP replica, a stream opened on it
in the 0.1 s before Envoy could see it gone counts as in flight; ``lost_to_dead_engine`` counts the lost
requests the gateway sent to the killed engine within 1 s, before anything could know it was gone),
``failed_requests`` (all of them), ``index_freezes`` (a replica's KV-event batch counter for the live pods
standing still for ≥ 3 s while requests complete), ``epp_rss_growth`` and ``engine_rss_growth`` (the largest
RSS growth of any replica / engine from the end of warm-up to the end, as a fraction; both taken
``SETTLE_S`` after the last flood, under the steady load, and once every replica's KV-event ingestion has
caught up (``kvfleet_epp_kv_event_lag_seconds`` ≤ ``CAUGHT_UP_S`` on every live pod; ``catch_up_s`` says how
long that took; ``max_kv_event_lag_s`` is the largest lag seen after warm-up), each the least of its
readings over ``RSS_WINDOW_S`` (under the steady load): past the speculative TTL and the heap trim interval,
with no backlog of events queued, so what counts is memory a process keeps, not the flood's working set),
``resyncs`` (KV-event resyncs over both replicas), ``ttft_p99_ms``, ``ttft_p50_ms``.

Last line: ``{"bench": "chaos", "lost_requests", "failed_requests", "index_freezes", "epp_rss_growth",
"engine_rss_growth", "resyncs", "ttft_p50_ms", "ttft_p99_ms", "requests", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq

from bench._live import children
from kvfleet.config.epp import default_plugins
from kvfleet.demo.envoy import envoy_binary
from kvfleet.demo.stack import (
    Child,
    PodSpec,
    ProcessStack,
    engine_env,
    engine_settings,
    free_port,
    plan_pods,
    pods_file,
    write_yaml,
)
from kvfleet.epp.envoy import write_bootstrap

MODEL = "llama-3-8b"


@dataclass
class Record:
    start: float
    end: float
    ok: bool
    ttft: float | None
    error: str = ""


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    kills: list[tuple[str, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def rss_mb(pid: int) -> float:
    """Resident MB of a process and of its live descendants (the EPP's native gRPC front is its child)."""
    total = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total = int(line.split()[1]) / 1024.0
                break
    except OSError:
        return 0.0
    return total + sum(rss_mb(c) for c in children(pid))


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def metric_sum(text: str, name: str, exclude: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not exclude or exclude not in line):
            with contextlib.suppress(ValueError):
                total += float(line.split()[-1])
    return total


#: warm-up floods until every engine's KV-event replay buffer is this full (of its byte bound): a bounded
#: buffer filling up is the warm-up, not growth
REPLAY_FULL = 0.9
MAX_WARM_FLOODS = 8


def replay_fill(st: Stack) -> float:
    """The least full engine's replay buffer, as a fraction of its bound (0 when one cannot be read)."""
    fills = []
    for p in st.pods:
        text = scrape(f"http://127.0.0.1:{p.port}/metrics")
        cap = metric_sum(text, "kvfleet_engine_kv_event_replay_cap_bytes")
        fills.append(metric_sum(text, "kvfleet_engine_kv_event_replay_bytes{") / cap if cap else 0.0)
    return min(fills, default=0.0)


#: RSS is read once every replica's KV-event lag (kvfleet_epp_kv_event_lag_seconds) is at most this
CAUGHT_UP_S = 1.0
MAX_CATCH_UP_S = 240.0

def caught_up(st: Stack, what: str) -> tuple[float, float]:
    """Seconds until every replica's KV-event ingestion has caught up (lag ≤ ``CAUGHT_UP_S`` on each live
    pod), and the largest lag seen meanwhile: RSS is read then, so a backlog being worked through is not
    counted as kept memory."""
    t0 = time.monotonic()
    last = -1.0
    worst = 0.0
    while time.monotonic() - t0 < MAX_CATCH_UP_S:
        lags = [max_lag(scrape(f"http://127.0.0.1:{m}/metrics")) for _, (_, _, m) in st.epps]
        worst = max(worst, *lags)
        if all(lag <= CAUGHT_UP_S for lag in lags):
            break
        if time.monotonic() - last >= 10.0:
            last = time.monotonic()
            print(f"{what}: KV-event ingestion behind by {max(lags):.1f} s; waiting ...", file=sys.stderr,
                  flush=True)
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1), round(worst, 1)


#: RSS is the least of its readings over this window (longer than the heap trim interval: what a process
#: keeps, not the garbage it has yet to hand back), every 0.25 s
RSS_WINDOW_S = 11.0


def kept_rss(st: Stack) -> tuple[list[float], dict[str, float]]:
    """Each EPP replica's and engine's least RSS (MB) over ``RSS_WINDOW_S``."""
    pids = [c.proc.pid for c, _ in st.epps] + [c.proc.pid for c in st.engines.values()]
    low = [float("inf")] * len(pids)
    t_end = time.monotonic() + RSS_WINDOW_S
    while time.monotonic() < t_end:
        low = [min(x, rss_mb(pid)) for x, pid in zip(low, pids, strict=True)]
        time.sleep(0.25)
    n = len(st.epps)
    return low[:n], dict(zip(st.engines, low[n:], strict=True))


def max_lag(text: str) -> float:
    """A replica's largest KV-event lag over the live pods (seconds) from its ``/metrics`` text."""
    return max((float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("kvfleet_epp_kv_event_lag_seconds{") and 'pod="rogue"' not in line),
               default=0.0)


#: seconds of steady load between a flood and an RSS reading: longer than the EPP's speculative TTL (10 s)
#: and the heap trim interval (kvfleet/cache/malloc.py, 10 s)
SETTLE_S = 12.0


class Stack:
    """The processes of the run (engines, two EPP replicas, Envoy) and how to kill and restart them."""

    def __init__(self, stack: ProcessStack, gpu_blocks: int) -> None:
        self.stack = stack
        self.pods: list[PodSpec] = plan_pods(4, 2, 1)
        self.gpu_blocks = gpu_blocks
        self.engines: dict[str, Child] = {}
        self.epps: list[tuple[Child, tuple[int, int, int]]] = []
        self.epp_ports = [(free_port(), free_port(), free_port()) for _ in range(2)]
        self.gossip_ports = [free_port() for _ in range(2)]
        self.rogue_port = free_port()
        self.rogue_events = free_port()
        self.gateway_port = free_port()
        self.pods_path = stack.workdir / "pods.yaml"

    def write_pods(self, rogue: bool) -> None:
        data = pods_file(self.pods, MODEL)
        if rogue:
            data["pools"][0]["pods"].append({
                "name": "rogue", "address": "127.0.0.1", "port": self.rogue_port, "shard": self.pods[0].pool,
                "events": f"tcp://127.0.0.1:{self.rogue_events}",
                "metrics": f"http://127.0.0.1:{self.rogue_port}/metrics",
            })
        tmp = self.pods_path.with_suffix(".tmp")
        write_yaml(tmp, data)
        tmp.replace(self.pods_path)

    def start_engine(self, p: PodSpec) -> Child:
        cfg = {"engine": engine_settings(self.pods, p, MODEL, time_factor=0.1, num_gpu_blocks=self.gpu_blocks,
                                         tiers={"cpu_blocks": self.gpu_blocks})}
        path = write_yaml(self.stack.workdir / f"{p.name}.yaml", cfg)
        child = self.stack.spawn_kvfleet(p.name, ["engine", "--config", str(path), "--log-level", "WARNING"],
                                         engine_env(self.stack.transfer_secret))
        self.stack.wait_http(child, f"http://127.0.0.1:{p.port}/health", timeout_s=60)
        self.engines[p.name] = child
        return child

    def start_epp(self, i: int) -> Child:
        grpc, health, metrics = self.epp_ports[i]
        # the gateway retries a dead pick on the next one
        plugins = msgspec.to_builtins(default_plugins(fallbacks=2))
        cfg = write_yaml(self.stack.workdir / f"epp-{i}.yaml", {"epp": {
            "host": "127.0.0.1", "grpc_port": grpc, "health_port": health, "metrics_port": metrics,
            "pods_file": str(self.pods_path), "prefix_shard_blocks": 64, "pool_saturation_queue": 4.0,
            "plugins": plugins, "gossip_port": self.gossip_ports[i],
            "gossip_peers": [f"127.0.0.1:{g}" for j, g in enumerate(self.gossip_ports) if j != i],
        }})
        child = self.stack.spawn_kvfleet(f"epp-{i}", ["epp", "--config", str(cfg), "--log-level", "WARNING"])
        self.stack.wait_http(child, f"http://127.0.0.1:{metrics}/metrics", timeout_s=60)
        if i < len(self.epps):
            self.epps[i] = (child, self.epp_ports[i])
        else:
            self.epps.append((child, self.epp_ports[i]))
        return child

    def start(self) -> None:
        self.write_pods(rogue=False)
        for p in self.pods:
            self.start_engine(p)
        for i in range(2):
            self.start_epp(i)
        admin = free_port()
        path = write_bootstrap(self.stack.workdir / "envoy.yaml", listen_port=self.gateway_port,
                               admin_port=admin,
                               epp_endpoints=[f"127.0.0.1:{g}" for g, _, _ in self.epp_ports],
                               body_mode="BUFFERED", routing="override_host",
                               pod_endpoints=[f"127.0.0.1:{p.port}" for p in self.pods]
                               + [f"127.0.0.1:{self.rogue_port}"])
        envoy = self.stack.spawn("envoy", [envoy_binary(), "-c", str(path), "--base-id", str(admin),
                                           "-l", "warning", "--concurrency", "2", "--disable-hot-restart"])
        self.stack.wait_http(envoy, f"http://127.0.0.1:{admin}/ready", timeout_s=60)

    def kill(self, child: Child) -> None:
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(5)
        if child in self.stack.children:
            self.stack.children.remove(child)


def rogue_publisher(port: int, stop: threading.Event) -> None:
    """A pod that publishes bad KV events: an out-of-range token id, garbage, a wrong topic, a huge batch."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    enc = msgspec.msgpack.Encoder()
    seq = 0
    bad_token = [time.time(), [["BlockStored", [12345], None, [2**32 + 7] * 16, 16, None, "GPU", None]], None]
    payloads = [enc.encode(bad_token), b"\xc1not msgpack", enc.encode([time.time(), [["Mystery", 1]], None]),
                enc.encode([time.time(), [["BlockStored", list(range(4096)), None, list(range(4096 * 16)), 16,
                                           None, "GPU", None]], None])]
    while not stop.wait(0.2):
        for i, payload in enumerate(payloads):
            topic = b"wrong-topic" if i == 2 else b""
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            seq += 1
    pub.close(0)


async def client(url: str, run: Run, prompts: list[str], stop: asyncio.Event,
                 rng: random.Random) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        while not stop.is_set():
            system = rng.choice(prompts)
            body = {"model": MODEL, "stream": True, "max_tokens": 4,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"q{rng.random()}"}]}
            t0 = time.monotonic()
            ttft, ok, error = None, False, ""
            try:
                async with s.post(url, json=body) as r:
                    if r.status == 200:
                        async for chunk in r.content:
                            if ttft is None and chunk.startswith(b"data:"):
                                ttft = time.monotonic() - t0
                        ok = ttft is not None
                    else:
                        text = (await r.read()).decode(errors="replace")
                        error = f"{r.status} {text[:200]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = type(exc).__name__
            with run.lock:
                run.records.append(Record(t0, time.monotonic(), ok, ttft, error))


async def flood(url: str, n: int, concurrency: int, rng: random.Random) -> int:
    sem = asyncio.Semaphore(concurrency)
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        async with sem, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            text = "".join(rng.choice("abcdefghij ") for _ in range(4096))
            try:
                async with s.post(url, json={"model": MODEL, "prompt": f"{i} {text}", "max_tokens": 1}) as r:
                    await r.read()
                    failed += r.status != 200
            except (aiohttp.ClientError, TimeoutError):
                failed += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return failed


class SteadyLoad:
    """``clients`` streaming chat clients on their own event-loop thread (:func:`client`), and floods of
    distinct prompts run on the same loop at 4 × their concurrency (:func:`flood`)."""

    def __init__(self, url: str, run: Run, prompts: list[str], clients: int) -> None:
        self.url, self.clients = url, clients
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="load", daemon=True)
        self.thread.start()
        self.done = asyncio.Event()
        self.tasks = [asyncio.run_coroutine_threadsafe(
            client(url + "/v1/chat/completions", run, prompts, self.done, random.Random(k)), self.loop)
            for k in range(clients)]

    def flood(self, n: int, rng: random.Random) -> int:
        """``n`` distinct 4k-token prompts; returns how many failed."""
        return asyncio.run_coroutine_threadsafe(
            flood(self.url + "/v1/completions", n, 4 * self.clients, rng), self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.done.set)
        for t in self.tasks:
            t.result(timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter gaps and a smaller flood (about 1 minute)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    gap = 3.0 if args.quick else 6.0
    flood_n = 400 if args.quick else 2000
    rng = random.Random(args.seed)
    prompts = [f"System prompt {k}: "
               + " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kv", "cache"]) for _ in range(700))
               for k in range(6)]
    run = Run()
    with tempfile.TemporaryDirectory(prefix="kvfleet-chaos-") as tmp, ProcessStack(Path(tmp)) as ps:
        st = Stack(ps, gpu_blocks=4096)
        print("starting 4 engines, 2 EPP replicas, Envoy ...", file=sys.stderr, flush=True)
        st.start()
        url = f"http://127.0.0.1:{st.gateway_port}"
        load = SteadyLoad(url, run, prompts, args.clients)
        rogue_stop = threading.Event()
        timeline: list[str] = []

        def at(delay: float) -> None:
            time.sleep(delay)

        def epp_metrics() -> list[str]:
            return [scrape(f"http://127.0.0.1:{m}/metrics") for _, (_, _, m) in st.epps]

        lag_seen = [0.0]

        def freeze_watch(stop: threading.Event, freezes: list[int]) -> None:
            last = [0.0, 0.0]
            still = [0.0, 0.0]
            done_before = 0
            while not stop.wait(1.0):
                with run.lock:
                    done = sum(1 for r in run.records if r.ok)
                texts = epp_metrics()
                for i, text in enumerate(texts):
                    if not text:  # a replica being restarted
                        still[i] = 0.0
                        continue
                    lag_seen[0] = max(lag_seen[0], max_lag(text))
                    batches = metric_sum(text, "kvfleet_epp_kv_event_batches_total{", exclude='pod="rogue"')
                    if batches > last[i] or done == done_before:
                        still[i] = 0.0
                    else:
                        still[i] += 1.0
                        if still[i] == 3.0:
                            freezes[i] += 1
                    last[i] = batches
                done_before = done

        print(f"warm-up: steady load and {flood_n} distinct 4k-token prompts to fill every cache ...",
              file=sys.stderr, flush=True)
        at(2 * gap)
        warm_rng = random.Random(-1)
        warm_floods = 0
        while True:
            load.flood(flood_n, warm_rng)
            warm_floods += 1
            fill = replay_fill(st)
            if fill >= REPLAY_FULL or warm_floods >= MAX_WARM_FLOODS:
                break
            print(f"warm-up: the engines' KV-event replay buffers are {fill:.0%} full; another {flood_n} "
                  "prompts ...", file=sys.stderr, flush=True)
        at(max(gap, SETTLE_S))
        catch_up = [caught_up(st, "warm-up")[0]]
        rss0_epp, rss0_eng = kept_rss(st)
        freezes = [0, 0]
        watch_stop = threading.Event()
        watcher = threading.Thread(target=freeze_watch, args=(watch_stop, freezes), daemon=True)
        watcher.start()

        def step(what: str) -> None:
            """A fault begins: note it with the RSS (MB) every process has now."""
            rss: dict[str, Any] = {"epp": [round(rss_mb(c.proc.pid), 1) for c, _ in st.epps],
                                   "engines": [round(rss_mb(c.proc.pid), 1) for c in st.engines.values()]}
            text = epp_metrics()[-1]  # the replica that is never killed: what it holds
            rss["epp_state"] = {m: metric_sum(text, m) for m in (
                "kvfleet_epp_index_entries", "kvfleet_epp_index_speculative_blocks",
                "kvfleet_epp_engine_hash_map_entries")}
            timeline.append(what)
            rss_timeline.append({"before": what, **rss})
            print(f"{what}   (RSS MB: EPP {rss['epp']}, engines {rss['engines']}; "
                  f"EPP 1 holds {rss['epp_state']})", file=sys.stderr, flush=True)

        rss_timeline: list[dict[str, Any]] = []
        step("kill -9 EPP replica 0")
        run.kills.append(("epp-0", time.monotonic()))
        st.kill(st.epps[0][0])
        at(2.0)
        st.start_epp(0)
        at(gap)

        victim = next(p for p in st.pods if p.role == "both")
        step(f"kill -9 engine {victim.name}")
        run.kills.append((victim.name, time.monotonic()))
        st.kill(st.engines[victim.name])
        at(3.0)
        st.start_engine(victim)
        at(gap)

        step("rogue publisher joins (bad token ids, garbage, wrong topic, 4 MiB batches)")
        rogue = threading.Thread(target=rogue_publisher, args=(st.rogue_events, rogue_stop), daemon=True)
        rogue.start()
        st.write_pods(rogue=True)  # the static datastore reloads the file within a second
        at(gap)

        step(f"flood: {flood_n} distinct 4k-token prompts")
        flood_failed = load.flood(flood_n, rng)
        at(max(gap, SETTLE_S))
        catch_up.append(caught_up(st, "after the flood")[0])
        rss1_epp, rss1_eng = kept_rss(st)

        load.stop()
        watch_stop.set()
        watcher.join(5)
        rogue_stop.set()
        step("end")
        texts = epp_metrics()
        resyncs = sum(metric_sum(t, "kvfleet_epp_kv_event_resyncs_total{") for t in texts)
        resyncs_by_pod = {p: sum(metric_sum(t, f'kvfleet_epp_kv_event_resyncs_total{{pod="{p}"}}')
                                 for t in texts)
                          for p in [*(p.name for p in st.pods), "rogue"]}
        alive = all(c.alive() for c, _ in st.epps) and all(c.alive() for c in st.engines.values())

    # Lost: failed, and not in flight on a killed process at its kill. Of those, the ones the gateway sent to
    # the killed engine before anything could know it was gone are counted apart (to_dead_engine).
    failed = [r for r in run.records if not r.ok]

    def on_killed(r: Record) -> bool:
        """In flight on a killed process: under way at its kill; for a killed EPP replica also a stream opened
        on it in the 0.1 s before Envoy could see it gone (its health check and outlier ejection)."""
        return any(r.start <= t + (0.1 if name.startswith("epp") else 0.0) and r.end > t
                   for name, t in run.kills)

    lost_list = [r for r in failed if not on_killed(r)]
    engine_kills = [t for name, t in run.kills if not name.startswith("epp")]
    to_dead = [r for r in lost_list
               if "upstream_unavailable" in r.error and any(t <= r.start < t + 1.0 for t in engine_kills)]
    lost = len(lost_list)
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error.split(" ", 1)[0]
               + (" upstream_unavailable" if "upstream_unavailable" in r.error else ""))
        errors[key] = errors.get(key, 0) + 1
    ttfts = sorted(r.ttft for r in run.records if r.ok and r.ttft is not None)

    def pct(q: float) -> float:
        return round(1000 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 1) if ttfts else float("nan")

    def growth(before: float, after: float) -> float:
        return round((after - before) / before, 3) if before > 0 else float("nan")

    epp_growth = max((growth(b, a) for b, a in zip(rss0_epp[1:], rss1_epp[1:], strict=True)),
                     default=float("nan"))
    engine_growth = max(growth(rss0_eng[n], rss1_eng[n]) for n in rss1_eng if n != victim.name)
    result: dict[str, Any] = {
        "bench": "chaos", "quick": args.quick, "requests": len(run.records), "failed_requests": len(failed),
        "lost_requests": lost, "lost_to_dead_engine": len(to_dead), "errors": errors,
        "flood_failed": flood_failed, "index_freezes": sum(freezes), "warmup_floods": warm_floods,
        "catch_up_s": catch_up, "max_kv_event_lag_s": round(lag_seen[0], 1),
        "epp_rss_growth": epp_growth, "engine_rss_growth": engine_growth,
        "epp_rss_mb": [round(x, 1) for x in rss1_epp],
        "engine_rss_mb": {n: round(x, 1) for n, x in rss1_eng.items()},
        "resyncs": int(resyncs), "resyncs_by_pod": {k: int(v) for k, v in resyncs_by_pod.items() if v},
        "ttft_p50_ms": pct(0.5), "ttft_p99_ms": pct(0.99), "all_alive": alive,
        "timeline": timeline, "rss_timeline": rss_timeline,
    }
    print(f"{len(run.records)} requests, {len(failed)} failed, {lost} lost; index freezes {sum(freezes)}; "
          f"EPP RSS growth {epp_growth}, engine RSS growth {engine_growth}; "
          f"TTFT p50 {pct(0.5)} ms, p99 {pct(0.99)} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
