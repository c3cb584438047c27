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
from kvfleet.agent.tiers.record import BlockMeta
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

DEFAULT_BACKEND: dict[Tier, str] = {Tier.GPU: "arena", Tier.CPU: "arena", Tier.SSD: "slab",
                                    Tier.REMOTE: "redis"}


def default_backend(tier: Tier, spec: TierSpec) -> str:
    """The backend used when ``spec.backend`` is empty: for gpu, ``torch`` when ``spec.device`` is a torch
    device.

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


def store_class(tier: Tier, spec: TierSpec) -> type[TierStore]:
    """The class of the backend ``spec.backend`` (or the tier's default) for ``tier``, imported now."""
    name = spec.backend or default_backend(tier, spec)
    try:
        module, cls = BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown tier backend {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    found: type[TierStore] = getattr(importlib.import_module(module), cls)
    return found


def open_store(tier: Tier, spec: TierSpec) -> TierStore:
    """Instantiate the backend ``spec.backend`` (or the tier's default) for ``tier``."""
    factory: Any = store_class(tier, spec)
    store: TierStore = factory(tier, spec)
    return store


def block_charge(tier: Tier, spec: TierSpec, meta: BlockMeta) -> int:
    """Bytes one block like ``meta`` takes in ``tier`` under ``spec`` (its backend's slot or record).

    ``capacity_bytes = blocks × block_charge(...)`` sizes a tier to hold ``blocks`` such blocks:
    exactly for the slot stores (arena, torch, slab: every block takes one slot), at least for
    the record stores (files, redis: a block whose header is smaller than ``meta``'s takes less).
    """
    return store_class(tier, spec).block_charge(spec, meta)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "block_charge", "default_backend", "open_store", "store_class"]
