"""Tokenizers of the read path: the byte-level fallback (shared with the engine simulator) or HF
``tokenizers``.

Registered by name (:data:`TOKENIZERS`): ``bytes`` → :class:`~kvfleet.cache.tokens.ByteTokenizer`;
any other value is taken as a path to a ``tokenizer.json`` (:class:`HFTokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvfleet.cache.tokens import ByteTokenizer, render_chat


class Tokenizer(Protocol):
    """Text → token ids (``uint32``), identical to what the model server computes."""

    name: str

    def encode(self, text: str) -> npt.NDArray[np.uint32]: ...


class HFTokenizer:
    """A HF ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file (no special tokens added)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        self.path = str(path)
        self.name = f"hf:{Path(path).name}"
        self._tok: Any = _HF.from_file(self.path)

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)


TOKENIZERS: dict[str, type] = {"bytes": ByteTokenizer}


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes`` or a path to ``tokenizer.json``; raises ``ValueError`` naming the known names."""
    if spec in TOKENIZERS:
        tok: Tokenizer = TOKENIZERS[spec]()
        return tok
    if Path(spec).is_file():
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: not a file; known names: {', '.join(TOKENIZERS)}")


__all__ = ["HFTokenizer", "Tokenizer", "load_tokenizer", "render_chat"]
