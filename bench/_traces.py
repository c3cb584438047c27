"""Load the Mooncake FAST'25 traces shipped in ``kvfleet/data/traces`` and turn rows into tokens.

Not a benchmark (``make bench`` skips modules whose name starts with ``_``). Token ids are
synthesised deterministically from ``hash_ids``: id ``h`` stands for the 512
tokens ``h*512 .. h*512+511``, so tokens of different ids never coincide and the
cache finds exactly the prefixes the trace has; the last block is cut to
``input_length``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

import kvfleet

TRACE_DIR = Path(kvfleet.__file__).parent / "data" / "traces"
TRACE_BLOCK = 512
_RAMP = np.arange(TRACE_BLOCK, dtype=np.uint32)


@dataclass(frozen=True)
class Request:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def trace_path(name: str) -> Path:
    """``conversation`` / ``synthetic`` (or a path to a JSONL file of the same format)."""
    p = Path(name)
    if p.suffix == ".jsonl" and p.exists():
        return p
    path = TRACE_DIR / f"{name}_trace.jsonl"
    if not path.exists():
        known = sorted(f.name.removesuffix("_trace.jsonl") for f in TRACE_DIR.glob("*_trace.jsonl"))
        raise FileNotFoundError(f"no trace {name!r}; known: {', '.join(known)} (or a .jsonl path)")
    return path


def load(name: str = "conversation", limit: int | None = None) -> list[Request]:
    out: list[Request] = []
    with trace_path(name).open() as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            row = json.loads(line)
            out.append(Request(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                               tuple(row["hash_ids"])))
    return out


def tokens(req: Request) -> npt.NDArray[np.uint32]:
    """The request's prompt as token ids (see module doc)."""
    ids = np.asarray(req.hash_ids, dtype=np.uint32)
    return (ids[:, None] * np.uint32(TRACE_BLOCK) + _RAMP).ravel()[: req.input_length]


def chunks(reqs: list[Request], size: int = 256) -> Iterator[list[npt.NDArray[np.uint32]]]:
    """Token arrays in chunks, so a replay can time its cache work without the synthesis."""
    for i in range(0, len(reqs), size):
        yield [tokens(r) for r in reqs[i : i + size]]
