"""The engine's slower tiers through the node agent's :class:`~kvfleet.agent.tiers.TierManager`.

``engine.tiers.backend: agent`` makes the simulator keep what it demotes from
its GPU stand-in in the agent's tier manager (``tiers:`` settings: cpu slabs,
ssd block files, Redis; codecs, watermarks, background migration, the
promotion rule, restart rescan with re-announcement) instead of the small
built-in :class:`~kvfleet.engine.localtiers.LocalTiers`. The manager's own GPU tier is
disabled: the engine's block manager is the GPU. Blocks cross the seam as
fp16 arrays of the simulated KV bytes; with a lossy codec (fp8, int4) a
promoted block differs from a recomputation, which changes the simulated
output, as it would change a real model's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from kvfleet.agent.tiers import TierError, TierManager
from kvfleet.cache.events import EventSink
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSettings
from kvfleet.engine.localtiers import SlowBlock

log = logging.getLogger(__name__)


def below_gpu(settings: TierSettings) -> TierSettings:
    """The same tier settings with the manager's GPU tier turned off."""
    return dataclasses.replace(settings, gpu=dataclasses.replace(settings.gpu, enabled=False))


class AgentTiers:
    """:class:`~kvfleet.engine.localtiers.SlowTiers` backed by a :class:`TierManager` (see the module doc)."""

    def __init__(self, settings: TierSettings, sink: EventSink) -> None:
        self.mgr = TierManager(below_gpu(settings), sink=sink)
        self._held: set[BlockHash] = set()

    def put(self, block: SlowBlock) -> None:
        arr = np.frombuffer(block.data, dtype=np.float16)
        try:
            self.mgr.put(block.block_hash, arr, tier=self.mgr.order[0], parent=block.parent, token_ids=block.token_ids)
        except TierError as exc:  # full or backpressure: the block is simply not kept
            log.debug("tier manager refused block %r: %s", block.block_hash, exc)
            return
        self._held.add(block.block_hash)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        return list(self.mgr.lookup(hashes).tiers)

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        arr = self.mgr.get(block_hash)
        if arr is None:
            return None
        return SlowBlock(block_hash, None, (), np.ascontiguousarray(arr, dtype=np.float16).tobytes())

    def announce(self) -> None:
        return None  # the manager re-announces what it rescanned when it starts (announce_on_start)

    def clear(self) -> None:
        self.mgr.discard(list(self._held))
        self._held.clear()

    def close(self) -> None:
        self.mgr.close()
