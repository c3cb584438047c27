"""The tiers below the simulator's GPU stand-in: the node agent's tier manager, sized in blocks.

:class:`~kvfleet.engine.kv.EngineKV` demotes every block its GPU stand-in
reclaims into :class:`AgentTiers`, a :class:`~kvfleet.agent.tiers.TierManager`
whose own gpu tier is off (the engine's block manager is the GPU), and promotes
from it. The simulator keeps what the agent keeps, where the agent keeps it:
cpu slots, ssd slab files (or a record file per block), Redis values, all in the
agent's record format (:mod:`kvfleet.agent.tiers.record`), with its codecs, its
background writers, its checks on every read and its restart rescan, which
drops corrupt records and re-announces the others (``BlockStored``, medium
``SSD``) when the engine starts.

Settings (:func:`manager_settings`): ``engine.tiers`` sizes the tiers in the
simulator's blocks — ``cpu_blocks`` (0: no cpu tier), ``ssd_dir`` and
``ssd_blocks`` (empty or 0: no ssd tier) — and the top-level ``tiers:`` gives
the rest (codecs, the ssd backend and ``direct_io``, the ssd and remote tiers'
watermarks, the remote tier, queue depth, writer threads,
``announce_on_start``). The cpu tier is an LRU of exactly ``cpu_blocks``
blocks: no watermark demotion; a put into the full tier sends its least
recently used block to the ssd/remote writers, or drops it when cpu is the last
tier. The manager's promotion rule and start-up calibration are not used: the
engine prices a promotion with its own cost model (``cpu_read_gbps``,
``ssd_read_gbps``) and reads a block where it is (:meth:`TierManager.read`).
With no tier configured the engine has :class:`NoTiers` (nothing below the
GPU, no threads).

Blocks cross the seam as fp16 arrays of the simulated KV bytes; with a lossy
codec (fp8, int4) a promoted block differs from a recomputation, which changes
the simulated output, as it would change a real model's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
from prometheus_client import CollectorRegistry

from kvfleet.agent.tiers import BlockMeta, TierError, TierManager, block_charge
from kvfleet.cache.events import EventSink, null_sink
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.engine import EngineSettings
from kvfleet.config.tiers import TierSettings

log = logging.getLogger(__name__)

#: how long a cache reset or a shutdown waits for the writers' queued blocks to land on ssd/remote.
DRAIN_S = 5.0
#: the largest hash a block header names (a 32-byte digest): what sizing a tier in blocks assumes.
_LARGEST_HASH = b"\xff" * 32


class SlowBlock(NamedTuple):
    """A block held on or below the GPU: its bytes plus what a KV event needs to announce it.

    A named tuple: the engine makes one for every block it computes.
    """

    block_hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    data: bytes


class SlowTiers(Protocol):
    """What :class:`~kvfleet.engine.kv.EngineKV` needs from the tiers below the GPU."""

    def put_many(self, blocks: Sequence[SlowBlock]) -> None:
        """Take blocks demoted from the GPU, oldest first (each may push an older block down, or be
        dropped)."""
        ...

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        """Tiers of the leading ``hashes`` present below the GPU (stops at the first miss)."""
        ...

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        """Read a block for promotion, leaving it where it is; ``None`` if it is gone or unreadable."""
        ...

    def clear(self) -> None:
        """Drop every block (``BlockRemoved`` each)."""
        ...

    def close(self) -> None:
        """Stop for good (blocks already on ssd/remote stay there for the next start)."""
        ...


class NoTiers:
    """No tier below the GPU: demoted blocks are dropped."""

    def put_many(self, blocks: Sequence[SlowBlock]) -> None:
        return None

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        return []

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        return None

    def clear(self) -> None:
        return None

    def close(self) -> None:
        return None


def block_shape(engine: EngineSettings, block_size: int) -> tuple[int, ...]:
    """The shape of one simulated block as it is stored: fp16, ``sim_kv_values_per_token`` per token."""
    return (block_size * engine.sim_kv_values_per_token,)


def manager_settings(engine: EngineSettings, block_size: int, tiers: TierSettings) -> TierSettings | None:
    """The tier manager's settings for this engine (see the module doc); ``None`` when no tier is configured.

    ``tiers`` with: the gpu tier off; the cpu tier on when ``cpu_blocks`` > 0, sized to that
    many blocks and without watermark demotion; the ssd tier on when ``ssd_dir`` is set and
    ``ssd_blocks`` > 0, in ``ssd_dir``, sized to that many blocks; no calibration; one
    promotion thread (the engine never queues a promotion).
    """
    t = engine.tiers
    cpu_on = t.cpu_blocks > 0
    ssd_on = bool(t.ssd_dir) and t.ssd_blocks > 0
    if not (cpu_on or ssd_on or tiers.remote.enabled):
        return None
    shape = block_shape(engine, block_size)
    largest = BlockMeta(hash=_LARGEST_HASH, dtype="float16", shape=shape, raw_nbytes=2 * shape[0],
                        parent=_LARGEST_HASH, token_ids=(2**32 - 1,) * block_size)
    cpu = dataclasses.replace(tiers.cpu, enabled=cpu_on, high_watermark=1.0, low_watermark=1.0)
    cpu_bytes = t.cpu_blocks * block_charge(Tier.CPU, cpu, largest) if cpu_on else 0
    cpu = dataclasses.replace(cpu, capacity_bytes=cpu_bytes)
    ssd = dataclasses.replace(tiers.ssd, enabled=ssd_on, path=t.ssd_dir or tiers.ssd.path)
    ssd_bytes = t.ssd_blocks * block_charge(Tier.SSD, ssd, largest) if ssd_on else 0
    ssd = dataclasses.replace(ssd, capacity_bytes=ssd_bytes)
    gpu = dataclasses.replace(tiers.gpu, enabled=False)
    return dataclasses.replace(tiers, gpu=gpu, cpu=cpu, ssd=ssd, calibrate=False, promotion_workers=1)


def check_ssd_dir(path: str) -> None:
    """Create ``path`` if needed; :class:`TierError` saying why when it cannot hold the ssd tier."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise TierError(f"engine.tiers.ssd_dir {path!r} is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TierError(f"engine.tiers.ssd_dir {path!r}: cannot create it: {exc.strerror or exc}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise TierError(f"engine.tiers.ssd_dir {path!r} is not writable")


def open_tiers(
    engine: EngineSettings,
    block_size: int,
    tiers: TierSettings,
    sink: EventSink = null_sink,
    registry: CollectorRegistry | None = None,
) -> SlowTiers:
    """The tiers below the GPU for ``engine``: :class:`AgentTiers`, or :class:`NoTiers` when none is
    configured.

    Raises :class:`TierError` when ``ssd_dir`` cannot hold the ssd tier. ``registry``: where the
    manager's ``kvfleet_tier_*`` series go (the engine's own ``/metrics``).
    """
    settings = manager_settings(engine, block_size, tiers)
    if settings is None:
        return NoTiers()
    if settings.ssd.enabled:
        check_ssd_dir(settings.ssd.path)
    return AgentTiers(settings, sink=sink, registry=registry)


class AgentTiers:
    """:class:`SlowTiers` on a :class:`TierManager` (see the module doc); ``settings`` from
    :func:`manager_settings`."""

    def __init__(
        self, settings: TierSettings, sink: EventSink = null_sink, registry: CollectorRegistry | None = None
    ) -> None:
        self.mgr = TierManager(settings, sink=sink, registry=registry)
        if settings.ssd.enabled and Tier.SSD not in self.mgr.stores:
            self.mgr.close()
            raise TierError(f"ssd tier: cannot open {settings.ssd.path} (the reason is logged above)")
        #: the fastest enabled tier: where a demoted block goes
        self.top = self.mgr.order[0]

    def put_many(self, blocks: Sequence[SlowBlock]) -> None:
        if not blocks:
            return
        # a refused block (no room anywhere, the writers' queue full) is simply not kept
        f16 = np.float16
        datas = [b.data for b in blocks]
        if len(set(map(len, datas))) == 1:  # blocks of one size (the simulator's): the rows of one array
            rows = np.frombuffer(b"".join(datas), dtype=f16).reshape(len(blocks), -1)
            self.mgr.put_rows([b.block_hash for b in blocks], rows, [b.parent for b in blocks],
                              [b.token_ids for b in blocks], tier=self.top)
            return
        # each block's bytes as an array without a copy (the manager copies them into its tier)
        items = [(b.block_hash, np.frombuffer(b.data, dtype=f16), b.parent, b.token_ids) for b in blocks]
        self.mgr.put_many(items, tier=self.top)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        return self.mgr.lookup(hashes).tiers

    def get(self, block_hash: BlockHash) -> SlowBlock | None:
        arr = self.mgr.read(block_hash)
        if arr is None:
            return None
        return SlowBlock(block_hash, None, (), np.ascontiguousarray(arr, dtype=np.float16).tobytes())

    def clear(self) -> None:
        """Wait (up to :data:`DRAIN_S`) for queued writes, then drop every block of every tier."""
        self.mgr.drain(DRAIN_S)
        self.mgr.clear()

    def close(self) -> None:
        """Let queued writes land (up to :data:`DRAIN_S`), then stop the manager (memory tiers are lost)."""
        self.mgr.drain(DRAIN_S)
        self.mgr.close()
