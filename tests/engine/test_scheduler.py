"""Continuous batching and cost-model timing (modelled seconds, never wall time).

Covers: concurrent requests share steps (fewer steps than run one by one) and all
finish with their own tokens; ``max_num_seqs`` bounds the running batch; only the
uncached suffix is charged as prefill; a request that must wait for KV blocks is
admitted once another finishes; ``reset`` (signed with the pool secret) empties
every tier and is refused while requests run.
"""

from __future__ import annotations

import asyncio

import numpy as np

from kvfleet.config import load
from kvfleet.engine.kv import EngineKV
from kvfleet.engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent
from tests.engine.conftest import EngineFactory


def make(**engine: object) -> Scheduler:
    s = load(None, {"engine": {"time_factor": 0.0, **engine}})
    return Scheduler(EngineKV(s.engine, s.cache))


async def run_all(sched: Scheduler, reqs: list[Request]) -> list[list[int]]:
    for r in reqs:
        sched.submit(r)

    async def drain(r: Request) -> list[int]:
        toks: list[int] = []
        while True:
            ev = await r.events.get()
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
            else:
                assert isinstance(ev, FinishEvent), ev
                return toks

    return await asyncio.gather(*(drain(r) for r in reqs))


def prompt(base: int, n: int = 64) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.uint32)


async def test_batching_shares_steps_and_bounds_the_batch() -> None:
    sched = make(max_num_seqs=4)
    sched.start()
    peak = 0
    orig = sched.on_step

    def watch() -> None:
        nonlocal peak
        peak = max(peak, sched.num_running)
        orig()

    sched.on_step = watch
    reqs = [Request(f"r{i}", prompt(1000 * i), 8) for i in range(8)]
    outs = await run_all(sched, reqs)
    await sched.close()
    assert all(len(o) == 8 for o in outs)
    assert len({tuple(o) for o in outs}) == 8  # different prompts, different outputs
    assert peak == 4
    assert sched.stats.steps < 8 * 8


async def test_only_the_uncached_suffix_is_prefilled() -> None:
    sched = make()
    sched.start()
    await run_all(sched, [Request("a", prompt(0, 1600), 1)])
    cold = sched.stats.modelled_seconds
    await run_all(sched, [Request("b", prompt(0, 1600), 1)])
    warm = sched.stats.modelled_seconds - cold
    await sched.close()
    tps, step = sched.model.prefill_tokens_per_s, sched.settings.decode_ms_per_step / 1000
    assert abs(cold - (1600 / tps + step)) < 1e-9
    assert abs(warm - (1 / tps + step)) < 1e-9


async def test_a_request_waits_for_blocks_then_runs() -> None:
    """8 blocks hold one 96-token request (6 blocks + its decode), not two: the second is admitted only once
    the first has finished and freed its blocks, then completes too."""
    sched = make(num_gpu_blocks=8, max_num_batched_tokens=64)
    sched.start()
    x, y = Request("x", prompt(0, 96), 4), Request("y", prompt(5000, 96), 4)
    order: list[str] = []
    seen_first = {"x": False, "y": False}

    async def watch(r: Request) -> list[int]:
        toks: list[int] = []
        while True:
            ev = await r.events.get()
            if isinstance(ev, TokenEvent):
                if not seen_first[r.request_id]:
                    seen_first[r.request_id] = True
                    order.append(f"{r.request_id}:first")
                toks.append(ev.token_id)
            else:
                assert isinstance(ev, FinishEvent), ev
                order.append(f"{r.request_id}:finish")
                return toks

    sched.submit(x)
    sched.submit(y)
    outs = await asyncio.gather(watch(x), watch(y))
    await sched.close()
    assert [len(o) for o in outs] == [4, 4]
    assert order == ["x:first", "x:finish", "y:first", "y:finish"], order


async def test_reset_endpoint_empties_the_cache(make_engine: EngineFactory, pool_secret: bytes) -> None:
    eng = await make_engine()
    body = {"model": "llama-3-8b", "prompt": list(range(64)), "max_tokens": 1}
    await eng.post("/v1/completions", body)
    st, _, _ = await eng.call("POST", "/kvfleet/v1/reset", signed=True)
    assert st == 200
    _, again, _ = await eng.post("/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
