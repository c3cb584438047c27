"""The index's compiled table (``_probe.c``, loaded with ctypes): probes, inserts and the per-pod
longest-prefix search. The decision rules are documented in :mod:`kvfleet.epp.index`; this module only
passes the table's arrays. There is no Python version: a kvfleet installed without its compiled part
fails here, at import, with the way to build it."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvfleet.cache.compiled import load, ptr

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


lib = load(Path(__file__).parent, "_probe", "index probe")
lib.kv_find.argtypes = [_P, _P, _P, _I64, _INT, _P, _P, _I64, _P]
lib.kv_find.restype = None
lib.kv_insert.argtypes = [_P, _P, _P, _P, _I64, _INT, _P, _P, _P, _I64]
lib.kv_insert.restype = _I64
lib.kv_count_absent.argtypes = [_P, _P, _P, _I64, _INT, _P, _I64, _INT]
lib.kv_count_absent.restype = _I64
lib.kv_add.argtypes = [_P, _P, _P, _P, _I64, _INT, _P, _I64, _INT, _INT, _P]
lib.kv_add.restype = None
lib.kv_remove.argtypes = [_P, _P, _P, _P, _I64, _INT, _P, _I64, _INT, _INT, _INT, _P]
lib.kv_remove.restype = None
lib.kv_match.argtypes = [_P, _P, _P, _P, _I64, _INT, _P, _I64, _P, _I64, _P, _INT, _I64, _P, _P, _P]
lib.kv_match.restype = None


class Table(NamedTuple):
    """A table as the compiled code takes it: the addresses of its key, pod slot and tier mask arrays and of
    ``mix`` (a word per slot), read once (:func:`table`; its owner keeps the arrays alive and never
    reallocates them), its position mask (length − 1) and home-position shift."""

    keys: int
    pods: int
    mask: int
    mix: int
    wrap: int
    shift: int


def table(tkeys: npt.NDArray[np.uint64], tpods: npt.NDArray[np.uint16], tmask: npt.NDArray[np.uint8],
          mix: npt.NDArray[np.uint64], shift: int) -> Table:
    """:class:`Table` of these arrays (contiguous, writable, of equal length)."""
    if not (len(tkeys) == len(tpods) == len(tmask)) or not all(
            a.flags.c_contiguous and a.flags.writeable for a in (tkeys, tpods, tmask, mix)):
        raise ValueError("a table's arrays must be contiguous, writable and of equal length")
    return Table(ptr(tkeys), ptr(tpods), ptr(tmask), ptr(mix), len(tkeys) - 1, int(shift))


def find(t: Table, keys: npt.NDArray[np.uint64], slots: npt.NDArray[np.uint16]) -> npt.NDArray[np.int64]:
    """Table position of each (key, slot) of table ``t``, −1 where absent."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    slots = np.ascontiguousarray(slots, dtype=np.uint16)
    out = np.empty(len(keys), dtype=np.int64)
    lib.kv_find(t.keys, t.pods, t.mix, t.wrap, t.shift, ptr(keys), ptr(slots), len(keys), ptr(out))
    return out


def insert(t: Table, keys: npt.NDArray[np.uint64], slots: npt.NDArray[np.uint16],
           masks: npt.NDArray[np.uint8]) -> int:
    """Insert (key, slot) pairs known to be absent and distinct, with their tier masks, into table ``t``,
    whose load stays below 1; returns how many deleted positions were reused."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    slots = np.ascontiguousarray(slots, dtype=np.uint16)
    masks = np.ascontiguousarray(masks, dtype=np.uint8)
    return int(lib.kv_insert(t.keys, t.pods, t.mask, t.mix, t.wrap, t.shift, ptr(keys), ptr(slots),
                              ptr(masks), len(keys)))


def count_absent(t: Table, keys: npt.NDArray[np.uint64], slot: int) -> int:
    """How many of ``keys`` pod ``slot`` does not hold in table ``t`` (a repeated key counts each time)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    return int(lib.kv_count_absent(t.keys, t.pods, t.mix, t.wrap, t.shift, ptr(keys), len(keys), slot))


def add(t: Table, keys: npt.NDArray[np.uint64], slot: int, bit: int) -> tuple[int, int, int]:
    """Pod ``slot`` holds ``keys`` in the tier of mask ``bit``: held entries gain the bit, absent keys are
    inserted with it (room for :func:`count_absent` more entries is the caller's). Returns (entries inserted,
    held entries that gained the bit, deleted positions reused)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    out = np.empty(3, dtype=np.int64)
    lib.kv_add(t.keys, t.pods, t.mask, t.mix, t.wrap, t.shift, ptr(keys), len(keys), slot, bit, ptr(out))
    inserted, gained, reused = out.tolist()
    return inserted, gained, reused


def remove(t: Table, keys: npt.NDArray[np.uint64], slot: int, keep: int, gpu_bit: int) -> tuple[int, int]:
    """Pod ``slot`` keeps only the tier bits of ``keep`` for ``keys``; entries left with none are deleted.
    Returns (entries deleted, entries that lost ``gpu_bit``)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    out = np.empty(2, dtype=np.int64)
    lib.kv_remove(t.keys, t.pods, t.mask, t.mix, t.wrap, t.shift, ptr(keys), len(keys), slot, keep, gpu_bit,
                  ptr(out))
    gone, lost = out.tolist()
    return gone, lost


def match(t: Table, keys: npt.NDArray[np.uint64], slots: npt.NDArray[np.uint16],
          weights: Sequence[float], walk_budget: int,
          ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Per pod slot, the longest prefix of ``keys`` held (blocks) and its tier-weighted value (the rules:
    :mod:`kvfleet.epp.index`)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    slots = np.ascontiguousarray(slots, dtype=np.uint16)
    w = np.ascontiguousarray(weights, dtype=np.float64)
    c = len(slots)
    length = np.empty(c, dtype=np.int64)
    weighted = np.empty(c, dtype=np.float64)
    scratch = np.empty(3 * c, dtype=np.int64)
    lib.kv_match(t.keys, t.pods, t.mask, t.mix, t.wrap, t.shift, ptr(keys), len(keys), ptr(slots), c, ptr(w),
                  len(w), walk_budget, ptr(length), ptr(weighted), ptr(scratch))
    return length, weighted
