"""Will a cached prefix still be there when the request runs? Each pod's LRU stack distance, from the
picker's own picks.

The index says what a pod holds *now*. A request picked now is prefilled after the requests already queued
on the pod, and their prefills store blocks that push the least recently used ones out of a full cache. On
a busy pod the index then credits a prefix that will be gone by the time the request is scheduled: the
request pays the recompute *and* the queue it was sent to, the queue scorer under-estimates that queue
(the requests ahead are credited hits they will not get), and requests pile onto the pods that held a
popular prefix (``docs/epp.md``, "Will the prefix still be there").

The rule (LRU's, in distinct blocks): a prefix of ``p + 1`` blocks whose last block was last sent to the
pod ``d`` distinct blocks ago survives while ``d + p + 1 ≤ capacity``, the pod's cache in the picker's
blocks (``vllm:cache_config_info``). ``d`` counts the blocks of every pick sent to the pod since, the picks
still queued included — the blocks a re-referenced prefix brings back to the top do not push anything out,
so it is the *distinct* blocks that count, not the insertions (an insertion count does not predict
evictions: ``docs/epp.md``). A candidate whose held prefix fails the rule keeps the longest shorter prefix
that passes (every sampled position of the request is one), else none; a prefix the sketch has not seen
keeps what the index says.

One sketch per pod (:class:`ReuseTracker`), fed by every pick recorded in the index (this replica's and
its peers', :meth:`~kvfleet.epp.index.BlockIndex.add_speculative_sampled`): each sampled key of the pick
(:func:`~kvfleet.epp.speculative.spec_positions`) with the blocks it stands for. It lives in ``_reuse.c``:
a ring of the last ``2 · entries`` sends with a Fenwick tree over their weights and a key → slot map; when
the ring is full the ``entries`` newest live sends are kept and the rest forgotten (their keys then answer
"unknown"), so a pod's sketch is a fixed ``112 · entries`` bytes (``entries`` 4,096: 0.46 MB) and a send
costs O(log entries).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvfleet.cache.compiled import ptr
from kvfleet.epp.probe import lib
from kvfleet.epp.speculative import grid, spec_position_index, spec_positions
from kvfleet.epp.table import as_u64

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
lib.kv_reuse_words.argtypes = [_I64, _P]
lib.kv_reuse_words.restype = _I64
lib.kv_reuse_init.argtypes = [_P, _I64, _I64]
lib.kv_reuse_init.restype = None
lib.kv_reuse_touch.argtypes = [_P, _P, _P, _I64]
lib.kv_reuse_touch.restype = None
lib.kv_reuse_distance.argtypes = [_P, _P, _I64, _P]
lib.kv_reuse_distance.restype = None
lib.kv_reuse_fit.argtypes = [_P, _I64, _P, _P, _P]
lib.kv_reuse_fit.restype = None

_TOTAL, _DROPPED = 1, 5  # header words (_reuse.c)


def _weights(m: int, blocks: int = 0) -> list[int]:
    """The blocks each key of a pick sampled at :func:`spec_positions` (``m`` keys) of a ``blocks``-block
    prompt stands for. Positions are absolute, so the sample gives them but for the last key's, which is
    ``blocks − 1`` (at most ``grid()[m − 1]``, used when ``blocks`` is unknown or does not fit the sample)."""
    g = grid()
    out = [g[i] - (g[i - 1] if i else -1) for i in range(m)]
    if m > 1 and g[m - 2] < blocks - 1 <= g[m - 1]:
        out[-1] = blocks - 1 - g[m - 2]
    return out


class ReuseTracker:
    """One reuse-distance sketch per pod (created at its first pick; ``entries`` sends kept at a
    compaction; 0 disables the tracker: :meth:`fit` keeps every hit)."""

    def __init__(self, entries: int = 4096) -> None:
        self.entries = max(0, entries)
        self._ring = 2 * self.entries
        m = ctypes.c_int64()
        self._words = int(lib.kv_reuse_words(self._ring, ctypes.addressof(m))) if self.entries else 0
        self._pods: dict[str, npt.NDArray[np.int64]] = {}
        self._addrs: dict[str, int] = {}  # each pod's buffer, where C finds it
        self._plans: dict[tuple[int, int], tuple[npt.NDArray[np.int64], int]] = {}
        self._lock = threading.Lock()
        #: candidates whose held prefix :meth:`fit` shortened (the index's hit will be gone by the time the
        #: request runs)
        self.shortened = 0

    @property
    def memory_bytes(self) -> int:
        return 8 * self._words * len(self._pods)

    def forgotten(self) -> int:
        """Sends forgotten by the bound, over all pods."""
        with self._lock:
            return sum(int(b[_DROPPED]) for b in self._pods.values())

    def _plan(self, m: int, blocks: int) -> tuple[npt.NDArray[np.int64], int]:
        plan = self._plans.get((m, blocks))
        if plan is None:
            w = np.asarray(_weights(m, blocks), dtype=np.int64)
            plan = (w, ptr(w))
            if len(self._plans) < 4096:
                self._plans[m, blocks] = plan
        return plan

    def touch(self, pod: str, sampled: Sequence[int] | npt.NDArray[np.uint64], blocks: int = 0) -> None:
        """``pod`` was sent a pick of a ``blocks``-block prompt (0: unknown) whose keys at
        :func:`spec_positions` are ``sampled``."""
        if not self.entries or not len(sampled):
            return
        _, waddr = self._plan(len(sampled), blocks)  # the plan keeps its array alive
        keys = np.ascontiguousarray(as_u64(sampled))  # the compiled touch reads one buffer
        with self._lock:
            addr = self._addrs.get(pod)
            if addr is None:
                buf = self._pods[pod] = np.zeros(self._words, dtype=np.int64)
                addr = self._addrs[pod] = ptr(buf)
                lib.kv_reuse_init(addr, self._ring, self.entries)
            lib.kv_reuse_touch(addr, ptr(keys), waddr, len(keys))

    def distance(self, pod: str, keys: Sequence[int]) -> list[int]:
        """Blocks sent to ``pod`` since each key was last sent to it (−1: unknown)."""
        k = np.ascontiguousarray(as_u64(keys))
        out = np.full(len(k), -1, dtype=np.int64)
        with self._lock:
            buf = self._pods.get(pod)
            if buf is not None and len(k):
                lib.kv_reuse_distance(ptr(buf), ptr(k), len(k), ptr(out))
        return [int(x) for x in out]

    def live_blocks(self, pod: str) -> int:
        """Blocks the pod's sketch remembers sending (distinct, within its bound)."""
        buf = self._pods.get(pod)
        return 0 if buf is None else int(buf[_TOTAL])

    def forget(self, pod: str) -> None:
        """The pod's cache was cleared (or the pod is gone): nothing sent before is there any more."""
        with self._lock:
            self._pods.pop(pod, None)
            self._addrs.pop(pod, None)

    def fit(self, pods: Sequence[str], hits: Sequence[int], capacities: Sequence[int],
            keys: Sequence[int]) -> list[int]:
        """Per pod, the blocks of its held prefix (``hits``) still expected in its cache of ``capacities``
        blocks (0: unknown) when a request with ``keys`` runs there (the module's rule)."""
        out = list(hits)
        addrs = self._addrs
        if not addrs:
            return out
        todo = [j for j, h in enumerate(hits) if h > 0 and capacities[j] > 0 and pods[j] in addrs]
        if not todo:
            return out
        pos = spec_positions(len(keys))
        parr = spec_position_index(len(keys))
        kat = as_u64(keys)[parr]
        res = np.empty(len(todo), dtype=np.int64)
        with self._lock:  # a forgotten pod (0) keeps its hit
            cand = np.array([(addrs.get(pods[j], 0), hits[j], capacities[j], bisect.bisect_left(pos, hits[j]))
                             for j in todo], dtype=np.int64)
            lib.kv_reuse_fit(ptr(cand), len(todo), ptr(kat), ptr(parr), ptr(res))
        for j, r in zip(todo, res.tolist(), strict=True):
            if r < out[j]:
                out[j] = r
                self.shortened += 1
        return out
