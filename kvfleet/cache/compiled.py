"""kvfleet's compiled parts (plain C, no Python API, built by ``pip install``: ``setup.py``), loaded with
ctypes. There is no Python version of any of them: a kvfleet installed without its compiled parts fails at
import, with the way to build them."""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path
from typing import Any

import numpy.typing as npt


def load(here: Path, stem: str, what: str, hold_gil: bool = False) -> ctypes.CDLL:
    """The shared library ``stem`` (``_probe``, ``_digest``...) built next to the module in ``here``; ``what``
    names it in the error when it is missing. ctypes releases the GIL around each call; ``hold_gil`` keeps it
    (``ctypes.PyDLL``) for calls of a microsecond or so, where the hand-over costs as much as the call."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{stem}{suffix}"
        if path.exists():
            return ctypes.PyDLL(str(path)) if hold_gil else ctypes.CDLL(str(path))
    raise ImportError(
        f"kvfleet's compiled {what} ({stem}*.so) is not in {here}: kvfleet was not built from its "
        "sources here. Install it with pip (`pip install -e .` in a checkout, or `make venv`); the build "
        "needs a C compiler: `cc`, or zig's from the ziglang package on PyPI, CC='ZIG cc' LDSHARED='ZIG cc "
        "-shared' with ZIG the `zig` binary in the ziglang package's directory (what `make venv` does)")


_CHAR = ctypes.c_char
_address = ctypes.addressof


def ptr(a: npt.NDArray[Any]) -> int:
    """The address of ``a``'s first element (``a`` contiguous): through ctypes' buffer view, 0.45 µs
    against 1.7 µs for ``__array_interface__``, which builds a dict per call (a decision passes a few
    arrays); a read-only array (no writable buffer to view) takes the slower way."""
    try:
        return _address(_CHAR.from_buffer(a))  # type: ignore[arg-type]  # ndarray is a buffer
    except (TypeError, ValueError):
        return int(a.__array_interface__["data"][0])
