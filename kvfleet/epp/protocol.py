"""The wire side of the picker: OpenAI request bodies in, ext_proc responses out.

Read path step 1: :func:`parse_request` turns ``(:path, body)`` into an
:class:`InferenceRequest` or raises a typed :class:`~kvfleet.epp.errors.EppError`.
The ``*_response`` builders produce the ``ProcessingResponse`` messages of the
Gateway API Inference Extension endpoint-picker protocol:

* the pick travels as the request header ``x-gateway-destination-endpoint`` **and**
  as dynamic metadata ``envoy.lb`` → ``x-gateway-destination-endpoint`` (same value,
  an ordered ``ip:port,ip:port`` list: the first is the pick, the rest fallbacks);
* P/D pools add ``x-prefiller-host-port`` naming the prefill pod;
* errors become an ImmediateResponse with a JSON body and the error's status;
* the endpoint that really served a request comes back in the response's
  ``metadata_context`` (``envoy.lb`` → ``x-gateway-destination-endpoint-served``,
  protocol v1.0) or, from kvfleet's own Envoy configuration, as the ext_proc
  attribute ``upstream.address``: :func:`served_endpoint`.

Client input never chooses a route, a prefill pod or cache contents: the
gateway strips :data:`CLIENT_STRIPPED_HEADERS` before the picker sees the
request and refuses requests with :data:`CLIENT_REFUSED_HEADERS` (400), and
:func:`parse_request` refuses the P/D control fields of :data:`CONTROL_FIELDS`
in a client body (400): they are set between pods, never
by clients. ``GET /v1/models`` (and ``/v1/models/{id}``) is answered by the
picker itself from the models its pools serve (:func:`models_body`); other
non-inference paths go to one member of a pool (:func:`classify_path`), except
the engines' internal ``/kvfleet/`` paths, which the gateway never forwards.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from kvfleet.cache.modeltok import ChatRequest
from kvfleet.cache.tokens import ChatFormatError, render_chat
from kvfleet.epp.errors import BadRequestError, BodyTooLargeError, EppError

DEST_HEADER = "x-gateway-destination-endpoint"
DEST_METADATA_NS = "envoy.lb"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
PREFILLER_HEADER = "x-prefiller-host-port"
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: response header of kvfleet's gateway when nothing listened at the picked pod (Envoy's UF): the picker takes
#: that pod out of rotation at once and removes the header from the response
UNREACHABLE_HEADER = "x-kvfleet-upstream-unreachable"
#: the ext_proc service's name, also a gRPC health service name (GIE)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: ext_proc attribute (CEL) with the upstream host that served the request
#: (kvfleet's Envoy config asks for it)
UPSTREAM_ATTRIBUTE = "upstream.address"
EXT_PROC_ATTRIBUTES_NS = "envoy.filters.http.ext_proc"
#: routing headers a client may not send: the gateway removes them before ext_proc and routing
CLIENT_STRIPPED_HEADERS = (DEST_HEADER, SUBSET_KEY, SERVED_KEY)
#: headers that steer prefill/decode between engines (the prefill pod, the engines' peer signature): a
#: client request carrying one is refused by the gateway with a 400, before ext_proc and in every failure mode
CLIENT_REFUSED_HEADERS = (PREFILLER_HEADER, "x-kvfleet-peer-timestamp", "x-kvfleet-peer-nonce",
                          "x-kvfleet-peer-signature")
#: body fields that steer prefill/decode disaggregation between pods (vLLM's and SGLang's): never from clients
CONTROL_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                  "disagg_prefill_endpoints")
#: engine-internal paths (KV release, reset) the gateway refuses to forward
INTERNAL_PREFIX = "/kvfleet/"
#: Largest chunk of a streamed body mutation (Envoy's gRPC message limit is larger; GIE uses 62 kB).
BODY_CHUNK = 62_000

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
API_PATHS = (COMPLETIONS, CHAT)
_JSON = msgspec.json.Decoder()


@dataclass(frozen=True)
class InferenceRequest:
    """What routing needs from one OpenAI request.

    Exactly one of ``prompt`` (text) and ``prompt_token_ids`` is set. A chat request also carries ``chat``
    (what decides its prompt under the model's own template, :mod:`kvfleet.epp.tokenize`); its ``prompt``
    is kvfleet's default rendering (the byte-level tokenizer's and the approximate baselines' text).
    """

    api: str = COMPLETIONS
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None
    stream: bool = False
    chat: ChatRequest | None = None


def parse_request(path: str, body: bytes, max_body_bytes: int) -> InferenceRequest:
    """Parse an OpenAI completions/chat request; raises BadRequestError/BodyTooLargeError."""
    api = path.split("?", 1)[0].rstrip("/")
    if api not in API_PATHS:
        raise BadRequestError(f"unknown API path {api!r}; known: {', '.join(API_PATHS)}")
    if len(body) > max_body_bytes:
        raise BodyTooLargeError(f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}")
    try:
        data = _JSON.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequestError("request body nests JSON too deeply") from None
    if not isinstance(data, dict):
        raise BadRequestError("request body must be a JSON object")
    control = [f for f in CONTROL_FIELDS if f in data]
    if control:
        raise BadRequestError(
            f"{', '.join(repr(f) for f in control)} may not be set by clients: the gateway sets up "
            "prefill/decode itself"
        )
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' must be a non-empty string")
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequestError("'cache_salt' must be a string")
    stream = bool(data.get("stream", False))
    if api == CHAT:
        text = chat_text(data.get("messages"))
        return InferenceRequest(api=api, model=model, prompt=text, cache_salt=salt, stream=stream,
                                chat=chat_request(data))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return InferenceRequest(api=api, model=model, prompt=prompt, cache_salt=salt, stream=stream)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < 2**32 for t in prompt):
        return InferenceRequest(api=api, model=model, prompt_token_ids=tuple(prompt), cache_salt=salt,
                                stream=stream)
    raise BadRequestError("'prompt' must be a string or a non-empty list of token ids")


def chat_text(messages: Any) -> str:
    """Check the shape of chat ``messages`` (400 for what no engine takes: not a non-empty list of objects
    with a string ``role``, ``content`` neither a string, a list of typed parts nor null) and return their
    text in kvfleet's own template, non-text parts as ``<|type|>`` (the picker's prompt text; the pool's
    tokenizer decides the keys, and what it cannot render is routed on load, not refused)."""
    try:
        return render_chat(messages, mark_parts=True)
    except ChatFormatError as exc:
        raise BadRequestError(str(exc)) from None


def chat_request(data: dict[str, Any]) -> ChatRequest:
    """The fields of a chat body that decide its prompt (types checked; the template judges the rest)."""
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = data.get(name, default)
        if not isinstance(value, bool):
            raise BadRequestError(f"{name!r} must be a boolean")
        flags[name] = value
    kwargs = data.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequestError("'chat_template_kwargs' must be an object")
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequestError("'tools' must be a list")
    return ChatRequest(messages=data.get("messages"), tools=tools, tool_choice=data.get("tool_choice"),
                       chat_template_kwargs=kwargs, **flags)


def model_of(body: bytes) -> str | None:
    """The ``model`` of a JSON body that has one (non-inference paths: used to find the pool only).

    Raises BadRequestError when the body carries a P/D control field (:data:`CONTROL_FIELDS`)."""
    if not body:
        return None
    try:
        data = _JSON.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    control = [f for f in CONTROL_FIELDS if f in data]
    if control:
        raise BadRequestError(f"{', '.join(repr(f) for f in control)} may not be set by clients")
    model = data.get("model")
    return model if isinstance(model, str) and model else None


#: the engines' client API besides completions, chat and models, which the gateway passes to one pod of the
#: pool: vLLM's and SGLang's inference, pooling, tokenizer and health paths. Their admin paths (weights,
#: LoRA loading, sleep, cache flushes, profiling, sessions) and anything else are answered 404 by the
#: picker and never reach a pod.
ENGINE_PATHS = frozenset({
    "/v1/embeddings", "/v1/responses", "/v1/score", "/score", "/v1/rerank", "/v2/rerank", "/rerank",
    "/pooling", "/classify", "/v1/classify", "/v1/audio/transcriptions", "/v1/audio/translations",
    "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/invocations",
    "/generate", "/encode", "/get_model_info", "/model_info", "/health", "/ping", "/version",
})


def classify_path(path: str) -> tuple[str, str]:
    """``(kind, argument)`` of a request path: ``("inference", api)``, ``("models", "")``,
    ``("model", id)``, ``("internal", path)``, ``("other", path)`` (one of :data:`ENGINE_PATHS`, or a
    stored response ``/v1/responses/{id}``) or ``("unknown", path)`` (anything else, dot segments and
    percent-encoded dots included: a gateway that resolves ``..`` before the picker sees the path never
    gets here with one)."""
    api = path.split("?", 1)[0]
    norm = api.rstrip("/") or "/"
    if norm in API_PATHS:
        return "inference", norm
    if norm == MODELS:
        return "models", ""
    if norm.startswith(MODELS + "/"):
        return "model", urllib.parse.unquote(norm[len(MODELS) + 1 :])
    if api.startswith(INTERNAL_PREFIX) or urllib.parse.unquote(api).startswith(INTERNAL_PREFIX):
        return "internal", norm
    if norm in ENGINE_PATHS or (norm.startswith("/v1/responses/") and ".." not in urllib.parse.unquote(norm)
                                and "%" not in norm):
        return "other", norm
    return "unknown", norm


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "kvfleet"}


def models_body(models: Sequence[str], created: int) -> bytes:
    """OpenAI's ``GET /v1/models`` answer: ``{"object": "list", "data": [model cards]}``."""
    return json.dumps({"object": "list", "data": [model_card(m, created) for m in models]}).encode()


def cached_tokens_of(body: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI response (JSON or SSE), if present."""
    text = body.decode("utf-8", errors="replace")
    candidates = [text]
    if text.lstrip().startswith("data:"):
        candidates = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
    for chunk in reversed(candidates):
        try:
            data = json.loads(chunk)
        except json.JSONDecodeError:
            continue
        usage = data.get("usage") if isinstance(data, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    return None


# --- ext_proc responses -------------------------------------------------------------------


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set_destination(meta: struct_pb2.Struct, endpoints: str) -> None:
    # through the maps, not Struct's Python helpers (get_or_create_struct): a third of the cost per pick
    meta.fields[DEST_METADATA_NS].struct_value.fields[DEST_HEADER].string_value = endpoints


def _set_header(options: Any, key: str, value: str) -> None:
    """Appends a set-header option to ``options`` (a ``HeaderMutation.set_headers`` field)."""
    o = options.add()
    o.header.key = key
    o.header.raw_value = value.encode()
    o.append_action = _OVERWRITE


def routing_headers(endpoints: Sequence[str], prefiller: str | None = None) -> list[tuple[str, str]]:
    headers = [(DEST_HEADER, ",".join(endpoints))]
    if prefiller:
        headers.append((PREFILLER_HEADER, prefiller))
    return headers


def pick_headers_response(
    headers: Sequence[tuple[str, str]], *, content_length: int | None = None, as_body: bool = False
) -> pb.ProcessingResponse:
    """The pick as a header mutation plus ``envoy.lb`` metadata.

    ``as_body`` puts the mutation in a BodyResponse (BUFFERED mode answers the
    headers message first, empty, and routes with the body answer).
    """
    # built in place (fields set on the one message) rather than from nested constructors, each of which
    # copies its parts: a third of the CPU, and it runs on every pick
    out = pb.ProcessingResponse()
    common = out.request_body.response if as_body else out.request_headers.response
    set_headers = common.header_mutation.set_headers
    for k, v in headers:
        _set_header(set_headers, k, v)
    if content_length is not None:
        _set_header(set_headers, "content-length", str(content_length))
    common.clear_route_cache = True
    _set_destination(out.dynamic_metadata, dict(headers)[DEST_HEADER])
    return out


def empty_request_headers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


#: the rest of a response without its body and trailers (``ProcessingResponse.mode_override``; the header
#: modes no longer matter once the response headers are answered)
_SKIP_RESPONSE_BODY = processing_mode_pb2.ProcessingMode(
    response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP)


def empty_response_headers_response(remove: Sequence[str] = (),
                                    skip_body: bool = False) -> pb.ProcessingResponse:
    """The answer to the response headers: ``remove`` those headers; ``skip_body``: ask Envoy not to send the
    response's body and trailers (``mode_override``, honoured with the filter's ``allow_mode_override``)."""
    if not remove:
        out = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    else:
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=list(remove)))
        out = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))
    if skip_body:
        out.mode_override.CopyFrom(_SKIP_RESPONSE_BODY)
    return out


def streamed_body_responses(body: bytes, *, request: bool = True) -> list[pb.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: hand the (whole) body back to Envoy in chunks, last one ending the stream."""
    chunks = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    last = len(chunks) - 1
    return [passthrough_body_response(chunk, i == last, request=request) for i, chunk in enumerate(chunks)]


def passthrough_body_response(chunk: bytes, end_of_stream: bool, *, request: bool) -> pb.ProcessingResponse:
    """``chunk`` handed back to Envoy unchanged (FULL_DUPLEX_STREAMED). Built in place: with nested
    constructors each level copied the chunk again (five copies of a 220 KB prompt per pick)."""
    out = pb.ProcessingResponse()
    streamed = (out.request_body if request else out.response_body).response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream
    return out


def buffered_body_ack(*, request: bool) -> pb.ProcessingResponse:
    if request:
        return pb.ProcessingResponse(request_body=pb.BodyResponse())
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def error_body(error: EppError) -> bytes:
    return json.dumps({"error": {"code": error.status, "type": error.kind, "message": str(error)}}).encode()


def immediate_response(error: EppError) -> pb.ProcessingResponse:
    """An ImmediateResponse with the error's HTTP status and a JSON body."""
    return json_response(error.status, error_body(error), details=error.kind)


def json_response(status: int, body: bytes, details: str = "") -> pb.ProcessingResponse:
    """An ImmediateResponse that answers the request from the picker itself (e.g. ``GET /v1/models``, an
    error: ``details`` names it)."""
    out = pb.ProcessingResponse()
    answer = out.immediate_response
    answer.status.code = status
    _set_header(answer.headers.set_headers, "content-type", "application/json")
    answer.body = body
    answer.details = details
    return out


def served_endpoint(msg: Any) -> str | None:
    """The endpoint that served a request, from a response-phase ``ProcessingRequest``: GIE's
    ``metadata_context`` entry first, else the ``upstream.address`` attribute."""
    fm: Mapping[str, Any] = msg.metadata_context.filter_metadata
    if DEST_METADATA_NS in fm:
        v = fm[DEST_METADATA_NS].fields.get(SERVED_KEY)
        if v is not None and v.WhichOneof("kind") == "string_value" and v.string_value:
            return str(v.string_value)
    attrs: Mapping[str, Any] = msg.attributes
    if EXT_PROC_ATTRIBUTES_NS in attrs:
        v = attrs[EXT_PROC_ATTRIBUTES_NS].fields.get(UPSTREAM_ATTRIBUTE)
        if v is not None and v.WhichOneof("kind") == "string_value" and v.string_value:
            return str(v.string_value)
    return None


def header_map(headers: Any) -> dict[str, str]:
    """Envoy's HeaderMap (``value`` or ``raw_value``) as a plain lower-case dict."""
    out: dict[str, str] = {}
    for h in headers.headers:
        out[h.key.lower()] = h.value if h.value else h.raw_value.decode("utf-8", errors="replace")
    return out


#: gRPC request metadata a gateway with one picker for several InferencePools sends on each pool's ext_proc
#: stream: the pool's name (``kvfleet gateway-extension`` sets it in each pool's filter)
POOL_METADATA = "x-kvfleet-inference-pool"


def invoked_pool(metadata: Iterable[tuple[str, Any]]) -> str:
    """The InferencePool named by :data:`POOL_METADATA` in a stream's gRPC metadata ("" when absent), cut at
    254 characters (no Kubernetes name is longer than 253, so a longer one matches no pool)."""
    for key, value in metadata:
        if key == POOL_METADATA:
            name = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            return name.strip()[:254]
    return ""


def subset_hint(metadata_context: Any) -> list[str] | None:
    """Endpoints allowed by ``envoy.lb.subset_hint`` → ``x-gateway-destination-endpoint-subset``, if any."""
    fm: Mapping[str, Any] = metadata_context.filter_metadata
    if SUBSET_NS not in fm:
        return None
    value = fm[SUBSET_NS].fields.get(SUBSET_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    if kind == "string_value":
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return None
