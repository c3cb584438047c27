"""Workloads the demo replays: a slice of a Mooncake-format trace, or a synthetic multi-tenant one.

Trace rows are ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``
with one hash id per 512-token block, prefix-chained (an id stands for its whole
prefix). A row becomes token ids by giving id ``h`` the block
``h·512 + k`` for ``k`` in ``0..511`` (ids never coincide across hash ids), cut to
``input_length``. So equal hash-id prefixes give equal token prefixes and the
trace's sharing is preserved exactly. Arrival times are the trace's, scaled by
``time_scale`` (the engines' time factor: the trace runs at its real rate in
modelled time).

Each item names its prompt group (``WorkItem.group``): the trace row's first two
hash ids (its first 1,024 tokens: the conversation), or the synthetic tenant.
:func:`workload_warnings` says when a workload cannot tell routing policies
apart (a single group: prefix routing then equals affinity).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

TRACE_BLOCK = 512


class WorkloadError(ValueError):
    """The trace file is missing or a row is malformed (the message names the line)."""


@dataclass(frozen=True)
class WorkItem:
    """One request to replay: when (seconds from start), which tokens, how many to generate."""

    at: float
    prompt: tuple[int, ...]
    max_tokens: int
    tenant: str = ""
    #: the prompt group (module doc): requests of one group share their opening tokens
    group: str = ""


def default_trace() -> Path:
    """The Mooncake conversation trace shipped in the package."""
    return Path(str(resources.files("kvfleet") / "data" / "traces" / "conversation_trace.jsonl"))


def _rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    try:
        fh = path.open()
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{path}:{n}: expected an object")
            yield n, row


def trace_tokens(hash_ids: list[int], input_length: int, block: int = TRACE_BLOCK) -> tuple[int, ...]:
    """Token ids of a trace row (see the module doc)."""
    out: list[int] = []
    for h in hash_ids:
        base = h * block
        out.extend(range(base, base + block))
    return tuple(out[: max(1, min(input_length, len(out)))])


def load_trace(
    path: Path,
    *,
    start: int = 0,
    count: int = 150,
    time_scale: float = 1.0,
    max_tokens: int = 32,
    speedup: float = 1.0,
    sessions: bool = False,
    min_turns: int = 3,
) -> list[WorkItem]:
    """``count`` rows from row ``start``; arrivals relative to the first, ÷ ``speedup`` × ``time_scale``.

    ``sessions``: instead of a contiguous slice (whose few minutes hold little
    reuse: conversations return minutes later), take whole conversations —
    rows grouped by their first two hash ids, groups with at least
    ``min_turns`` rows, in order of first appearance from row ``start`` — until
    ``count`` rows, kept in trace order. ``speedup`` then compresses the hour
    they span.
    """
    rows = list(_rows(path))[start:]
    if sessions:
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (_, row) in enumerate(rows):
            ids = row.get("hash_ids")
            key = tuple(ids[:2]) if isinstance(ids, list) else (i,)
            groups.setdefault(key, []).append(i)
        chosen: list[int] = []
        for members in groups.values():
            if len(members) >= min_turns and len(chosen) < count:
                chosen.extend(members[: count - len(chosen)])
        rows = [rows[i] for i in sorted(chosen)]
    items: list[WorkItem] = []
    t0: float | None = None
    for n, row in rows:
        if len(items) >= count:
            break
        try:
            ts = float(row["timestamp"])  # type: ignore[arg-type]
            ids = [int(h) for h in row["hash_ids"]]  # type: ignore[attr-defined]
            length = int(row["input_length"])  # type: ignore[call-overload]
            out = int(row["output_length"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(
                f"{path}:{n}: needs timestamp, hash_ids, input_length, output_length ({exc})") from None
        if not ids or length <= 0:
            raise WorkloadError(f"{path}:{n}: empty hash_ids or input_length")
        t0 = ts if t0 is None else t0
        at = (ts - t0) / 1000.0 / speedup * time_scale
        group = "-".join(str(h) for h in ids[:2])
        items.append(WorkItem(at, trace_tokens(ids, length), max(1, min(out, max_tokens)), group=group))
    if not items:
        raise WorkloadError(f"{path}: no rows from row {start}")
    return items


def synthetic(
    *, count: int = 150, tenants: int = 8, system_tokens: int = 2048, user_tokens: int = 512,
    rate: float = 4.0, time_scale: float = 1.0, max_tokens: int = 32, seed: int = 7,
) -> list[WorkItem]:
    """Multi-tenant shared-system-prompt workload: each tenant's requests share its system prompt.

    Poisson arrivals at ``rate`` requests per modelled second; tenants drawn
    Zipf-like (tenant ``i`` with weight ``1/(i+1)``).
    """
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(tenants)]
    t = 0.0
    items: list[WorkItem] = []
    for r in range(count):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(tenants), weights)[0]
        system = range(10_000_000 + tenant * system_tokens, 10_000_000 + (tenant + 1) * system_tokens)
        user = range(50_000_000 + r * user_tokens, 50_000_000 + (r + 1) * user_tokens)
        items.append(WorkItem(t * time_scale, (*system, *user), max_tokens, tenant=f"tenant-{tenant}",
                              group=f"tenant-{tenant}"))
    return items


def workload_warnings(items: list[WorkItem]) -> list[str]:
    """What makes the workload unfit to compare routing policies (empty when nothing does)."""
    groups = {i.group for i in items}
    if len(items) > 1 and len(groups) == 1:
        return [
            f"the replayed slice holds a single prompt group ({next(iter(groups)) or 'no group'}: "
            f"all {len(items)} requests open with the same tokens), so prefix-aware routing cannot differ "
            "from plain prefix affinity here; replay more conversations (--slice sessions, more --requests "
            "or another --start)"
        ]
    return []
