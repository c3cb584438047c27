"""The global block index: which pod holds which block key, in which tier.

Write path (KV events, per pod, in order): :meth:`BlockIndex.add`,
:meth:`BlockIndex.remove`, :meth:`BlockIndex.clear_pod`. Read path:
:meth:`BlockIndex.match` walks a request's chained block keys and returns, per
pod, the length of the longest prefix the pod holds and its tier-weighted
value. Because keys are chained, block ``i`` being present means the pod had the
whole prefix ``0..i`` when it stored it; the walk still stops at the first
missing block (a hole left by eviction breaks reuse in vLLM too).

Speculative entries (:meth:`add_speculative`) record the picker's own picks
until the pod's events confirm them or their TTL expires: without them, a burst
of same-prefix requests arriving before the first prefill's events would
scatter. They are not dropped when an event about the key arrives: an event
reports the pod's state when the prefill finished, while a later pick for the
same prefix (queued behind it) re-admits the blocks; dropping entries on
``BlockRemoved`` lowered the routing simulation's hit rate (``docs/epp.md``).
With events disabled they are the whole index (approximate mode).

Tiers are a bit mask per (key, pod): bit ``Tier.rank``; the best (fastest) tier
counts. All methods are thread-safe (one lock; the walk is short).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvfleet.cache.tiers import Tier

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


def spec_positions(n: int) -> Sequence[int]:
    """Block positions sampled for speculative entries of an ``n``-block prompt: the grid (absolute, so all
    prompts agree on it) below ``n``, and ``n − 1`` (so a repeated prompt is credited in full)."""
    if n <= SPEC_DENSE:
        return range(n)
    out = _GRID[: bisect.bisect_left(_GRID, n)]
    return out if out[-1] == n - 1 else [*out, n - 1]


def _best_rank(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class Lease:
    """The expiry of one pick's speculative entries, shared by all of them: extending it is O(1)."""

    __slots__ = ("expiry",)

    def __init__(self, expiry: float) -> None:
        self.expiry = expiry


@dataclass(frozen=True)
class PodMatch:
    """One pod's prefix hit: ``blocks`` matched from the start, ``weighted`` = Σ tier weight per block."""

    blocks: int = 0
    weighted: float = 0.0
    speculative: int = 0


class BlockIndex:
    """key → {pod: tier mask}; plus speculative picks with an expiry (see module doc)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._holders: dict[int, dict[str, int]] = {}
        self._pod_keys: dict[str, set[int]] = {}
        self._spec: dict[int, dict[str, Lease]] = {}
        self._lock = threading.Lock()

    # --- write path -------------------------------------------------------------------
    def add(self, pod: str, keys: Iterable[int], tier: Tier = Tier.GPU) -> None:
        bit = 1 << tier.rank
        with self._lock:
            owned = self._pod_keys.setdefault(pod, set())
            for k in keys:
                holders = self._holders.get(k)
                if holders is None:
                    self._holders[k] = {pod: bit}
                else:
                    holders[pod] = holders.get(pod, 0) | bit
                owned.add(k)

    def remove(self, pod: str, keys: Iterable[int], tier: Tier | None = Tier.GPU) -> None:
        """Drop ``keys`` of ``pod`` from ``tier`` (``None``: from every tier)."""
        clear = ~0 if tier is None else ~(1 << tier.rank)
        with self._lock:
            owned = self._pod_keys.get(pod)
            for k in keys:
                holders = self._holders.get(k)
                if holders is None or pod not in holders:
                    continue
                mask = holders[pod] & clear
                if mask:
                    holders[pod] = mask
                    continue
                del holders[pod]
                if not holders:
                    del self._holders[k]
                if owned is not None:
                    owned.discard(k)

    def clear_pod(self, pod: str) -> None:
        """Forget everything ``pod`` holds (AllBlocksCleared, resync, pod gone)."""
        with self._lock:
            for k in self._pod_keys.pop(pod, set()):
                holders = self._holders.get(k)
                if holders is not None:
                    holders.pop(pod, None)
                    if not holders:
                        del self._holders[k]
            for k in [k for k, s in self._spec.items() if pod in s]:
                del self._spec[k][pod]
                if not self._spec[k]:
                    del self._spec[k]

    def add_speculative(self, pod: str, keys: Sequence[int], ttl_s: float, now: float | None = None) -> Lease:
        """Record that ``pod`` will hold the prefix ``keys`` (until ``now + ttl_s``).

        Keys are chained, so holding block ``i`` implies blocks ``0..i``: only the
        positions of :func:`spec_positions` are stored (every block of the first
        ``SPEC_DENSE``, every ``SPEC_STRIDE``-th to ``SPEC_FAR``, then ``SPEC_RESOLUTION``
        points per doubling, and the last block) and :meth:`match` credits the prefix up
        to the last sampled key found. A 220 KB prompt (13.7 k blocks) costs about 370 entries
        (915 with a fixed stride). Returns the pick's :class:`Lease`: :meth:`extend` moves the expiry of
        every entry still held by this pick at once (a later pick of the same key takes the entry over).
        """
        lease = Lease((self.clock() if now is None else now) + ttl_s)
        spec = self._spec
        with self._lock:
            for i in spec_positions(len(keys)):
                held = spec.get(keys[i])
                if held is None:
                    spec[keys[i]] = {pod: lease}
                else:
                    held[pod] = lease
        return lease

    def extend(self, lease: Lease, ttl_s: float, now: float | None = None) -> None:
        """Set a pick's speculative entries to expire ``ttl_s`` from now."""
        lease.expiry = (self.clock() if now is None else now) + ttl_s

    def expire(self, now: float | None = None) -> int:
        """Drop expired speculative entries; returns how many."""
        t = self.clock() if now is None else now
        n = 0
        with self._lock:
            for k in list(self._spec):
                s = self._spec[k]
                for pod in [p for p, e in s.items() if e.expiry <= t]:
                    del s[pod]
                    n += 1
                if not s:
                    del self._spec[k]
        return n

    # --- read path --------------------------------------------------------------------
    def match(
        self,
        keys: Sequence[int],
        pods: Iterable[str],
        tier_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
        now: float | None = None,
    ) -> dict[str, PodMatch]:
        """Longest held prefix of ``keys`` for each of ``pods`` (pods without a hit are absent).

        A pod's match is the longer of its exact prefix (events; tier-weighted) and
        its speculative prefix (picks; GPU weight for the blocks beyond the exact part).
        """
        t = self.clock() if now is None else now
        w = list(tier_weights)
        blocks: dict[str, int] = {}
        weighted: dict[str, float] = {}
        spec_len: dict[str, int] = {}
        with self._lock:
            alive = set(pods)
            for k in keys:
                if not alive:
                    break
                holders = self._holders.get(k)
                if holders is None:
                    break
                gone: list[str] = []
                for pod in alive:
                    mask = holders.get(pod, 0)
                    if mask:
                        blocks[pod] = blocks.get(pod, 0) + 1
                        weighted[pod] = weighted.get(pod, 0.0) + w[_best_rank(mask)]
                    else:
                        gone.append(pod)
                for pod in gone:
                    alive.discard(pod)
            if self._spec:
                positions = spec_positions(len(keys))
                first = self._spec.get(keys[positions[0]]) if len(positions) else None
                for pod in set(pods):
                    held = None if first is None else first.get(pod)
                    if held is None or held.expiry <= t:
                        continue
                    # one pick stores a whole prefix, so "held at position i" is (nearly) monotone in i:
                    # binary search for the last sampled position the pod holds
                    lo, hi = 0, len(positions) - 1
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        spec = self._spec.get(keys[positions[mid]])
                        lease = None if spec is None else spec.get(pod)
                        if lease is not None and lease.expiry > t:
                            lo = mid
                        else:
                            hi = mid - 1
                    spec_len[pod] = positions[lo] + 1
        out = {p: PodMatch(blocks=b, weighted=weighted[p]) for p, b in blocks.items()}
        for pod, n in spec_len.items():
            exact = out.get(pod, PodMatch())
            if n > exact.blocks:
                out[pod] = PodMatch(blocks=n, weighted=exact.weighted + (n - exact.blocks) * w[0], speculative=n - exact.blocks)
        return out

    def pod_tiers(self, pod: str, key: int) -> set[Tier]:
        with self._lock:
            mask = self._holders.get(key, {}).get(pod, 0)
        return {t for t in Tier if mask & (1 << t.rank)}

    @property
    def num_keys(self) -> int:
        return len(self._holders)

    def num_pod_keys(self, pod: str) -> int:
        return len(self._pod_keys.get(pod, ()))

    @property
    def num_speculative(self) -> int:
        return sum(len(s) for s in self._spec.values())

    def pods(self) -> list[str]:
        with self._lock:
            return [p for p, keys in self._pod_keys.items() if keys]
