"""The live benches' per-thread CPU split (bench/_live.py): a thread's CPU lands in its group by name."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from bench._live import cpu_split, thread_cpu, thread_group
from kvfleet.cache import threadnames


def test_thread_groups() -> None:
    assert thread_group("ext-proc-loop") == "loop"
    assert thread_group("epp-route_0") == "route"
    assert thread_group("scrape_3") == thread_group("metrics-scraper") == "scrapers"
    assert thread_group("ZMQbg/IO/0") == "zmq-io"
    assert thread_group("python") == "other"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_NAME are Linux's")
def test_a_named_thread_s_cpu_lands_in_its_group() -> None:
    stop = threading.Event()

    def spin() -> None:
        threadnames.set_current("epp-gossip")
        end = time.thread_time() + 0.3
        while time.thread_time() < end and not stop.is_set():
            pass

    before = [thread_cpu(os.getpid())]
    t = threading.Thread(target=spin)
    t.start()
    # read while the thread lives: an ended thread's CPU leaves /proc/PID/task with it
    time.sleep(0.05)
    after = before
    while t.is_alive():
        after = [thread_cpu(os.getpid())]
        time.sleep(0.01)
    split = cpu_split(before, after)
    assert split.get("gossip", 0.0) >= 0.15
    assert split.get("loop", 0.0) == 0.0
    stop.set()
