"""The content digests of a prompt's blocks in one compiled call (``_digest.c``: ``xxh3_64`` of each block,
from the vendored ``native/xxhash/xxhash.h``), for :class:`~kvfleet.cache.hashing.Xxh3Chain`."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvfleet.cache.compiled import load

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

lib = load(Path(__file__).parent, "_digest", "block digest")
lib.kv_digest_rows.argtypes = [_P, _I64, _I64, _P]
lib.kv_digest_rows.restype = None


def digest_rows(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """``xxh3_64`` (seed 0) of each row of a C-contiguous 2-D ``uint8`` array."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.flags.c_contiguous:
        raise ValueError("digest_rows takes a C-contiguous 2-D uint8 array")
    out = np.empty(rows.shape[0], dtype=np.uint64)
    if rows.shape[0]:
        lib.kv_digest_rows(rows.ctypes.data, rows.shape[0], rows.shape[1], out.ctypes.data)
    return out
