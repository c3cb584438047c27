"""Each pool's requests are keyed with that pool's tokenizer (kvfleet/epp/tokenize.py): several models in one
EPP, a pool whose tokenizer is missing or still being fetched, a request no tokenizer can key, and the
Hugging Face Hub fetch (a local server speaking the Hub's file API, as a mirror does)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.modeltok import BUILTIN_DIR, ChatRequest, load_model_tokenizer
from kvfleet.config import load
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import CHAT, COMPLETIONS, parse_request
from kvfleet.epp.router import Router
from kvfleet.epp.tokenize import PoolTokenizers, hub_fetch

MESSAGES = [{"role": "system", "content": "You answer questions about shipping."},
            {"role": "user", "content": "Where is container 4471 now? " * 8}]


def pool(name: str, model: str, tokenizer: str | None, dialect: str = "vllm") -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "models": [model], "chat_dialect": dialect,
                           "pods": [{"name": f"{name}-0", "address": "127.0.0.1", "port": 1}]}
    if tokenizer:
        out["tokenizer"] = tokenizer
    return out


def router(*pools: dict[str, Any], default: str = "bytes") -> tuple[Router, BlockIndex]:
    s = load()
    idx = BlockIndex()
    return Router(s.epp, s.cache, StaticDatastore(data={"pools": list(pools)}), idx, MetricsStore(),
                  PoolTokenizers(default)), idx


def chat(model: str, **extra: Any) -> Any:
    return parse_request(CHAT, json.dumps({"model": model, "messages": MESSAGES, **extra}).encode(), 1 << 20)


def test_each_pool_keys_with_its_own_models_tokenizer() -> None:
    r, idx = router(pool("qwen", "qwen", "builtin:qwen2.5"), pool("nemo", "nemo", "builtin:mistral-nemo"),
                    pool("plain", "plain", None))
    hasher = BlockHasher(16, load().cache.hash_algo, load().cache.hash_seed)
    for name, model, spec in (("qwen", "qwen", "builtin:qwen2.5"), ("nemo", "nemo", "builtin:mistral-nemo")):
        ids = load_model_tokenizer(spec).encode_chat(ChatRequest(MESSAGES))
        keys = hashes_as_ints(hasher.hash_tokens(ids))
        idx.add(f"{name}-0", keys)
        d = r.route(chat(model))
        assert (d.pool, d.num_tokens, d.unkeyed) == (name, len(ids), "")
        assert d.predicted_hit_tokens == len(keys) * 16  # the index's keys are the model's, block for block
    plain = r.route(chat("plain"))  # no tokenizer declared: the picker's default (bytes)
    assert plain.pool == "plain" and not plain.unkeyed
    assert plain.num_tokens == len(r.tokenizer.encode(chat("plain").prompt))  # one token per byte


def test_completions_use_the_special_token_rule() -> None:
    r, _ = router(pool("nemo", "nemo", "builtin:mistral-nemo"))
    req = parse_request(COMPLETIONS, json.dumps({"model": "nemo", "prompt": "Hello world"}).encode(), 1 << 20)
    assert r.tokens_of(req, r.datastore.pools()[0]).tolist()[0] == 1  # BOS, as vLLM adds it


def test_unkeyable_requests_are_routed_on_load_with_a_reason(tmp_path: Path) -> None:
    r, _ = router(pool("qwen", "qwen", "builtin:qwen2.5"), pool("gone", "gone", str(tmp_path / "missing")))
    d = r.route(chat("qwen", tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]))
    assert d.pod == "qwen-0" and d.unkeyed == "tool_choice" and d.predicted_hit_tokens == 0
    d = r.route(chat("gone"))
    assert d.pod == "gone-0" and d.unkeyed == "tokenizer_unavailable"
    assert "not a directory" in (r.tokenizers.failure(str(tmp_path / "missing")) or "")


class _Hub(http.server.BaseHTTPRequestHandler):
    token = "hf_secret"
    files: dict[str, bytes] = {}  # noqa: RUF012 - set by the fixture

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        if data is not None:
            self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    import gzip

    src = BUILTIN_DIR / "qwen2.5"
    _Hub.files = {"/acme/qwen-mini/resolve/main/tokenizer.json": gzip.decompress(
                      (src / "tokenizer.json.gz").read_bytes()),
                  "/acme/qwen-mini/resolve/main/tokenizer_config.json":
                      (src / "tokenizer_config.json").read_bytes()}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_hub_tokenizer_is_fetched_in_the_background(hub: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    s = load()
    tokenizers = PoolTokenizers("bytes", tmp_path)
    r = Router(s.epp, s.cache, StaticDatastore(data={"pools": [pool("q", "q", "hf:acme/qwen-mini")]}),
               BlockIndex(), MetricsStore(), tokenizers)
    first = r.route(chat("q"))
    assert first.unkeyed == "tokenizer_loading"  # never keyed with another tokenizer meanwhile
    assert not isinstance(tokenizers.wait("hf:acme/qwen-mini"), str)
    ids = load_model_tokenizer("builtin:qwen2.5").encode_chat(ChatRequest(MESSAGES))
    d = r.route(chat("q"))
    assert not d.unkeyed and d.num_tokens == len(ids)
    assert (tmp_path / "acme--qwen-mini" / "main" / ".complete").exists()  # fetched once, kept


def test_hub_errors_name_the_cause(hub: str, tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"HTTP 401.*HF_TOKEN"):
        hub_fetch("hf:acme/qwen-mini", tmp_path, endpoint=hub, token="wrong")
    with pytest.raises(OSError, match=r"tokenizer\.json answered HTTP 404"):
        hub_fetch("hf:acme/other", tmp_path, endpoint=hub, token="hf_secret")
    for bad in ("hf:../etc", "hf:a/b/c", "hf:acme/x@../y", "hf:acme/.."):
        with pytest.raises(ValueError, match="ORG/NAME"):
            hub_fetch(bad, tmp_path, endpoint=hub, token="hf_secret")
