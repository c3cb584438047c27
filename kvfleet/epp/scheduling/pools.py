"""Level 1: prefix shard → pool, by weighted rendezvous hashing.

For the first ``K`` block keys of the prompt (the shard key ``s``), pool ``p``
ranks by ``weight_p / −ln(u(s, p))`` with ``u`` a uniform hash in (0,1)
(weighted rendezvous / highest-random-weight hashing): each pool receives a
share of prefixes proportional to its capacity weight, the same prefix always
maps to the same pool, and removing a pool only moves that pool's prefixes.
The caller walks the ranking and spills to the next pool when one is saturated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from kvfleet.epp.datastore import Pool


def rendezvous_rank(shard_key: int, pools: Sequence[Pool]) -> list[Pool]:
    def weight(pool: Pool) -> float:
        h = xxhash.xxh3_64_intdigest(pool.name.encode(), seed=shard_key & 0xFFFFFFFFFFFFFFFF)
        u = (h + 0.5) / 2.0**64
        return pool.weight / -math.log(u)

    return sorted(pools, key=lambda p: (-weight(p), p.name))
