"""The picker closes an ext_proc stream itself once the response's last message is answered (Envoy then
proceeds without it), instead of waiting for Envoy to reset the stream at the end of the HTTP exchange: a
``grpc.aio`` call reset while its handler awaits the next message leaks native memory (grpc/grpc#43360).
The request iterator below never ends on its own, as Envoy's stream stays open until then."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.server import ExtProcServicer
from tests.epp.test_scheduling import router

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _request() -> list[pb.ProcessingRequest]:
    body = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]))
    cfg = pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX)
    return [
        pb.ProcessingRequest(request_headers=headers, protocol_config=cfg),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":status", raw_value=b"200")]))),
    ]


async def _run(svc: ExtProcServicer, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """The servicer's responses to ``msgs``, sent by a peer that keeps the stream open afterwards."""
    async def it() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m
        await asyncio.Event().wait()  # Envoy's side stays open

    return await asyncio.wait_for(_collect(svc.Process(it(), None)), 10)


async def _collect(gen: AsyncIterator[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
    return [r async for r in gen]


@pytest.mark.parametrize("last", [
    pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"usage": {}}', end_of_stream=True)),
    pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
])
def test_the_stream_ends_after_the_response_s_last_message(last: pb.ProcessingRequest) -> None:
    svc = ExtProcServicer(router(), EppMetrics(), 1 << 20)
    try:
        chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{", end_of_stream=False))
        msgs = [*_request(), chunk, last]
        out = asyncio.run(_run(svc, msgs))
    finally:
        svc.route_pool.shutdown(wait=True)
    # every message answered, the pick's headers first, then the stream closed by the picker
    assert len(out) == len(msgs)
    assert out[0].request_headers.response.header_mutation.set_headers
    assert out[-1].WhichOneof("response") == last.WhichOneof("request")


def test_the_stream_stays_open_while_the_response_goes_on() -> None:
    """A body chunk without ``end_of_stream``: the picker waits for the rest."""
    svc = ExtProcServicer(router(), EppMetrics(), 1 << 20)
    msgs = [*_request(), pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{", end_of_stream=False))]
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(_run(svc, msgs), 1.0))
    finally:
        svc.route_pool.shutdown(wait=True)
