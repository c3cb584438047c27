"""The live benches' per-thread CPU split (bench/_live.py): a thread's CPU lands in its group by name."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench._live import thread_group


def test_thread_groups() -> None:
    assert thread_group("ext-proc-loop") == "loop"
    assert thread_group("epp-route_0") == "route"
    assert thread_group("scrape_3") == thread_group("metrics-scraper") == "scrapers"
    assert thread_group("ZMQbg/IO/0") == "zmq-io"
    assert thread_group("python") == "other"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_NAME are Linux's")
def test_a_named_thread_s_cpu_lands_in_its_group() -> None:
    # a fresh process: in the test runner, threads of other tests' pickers come and go (an ended thread's CPU
    # leaves /proc with it)
    code = textwrap.dedent("""
        import hashlib, json, os, threading, time
        from bench._live import cpu_split, thread_cpu
        from kvfleet.cache import threadnames

        spun, leave = threading.Event(), threading.Event()
        data = bytes(1 << 20)

        def spin():
            threadnames.set_current("epp-gossip")
            end = time.thread_time() + 0.3
            while time.thread_time() < end:
                hashlib.sha256(data).digest()  # CPU without the GIL held
            spun.set()
            leave.wait()  # read while the thread lives: an ended thread leaves /proc

        before = [thread_cpu(os.getpid())]
        t = threading.Thread(target=spin)
        t.start()
        spun.wait()
        after = [thread_cpu(os.getpid())]
        leave.set()
        t.join()
        print(json.dumps(cpu_split(before, after)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    split = json.loads(out.stdout)
    assert split.get("gossip", 0.0) >= 0.15, split
    assert split.get("loop", 0.0) == 0.0, split
