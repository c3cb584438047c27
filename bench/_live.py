"""The live stack the live benchmarks share (bench.router_cost, bench.replicas): simulated engines with the
model's tokenizer, seeded chat sessions streamed by concurrent clients, and per-process CPU from /proc."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvfleet.cache import threadnames
from kvfleet.demo.stack import (
    Child,
    PodSpec,
    ProcessStack,
    engine_env,
    engine_settings,
    plan_pods,
    reset_engine,
    write_yaml,
)

MODEL = "llama-3-8b"
TOKENIZER = "builtin:qwen2.5"
WORDS = ["freight", "container", "berth", "customs", "pallet", "manifest", "inspection", "vessel", "harbour",
         "crane", "tariff", "broker", "invoice", "shipment", "consignee", "carrier", "draft", "ledger",
         "route", "schedule"]


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (of every one of its threads); none for a process that is gone."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, every thread included, and of its live descendants (the
    EPP's native gRPC front is its child); 0 for a process that is gone."""
    return (threadnames.process_cpu(pid) or 0.0) + sum(cpu_s(c) for c in children(pid))


#: thread groups of a kvfleet process by their OS names (kvfleet/cache/threadnames.py): a name's group is
#: the first prefix it starts with; pool threads (``scrape_3``) share one
THREAD_GROUPS = (("ext-proc-loop", "loop"), ("epp-route", "route"), ("kv-events", "kv-events"),
                 ("epp-gossip", "gossip"), ("ZMQbg", "zmq-io"), ("scrape", "scrapers"),
                 ("metrics-scraper", "scrapers"))


def thread_group(name: str) -> str:
    """The group :data:`THREAD_GROUPS` gives an OS thread name (``other`` for the rest)."""
    return next((g for prefix, g in THREAD_GROUPS if name.startswith(prefix)), "other")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread group of ``pid`` (:func:`thread_group` of the names
    :func:`kvfleet.cache.threadnames.thread_cpu` reads), its child processes (the EPP's native front) under
    ``front``; ``{}`` for a process that is gone. Differences of two calls on the same process are what a
    phase spent per group (a thread that ended in between is lost from both)."""
    out: dict[str, float] = {}
    for name, seconds in threadnames.thread_cpu(pid).values():
        group = thread_group(name)
        out[group] = out.get(group, 0.0) + seconds
    kids = children(pid)
    if kids:
        out["front"] = sum(cpu_s(c) for c in kids)
    return out


def cpu_split(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float]:
    """Per thread group, the CPU seconds spent between ``before`` and ``after`` (:func:`thread_cpu` of the
    same processes, in the same order), summed over the processes."""
    out: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for k, v in a.items():
            out[k] = out.get(k, 0.0) + v - b.get(k, 0.0)
    return out


def thread_ms(runs: list[Result], role: str, per_process: int = 1) -> dict[str, float]:
    """CPU ms per request (and per process with ``per_process``) of each thread group of the ``role``
    processes (:attr:`Result.threads`) over ``runs``: the largest first, the groups that spent nothing left
    out."""
    out: dict[str, float] = {}
    for r in runs:
        for k, v in r.threads.get(role, {}).items():
            out[k] = out.get(k, 0.0) + v
    n = max(1, sum(r.requests for r in runs)) * per_process
    return {k: round(v * 1e3 / n, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


def measured_pid(child: Child) -> int:
    """The process to measure: the child itself, or, when it is py-spy recording the EPP, the EPP."""
    try:
        comm = Path(f"/proc/{child.proc.pid}/comm").read_text().strip()
    except OSError:
        return child.proc.pid
    kids = children(child.proc.pid)
    return kids[0] if comm == "py-spy" and len(kids) == 1 else child.proc.pid


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failed: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    #: per role (``serving``, ``idle``), CPU seconds per thread group (:func:`thread_cpu`)
    threads: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.ttft)

    @property
    def hit(self) -> float:
        """Cached ÷ prompt tokens, as the engines reported them."""
        return self.cached_tokens / max(1, self.prompt_tokens)

    @classmethod
    def merged(cls, results: list[Result]) -> Result:
        """The runs of one configuration as one (latencies pooled, tokens and failures summed)."""
        m = cls()
        for x in results:
            m.ttft += x.ttft
            m.prompt_tokens += x.prompt_tokens
            m.cached_tokens += x.cached_tokens
            m.failed += x.failed
        return m


def system_prompts(n: int, words: int, rng: random.Random) -> list[str]:
    return [f"System {i}: you answer for team {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))
            for i in range(n)]


def scripts(clients: int, sessions: int, turns: int, prompts: list[str], seed: int) -> list[list[list[str]]]:
    """Per client, per session: the system prompt then the user turns (seeded: both routers get these)."""
    rng = random.Random(seed)
    def question(c: int, s: int, t: int) -> str:
        return f"Question {c}.{s}.{t}: " + " ".join(rng.choice(WORDS) for _ in range(12))

    return [[[rng.choice(prompts)] + [question(c, s, t) for t in range(turns)] for s in range(sessions)]
            for c in range(clients)]


async def run_client(url: str, script: list[list[str]], res: Result, max_tokens: int = 8) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for session in script:
            msgs: list[dict[str, str]] = [{"role": "system", "content": session[0]}]
            for question in session[1:]:
                msgs.append({"role": "user", "content": question})
                body = {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "stream": True,
                        "stream_options": {"include_usage": True}}
                t0, ttft, text, usage = time.monotonic(), None, "", None
                try:
                    async with s.post(url, json=body) as r:
                        if r.status != 200:
                            res.failed += 1
                            await r.read()
                            break
                        async for line in r.content:
                            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                                continue
                            if ttft is None:
                                ttft = time.monotonic() - t0
                            chunk = json.loads(line[5:])
                            for ch in chunk.get("choices") or []:
                                text += (ch.get("delta") or {}).get("content") or ""
                            usage = chunk.get("usage") or usage
                except (aiohttp.ClientError, TimeoutError):
                    res.failed += 1
                    break
                if ttft is None or usage is None:
                    res.failed += 1
                    break
                res.ttft.append(ttft)
                res.prompt_tokens += usage["prompt_tokens"]
                res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                msgs.append({"role": "assistant", "content": text})


async def drive(url: str, work: list[list[list[str]]], max_tokens: int = 8) -> Result:
    """Every client's script at once; each answer streamed, ``max_tokens`` long at most."""
    res = Result()
    await asyncio.gather(*(run_client(url, script, res, max_tokens) for script in work))
    return res


class Engines:
    """The pool's engines (one pool of unified pods) and the processes started beside them."""

    def __init__(self, stack: ProcessStack, args: argparse.Namespace) -> None:
        self.stack, self.args = stack, args
        self.pods: list[PodSpec] = plan_pods(args.pods, 1, 0)
        self.engine_children: list[Child] = []

    def start_engines(self) -> None:
        for p in self.pods:
            cfg = {"engine": engine_settings(self.pods, p, MODEL, time_factor=self.args.time_factor,
                                             num_gpu_blocks=self.args.gpu_blocks, tokenizer=TOKENIZER)}
            path = write_yaml(self.stack.workdir / f"{p.name}.yaml", cfg)
            child = self.stack.spawn_kvfleet(p.name, ["engine", "--config", str(path), "--log-level",
                                                      "WARNING"], engine_env(self.stack.transfer_secret))
            self.stack.wait_http(child, f"http://127.0.0.1:{p.port}/health", timeout_s=60)
            self.engine_children.append(child)

    def reset(self) -> None:
        for p in self.pods:
            reset_engine(p.port, self.stack.transfer_secret)

    def stop(self, *children: Child) -> None:
        """Stop each child and whatever it started (its process group: py-spy's EPP, say)."""
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
            try:
                c.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            self.stack.children.remove(c)


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


