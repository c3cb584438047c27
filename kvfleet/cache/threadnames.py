"""OS thread names: every Python thread of a kvfleet process tells the kernel its name.

A kvfleet process runs several threads (the EPP: ``ext-proc-loop``, ``epp-route``, ``kv-events``,
``epp-gossip``, ``metrics-scraper``, ``scrape_N``, ``malloc-trim``; an agent: the tier movers and transfer
threads). Python gives them names of its own, but before 3.14 it does not hand them to the kernel, so
``top -H``, ``ps -L``, ``/proc/PID/task/TID/comm``, ``perf`` and ``py-spy`` show every one as ``python``
and a thread's CPU cannot be told from another's. :func:`configure` (``kvfleet`` calls it at start, before
any role starts a thread) installs a one-shot hook through :func:`threading.setprofile`: each thread started
afterwards sets its name (``prctl(PR_SET_NAME)``: the kernel keeps 15 bytes) as it begins to run, then
removes the hook, so nothing is traced after. :func:`thread_cpu` reads each thread's CPU by that name
(the EPP's ``kvfleet_epp_thread_cpu_seconds_total{thread}``, the benches' split per thread). Linux only;
elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from functools import cache
from pathlib import Path
from types import FrameType
from typing import Any

PR_SET_NAME = 15
#: the kernel keeps this many bytes of a thread's name (16 with the terminating NUL)
MAX_NAME_BYTES = 15


@cache
def _prctl() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def os_name(name: str) -> bytes:
    """``name`` as the kernel keeps it: UTF-8, cut to :data:`MAX_NAME_BYTES` without splitting a character."""
    raw = name.encode("utf-8", "replace")[:MAX_NAME_BYTES]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def set_current(name: str) -> bool:
    """Name the calling OS thread ``name``; ``False`` where that is not possible."""
    prctl = _prctl()
    if prctl is None:
        return False
    return int(prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0)) == 0


def _hook(frame: FrameType, event: str, arg: Any) -> None:
    # runs in the new thread, on its first call event (Thread.run): name it, then trace nothing more
    sys.setprofile(None)
    set_current(threading.current_thread().name)


_NUMBER = re.compile(r"[-_/]?\d+")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def label(name: str) -> str:
    """A thread's name without its numbers: the threads of one pool (``scrape_0``, ``scrape_3``) or one kind
    (``kvfleet-xfer-accept-8001``) share a label, so a metric labelled by it has a bounded set."""
    return _NUMBER.sub("", name) or "other"


def _stat_cpu(stat: str) -> float:
    """User + system CPU seconds from the text of a ``/proc/.../stat`` file (fields 14 and 15)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def thread_cpu(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """Each live thread of process ``pid``: thread id → (its OS name, user + system CPU seconds), from
    ``/proc``; ``{}`` where there is none (another OS, a process that is gone)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        out[int(task.name)] = (stat[stat.index("(") + 1:stat.rindex(")")], _stat_cpu(stat))
    return out


def process_cpu(pid: int | str = "self") -> float | None:
    """User + system CPU seconds of process ``pid``, its ended threads included (``None``: no such process or
    no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return _stat_cpu(stat)


def configure() -> bool:
    """Name every thread started from now on after its :attr:`threading.Thread.name` (see the module doc);
    ``False`` where the platform has no way to."""
    if _prctl() is None:
        return False
    threading.setprofile(_hook)
    return True


__all__ = ["MAX_NAME_BYTES", "configure", "label", "os_name", "process_cpu", "set_current", "thread_cpu"]
