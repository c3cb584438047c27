"""Exponential back-off with full jitter between retries of a transfer.

The ``k``-th retry on the same backend waits a delay drawn uniformly from
``[0, min(cap, base · 2^(k-1))]`` ("full jitter"): many receivers that lost
the same sender do not come back in lock step, and a dead peer costs at most
:meth:`Backoff.bound` of waiting on top of its failed attempts. A failover to
another backend (shm → tcp) goes at once: a different data path is not the
overloaded one.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays of a transfer's retries; ``rng`` is injectable for deterministic tests."""

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if base_s < 0 or cap_s < 0:
            raise ValueError(f"back-off base and cap must be >= 0, got {base_s}, {cap_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self.rng = rng or random.Random()

    def ceiling(self, attempt: int) -> float:
        """The largest delay before the ``attempt``-th retry (1-based)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(max(attempt - 1, 0), 62))

    def delay(self, attempt: int) -> float:
        """A delay drawn for the ``attempt``-th retry: uniform in ``[0, ceiling(attempt)]``."""
        return self.rng.uniform(0.0, self.ceiling(attempt))

    def bound(self, retries: int) -> float:
        """The most ``retries`` retries can wait in total."""
        return sum(self.ceiling(k) for k in range(1, retries + 1))
