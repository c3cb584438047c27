"""Process memory under glibc: few malloc arenas, and freed heap handed back to the system.

A long-running kvfleet process (the EPP, an engine, an agent) allocates request bodies, token arrays and
event batches on many threads (the gRPC loop, the pick executor, the event subscriber, the metrics
scrapers). glibc gives each thread that contends its own malloc arena (up to 8 × cores of them) and keeps
freed memory in each: after a flood of large requests the resident size stays at its peak although
Python freed everything (measured by ``bench.chaos``). Three remedies, applied by ``kvfleet`` at start
(:func:`configure`):

* :func:`limit_arenas` — ``mallopt(M_ARENA_MAX, 2)``, what ``MALLOC_ARENA_MAX=2`` does (an explicit
  ``MALLOC_ARENA_MAX`` in the environment wins);
* :func:`fix_mmap_threshold` — ``mallopt(M_MMAP_THRESHOLD, 32 KiB)``, what
  ``MALLOC_MMAP_THRESHOLD_=32768`` does (an explicit one in the environment wins). glibc starts at
  128 KiB and raises the threshold to the size of every mmapped block freed (up to 32 MiB), so once a
  large buffer was freed, every later request body and event batch up to that size is carved from the
  heap, and the heap fragments: an EPP under floods of distinct 4k-token prompts grew 18 % over six
  floods with the dynamic threshold, 1.5 % with it fixed (``bench.chaos``). Blocks of 32 KiB and more
  are mapped and unmapped on their own;
* :func:`start_trimmer` — ``malloc_trim(0)`` every ``interval_s`` on a daemon thread, returning free
  pages of every arena to the system.

Both are no-ops where the C library is not glibc (musl, macOS): they return ``False``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from functools import cache

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
ARENAS = 2
MMAP_THRESHOLD = 32 * 1024
TRIM_INTERVAL_S = 10.0


@cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        for symbol in ("gnu_get_libc_version", "malloc_trim", "mallopt"):  # only glibc has all three
            getattr(libc, symbol)
    except (OSError, AttributeError):
        return None
    return libc


def limit_arenas(n: int = ARENAS) -> bool:
    """At most ``n`` malloc arenas (call before threads start); ``False`` if not applied."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, n))


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Blocks of ``nbytes`` and more are mmapped, whatever was freed before (glibc's dynamic threshold off);
    ``False`` if not applied (not glibc, or ``MALLOC_MMAP_THRESHOLD_`` set)."""
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))


def trim() -> bool:
    """Return the free pages of every arena to the system; ``True`` if some were."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def start_trimmer(interval_s: float = TRIM_INTERVAL_S,
                  stop: threading.Event | None = None) -> threading.Thread | None:
    """:func:`trim` every ``interval_s`` on a daemon thread until ``stop`` is set (``None`` without glibc)."""
    if _glibc() is None:
        return None
    done = stop or threading.Event()

    def run() -> None:
        while not done.wait(interval_s):
            trim()

    t = threading.Thread(target=run, name="malloc-trim", daemon=True)
    t.start()
    return t


def configure() -> None:
    """What every kvfleet process does at start: :func:`limit_arenas`, :func:`fix_mmap_threshold` and
    :func:`start_trimmer`."""
    limited = limit_arenas()
    fixed = fix_mmap_threshold()
    trimmer = start_trimmer()
    log.debug("malloc: arenas limited %s, mmap threshold fixed %s, trimmer %s", limited, fixed,
              trimmer is not None)
