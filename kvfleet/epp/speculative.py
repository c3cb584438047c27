"""The picker's speculative index entries: which block positions of a picked prompt are recorded
(:func:`spec_positions`), the :class:`Lease` that all the entries of one pick share, and the compiled store
that holds them (:class:`SpecStore`, ``_spec.c``). :class:`~kvfleet.epp.index.BlockIndex` keeps the rules.

Speculative entries (:meth:`~kvfleet.epp.index.BlockIndex.add_speculative`) record the picker's own picks
until the pod's events confirm them or their TTL expires: without them, a burst
of same-prefix requests arriving before the first prefill's events would
scatter. A pod's removal of a key drops its entries of picks already served (their
first token came back, so the removal is newer news); a pick still waiting for
its first token keeps them, since its prefill will store the blocks again
(dropping every pick's entries on ``BlockRemoved`` lowered the routing
simulation's hit rate; keeping served ones credited pods with evicted blocks:
``docs/epp.md``, "Workloads it was not tuned on").
With events disabled they are the whole index (approximate mode). They are capped
at ``max_speculative`` entries: beyond it, expired picks are dropped, then the
oldest picks, counted in :attr:`~kvfleet.epp.index.BlockIndex.speculative_dropped`.

The entries live in one compiled hash table, (block key, pod slot) → lease, with the leases' expiry,
served flag and entry count beside it: 20–37 bytes per entry and no Python object per entry. As a
``key → {pod: Lease}`` dict they cost ≈ 325 bytes each, and at the default bound (10⁶ entries) a full
collection of the garbage collector walked them for ≈ 130–190 ms, a stall of the picker. Every call on the
store holds the index's speculative lock, reads included (picks are written by the router's thread and the
gossip thread, removals by the ingestion thread; the compiled calls release the GIL)."""

from __future__ import annotations

import bisect
import ctypes
import functools
import math
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvfleet.cache.compiled import ptr
from kvfleet.epp.probe import lib

#: Speculative entries are kept for every block below SPEC_DENSE, then every SPEC_STRIDE-th block up to
#: SPEC_FAR blocks, then on a grid whose spacing grows with the position (``p → p + p // SPEC_RESOLUTION``:
#: a credited prefix is short by at most 1/SPEC_RESOLUTION of it), plus the prompt's last block.
SPEC_DENSE = 64
SPEC_STRIDE = 16
SPEC_FAR = 1024
SPEC_RESOLUTION = 64


def _grid(limit: int = 1 << 32) -> list[int]:
    out = [*range(SPEC_DENSE), *range(SPEC_DENSE + SPEC_STRIDE - 1, SPEC_FAR, SPEC_STRIDE)]
    while out[-1] < limit:
        out.append(out[-1] + max(SPEC_STRIDE, out[-1] // SPEC_RESOLUTION))
    return out


_GRID = _grid()  # ≈ 1,500 positions up to 2^32 blocks


def grid() -> list[int]:
    """The absolute sample grid (a prompt of ``n`` blocks is sampled at its positions below ``n``, and
    ``n − 1``); read-only."""
    return _GRID


def spec_positions(n: int) -> Sequence[int]:
    """Block positions sampled for speculative entries of an ``n``-block prompt: the grid (absolute, so all
    prompts agree on it) below ``n``, and ``n − 1`` (so a repeated prompt is credited in full)."""
    if n <= SPEC_DENSE:
        return range(n)
    out = _GRID[: bisect.bisect_left(_GRID, n)]
    return out if out[-1] == n - 1 else [*out, n - 1]


@functools.lru_cache(maxsize=1024)
def spec_position_index(n: int) -> npt.NDArray[np.int64]:
    """:func:`spec_positions` of an ``n``-block prompt as an ``int64`` array, kept per ``n`` and shared: never
    written (indexes and a ``const`` argument of the compiled reuse fit). Numpy converts a list of positions
    on every read (4.7 against 1.8 µs for a 4k prompt's 76). Left writable: ``probe.ptr`` reads a writable
    array's address in ≈ 0.5 µs and a read-only one's in ≈ 4.6."""
    return np.asarray(spec_positions(n), dtype=np.int64)


# --- the compiled store ------------------------------------------------------------------------------

_P, _I64, _U16, _D, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint16, ctypes.c_double, ctypes.c_int
lib.spec_new.argtypes = []
lib.spec_new.restype = _P
lib.spec_free.argtypes = [_P]
lib.spec_free.restype = None
lib.spec_lease_new.argtypes = [_P, _D]
lib.spec_lease_new.restype = _I64
lib.spec_lease_owned.argtypes = [_P, _I64]
lib.spec_lease_owned.restype = _I64
lib.spec_lease_set.argtypes = [_P, _I64, _D, _INT]
lib.spec_lease_set.restype = None
lib.spec_add.argtypes = [_P, _P, _I64, _U16, _I64]
lib.spec_add.restype = _I64
lib.spec_drop.argtypes = [_P, _P, _I64, _U16, _I64]
lib.spec_drop.restype = _I64
lib.spec_drop_served.argtypes = [_P, _P, _I64, _U16]
lib.spec_drop_served.restype = _I64
lib.spec_drop_pod.argtypes = [_P, _U16]
lib.spec_drop_pod.restype = _I64
lib.spec_match.argtypes = [_P, _P, _P, _I64, _P, _I64, _D, _P]
lib.spec_match.restype = _I64
lib.spec_entries.argtypes = [_P, _P, _P, _I64]
lib.spec_entries.restype = _I64
lib.spec_stats.argtypes = [_P, _P]
lib.spec_stats.restype = None

#: a pod slot that names no pod (:meth:`SpecStore.match` skips it)
NO_POD = 0xFFFF


def _contiguous(keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """``keys`` as the compiled store reads them: one contiguous uint64 buffer (copied only if they are
    not)."""
    return np.ascontiguousarray(keys, dtype=np.uint64)


class Lease:
    """The expiry of one pick's speculative entries, shared by all of them: extending it is O(1).
    ``owned``: how many entries still name this lease (a later pick of the same key takes an entry over);
    ``served``: the pick's first token came back (:meth:`BlockIndex.extend`), so the pod's events are now
    newer than the pick. A handle on the lease in its :class:`SpecStore`: once its last entry is gone the
    store frees it, and the handle keeps its last expiry and served flag (``owned`` 0)."""

    __slots__ = ("_expiry", "_served", "handle", "store")

    def __init__(self, store: SpecStore, handle: int, expiry: float) -> None:
        self.store, self.handle, self._expiry, self._served = store, handle, expiry, False

    @property
    def expiry(self) -> float:
        return self._expiry

    @expiry.setter
    def expiry(self, value: float) -> None:
        self._expiry = value
        with self.store.lock:
            self.store.set_lease(self.handle, value, -1)

    @property
    def served(self) -> bool:
        return self._served

    def serve(self, expiry: float) -> None:
        """The pick's first token came back: its entries now expire at ``expiry``."""
        self._expiry, self._served = expiry, True
        with self.store.lock:
            self.store.set_lease(self.handle, expiry, 1)

    @property
    def owned(self) -> int:
        with self.store.lock:
            return self.store.owned(self.handle)


class SpecStore:
    """The speculative entries, (block key, pod slot) → the :class:`Lease` of the pick that recorded it, in
    ``_spec.c`` (20–37 bytes per entry; no Python object per entry, so nothing for the garbage collector
    to walk). Every call must hold ``lock`` (a :class:`Lease` takes it itself;
    :class:`~kvfleet.epp.index.BlockIndex` holds it around its calls)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        #: no lease expires before this (at most the earliest expiry given to one since the owner's last scan
        #: of its picks, which sets it): a scan before it would find nothing
        self.next_expiry = math.inf
        self._s = lib.spec_new()
        if not self._s:
            raise MemoryError("speculative entries: no memory for the table")
        self._free = lib.spec_free  # still reachable from __del__ at interpreter exit

    def __del__(self) -> None:
        s, self._s = getattr(self, "_s", None), None
        if s:
            self._free(s)

    def lease(self, expiry: float) -> Lease:
        h = int(lib.spec_lease_new(self._s, expiry))
        if h < 0:
            raise MemoryError("speculative entries: no memory for another lease")
        if expiry < self.next_expiry:
            self.next_expiry = expiry
        return Lease(self, h, expiry)

    def set_lease(self, handle: int, expiry: float, served: int) -> None:
        if expiry < self.next_expiry:
            self.next_expiry = expiry
        lib.spec_lease_set(self._s, handle, expiry, served)

    def owned(self, handle: int) -> int:
        return int(lib.spec_lease_owned(self._s, handle))

    def add(self, keys: npt.NDArray[np.uint64], pod: int, lease: Lease) -> int:
        """``pod`` holds ``keys`` under ``lease`` (new from :meth:`lease`; entries of earlier picks are taken
        over): returns the entries created."""
        keys = _contiguous(keys)
        n = int(lib.spec_add(self._s, ptr(keys), len(keys), pod, lease.handle))
        if n < 0:
            raise MemoryError("speculative entries: no memory to grow the table")
        return n

    def drop(self, keys: npt.NDArray[np.uint64], pod: int, lease: Lease) -> int:
        """Drop ``pod``'s entries of ``keys`` that ``lease`` still owns; returns how many."""
        keys = _contiguous(keys)
        return int(lib.spec_drop(self._s, ptr(keys), len(keys), pod, lease.handle))

    def drop_served(self, keys: npt.NDArray[np.uint64], pod: int) -> int:
        """Drop ``pod``'s entries of ``keys`` whose pick was served; returns how many."""
        keys = _contiguous(keys)
        return int(lib.spec_drop_served(self._s, ptr(keys), len(keys), pod))

    def drop_pod(self, pod: int) -> int:
        return int(lib.spec_drop_pod(self._s, pod))

    def match(self, sampled: npt.NDArray[np.uint64], positions: npt.NDArray[np.int64],
              pods: npt.NDArray[np.uint16], t: float) -> tuple[int, npt.NDArray[np.int64]]:
        """Per pod slot of ``pods`` (:data:`NO_POD`: none), the prefix (blocks) a live pick covers of a prompt
        whose keys at ``positions`` are ``sampled`` (0: none), and how many pods have one."""
        sampled, pods = _contiguous(sampled), np.ascontiguousarray(pods, dtype=np.uint16)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if len(positions) != len(sampled):
            raise ValueError(f"{len(sampled)} sampled keys for {len(positions)} positions")
        out = np.empty(len(pods), dtype=np.int64)
        hits = int(lib.spec_match(self._s, ptr(sampled), ptr(positions), len(sampled), ptr(pods), len(pods),
                                  t, ptr(out)))
        return hits, out

    def entries(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint16]]:
        """Every entry's key and pod slot."""
        n = self.stats()[0]
        keys, pods = np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint16)
        got = int(lib.spec_entries(self._s, ptr(keys), ptr(pods), n))
        return keys[:got], pods[:got]

    def stats(self) -> tuple[int, int]:
        """(entries, bytes held)."""
        out = np.empty(2, dtype=np.int64)
        lib.spec_stats(self._s, ptr(out))
        live, nbytes = out.tolist()
        return live, nbytes
