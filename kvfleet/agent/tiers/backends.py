"""The backend registry and factory: a ``TierSpec.backend`` name → a :class:`~.base.TierStore`.

It lives outside the abstract base on purpose: the factory names every
backend (the gpu tier's default asks :mod:`~.device` whether torch drives a
device), and every backend imports the base, so the two in one module made an
import circle (``base → device → memory → base``). Backends are imported on
first use (torch and redis only when asked for).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvfleet.agent.tiers.base import TierStore
from kvfleet.agent.tiers.errors import UnknownBackendError
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSpec

#: backend name → (module, class), imported on first use.
BACKENDS: dict[str, tuple[str, str]] = {
    "arena": ("kvfleet.agent.tiers.memory", "ArenaStore"),
    "files": ("kvfleet.agent.tiers.ssd", "FileStore"),
    "slab": ("kvfleet.agent.tiers.slab", "SlabStore"),
    "redis": ("kvfleet.agent.tiers.remote", "RedisStore"),
    "torch": ("kvfleet.agent.tiers.device", "TorchDeviceStore"),
}

DEFAULT_BACKEND: dict[Tier, str] = {Tier.GPU: "arena", Tier.CPU: "arena", Tier.SSD: "slab", Tier.REMOTE: "redis"}


def default_backend(tier: Tier, spec: TierSpec) -> str:
    """The backend used when ``spec.backend`` is empty: for gpu, ``torch`` when ``spec.device`` is a torch device.

    Device ``auto`` imports torch (when installed and a GPU driver is present) to ask whether CUDA is
    available; ``host`` imports nothing.
    Raises ``DeviceError`` (:mod:`~.device`) for ``cuda``/``cpu`` devices this machine cannot serve.
    """
    device = getattr(spec, "device", "host")
    if tier is Tier.GPU and device != "host":
        from kvfleet.agent.tiers.device import resolve_device  # imports torch only when needed

        if resolve_device(device) is not None:
            return "torch"
    return DEFAULT_BACKEND[tier]


def open_store(tier: Tier, spec: TierSpec) -> TierStore:
    """Instantiate the backend ``spec.backend`` (or the tier's default) for ``tier``."""
    name = spec.backend or default_backend(tier, spec)
    try:
        module, cls = BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(f"unknown tier backend {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    factory: Any = getattr(importlib.import_module(module), cls)
    store: TierStore = factory(tier, spec)
    return store


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "default_backend", "open_store"]
