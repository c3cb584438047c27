"""Tiered KV-block storage of the node agent: gpu → cpu → ssd → remote.

:class:`TierManager` (``manager.py``) is the entry point; stores
(``memory.py``, ``device.py`` (torch: CUDA HBM), ``slab.py``, ``ssd.py``, ``remote.py``) implement :class:`TierStore`
(``base.py``); ``cost.py`` holds the promotion rule, ``record.py`` the on-disk
/ on-wire record, ``metrics.py`` the Prometheus series. See docs/tiers.md.
"""

from __future__ import annotations

from kvfleet.agent.tiers.base import BACKENDS, ScanReport, TierStore, open_store
from kvfleet.agent.tiers.cost import Action, CostModel, Decision, TierCost
from kvfleet.agent.tiers.device import DeviceError
from kvfleet.agent.tiers.errors import (
    BackpressureError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    TierError,
    TierFullError,
    TierIOError,
    TierUnavailableError,
    TruncatedBlockError,
    UnknownBackendError,
)
from kvfleet.agent.tiers.manager import LookupResult, PinReceipt, TierManager
from kvfleet.agent.tiers.metrics import METRIC_NAMES, TierMetrics
from kvfleet.agent.tiers.record import BlockMeta

__all__ = [
    "BACKENDS",
    "METRIC_NAMES",
    "Action",
    "BackpressureError",
    "BlockMeta",
    "BlockNotFoundError",
    "BlockTooLargeError",
    "CorruptBlockError",
    "CostModel",
    "Decision",
    "DeviceError",
    "LookupResult",
    "PinReceipt",
    "ScanReport",
    "TierCost",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TierManager",
    "TierMetrics",
    "TierStore",
    "TierUnavailableError",
    "TruncatedBlockError",
    "UnknownBackendError",
    "open_store",
]
