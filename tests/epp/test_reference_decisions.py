"""The compiled index search decides as the numpy search it replaced: every pick of small ``bench.routing``
cases and every match on random index states with holes equal the recorded ones (``reference_decisions.py``
says how and from what they were recorded)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.epp import reference_decisions as ref


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ref.DATA.read_text())
    return data


@pytest.mark.parametrize("name", list(ref.CASES))
def test_picks(recorded: dict[str, Any], name: str) -> None:
    want, got = recorded["picks"][name], ref.picks(name)
    pairs = zip(want["picks"], got["picks"], strict=True)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    assert first is None, f"request {first}: recorded pod {want['picks'][first]}, now {got['picks'][first]}"
    assert got["hit_rate"] == want["hit_rate"]


@pytest.mark.parametrize("state", ref.STATES, ids=lambda s: "seed{}-pods{}-chains{}-blocks{}".format(*s))
def test_matches(recorded: dict[str, Any], state: tuple[int, int, int, int]) -> None:
    assert ref.matches(*state) == recorded["matches"][",".join(map(str, state))]
