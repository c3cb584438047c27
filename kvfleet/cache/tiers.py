"""The storage tiers a KV block can live in, fastest first, and the ``medium`` names engines use for them.

KV events name a block's tier in ``medium`` (case-insensitive, ``-`` read as ``_``):

| tier | mediums |
|---|---|
| ``gpu`` | ``None`` (vLLM's default), ``GPU``, ``CUDA``, ``HBM``, ``DEVICE`` |
| ``cpu`` | ``CPU``, ``CPU_PINNED`` (SGLang), ``PINNED``, ``HOST``, ``DRAM`` |
| ``ssd`` | ``SSD``, ``DISK`` (SGLang), ``STORAGE`` (vLLM's storage offloading), ``NVME``, ``LOCAL_DISK`` |
| ``remote`` | ``REMOTE``, ``EXTERNAL`` (SGLang), ``SHARED_STORAGE``, ``LMCACHE`` |

Any other name is unknown: :meth:`Tier.from_medium` raises, or returns the
``default`` it is given (the EPP passes the slowest tier and counts the event).
"""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    """Where a block lives. Ordered fastest → slowest: ``gpu < cpu < ssd < remote``."""

    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"
    REMOTE = "remote"

    #: hashed as the string it equals: ``Enum`` hashes the member's name (``"GPU"``), which disagrees
    #: with ``Tier.GPU == "gpu"`` and costs a Python call on every lookup of a tier-keyed dict.
    __hash__ = str.__hash__

    @property
    def rank(self) -> int:
        """0 for the fastest tier, growing towards the slowest."""
        return _RANK[self]

    @property
    def medium(self) -> str:
        """The ``medium`` string used in vLLM KV events (``"GPU"``, ``"CPU"``, ...)."""
        return _MEDIUM[self]

    @classmethod
    def from_medium(cls, medium: str | None, default: Tier | None = None) -> Tier:
        """Parse a KV-event ``medium`` (see the module doc; ``None`` means GPU, as vLLM does).

        An unknown name raises ``ValueError``, or gives ``default`` when one is passed.
        """
        if medium is None:
            return cls.GPU
        tier = _SPELLED.get(medium)
        if tier is not None:
            return tier
        tier = _ALIASES.get(medium.strip().lower().replace("-", "_"))
        if tier is not None:
            if len(_SPELLED) < _MAX_SPELLED:
                _SPELLED[medium] = tier
            return tier
        if default is not None:
            return default
        raise ValueError(
            f"unknown KV medium {medium[:64]!r}; known: {', '.join(sorted(a.upper() for a in _ALIASES))}")

    @classmethod
    def slowest(cls) -> Tier:
        return _ORDER[-1]

    def slower(self) -> Tier | None:
        """The next slower tier, or ``None`` for the last one."""
        i = self.rank + 1
        return _ORDER[i] if i < len(_ORDER) else None


_ORDER: list[Tier] = [Tier.GPU, Tier.CPU, Tier.SSD, Tier.REMOTE]
#: ``rank`` and ``medium`` of each tier, looked up (every KV event of a tier names its medium)
_RANK: dict[Tier, int] = {t: i for i, t in enumerate(_ORDER)}
_MEDIUM: dict[Tier, str] = {t: t.value.upper() for t in _ORDER}
#: the known spellings :meth:`Tier.from_medium` has met, as given (every KV event names its medium: the
#: normalising is paid once per spelling); bounded, since a pod may spell them in many ways
_SPELLED: dict[str, Tier] = {}
_MAX_SPELLED = 64
_ALIASES: dict[str, Tier] = {
    **{name: Tier.GPU for name in ("gpu", "cuda", "hbm", "device")},
    **{name: Tier.CPU for name in ("cpu", "cpu_pinned", "pinned", "host", "dram")},
    **{name: Tier.SSD for name in ("ssd", "disk", "storage", "nvme", "local_disk")},
    **{name: Tier.REMOTE for name in ("remote", "external", "shared_storage", "lmcache")},
}
