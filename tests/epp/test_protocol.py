"""Request parsing (OpenAI completions/chat, limits, typed errors → HTTP status) and ext_proc response
shapes."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from google.protobuf import struct_pb2

from kvfleet.cache.tokens import ByteTokenizer, ChatFormatError, render_chat
from kvfleet.config import load
from kvfleet.epp import protocol
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.errors import (
    BadRequestError,
    BodyTooLargeError,
    NoEndpointError,
    SheddingError,
    UnknownModelError,
)
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.router import Router
from kvfleet.epp.server import ExtProcServicer
from kvfleet.epp.tokenize import load_tokenizer


def body(obj: object) -> bytes:
    return json.dumps(obj).encode()


class TestParse:
    """parse_request accepts what OpenAI servers accept and names what is wrong otherwise."""

    def test_completions_text_prompt(self) -> None:
        r = protocol.parse_request("/v1/completions", body({"model": "m", "prompt": "hi", "cache_salt": "s"}),
                                   1000)
        assert (r.api, r.model, r.prompt, r.cache_salt) == ("/v1/completions", "m", "hi", "s")

    def test_completions_token_prompt_and_single_list(self) -> None:
        r = protocol.parse_request("/v1/completions", body({"model": "m", "prompt": [1, 2, 3]}), 1000)
        assert r.prompt_token_ids == (1, 2, 3) and r.prompt is None
        r = protocol.parse_request("/v1/completions?x=1", body({"model": "m", "prompt": ["a"]}), 1000)
        assert r.prompt == "a"

    def test_chat_uses_the_shared_template(self) -> None:
        msgs = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        r = protocol.parse_request("/v1/chat/completions", body({"model": "m", "messages": msgs}), 10_000)
        assert r.prompt == render_chat(msgs) == ("<|system|>\nbe brief<|end|>\n"
                                                 "<|user|>\nhi<|end|>\n<|assistant|>\n")

    def test_chat_with_parts_engines_may_take_is_passed_on(self) -> None:
        """Image and other typed parts are not the picker's to refuse (SGLang takes an image part even for a
        text model): parsed, their place marked in the picker's prompt text, keyed or not by the pool's
        tokenizer (tests/interop/test_chat_tokens.py::test_edge_requests_get_the_engines_answer)."""
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                             {"type": "image_url", "image_url": {"url": "data:,"}}]},
                {"role": "narrator", "content": None}]
        r = protocol.parse_request("/v1/chat/completions", body({"model": "m", "messages": msgs}), 10_000)
        assert r.chat is not None and r.chat.messages == msgs
        assert r.prompt == "<|user|>\nwhat is it?<|image_url|><|end|>\n<|narrator|>\n<|end|>\n<|assistant|>\n"

    @pytest.mark.parametrize(
        ("path", "payload"),
        [
            ("/v1/completions", b"{nope"),
            ("/v1/completions", b"\xff\xfe"),
            ("/v1/completions", body([1, 2])),
            ("/v1/completions", body({"prompt": "x"})),
            ("/v1/completions", body({"model": "m"})),
            ("/v1/completions", body({"model": "m", "prompt": [-1]})),
            ("/v1/completions", body({"model": "m", "prompt": "x", "cache_salt": 3})),
            ("/v1/chat/completions", body({"model": "m", "messages": []})),
            ("/v1/chat/completions",
             body({"model": "m", "messages": [{"role": "user", "content": [{"text": "no type"}]}]})),
            ("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
            ("/v1/completions",
             body({"model": "m", "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})),
            ("/v1/completions", body({"model": "m", "prompt": "x", "kv_transfer_params": None})),
            ("/v1/chat/completions",
             body({"model": "m", "messages": [{"role": "user", "content": "x"}], "bootstrap_room": 7})),
        ],
    )
    def test_bad_requests_are_400(self, path: str, payload: bytes) -> None:
        """Malformed bodies, deep nesting (no RecursionError escapes) and P/D control fields from clients."""
        with pytest.raises(BadRequestError) as ei:
            protocol.parse_request(path, payload, 1_000_000)
        assert ei.value.status == 400

    def test_oversized_body(self) -> None:
        with pytest.raises(BodyTooLargeError) as ei:
            protocol.parse_request("/v1/completions", body({"model": "m", "prompt": "x" * 100}), 50)
        assert ei.value.status == 400


class TestErrors:
    """Each typed error maps to its HTTP status in an ImmediateResponse with a JSON body."""

    @pytest.mark.parametrize(
        ("err", "status"),
        [(BadRequestError("x"), 400), (UnknownModelError("x"), 404), (NoEndpointError("x"), 503),
         (SheddingError("x"), 429)],
    )
    def test_immediate_response(self, err: Exception, status: int) -> None:
        resp = protocol.immediate_response(err)  # type: ignore[arg-type]
        assert resp.immediate_response.status.code == status
        payload = json.loads(resp.immediate_response.body)
        assert payload["error"]["code"] == status and payload["error"]["message"] == "x"


class TestResponses:
    """The pick is a header and envoy.lb metadata with the same value; bodies are echoed in chunks."""

    def test_pick_header_and_metadata_agree(self) -> None:
        resp = protocol.pick_headers_response(protocol.routing_headers(["10.0.0.1:8000"], "10.0.0.2:8000"))
        hdrs = {h.header.key: h.header.raw_value.decode()
                for h in resp.request_headers.response.header_mutation.set_headers}
        assert hdrs == {"x-gateway-destination-endpoint": "10.0.0.1:8000",
                        "x-prefiller-host-port": "10.0.0.2:8000"}
        meta = (resp.dynamic_metadata.fields["envoy.lb"].struct_value
                .fields["x-gateway-destination-endpoint"].string_value)
        assert meta == "10.0.0.1:8000"
        assert resp.request_headers.response.clear_route_cache

    def test_buffered_pick_rides_on_the_body_response(self) -> None:
        resp = protocol.pick_headers_response([("x-gateway-destination-endpoint", "a:1")], as_body=True)
        assert resp.HasField("request_body") and resp.request_body.response.header_mutation.set_headers

    def test_streamed_body_chunks(self) -> None:
        data = bytes(range(256)) * 600
        out = protocol.streamed_body_responses(data)
        chunks = [r.request_body.response.body_mutation.streamed_response for r in out]
        assert b"".join(c.body for c in chunks) == data
        assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]

    def test_cached_tokens_json_and_sse(self) -> None:
        usage = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}}
        assert protocol.cached_tokens_of(json.dumps(usage).encode()) == 7
        sse = f"data: {json.dumps({'choices': []})}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        assert protocol.cached_tokens_of(sse.encode()) == 7
        assert protocol.cached_tokens_of(b"not json") is None

    def test_subset_hint_list_and_string(self) -> None:
        md = base_pb2.Metadata()
        s = struct_pb2.Struct()
        s.update({protocol.SUBSET_KEY: ["a:1", "b:2"]})
        md.filter_metadata[protocol.SUBSET_NS].CopyFrom(s)
        assert protocol.subset_hint(md) == ["a:1", "b:2"]
        s2 = struct_pb2.Struct()
        s2.update({protocol.SUBSET_KEY: "a:1, c:3"})
        md.filter_metadata[protocol.SUBSET_NS].CopyFrom(s2)
        assert protocol.subset_hint(md) == ["a:1", "c:3"]
        assert protocol.subset_hint(base_pb2.Metadata()) is None


class TestTokens:
    """The byte-level tokenizer is lossless and bounded to byte ids; the chat template rejects bad shapes."""

    def test_roundtrip_utf8(self) -> None:
        tok = ByteTokenizer()
        ids = tok.encode("héllo ✓")
        assert ids.max() < 256 and tok.decode(ids) == "héllo ✓"

    @pytest.mark.parametrize("messages", [None, [], ["x"], [{"content": "x"}], [{"role": "u", "content": 3}]])
    def test_chat_errors(self, messages: object) -> None:
        with pytest.raises(ChatFormatError):
            render_chat(messages)


class TestResponseBodySample:
    """``epp.response_body_sample``: which responses' bodies the picker reads, and how it asks Envoy to skip
    the others (the real Envoy's side: ``tests/epp/test_envoy.py::test_response_body_sample``)."""

    @staticmethod
    def servicer(sample: float) -> ExtProcServicer:
        s = load()
        router = Router(s.epp, s.cache, StaticDatastore(data={"pools": []}), BlockIndex(), MetricsStore(),
                        load_tokenizer("bytes"))
        return ExtProcServicer(router, EppMetrics(), 1 << 20, response_body_sample=sample)

    @pytest.mark.parametrize(("sample", "pattern"), [
        (1.0, [True] * 8), (0.0, [False] * 8), (0.25, [False, False, False, True] * 2),
        (0.5, [False, True] * 4),
    ])
    def test_spread_evenly(self, sample: float, pattern: list[bool]) -> None:
        sv = self.servicer(sample)
        assert [sv._sampled() for _ in range(8)] == pattern

    def test_a_third_reads_a_third(self) -> None:
        sv = self.servicer(1 / 3)
        assert sum(sv._sampled() for _ in range(3000)) == 1000

    def test_skip_asks_for_no_body_and_no_trailers(self) -> None:
        plain = protocol.empty_response_headers_response()
        assert not plain.HasField("mode_override")
        out = protocol.empty_response_headers_response(remove=["x-a"], skip_body=True)
        assert out.mode_override.response_body_mode == pm.ProcessingMode.NONE
        assert out.mode_override.response_trailer_mode == pm.ProcessingMode.SKIP
        assert list(out.response_headers.response.header_mutation.remove_headers) == ["x-a"]

    def test_out_of_range_is_refused(self) -> None:
        with pytest.raises(ValueError, match="response_body_sample"):
            load(overrides={"epp": {"response_body_sample": 1.5}})
