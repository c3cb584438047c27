"""The picker's speculative index entries: which block positions of a picked prompt are recorded
(:func:`spec_positions`) and the :class:`Lease` that all the entries of one pick share.
:class:`~kvfleet.epp.index.BlockIndex` keeps the entries.

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
oldest picks, counted in :attr:`~kvfleet.epp.index.BlockIndex.speculative_dropped`. Speculative
entries have their own lock (picks are written by the router's thread, events by
the ingestion thread)."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

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


class Lease:
    """The expiry of one pick's speculative entries, shared by all of them: extending it is O(1).
    ``owned``: how many entries still name this lease (a later pick of the same key takes an entry over);
    ``served``: the pick's first token came back (:meth:`BlockIndex.extend`), so the pod's events are now
    newer than the pick."""

    __slots__ = ("expiry", "owned", "served")

    def __init__(self, expiry: float) -> None:
        self.expiry = expiry
        self.owned = 0
        self.served = False
