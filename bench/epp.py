"""bench.epp: the picker's decision rate over ext_proc, and the latency it adds behind a real Envoy.

1. Decisions per second: the EPP runs as its own process (``kvfleet epp``, 8
   pods in a static pool, no events) and a gRPC client drives ext_proc streams
   exactly as Envoy does in FULL_DUPLEX_STREAMED mode (headers, then the body,
   then read the pick and the echoed body), with 16 streams in flight. Prompts
   are 4k tokens (4 KiB of text with the byte-level tokenizer: every byte is a
   token) and 220 KB, each a shared 1 KiB system prefix + a unique suffix.
   The EPP's CPU counts its native gRPC front (a child process); the 4k run is
   repeated with ``epp.front: grpcio`` (Python's grpc.aio) as the front's
   baseline in the same run (``front_cpu_vs_grpcio_4k``).
2. Added latency: the same small upstream behind two Envoys in the same run,
   one with the ext_proc filter (Envoy → EPP → upstream) and one without
   (Envoy → upstream, the baseline); sequential requests with 4k-token
   prompts, alternating between the two; added = with − without at p50/p99.
3. Warm index: 64 pods publish KV events in vLLM's wire format (a publisher
   process with one :class:`~kvfleet.agent.publisher.ZmqPublisher` PUB + replay
   ROUTER per pod) to a fresh EPP whose subscriber indexes them (the real
   ingestion path; ``recompute_keys: false``, so the events carry the picker's
   own hashes and no token ids) until its index holds ``--warm-entries``
   (block, pod) entries with the prefix sharing of :class:`WarmPlan`; then the
   decision rate and one-at-a-time pick latency on prompts that many pods
   partly hold, the index's bytes per entry (its table, and the EPP's RSS
   growth), the ingest rate (blocks/s of prefill-step events of up to 512
   blocks, ``ingest_blocks_per_s``; those events/s), the previous dict-of-dicts
   layout's bytes per entry measured on the same entries for the ratio, and,
   after the decisions, decode-step events through the same subscriber: one
   block per ``BlockStored`` event with its 16 token ids, as vLLM publishes
   them, ``DECODE_BATCH`` events a batch, 600,000 of them, encoded before the
   clock starts: ``ingest_events_per_s`` is those events per CPU second of the
   EPP's ingestion thread (``kv-events``: one core), ``ingest_events_per_s_wall``
   the rate with the publisher process on the same cores. In process, the same
   kind of batches applied from their bytes against decoded into events, the
   path a batch in another layout takes (``ingest_from_bytes_vs_decoder``);
   and for a pod whose keys are recomputed (its hash is not the picker's), a
   decode step's stores recomputed together against one by one
   (``ingest_recomputed_together_vs_one_by_one``).
4. The model's tokenizer: the same 8-pod EPP with the pool's tokenizer ``builtin:qwen2.5`` (Qwen2.5's
   files, its chat template) and, as the baseline in the same run, ``bytes``, on the same bodies: single
   prompts of ~4k Qwen tokens (prose) and ~220 KB, and multi-turn chat (24 conversations of 8 turns, each
   turn repeating the conversation, 1.4k → 4.5k tokens); decisions/s and EPP CPU per decision, and the
   ratio real ÷ bytes (``real_tok_cpu_vs_bytes_*``). Its index holds the run's own picks only.

Last line: ``{"bench": "epp", "decisions_per_s_4k", "decisions_per_s_220kb", "added_p50_ms", "added_p99_ms",
"warm_decisions_per_s_4k", "warm_decisions_per_s_220kb", "warm_pick_p50_ms", "warm_pick_p99_ms",
"index_bytes_per_entry", "warm_index_entries", "ingest_blocks_per_s", "ingest_events_per_s", "epp_rss_mb",
...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench import index_scale
from bench._live import cpu_s, thread_cpu
from kvfleet.agent.publisher import ZmqPublisher
from kvfleet.cache.events import (
    AnyEvent,
    BlockStored,
    KVEventBatch,
    decode_batch_lenient,
    encode_batch,
    stored,
)
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.tokens import ByteTokenizer, salt_extra_keys
from kvfleet.demo.envoy import EnvoyProcess, free_port
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.server import health_check

SYSTEM = "".join(random.Random(0).choices(string.ascii_letters + " ", k=1024))


def prompts(n: int, size: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        suffix = "".join(rng.choices(string.ascii_letters + " ", k=64))
        text = (SYSTEM + suffix * ((size - len(SYSTEM)) // 64 + 1))[:size]
        out.append(json.dumps({"model": "m", "prompt": text, "max_tokens": 1}).encode())
    return out


def messages(body: bytes, path: bytes = b"/v1/completions") -> list[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode()),
        ]),
        end_of_stream=False,
    )
    cfg = pb.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)
    return [
        pb.ProcessingRequest(request_headers=headers, protocol_config=cfg),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]


async def decisions_per_s(target: str, bodies: list[bytes], seconds: float,
                          concurrency: int = 16, path: bytes = b"/v1/completions") -> tuple[float, int]:
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        done = 0
        errors = 0
        stop_at = time.perf_counter() + seconds

        async def one(body: bytes) -> bool:
            call = stub.Process(iter(messages(body, path)))
            picked = False
            async for resp in call:
                if resp.HasField("request_headers"):
                    picked = bool(resp.request_headers.response.header_mutation.set_headers)
                if resp.HasField("immediate_response"):
                    return False
                if resp.HasField("request_body") and (
                    resp.request_body.response.body_mutation.streamed_response.end_of_stream
                ):
                    break
            call.cancel()
            return picked

        async def worker(k: int) -> None:
            nonlocal done, errors
            i = k
            while time.perf_counter() < stop_at:
                ok = await one(bodies[i % len(bodies)])
                i += concurrency
                if ok:
                    done += 1
                else:
                    errors += 1

        for b in bodies[:concurrency]:  # warm-up
            await one(b)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t0), errors


class Upstream:
    """A minimal OpenAI-shaped upstream on loopback (one thread, its own loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> Upstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        async def completions(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"choices": [{"text": "ok"}],
                                      "usage": {"prompt_tokens": 1,
                                                "prompt_tokens_details": {"cached_tokens": 0}}})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", completions)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def timed_post(url: str, body: bytes) -> float:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    return time.perf_counter() - t0


def start_epp(workdir: Path, pods: list[dict[str, Any]],
              **epp: Any) -> tuple[subprocess.Popen[bytes], int, int]:
    """The EPP in its own process on a static pool of ``pods``; returns it, its gRPC and its metrics port."""
    pods_file = workdir / "pods.yaml"
    tokenizer = epp.pop("pool_tokenizer", "bytes")  # routing measured apart from tokenization unless asked
    pods_file.write_text(yaml.safe_dump({"pools": [{"name": "bench", "models": ["m"], "tokenizer": tokenizer,
                                                    "pods": pods}]}))
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    cfg = workdir / "epp.yaml"
    cfg.write_text(yaml.safe_dump({"epp": {"host": "127.0.0.1", "grpc_port": grpc_port,
                                           "health_port": health_port, "metrics_port": metrics_port,
                                           "pods_file": str(pods_file), **epp}}))
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.epp.main", "--config", str(cfg),
                             "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=open(workdir / "epp.log", "wb"))  # noqa: SIM115
    deadline = time.monotonic() + 30
    while not health_check(f"127.0.0.1:{health_port}", 0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"epp did not start: {(workdir / 'epp.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, grpc_port, metrics_port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.epp",
                                 description="EPP decision rate and added latency")
    ap.add_argument("--quick", action="store_true", help="short measurements (a few minutes on 2 busy cores)")
    ap.add_argument("--warm-entries", type=int, default=0,
                    help="(block, pod) entries of the warm run's index (default 10.5M; 0 with --no-warm)")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-index run")
    ap.add_argument("--no-index-scale", action="store_true",
                    help="skip the index at 10 M entries x 256 pods (bench.index_scale)")
    ap.add_argument("--publish", metavar="SPEC", help=argparse.SUPPRESS)  # the warm run's publisher process
    args = ap.parse_args(argv)
    if args.publish:
        return publish_plan(args.publish)
    seconds = 4.0 if args.quick else 15.0
    print(f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs "
          "(other processes skew every figure)")
    n_lat = 300 if args.quick else 2000
    workdir = Path(tempfile.mkdtemp(prefix="kvfleet-bench-epp-"))
    upstream = Upstream().start()
    pods = [{"name": f"pod-{i}", "address": "127.0.0.1", "port": upstream.port if i == 0 else 20000 + i}
            for i in range(8)]
    proc, grpc_port, _ = start_epp(workdir, pods)
    envoys: list[EnvoyProcess] = []
    try:
        target = f"127.0.0.1:{grpc_port}"
        small = prompts(256, 4096, 1)
        large = prompts(32, 220 * 1024, 2)
        c0 = cpu_s(proc.pid)
        d4k, e4k = asyncio.run(decisions_per_s(target, small, seconds))
        c1 = cpu_s(proc.pid)
        cpu4k = (c1 - c0) / max(1.0, d4k * seconds + 16) * 1e3
        print(f"decisions/s, 4k-token prompts:  {d4k:8.0f}  (errors {e4k}); EPP CPU {cpu4k:.2f} ms/decision")
        d220, e220 = asyncio.run(decisions_per_s(target, large, seconds))
        cpu220 = (cpu_s(proc.pid) - c1) / max(1.0, d220 * seconds + 16) * 1e3
        print(f"decisions/s, 220 KB prompts:   {d220:8.0f}  (errors {e220}); "
              f"EPP CPU {cpu220:.2f} ms/decision")
        cold_lat = asyncio.run(pick_latencies(target, small, min(n_lat, 300)))
        print(f"pick, one at a time, 4k-token prompts: p50 {np.percentile(cold_lat, 50):.2f} ms, "
              f"p99 {np.percentile(cold_lat, 99):.2f} ms")
        proc.terminate()
        proc.wait(10)
        # the same decisions through Python's grpc.aio (epp.front grpcio): the native front's baseline
        proc, aio_port, _ = start_epp(workdir, pods, front="grpcio")
        c2 = cpu_s(proc.pid)
        d4k_aio, _ = asyncio.run(decisions_per_s(f"127.0.0.1:{aio_port}", small, seconds))
        cpu4k_aio = (cpu_s(proc.pid) - c2) / max(1.0, d4k_aio * seconds + 16) * 1e3
        front_vs_aio = cpu4k / cpu4k_aio if cpu4k_aio > 0 else None
        print(f"the same through grpc.aio:      {d4k_aio:8.0f}  EPP CPU {cpu4k_aio:.2f} ms/decision "
              f"(native front ÷ grpc.aio: {front_vs_aio or float('nan'):.2f} × the CPU)")
        proc.terminate()
        proc.wait(10)
        # latency: a single-pod pool so every pick lands on the real upstream
        proc, grpc_port, _ = start_epp(workdir, pods[:1])
        with_epp = EnvoyProcess(epp_port=grpc_port).start()
        envoys.append(with_epp)
        without = EnvoyProcess(use_epp=False, fallback_endpoints=[f"127.0.0.1:{upstream.port}"]).start()
        envoys.append(without)
        lat_bodies = prompts(64, 4096, 3)
        u_with = f"http://127.0.0.1:{with_epp.listen_port}/v1/completions"
        u_without = f"http://127.0.0.1:{without.listen_port}/v1/completions"
        for b in lat_bodies[:10]:
            timed_post(u_with, b)
            timed_post(u_without, b)
        a, b_ = [], []
        for i in range(n_lat):
            body = lat_bodies[i % len(lat_bodies)]
            a.append(timed_post(u_with, body))
            b_.append(timed_post(u_without, body))
        wa, wb = np.array(a) * 1e3, np.array(b_) * 1e3
        added_p50 = float(np.percentile(wa, 50) - np.percentile(wb, 50))
        added_p99 = float(np.percentile(wa, 99) - np.percentile(wb, 99))
        print(f"through Envoy, 4k-token prompts: p50 {np.percentile(wa, 50):.2f} ms with EPP "
              f"vs {np.percentile(wb, 50):.2f} ms without; "
              f"p99 {np.percentile(wa, 99):.2f} vs {np.percentile(wb, 99):.2f}")
        out = {
            "bench": "epp",
            "quick": args.quick,
            "decisions_per_s_4k": round(d4k, 1),
            "decisions_per_s_220kb": round(d220, 1),
            "epp_cpu_ms_per_decision_4k": round(cpu4k, 3),
            "epp_cpu_ms_per_decision_220kb": round(cpu220, 3),
            "decisions_per_s_4k_grpcio": round(d4k_aio, 1),
            "epp_cpu_ms_per_decision_4k_grpcio": round(cpu4k_aio, 3),
            "front_cpu_vs_grpcio_4k": round(front_vs_aio, 3) if front_vs_aio is not None else None,
            "decisions_per_cpu_s_4k": round(1e3 / cpu4k, 1) if cpu4k > 0 else None,
            "decisions_per_cpu_s_220kb": round(1e3 / cpu220, 1) if cpu220 > 0 else None,
            "pick_p50_ms": round(float(np.percentile(cold_lat, 50)), 3),
            "pick_p99_ms": round(float(np.percentile(cold_lat, 99)), 3),
            "added_p50_ms": round(added_p50, 3),
            "added_p99_ms": round(added_p99, 3),
            "baseline_p50_ms": round(float(np.percentile(wb, 50)), 3),
            "baseline_p99_ms": round(float(np.percentile(wb, 99)), 3),
            "errors": e4k + e220,
        }
        for e in envoys:
            e.stop()
        envoys.clear()
        proc.terminate()
        proc.wait(10)
        out.update(tokenizer_run(workdir, pods, seconds))
        out.update(ingest_paths())
        if not args.no_warm:
            out.update(warm_run(workdir, args.warm_entries or 10_500_000, seconds, n_lat))
        if not args.no_index_scale:  # the index alone at fleet scale (bench/index_scale.py)
            out.update(index_scale.run(queries=500 if args.quick else 2000))
        out["cpus"] = os.cpu_count()
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    finally:
        for e in envoys:
            e.stop()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        upstream.stop()
    print(json.dumps(out))
    return 0


# --- the model's tokenizer --------------------------------------------------------------------------------
REAL_TOKENIZER = "builtin:qwen2.5"
_WORDS = " ".join((
    "the of and to in is that for it as with was on be by at this are from or have an not which",
    "shipment container vessel port customs broker pallet weight invoice route carrier delay",
    "schedule warehouse inventory forecast demand supplier contract freight tariff berth crane",
    "manifest consignee declared inspection temperature humidity sensor reading report summary",
)).split()


def _prose(rng: random.Random, n_words: int) -> str:
    words = rng.choices(_WORDS, k=n_words)
    return " ".join(w.capitalize() + "." if i % 17 == 16 else w for i, w in enumerate(words))


def real_prompts(n: int, tokens: int, seed: int) -> list[bytes]:
    """Completions of about ``tokens`` Qwen2.5 tokens (prose: ~1.05 tokens a word), a shared 1k-token head."""
    rng = random.Random(seed)
    head = _prose(random.Random(0), 1000)
    return [json.dumps({"model": "m", "prompt": head + " " + _prose(rng, max(1, tokens * 93 // 100 - 1000)),
                        "max_tokens": 1}).encode() for _ in range(n)]


def conversations(n: int, turns: int, seed: int) -> list[bytes]:
    """Chat bodies of ``n`` conversations, turn by turn (each repeats the conversation so far): a 1k-token
    system prompt, then turns of a ~300-token question and a ~100-token answer (about 4k tokens at turn 7)."""
    rng = random.Random(seed)
    system = _prose(random.Random(1), 1000)
    out: list[bytes] = []
    for _ in range(n):
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
        for _t in range(turns):
            msgs.append({"role": "user", "content": _prose(rng, 290)})
            out.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 1}).encode())
            msgs = [*msgs, {"role": "assistant", "content": _prose(rng, 95)}]
    return out


def tokenizer_run(workdir: Path, pods: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Decisions/s and EPP CPU per decision with the model's tokenizer and chat template (Qwen2.5) against the
    byte-level tokenizer on the same bodies, same run: single 4k-token and 220 KB prompts, and multi-turn
    chat (each turn repeats the conversation). The index is warmed by the run's own picks."""
    single = real_prompts(128, 4096, 11)
    large = [json.dumps({"model": "m", "prompt": json.loads(b)["prompt"] * 11, "max_tokens": 1}).encode()
             for b in real_prompts(16, 4096, 12)]  # about 220 KB of prose each
    chats = conversations(24, 8, 13)
    out: dict[str, Any] = {"tokenizer": REAL_TOKENIZER}
    for tok, tag in ((REAL_TOKENIZER, "real_tok"), ("bytes", "bytes_tok")):
        proc, grpc_port, _ = start_epp(workdir, pods, pool_tokenizer=tok)
        try:
            target = f"127.0.0.1:{grpc_port}"
            runs = (("4k", single, b"/v1/completions"), ("220kb", large, b"/v1/completions"),
                    ("multiturn_4k", chats, b"/v1/chat/completions"))
            for name, bodies, path in runs:
                c0 = cpu_s(proc.pid)
                rate, errors = asyncio.run(decisions_per_s(target, bodies, seconds, path=path))
                cpu = (cpu_s(proc.pid) - c0) / max(1.0, rate * seconds + 16) * 1e3
                print(f"{tag:9s} {name:13s} decisions/s {rate:8.1f}  EPP CPU {cpu:7.2f} ms/decision"
                      f"  (errors {errors})")
                out[f"warm_decisions_per_s_{name}_{tag}"] = round(rate, 1)
                out[f"epp_cpu_ms_per_decision_{name}_{tag}"] = round(cpu, 3)
        finally:
            proc.terminate()
            proc.wait(10)
    for name in ("4k", "220kb", "multiturn_4k"):
        b = out[f"epp_cpu_ms_per_decision_{name}_bytes_tok"]
        out[f"real_tok_cpu_vs_bytes_{name}"] = round(out[f"epp_cpu_ms_per_decision_{name}_real_tok"] / b, 2) \
            if b else None
    return out


# --- warm index -------------------------------------------------------------------------------------------
#: the warm run's fleet and its prefix sharing (see :class:`WarmPlan`)
WARM_PODS = 64
#: decode-step events per KVEventBatch in the ingest measurement: a busy engine's step (256 running requests
#: with 16-token blocks fill about 16 blocks a step; vLLM publishes one batch per step)
DECODE_BATCH = 16
BLOCK = 16
_LETTERS = np.frombuffer((string.ascii_letters + " ").encode(), dtype=np.uint8)


def _text(rng: np.random.Generator, n: int) -> str:
    return _LETTERS[rng.integers(0, len(_LETTERS), n)].tobytes().decode()


def _keys(text: str) -> list[int]:
    """The EPP's block keys of a ``/v1/completions`` prompt (byte tokenizer, the default cache settings)."""
    return hashes_as_ints(BlockHasher(BLOCK).hash_tokens(ByteTokenizer().encode(text),
                                                         extra_keys=salt_extra_keys(None)))


class WarmPlan:
    """What the warm fleet holds and what it is asked, derived from ``seed`` alone (the bench and its
    publisher process build the same plan).

    Requested prefixes, so that many pods partly hold every prompt: 16 system prompts of 2 KiB, each held
    by 32 of the 64 pods; 256 conversations of 1.5 KiB on them, each held by 2 pods; a 4k-token prompt is
    system + conversation + a fresh 512-byte turn (2,048 prompts, so a prompt repeats only after 2,048
    decisions). For 220 KB prompts: 4 system prompts of 8 KiB (32 pods each), 32 conversations of 208 KiB
    (2 pods each), a fresh 4 KiB turn. Filler, up to ``entries`` (block, pod) entries: 48 shared system
    prompts of 64–1,024 blocks, each held by 8–64 pods, and conversations of 64–4,096 blocks on them held
    by 1 pod (70 %), 2 (20 %) or 3 (10 %); 30 % of the conversations sit in the CPU tier.
    """

    def __init__(self, seed: int, entries: int, pods: int = WARM_PODS) -> None:
        rng = np.random.default_rng(seed)
        self.pods = pods
        self.entries = entries
        self.seed = seed
        self.sys4k = [_text(rng, 2048) for _ in range(16)]
        self.sys4k_holders = [sorted(rng.choice(pods, pods // 2, replace=False).tolist()) for _ in self.sys4k]
        self.conv4k = [(int(rng.integers(len(self.sys4k))), _text(rng, 1536),
                        sorted(rng.choice(pods, 2, replace=False).tolist()))
                       for _ in range(256)]
        self.sys220 = [_text(rng, 8192) for _ in range(4)]
        self.sys220_holders = [sorted(rng.choice(pods, pods // 2, replace=False).tolist())
                               for _ in self.sys220]
        self.conv220 = [(int(rng.integers(len(self.sys220))), _text(rng, 208 * 1024),
                         sorted(rng.choice(pods, 2, replace=False).tolist()))
                        for _ in range(32)]

    def prompts_4k(self, n: int = 2048) -> list[bytes]:
        """``n`` prompts: conversation ``i % 256`` on its system prompt, then a fresh 512-byte turn."""
        rng = np.random.default_rng(self.seed + 2)
        return [json.dumps({"model": "m", "prompt": self.sys4k[s] + h + _text(rng, 512),
                            "max_tokens": 1}).encode()
                for s, h, _ in (self.conv4k[i % len(self.conv4k)] for i in range(n))]

    def prompts_220kb(self, n: int = 128) -> list[bytes]:
        """``n`` prompts: conversation ``i % 32`` on its system prompt, then a fresh 4 KiB turn (220 KiB in
        all)."""
        rng = np.random.default_rng(self.seed + 3)
        tail = 220 * 1024 - 8192 - 208 * 1024
        return [json.dumps({"model": "m", "prompt": self.sys220[s] + h + _text(rng, tail),
                            "max_tokens": 1}).encode()
                for s, h, _ in (self.conv220[i % len(self.conv220)] for i in range(n))]

    def holdings(self) -> Iterator[tuple[list[int], list[int], list[int], str]]:
        """(pods, system keys, conversation keys after them, medium), requested prefixes first, then filler
        until ``entries`` distinct (block, pod) entries (a pod stores a system prompt once)."""
        for sys_texts, holders in ((self.sys4k, self.sys4k_holders), (self.sys220, self.sys220_holders)):
            for text, pods in zip(sys_texts, holders, strict=True):
                yield pods, _keys(text), [], "GPU"
        for sys_texts, convs in ((self.sys4k, self.conv4k), (self.sys220, self.conv220)):
            sys_keys = [_keys(t) for t in sys_texts]
            for s, hist, pods in convs:
                full = _keys(sys_texts[s] + hist)
                yield pods, sys_keys[s], full[len(sys_keys[s]):], "GPU"
        rng = np.random.default_rng(self.seed + 1)
        u64 = np.iinfo(np.uint64).max
        fsys = [rng.integers(0, u64, int(rng.integers(64, 1025)), dtype=np.uint64, endpoint=True).tolist()
                for _ in range(48)]
        fsys_holders = [rng.choice(self.pods, int(rng.integers(8, self.pods + 1)), replace=False).tolist()
                        for _ in fsys]
        for keys, pods in zip(fsys, fsys_holders, strict=True):
            yield pods, keys, [], "GPU"
        while True:
            s = int(rng.integers(len(fsys)))
            n = int(rng.choice([1, 2, 3], p=[0.7, 0.2, 0.1]))
            pods = rng.choice(self.pods, n, replace=False).tolist()
            hist = rng.integers(0, u64, int(rng.integers(64, 4097)), dtype=np.uint64, endpoint=True).tolist()
            yield pods, fsys[s], hist, ("CPU" if rng.random() < 0.3 else "GPU")


def publish_plan(spec_path: str) -> int:
    """The publisher process: one vLLM-format PUB + replay ROUTER per pod (:class:`ZmqPublisher`); waits for
    ``go`` on stdin, publishes the plan's holdings, reports ``published <entries> <seconds>``, and closes at
    EOF."""
    spec = json.loads(Path(spec_path).read_text())
    plan = WarmPlan(spec["seed"], spec["entries"], len(spec["ports"]))
    pubs = [ZmqPublisher(f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}", buffer_steps=1 << 20,
                         buffer_bytes=1 << 30, sndhwm=1 << 20) for a, b in spec["ports"]]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    t0 = time.perf_counter()
    held: list[set[int]] = [set() for _ in pubs]  # system prompts (by first key) each pod stores once
    entries = events_n = 0
    last = t0
    for pods, sys_keys, conv, medium in plan.holdings():
        for p in pods:
            events: list[AnyEvent] = []
            parent: int | None = None
            chunks: list[tuple[list[int], str]] = []
            if sys_keys[0] not in held[p]:
                held[p].add(sys_keys[0])
                chunks += [(sys_keys[i : i + 512], "GPU") for i in range(0, len(sys_keys), 512)]
                entries += len(sys_keys)
            chunks += [(conv[i : i + 512], medium) for i in range(0, len(conv), 512)]
            entries += len(conv)
            for c, m in chunks:  # one event per prefill step of ≤ 512 blocks (8k tokens), chained by parent
                events.append(stored(c, parent, [], BLOCK, m))
                parent = c[-1]
            if events:
                pubs[p].publish(KVEventBatch(ts=time.time(), events=events))
                events_n += len(events)
        if entries >= plan.entries:
            break
        if time.perf_counter() - last > 5:
            last = time.perf_counter()
            print(f"progress {entries}", flush=True)
    print(f"published {entries} {time.perf_counter() - t0:.2f} {events_n}", flush=True)
    line = sys.stdin.readline().split()
    if line and line[0] == "decode":  # decode steps (decode_steps), encoded first, then sent on "go"
        payloads = decode_steps(int(line[1]), len(pubs), plan.seed + 1)
        print("decode-ready", flush=True)
        if sys.stdin.readline().strip() == "go":
            for p, payload in payloads:
                pubs[p].publish_encoded(payload)
    sys.stdin.read()
    for pub in pubs:
        pub.close()
    return 0


def decode_steps(n: int, pods: int, seed: int) -> list[tuple[int, bytes]]:
    """``n`` decode-step events as vLLM publishes them, encoded: one ``BlockStored`` per filled block (its 16
    token ids, chained from the pod's previous block), ``DECODE_BATCH`` events a batch (an engine step),
    batches dealt round-robin to ``pods`` pods: (pod, payload)."""
    rng = random.Random(seed)
    tips: list[int | None] = [None] * pods
    out: list[tuple[int, bytes]] = []
    for k in range(0, n, DECODE_BATCH):
        p = (k // DECODE_BATCH) % pods
        batch: list[AnyEvent] = []
        for _ in range(min(DECODE_BATCH, n - k)):
            key = rng.getrandbits(63)
            batch.append(stored([key], tips[p], [rng.randrange(152_064) for _ in range(BLOCK)], BLOCK, "GPU"))
            tips[p] = key
        out.append((p, encode_batch(KVEventBatch(ts=time.time(), events=batch))))
    return out


class _OneByOne(PodEventApplier):
    """The baseline: each store of a pod whose keys are recomputed applied on its own, as before."""

    def _recompute_stores(self, stores: list[BlockStored]) -> int:
        return sum(self._apply_one(e) for e in stores)


def _events_per_cpu_s(runs: dict[str, Callable[[], PodEventApplier]], events: int) -> dict[str, float]:
    """Events per CPU second of each run (each applies ``events`` events to a fresh applier it returns),
    the runs alternated, best of three."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(3):
        for name, run in runs.items():
            t0 = time.process_time()
            ap = run()
            dt = time.process_time() - t0
            assert ap.stats.stored == events, (name, ap.stats)
            best[name] = max(best[name], events / max(dt, 1e-9))
    return best


def ingest_paths(n: int = 64_000) -> dict[str, float]:
    """In this process, the same decode-step batches (:func:`decode_steps`, one pod) applied to a fresh index
    from their bytes (:meth:`~kvfleet.epp.ingest.PodEventApplier.apply_payload`, flushed every 16 batches as
    a read of a socket does) and, the baseline, decoded into events and applied
    (:func:`~kvfleet.cache.events.decode_batch_lenient`, :meth:`~kvfleet.epp.ingest.PodEventApplier.apply`):
    events per CPU second of each, best of three. Then a pod whose keys are recomputed (its hash is not the
    picker's): 16 requests decoding, a block each per step, a step's stores recomputed together against one
    by one (the baseline)."""
    payloads = [p for _, p in decode_steps(n, 1, 11)]

    def from_bytes() -> PodEventApplier:
        ap = PodEventApplier("p", BlockIndex(), BlockHasher(BLOCK))
        for i, payload in enumerate(payloads):
            ap.apply_payload(payload)
            if i % 16 == 15:
                ap.flush()
        ap.flush()
        return ap

    def decoded() -> PodEventApplier:
        ap = PodEventApplier("p", BlockIndex(), BlockHasher(BLOCK))
        for payload in payloads:
            ap.apply(decode_batch_lenient(payload).batch)
        return ap

    best = _events_per_cpu_s({"bytes": from_bytes, "decoder": decoded}, n)
    print(f"ingest in process, decode-step events: {best['bytes']:,.0f}/CPU-s from their bytes, "
          f"{best['decoder']:,.0f}/CPU-s decoded into events ({best['bytes'] / best['decoder']:.2f} ×)",
          flush=True)
    # a pod whose keys are recomputed (vLLM's sha256 on an xxh3_64 pool): 16 requests decoding, a block each
    # per step; a step's stores recomputed together against, the baseline, one by one
    engine, rng = BlockHasher(BLOCK, "sha256_cbor"), random.Random(12)
    steps = n // 16 // 4
    toks = [[rng.randrange(152_064) for _ in range(BLOCK * steps)] for _ in range(16)]
    ehs = [hashes_as_ints(engine.hash_tokens(t)) for t in toks]
    batches = [KVEventBatch(ts=0.0, events=[
        stored([ehs[r][s]], ehs[r][s - 1] if s else None, toks[r][s * BLOCK : (s + 1) * BLOCK], BLOCK, "GPU")
        for r in range(16)]) for s in range(steps)]

    def recomputed(cls: type[PodEventApplier]) -> Callable[[], PodEventApplier]:
        def run() -> PodEventApplier:
            ap = cls("p", BlockIndex(), BlockHasher(BLOCK), recompute_keys=True)
            for b in batches:
                ap.apply(b)
            assert ap.hashes_like_us is not True
            return ap
        return run

    rec = _events_per_cpu_s({"together": recomputed(PodEventApplier), "one_by_one": recomputed(_OneByOne)},
                            16 * steps)
    print(f"ingest in process, a pod whose keys are recomputed: {rec['together']:,.0f}/CPU-s a step's "
          f"stores together, {rec['one_by_one']:,.0f}/CPU-s one by one "
          f"({rec['together'] / rec['one_by_one']:.2f} ×)", flush=True)
    return {"ingest_in_process_events_per_cpu_s": round(best["bytes"]),
            "ingest_in_process_decoder_events_per_cpu_s": round(best["decoder"]),
            "ingest_from_bytes_vs_decoder": round(best["bytes"] / best["decoder"], 2),
            "ingest_recomputed_events_per_cpu_s": round(rec["together"]),
            "ingest_recomputed_one_by_one_events_per_cpu_s": round(rec["one_by_one"]),
            "ingest_recomputed_together_vs_one_by_one": round(rec["together"] / rec["one_by_one"], 2)}


def _scrape(port: int) -> dict[str, float]:
    """The EPP's unlabelled metrics (name → value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def pick_latencies(target: str, bodies: list[bytes], n: int) -> npt.NDArray[np.float64]:
    """Client-side time of whole ext_proc exchanges (headers, body, pick, echoed body), one at a time (ms)."""
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    out = []
    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        for i in range(n + 10):
            t0 = time.perf_counter()
            call = stub.Process(iter(messages(bodies[i % len(bodies)])))
            async for resp in call:
                if resp.HasField("immediate_response") or (
                    resp.HasField("request_body")
                    and resp.request_body.response.body_mutation.streamed_response.end_of_stream
                ):
                    break
            call.cancel()
            if i >= 10:  # warm-up
                out.append((time.perf_counter() - t0) * 1e3)
    return np.array(out)


def reference_bytes_per_entry(entries: int, pods: int = WARM_PODS, seed: int = 5) -> tuple[float, float]:
    """Bytes per (block, pod) entry of the previous index layout (``key → {pod: mask}`` dicts plus a per-pod
    key ``set``) and of :class:`BlockIndex`, both measured with ``tracemalloc`` on the same entries (keys
    shared by 1–3 pods, as the warm plan's conversations)."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, np.iinfo(np.uint64).max, entries // 2, dtype=np.uint64, endpoint=True)
    holders = [rng.choice(pods, int(n), replace=False).tolist()
               for n in rng.choice([1, 2, 3], len(keys), p=[0.7, 0.2, 0.1])]
    names = [f"pod-{i}" for i in range(pods)]
    by_pod: dict[int, list[int]] = {}
    for k, hs in zip(keys.tolist(), holders, strict=True):
        for p in hs:
            by_pod.setdefault(p, []).append(k)
    total = sum(len(v) for v in by_pod.values())
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    old: dict[int, dict[str, int]] = {}
    owned: dict[str, set[int]] = {}
    for p, ks in by_pod.items():
        own = owned.setdefault(names[p], set())
        for k in ks:
            h = old.get(k)
            if h is None:
                old[k] = {names[p]: 1}
            else:
                h[names[p]] = h.get(names[p], 0) | 1
            own.add(k)
    old_bytes = tracemalloc.get_traced_memory()[0] - base
    del old, owned
    base = tracemalloc.get_traced_memory()[0]
    idx = BlockIndex()
    for p, ks in by_pod.items():
        for i in range(0, len(ks), 512):
            idx.add(names[p], ks[i : i + 512])
    new_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert idx.num_entries == total
    return old_bytes / total, new_bytes / total


def warm_run(workdir: Path, entries: int, seconds: float, n_lat: int, seed: int = 7,
             front: str = "auto", decode_events: int = 600_000) -> dict[str, Any]:
    """The EPP's index filled through its real subscriber from ``WARM_PODS`` publishing pods, then
    decisions (``front``: the EPP's ``epp.front``)."""
    print(f"warm: planning {WARM_PODS} pods, {entries:,} (block, pod) entries", flush=True)
    plan = WarmPlan(seed, entries)
    ports = [(free_port(), free_port()) for _ in range(WARM_PODS)]
    spec = workdir / "warm.json"
    spec.write_text(json.dumps({"seed": seed, "entries": entries, "ports": ports}))
    helper = subprocess.Popen([sys.executable, "-m", "bench.epp", "--publish", str(spec)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])
    proc: subprocess.Popen[bytes] | None = None
    try:
        assert helper.stdout is not None and helper.stdin is not None
        if helper.stdout.readline().strip() != "ready":
            raise RuntimeError("publisher process did not start")
        pods = [{"name": f"pod-{i}", "address": "127.0.0.1", "port": 20000 + i,
                 "events": f"tcp://127.0.0.1:{a}", "replay": f"tcp://127.0.0.1:{b}"}
                for i, (a, b) in enumerate(ports)]
        proc, grpc_port, metrics_port = start_epp(workdir, pods, recompute_keys=False, front=front)
        time.sleep(2.0)  # the subscriber's SUB sockets join (and ask each pod's replay endpoint from 0)
        rss0 = rss_mb(proc.pid)
        helper.stdin.write("go\n")
        helper.stdin.flush()
        t0 = time.perf_counter()
        published = events_published = -1
        seen = 0.0
        last = t0
        while True:
            line = helper.stdout.readline() if published < 0 else ""
            if line.startswith("published"):
                published, events_published = int(line.split()[1]), int(line.split()[3])
                print(f"warm: {published:,} entries published in {float(line.split()[2]):.1f} s",
                      flush=True)
            elif line.startswith("progress"):
                m = _scrape(metrics_port)
                print(f"warm: published {int(line.split()[1]):,}, "
                      f"indexed {m.get('kvfleet_epp_index_entries', 0):,.0f}", flush=True)
                continue
            elif published < 0:
                raise RuntimeError(f"publisher process ended: {line!r}")
            seen = _scrape(metrics_port).get("kvfleet_epp_index_entries", 0.0)
            if seen >= published:
                break
            if time.perf_counter() - last > 5:
                last = time.perf_counter()
                print(f"warm: indexed {seen:,.0f} of {published:,}", flush=True)
            if time.perf_counter() - t0 > 1200:
                raise RuntimeError(f"index stuck at {seen:,.0f} of {published:,} entries")
            time.sleep(0.2)
        ingest_s = time.perf_counter() - t0
        m = _scrape(metrics_port)
        rss1 = rss_mb(proc.pid)
        print(f"warm: {seen:,.0f} entries indexed in {ingest_s:.1f} s ({seen / ingest_s:,.0f} blocks/s); "
              f"table {m['kvfleet_epp_index_bytes'] / seen:.1f} B/entry; EPP RSS {rss0:.0f} → {rss1:.0f} MB",
              flush=True)
        target = f"127.0.0.1:{grpc_port}"
        small, large = plan.prompts_4k(), plan.prompts_220kb()
        c0 = cpu_s(proc.pid)
        d4k, e4k = asyncio.run(decisions_per_s(target, small, seconds))
        c1 = cpu_s(proc.pid)
        cpu4k = (c1 - c0) / max(1.0, d4k * seconds + 16) * 1e3
        print(f"warm decisions/s, 4k-token prompts: {d4k:8.0f}  (errors {e4k}); "
              f"EPP CPU {cpu4k:.2f} ms/decision", flush=True)
        d220, e220 = asyncio.run(decisions_per_s(target, large, seconds))
        cpu220 = (cpu_s(proc.pid) - c1) / max(1.0, d220 * seconds + 16) * 1e3
        print(f"warm decisions/s, 220 KB prompts:  {d220:8.0f}  (errors {e220}); "
              f"EPP CPU {cpu220:.2f} ms/decision", flush=True)
        m2 = _scrape(metrics_port)
        hit = (m2["kvfleet_epp_predicted_hit_tokens_total"]
               - m["kvfleet_epp_predicted_hit_tokens_total"]) / max(
            1.0, m2["kvfleet_epp_prompt_tokens_total"] - m["kvfleet_epp_prompt_tokens_total"])
        lat = asyncio.run(pick_latencies(target, small, n_lat))
        lat220 = asyncio.run(pick_latencies(target, large, max(20, n_lat // 10)))
        print(f"warm pick, one at a time: 4k p50 {np.percentile(lat, 50):.2f} ms, "
              f"p99 {np.percentile(lat, 99):.2f} ms; "
              f"220 KB p50 {np.percentile(lat220, 50):.2f} ms; predicted hit ratio {hit:.3f}", flush=True)
        rss2 = rss_mb(proc.pid)
        # decode steps through the same subscriber: one block per BlockStored event (what a decoding
        # request publishes each time it fills a block), after the decisions so they route on the warm index
        base = _scrape(metrics_port).get("kvfleet_epp_index_entries", 0.0)
        helper.stdin.write(f"decode {decode_events}\n")
        helper.stdin.flush()
        if helper.stdout.readline().strip() != "decode-ready":
            raise RuntimeError("publisher process did not prepare the decode steps")
        k0 = thread_cpu(proc.pid).get("kv-events", 0.0)
        helper.stdin.write("go\n")
        helper.stdin.flush()
        t0 = time.perf_counter()
        while _scrape(metrics_port).get("kvfleet_epp_index_entries", 0.0) < base + decode_events:
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("decode-step events not indexed within 300 s")
            time.sleep(0.05)
        decode_s = time.perf_counter() - t0
        decode_cpu = thread_cpu(proc.pid).get("kv-events", 0.0) - k0
        per_cpu_s = decode_events / max(decode_cpu, 1e-9)
        print(f"warm: {decode_events:,} decode-step events (one block each, {DECODE_BATCH} a batch) "
              f"indexed in {decode_s:.2f} s ({decode_events / decode_s:,.0f} events/s, the publisher "
              f"process beside it); the ingestion thread's CPU {decode_cpu:.2f} s: {per_cpu_s:,.0f} events "
              "per CPU second",
              flush=True)
        ref = reference_bytes_per_entry(min(entries, 1_000_000))
        print(f"index bytes per entry (tracemalloc, same 1M entries): dict-of-dicts {ref[0]:.0f}, "
              f"table {ref[1]:.1f} ({ref[0] / ref[1]:.1f}×)", flush=True)
        return {
            "warm_decisions_per_s_4k": round(d4k, 1),
            "warm_decisions_per_s_220kb": round(d220, 1),
            "warm_epp_cpu_ms_per_decision_4k": round(cpu4k, 3),
            "epp_cpu_ms_per_decision_warm_4k": round(cpu4k, 3),  # the same, by the name the aim gives it
            "warm_epp_cpu_ms_per_decision_220kb": round(cpu220, 3),
            "warm_pick_p50_ms": round(float(np.percentile(lat, 50)), 3),
            "warm_pick_p99_ms": round(float(np.percentile(lat, 99)), 3),
            "warm_pick_p50_ms_220kb": round(float(np.percentile(lat220, 50)), 3),
            "warm_predicted_hit_ratio": round(hit, 4),
            "index_bytes_per_entry": round(m["kvfleet_epp_index_bytes"] / seen, 2),
            "index_rss_bytes_per_entry": round((rss1 - rss0) * 2**20 / seen, 2),
            "old_index_bytes_per_entry": round(ref[0], 1),
            "new_index_bytes_per_entry_traced": round(ref[1], 2),
            "warm_index_entries": int(seen),
            "warm_pods": WARM_PODS,
            "ingest_blocks_per_s": round(seen / ingest_s, 0),
            "ingest_prefill_events_per_s": round(events_published / ingest_s, 0),
            "ingest_events_per_s": round(per_cpu_s, 0),
            "ingest_events_per_s_wall": round(decode_events / decode_s, 0),
            "ingest_thread_cpu_s": round(decode_cpu, 2),
            "ingest_s": round(ingest_s, 1),
            "epp_rss_mb": round(rss2, 1),
            "warm_errors": e4k + e220,
        }
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        if helper.stdin is not None:
            helper.stdin.close()
        helper.wait(30)


if __name__ == "__main__":
    raise SystemExit(main())
