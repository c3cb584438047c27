"""Request parsing (OpenAI completions/chat, limits, typed errors → HTTP status) and ext_proc response
shapes."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2

from kvfleet.cache.tokens import ByteTokenizer, ChatFormatError, render_chat
from kvfleet.epp import protocol
from kvfleet.epp.errors import (
    BadRequestError,
    BodyTooLargeError,
    NoEndpointError,
    SheddingError,
    UnknownModelError,
)


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
