"""Where the pick runs: a long body's off the gRPC event loop, on the servicer's one-thread executor, while
other streams move on; a short body's on the loop itself, unless a pick holds the routing lock (then on the
thread, behind it): picks never overlap."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.server import ExtProcServicer
from tests.conftest import eventually
from tests.epp.test_scheduling import router

T = TypeVar("T")


def _messages(body: bytes) -> list[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]))
    cfg = pb.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)
    return [
        pb.ProcessingRequest(request_headers=headers, protocol_config=cfg),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]


async def _stream(svc: ExtProcServicer, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async def it() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    return [r async for r in svc.Process(it(), None)]


def _run(svc: ExtProcServicer, main: Callable[[], Coroutine[Any, Any, T]],
         release: threading.Event | None = None) -> T:
    """``main`` on an event loop of its own; then the picks held back are released and the routing thread
    stopped, whatever happened."""
    try:
        return asyncio.run(main())
    finally:
        if release is not None:
            release.set()
        svc.route_pool.shutdown(wait=True)


def test_the_pick_runs_on_the_route_thread_while_the_loop_serves_other_streams() -> None:
    r = router()
    svc = ExtProcServicer(r, EppMetrics(), 1 << 20, inline_route_bytes=64)
    threads: list[str] = []
    release = threading.Event()
    route = r.route

    def slow_route(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        assert release.wait(10)
        return route(*a, **kw)

    r.route = slow_route  # type: ignore[method-assign]
    body = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()

    async def main() -> None:
        first = asyncio.ensure_future(_stream(svc, _messages(body)))
        await eventually(lambda: threads, "the first stream's pick blocking its thread", timeout_s=10)
        # meanwhile the loop still answers another stream's messages (the headers need no pick)
        headers_only = await asyncio.wait_for(_stream(svc, _messages(body)[:1]), 5)
        assert headers_only == [] and not first.done()
        release.set()
        out = await asyncio.wait_for(first, 10)
        assert out[0].request_headers.response.header_mutation.set_headers

    _run(svc, main, release)
    assert threads and all(t.startswith("epp-route") for t in threads)


def test_a_short_body_is_routed_on_the_loop() -> None:
    r = router()
    svc = ExtProcServicer(r, EppMetrics(), 1 << 20, inline_route_bytes=1024)
    threads: list[str] = []
    route = r.route

    def spy(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return route(*a, **kw)

    r.route = spy  # type: ignore[method-assign]
    loop_thread: list[str] = []

    async def main() -> list[pb.ProcessingResponse]:
        loop_thread.append(threading.current_thread().name)
        return await _stream(svc, _messages(json.dumps({"model": "m", "prompt": "hi " * 50}).encode()))

    out = _run(svc, main)
    assert out[0].request_headers.response.header_mutation.set_headers
    assert threads == loop_thread and svc.inline_routes == 1


def test_a_short_body_waits_behind_a_pick_in_progress_without_blocking_the_loop() -> None:
    r = router()
    svc = ExtProcServicer(r, EppMetrics(), 1 << 20, inline_route_bytes=1024)
    threads: list[str] = []
    running = [0, 0]  # picks running now, most at once
    release = threading.Event()
    route = r.route

    def slow_route(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        running[0] += 1
        running[1] = max(running)
        try:
            if len(threads) == 1:
                assert release.wait(10)
            return route(*a, **kw)
        finally:
            running[0] -= 1

    r.route = slow_route  # type: ignore[method-assign]
    long = json.dumps({"model": "m", "prompt": "hello " * 500}).encode()
    short = json.dumps({"model": "m", "prompt": "hi " * 50}).encode()

    async def main() -> None:
        first = asyncio.ensure_future(_stream(svc, _messages(long)))
        await eventually(lambda: threads, "the long body's pick blocking the routing thread", timeout_s=10)
        second = asyncio.ensure_future(_stream(svc, _messages(short)))
        # the short body found the lock taken: it queued for the thread, and the loop still serves others
        headers_only = await asyncio.wait_for(_stream(svc, _messages(short)[:1]), 5)
        assert headers_only == [] and not first.done() and not second.done()
        release.set()
        for f in (first, second):
            out = await asyncio.wait_for(f, 10)
            assert out[0].request_headers.response.header_mutation.set_headers

    _run(svc, main, release)
    assert len(threads) == 2 and all(t.startswith("epp-route") for t in threads)
    assert running[1] == 1 and svc.inline_routes == 0
