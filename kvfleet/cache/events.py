"""KV events in vLLM's wire format (``vllm.distributed.kv_events``).

vLLM's ZMQ publisher sends ``KVEventBatch`` objects encoded with
``msgspec.msgpack.Encoder()``: the batch is a msgpack *array*
``[ts, events, data_parallel_rank]`` and each event a msgpack *map* tagged with
``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); fields at
their default may be omitted, and newer vLLM versions add optional fields
(``extra_keys``, ``group_idx``, ...) that a reader must tolerate. The structs
below reproduce that layout, so a subscriber written for vLLM pods reads
kvfleet's events and kvfleet reads vLLM's (round-trip tested against batches
encoded by vLLM itself, ``tests/cache/data/``).

``medium`` carries the tier (``"GPU"``, ``"CPU"``, ``"SSD"``, ``"REMOTE"``).
Block hashes are ``int`` (64-bit) or ``bytes`` (SHA-256), as in vLLM.

The transport (ZMQ PUB framing ``[topic, seq(8 bytes big-endian), payload]``)
lives with the publisher and subscriber in the agent and EPP; this module only
encodes and decodes payloads, and collects events emitted by the cache core.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from kvfleet.cache.errors import EventDecodeError

BlockHashWire = int | bytes


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=False):
    """Base of the three event types (a msgpack map tagged ``type`` = class name)."""


class BlockStored(KVCacheEvent):
    """Blocks were stored (``token_ids`` covers all of them, ``block_size`` each)."""

    block_hashes: list[BlockHashWire]
    parent_block_hash: BlockHashWire | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    #: ``UNSET`` when an older publisher left it out; written whenever set (even to ``None``),
    #: which keeps our messages field-for-field equal to vLLM's.
    lora_name: str | msgspec.UnsetType | None = msgspec.UNSET


class BlockRemoved(KVCacheEvent):
    """Blocks were dropped from ``medium`` (they may still live in another tier)."""

    block_hashes: list[BlockHashWire]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher is gone (cache reset)."""


AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch as vLLM sends it: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[AnyEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes, exactly as vLLM's ``ZmqEventPublisher`` encodes them."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a payload; raises :class:`EventDecodeError` on anything malformed."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError(f"invalid KVEventBatch payload ({len(payload)} bytes): {exc}") from exc


EventSink = Callable[[AnyEvent], None]
"""Where the cache core sends events (the agent's publisher, a test list, ...)."""


def null_sink(event: AnyEvent) -> None:
    """The default sink: drops events."""


class EventBuffer:
    """A thread-safe sink that collects events and drains them as batches.

    The block manager and radix tree call it synchronously on every store and
    removal; a publisher drains it once per engine step (as vLLM does) so the
    step loop never waits on a socket.
    """

    def __init__(self, data_parallel_rank: int | None = None, max_events: int = 1_000_000) -> None:
        self._events: list[AnyEvent] = []
        self._lock = threading.Lock()
        self.data_parallel_rank = data_parallel_rank
        self.max_events = max_events
        self.dropped = 0

    def __call__(self, event: AnyEvent) -> None:
        with self._lock:
            if len(self._events) >= self.max_events:
                self.dropped += 1
                return
            self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def drain(self, ts: float | None = None) -> KVEventBatch | None:
        """Everything collected so far as one batch, or ``None`` when empty."""
        with self._lock:
            if not self._events:
                return None
            events, self._events = self._events, []
        return KVEventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=self.data_parallel_rank)


def stored(
    hashes: Sequence[BlockHashWire],
    parent: BlockHashWire | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> BlockStored:
    """A ``BlockStored`` event (plain Python lists, as msgspec encodes them)."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(token_ids),
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
    )


def removed(hashes: Iterable[BlockHashWire], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def as_plain(batch: KVEventBatch) -> list[Any]:
    """The batch as plain Python objects (what a generic msgpack reader sees)."""
    plain: list[Any] = msgspec.to_builtins(batch)
    return plain
