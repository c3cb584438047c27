"""Tiered KV-block storage of the node agent: gpu → cpu → ssd → remote.

:class:`TierManager` (``manager.py``) is the entry point, a facade over:
``index.py`` (hash → tier, LRU, bytes per tier, pins, KV events),
``policy.py`` (placement, watermarks, the promotion rule of ``cost.py``),
``moves.py`` (one block's move between two stores), ``movement.py`` (the
migration threads and queues; ``staging.py`` their copy buffers) and the
stores: ``memory.py``, ``device.py`` (torch: CUDA HBM), ``slab.py``,
``ssd.py``, ``remote.py`` implement :class:`TierStore` (``base.py``), made
by name in ``backends.py``. ``record.py`` is the on-disk / on-wire record,
``metrics.py`` the Prometheus series. See docs/tiers.md ("Layout").
"""

from __future__ import annotations

from kvfleet.agent.tiers.backends import BACKENDS, block_charge, open_store
from kvfleet.agent.tiers.base import ScanReport, TierStore
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
    "block_charge",
    "open_store",
]
