"""Reference decisions of the picker, recorded once and replayed by ``test_reference_decisions.py``.

Two kinds, both deterministic:

- **picks**: the pod the EPP's :class:`~kvfleet.epp.router.Router` picks for every request of small cases of
  ``bench.routing`` (the workload family's generators, the Mooncake traces, CPU/SSD tiers), run through
  ``bench.routing.simulate`` with kvfleet's default knobs;
- **matches**: :meth:`~kvfleet.epp.index.BlockIndex.match` on random index states with holes, several tiers
  and prompts both under and over the verifying walk's budget (where the search's answer stands).

The data file (``data/reference_decisions.json``) was written by ``python -m tests.epp.reference_decisions
--write``: first from the numpy index search (commit 97c30ea), before the search moved to the compiled probe
loop (``kvfleet/epp/_probe.c``); the picks again when the reuse sketch (``kvfleet/epp/reuse.py``) began to cut
held prefixes that will not survive the queue, when the recompute-load scorer joined the default profile, and
when the hot-spot damping stopped counting the followers of a prefix still being computed that come slower
than their pod serves them while no copy elsewhere would be ready first (``plugins.followers``) and the
copy-value scorer joined the default profile, and when the recompute-load scorer's utilisation came to count
up to 0.8 instead of 0.5 (changes of decisions by design; the matches were unchanged).
Any change of a decision shows as a failed replay. Rewrite it only for a change that is meant to change
decisions, and say so in the commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from bench import _family as family
from bench.routing import (
    Knobs,
    Req,
    SimConfig,
    Workload,
    _requests,
    at_utilisation,
    make_policy,
    simulate,
    tiers_of,
)
from kvfleet.cache.tiers import Tier
from kvfleet.epp.index import BlockIndex

DATA = Path(__file__).parent / "data" / "reference_decisions.json"
REQUESTS = 300


def family_case(workload: str, scale: str, rho: float, gpu: int, seed: int, tiered: bool = False
                ) -> tuple[list[Req], SimConfig]:
    c = family.Case(workload, (scale, rho), SimConfig(pods=8, gpu_blocks=gpu, seed=seed), seed, REQUESTS)
    return family.requests(c), tiers_of(c.cluster) if tiered else c.cluster


def trace_case(trace: str, rho: float, gpu: int, tiered: bool = False) -> tuple[list[Req], SimConfig]:
    cfg = SimConfig(pods=8, gpu_blocks=gpu)
    w = at_utilisation(Workload(trace, 5 * REQUESTS, 0, 1.0), cfg, rho)
    return _requests(w), tiers_of(cfg) if tiered else cfg


#: name → (requests, cluster): every family generator, both trace files, tiers on two of them
CASES: dict[str, Any] = {
    "documents rho=0.95 gpu=250": lambda: family_case("documents", "ρ", 0.95, 250, 0),
    "documents rho*=0.5 gpu=250 tiered": lambda: family_case("documents", "ρ*", 0.5, 250, 1, tiered=True),
    "tenants rho*=0.8 gpu=1000": lambda: family_case("tenants", "ρ*", 0.8, 1000, 1),
    "sessions rho=0.8 gpu=250": lambda: family_case("sessions", "ρ", 0.8, 250, 2),
    "agents rho=0.95 gpu=250": lambda: family_case("agents", "ρ", 0.95, 250, 0),
    "agents rho=0.8 gpu=250 tiered": lambda: family_case("agents", "ρ", 0.8, 250, 1, tiered=True),
    "storm rho=0.8 gpu=1000": lambda: family_case("storm", "ρ", 0.8, 1000, 0),
    "conversation rho=0.8 gpu=1000": lambda: trace_case("conversation", 0.8, 1000),
    "synthetic rho=0.8 gpu=250 tiered": lambda: trace_case("synthetic", 0.8, 250, tiered=True),
}


def picks(name: str) -> dict[str, Any]:
    """The case's picks (one digit per request: pod 0–7) and hit rate."""
    reqs, cfg = CASES[name]()
    build = make_policy("kvfleet", Knobs())
    chosen: list[int] = []

    def make(c: SimConfig, pods: list[Any]) -> Any:
        pol = build(c, pods)
        route = pol.route

        def recorded(r: Req, now: float) -> int:
            i = route(r, now)
            chosen.append(i)
            return i

        pol.route = recorded  # type: ignore[method-assign]
        return pol

    res = simulate(reqs, cfg, make)
    return {"picks": "".join(map(str, chosen)), "hit_rate": round(res.hit_rate, 12)}


#: the index states: (seed, pods, distinct prefixes, prompt blocks); prompts over 1,024 probes use the search
STATES = ((1, 8, 12, 90), (2, 16, 20, 300), (3, 64, 40, 256), (4, 8, 6, 2000))
WEIGHTS = (1.0, 0.8, 0.35, 0.1)


def index_state(seed: int, pods: int, prefixes: int, blocks: int) -> tuple[BlockIndex, list[list[int]]]:
    """A random index: chained prefixes held by random pods to random depths in random tiers, then random
    removals (holes: a block gone while later ones of its chain stay)."""
    rng = random.Random(seed)
    idx = BlockIndex(clock=lambda: 0.0)
    chains = [[rng.getrandbits(64) - (1 << 63) for _ in range(blocks)] for _ in range(prefixes)]
    tiers = list(Tier)
    for chain in chains:
        for p in rng.sample(range(pods), rng.randint(1, pods)):
            depth = rng.randint(1, blocks)
            cut = rng.randint(0, depth)  # blocks [0, cut) in one tier, [cut, depth) in a lower one
            hi = rng.randrange(len(tiers))
            lo = min(len(tiers) - 1, hi + rng.randint(0, 2))
            idx.add(f"pod-{p}", chain[:cut], tiers[hi])
            idx.add(f"pod-{p}", chain[cut:depth], tiers[lo])
            if rng.random() < 0.3:
                idx.add(f"pod-{p}", chain[: rng.randint(0, depth)], tiers[0])  # held in two tiers
            if rng.random() < 0.25:  # holes
                gone = rng.sample(range(depth), max(1, depth // 20))
                idx.remove(f"pod-{p}", [chain[i] for i in gone], None)
    return idx, chains


def matches(seed: int, pods: int, prefixes: int, blocks: int) -> list[list[Any]]:
    """Every pod's match for each chain (whole, and a random prefix of it), as sorted rows."""
    idx, chains = index_state(seed, pods, prefixes, blocks)
    rng = random.Random(seed + 1000)
    names = [f"pod-{p}" for p in range(pods)]
    out: list[list[Any]] = []
    for chain in chains:
        for keys in (chain, chain[: rng.randint(1, len(chain))]):
            got = idx.match(keys, names, WEIGHTS)
            out.append(sorted([p, m.blocks, round(m.weighted, 9)] for p, m in got.items()))
    return out


def record() -> dict[str, Any]:
    return {
        "picks": {name: picks(name) for name in CASES},
        "matches": {",".join(map(str, s)): matches(*s) for s in STATES},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {DATA.name} (else print its digest)")
    args = ap.parse_args(argv)
    data = record()
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if args.write:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(text)
    print(hashlib.sha256(text.encode()).hexdigest())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
