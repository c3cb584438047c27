"""Detects a pool whose engines key KV blocks differently from what the pool declares.

The picker keys a prompt with the pool's block size, hash algorithm and seed
(:class:`~kvfleet.epp.datastore.PoolCache`). If the engines use other ones (an engine started
with ``--block-size 64`` in a pool that declares 16, another hash or seed), the index never
matches their events and every hit looks like a miss: routing silently loses its prefix
affinity. The signature is in the responses: the engine reports cached tokens
(``usage.prompt_tokens_details.cached_tokens``) well above what the picker predicted. Per pool,
over the last ``window`` responses that report a hit of at least two blocks, :class:`KeyCheck`
counts those under-predicted by more than one block; with at least ``min_hits`` such responses
and a share of at least ``threshold`` the pool is flagged (a log line and the gauge
``kvfleet_epp_pool_key_mismatch{pool}``), and cleared when the share falls back.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class KeyCheck:
    def __init__(
        self, window: int = 64, min_hits: int = 16, threshold: float = 0.5,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.window, self.min_hits, self.threshold = window, min_hits, threshold
        self.on_change = on_change
        self._seen: dict[str, deque[bool]] = {}
        self._flagged: set[str] = set()
        self._lock = threading.Lock()

    def observe(self, pool: str, predicted: int, reported: int, block_size: int) -> None:
        """One response of ``pool``: the picker's predicted and the engine's reported cached tokens."""
        if reported < 2 * block_size:
            return
        with self._lock:
            seen = self._seen.setdefault(pool, deque(maxlen=self.window))
            seen.append(reported > predicted + block_size)
            under = sum(seen)
            flag = len(seen) >= self.min_hits and under >= self.threshold * len(seen)
            changed = flag != (pool in self._flagged)
            if changed:
                (self._flagged.add if flag else self._flagged.discard)(pool)
        if not changed:
            return
        if flag:
            log.warning(
                "pool %s: engines report cached tokens the index never predicted (%d of the last %d hits): "
                "its engines key blocks differently from the pool's declared block size / hash algorithm "
                "/ seed", pool, under, len(seen),
            )
        else:
            log.info("pool %s: predicted and reported cached tokens agree again", pool)
        if self.on_change is not None:
            self.on_change(pool, flag)

    def forget(self, pool: str) -> None:
        with self._lock:
            self._seen.pop(pool, None)
            was = pool in self._flagged
            self._flagged.discard(pool)
        if was and self.on_change is not None:
            self.on_change(pool, False)

    def flagged(self) -> set[str]:
        with self._lock:
            return set(self._flagged)
