"""bench.engine: CPU cost of the engine simulator, against baselines measured in the same run.

1. KV admission: ``EngineKV.admit`` + ``free`` (hash, block table, KV bytes, events,
   demotion) on fresh 16k-token prompts, against hashing the same tokens alone
   (``BlockHasher.hash_tokens``, the part no engine can skip) → ``admit_ratio``.
2. HTTP: ``/v1/completions`` with 4k-token id prompts and ``time_factor 0`` (no
   modelled sleep: pure serving overhead), against a bare aiohttp handler that
   parses the same JSON and answers → ``http_ratio``.

``python -m bench.engine [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from kvfleet.cache.hashing import BlockHasher
from kvfleet.config import load
from kvfleet.engine.kv import EngineKV
from kvfleet.engine.server import EngineServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def bench_admit(n: int, tokens: int) -> tuple[float, float]:
    s = load(None, {"engine": {"num_gpu_blocks": 4 * tokens // 16,
                               "tiers": {"cpu_blocks": 4 * tokens // 16}}})
    kv = EngineKV(s.engine, s.cache, model=s.tiers.model)
    hasher = BlockHasher()
    prompts = [np.arange(i * tokens, (i + 1) * tokens, dtype=np.uint32) for i in range(n)]
    t = time.perf_counter()
    for p in prompts:
        hasher.hash_tokens(p)
    hash_tps = n * tokens / (time.perf_counter() - t)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        kv.admit(i, p)
        kv.free(i)
    admit_tps = n * tokens / (time.perf_counter() - t)
    return hash_tps, admit_tps


async def _drive(url: str, bodies: list[bytes], concurrency: int) -> float:
    async with aiohttp.ClientSession() as s:
        sem = asyncio.Semaphore(concurrency)

        async def one(b: bytes) -> None:
            async with sem, s.post(url, data=b, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status

        await one(bodies[0])  # warm-up
        t = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return len(bodies) / (time.perf_counter() - t)


async def bench_http(n: int, tokens: int) -> tuple[float, float]:
    bodies = [
        json.dumps({"model": "llama-3-8b", "prompt": list(range(i * tokens, (i + 1) * tokens)),
                    "max_tokens": 4}).encode()
        for i in range(n)
    ]

    async def echo(request: web.Request) -> web.Response:
        data: Any = await request.json()
        return web.json_response({"choices": [{"text": "abcd"}],
                                  "usage": {"prompt_tokens": len(data["prompt"])}})

    raw_app = web.Application(client_max_size=64 << 20)
    raw_app.router.add_post("/v1/completions", echo)
    runner = web.AppRunner(raw_app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    raw = await _drive(f"http://127.0.0.1:{port}/v1/completions", bodies, 8)
    await runner.cleanup()

    port = free_port()
    server = EngineServer(load(None, {"engine": {"port": port, "time_factor": 0.0, "num_gpu_blocks": 16384,
                                                 "kv_events_port": free_port(),
                                                 "kv_events_replay_port": free_port()}}))
    server.start_publisher()
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    eng = await _drive(f"http://127.0.0.1:{port}/v1/completions", bodies, 8)
    await runner.cleanup()
    return raw, eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_admit, n_http = (20, 100) if args.quick else (100, 500)
    hash_tps, admit_tps = bench_admit(n_admit, 16384)
    print(f"KV admission: {admit_tps / 1e6:.2f} M tokens/s vs hashing alone {hash_tps / 1e6:.2f} M tokens/s")
    raw_rps, eng_rps = asyncio.run(bench_http(n_http, 4096))
    print(f"HTTP 4k-token prompts: engine {eng_rps:.0f} req/s vs bare aiohttp {raw_rps:.0f} req/s")
    print(json.dumps({
        "bench": "engine",
        "admit_tokens_per_s": round(admit_tps),
        "hash_tokens_per_s": round(hash_tps),
        "admit_ratio": round(admit_tps / hash_tps, 3),
        "http_rps": round(eng_rps, 1),
        "raw_http_rps": round(raw_rps, 1),
        "http_ratio": round(eng_rps / raw_rps, 3),
    }))


if __name__ == "__main__":
    main()
