"""The single source of configuration for every kvfleet role.

Settings are frozen dataclasses, one per concern, every field defaulted
(``Settings()`` is a working one-machine configuration). The Helm chart's
``values.yaml`` defaults and the CRD defaults are rendered from these classes
and checked against them in CI, never edited by hand in two places.

Each concern lives in its own module (``cache``, and the ones the agent, EPP,
engine and operator add); :class:`Settings` nests them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfleet.config._loader import ConfigError, from_dict, to_dict
from kvfleet.config.cache import CacheSettings
from kvfleet.config.engine import EngineSettings
from kvfleet.config.epp import EppSettings
from kvfleet.config.operator import OperatorSettings
from kvfleet.config.tiers import TierSettings
from kvfleet.config.transfer import TransferSettings

__all__ = [
    "CacheSettings",
    "ConfigError",
    "EngineSettings",
    "EppSettings",
    "OperatorSettings",
    "Settings",
    "TierSettings",
    "TransferSettings",
    "from_dict",
    "load",
    "to_dict",
]


@dataclass(frozen=True)
class Settings:
    """All settings; a YAML file with the same nesting overrides any subset."""

    cache: CacheSettings = field(default_factory=CacheSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    epp: EppSettings = field(default_factory=EppSettings)
    operator: OperatorSettings = field(default_factory=OperatorSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    tiers: TierSettings = field(default_factory=TierSettings)


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Load settings from a YAML file (optional) with dict overrides on top."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded
    if overrides:
        data = _merge(data, overrides)
    return from_dict(Settings, data)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
