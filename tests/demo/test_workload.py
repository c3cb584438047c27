"""Workloads: trace rows → token sequences that keep the trace's prefix sharing; synthetic tenants; bad input.

Covers: ``trace_tokens`` gives equal token prefixes exactly for equal hash-id
prefixes and never reuses a token across ids; a contiguous slice keeps trace order
and scales arrivals; the ``sessions`` slice takes whole conversations (groups of
rows sharing their first two hash ids); the synthetic workload shares each
tenant's system prompt; malformed rows name the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.demo.workload import WorkloadError, default_trace, load_trace, synthetic, trace_tokens


def test_trace_tokens_preserve_prefix_sharing() -> None:
    a = trace_tokens([0, 1, 2], 1500)
    b = trace_tokens([0, 1, 3], 1536)
    assert len(a) == 1500 and len(b) == 1536
    assert a[:1024] == b[:1024] and a[1024] != b[1024]
    assert set(trace_tokens([5], 512)).isdisjoint(trace_tokens([6], 512))


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_contiguous_and_session_slices(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 600, "output_length": 50, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 5000, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 3]},
        {"timestamp": 7000, "input_length": 1600, "output_length": 50, "hash_ids": [0, 1, 3, 4]},
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    items = load_trace(path, count=3, time_scale=0.5, max_tokens=8)
    assert [i.at for i in items] == [0.0, 1.0, 2.0]
    assert [i.max_tokens for i in items] == [8, 5, 8]
    sess = load_trace(path, count=10, sessions=True, min_turns=2, speedup=2.0)
    assert [len(i.prompt) for i in sess] == [600, 1100, 1600]  # the [0, 2] conversation has one turn
    assert [i.at for i in sess] == [0.0, 2.0, 3.0]


def test_bad_trace_rows_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 1}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2"):
        load_trace(path)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_shipped_trace_and_synthetic_workload() -> None:
    items = load_trace(default_trace(), count=20, sessions=True)
    assert len(items) == 20 and all(i.prompt for i in items)
    syn = synthetic(count=30, tenants=3, system_tokens=64, user_tokens=16)
    by_tenant: dict[str, set[tuple[int, ...]]] = {}
    for it in syn:
        by_tenant.setdefault(it.tenant, set()).add(it.prompt[:64])
    assert all(len(v) == 1 for v in by_tenant.values())
    assert sorted(i.at for i in syn) == [i.at for i in syn]
