"""A gateway with one picker for several InferencePools names the pool its route invoked on each ext_proc
stream (gRPC metadata ``x-kvfleet-inference-pool``, set per pool by ``kvfleet gateway-extension``): the pick
stays in that pool whatever model the body names; a pool the picker does not serve gets 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.protocol import DEST_HEADER, POOL_METADATA, invoked_pool
from kvfleet.epp.server import ExtProcServicer
from tests.epp.test_scheduling import pools, router

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class Context:
    def __init__(self, metadata: list[tuple[str, Any]]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, Any]]:
        return self.metadata


def _messages(prompt: str) -> list[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]))
    cfg = pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX)
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    return [pb.ProcessingRequest(request_headers=headers, protocol_config=cfg),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


def _pick(svc: ExtProcServicer, prompt: str, context: Context | None) -> pb.ProcessingResponse:
    async def run() -> pb.ProcessingResponse:
        async def it() -> AsyncIterator[pb.ProcessingRequest]:
            for m in _messages(prompt):
                yield m
            await asyncio.Event().wait()

        gen = svc.Process(it(), context)
        first: pb.ProcessingResponse = await gen.__anext__()
        await gen.aclose()  # type: ignore[attr-defined]  # an async generator
        return first

    return asyncio.run(asyncio.wait_for(run(), 10))


def _endpoint(resp: pb.ProcessingResponse) -> str:
    sets = resp.request_headers.response.header_mutation.set_headers
    return str(next(h.header.raw_value.decode() for h in sets if h.header.key == DEST_HEADER))


def test_picks_stay_in_the_pool_the_route_invoked() -> None:
    data = pools(3, npools=2)  # pool-0 and pool-1, both serving model "m"
    ports: dict[str, set[str]] = {p["name"].split("-")[0]: set() for pl in data["pools"] for p in pl["pods"]}
    for pl in data["pools"]:
        for p in pl["pods"]:
            ports[p["name"].split("-")[0]].add(f'{p["address"]}:{p["port"]}')
    svc = ExtProcServicer(router(data), EppMetrics(), 1 << 20)
    try:
        prompts = [f"prompt number {i} " * 20 for i in range(24)]
        free = {_endpoint(_pick(svc, q, None)) for q in prompts}
        assert free & ports["p0"] and free & ports["p1"]  # unscoped, both pools serve the model
        for name, mine in (("pool-0", ports["p0"]), ("pool-1", ports["p1"])):
            ctx = Context([("other", "x"), (POOL_METADATA, name)])
            assert {_endpoint(_pick(svc, q, ctx)) for q in prompts} <= mine
        gone = _pick(svc, prompts[0], Context([(POOL_METADATA, "pool-9")]))
        assert gone.immediate_response.status.code == 503
        assert b"pool-9" in gone.immediate_response.body
    finally:
        svc.route_pool.shutdown(wait=True)


def test_the_pool_name_is_read_from_metadata() -> None:
    assert invoked_pool([("a", "b"), (POOL_METADATA, b" pool-1 ")]) == "pool-1"
    assert invoked_pool([]) == ""
    assert len(invoked_pool([(POOL_METADATA, "x" * 1000)])) == 254  # matches no Kubernetes name
