"""``Tier``: order, ``medium`` names, and a hash that agrees with its string equality."""

from __future__ import annotations

from kvfleet.cache.tiers import Tier


def test_rank_medium_and_hash() -> None:
    assert [t.rank for t in Tier] == [0, 1, 2, 3]
    assert [t.medium for t in Tier] == ["GPU", "CPU", "SSD", "REMOTE"]
    assert Tier.SSD.slower() is Tier.REMOTE and Tier.REMOTE.slower() is None
    for t in Tier:  # a tier equals its value, so it hashes as its value: either finds the other in a dict
        assert t == t.value and hash(t) == hash(t.value)
        by_tier: dict[str, int] = {t: 1}
        assert {t.value: 1}[t] == 1 and by_tier[t.value] == 1
