"""A black-box client of an endpoint picker (EPP): Envoy's side of the ext_proc stream, as GIE's endpoint
picker protocol (v1.0) has a data plane speak it, over gRPC only.

It imports nothing of any EPP: the published ext_proc and gRPC health protos (``xds-protos``,
``grpcio-health-checking``) and the standard library. One :class:`Exchange` is one HTTP request through
the picker: request headers (with the subset hint in ``metadata_context``, as a data plane sends it), the
body in one or more chunks, then optionally the response phase (headers carrying
``x-gateway-destination-endpoint-served``, a body in chunks), each answered as the processing mode
requires.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEST = "x-gateway-destination-endpoint"
LB_NS = "envoy.lb"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_END = object()


class ProtocolViolation(AssertionError):
    """The picker answered something the protocol (or ext_proc) does not allow."""


@dataclass
class Pick:
    """What the picker answered for the request phase."""

    status: int | None = None  # an ImmediateResponse's HTTP status; None when it picked
    header: str | None = None  # x-gateway-destination-endpoint, as set on the request
    metadata: str | None = None  # envoy.lb → x-gateway-destination-endpoint
    body_back: bytes = b""  # FULL_DUPLEX_STREAMED: the request body the picker streamed back to the proxy
    body_ended: bool = False
    immediate_body: bytes = b""
    responses: list[pb.ProcessingResponse] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        """The ordered endpoint list (primary first), from the header."""
        return [e.strip() for e in (self.header or "").split(",") if e.strip()]


def _struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def _headers(path: str, method: str, extra: dict[str, str], end: bool) -> pb.HttpHeaders:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
          {":method": method, ":path": path, ":authority": "gateway", ":scheme": "http",
           "content-type": "application/json", **extra}.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=end)


def _set_headers(resp: pb.CommonResponse) -> dict[str, str]:
    out = {}
    for h in resp.header_mutation.set_headers:
        out[h.header.key.lower()] = h.header.value or h.header.raw_value.decode()
    return out


class Exchange:
    """One HTTP request's ext_proc stream to the picker at ``address``."""

    def __init__(self, channel: grpc.Channel, mode: int = FULL_DUPLEX, timeout_s: float = 10.0) -> None:
        self.mode = mode
        self.timeout_s = timeout_s
        self._out: queue.Queue[Any] = queue.Queue()
        stub = pb_grpc.ExternalProcessorStub(channel)
        self._calls = stub.Process(self._requests(), timeout=timeout_s * 3)
        self.closed = False

    def _requests(self) -> Iterator[pb.ProcessingRequest]:
        while True:
            item = self._out.get()
            if item is _END:
                return
            yield item

    def send(self, msg: pb.ProcessingRequest) -> None:
        self._out.put(msg)

    def recv(self) -> pb.ProcessingResponse:
        try:
            return next(self._calls)
        except StopIteration:
            raise ProtocolViolation("the picker closed the stream before answering") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._out.put(_END)
            self._calls.cancel()

    # -- request phase ------------------------------------------------------------------------------
    def request(self, body: bytes, path: str = "/v1/completions", subset: Sequence[str] | None = None,
                chunks: int = 1, headers: dict[str, str] | None = None) -> Pick:
        """Send the request phase and read the picker's answer to it."""
        meta = base_pb2.Metadata()
        if subset is not None:
            meta.filter_metadata[SUBSET_NS].CopyFrom(_struct({SUBSET_KEY: list(subset)}))
        first = pb.ProcessingRequest(
            request_headers=_headers(path, "POST", {"content-length": str(len(body)), **(headers or {})},
                                     end=False),
            metadata_context=meta,
            protocol_config=pb.ProtocolConfiguration(request_body_mode=self.mode,
                                                     response_body_mode=self.mode))
        self.send(first)
        size = max(1, -(-len(body) // chunks))
        pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        pick = Pick()
        if self.mode == BUFFERED:  # headers are answered before the body is sent
            self._take(pick, self.recv())
            if pick.status is not None:
                return pick
        for i, piece in enumerate(pieces):
            self.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece,
                                                                    end_of_stream=i == len(pieces) - 1)))
        while True:
            self._take(pick, self.recv())
            if pick.status is not None:
                return pick
            if self.mode == BUFFERED and pick.header is not None:
                return pick
            if self.mode == FULL_DUPLEX and pick.body_ended:
                return pick

    def _take(self, pick: Pick, resp: pb.ProcessingResponse) -> None:
        pick.responses.append(resp)
        kind = resp.WhichOneof("response")
        if kind == "immediate_response":
            pick.status = resp.immediate_response.status.code
            pick.immediate_body = resp.immediate_response.body
            return
        if kind not in ("request_headers", "request_body"):
            raise ProtocolViolation(f"request phase answered with {kind}")
        common = getattr(resp, kind).response
        hdrs = _set_headers(common)
        if DEST in hdrs:
            if pick.header is not None:
                raise ProtocolViolation("the destination header was set twice")
            pick.header = hdrs[DEST]
        if resp.HasField("dynamic_metadata"):
            ns = resp.dynamic_metadata.fields.get(LB_NS)
            if ns is not None:
                v = ns.struct_value.fields.get(DEST)
                if v is not None:
                    pick.metadata = v.string_value
        sr = common.body_mutation.streamed_response
        if common.body_mutation.HasField("streamed_response"):
            if self.mode != FULL_DUPLEX:
                raise ProtocolViolation("a streamed body mutation outside FULL_DUPLEX_STREAMED")
            if pick.header is None:
                raise ProtocolViolation("the body was streamed back before the destination was set")
            pick.body_back += sr.body
            pick.body_ended = sr.end_of_stream

    # -- response phase -----------------------------------------------------------------------------
    def respond(self, served: str | None, body: bytes, chunks: int = 1) -> bytes:
        """Send the response phase (headers with the served endpoint, the body in ``chunks``); returns the
        response body as the picker hands it back (FULL_DUPLEX_STREAMED) or ``body`` (BUFFERED)."""
        meta = base_pb2.Metadata()
        if served is not None:
            meta.filter_metadata[LB_NS].CopyFrom(_struct({SERVED_KEY: served}))
        hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode())
              for k, v in {":status": "200", "content-type": "application/json"}.items()]
        self.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv)),
                                       metadata_context=meta))
        resp = self.recv()
        if resp.WhichOneof("response") != "response_headers":
            raise ProtocolViolation(f"response headers answered with {resp.WhichOneof('response')}")
        if resp.response_headers.response.status not in (pb.CommonResponse.CONTINUE, 0):
            raise ProtocolViolation("response headers not continued")
        size = max(1, -(-len(body) // chunks))
        pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        back = b""
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            self.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=last)))
            if self.mode == BUFFERED and not last:
                continue
            r = self.recv()
            if r.WhichOneof("response") != "response_body":
                raise ProtocolViolation(f"response body answered with {r.WhichOneof('response')}")
            common = r.response_body.response
            if self.mode == FULL_DUPLEX:
                if not common.body_mutation.HasField("streamed_response"):
                    raise ProtocolViolation("FULL_DUPLEX_STREAMED response body not streamed back")
                back += common.body_mutation.streamed_response.body
            else:
                back = body
        return back


def completion(prompt: str, model: str) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()


def health(address: str, service: str, timeout_s: float = 5.0) -> str:
    """The ``grpc.health.v1`` status name of ``service`` at ``address`` (``NOT_FOUND`` for an unknown
    name)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            return str(code.name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
