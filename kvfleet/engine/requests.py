"""Request validation of the engine simulator, as vLLM answers it: OpenAI error classes, sampling
parameters, and the request fields vLLM's own request models check (``logprobs``, ``top_logprobs``,
``cache_salt``, ``logit_bias``, ``tools``). A body vLLM refuses with a 400 is refused here with a 400
(``tests/interop/test_vllm_requests.py`` holds the two to the same answers, case by case)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.cache.hashing import ExtraKeys
from kvfleet.cache.modeltok import ChatRequest, ChatTemplateError, ModelTokenizer, UnsupportedChat
from kvfleet.cache.tokens import ByteTokenizer, ChatFormatError, render_chat


class ApiError(Exception):
    """An error answered as OpenAI error JSON; the subclass decides the status."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ForbiddenApiError(ApiError):
    status = 403
    kind = "permission_error"


class NotFoundApiError(ApiError):
    status = 404
    kind = "not_found_error"


class ConflictApiError(ApiError):
    status = 409
    kind = "conflict"


class UnavailableApiError(ApiError):
    status = 503
    kind = "service_unavailable"


#: vLLM's SamplingParams checks, in its words: (field, default, valid?, message)
_SAMPLING: tuple[tuple[str, float, Callable[[float], bool], str], ...] = (
    ("n", 1, lambda v: v >= 1, "n must be at least 1, got {}."),
    ("presence_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "presence_penalty must be in [-2, 2], got {}."),
    ("frequency_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "frequency_penalty must be in [-2, 2], got {}."),
    ("repetition_penalty", 1.0, lambda v: v > 0.0, "repetition_penalty must be greater than zero, got {}."),
    ("temperature", 1.0, lambda v: v >= 0.0, "temperature must be non-negative, got {}."),
    ("temperature", 1.0, lambda v: v <= 2.0, "temperature must be in [0, 2], got {}."),
    ("top_p", 1.0, lambda v: 0.0 < v <= 1.0, "top_p must be in (0, 1], got {}."),
    ("top_k", 0, lambda v: v >= -1 and v == int(v), "top_k must be 0 (disable), or at least 1, got {}."),
    ("min_p", 0.0, lambda v: 0.0 <= v <= 1.0, "min_p must be in [0, 1], got {}."),
)


def check_sampling(data: Mapping[str, Any]) -> None:
    """Sampling parameters as vLLM validates them (400 with vLLM's message); ``null`` means the default."""
    for name, _, valid, message in _SAMPLING:
        v = data.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ApiError(f"{name} must be a finite number, got {v!r}.", param=name)
        if not valid(float(v)):
            raise ApiError(message.format(v), param=name)


# pydantic's lax booleans (what vLLM's request models accept for a ``bool`` field)
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise ApiError(f"`{name}` must be a boolean.", param=name)


def _int(name: str, v: Any) -> int:
    if isinstance(v, int):  # bool included, as pydantic takes it
        return int(v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    raise ApiError(f"`{name}` must be an integer.", param=name)


def _positive_or_minus_one(name: str, v: int) -> None:
    if v < 0 and v != -1:
        raise ApiError(f"`{name}` must be a positive value or -1.", param=name)


def _number(v: Any) -> bool:
    if isinstance(v, bool | int | float):
        return True
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return False
        return True
    return False


def check_request_fields(data: Mapping[str, Any], chat: bool) -> None:
    """The fields vLLM's ``ChatCompletionRequest`` / ``CompletionRequest`` validate before anything runs
    (its 400s): ``logprobs`` (a boolean for chat, an integer ≥ 0 or -1 for completions),
    ``top_logprobs`` (chat: an integer ≥ 0 or -1, only with ``logprobs`` true), ``cache_salt`` (a
    non-empty string), ``logit_bias`` (token id → number), ``tools`` (a list of function tools, each
    with a ``function.name``)."""
    logprobs = data.get("logprobs")
    if chat:
        on = logprobs is not None and _bool("logprobs", logprobs)
        top = data.get("top_logprobs")
        if top is not None:
            n = _int("top_logprobs", top)
            _positive_or_minus_one("top_logprobs", n)
            if (n == -1 or n > 0) and not on:
                raise ApiError("when using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
    elif logprobs is not None:
        _positive_or_minus_one("logprobs", _int("logprobs", logprobs))
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    bias = data.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or not all(_number(v) for v in bias.values())):
        raise ApiError("`logit_bias` must map token ids to numbers.", param="logit_bias")
    tools = data.get("tools") if chat else None
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError("`tools` must be a list of tools.", param="tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                    or tool.get("type", "function") != "function"):
                raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.",
                               param="tools")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated OpenAI request."""

    chat: bool
    token_ids: npt.NDArray[np.uint32]
    max_tokens: int
    stream: bool
    include_usage: bool
    extra_keys: ExtraKeys
    remote_decode: bool


def chat_ids(tok: ByteTokenizer | ModelTokenizer, data: Mapping[str, Any]) -> npt.NDArray[np.uint32]:
    """A chat request's prompt ids as vLLM renders and encodes them (the model's template), else with
    kvfleet's template (the byte tokenizer)."""
    try:
        if isinstance(tok, ByteTokenizer):
            return tok.encode(render_chat(data.get("messages")))
        add_gen = data.get("add_generation_prompt", True)
        kwargs = data.get("chat_template_kwargs") or {}
        if not isinstance(add_gen, bool) or not isinstance(kwargs, dict):
            raise ApiError("add_generation_prompt must be a boolean and chat_template_kwargs an object")
        return tok.encode_chat(ChatRequest(data.get("messages"), data.get("tools"), add_gen,
                                           bool(data.get("continue_final_message", False)),
                                           data.get("tool_choice"), kwargs))
    except (ChatFormatError, UnsupportedChat, ChatTemplateError) as exc:
        raise ApiError(str(exc), param="messages") from None


def prompt_ids(tok: ByteTokenizer | ModelTokenizer, prompt: Any) -> npt.NDArray[np.uint32]:
    """A completion's ``prompt`` as ids: text encoded with the engine's special-token rule, or ids checked."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt must not be empty", param="prompt")
        return tok.encode(prompt) if isinstance(tok, ByteTokenizer) else tok.encode_prompt(prompt)
    if isinstance(prompt, list) and prompt:
        try:
            arr = np.asarray(prompt)
        except (ValueError, OverflowError):
            arr = np.asarray([0.5])  # ragged or oversized: rejected below
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 2**32:
            raise ApiError("prompt token ids must be integers in [0, 2^32)", param="prompt")
        return arr.astype(np.uint32)
    raise ApiError("prompt must be a non-empty string or list of token ids", param="prompt")
