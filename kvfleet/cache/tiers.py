"""The storage tiers a KV block can live in, fastest first, and their vLLM medium names."""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    """Where a block lives. Ordered fastest → slowest: ``gpu < cpu < ssd < remote``."""

    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"
    REMOTE = "remote"

    @property
    def rank(self) -> int:
        """0 for the fastest tier, growing towards the slowest."""
        return _ORDER.index(self)

    @property
    def medium(self) -> str:
        """The ``medium`` string used in vLLM KV events (``"GPU"``, ``"CPU"``, ...)."""
        return self.value.upper()

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        """Parse a KV-event ``medium`` (case-insensitive; ``None`` means GPU, as vLLM does)."""
        if medium is None:
            return cls.GPU
        key = medium.lower()
        if key in _ALIASES:
            return _ALIASES[key]
        try:
            return cls(key)
        except ValueError:
            raise ValueError(f"unknown KV medium {medium!r}; known: {', '.join(t.medium for t in cls)}") from None

    def slower(self) -> Tier | None:
        """The next slower tier, or ``None`` for the last one."""
        i = self.rank + 1
        return _ORDER[i] if i < len(_ORDER) else None


_ORDER: list[Tier] = [Tier.GPU, Tier.CPU, Tier.SSD, Tier.REMOTE]
_ALIASES: dict[str, Tier] = {"cuda": Tier.GPU, "hbm": Tier.GPU, "disk": Tier.SSD, "lmcache": Tier.REMOTE}
