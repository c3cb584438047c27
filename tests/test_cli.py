"""The ``kvfleet`` entry point: usage, version, unknown roles."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet.cli import ROLES, main


def test_usage_lists_every_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for role in ROLES:
        assert role in out


def test_unknown_role_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "unknown role 'nope'" in capsys.readouterr().err


def test_module_entry_point_prints_version() -> None:
    out = subprocess.run([sys.executable, "-m", "kvfleet", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.startswith("kvfleet ")
