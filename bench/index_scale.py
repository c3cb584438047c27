"""bench.index_scale — the EPP's block index at fleet scale: 10 M (block, pod) entries over 256 pods.

The index (:class:`kvfleet.epp.index.BlockIndex`) is filled in-process the way KV events fill it (chains of
chained block keys, each chain stored by one to four pods, added one stored batch at a time), then
queried the way a pick queries it: a 4k-token prompt (256 blocks) that shares a random prefix of a stored
chain, matched against every one of the 256 pods (the worst case: no pool or shard narrows the
candidates). Printed: the add rate (blocks per second through ``BlockIndex.add``, the index's side of KV
ingestion; ``bench.epp``'s warm run measures the whole path from the socket), the index's own bytes per
entry and the process's RSS growth per entry, and the lookup's p50/p99 latency with a dict-of-sets scan of
the same entries measured in the same run as the baseline (``lookup_vs_dict_scan``). Last line: one JSON
object (``index_lookup_p99_ms_10m_256pods``, ``index_bytes_per_entry``, ``index_add_blocks_per_s``, ...).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from kvfleet.epp.index import BlockIndex

BLOCKS = 256  # a 4k-token prompt at 16 tokens per block


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def build(entries: int, pods: int, seed: int) -> tuple[BlockIndex, np.ndarray, list[list[str]], float, float]:
    """The filled index, its chains (rows of keys), the pods of each chain, the add time and RSS growth."""
    rng = np.random.default_rng(seed)
    holders = rng.integers(1, 5, size=entries // BLOCKS + 1)
    n_chains = int(np.searchsorted(np.cumsum(holders * BLOCKS), entries)) + 1
    chains = rng.integers(1, 2**63, size=(n_chains, BLOCKS), dtype=np.uint64)
    names = [f"pod-{i}" for i in range(pods)]
    owners = [[names[int(p)] for p in rng.choice(pods, int(holders[c]), replace=False)]
              for c in range(n_chains)]
    index = BlockIndex()
    r0 = rss_mb()
    t0 = time.perf_counter()
    for c in range(n_chains):
        keys = chains[c].tolist()
        for pod in owners[c]:
            index.add(pod, keys)
    return index, chains, owners, time.perf_counter() - t0, rss_mb() - r0


def run(entries: int = 10_000_000, pods: int = 256, queries: int = 2000, seed: int = 11) -> dict[str, float]:
    index, chains, owners, add_s, rss = build(entries, pods, seed)
    n = index.num_entries
    names = [f"pod-{i}" for i in range(pods)]
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, len(chains), size=queries)
    cuts = rng.integers(1, BLOCKS + 1, size=queries)
    tails = rng.integers(1, 2**63, size=(queries, BLOCKS), dtype=np.uint64)
    bodies = []
    for q in range(queries):  # a stored prefix, then blocks no pod holds
        row = np.concatenate([chains[picks[q], : cuts[q]], tails[q, cuts[q]:]])
        bodies.append(row.tolist())
    for b in bodies[:50]:
        index.match(b, names)
    lat = np.empty(queries)
    for q, keys in enumerate(bodies):
        t = time.perf_counter()
        found = index.match(keys, names)
        lat[q] = time.perf_counter() - t
        best = max((m.blocks for m in found.values()), default=0)
        assert best >= cuts[q], (q, best, cuts[q])  # the stored prefix is found
    # baseline: the same entries as one dict of sets (key -> pods), a prompt scanned block by block
    sample = min(len(chains), 4000)
    table: dict[int, set[int]] = {}
    for c in range(sample):
        ps = {int(p.split("-")[1]) for p in owners[c]}
        for k in chains[c].tolist():
            table.setdefault(k, set()).update(ps)
    base = np.empty(min(queries, 500))
    for q in range(len(base)):
        c = int(picks[q]) % sample
        keys = chains[c].tolist()
        t = time.perf_counter()
        alive = set(range(pods))
        for k in keys:
            alive &= table.get(k, set())
            if not alive:
                break
        base[q] = time.perf_counter() - t
    p50, p99 = float(np.percentile(lat, 50) * 1e3), float(np.percentile(lat, 99) * 1e3)
    print(f"index: {n:,} entries over {pods} pods added in {add_s:.1f} s ({n / add_s:,.0f} blocks/s); "
          f"{index.nbytes / n:.1f} B/entry in the table, RSS +{rss * 2**20 / n:.1f} B/entry")
    print(f"lookup of a 4k-token prompt against all {pods} pods: p50 {p50:.3f} ms, p99 {p99:.3f} ms "
          f"(dict-of-sets scan of a stored chain: p50 {np.percentile(base, 50) * 1e3:.3f} ms)")
    return {
        "index_entries": n, "index_pods": pods,
        "index_add_blocks_per_s": round(n / add_s),
        "index_bytes_per_entry_10m": round(index.nbytes / n, 2),
        "index_rss_bytes_per_entry_10m": round(rss * 2**20 / n, 2),
        "index_lookup_p50_ms_10m_256pods": round(p50, 3),
        "index_lookup_p99_ms_10m_256pods": round(p99, 3),
        "dict_scan_p50_ms": round(float(np.percentile(base, 50) * 1e3), 3),
        "lookup_vs_dict_scan": round(float(np.percentile(lat, 50) / np.percentile(base, 50)), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.index_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 lookups, not 2,000 (still 10 M entries)")
    ap.add_argument("--entries", type=int, default=10_000_000)
    ap.add_argument("--pods", type=int, default=256)
    args = ap.parse_args(argv)
    out = {"bench": "index_scale", **run(args.entries, args.pods, 500 if args.quick else 2000)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
