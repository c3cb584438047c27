"""bench.replicas — three real EPP replicas against one, live: the same engines, the same requests.

Four simulated engines (one pool, Qwen2.5's tokenizer and chat template) behind one Envoy (the chart's
gateway configuration: ext_proc BUFFERED, routing on the picked header). In turn, Envoy's ext_proc cluster
is one ``kvfleet epp`` process, or three (Envoy balances the streams over them; each replica subscribes to
every engine's KV events, scrapes the engines on its own clock and gossips its picks and in-flight load to
the others over ZMQ, as the chart runs them). Two workloads, each on empty engine caches and fresh
pickers:

* ``storm``: 16 clients at once, each request one of two long system prompts with a new question;
* ``multiturn``: 8 clients × chat sessions on six long system prompts, each turn repeating the
  conversation so far.

The engines run at the modelled GPU's speed (``--time-factor 1``), as a GPU would serve beside the EPPs' own
cores. At ``--time-factor 0.1`` (the default before) the whole stack, clients included, shares this host's
cores and keeps them busy: the clients drive it closed-loop, so TTFT then follows the stack's CPU per request
(three replicas ingest every KV event three times and gossip), which ``bench.router_cost`` measures, more
than the replicas' routing.

Printed per workload: the hit rate (cached ÷ prompt tokens the engines report) and TTFT p50/p90/p99 (time
to the first streamed chunk) of each, and ``live_replicas3_hit_vs_1``, ``live_replicas3_p50_vs_1``,
``live_replicas3_p90_vs_1``, ``live_replicas3_p99_vs_1`` over both workloads (the worse of the two).
The control (``--no-control`` skips it): three replicas running as above but Envoy sending every stream to
one of them, ``live_replicas3_serving1_p*_vs_1``: what two more EPP processes (their KV-event ingestion,
scrapes and gossip) cost the TTFT on these shared cores whoever routes; the rest of the gap is routing.
Where the CPU goes, per phase: CPU ms per request of the serving EPPs, Envoy, the engines and the clients
(``{workload}_epp_cpu_ms_per_request_1`` / ``_3``: the routing's own cost, all replicas summed), and in the
control each idle replica's share of a core (``{workload}_idle_epp_core_share``); the whole stack's CPU per
request, 3 ÷ 1 (``{workload}_stack_cpu_per_request_3_vs_1``), and how busy it kept the host's cores
(``{workload}_host_busy_{1,3}``: the clients drive it closed-loop, so on a host it keeps busy TTFT follows the
CPU per request, whoever spends it).
Rounds alternate 1 then 3, then 3 then 1 (``--reps``). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench._live import (
    MODEL,
    TOKENIZER,
    Engines,
    Result,
    cpu_s,
    cpu_split,
    drive,
    pct,
    scripts,
    system_prompts,
    thread_cpu,
    thread_ms,
)
from kvfleet.demo.envoy import envoy_binary
from kvfleet.demo.stack import Child, ProcessStack, free_port, pods_file, write_yaml
from kvfleet.epp.envoy import write_bootstrap

Work = list[list[list[str]]]


class Bench(Engines):
    #: the running gateway's EPP processes (Envoy's ext_proc cluster first) and Envoy
    epps: list[Child]
    envoy: Child

    @contextmanager
    def gateway(self, replicas: int, serving: int = 0) -> Iterator[str]:
        """Envoy in front of ``replicas`` EPP processes (gossiping when more than one); with ``serving``,
        Envoy knows only the first ``serving`` of them (the others run, ingest and gossip: the control)."""
        pods = write_yaml(self.stack.workdir / "pods.yaml", pods_file(self.pods, MODEL, tokenizer=TOKENIZER))
        ports = [(free_port(), free_port(), free_port(), free_port()) for _ in range(replicas)]
        children: list[Child] = []
        try:
            for i, (grpc, health, metrics, gossip) in enumerate(ports):
                epp = {"host": "127.0.0.1", "grpc_port": grpc, "health_port": health, "metrics_port": metrics,
                       "pods_file": str(pods)}
                if replicas > 1:
                    epp |= {"gossip_port": gossip,
                            "gossip_peers": [f"127.0.0.1:{p[3]}" for j, p in enumerate(ports) if j != i]}
                cfg = write_yaml(self.stack.workdir / f"epp-{i}.yaml", {"epp": epp})
                child = self.stack.spawn_kvfleet(f"epp-{i}", ["epp", "--config", str(cfg), "--log-level",
                                                              "WARNING"])
                children.append(child)
                self.stack.wait_http(child, f"http://127.0.0.1:{metrics}/metrics", timeout_s=60)
            listen, admin = free_port(), free_port()
            boot = write_bootstrap(self.stack.workdir / "envoy.yaml", listen_port=listen, admin_port=admin,
                                   epp_endpoints=[f"127.0.0.1:{p[0]}" for p in ports[:serving or replicas]],
                                   body_mode="BUFFERED")
            envoy = self.stack.spawn("envoy", [envoy_binary(), "-c", str(boot), "--base-id", str(admin), "-l",
                                               "warning", "--concurrency", "1", "--disable-hot-restart"])
            children.append(envoy)
            self.stack.wait_http(envoy, f"http://127.0.0.1:{admin}/ready", timeout_s=60)
            time.sleep(1.0)  # every replica connected to every engine's KV events, gossip peers found
            self.epps, self.envoy = children[:-1], envoy
            yield f"http://127.0.0.1:{listen}/v1/chat/completions"
        finally:
            self.stop(*reversed(children))

    def phase(self, replicas: int, name: str, work: Work, warm: Work, serving: int = 0) -> Result:
        """One workload through ``replicas`` EPPs; the result's ``cpu``: CPU seconds over the measured drive
        of the EPPs Envoy sends streams to (``epp_serving``), of those it does not (``epp_idle``, the
        control), of Envoy and of the engines, and its wall seconds."""
        with self.gateway(replicas, serving) as url:
            asyncio.run(drive(url, warm))
            self.reset()
            time.sleep(0.5)
            n = serving or replicas
            procs = {"epp_serving": self.epps[:n], "epp_idle": self.epps[n:], "envoy": [self.envoy],
                     "engines": self.engine_children}
            c0 = {k: sum(cpu_s(c.proc.pid) for c in v) for k, v in procs.items()}
            t0_serving = [thread_cpu(c.proc.pid) for c in procs["epp_serving"]]
            t0_idle = [thread_cpu(c.proc.pid) for c in procs["epp_idle"]]
            t0, client0 = time.monotonic(), time.process_time()
            res = asyncio.run(drive(url, work))
            res.cpu = {k: sum(cpu_s(c.proc.pid) for c in v) - c0[k] for k, v in procs.items()}
            res.cpu["clients"] = time.process_time() - client0  # this process: the clients' HTTP and JSON
            res.cpu["wall"] = time.monotonic() - t0
            res.threads = {
                "serving": cpu_split(t0_serving, [thread_cpu(c.proc.pid) for c in procs["epp_serving"]]),
                "idle": cpu_split(t0_idle, [thread_cpu(c.proc.pid) for c in procs["epp_idle"]])}
        label = f"{replicas} EPP" + (f" ({serving} serving)" if serving else "")
        per = 1e3 / max(1, res.requests)
        idle = (f", each idle EPP {res.cpu['epp_idle'] / (replicas - serving) / res.cpu['wall'] * 100:.0f} % "
                "of a core" if serving else "")
        print(f"{name:9s} {label}: {res.requests} requests ({res.failed} failed); TTFT p50 "
              f"{pct(res.ttft, 50) * 1e3:.0f} ms, p90 {pct(res.ttft, 90) * 1e3:.0f} ms, p99 "
              f"{pct(res.ttft, 99) * 1e3:.0f} ms; hit {res.hit:.3f}; CPU ms per request: serving EPPs "
              f"{res.cpu['epp_serving'] * per:.1f}, Envoy {res.cpu['envoy'] * per:.1f}, engines "
              f"{res.cpu['engines'] * per:.1f}, clients {res.cpu['clients'] * per:.1f}{idle}",
              flush=True)
        for role in res.threads:
            if res.threads[role]:
                print(f"{'':9s} {role} EPPs' CPU ms per request by thread: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in thread_ms([res], role).items()), flush=True)
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, fewer sessions (about 1 minute)")
    ap.add_argument("--reps", type=int, default=0, help="alternated rounds (default: 1 quick, else 4)")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--time-factor", type=float, default=1.0,
                    help="simulated GPU time scale of the engines (1: the modelled GPU's speed; 0.1, ten "
                    "times faster, keeps these cores busy: TTFT then follows the stack's CPU per request)")
    ap.add_argument("--gpu-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--no-control", action="store_true",
                    help="skip the control: 3 replicas running, Envoy sending every stream to one of them")
    args = ap.parse_args(argv)
    reps = args.reps or (1 if args.quick else 4)
    rng = random.Random(args.seed)
    scale = 1 if args.quick else 2
    workloads: dict[str, Work] = {
        "storm": scripts(16, 4 * scale, 1, system_prompts(2, 1200, rng), args.seed),
        "multiturn": scripts(8, 3 * scale, 4, system_prompts(6, 900, rng), args.seed + 1),
    }
    warm = scripts(2, 1, 2, system_prompts(2, 200, random.Random(args.seed + 7)), args.seed + 7)
    results: dict[tuple[str, int], list[Result]] = {}
    with tempfile.TemporaryDirectory(prefix="kvfleet-replicas-") as tmp, ProcessStack(Path(tmp)) as stack:
        b = Bench(stack, args)
        b.start_engines()
        for r in range(reps):
            for replicas in ((1, 3) if r % 2 == 0 else (3, 1)):
                for name, work in workloads.items():
                    results.setdefault((name, replicas), []).append(b.phase(replicas, name, work, warm))
            if not args.no_control:  # what the two extra processes cost on these cores, whoever routes
                for name, work in workloads.items():
                    results.setdefault((name, 0), []).append(b.phase(3, name, work, warm, serving=1))

    out: dict[str, object] = {"bench": "replicas", "reps": reps, "pods": args.pods, "tokenizer": TOKENIZER}
    worst = {"hit": float("inf"), "p50": 0.0, "p90": 0.0, "p99": 0.0}
    control = {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    failed = 0
    for name in workloads:
        one, three = Result.merged(results[(name, 1)]), Result.merged(results[(name, 3)])
        hit1, hit3 = one.hit, three.hit
        ratios = {"hit": hit3 / max(1e-9, hit1)}
        for q in (50, 90, 99):
            ratios[f"p{q}"] = pct(three.ttft, q) / pct(one.ttft, q)
            out[f"{name}_ttft_p{q}_ms_1"] = round(pct(one.ttft, q) * 1e3, 1)
            out[f"{name}_ttft_p{q}_ms_3"] = round(pct(three.ttft, q) * 1e3, 1)
        out[f"{name}_hit_1"], out[f"{name}_hit_3"] = round(hit1, 4), round(hit3, 4)
        out[f"{name}_requests"] = one.requests // reps
        every: dict[str, float] = {}
        for tag in ("1", "3"):  # every serving EPP's CPU per request: what the routing costs
            runs = results[(name, int(tag))]
            n = max(1, sum(r.requests for r in runs))
            cpu = sum(r.cpu["epp_serving"] for r in runs) / n
            out[f"{name}_epp_cpu_ms_per_request_{tag}"] = round(cpu * 1e3, 2)
            out[f"{name}_epp_thread_ms_per_request_{tag}"] = thread_ms(runs, "serving")
            # the whole stack's (EPPs, Envoy, engines, clients): on a host it keeps busy, TTFT follows it
            total = sum(v for r in runs for k, v in r.cpu.items() if k != "wall")
            every[tag] = total / n
            busy = total / max(1e-9, sum(r.cpu["wall"] for r in runs))
            out[f"{name}_host_busy_{tag}"] = round(busy / (os.cpu_count() or 1), 3)
        out[f"{name}_stack_cpu_per_request_3_vs_1"] = round(every["3"] / max(1e-9, every["1"]), 3)
        print(f"{name}: 3 replicas / 1: hit {ratios['hit']:.3f}, TTFT p50 {ratios['p50']:.2f}, "
              f"p90 {ratios['p90']:.2f}, p99 {ratios['p99']:.2f}; the stack's CPU per request "
              f"{out[f'{name}_stack_cpu_per_request_3_vs_1']:.2f} (host busy "
              f"{out[f'{name}_host_busy_1']:.2f} / {out[f'{name}_host_busy_3']:.2f} of its "
              f"{os.cpu_count()} cores)")
        if (name, 0) in results:
            ctl = Result.merged(results[(name, 0)])
            cr = {f"p{q}": pct(ctl.ttft, q) / pct(one.ttft, q) for q in (50, 90, 99)}
            for key, v in cr.items():
                control[key] = max(control[key], v)
            print(f"{name}: control, 3 replicas with 1 serving / 1: hit {ctl.hit / max(1e-9, hit1):.3f}, "
                  f"TTFT p50 {cr['p50']:.2f}, p90 {cr['p90']:.2f}, p99 {cr['p99']:.2f}")
            runs = results[(name, 0)]
            idle = sum(r.cpu["epp_idle"] for r in runs) / (2 * sum(r.cpu["wall"] for r in runs))
            out[f"{name}_idle_epp_core_share"] = round(idle, 3)
            out[f"{name}_idle_epp_thread_ms_per_request"] = thread_ms(runs, "idle", per_process=2)
        worst["hit"] = min(worst["hit"], ratios["hit"])
        for key in ("p50", "p90", "p99"):
            worst[key] = max(worst[key], ratios[key])
        failed += one.failed + three.failed + sum(r.failed for r in results.get((name, 0), []))
    for key in ("hit", "p50", "p90", "p99"):
        out[f"live_replicas3_{key}_vs_1"] = round(worst[key], 3)
    if not args.no_control:
        for key, v in control.items():
            out[f"live_replicas3_serving1_{key}_vs_1"] = round(v, 3)
    out["failed"] = failed
    print(json.dumps(out))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
