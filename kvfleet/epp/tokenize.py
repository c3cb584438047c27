"""The read path's tokenizers: each pool's requests become the token ids that pool's engines compute.

A tokenizer *spec* names where a model's tokenizer files are (``epp.tokenizer`` for every pool, or a pool's
own ``tokenizer``, which the operator renders from the KVCachePool's ``model.tokenizer``):

``bytes``
    the byte-level tokenizer shared with the engine simulator (tests that need no files).
``builtin:NAME``
    files shipped in the image (:func:`kvfleet.cache.modeltok.builtin_names`).
``/a/directory``
    ``tokenizer.json``, ``tokenizer_config.json`` and an optional ``chat_template.jinja``: the model cache
    volume the engines read, mounted read-only into the EPP (air-gapped clusters).
``hf:ORG/NAME[@REVISION]``
    the three files fetched once from the Hugging Face Hub API (``$HF_ENDPOINT``, default
    ``https://huggingface.co``, a mirror in a closed network; ``$HF_TOKEN`` for gated models, from a
    Secret) into ``epp.tokenizer_cache_dir`` (default ``$TMPDIR/kvfleet-tokenizers``: the chart's
    writable ``/tmp``), in the background: until they are there the pool's requests
    are routed on load and counted.

:class:`PoolTokenizers` loads each spec once (several models in one EPP: one tokenizer each) and answers
:meth:`~PoolTokenizers.tokens` with the ids, or with the reason the request cannot be keyed
(``kvfleet_epp_unkeyed_requests_total{pool,reason}``): the picker then routes it on load, never on keys
that the engine will not produce.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from kvfleet.cache.modeltok import (
    DIALECTS,
    ChatTemplateError,
    ModelTokenizer,
    UnsupportedChat,
    load_model_tokenizer,
)
from kvfleet.cache.tokens import ByteTokenizer, ChatFormatError, render_chat

if TYPE_CHECKING:
    from kvfleet.epp.datastore import Pool
    from kvfleet.epp.protocol import InferenceRequest

log = logging.getLogger(__name__)

HUB_PREFIX = "hf:"
HUB_FILES = (("tokenizer.json", True), ("tokenizer_config.json", True), ("chat_template.jinja", False))
MAX_HUB_FILE_BYTES = 64 * 1024 * 1024


class Tokenizer(Protocol):
    """Text → token ids (``uint32``), identical to what the model server computes."""

    name: str

    def encode(self, text: str) -> npt.NDArray[np.uint32]: ...


@dataclass(frozen=True)
class Tokens:
    """A request's prompt token ids, or why there are none (``reason``, a metric label)."""

    ids: npt.NDArray[np.uint32] | None
    reason: str = ""
    detail: str = ""


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes``, ``builtin:NAME`` or a directory (synchronously; hub specs: :class:`PoolTokenizers`)."""
    if spec == "bytes":
        return ByteTokenizer()
    try:
        return load_model_tokenizer(spec)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def hub_fetch(spec: str, cache_dir: str | Path, endpoint: str | None = None, token: str | None = None,
              timeout_s: float = 30.0) -> Path:
    """``hf:ORG/NAME[@REV]``'s tokenizer files in ``cache_dir`` (fetched once; a partial fetch is retried).

    Uses the Hub's file API (``{endpoint}/{repo}/resolve/{revision}/{file}``), as ``huggingface_hub`` and
    mirrors serve it. Raises ``OSError`` naming the file and the HTTP status."""
    repo, _, rev = spec[len(HUB_PREFIX):].partition("@")
    rev = rev or "main"
    if repo.count("/") != 1 or any(not part or part in (".", "..") for part in repo.split("/")) \
            or "/" in rev or rev in (".", ".."):
        raise ValueError(f"tokenizer {spec!r}: expected hf:ORG/NAME[@REVISION]")
    target = Path(cache_dir) / repo.replace("/", "--") / rev
    if (target / ".complete").exists():
        return target
    base = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    token = token if token is not None else os.environ.get("HF_TOKEN")
    target.mkdir(parents=True, exist_ok=True)
    for name, required in HUB_FILES:
        url = f"{base}/{urllib.parse.quote(repo)}/resolve/{urllib.parse.quote(rev, safe='')}/{name}"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                data = resp.read(MAX_HUB_FILE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and not required:
                continue
            raise OSError(f"{spec}: GET {name} answered HTTP {exc.code}"
                          + (" (set HF_TOKEN for a gated model)" if exc.code in (401, 403) else "")) from None
        except (urllib.error.URLError, TimeoutError) as exc:
            raise OSError(f"{spec}: GET {url}: {getattr(exc, 'reason', exc)}") from None
        if len(data) > MAX_HUB_FILE_BYTES:
            raise OSError(f"{spec}: {name} is larger than {MAX_HUB_FILE_BYTES} bytes")
        tmp = target / f".{name}.part"
        tmp.write_bytes(data)
        tmp.replace(target / name)
    (target / ".complete").write_text(spec + "\n")
    return target


class PoolTokenizers:
    """One tokenizer per spec, shared by the pools that declare it; hub specs fetched in the background."""

    def __init__(self, default_spec: str = "bytes", cache_dir: str | Path = "") -> None:
        self.default_spec = default_spec
        self.cache_dir = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "kvfleet-tokenizers"
        self._loaded: dict[str, Tokenizer] = {}
        self._failed: dict[str, str] = {}
        self._loading: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer: Tokenizer | PoolTokenizers) -> PoolTokenizers:
        """``tokenizer`` as the default of every pool (a :class:`PoolTokenizers` is returned as is)."""
        if isinstance(tokenizer, PoolTokenizers):
            return tokenizer
        out = cls(tokenizer.name)
        out._loaded[tokenizer.name] = tokenizer
        return out

    @property
    def default(self) -> Tokenizer | str:
        return self.get(self.default_spec)

    def spec_of(self, pool: Pool | None) -> str:
        own = pool.cache.tokenizer if pool is not None else None
        return own or self.default_spec

    def get(self, spec: str) -> Tokenizer | str:
        """The loaded tokenizer, or the reason there is none yet (``tokenizer_loading`` /
        ``tokenizer_unavailable``)."""
        tok = self._loaded.get(spec)
        if tok is not None:
            return tok
        with self._lock:
            tok = self._loaded.get(spec)
            if tok is not None:
                return tok
            if spec in self._failed:
                return "tokenizer_unavailable"
            if spec.startswith(HUB_PREFIX):
                if spec not in self._loading:
                    self._loading.add(spec)
                    threading.Thread(target=self._fetch, args=(spec,), name=f"tokenizer-{spec}",
                                     daemon=True).start()
                return "tokenizer_loading"
            try:
                tok = self._loaded[spec] = load_tokenizer(spec)
            except ValueError as exc:
                self._failed[spec] = str(exc)
                log.error("tokenizer %s cannot be loaded: %s; its pools are routed on load", spec, exc)
                return "tokenizer_unavailable"
            return tok

    def _fetch(self, spec: str) -> None:
        try:
            directory = hub_fetch(spec, self.cache_dir)
            tok: Tokenizer = ModelTokenizer(directory, spec[len(HUB_PREFIX):])
        except (OSError, ValueError) as exc:
            with self._lock:
                self._failed[spec] = str(exc)
                self._loading.discard(spec)
            log.error("tokenizer %s cannot be fetched: %s; its pools are routed on load", spec, exc)
            return
        with self._lock:
            self._loaded[spec] = tok
            self._loading.discard(spec)
        log.info("tokenizer %s loaded from %s", spec, directory)

    def failure(self, spec: str) -> str | None:
        return self._failed.get(spec)

    def wait(self, spec: str, timeout_s: float = 60.0) -> Tokenizer | str:
        """Block until ``spec`` is loaded or failed (start-up, tests)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            got = self.get(spec)
            if not isinstance(got, str) or got != "tokenizer_loading" or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def tokens(self, req: InferenceRequest, pool: Pool | None) -> Tokens:
        """``req``'s prompt token ids as ``pool``'s engines compute them (see the module doc)."""
        if req.prompt_token_ids is not None:
            return Tokens(np.asarray(req.prompt_token_ids, dtype=np.uint32))
        tok = self.get(self.spec_of(pool))
        if isinstance(tok, str):
            return Tokens(None, tok)
        if not isinstance(tok, ModelTokenizer):  # the byte-level tokenizer and kvfleet's own template
            try:
                text = req.prompt if req.chat is None else render_chat(req.chat.messages)
            except ChatFormatError as exc:
                return Tokens(None, "content_part", str(exc))
            return Tokens(tok.encode(text or ""))
        dialect = (pool.cache.chat_dialect if pool is not None else None) or "vllm"
        try:
            if req.chat is not None:
                return Tokens(tok.encode_chat(req.chat, dialect))
            if not req.prompt and not DIALECTS[dialect].empty_prompt:
                return Tokens(None, "empty_prompt", f"{dialect} refuses an empty prompt")
            return Tokens(tok.encode_prompt(req.prompt or ""))
        except UnsupportedChat as exc:
            return Tokens(None, exc.reason, str(exc))
        except ChatTemplateError as exc:
            return Tokens(None, "template_error", str(exc))


__all__ = ["PoolTokenizers", "Tokenizer", "Tokens", "hub_fetch", "load_tokenizer", "render_chat"]
