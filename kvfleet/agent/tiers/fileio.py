"""Small file helpers shared by the on-disk stores (``ssd`` per-block files, ``slab`` files)."""

from __future__ import annotations

import errno
import logging
import os
import stat

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


def read_regular(path: str) -> bytes:
    """The bytes of the regular file ``path``: a symlink is not followed and a FIFO never blocks.

    Anything else (a directory, FIFO, socket, device, symlink) raises ``OSError``, as an unreadable file does.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        chunks: list[bytes] = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
