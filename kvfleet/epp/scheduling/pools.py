"""Level 1: prefix shard → pool, by weighted rendezvous hashing with weights that follow capacity.

For the first ``K`` block keys of the prompt (the shard key ``s``), pool ``p``
ranks by ``w_p / −ln(u(s, p))`` with ``u`` a uniform hash in (0,1)
(weighted rendezvous / highest-random-weight hashing): each pool receives a
share of prefixes proportional to ``w_p``, the same prefix always maps to the
same pool, and removing a pool only moves that pool's prefixes.
The caller walks the ranking and spills to the next pool when one is saturated.

``w_p = pool.weight × capacity(p)`` (:func:`capacity`): the pods that compute
prompts — ``both`` and ``prefill`` pods; a pool with neither counts its decode
pods — times their GPU KV blocks when every pod of the ranked pools states them
(``Pod.kv_blocks``), else their number. Decode pods of a P/D pool add nothing:
the pool computes, and caches the prefixes of, its prompts on its prefill pods,
so those set how many prefixes it can take (a P/D shard of one prefill and one
decode pod weighs half a shard of two unified pods). Pods count whether ready or
not, so readiness flaps do not move prefixes. The pools the router ranks are
InferencePools (``weight`` from the pods file or ``kvfleet.io/weight``) and the
prefix shards of one (pod subsets, weight 1), so both follow capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from kvfleet.epp.datastore import Pool


def capacity(pool: Pool, by_blocks: bool = True) -> float:
    """The pool's prefix capacity (module doc); a pool whose pods are not known yet counts 1."""
    pods = [p for p in pool.pods if p.role != "decode"] or list(pool.pods)
    if not pods:
        return 1.0
    if by_blocks and all(p.kv_blocks for p in pods):
        return float(sum(p.kv_blocks or 0 for p in pods))
    return float(len(pods))


def weights(pools: Sequence[Pool]) -> list[float]:
    """``pool.weight × capacity`` of each pool, in KV blocks when every pod states them, else in pods."""
    by_blocks = all(p.kv_blocks for pool in pools for p in pool.pods)
    return [pool.weight * capacity(pool, by_blocks) for pool in pools]


def rendezvous_rank(shard_key: int, pools: Sequence[Pool]) -> list[Pool]:
    seed = shard_key & 0xFFFFFFFFFFFFFFFF

    def rank(pool: Pool, w: float) -> float:
        h = xxhash.xxh3_64_intdigest(pool.name.encode(), seed=seed)
        u = (h + 0.5) / 2.0**64
        return w / -math.log(u)

    keyed = sorted(zip(pools, weights(pools), strict=True), key=lambda pw: (-rank(*pw), pw[0].name))
    return [p for p, _ in keyed]
