"""``kvfleet demo`` end to end on a small workload, and its failure messages.

Covers: the demo starts Envoy, the EPP and the engines, replays the trace once per
chosen policy, writes ``report.md``, the PNG chart and ``summary.json`` with the
per-policy numbers, exits 0, and leaves no process behind (every child had the
demo's work directory in its command line; none survives); a taken gateway port
and an unreadable trace give exit code 2 and a one-line reason.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(170)]


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            pids.append(int(entry))
    return pids


def run_demo(*args: str, timeout: float = 160) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet", "demo", "--quiet", *args], capture_output=True, text=True,
        timeout=timeout,
    )


def test_demo_runs_to_its_report_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = run_demo("--requests", "16", "--policies", "kvfleet,random", "--out", str(out), "--time-factor",
                    "0.05")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"logs in (\S+)", proc.stderr)
    assert m, proc.stderr
    assert processes_mentioning(m.group(1)) == [], "demo left processes running"
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("kvfleet", "random"):
        res = summary["policies"][policy]
        assert res["ran"] and res["ok"] == 16
        assert 0.0 <= res["hit_rate"] <= 1.0
        assert res["ttft_ms"]["p50"] > 0 and res["throughput_rps"] > 0
    assert (out / "policies.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "| kvfleet |" in report and "TTFT" in report


def test_taken_port_and_bad_trace_are_clear_errors(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_demo("--port", str(port), "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert f"port {port}" in proc.stderr and "in use" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\nnot json\n')
    proc = run_demo("--trace", str(bad), "--slice", "contiguous", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "bad.jsonl" in proc.stderr
