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

Other engines' layouts are read too: events as tagged *arrays*
(``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]``:
SGLang and older vLLM), the batch as a *map* (``{"ts", "events",
"data_parallel_rank"}``, SGLang's ``attn_dp_rank``), events without ``medium``.

Fields are validated on decoding: token ids must fit 32 bits (``[0, 2^32)``) and
``block_size`` be positive. :func:`decode_batch` refuses a batch with any
invalid event; :func:`decode_batch_lenient` (the EPP's reader) keeps the valid
events of a batch and reports the others, so one bad event costs only itself.

``medium`` carries the tier (``"GPU"``, ``"CPU"``, ``"SSD"``, ``"REMOTE"``; other
engines' names are mapped by :meth:`kvfleet.cache.tiers.Tier.from_medium`).
Block hashes are ``int`` (64-bit) or ``bytes`` (SHA-256), as in vLLM.

:func:`scan_batch` reads a batch in vLLM's own layout straight from its bytes in one compiled pass
(``_events.c``), for the EPP's ingestion, where one engine step's batch of one-block events would otherwise
cost more to decode into objects than to index: it returns the batch's events merged into runs of keys and
declines (``None``) any batch it cannot read completely or with an invalid event, which
:func:`decode_batch_lenient` then reads (``tests/cache/test_events_scan.py`` compares the two on vLLM's own
batches and on mutated ones).

The transport (ZMQ framing, sequence numbers, replay) is :mod:`kvfleet.cache.kvwire`;
this module only encodes and decodes payloads, and collects events emitted by
the cache core.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from kvfleet.cache.compiled import load, ptr
from kvfleet.cache.errors import EventDecodeError

BlockHashWire = int | bytes
TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=False):
    """Base of the three event types (a msgpack map tagged ``type`` = class name)."""


class BlockStored(KVCacheEvent):
    """Blocks were stored (``token_ids`` covers all of them, ``block_size`` each)."""

    block_hashes: list[BlockHashWire]
    parent_block_hash: BlockHashWire | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(gt=0)]
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
_RAW = msgspec.msgpack.Decoder()

#: positional fields of events sent as tagged arrays (after the tag), and their optional tail
_EVENTS: dict[str, tuple[type[KVCacheEvent], tuple[str, ...], tuple[str, ...]]] = {
    "BlockStored": (
        BlockStored,
        ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
        ("lora_id", "medium"),
    ),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium"), ("medium",)),
    "AllBlocksCleared": (AllBlocksCleared, (), ()),
}


@dataclass
class DecodedBatch:
    """A batch read by :func:`decode_batch_lenient`: its valid events and what was dropped."""

    batch: KVEventBatch
    refused: list[str] = field(default_factory=list)
    """One reason per event dropped."""
    reset_at: int | None = None
    """Set when a dropped event may have removed blocks (an unreadable ``BlockRemoved`` or an event
    whose type cannot be read): the pod's entries must be cleared before ``batch.events[reset_at:]``
    are applied, and the events before it are superseded."""


class _Refused(Exception):
    def __init__(self, reason: str, unsafe: bool) -> None:
        super().__init__(reason)
        self.unsafe = unsafe


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes, exactly as vLLM's ``ZmqEventPublisher`` encodes them."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a payload; raises :class:`EventDecodeError` on anything malformed (any invalid event)."""
    out = decode_batch_lenient(payload)
    if out.refused:
        raise EventDecodeError(f"invalid KVEventBatch payload ({len(payload)} bytes): {out.refused[0]}")
    return out.batch


def decode_batch_lenient(payload: bytes | memoryview) -> DecodedBatch:
    """Decode a payload, dropping invalid events one by one (see :class:`DecodedBatch`).

    Raises :class:`EventDecodeError` only when the batch itself is unreadable (not msgpack, not a
    batch, no event list)."""
    try:
        return DecodedBatch(_DECODER.decode(payload))
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass  # another engine's layout, or an invalid event: read it element by element
    try:
        raw = _RAW.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"invalid KVEventBatch payload ({len(payload)} bytes): {exc}") from exc
    ts, events, rank = _batch_parts(raw, len(payload))
    out = DecodedBatch(KVEventBatch(ts=ts, events=[], data_parallel_rank=rank))
    for i, ev in enumerate(events):
        try:
            out.batch.events.append(_event(ev))
        except _Refused as exc:
            out.refused.append(f"event {i}: {exc}")
            if exc.unsafe:
                out.reset_at = len(out.batch.events)
    return out


def _batch_parts(raw: Any, size: int) -> tuple[float, list[Any], int | None]:
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events = raw.get("ts", 0.0), raw["events"]
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise EventDecodeError(f"invalid KVEventBatch payload ({size} bytes): not a batch")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list):
        raise EventDecodeError(f"invalid KVEventBatch payload ({size} bytes): bad ts or events")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None
    return float(ts), events, rank


def _event(raw: Any) -> AnyEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        data = dict(raw)
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _EVENTS[tag][1] if tag in _EVENTS else ()
        data = dict(zip(names, raw[1:], strict=False))
        data["type"] = tag
    else:
        raise _Refused("not an event", unsafe=True)
    if not isinstance(tag, str):
        raise _Refused("event without a type", unsafe=True)
    if tag not in _EVENTS:
        raise _Refused(f"unknown event type {tag[:64]!r}", unsafe=False)
    cls, _, optional = _EVENTS[tag]
    for name in optional:
        data.setdefault(name, None)
    try:
        ev: AnyEvent = msgspec.convert(data, cls)  # type: ignore[assignment]
    except msgspec.ValidationError as exc:
        raise _Refused(f"invalid {tag}: {exc}", unsafe=cls is not BlockStored) from None
    return ev


# a step's batch is scanned in about a microsecond: the ingestion thread keeps the GIL through it (handing it
# over and taking it back costs as much; paired runs of the subscriber's loop: 11.0–12.3 against 11.8–12.5 µs
# a 16-event batch); a payload above HOLD_GIL_BYTES (≈ 20 µs of scan and more, up to ≈ 5 ms at the 16 MiB
# cap) is scanned with the GIL released, so the threads that route are not held up
_held = load(Path(__file__).parent, "_events", "KV-event scanner", hold_gil=True).kv_scan_batch
_free = load(Path(__file__).parent, "_events", "KV-event scanner").kv_scan_batch
for _fn in (_held, _free):
    _fn.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    _fn.restype = ctypes.c_int64
#: the largest payload scanned with the GIL held
HOLD_GIL_BYTES = 64 << 10
#: words per run in ``kv_scan_batch``'s output
_OP_WORDS = 7
#: the smallest event in vLLM's layout (``{"type": "AllBlocksCleared"}``) is 23 bytes: a bound on the runs
_MIN_EVENT_BYTES = 16
_KINDS: tuple[type[AnyEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
_U64, _F64 = struct.Struct("<Q"), struct.Struct("<d")


#: a :class:`BatchScanner`'s lasting buffers: keys (a batch's hashes and those its caller keeps in front of
#: them) and runs; a batch that needs more gets buffers of its own (:meth:`BatchScanner.fits`)
SCAN_KEYS = 1 << 16
SCAN_RUNS = 1 << 12
#: the kinds of :attr:`ScannedRun.kind` as :meth:`BatchScanner.scan` numbers them
STORED, REMOVED, CLEARED = 0, 1, 2

#: a run as :meth:`BatchScanner.scan` gives it: (kind: :data:`STORED`, :data:`REMOVED` or :data:`CLEARED`,
#: medium, first key in the scanner's ``keys``, key count, events, hash_keys as 0/1; see :class:`ScannedRun`)
RawRun = tuple[int, str | None, int, int, int, int]


class BatchScanner:
    """:func:`scan_batch` with buffers kept from one batch to the next (one per pod: not thread-safe).

    A batch's keys are written to :attr:`keys` from the offset the caller gives, so a caller can keep the
    keys of earlier batches in front of them (the EPP holds a pod's stores until a read of its socket ends
    and indexes them in one operation). Its lasting buffers are ``SCAN_KEYS`` keys and ``SCAN_RUNS`` runs
    (0.7 MB of address space; the pages written stay resident); a batch that needs more is scanned by a
    scanner of its own size (:meth:`fits`)."""

    def __init__(self, block_size: int, chain_bytes: bool, keys: int = SCAN_KEYS,
                 runs: int = SCAN_RUNS) -> None:
        self.block_size = block_size
        self.chain_bytes = chain_bytes
        self.keys = np.empty(max(1, keys), dtype=np.uint64)
        self._runs_cap = max(1, runs)
        self._ops = np.empty(1 + self._runs_cap * _OP_WORDS, dtype=np.uint64)
        self._keys_at, self._ops_at = ptr(self.keys), ptr(self._ops)

    @classmethod
    def sized(cls, block_size: int, chain_bytes: bool, payload_bytes: int) -> BatchScanner:
        """A scanner whose buffers fit a payload of this size (every hash takes a byte at least, every event
        more than ``_MIN_EVENT_BYTES``)."""
        return cls(block_size, chain_bytes, payload_bytes, payload_bytes // _MIN_EVENT_BYTES + 1)

    def fits(self, payload_bytes: int, at: int = 0) -> bool:
        """Whether a payload of this size is sure to fit the buffers with its keys written from ``at``."""
        return at + payload_bytes <= len(self.keys) and payload_bytes // _MIN_EVENT_BYTES < self._runs_cap

    def scan(self, payload: bytes, at: int = 0) -> tuple[float, list[RawRun]] | None:
        """The batch's timestamp and runs (:data:`RawRun`), its keys in ``keys[first : first + count]``
        written from ``at``; ``None`` as :func:`scan_batch` (or when the buffers are too small)."""
        n = len(payload)
        if n == 0 or at < 0 or at >= len(self.keys):
            return None
        call = _held if n <= HOLD_GIL_BYTES else _free
        got = call(payload, n, self.block_size, self.chain_bytes, self._ops_at, self._runs_cap,
                   self._keys_at + 8 * at, len(self.keys) - at)
        if got < 0:
            return None
        head = self._ops[: 1 + got * _OP_WORDS].tolist()
        runs: list[RawRun] = []
        for i in range(1, len(head), _OP_WORDS):
            kind, off, mlen, first, count, events, hash_keys = head[i : i + _OP_WORDS]
            runs.append((kind, payload[off - 1 : off - 1 + mlen].decode() if off else None, at + first, count,
                         events, hash_keys))
        return _F64.unpack(_U64.pack(head[0]))[0], runs


class ScannedRun(NamedTuple):
    """Consecutive events of one type and one ``medium`` of a scanned batch."""

    kind: type[AnyEvent]
    medium: str | None
    keys: npt.NDArray[np.uint64]
    """Their block hashes' 64-bit form (:func:`~kvfleet.cache.hashing.to_int64`), in order; empty for
    ``AllBlocksCleared``."""
    events: int
    hash_keys: bool
    """Every ``BlockStored`` of the run has the scan's ``block_size``, token ids covering its blocks, and a
    parent and hashes that are ints (or, with ``chain_bytes``, 32-byte ``bytes``): what decides whether its
    hashes may stand for the picker's keys (:mod:`kvfleet.epp.ingest`)."""


class ScannedBatch(NamedTuple):
    ts: float
    runs: list[ScannedRun]


def scan_batch(payload: bytes, block_size: int, chain_bytes: bool) -> ScannedBatch | None:
    """A batch in vLLM's layout (an array ``[ts, events(, rank)]`` of events as maps tagged ``type``, every
    field present and valid, unknown fields skipped) read in one compiled pass into runs of keys; ``None``
    for anything else (another layout, an invalid or incomplete event, trailing bytes...), which
    :func:`decode_batch_lenient` reads. ``block_size`` and ``chain_bytes`` only decide
    :attr:`ScannedRun.hash_keys`. (:class:`BatchScanner` keeps its buffers from one batch to the next.)"""
    scanner = BatchScanner.sized(block_size, chain_bytes, len(payload))
    scan = scanner.scan(payload)
    if scan is None:
        return None
    ts, runs = scan
    return ScannedBatch(ts, [ScannedRun(_KINDS[kind], medium, scanner.keys[first : first + count], events,
                                        hash_keys == 1)
                             for kind, medium, first, count, events, hash_keys in runs])


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
        return KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                            data_parallel_rank=self.data_parallel_rank)


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
