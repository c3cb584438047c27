"""Byte-level tokenization and the default chat template, shared by the EPP and the engine simulator.

Both sides must turn the same request into the same token ids, or the EPP's
block keys never match the engine's KV events. The byte-level tokenizer is the
fallback when no ``tokenizer.json`` is configured: token id = byte value of the
UTF-8 encoding of the rendered prompt (ids 0..255).

The default chat template renders OpenAI ``messages`` as::

    <|role|>\\n{content}<|end|>\\n   (one per message)
    <|assistant|>\\n               (the generation prompt, when asked for)

``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts
(other part types are rejected: they cannot be keyed without their encoder).

:func:`salt_extra_keys` is vLLM's rule for ``cache_salt``: the one-element tuple
``(salt,)`` is the extra key of the first block only (an empty or missing salt
adds nothing), so the EPP's keys equal the engine's and vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ByteTokenizer", "ChatFormatError", "render_chat", "salt_extra_keys"]


class ChatFormatError(ValueError):
    """``messages`` is not a list of ``{"role": str, "content": str | [text parts]}``."""


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text; lossless and the same everywhere."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        raw = text.encode("utf-8", errors="surrogatepass")
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint32)

    def decode(self, token_ids: Sequence[int] | npt.NDArray[Any]) -> str:
        arr = np.asarray(token_ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte-level token ids must be in [0, 255]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _content_text(content: Any, index: int, mark_parts: bool) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            text = part.get("text") if kind == "text" else None
            if isinstance(text, str):
                parts.append(text)
            elif mark_parts and isinstance(kind, str):
                parts.append(f"<|{kind}|>")
            elif mark_parts:
                raise ChatFormatError(f"messages[{index}].content[{j}] must be an object with a 'type'")
            else:
                raise ChatFormatError(f"messages[{index}].content[{j}]: only text parts are supported")
        return "".join(parts)
    if content is None:
        return ""
    raise ChatFormatError(f"messages[{index}].content must be a string or a list of text parts")


def render_chat(messages: Any, add_generation_prompt: bool = True, mark_parts: bool = False) -> str:
    """Render OpenAI chat ``messages`` with the default template (see the module doc). ``mark_parts``: a
    content part other than text (any object with a string ``type``) is written ``<|type|>`` instead of
    refused."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatFormatError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatFormatError(f"messages[{i}].role must be a non-empty string")
        out.append(f"<|{role}|>\n{_content_text(msg.get('content'), i, mark_parts)}<|end|>\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def salt_extra_keys(salt: str | None) -> list[tuple[str] | None] | None:
    """Per-block extra keys for a request's ``cache_salt``, as vLLM builds them.

    vLLM's ``generate_block_hash_extra_keys`` adds ``request.cache_salt`` to the
    extra-key tuple of the block starting at token 0 only, and only when the salt
    is non-empty: ``[(salt,)]`` (later blocks: none), else ``None``.
    """
    return [(salt,)] if salt else None
