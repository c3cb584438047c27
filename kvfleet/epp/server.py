"""The ext_proc gRPC service (``envoy.service.ext_proc.v3.ExternalProcessor``) and gRPC health.

One bidirectional stream per HTTP request, served by ``grpc.aio`` (one event
loop thread: a thread-pool server hands every message across threads, which
cost ~5 ms per request here). The body mode comes from the
stream's first message (``protocol_config``), so one server serves Envoy
listeners configured either way:

* BUFFERED: answer the headers message with an empty HeadersResponse, then the
  whole body arrives at once and the BodyResponse carries the header mutation
  and the ``envoy.lb`` metadata;
* FULL_DUPLEX_STREAMED (GIE's reference config): hold the headers answer until
  the body is complete, then send the HeadersResponse with the pick and hand
  the body back in streamed chunks.

Request paths (:func:`~kvfleet.epp.protocol.classify_path`): completions and chat
are routed by prefix and load; ``GET /v1/models`` and ``/v1/models/{id}`` are
answered by the picker from the models its pools serve; the engines' other client
paths (:data:`~kvfleet.epp.protocol.ENGINE_PATHS`) go to the least-loaded ready pod of
the invoked pool; the engines' internal ``/kvfleet/`` paths, their admin paths and any
unknown path get a JSON 404 and never reach a pod; a wrong method gets a 405.

Response headers carry the endpoint that served the request (GIE protocol v1.0:
``envoy.lb`` → ``x-gateway-destination-endpoint-served``, or the ext_proc
attribute ``upstream.address``): when a fallback served it, the in-flight
ticket and the speculative entry move to that pod. They also mark the prefill
as done (pending work off the pod); a response body is passed through and its
``usage.prompt_tokens_details.cached_tokens`` is compared with the predicted hit
(misprediction metrics). The predicted hit is the
block index's, or, when a scheduling plugin keeps a prefix index of its own (GIE's
approximate scorer), that plugin's: routing runs inside
:func:`~kvfleet.epp.scheduling.routing_request`, which shows plugins the prompt and
takes their prediction back. With the environment
variable ``KVFLEET_EPP_DECISION_LOG`` set to a path, every answered request appends
one JSON line there: its ``x-request-id`` (set by Envoy, or by the client), the pick,
each candidate's index hit (and its speculative part), the predicted and the
engine-reported cached tokens (routing diagnosis; ``docs/epp.md``). Every error ends
in an ImmediateResponse with a JSON body; the stream always ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.epp import protocol
from kvfleet.epp.errors import (
    BodyTooLargeError,
    EppError,
    ForbiddenPathError,
    MethodNotAllowedError,
    NoEndpointError,
    UnknownModelError,
)
from kvfleet.epp.keycheck import KeyCheck
from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.router import Decision, Router
from kvfleet.epp.scheduling import RequestContext, routing_request

log = logging.getLogger(__name__)
_Mode = processing_mode_pb2.ProcessingMode
_MAX_RESPONSE_CAPTURE = 1 << 20
#: the answer to a response chunk that does not end the response, by response body mode (``b""``: the chunk
#: handed back, :func:`~kvfleet.epp.protocol.passthrough_body_response`)
_CHUNK_ANSWERS = {_Mode.STREAMED: protocol.buffered_body_ack(request=False).SerializeToString(),
                  _Mode.FULL_DUPLEX_STREAMED: b""}
DECISION_LOG_ENV = "KVFLEET_EPP_DECISION_LOG"
#: the request's id in the decision log (Envoy sets it when the client does not)
REQUEST_ID_HEADER = "x-request-id"
#: the ``model_name`` label of requests for a model no pool serves
UNKNOWN_MODEL = "unknown"


def log_decision(path: str, d: Decision, reported: int | None, request_id: str = "",
                 predicted: int | None = None) -> None:
    """Append one decision as a JSON line (see the module doc); ``predicted`` defaults to the decision's."""
    rec = {
        "t": time.time(), "id": request_id, "pod": d.pod, "pool": d.pool, "prefiller": d.prefiller,
        "tokens": d.num_tokens,
        "predicted": d.predicted_hit_tokens if predicted is None else predicted, "reported": reported,
        "hits": [list(h) for h in d.hits],
    }
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as exc:
        log.warning("decision log %s: %s", path, exc)


class Stream:
    """Per-request state of one ext_proc stream."""

    def __init__(self, request_mode: int) -> None:
        self.request_mode = request_mode
        self.response_mode = _Mode.NONE
        self.path = ""
        self.kind = "inference"
        self.bodiless = False
        self.body = bytearray()
        self.decision: Decision | None = None
        self.model = ""
        self.subset: list[str] | None = None
        #: the InferencePool the gateway's route invoked (gRPC metadata ``protocol.POOL_METADATA``), if named
        self.pool = ""
        self.response = bytearray()
        self.routed = False
        self.request_id = ""
        #: the predicted cached tokens the metrics and the decision log count (module doc)
        self.predicted = 0
        #: whether the response's body is read (``EppSettings.response_body_sample``)
        self.read_response = True
        #: the answer to each chunk of the response but the last, the same whatever the chunk holds, so the
        #: native front may give it itself (:mod:`kvfleet.epp.front`): ``None``, none fixed (the picker
        #: answers each); ``b""``, the chunk handed back unchanged (FULL_DUPLEX_STREAMED); else these bytes
        #: (STREAMED: an empty BodyResponse). Set by the pick.
        self.chunk_answer: bytes | None = None
        #: how many bytes of those chunks' bodies the picker reads (the usage;
        #: :meth:`ExtProcServicer.captured`)
        self.chunk_capture = 0


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, router: Router, metrics: EppMetrics, max_body_bytes: int,
                 default_mode: str = "FULL_DUPLEX_STREAMED", inline_route_bytes: int = 16 * 1024,
                 response_body_sample: float = 1.0) -> None:
        self.created = int(time.time())
        #: the share of responses whose body is read, and the running remainder that spreads them evenly
        #: (error diffusion: every 1/sample-th response, deterministic)
        self.response_body_sample = response_body_sample
        self._sample_credit = 0.0
        self.decision_log = os.environ.get(DECISION_LOG_ENV, "")
        self.keycheck = KeyCheck(
            on_change=lambda pool, bad: metrics.key_mismatch.labels(pool).set(1.0 if bad else 0.0))
        self.router = router
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.default_mode = _Mode.BodySendMode.Value(default_mode)
        # routing (tokenize, key, index lookup, score) of a long body runs off the event loop, so streams in
        # flight keep moving; a short one runs on the loop (the hop to a thread and back cost about as much
        # CPU as its decision). One routing thread and one lock: picks stay serialized (the router's
        # bookkeeping is not built for parallel picks, and the GIL would not run two at once anyway); a
        # short body finding the lock taken goes to the thread too, so the loop never waits for it
        self.route_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-route")
        self.inline_route_bytes = inline_route_bytes
        self._route_lock = threading.Lock()
        #: decisions made on the event loop (the rest on the routing thread)
        self.inline_routes = 0

    @staticmethod
    def _ends(msg: pb.ProcessingRequest, side: str) -> bool:
        """Whether ``msg`` is the last message of the ``side`` (``request`` or ``response``) it belongs to:
        its headers or body with ``end_of_stream``, or its trailers."""
        kind = msg.WhichOneof("request")
        if kind in (f"{side}_headers", f"{side}_body"):
            return bool(getattr(msg, kind).end_of_stream)
        return bool(kind == f"{side}_trailers")

    @classmethod
    def _last(cls, msg: pb.ProcessingRequest) -> bool:
        """Whether ``msg`` ends the exchange: the response's last message. The stream is then closed
        cleanly at once ("Envoy proceeds without consulting the server"), rather than left for Envoy to
        reset when the HTTP stream ends: ``grpc.aio`` leaks the ``grpc_op`` array of a batch that fails or
        whose awaiter is cancelled (grpc/grpc#43360, open in grpcio 1.85), as when a call is reset while its
        handler awaits the next message. Under the chaos stack's steady chat load alone, an EPP's RSS grew
        0.7 MB a minute with Envoy resetting every stream, 0.3 MB a minute (levelling off) with this."""
        return cls._ends(msg, "response")

    @classmethod
    def _routes(cls, st: Stream, msg: pb.ProcessingRequest) -> bool:
        """Whether handling ``msg`` picks an endpoint: the request's last message (trailers only when the
        body has not routed already)."""
        return cls._ends(msg, "request") and not (msg.WhichOneof("request") == "request_trailers"
                                                  and st.routed)

    def open_stream(self, msg: pb.ProcessingRequest, metadata: Iterable[tuple[str, Any]]) -> Stream:
        """The state of a stream whose first message is ``msg``; ``metadata`` is the call's gRPC metadata."""
        mode = self.default_mode
        if msg.HasField("protocol_config"):
            mode = msg.protocol_config.request_body_mode
        st = Stream(mode)
        if msg.HasField("protocol_config"):
            st.response_mode = msg.protocol_config.response_body_mode
        if msg.HasField("metadata_context"):
            st.subset = protocol.subset_hint(msg.metadata_context)
        st.pool = protocol.invoked_pool(metadata)
        return st

    def step(self, st: Stream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        """The answers to ``msg``, handled on the caller's thread (the event loop), or ``None`` when it routes
        a long body or finds a pick in progress: then :meth:`routed` handles it on ``route_pool``."""
        if not self._routes(st, msg):
            return self._handle(st, msg)
        if self._short(st, msg) and self._route_lock.acquire(blocking=False):
            try:
                out = self._handle(st, msg)
                self.inline_routes += 1
            finally:
                self._route_lock.release()
            return out
        return None

    def routed(self, st: Stream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """:meth:`step`'s work for a message it left to ``route_pool`` (run there; picks never overlap)."""
        with self._route_lock:
            return self._handle(st, msg)

    @classmethod
    def finished(cls, msg: pb.ProcessingRequest, out: list[pb.ProcessingResponse]) -> bool:
        """Whether the stream ends after ``msg`` was answered with ``out``: an immediate response, or the
        response's last message (:meth:`_last`)."""
        return bool(out and out[-1].HasField("immediate_response")) or cls._last(msg)

    @staticmethod
    def close_stream(st: Stream | None) -> None:
        """Release what a stream holds when it ends, however it ends (its in-flight ticket)."""
        if st is not None and st.decision is not None and st.decision.ticket is not None:
            st.decision.ticket.close()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        """One stream on the ``grpc.aio`` server (the native front's streams: :mod:`kvfleet.epp.front`)."""
        st: Stream | None = None
        try:
            async for msg in request_iterator:
                if st is None:
                    st = self.open_stream(msg, context.invocation_metadata() or () if context else ())
                out = self.step(st, msg)
                if out is None:
                    loop = asyncio.get_running_loop()
                    out = await loop.run_in_executor(self.route_pool, self.routed, st, msg)
                for resp in out:
                    yield resp
                if self.finished(msg, out):
                    return
        finally:
            self.close_stream(st)

    def _short(self, st: Stream, msg: pb.ProcessingRequest) -> bool:
        """Whether the request that ``msg`` completes is short enough to route on the event loop."""
        body = msg.request_body.body if msg.WhichOneof("request") == "request_body" else b""
        return len(st.body) + len(body) <= self.inline_route_bytes

    # --- one message ------------------------------------------------------------------
    def _handle(self, st: Stream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._request_headers(st, msg.request_headers)
            if kind == "request_body":
                return self._request_body(st, msg.request_body)
            if kind == "request_trailers":
                out = [] if st.routed else self._route(st)
                if out and out[-1].HasField("immediate_response"):
                    return out
                return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
            if kind == "response_headers":
                unreachable = protocol.header_map(msg.response_headers.headers).get(
                    protocol.UNREACHABLE_HEADER)
                if unreachable is not None and st.decision is not None:
                    self.router.unreachable(st.decision, unreachable)
                    return [protocol.empty_response_headers_response(remove=[protocol.UNREACHABLE_HEADER])]
                if st.decision is not None:
                    served = protocol.served_endpoint(msg)
                    if served is not None:
                        st.decision.served(served)
                        self.metrics.served.labels(
                            "pick" if served == st.decision.endpoints[0] else "fallback").inc()
                    if st.decision.ticket is not None:
                        st.decision.ticket.first_byte()
                if st.read_response:
                    return [protocol.empty_response_headers_response()]
                # the stream's close still ends the ticket (close_stream)
                self.metrics.response_bodies_skipped.inc()
                if st.response_mode == _Mode.FULL_DUPLEX_STREAMED:
                    # Envoy ignores the override there and sends every chunk: they are handed back unread
                    return [protocol.empty_response_headers_response()]
                return [protocol.empty_response_headers_response(skip_body=True)]
            if kind == "response_body":
                return self._response_body(st, msg.response_body)
            if kind == "response_trailers":
                return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        except EppError as exc:
            return [self._error(st, exc)]
        except Exception:
            log.exception("ext_proc: unexpected failure")
            return [self._error(st, EppError("internal error in the endpoint picker"))]
        return []

    def _request_headers(self, st: Stream, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        hm = protocol.header_map(headers.headers)
        st.path = hm.get(":path", "")
        st.request_id = hm.get(REQUEST_ID_HEADER, "")[:128]
        method = hm.get(":method", "POST").upper()
        st.kind, arg = protocol.classify_path(st.path)
        if st.kind == "internal":
            raise ForbiddenPathError(f"{arg!r} is not served through the gateway")
        if st.kind == "unknown":
            raise ForbiddenPathError(f"no such API path {arg[:200]!r}; the gateway serves /v1/completions, "
                                     "/v1/chat/completions, /v1/models and the engines' client API")
        if st.kind in ("models", "model"):
            if method not in ("GET", "HEAD"):
                raise MethodNotAllowedError(f"{method} is not allowed on {protocol.MODELS}; use GET")
            return [self._models(arg if st.kind == "model" else None)]
        if st.kind == "inference" and method != "POST":
            raise MethodNotAllowedError(f"{method} is not allowed on {arg}; use POST")
        cl = hm.get("content-length", "")
        if cl.isdigit() and int(cl) > self.max_body_bytes:
            raise BodyTooLargeError(f"request body of {cl} bytes exceeds the limit of {self.max_body_bytes}")
        if headers.end_of_stream:
            st.bodiless = True
            return self._route(st)
        if st.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return []
        return [protocol.empty_request_headers_response()]

    def _models(self, model: str | None) -> pb.ProcessingResponse:
        """``GET /v1/models`` (every model the pools serve) or ``/v1/models/{id}`` (404 when none serves
        it)."""
        served = sorted({m for p in self.router.datastore.pools() for m in p.models if m != "*"})
        if model is None:
            return protocol.json_response(200, protocol.models_body(served, self.created))
        if model not in served and not any("*" in p.models for p in self.router.datastore.pools()):
            raise UnknownModelError(f"The model `{model}` does not exist.")
        return protocol.json_response(200, json.dumps(protocol.model_card(model, self.created)).encode())

    def _request_body(self, st: Stream, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        st.body += body.body
        if len(st.body) > self.max_body_bytes:
            raise BodyTooLargeError(f"request body exceeds the limit of {self.max_body_bytes} bytes")
        if body.end_of_stream:
            return self._route(st)
        if st.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return []
        return [protocol.buffered_body_ack(request=True)]  # STREAMED: let chunks through

    def _route(self, st: Stream) -> list[pb.ProcessingResponse]:
        st.routed = True
        t0 = time.perf_counter()
        body = bytes(st.body)
        if st.kind != "inference":
            return self._route_other(st, body)
        req = protocol.parse_request(st.path, body, self.max_body_bytes)
        st.model = req.model
        self.metrics.requests.labels(self._model_label(req.model)).inc()
        ctx = RequestContext(request_id=st.request_id, model=req.model, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, cache_salt=req.cache_salt)
        with routing_request(ctx):
            d = self.router.route(req, self._scope(st))
        st.decision = d
        st.predicted = (d.predicted_hit_tokens if ctx.predicted_hit_tokens is None
                        else ctx.predicted_hit_tokens)
        st.read_response = self._sampled()
        st.chunk_answer = _CHUNK_ANSWERS.get(st.response_mode)
        st.chunk_capture = _MAX_RESPONSE_CAPTURE if st.read_response else 0
        self.metrics.pick_seconds.observe(time.perf_counter() - t0)
        self.metrics.prompt_tokens.inc(d.num_tokens)
        self.metrics.predicted_hit.inc(st.predicted)
        if d.unkeyed:
            self.metrics.unkeyed_requests.labels(pool=d.pool, reason=d.unkeyed).inc()
        headers = protocol.routing_headers(d.endpoints, d.prefiller)
        if st.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return [protocol.pick_headers_response(headers), *protocol.streamed_body_responses(body)]
        return [protocol.pick_headers_response(headers, as_body=True)]

    def _sampled(self) -> bool:
        """Whether this inference response's body is read (``response_body_sample`` of them, evenly spread;
        called under the routing lock)."""
        if self.response_body_sample >= 1.0:
            return True
        self._sample_credit += self.response_body_sample
        if self._sample_credit >= 1.0:
            self._sample_credit -= 1.0
            return True
        return False

    def _scope(self, st: Stream) -> list[str] | None:
        """The endpoints this request may go to: the subset hint's, within the InferencePool the route invoked
        when the gateway names it (a gateway with one picker for several pools: each pool's ext_proc filter
        sends its own), so a pick never leaves that pool (GIE v1.6), whatever model the body names."""
        if not st.pool:
            return st.subset
        pool = next((p for p in self.router.datastore.pools() if p.name == st.pool), None)
        if pool is None:
            raise NoEndpointError(f"the route's InferencePool {st.pool[:64]!r} is not one this picker serves")
        mine = [p.endpoint for p in pool.pods]
        if st.subset is None:
            return mine
        allowed = set(mine)
        return [e for e in st.subset if e in allowed]

    def _route_other(self, st: Stream, body: bytes) -> list[pb.ProcessingResponse]:
        """A non-inference path: the least-loaded pod of the pool of the body's ``model`` (if any)."""
        model = protocol.model_of(body)
        st.model = model or ""
        st.decision = self.router.route_any(model, self._scope(st))
        headers = protocol.routing_headers(st.decision.endpoints)
        if st.bodiless:
            return [protocol.pick_headers_response(headers)]
        if st.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return [protocol.pick_headers_response(headers), *protocol.streamed_body_responses(body)]
        return [protocol.pick_headers_response(headers, as_body=True)]

    @staticmethod
    def captured(st: Stream, data: bytes) -> None:
        """``data``: bodies of the response's chunks that were answered without this process (the native
        front's, in the stream's order, ahead of the next message it hands over)."""
        if st.read_response and len(st.response) < _MAX_RESPONSE_CAPTURE:
            st.response += data

    def _response_body(self, st: Stream, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.captured(st, body.body)
        if st.read_response and body.end_of_stream and st.decision is not None:
            reported = protocol.cached_tokens_of(bytes(st.response))
            if reported is not None:
                d = st.decision
                self.metrics.observe_cached(st.predicted, reported)
                if d.pool and d.num_tokens and not d.unkeyed:  # the key check: the index's own prediction
                    self.keycheck.observe(d.pool, d.predicted_hit_tokens, reported, d.block_size)
            if self.decision_log:
                log_decision(self.decision_log, st.decision, reported, st.request_id, st.predicted)
        if st.response_mode == _Mode.FULL_DUPLEX_STREAMED:
            return [protocol.passthrough_body_response(body.body, body.end_of_stream, request=False)]
        return [protocol.buffered_body_ack(request=False)]

    def _model_label(self, model: str) -> str:
        """A model a pool names, else ``unknown``: a client cannot grow the label sets (metric
        cardinality)."""
        if not model:
            return ""
        return model if any(model in p.models for p in self.router.datastore.pools()) else UNKNOWN_MODEL

    def _error(self, st: Stream, exc: EppError) -> pb.ProcessingResponse:
        self.metrics.errors.labels(self._model_label(st.model), str(exc.status)).inc()
        return protocol.immediate_response(exc)


# --- gRPC health (grpc.health.v1, GIE's service names) -----------------------------------------------
LIVENESS, READINESS = "liveness", "readiness"
EXT_PROC_SERVICE = protocol.EXT_PROC_SERVICE


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """``grpc.health.v1.Health`` as GIE's EPP protocol defines it.

    ``liveness``: SERVING while the process answers; ``readiness``, the ext_proc service name and
    ``""`` (the whole server): SERVING only once the picker serves *and* its datastore has synced
    (Kubernetes: the first list of InferencePools and Pods). Any other name: NOT_FOUND. While the picker
    drains (``streams``: whether it answers streams, draining or not), ``readiness`` is NOT_SERVING, so the
    pod leaves its Service, but the ext_proc service name and ``""`` stay SERVING: a gateway that health
    checks them keeps sending streams until its discovery drops the pod.
    """

    def __init__(self, alive: Callable[[], bool], ready: Callable[[], bool],
                 streams: Callable[[], bool] | None = None) -> None:
        self.alive, self.ready = alive, ready
        self.streams = streams or ready

    def status(self, service: str) -> int | None:
        if service == LIVENESS:
            ok = self.alive()
        elif service == READINESS:
            ok = self.ready()
        elif service in (EXT_PROC_SERVICE, ""):
            ok = self.streams()
        else:
            return None
        return int(
            health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: Any) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: Any) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last: int | None = -1
        while True:
            status = self.status(request.service)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(
                    status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
                )
            await asyncio.sleep(0.5)


def health_check(
    target: str, timeout_s: float = 1.0, service: str = READINESS,
    credentials: grpc.ChannelCredentials | None = None
) -> bool:
    """Client side of :class:`HealthServicer` (used by tests and ``kvfleet epp --check``): SERVING?"""
    with (grpc.secure_channel(target, credentials) if credentials is not None
          else grpc.insecure_channel(target)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
