"""bench.soak: RSS of every process through floods of distinct prompts, flood after flood.

The stack of ``bench.chaos`` without its faults: four simulated engines, two EPP replicas gossiping, Envoy
in front; four clients stream chat requests that share a few long system prompts the whole time. Then
``--floods`` floods of ``--prompts`` distinct 4k-token prompts each (20 × 1,000 = 20,000 by default;
``--quick`` 5 × 400). After each flood: ``SETTLE_S`` of steady load (past the speculative TTL and the heap
trim), then a wait until every replica's KV-event ingestion has caught up
(``kvfleet_epp_kv_event_lag_seconds`` ≤ 1 s on every pod; how long that took is ``catch_up_s``), then every
process's RSS: the least of its readings over ``RSS_WINDOW_S`` (longer than the heap trim interval).

Warm-up is the first floods, until every engine's KV-event replay buffer is full (a bounded buffer filling
is not growth; ``warm_floods``). Measured: ``epp_rss_growth`` and ``engine_rss_growth`` — the largest
growth of any replica / engine from the end of warm-up to the last flood, as a fraction — and the RSS after
every flood (``rss``), with ``max_kv_event_lag_s`` (the largest lag seen while waiting). The baseline for
the growth is the figure in the same run before the floods that follow.

Last line: ``{"bench": "soak", "prompts", "epp_rss_growth", "engine_rss_growth", "rss", ...}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chaos import REPLAY_FULL, SETTLE_S, Run, Stack, SteadyLoad, caught_up, kept_rss, replay_fill
from kvfleet.demo.stack import ProcessStack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 floods of 400 prompts (about 5 minutes)")
    ap.add_argument("--floods", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=1000, help="distinct 4k-token prompts per flood")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--plot", default=None, help="write RSS per flood of every process to this PNG")
    args = ap.parse_args(argv)
    floods, per_flood = (5, 400) if args.quick else (args.floods, args.prompts)
    rng = random.Random(args.seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache"]
    prompts = [f"System prompt {k}: " + " ".join(rng.choice(words) for _ in range(700)) for k in range(6)]
    rows: list[dict[str, Any]] = []
    warm = 0
    with tempfile.TemporaryDirectory(prefix="kvfleet-soak-") as tmp, ProcessStack(Path(tmp)) as ps:
        st = Stack(ps, gpu_blocks=4096)
        print("starting 4 engines, 2 EPP replicas, Envoy ...", file=sys.stderr, flush=True)
        st.start()
        run = Run()
        load = SteadyLoad(f"http://127.0.0.1:{st.gateway_port}", run, prompts, args.clients)
        for k in range(floods):
            t0 = time.monotonic()
            failed = load.flood(per_flood, rng)
            took = time.monotonic() - t0
            time.sleep(SETTLE_S)
            catch_up, lag = caught_up(st, f"flood {k + 1}")
            epp, engines = kept_rss(st)
            fill = replay_fill(st)
            if warm == 0 and fill >= REPLAY_FULL:
                warm = k + 1
            row = {"flood": k + 1, "prompts": (k + 1) * per_flood, "flood_s": round(took, 1),
                   "failed": failed,
                   "catch_up_s": catch_up, "max_lag_s": lag, "replay_fill": round(fill, 2),
                   "epp": [round(x, 1) for x in epp], "engines": [round(x, 1) for x in engines.values()]}
            rows.append(row)
            print(f"flood {k + 1}/{floods}: {per_flood} prompts in {took:.0f} s ({failed} failed), caught up "
                  f"in {catch_up:.0f} s (lag up to {lag:.0f} s); RSS MB: EPP {row['epp']}, engines "
                  f"{row['engines']}", file=sys.stderr, flush=True)
        load.stop()

    def growth(key: str) -> float:
        if not warm or warm >= len(rows):
            return float("nan")
        base, last = rows[warm - 1][key], rows[-1][key]
        return round(float(max((b2 - b1) / b1 for b1, b2 in zip(base, last, strict=True))), 3)

    steady_failed = sum(1 for r in run.records if not r.ok)
    result = {
        "bench": "soak", "quick": args.quick, "prompts": floods * per_flood, "floods": floods,
        "warm_floods": warm, "epp_rss_growth": growth("epp"), "engine_rss_growth": growth("engines"),
        "max_kv_event_lag_s": max(r["max_lag_s"] for r in rows),
        "flood_failed": sum(r["failed"] for r in rows), "steady_requests": len(run.records),
        "steady_failed": steady_failed, "rss": rows,
    }
    print(f"{floods * per_flood} distinct prompts: EPP RSS growth {result['epp_rss_growth']}, engine RSS "
          f"growth {result['engine_rss_growth']} (after {warm} warm-up floods); KV-event lag up to "
          f"{result['max_kv_event_lag_s']} s")
    if args.plot:
        plot(rows, warm, args.plot)
    print(json.dumps(result))
    return 0


def plot(rows: list[dict[str, Any]], warm: int, path: str) -> None:
    """RSS after each flood, one line per process, the end of warm-up marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = [r["prompts"] for r in rows]
    for i in range(len(rows[0]["epp"])):
        ax.plot(x, [r["epp"][i] for r in rows], marker="o", label=f"EPP replica {i}")
    for i in range(len(rows[0]["engines"])):
        ax.plot(x, [r["engines"][i] for r in rows], linestyle="--", label=f"engine {i}")
    ax.set_ylim(bottom=0)
    if warm:
        ax.axvline(rows[warm - 1]["prompts"], color="grey", linewidth=0.8)
        ax.annotate(" end of warm-up", (rows[warm - 1]["prompts"], 5), color="grey")
    ax.set_xlabel("distinct 4k-token prompts sent")
    ax.set_ylabel("RSS (MB, floor over 11 s, caught up)")
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("bench.soak: RSS flood after flood")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
