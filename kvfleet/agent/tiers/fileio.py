"""Small file helpers shared by the on-disk stores (``ssd`` per-block files, ``slab`` files)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def advance_views(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (those a vectored read or write just moved)."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def remove_file(path: str) -> None:
    """Unlink ``path``; a failure is logged, never raised (the record is already dropped)."""
    try:
        os.unlink(path)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
