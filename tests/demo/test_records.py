"""The demo's per-request records, its workload warning and its policies (no processes).

Covers: the EPP's decision log joined to the client's outcomes on the request id (predicted, reported,
TTFT, pod, group; ``null`` where the log has no line, a cut line skipped); ``summary.json`` keeps one record
per line and round-trips; a single-prompt-group workload warns in ``report.md`` and a varied one does not;
trace items carry their conversation (first two hash ids) and synthetic ones their tenant; the policies run
GIE's default profile as ``gie-approx`` without level-1 sharding, and kvfleet last.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.demo.main import POLICIES
from kvfleet.demo.replay import Outcome
from kvfleet.demo.report import dump_json, load_decisions, request_records, summarize, write_report
from kvfleet.demo.workload import WorkItem, load_trace, synthetic, workload_warnings


def test_records_join_the_decision_log(tmp_path: Path) -> None:
    log = tmp_path / "d.jsonl"
    log.write_text(
        json.dumps({"id": "kvfleet.1-0", "pod": "pod-0", "predicted": 512, "reported": 480}) + "\n"
        + json.dumps({"id": "kvfleet.1-1", "pod": "pod-1", "predicted": 0, "reported": 16}) + "\n"
        + '{"id": "kvfleet.1-2", "pod"\n'  # cut short when the EPP stopped
    )
    decisions = load_decisions(log)
    assert set(decisions) == {"kvfleet.1-0", "kvfleet.1-1"} and load_decisions(tmp_path / "none.jsonl") == {}
    outs = [
        Outcome(0, 200, "pod-0", 1000, 480, 4, 0.1234, 0.2, request_id="kvfleet.1-0"),
        Outcome(1, 200, "pod-1", 1000, 16, 4, 0.05, 0.1, request_id="kvfleet.1-1"),
        Outcome(2, 503, "", 0, 0, 0, None, None, error="down", request_id="kvfleet.1-2"),
    ]
    recs = request_records(outs, ["46-47", "46-47", "9-10"], decisions)
    assert recs[0] == {"i": 0, "pod": "pod-0", "group": "46-47", "predicted": 512, "reported": 480,
                       "ttft_ms": 123.4}
    assert recs[1]["predicted"] == 0 and recs[1]["reported"] == 16
    assert (recs[2]["predicted"] is None and recs[2]["reported"] is None
            and recs[2]["error"].startswith("HTTP 503"))


def test_summary_keeps_one_record_per_line(tmp_path: Path) -> None:
    res = summarize("gie-approx", [Outcome(0, 200, "a", 100, 50, 2, 0.05, 0.1, request_id="x-0")], 1.0, {},
                    [], 16, None)
    res.records = [{"i": i, "pod": "a", "group": "g", "predicted": 16 * i, "reported": 16, "ttft_ms": 1.5}
                   for i in range(50)]
    paths = write_report(tmp_path, [res], {"workload": "w", "requests": 50, "warnings": []})
    text = paths["summary"].read_text()
    summary = json.loads(text)
    assert summary["policies"]["gie-approx"]["records"] == res.records
    assert (list(summary["policies"]["gie-approx"])[-1] == "records"
            and summary["policies"]["gie-approx"]["requests"] == 1)
    assert text.count("\n") < 100  # 50 records, one line each, plus the figures
    assert json.loads(dump_json({"a": [1, 2], "b": {"c": [{"d": 1}], "e": []}, "f": None})) == {
        "a": [1, 2], "b": {"c": [{"d": 1}], "e": []}, "f": None}


def test_single_prompt_group_warns() -> None:
    same = [WorkItem(0.0, (1, 2, 3), 4, group="46-47") for _ in range(5)]
    (warning,) = workload_warnings(same)
    assert "single prompt group" in warning and "46-47" in warning
    assert workload_warnings([*same, WorkItem(1.0, (9,), 4, group="9-10")]) == []
    assert workload_warnings(same[:1]) == []


def test_report_shows_the_warning(tmp_path: Path) -> None:
    res = summarize("kvfleet", [Outcome(0, 200, "a", 100, 50, 2, 0.05, 0.1)], 1.0, {}, [], 16, None)
    text = write_report(
        tmp_path, [res], {"workload": "w", "warnings": ["the replayed slice holds a single prompt group"]}
    )["report"].read_text()
    assert "**Warning:** the replayed slice holds a single prompt group." in text
    plain = write_report(tmp_path / "b", [res], {"workload": "w", "warnings": []})["report"].read_text()
    assert "Warning" not in plain


def test_items_carry_their_prompt_group(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 600, "output_length": 4, "hash_ids": ids}
            for i, ids in enumerate([[0, 1], [0, 2, 3], [0, 1, 5], [7]])]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [i.group for i in load_trace(path, count=4)] == ["0-1", "0-2", "0-1", "7"]
    assert {i.group for i in synthetic(count=20, tenants=2)} == {"tenant-0", "tenant-1"}


def test_policies() -> None:
    assert list(POLICIES) == ["random", "round-robin", "least-load", "gie-approx", "kvfleet"]
    gie = POLICIES["gie-approx"]
    assert gie["prefix_shard_pools"] is False and gie["events_enabled"] is False
    assert {p["type"]: p.get("weight") for p in gie["plugins"]} == {
        "gie-queue-scorer": 2.0, "gie-kv-cache-utilization-scorer": 2.0, "gie-prefix-cache-scorer": 3.0,
        "gie-max-score-picker": None}
