"""Replay a workload through the gateway and record what each request saw.

Requests go out at their arrival times (open loop: a slow stack does not slow
the arrivals down), as streaming ``/v1/completions`` with the prompt as token
ids. For each one the client records the first-token time (first SSE chunk with
text), the end, the serving pod (``x-kvfleet-pod``), the prompt and cached
token counts from ``usage``, and the HTTP status or error. Each request carries
an ``x-request-id`` (``<id_prefix><index>``), which the EPP writes in its decision
log: the demo joins the two on it (the EPP's predicted cached tokens per request).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from kvfleet.demo.workload import WorkItem


@dataclass
class Outcome:
    """What one replayed request saw (times in wall seconds from its send)."""

    index: int
    status: int = 0
    pod: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str = ""
    request_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, i: int, item: WorkItem, timeout_s: float,
    id_prefix: str = "",
) -> Outcome:
    out = Outcome(i, request_id=f"{id_prefix}{i}")
    body = {
        "model": model,
        "prompt": list(item.prompt),
        "max_tokens": item.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    try:
        headers = {"x-request-id": out.request_id}
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            out.status = r.status
            out.pod = r.headers.get("x-kvfleet-pod", "")
            if r.status != 200:
                out.error = (await r.text())[:300]
                return out
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        continue
                    data = json.loads(payload)
                    if "error" in data:
                        out.error = str(data["error"].get("message", data["error"]))[:300]
                        continue
                    choices = data.get("choices") or []
                    if choices and choices[0].get("text") and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - t0
                    usage = data.get("usage")
                    if usage:
                        out.prompt_tokens = int(usage.get("prompt_tokens", 0))
                        out.completion_tokens = int(usage.get("completion_tokens", 0))
                        out.cached_tokens = int(
                            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.latency_s = time.perf_counter() - t0
    if not out.prompt_tokens:
        out.prompt_tokens = len(item.prompt)
    return out


async def replay(
    url: str,
    model: str,
    items: Sequence[WorkItem],
    on_done: Callable[[Outcome], None] = lambda o: None,
    timeout_s: float = 120.0,
    max_connections: int = 256,
    id_prefix: str = "",
) -> tuple[list[Outcome], float]:
    """Send every item at its time; returns the outcomes (in item order) and the wall duration.
    Request ids are ``id_prefix`` + the item's index."""
    conn = aiohttp.TCPConnector(limit=max_connections)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.perf_counter()

        async def fire(i: int, item: WorkItem) -> Outcome:
            delay = item.at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            o = await _one(session, url, model, i, item, timeout_s, id_prefix)
            on_done(o)
            return o

        outcomes = await asyncio.gather(*(fire(i, it) for i, it in enumerate(items)))
        return list(outcomes), time.perf_counter() - start
