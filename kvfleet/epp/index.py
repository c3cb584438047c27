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
scatter. With events disabled they are the whole index (approximate mode).

Tiers are a bit mask per (key, pod): bit ``Tier.rank``; the best (fastest) tier
counts. All methods are thread-safe (one lock; the walk is short).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvfleet.cache.tiers import Tier

_RANKS = [t.rank for t in Tier]
_SPEC_BIT = 1 << 7


def _best_rank(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


@dataclass(frozen=True)
class PodMatch:
    """One pod's prefix hit: ``blocks`` matched from the start, ``weighted`` = Σ tier weight per block."""

    blocks: int = 0
    weighted: float = 0.0
    speculative: int = 0


class BlockIndex:
    """key → {pod: tier mask}; plus speculative picks with an expiry (see module doc)."""

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, int]] = {}
        self._pod_keys: dict[str, set[int]] = {}
        self._spec: dict[int, dict[str, float]] = {}
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
                spec = self._spec.get(k)
                if spec is not None and spec.pop(pod, None) is not None and not spec:
                    del self._spec[k]

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

    def add_speculative(self, pod: str, keys: Sequence[int], ttl_s: float, now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + ttl_s
        with self._lock:
            for k in keys:
                holders = self._holders.get(k)
                if holders is not None and pod in holders:
                    continue
                self._spec.setdefault(k, {})[pod] = expiry

    def expire(self, now: float | None = None) -> int:
        """Drop expired speculative entries; returns how many."""
        t = time.monotonic() if now is None else now
        n = 0
        with self._lock:
            for k in list(self._spec):
                s = self._spec[k]
                for pod in [p for p, e in s.items() if e <= t]:
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
        """Longest held prefix of ``keys`` for each of ``pods`` (pods without a hit are absent)."""
        t = time.monotonic() if now is None else now
        alive = set(pods)
        blocks: dict[str, int] = {}
        weighted: dict[str, float] = {}
        spec_n: dict[str, int] = {}
        w = list(tier_weights)
        with self._lock:
            for k in keys:
                if not alive:
                    break
                holders = self._holders.get(k)
                spec = self._spec.get(k)
                gone: list[str] = []
                for pod in alive:
                    mask = holders.get(pod, 0) if holders is not None else 0
                    if mask:
                        blocks[pod] = blocks.get(pod, 0) + 1
                        weighted[pod] = weighted.get(pod, 0.0) + w[_best_rank(mask)]
                    elif spec is not None and spec.get(pod, 0.0) > t:
                        blocks[pod] = blocks.get(pod, 0) + 1
                        weighted[pod] = weighted.get(pod, 0.0) + w[0]
                        spec_n[pod] = spec_n.get(pod, 0) + 1
                    else:
                        gone.append(pod)
                for pod in gone:
                    alive.discard(pod)
        return {p: PodMatch(blocks=b, weighted=weighted[p], speculative=spec_n.get(p, 0)) for p, b in blocks.items()}

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
