"""A model's own tokenizer and chat template, applied as vLLM and SGLang apply them.

The EPP's block keys equal an engine's only when the EPP computes the same token ids for a request.
A pool's engines tokenize with the model's files (``tokenizer.json``, ``tokenizer_config.json``, an
optional ``chat_template.jinja``); :class:`ModelTokenizer` loads the same files and reproduces the two
request paths:

``/v1/completions``
    ``encode_prompt(text)``: the tokenizer with its special-token rule (``add_special_tokens=True``:
    Mistral and Llama tokenizers prepend BOS through their post-processor, Qwen's add nothing).
``/v1/chat/completions``
    ``encode_chat(chat)``: the messages normalised as the engine's OpenAI layer does (:func:`conversation`),
    the model's Jinja chat template rendered in the environment ``transformers`` uses (sandboxed,
    ``trim_blocks``/``lstrip_blocks``, its ``tojson``, ``raise_exception`` and ``strftime_now``), then
    encoded with ``add_special_tokens=False`` (the template writes BOS itself).

The engines differ in a few normalisations (the *dialect*, the pool's engine kind): vLLM passes every
tool as the full OpenAI model (unset ``description``/``parameters`` as ``null``); SGLang passes the
fields the client sent. Both join a message's text parts and turn an assistant's tool-call
``arguments`` JSON into an object before rendering. The interop suite (``tests/interop/test_chat_tokens.py``)
checks these token ids against vLLM's and SGLang's own serving code, both supported versions of each.

What cannot be reproduced raises :class:`UnsupportedChat` (non-text content parts, a request-supplied
template, an unknown role): the EPP routes such a request on load and counts it, it never keys it
wrongly. A template that rejects the conversation (``raise_exception``) raises :class:`ChatTemplateError`;
the engine answers 400 for the same conversation.

Built-in files (``builtin:qwen2.5``, ``builtin:mistral-nemo``) ship in ``kvfleet/data/tokenizers``
(their provenance in ``SOURCES.md``); any other spec is a directory holding the model's files.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BUILTIN_DIR", "DIALECTS", "ChatRequest", "ChatTemplateError", "Dialect", "ModelTokenizer",
    "UnsupportedChat", "builtin_names", "conversation", "dialect_for", "load_model_tokenizer",
]

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data" / "tokenizers"
BUILTIN_PREFIX = "builtin:"
#: chat texts shorter than this are encoded whole; the piece cache holds at most this many characters
PIECE_MIN_CHARS = 2048
PIECE_CACHE_CHARS = 32 * 1024 * 1024
ROLES = frozenset({"system", "user", "assistant", "tool"})
#: ``chat_template_kwargs`` the EPP can pass on unchanged (any other key: UnsupportedChat)
PASSED_KWARGS = frozenset({"enable_thinking", "thinking"})


@dataclass(frozen=True)
class Dialect:
    """How an engine's OpenAI layer hands a request to the chat template (each checked by the interop suite).

    ``function_fields``: a tool's ``function`` as the engine's pydantic model dumps it (field order and
    defaults); ``tool_is_function``: the template gets the ``function`` object only (else the whole tool,
    with ``tool_extra``); ``part_separator`` joins a message's text parts; ``none_content`` is what a
    missing ``content`` becomes; ``generation_prompt_fixed``: ``add_generation_prompt`` is always on;
    ``call_arguments_first``: an assistant's tool call is
    ``{"id", "function": {"arguments", "name"}, "type"}``
    (the order of the OpenAI ``TypedDict`` vLLM validates it into; templates that ``tojson`` it show it),
    else ``{"id", "type", "function": {"name", "arguments"}}``; ``retry_wrapped_tools``: when the template
    fails on function-only tools, the engine renders again with each wrapped as ``{"function": ...}``;
    ``drops_tools_on_none``: ``tool_choice: "none"`` renders no tools; ``any_role``: a message of a role
    other than system, user, assistant and tool goes to the template as it is (vLLM; SGLang's request model
    refuses it); ``final_assistant``: a conversation may end with an assistant message (SGLang 0.5.23 hands
    such a one to the template otherwise than this code does: not keyed); ``empty_prompt``: a completions
    ``prompt`` of ``""`` is served (vLLM refuses it).
    """

    name: str
    function_fields: Mapping[str, Any]
    tool_is_function: bool = False
    tool_extra: Mapping[str, Any] = field(default_factory=dict)
    part_separator: str = "\n"
    none_content: Any = ""
    generation_prompt_fixed: bool = False
    call_arguments_first: bool = False
    retry_wrapped_tools: bool = False
    drops_tools_on_none: bool = False
    any_role: bool = False
    final_assistant: bool = True
    empty_prompt: bool = True


_FN = {"name": None, "description": None, "parameters": None}
#: by name: ``vllm`` (vLLM 0.11 and 0.33), ``sglang`` (SGLang 0.5.23), ``sglang-0.5.3``
DIALECTS: dict[str, Dialect] = {d.name: d for d in (
    Dialect("vllm", _FN, call_arguments_first=True, any_role=True, empty_prompt=False),
    Dialect("sglang", _FN, tool_extra={"defer_loading": None}, part_separator=" ", none_content=None,
            generation_prompt_fixed=True, drops_tools_on_none=True, final_assistant=False),
    Dialect("sglang-0.5.3", {"description": None, "name": None, "parameters": None, "strict": False},
            tool_is_function=True, part_separator=" ", none_content=None, generation_prompt_fixed=True,
            retry_wrapped_tools=True, drops_tools_on_none=True),
)}


def dialect_for(engine: str, version: tuple[int, ...] | None = None) -> str:
    """The dialect of an engine release: SGLang before 0.5.23 renders tools as 0.5.3 does."""
    if engine == "sglang":
        return "sglang-0.5.3" if version is not None and version < (0, 5, 23) else "sglang"
    return "vllm"


class UnsupportedChat(ValueError):
    """A chat request whose rendering the EPP cannot reproduce exactly; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ChatTemplateError(ValueError):
    """The model's chat template rejected the conversation (the engine answers 400 too)."""


@dataclass(frozen=True)
class ChatRequest:
    """The fields of a chat request that decide its prompt tokens."""

    messages: Any
    tools: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tool_choice: Any = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def builtin_names() -> list[str]:
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if p.is_dir())


def _read(directory: Path, name: str) -> bytes | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            raw = candidate.read_bytes()
            return gzip.decompress(raw) if candidate.suffix == ".gz" else raw
    return None


def _template_of(config: Mapping[str, Any], directory: Path) -> str | dict[str, str] | None:
    jinja = _read(directory, "chat_template.jinja")
    if jinja is not None:
        return jinja.decode("utf-8")
    raw = _read(directory, "chat_template.json")
    if raw is not None:
        tpl_json = json.loads(raw).get("chat_template")
        return tpl_json if isinstance(tpl_json, str) else None
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates (transformers): [{"name": ..., "template": ...}]
        return {str(t["name"]): str(t["template"]) for t in tpl if isinstance(t, Mapping)}
    return tpl if isinstance(tpl, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    """The template compiled in the environment ``transformers`` renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):  # {% generation %} blocks render their body
        tags = {"generation"}  # noqa: RUF012 - jinja2's own attribute type

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _content_format(template: str) -> str:
    """``openai`` when the template iterates over a message's content parts, else ``string``."""
    import re

    loop = r"for\s+\w+\s+in\s+(message|msg|m)\s*(\[\s*['\"]content['\"]\s*\]|\.content)"
    return "openai" if re.search(loop, template) else "string"


def _text_parts(content: Any, where: str) -> list[str]:
    texts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            raise UnsupportedChat("content_part", f"{where}.content[{j}]: part type {kind!r} is not keyed")
        text = part.get("text")
        if not isinstance(text, str):
            raise UnsupportedChat("content_part", f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return texts


def _tool_calls(calls: Any, where: str, arguments_first: bool) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise UnsupportedChat("tool_calls", f"{where}.tool_calls must be a list")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise UnsupportedChat("tool_calls", f"{where}.tool_calls[{j}].function.name must be a string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise UnsupportedChat("tool_calls",
                                      f"{where}.tool_calls[{j}]: arguments are not JSON") from None
        if not isinstance(args, dict):
            raise UnsupportedChat("tool_calls", f"{where}.tool_calls[{j}]: arguments must be a JSON object")
        if arguments_first:
            out.append({"id": call.get("id"), "function": {"arguments": args, "name": fn["name"]},
                        "type": call.get("type", "function")})
        else:
            out.append({"id": call.get("id"), "type": call.get("type", "function"),
                        "function": {"name": fn["name"], "arguments": args}})
    return out


def conversation(messages: Any, dialect: Dialect, content_format: str = "string") -> list[dict[str, Any]]:
    """OpenAI ``messages`` normalised as the engine's OpenAI layer hands them to the template."""
    if not isinstance(messages, list) or not messages:
        raise UnsupportedChat("messages", "messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise UnsupportedChat("messages", f"{where} must be an object")
        role = msg.get("role")
        if role not in ROLES and not (dialect.any_role and isinstance(role, str) and role):
            raise UnsupportedChat("role",
                                  f"{where}.role {role!r} is not keyed (known: {', '.join(sorted(ROLES))})")
        content = msg.get("content")
        texts: list[str] | None
        if content is None and "content" in msg and role != "assistant":
            raise UnsupportedChat("content", f"{where}.content is null (only an assistant's may be)")
        if content is None:
            texts = None
        elif isinstance(content, str):
            texts = [content]
        elif isinstance(content, list):
            texts = _text_parts(content, where)
        else:
            raise UnsupportedChat("messages", f"{where}.content must be a string or a list of parts")
        entry: dict[str, Any] = {"role": role}
        if content_format == "openai":
            entry["content"] = [{"type": "text", "text": t} for t in texts or []]
        elif texts is None:
            entry["content"] = dialect.none_content
        else:
            entry["content"] = dialect.part_separator.join(texts)
        if role == "assistant" and msg.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(msg["tool_calls"], where, dialect.call_arguments_first)
        if role == "tool" and msg.get("tool_call_id") is not None:
            entry["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            entry["name"] = msg["name"]
        out.append(entry)
    if not dialect.final_assistant and out[-1]["role"] == "assistant":
        raise UnsupportedChat("final_assistant",
                              f"{dialect.name}: a conversation ending with an assistant turn is not keyed")
    return out


def _tools(tools: Any, dialect: Dialect) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise UnsupportedChat("tools", "tools must be a list")
    out: list[dict[str, Any]] = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or tool.get("type", "function") != "function":
            raise UnsupportedChat("tools", f"tools[{j}] must be a function tool with a name")
        unknown = (set(fn) - set(dialect.function_fields)) \
            | (set(tool) - {"type", "function", *dialect.tool_extra})
        if unknown:
            raise UnsupportedChat("tools", f"tools[{j}]: fields {sorted(unknown)} are not keyed")
        function = {k: fn.get(k, default) for k, default in dialect.function_fields.items()}
        if dialect.tool_is_function:
            out.append(function)
        else:
            out.append({"type": "function", "function": function,
                        **{k: tool.get(k, default) for k, default in dialect.tool_extra.items()}})
    return out or None


class ModelTokenizer:
    """A model's ``tokenizer.json`` and chat template (see the module doc); thread-safe."""

    def __init__(self, directory: str | Path, name: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        self.directory = Path(directory)
        raw = _read(self.directory, "tokenizer.json")
        if raw is None:
            raise FileNotFoundError(f"no tokenizer.json in {self.directory}")
        self.name = name or self.directory.name
        self._tok: Any = _HF.from_str(raw.decode("utf-8"))
        self._fast: Any = getattr(self._tok, "encode_batch_fast", None)
        cfg_raw = _read(self.directory, "tokenizer_config.json")
        self.config: dict[str, Any] = json.loads(cfg_raw) if cfg_raw else {}
        self.templates = _template_of(self.config, self.directory)
        self.special_tokens = {k: t for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                                              "cls_token", "mask_token")
                               if (t := _token_text(self.config.get(k))) is not None}
        self._lock = threading.Lock()
        self._anchor = self._find_anchor()
        self._pieces: OrderedDict[str, npt.NDArray[np.uint32]] = OrderedDict()
        self._piece_chars = 0
        self.piece_hits = 0
        self.piece_misses = 0

    def _find_anchor(self) -> str | None:
        """The end-of-turn token a rendered chat can be cut after, exactly (see :meth:`encode`): the EOS token
        when it is a special added token that absorbs no whitespace, is matched on the raw text and is no
        part of another added token; else ``None`` (no reuse)."""
        eos = self.special_tokens.get("eos_token")
        if not eos:
            return None
        added = {t.content: t for t in self._tok.get_added_tokens_decoder().values()}
        tok = added.get(eos)
        if tok is None or not tok.special or tok.lstrip or tok.rstrip or tok.normalized or tok.single_word:
            return None
        if any(eos in other and other != eos for other in added):
            return None
        return str(eos)

    def __repr__(self) -> str:
        return f"ModelTokenizer({self.name!r})"

    # --- completions ------------------------------------------------------------------------------

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        """Token ids of ``text`` without special tokens (what a chat template's output is encoded with).

        Reuse across turns, exactly: the tokenizer splits its input on added tokens first and encodes the
        text between them independently, so ``text`` cut right after each end-of-turn token (the anchor,
        :meth:`_find_anchor`) encodes piece by piece to the same ids. Each piece's ids are kept by content
        (an LRU of at most :data:`PIECE_CACHE_CHARS` characters): a follow-up turn, which repeats the
        conversation, encodes only its new messages. ``tests/cache/test_modeltok.py`` compares it with a
        whole encoding on every case it claims."""
        anchor = self._anchor
        if anchor is None or len(text) < PIECE_MIN_CHARS or anchor not in text:
            return self._encode_whole(text)
        parts: list[npt.NDArray[np.uint32]] = []
        start = 0
        n = len(anchor)
        while start < len(text):
            cut = text.find(anchor, start)
            end = len(text) if cut < 0 else cut + n
            parts.append(self._piece(text[start:end]))
            start = end
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _encode_whole(self, text: str) -> npt.NDArray[np.uint32]:
        return self._ids(text, False)

    def _ids(self, text: str, special: bool) -> npt.NDArray[np.uint32]:
        """The ids of ``text``: ``encode_batch_fast`` where the tokenizers release has it (the same ids
        without the character offsets, ≈ 25 % less CPU on a 4k-token prompt), else ``encode``."""
        if self._fast is not None:
            return np.asarray(self._fast([text], add_special_tokens=special)[0].ids, dtype=np.uint32)
        return np.asarray(self._tok.encode(text, add_special_tokens=special).ids, dtype=np.uint32)

    def _piece(self, piece: str) -> npt.NDArray[np.uint32]:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.piece_hits += 1
                return ids
        ids = self._encode_whole(piece)
        ids.flags.writeable = False
        with self._lock:
            self.piece_misses += 1
            if piece not in self._pieces:
                self._pieces[piece] = ids
                self._piece_chars += len(piece)
                while self._piece_chars > PIECE_CACHE_CHARS and self._pieces:
                    old, _ = self._pieces.popitem(last=False)
                    self._piece_chars -= len(old)
        return ids

    def encode_prompt(self, text: str) -> npt.NDArray[np.uint32]:
        """Token ids of a completions ``prompt``: with the tokenizer's special-token rule (BOS)."""
        return self._ids(text, True)

    def decode(self, token_ids: Sequence[int] | npt.NDArray[Any]) -> str:
        return str(self._tok.decode([int(t) for t in token_ids], skip_special_tokens=False))

    # --- chat -------------------------------------------------------------------------------------

    def template_for(self, tools: Any) -> str:
        tpl = self.templates
        if isinstance(tpl, dict):
            name = "tool_use" if tools and "tool_use" in tpl else "default"
            if name not in tpl:
                raise UnsupportedChat("no_template", f"{self.name}: no {name!r} chat template")
            return tpl[name]
        if not tpl:
            raise UnsupportedChat("no_template", f"{self.name}: the tokenizer has no chat template")
        return tpl

    def render_chat(self, chat: ChatRequest, dialect: str = "vllm") -> str:
        d = DIALECTS.get(dialect)
        if d is None:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
        if chat.continue_final_message:
            raise UnsupportedChat("continue_final_message", "continue_final_message is not keyed")
        extra = set(chat.chat_template_kwargs) - PASSED_KWARGS
        if extra:
            raise UnsupportedChat("chat_template_kwargs",
                                  f"chat_template_kwargs {sorted(extra)} are not keyed")
        if chat.tool_choice not in (None, "auto", "none") or (chat.tool_choice == "none" and d.name != "vllm"
                                                                and not d.drops_tools_on_none):
            raise UnsupportedChat("tool_choice",
                                  f"tool_choice {chat.tool_choice!r} is not keyed for {d.name}")
        tools_in = None if chat.tool_choice == "none" and d.drops_tools_on_none else chat.tools
        template = self.template_for(tools_in)
        conv = conversation(chat.messages, d, _content_format(template))
        tools = _tools(tools_in, d)
        try:
            return self._render(template, conv, tools, chat, d)
        except ChatTemplateError:
            if not (tools and d.retry_wrapped_tools):
                raise
            wrapped = [t if "function" in t else {"function": t} for t in tools]
            return self._render(template, conv, wrapped, chat, d)

    def _render(self, template: str, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                chat: ChatRequest, d: Dialect) -> str:
        import jinja2

        try:
            return str(_compile(template).render(messages=conv, tools=tools, documents=None,
                                                 add_generation_prompt=chat.add_generation_prompt or
                                                 d.generation_prompt_fixed,
                                                 **{**self.special_tokens, **chat.chat_template_kwargs}))
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{self.name} chat template: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # template code failing on odd input
            raise UnsupportedChat("template_failed", f"{self.name} chat template failed: {exc}") from None

    def encode_chat(self, chat: ChatRequest, dialect: str = "vllm") -> npt.NDArray[np.uint32]:
        return self.encode(self.render_chat(chat, dialect))


_LOADED: dict[str, ModelTokenizer] = {}
_LOAD_LOCK = threading.Lock()


def load_model_tokenizer(spec: str) -> ModelTokenizer:
    """``builtin:NAME`` (see :func:`builtin_names`) or a directory with the model's tokenizer files.

    Loaded once per spec per process. Raises ``FileNotFoundError`` naming what is missing."""
    with _LOAD_LOCK:
        tok = _LOADED.get(spec)
        if tok is not None:
            return tok
        if spec.startswith(BUILTIN_PREFIX):
            name = spec[len(BUILTIN_PREFIX):]
            if not (BUILTIN_DIR / name).is_dir():
                raise FileNotFoundError(
                    f"unknown built-in tokenizer {name!r}; known: {', '.join(builtin_names())}")
            tok = ModelTokenizer(BUILTIN_DIR / name, name)
        else:
            path = Path(spec)
            if path.is_file() and path.name.startswith("tokenizer.json"):
                path = path.parent
            if not path.is_dir():
                raise FileNotFoundError(f"tokenizer {spec!r}: not a directory with tokenizer.json, nor "
                                        f"builtin:NAME ({', '.join(builtin_names())})")
            tok = ModelTokenizer(path)
        _LOADED[spec] = tok
        return tok
