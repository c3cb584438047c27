"""bench.cache_core: replay a Mooncake trace through the radix tree + block pool.

For every request, in arrival order: ``match_prefix`` (hits), lock the matched
path, evict least-recently-used leaves until the uncached suffix fits, allocate
its blocks, ``insert`` (which computes the new blocks' chained hashes, what KV
events carry). Capacity is ``--capacity`` 16-token blocks (default chosen so
eviction happens). Measured in the same run:

- ``blocks_per_s``: full blocks processed (matched + inserted) per second of
  cache work (token synthesis is excluded from both sides);
- ``hit_rate``: matched blocks / full blocks, and ``reference_hit_rate``: a plain
  LRU over block hashes (``OrderedDict``, prefix hits only, tail blocks of a
  request least recent) at the same capacity; they must agree within 1 %;
- ``baseline_blocks_per_s``: that reference LRU, which works once per block in
  Python (the way vLLM's block pool does) — the naive baseline;
- ``bytes_per_block`` / ``baseline_bytes_per_block``: traced memory of each
  structure per indexed block (tracemalloc, on a replay prefix without eviction).

Last line: one JSON object, ``{"bench": "cache_core", ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from collections import OrderedDict
from typing import Any

import numpy as np

from bench import _traces as traces
from kvfleet.cache.blocks import BlockPool
from kvfleet.cache.hashing import BlockHasher
from kvfleet.cache.radix import RadixTree

BLOCK = 16


def replay_tree(reqs: list[traces.Request], capacity: int, hasher: BlockHasher) -> dict[str, Any]:
    tree = RadixTree(block_size=BLOCK, hasher=hasher)
    pool = BlockPool(capacity)
    hit = total = 0
    busy = 0.0
    for chunk in traces.chunks(reqs):
        t0 = time.perf_counter()
        for toks in chunk:
            n = len(toks) // BLOCK
            m = tree.match_prefix(toks)
            h = m.num_blocks
            need = n - h
            if need > capacity:
                continue  # larger than the whole cache: not cacheable
            if need > pool.num_free:
                with tree.lock(m.node):
                    freed = tree.evict(need - pool.num_free)
                pool.free(np.concatenate([e.block_ids for e in freed]))
            if need > pool.num_free:
                continue
            ids = pool.allocate(need)
            tree.insert(toks, np.concatenate((m.block_ids, ids)))
            hit += h
            total += n
        busy += time.perf_counter() - t0
    return {"blocks": total, "hits": hit, "seconds": busy, "tree_blocks": tree.total_blocks,
            "nodes": tree.num_nodes}


def replay_lru(reqs: list[traces.Request], capacity: int, hasher: BlockHasher) -> dict[str, Any]:
    """Plain LRU over block hashes: one Python dict operation per block."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    busy = 0.0
    for chunk in traces.chunks(reqs):
        t0 = time.perf_counter()
        for toks in chunk:
            hashes: list[int] = hasher.hash_tokens(toks).tolist()
            n = len(hashes)
            if n > capacity:
                continue
            h = 0
            for x in hashes:
                if x not in lru:
                    break
                h += 1
            for x in reversed(hashes):  # tail first: the head ends most recent
                lru[x] = None
                lru.move_to_end(x)
            while len(lru) > capacity:
                lru.popitem(last=False)
            hit += h
            total += n
        busy += time.perf_counter() - t0
    return {"blocks": total, "hits": hit, "seconds": busy}


def traced_bytes_per_block(reqs: list[traces.Request], hasher: BlockHasher, which: str) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    blocks = 0
    keep: Any
    if which == "tree":
        tree = RadixTree(block_size=BLOCK, hasher=hasher)
        for r in reqs:
            toks = traces.tokens(r)
            tree.insert(toks, np.arange(len(toks) // BLOCK, dtype=np.int64))
        blocks, keep = tree.total_blocks, tree
    else:
        lru: OrderedDict[int, None] = OrderedDict()
        for r in reqs:
            for x in reversed(hasher.hash_tokens(traces.tokens(r)).tolist()):
                lru[x] = None
                lru.move_to_end(x)
        blocks, keep = len(lru), lru
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del keep
    return used / max(blocks, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cache_core", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first 3,000 requests (< 60 s on 2 cores)")
    ap.add_argument("--trace", default="conversation",
                    help="conversation | synthetic | path to a JSONL trace")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--capacity", type=int, default=None, help="cache capacity in 16-token blocks")
    ap.add_argument("--algo", default="xxh3_64", help="block hash algorithm (xxh3_64 | sha256_cbor)")
    args = ap.parse_args(argv)
    limit = args.requests or (3000 if args.quick else None)
    reqs = traces.load(args.trace, limit)
    capacity = args.capacity or (200_000 if args.quick else 1_000_000)
    hasher = BlockHasher(block_size=BLOCK, algo=args.algo)
    print(f"cache_core: {len(reqs)} requests of {args.trace}, capacity {capacity} blocks of {BLOCK} tokens",
          file=sys.stderr)
    tree = replay_tree(reqs, capacity, hasher)
    print(f"  radix tree + pool: {tree['blocks'] / tree['seconds'] / 1e6:.2f} M blocks/s, "
          f"hit {tree['hits'] / tree['blocks']:.4f}", file=sys.stderr)
    lru = replay_lru(reqs, capacity, hasher)
    print(f"  reference LRU:     {lru['blocks'] / lru['seconds'] / 1e6:.2f} M blocks/s, "
          f"hit {lru['hits'] / lru['blocks']:.4f}", file=sys.stderr)
    mem_reqs = reqs[: min(len(reqs), 1500)]
    bpb = traced_bytes_per_block(mem_reqs, hasher, "tree")
    base_bpb = traced_bytes_per_block(mem_reqs, hasher, "lru")
    print(f"  bytes/indexed block: tree {bpb:.1f}, reference LRU {base_bpb:.1f}", file=sys.stderr)
    hit_rate = tree["hits"] / tree["blocks"]
    ref = lru["hits"] / lru["blocks"]
    result = {
        "bench": "cache_core",
        "trace": args.trace,
        "requests": len(reqs),
        "capacity_blocks": capacity,
        "hash_algo": args.algo,
        "blocks_per_s": round(tree["blocks"] / tree["seconds"]),
        "baseline_blocks_per_s": round(lru["blocks"] / lru["seconds"]),
        "speedup": round((tree["blocks"] / tree["seconds"]) / (lru["blocks"] / lru["seconds"]), 2),
        "hit_rate": round(hit_rate, 5),
        "reference_hit_rate": round(ref, 5),
        "hit_rate_delta": round(abs(hit_rate - ref), 5),
        "bytes_per_block": round(bpb, 1),
        "baseline_bytes_per_block": round(base_bpb, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
