"""Process memory helpers (kvfleet/cache/malloc.py) on this machine's C library.

Covers: on glibc, freed heap memory left resident after a burst of mid-sized allocations on several threads
is handed back by :func:`trim` (RSS measured in a fresh interpreter); :func:`limit_arenas` applies unless
``MALLOC_ARENA_MAX`` is set; after :func:`fix_mmap_threshold` 64 KiB blocks the heap cannot serve from its
free space are still mapped one by one after a 4 MiB block was freed (without it glibc's dynamic threshold
grows the heap for them; glibc's own ``mallinfo2`` counts the mapped blocks); :func:`start_trimmer` trims
periodically until stopped; every ``kvfleet`` role starts with all three (``kvfleet.cli``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvfleet.cache import malloc
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(malloc._glibc() is None, reason="not glibc: the helpers are no-ops")

_BURST = r"""
import sys, threading
from kvfleet.cache import malloc

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

survivors = []

def burst():
    block = [bytearray(24 * 1024) for _ in range(3000)]  # below glibc's mmap threshold: heap memory
    survivors.extend(block[::100])  # a few stay alive, scattered: the heap cannot shrink from its top
    del block

threads = [threading.Thread(target=burst) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
before = rss_mb()
malloc.trim()
print(before, rss_mb())
"""


def test_trim_returns_freed_heap_to_the_system() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", _BURST], capture_output=True, text=True, env=env, timeout=60,
                         check=True).stdout
    before, after = (float(x) for x in out.split())
    assert before > 100  # 4 threads × 3,000 × 24 KiB were allocated, 99 % freed, and stay resident
    assert after < before - 100, (before, after)


_MAPPED = r"""
import ctypes, sys
from kvfleet.cache import malloc

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = malloc._glibc()
libc.mallinfo2.restype = Info
if sys.argv[1] == "fixed":
    assert malloc.fix_mmap_threshold()
big = bytearray(4 << 20)  # mapped (above the 128 KiB start), and its free raises the dynamic threshold
del big
before = libc.mallinfo2().hblks
blocks = [bytearray(64 << 10) for _ in range(200)]  # 12.5 MiB: more than the heap has free
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
def test_fixed_mmap_threshold_maps_blocks_after_a_large_free(mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", _MAPPED, mode], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout
    mapped = int(out)
    if mode == "fixed":  # what the heap could not serve from its free space was mapped block by block
        assert mapped >= 150, mapped
    else:  # the heap grew instead
        assert mapped <= 5, mapped


def test_fixed_mmap_threshold_yields_to_the_environment() -> None:
    code = "from kvfleet.cache import malloc; print(malloc.fix_mmap_threshold())"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         check=True).stdout
    assert out.strip() == "False"


def test_limit_arenas_unless_the_environment_says() -> None:
    code = "from kvfleet.cache import malloc; print(malloc.limit_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def run(e: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60,
                              check=True).stdout.strip()

    assert run(env) == "True"
    assert run({**env, "MALLOC_ARENA_MAX": "4"}) == "False"


def test_the_trimmer_trims_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def trim() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(malloc, "trim", trim)
    stop = threading.Event()
    t = malloc.start_trimmer(0.01, stop)
    assert t is not None
    try:
        wait_for(lambda: len(calls) >= 3, "three trims", timeout_s=5)
    finally:
        stop.set()
    t.join(2)
    assert not t.is_alive() and len(calls) >= 3


def test_every_role_starts_with_all_three(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet import cli

    seen: list[str] = []
    monkeypatch.setattr(malloc, "configure", lambda: seen.append("configured"))
    assert cli.main(["gateway-config", "--epp", "127.0.0.1:9002", "--out", os.devnull]) == 0
    assert seen == ["configured"]
