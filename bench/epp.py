"""bench.epp: the picker's decision rate over ext_proc, and the latency it adds behind a real Envoy.

1. Decisions per second: the EPP runs as its own process (``kvfleet epp``, 8
   pods in a static pool, no events) and a gRPC client drives ext_proc streams
   exactly as Envoy does in FULL_DUPLEX_STREAMED mode (headers, then the body,
   then read the pick and the echoed body), with 16 streams in flight. Prompts
   are 4k tokens (4 KiB of text with the byte-level tokenizer: every byte is a
   token) and 220 KB, each a shared 1 KiB system prefix + a unique suffix.
2. Added latency: the same small upstream behind two Envoys in the same run,
   one with the ext_proc filter (Envoy → EPP → upstream) and one without
   (Envoy → upstream, the baseline); sequential requests with 4k-token
   prompts, alternating between the two; added = with − without at p50/p99.

Last line: ``{"bench": "epp", "decisions_per_s_4k", "decisions_per_s_220kb", "added_p50_ms", "added_p99_ms", ...}``.
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
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvfleet.epp.envoy import EnvoyProcess, free_port
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


def messages(body: bytes) -> list[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
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


async def decisions_per_s(target: str, bodies: list[bytes], seconds: float, concurrency: int = 16) -> tuple[float, int]:
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        done = 0
        errors = 0
        stop_at = time.perf_counter() + seconds

        async def one(body: bytes) -> bool:
            call = stub.Process(iter(messages(body)))
            picked = False
            async for resp in call:
                if resp.HasField("request_headers"):
                    picked = bool(resp.request_headers.response.header_mutation.set_headers)
                if resp.HasField("immediate_response"):
                    return False
                if resp.HasField("request_body") and resp.request_body.response.body_mutation.streamed_response.end_of_stream:
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
            return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}})

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``), to price a decision independently of contention."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_post(url: str, body: bytes) -> float:
    req = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    return time.perf_counter() - t0


def start_epp(workdir: Path, pods: list[dict[str, Any]]) -> tuple[subprocess.Popen[bytes], int]:
    pods_file = workdir / "pods.yaml"
    pods_file.write_text(yaml.safe_dump({"pools": [{"name": "bench", "models": ["m"], "pods": pods}]}))
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    cfg = workdir / "epp.yaml"
    cfg.write_text(yaml.safe_dump({"epp": {"host": "127.0.0.1", "grpc_port": grpc_port, "health_port": health_port,
                                           "metrics_port": metrics_port, "pods_file": str(pods_file)}}))
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.epp.main", "--config", str(cfg), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=open(workdir / "epp.log", "wb"))  # noqa: SIM115
    deadline = time.monotonic() + 30
    while not health_check(f"127.0.0.1:{health_port}", 0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"epp did not start: {(workdir / 'epp.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, grpc_port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.epp", description="EPP decision rate and added latency")
    ap.add_argument("--quick", action="store_true", help="short measurements (fits in 60 s)")
    args = ap.parse_args(argv)
    seconds = 4.0 if args.quick else 15.0
    print(f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (other processes skew every figure)")
    n_lat = 300 if args.quick else 2000
    workdir = Path(tempfile.mkdtemp(prefix="kvfleet-bench-epp-"))
    upstream = Upstream().start()
    pods = [{"name": f"pod-{i}", "address": "127.0.0.1", "port": upstream.port if i == 0 else 20000 + i} for i in range(8)]
    proc, grpc_port = start_epp(workdir, pods)
    envoys: list[EnvoyProcess] = []
    try:
        target = f"127.0.0.1:{grpc_port}"
        small = prompts(256, 4096, 1)
        large = prompts(32, 220 * 1024, 2)
        c0 = cpu_seconds(proc.pid)
        d4k, e4k = asyncio.run(decisions_per_s(target, small, seconds))
        c1 = cpu_seconds(proc.pid)
        cpu4k = (c1 - c0) / max(1.0, d4k * seconds + 16) * 1e3
        print(f"decisions/s, 4k-token prompts:  {d4k:8.0f}  (errors {e4k}); EPP CPU {cpu4k:.2f} ms/decision")
        d220, e220 = asyncio.run(decisions_per_s(target, large, seconds))
        cpu220 = (cpu_seconds(proc.pid) - c1) / max(1.0, d220 * seconds + 16) * 1e3
        print(f"decisions/s, 220 KB prompts:   {d220:8.0f}  (errors {e220}); EPP CPU {cpu220:.2f} ms/decision")
        proc.terminate()
        proc.wait(10)
        # latency: a single-pod pool so every pick lands on the real upstream
        proc, grpc_port = start_epp(workdir, pods[:1])
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
        print(f"through Envoy, 4k-token prompts: p50 {np.percentile(wa, 50):.2f} ms with EPP vs {np.percentile(wb, 50):.2f} ms without; "
              f"p99 {np.percentile(wa, 99):.2f} vs {np.percentile(wb, 99):.2f}")
        out = {
            "bench": "epp",
            "quick": args.quick,
            "decisions_per_s_4k": round(d4k, 1),
            "decisions_per_s_220kb": round(d220, 1),
            "epp_cpu_ms_per_decision_4k": round(cpu4k, 3),
            "epp_cpu_ms_per_decision_220kb": round(cpu220, 3),
            "decisions_per_cpu_s_4k": round(1e3 / cpu4k, 1) if cpu4k > 0 else None,
            "decisions_per_cpu_s_220kb": round(1e3 / cpu220, 1) if cpu220 > 0 else None,
            "added_p50_ms": round(added_p50, 3),
            "added_p99_ms": round(added_p99, 3),
            "baseline_p50_ms": round(float(np.percentile(wb, 50)), 3),
            "baseline_p99_ms": round(float(np.percentile(wb, 99)), 3),
            "errors": e4k + e220,
            "cpus": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    finally:
        for e in envoys:
            e.stop()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        upstream.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
