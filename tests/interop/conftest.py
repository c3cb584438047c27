"""Fixtures of the interop suite: the interpreters of the real vLLM and SGLang releases (scripts/interop_venvs.py builds them).

Every test here is marked ``interop`` (``make test-interop``; ``make unit`` leaves them to it). A
release whose venv is not built makes its tests skip with the command that builds it, unless
``KVFLEET_REQUIRE_INTEROP=1`` (``make test-interop``), where that is an error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.interop)


def engine_python(engine: str, version: str) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import interop_venvs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    found: Path | None = interop_venvs.python(engine, version)
    if found is None:
        reason = f"{engine} {version} interop venv not built (python scripts/interop_venvs.py build, or make interop)"
        if os.environ.get("KVFLEET_REQUIRE_INTEROP", "") not in ("", "0"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def vllm_python(version: str) -> Path:
    return engine_python("vllm", version)
