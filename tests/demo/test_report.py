"""The demo's numbers and files from outcomes and scraped metrics (no processes).

Covers: hit rate is cached / prompt tokens over successful requests; TTFT
percentiles; per-tier hit split and imbalance from the engines' exposition;
misprediction from the EPP's counters (``None`` when absent); a policy that did
not run appears as such in ``report.md`` and ``summary.json``; the chart is a PNG.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.demo.replay import Outcome
from kvfleet.demo.report import percentile, skipped, summarize, write_report

ENGINE = """# TYPE kvfleet_engine_tier_hit_blocks counter
kvfleet_engine_tier_hit_blocks_total{model_name="m",tier="gpu"} 10
kvfleet_engine_tier_hit_blocks_total{model_name="m",tier="cpu"} 5
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} %d
"""

EPP = """# TYPE kvfleet_epp_misprediction_tokens counter
kvfleet_epp_misprediction_tokens_total{direction="over"} 30
kvfleet_epp_misprediction_tokens_total{direction="under"} 10
# TYPE kvfleet_epp_prompt_tokens counter
kvfleet_epp_prompt_tokens_total 400
"""


def test_summary_numbers() -> None:
    outs = [
        Outcome(0, 200, "a", 200, 100, 4, 0.1, 0.2),
        Outcome(1, 200, "b", 200, 140, 4, 0.3, 0.4),
        Outcome(2, 503, "", 0, 0, 0, None, None, error="down"),
    ]
    metrics = {"a": ENGINE % 300, "b": ENGINE % 100, "c": ENGINE % 999}
    r = summarize("kvfleet", outs, 2.0, metrics, ["a", "b"], 16, EPP)
    assert r.ok == 2 and r.errors == 1 and r.first_error.startswith("HTTP 503")
    assert r.hit_rate == 240 / 400
    assert r.tier_hit_rate == {"gpu": 2 * 10 * 16 / 400, "cpu": 2 * 5 * 16 / 400}
    assert r.imbalance == 300 / 200
    assert r.misprediction == 40 / 400
    assert r.ttft_ms["p50"] == 200.0 and r.throughput_rps == 1.0
    assert summarize("x", outs, 1.0, {}, [], 16, None).misprediction is None
    assert percentile([], 0.5) is None and percentile([1.0, 3.0], 0.5) == 2.0


def test_report_files(tmp_path: Path) -> None:
    ok = summarize("kvfleet", [Outcome(0, 200, "a", 100, 50, 2, 0.05, 0.1)], 1.0, {}, [], 16, None)
    paths = write_report(tmp_path, [ok, skipped("round-robin", "unknown plugin")],
                         {"workload": "w", "requests": 1})
    text = paths["report"].read_text()
    assert "| kvfleet | 50.0 %" in text and "round-robin | not run: unknown plugin" in text
    summary = json.loads(paths["summary"].read_text())
    assert summary["policies"]["round-robin"]["ran"] is False
    assert summary["policies"]["kvfleet"]["hit_rate"] == 0.5
    assert paths["chart"].read_bytes()[:4] == b"\x89PNG"
