"""The package stays in small modules: none over 600 lines (split by concept when one grows)."""

from __future__ import annotations

from pathlib import Path

import kvfleet

MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    root = Path(kvfleet.__file__).parent
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
