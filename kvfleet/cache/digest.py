"""The content digests of a prompt's blocks, and their chain, in one compiled call each (``_digest.c``:
``xxh3_64`` of each block, from the vendored ``native/xxhash/xxhash.h``; the polynomial chain and its
``fmix64``), for :class:`~kvfleet.cache.hashing.Xxh3Chain`."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvfleet.cache.compiled import load

_P, _I64, _U64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64

lib = load(Path(__file__).parent, "_digest", "block digest")
lib.kv_digest_rows.argtypes = [_P, _I64, _I64, _P]
lib.kv_digest_rows.restype = None
lib.kv_chain.argtypes = [_P, _I64, _U64, _P]
lib.kv_chain.restype = None
lib.kv_digest_chain.argtypes = [_P, _I64, _I64, _U64, _P]
lib.kv_digest_chain.restype = None
lib.kv_chain_each.argtypes = [_P, _P, _I64, _P]
lib.kv_chain_each.restype = None


def _rows(rows: npt.NDArray[np.uint8]) -> None:
    if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.flags.c_contiguous:
        raise ValueError("the rows must be a C-contiguous 2-D uint8 array")


def digest_rows(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """``xxh3_64`` (seed 0) of each row of a C-contiguous 2-D ``uint8`` array."""
    _rows(rows)
    out = np.empty(rows.shape[0], dtype=np.uint64)
    if rows.shape[0]:
        lib.kv_digest_rows(rows.ctypes.data, rows.shape[0], rows.shape[1], out.ctypes.data)
    return out


def chain(digests: npt.NDArray[np.uint64], state: int) -> npt.NDArray[np.uint64]:
    """``h_i = fmix64(s_i)``, ``s_i = P·s_{i-1} + digests[i] (mod 2^64)`` from ``s_{-1} = state``."""
    d = np.ascontiguousarray(digests, dtype=np.uint64)
    out = np.empty(len(d), dtype=np.uint64)
    if len(d):
        lib.kv_chain(d.ctypes.data, len(d), state, out.ctypes.data)
    return out


def digest_chain(rows: npt.NDArray[np.uint8], state: int) -> npt.NDArray[np.uint64]:
    """:func:`chain` of :func:`digest_rows` in one pass."""
    _rows(rows)
    out = np.empty(rows.shape[0], dtype=np.uint64)
    if rows.shape[0]:
        lib.kv_digest_chain(rows.ctypes.data, rows.shape[0], rows.shape[1], state, out.ctypes.data)
    return out


def chain_each(digests: npt.NDArray[np.uint64], states: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """One link of :func:`chain` from each state: ``h_i = fmix64(P·states[i] + digests[i])``."""
    d = np.ascontiguousarray(digests, dtype=np.uint64)
    s = np.ascontiguousarray(states, dtype=np.uint64)
    if len(d) != len(s):
        raise ValueError("one state per digest")
    out = np.empty(len(d), dtype=np.uint64)
    if len(d):
        lib.kv_chain_each(d.ctypes.data, s.ctypes.data, len(d), out.ctypes.data)
    return out
