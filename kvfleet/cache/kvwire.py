"""The KV-event wire protocol, in one place: vLLM's ``ZmqEventPublisher`` framing and its replay.

Everything that writes or reads KV events on ZMQ (the engine simulator's and the
agent's publisher, the EPP's subscriber, the test pods) frames messages with
these functions, so the protocol has one definition. No sockets here: this
module only builds and parses frames and decides, for one publisher's stream,
which batch to apply next (:class:`FeedSequencer`).

Live stream (PUB → SUB), three frames per batch::

    [topic, seq (8 bytes, big-endian), payload (msgpack KVEventBatch)]

``seq`` starts at 0 when the publisher starts and grows by one per batch.

Replay (ROUTER on the publisher, DEALER on the subscriber). The subscriber sends
``[b"", start_seq (8 bytes, big-endian)]``; the publisher answers, for every
batch it still buffers with ``seq >= start_seq``, ``[b"", seq, payload]`` and
ends with the marker ``[b"", -1 (8 bytes, signed big-endian), b""]``. That is
what vLLM and SGLang 0.5.3 send. SGLang 0.5.23 puts the topic frame in its
replay answers (``[b"", topic, seq, payload]``, and ``[b"", b"", -1, b""]`` for
the marker): :func:`parse_replay_answer` reads both forms (tests/interop runs
both engines' publishers against it).

Restart semantics: a publisher that restarts counts from 0 again, and the first
messages after a (re)connection may be lost (ZMQ's slow joiner). So any live
sequence number not above the last one seen means the publisher restarted: the
pod's entries are rebuilt (cleared, replayed from 0). A gap is filled from the
replay buffer; when it cannot be (no replay endpoint, the buffer no longer
reaches back, a hole in the answer, no answer in time) the pod's entries are
cleared and the stream is accepted from the next batch at hand. Entries are
never kept across a missing batch, so the index never holds a block whose
removal was lost (it may miss blocks stored before a clear).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

SEQ = struct.Struct(">q")
END_SEQ = SEQ.pack(-1)
"""The replay end marker's sequence frame (``-1``, 8 bytes signed big-endian)."""
END = -1


class KVWireError(ValueError):
    """Frames that do not follow the KV-event wire protocol."""


def pack_seq(seq: int) -> bytes:
    if not 0 <= seq < 1 << 63:
        raise KVWireError(f"sequence number out of range: {seq}")
    return seq.to_bytes(8, "big")


def unpack_seq(raw: bytes) -> int:
    """A sequence frame (signed, so the end marker reads ``-1``)."""
    if len(raw) != 8:
        raise KVWireError(f"sequence frame of {len(raw)} bytes (8 expected)")
    value: int = SEQ.unpack(raw)[0]
    return value


class LiveMessage(NamedTuple):
    """One live batch as its three frames carry it (a tuple: one is made per batch received)."""

    topic: bytes
    seq: int
    payload: bytes


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames a PUB socket sends for one batch."""
    return [topic, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    if len(frames) != 3:
        raise KVWireError(f"live message of {len(frames)} frames (3 expected)")
    seq = unpack_seq(frames[1])
    if seq < 0:
        raise KVWireError(f"negative sequence number {seq} in a live message")
    return LiveMessage(bytes(frames[0]), seq, bytes(frames[2]))


def replay_request(start: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from ``start`` on."""
    return [b"", pack_seq(start)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """``(peer identity, start)`` from what a ROUTER received (``[identity, b"", start]``; a
    DEALER that left out the empty delimiter is accepted too)."""
    if len(frames) == 3 and frames[1] == b"":
        ident, raw = frames[0], frames[2]
    elif len(frames) == 2:
        ident, raw = frames[0], frames[1]
    else:
        raise KVWireError(f"replay request of {len(frames)} frames")
    if len(raw) != 8:
        raise KVWireError(f"replay start of {len(raw)} bytes (8 expected)")
    return bytes(ident), int.from_bytes(raw, "big")  # unsigned, as vLLM reads it


def replay_item(ident: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One buffered batch of a replay answer, as a ROUTER sends it."""
    return [ident, b"", pack_seq(seq), payload]


def replay_end(ident: bytes) -> list[bytes]:
    """The end marker closing a replay answer."""
    return [ident, b"", END_SEQ, b""]


def parse_replay_answer(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one replay frame set received on a DEALER; ``seq`` is :data:`END` for the end
    marker."""
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 2:
        seq_raw, payload = parts
    elif len(parts) == 3:  # [topic, seq, payload]: SGLang 0.5.23's form (its end marker has an empty topic)
        _, seq_raw, payload = parts
    else:
        raise KVWireError(f"replay answer of {len(frames)} frames")
    seq = unpack_seq(seq_raw)
    if seq < END:
        raise KVWireError(f"negative sequence number {seq} in a replay answer")
    return seq, bytes(payload)


# --- ordering one publisher's stream ---------------------------------------------------------


@dataclass
class SequenceStats:
    """Counters of one feed's ordering (the subscriber extends them)."""

    gaps: int = 0
    """Live batches that arrived ahead of the next expected sequence number."""
    replayed: int = 0
    """Batches applied from replay answers."""
    resyncs: int = 0
    """Times the pod's entries were cleared to stay exact (restart, unfillable gap, hole, no answer)."""
    restarts: int = 0
    """Publisher restarts seen (a live sequence number not above the last one)."""
    replay_holes: int = 0
    """Replay answers with batches missing (inside, or between the answer and the live stream)."""
    replay_timeouts: int = 0
    """Replay requests not answered in time."""
    duplicates: int = 0
    """Batches received twice (live and replayed) and skipped."""


class FeedSink(Protocol):
    """What a :class:`FeedSequencer` drives: the index side and the replay socket of one pod."""

    def apply(self, seq: int, payload: bytes, replayed: bool) -> None:
        """Apply one batch (in sequence order; must not raise)."""

    def clear(self, reason: str) -> None:
        """Forget every entry of the pod."""

    def request_replay(self, start: int) -> None:
        """Send a replay request from ``start`` (dropping any earlier one and its answer)."""

    def cancel_replay(self) -> None:
        """Drop the outstanding replay request, if any (its late answer must not arrive)."""


@dataclass
class _Replay:
    start: int
    full: bool
    deadline: float
    hard_deadline: float
    applied: int = 0


class FeedSequencer:
    """Decides, for one publisher, which batch is applied next; time is passed in (``now``, seconds).

    ``replay``: the pod has a replay endpoint. A replay request is answered within
    ``timeout_s`` of silence (and ``total_timeout_s`` overall) or given up; after
    that the endpoint is not asked again for ``backoff_s`` (doubling up to
    ``max_backoff_s`` while it stays silent). Live batches that arrive while a
    request is outstanding wait (at most ``max_pending`` of them and
    ``max_pending_bytes``; beyond that the request is given up). A full rebuild
    whose answer has a hole is retried ``max_full_retries`` times; then the pod
    keeps what follows the last hole.
    """

    def __init__(
        self,
        sink: FeedSink,
        *,
        replay: bool,
        stats: SequenceStats | None = None,
        timeout_s: float = 2.0,
        total_timeout_s: float = 30.0,
        backoff_s: float = 5.0,
        max_backoff_s: float = 60.0,
        max_pending: int = 20_000,
        max_pending_bytes: int = 256 << 20,
        max_full_retries: int = 2,
    ) -> None:
        self.sink = sink
        self.replay_enabled = replay
        self.stats = stats if stats is not None else SequenceStats()
        self.timeout_s = timeout_s
        self.total_timeout_s = total_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_full_retries = max_full_retries
        #: next sequence number to apply; ``None``: the pod is empty and the next batch at hand starts it
        self.expected: int | None = None
        self.last_live: int | None = None
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self._replay: _Replay | None = None
        self._suspended_until = 0.0
        self._next_backoff = backoff_s
        self._full_retries = 0
        #: why the last replay request was given up (for the subscriber's log)
        self.gave_up = ""

    # --- inputs ----------------------------------------------------------------------------
    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @property
    def deadline(self) -> float | None:
        """When the outstanding replay request is given up (``None``: none outstanding)."""
        r = self._replay
        return None if r is None else min(r.deadline, r.hard_deadline)

    def start(self, now: float) -> None:
        """A new subscription: the pod's entries are rebuilt from the replay buffer (or from the next
        batch)."""
        self.sink.clear("subscribed")
        self.expected = None
        if self._replay_usable(now):
            self._request(now, 0, full=True)

    def on_live(self, now: float, seq: int, payload: bytes) -> None:
        if self.last_live is not None and seq <= self.last_live:
            self.stats.restarts += 1
            previous, self.last_live = self.last_live, seq
            self._drop_pending()
            self._cancel()
            self._pending[seq] = payload
            self._pending_bytes = len(payload)
            self._rebuild(now, f"publisher restarted (sequence {seq} after {previous})")
            return
        self.last_live = seq
        if self._replay is not None:
            self._hold(now, seq, payload)
            return
        if self.expected is None:
            self.expected = seq
        if seq < self.expected:
            self.stats.duplicates += 1
            return
        if seq > self.expected:
            self.stats.gaps += 1
            self._hold(now, seq, payload)
            if self._replay_usable(now):
                self._request(now, self.expected, full=False)
            else:
                self._reset("sequence gap without replay")
                self._settle()
            return
        self._emit(seq, payload, replayed=False)
        self._drain()

    def on_reconnect(self, now: float) -> None:
        """The live connection dropped and came back: batches may be lost, the publisher may be new."""
        self.last_live = None
        self._drop_pending()
        self._cancel()
        self._rebuild(now, "publisher reconnected")

    def on_replay(self, now: float, seq: int, payload: bytes) -> None:
        """One frame set of the outstanding replay answer (``seq == END`` for its end marker)."""
        r = self._replay
        if r is None:
            return
        if seq == END:
            self._end(now)
            return
        r.deadline = now + self.timeout_s
        if seq < r.start:
            return
        if self.expected is None:  # a rebuild: the buffer's oldest batch starts the pod
            self.expected = seq
        if seq < self.expected:
            self.stats.duplicates += 1
            return
        if seq > self.expected:
            if not r.full and r.applied == 0:  # the buffer no longer reaches back to the gap
                self._cancel()
                self._rebuild(now, f"gap at {self.expected} older than the replay buffer (starts at {seq})")
                return
            self.stats.replay_holes += 1
            if self._retry_full(now, f"replay answer skips {self.expected}..{seq - 1}"):
                return
            self._reset(f"replay answer skips {self.expected}..{seq - 1}")
            self.expected = seq
        self._emit(seq, payload, replayed=True)
        r.applied += 1

    def poll(self, now: float) -> None:
        """Give up an outstanding replay request whose deadline passed."""
        r = self._replay
        if r is None or now < min(r.deadline, r.hard_deadline):
            return
        self._give_up(now, "no replay answer in time")

    # --- internals -------------------------------------------------------------------------
    def _replay_usable(self, now: float) -> bool:
        return self.replay_enabled and now >= self._suspended_until

    def _request(self, now: float, start: int, *, full: bool) -> None:
        self._replay = _Replay(start, full, now + self.timeout_s, now + self.total_timeout_s)
        self.sink.request_replay(start)

    def _cancel(self) -> None:
        if self._replay is not None:
            self._replay = None
            self.sink.cancel_replay()

    def _rebuild(self, now: float, reason: str) -> None:
        """Clear the pod and replay from 0 (or, without a usable replay, start from the batches at hand)."""
        self._reset(reason)
        if self._replay_usable(now):
            self._request(now, 0, full=True)
        else:
            self._settle()

    def _retry_full(self, now: float, reason: str) -> bool:
        if self._full_retries >= self.max_full_retries or not self._replay_usable(now):
            return False
        self._full_retries += 1
        self._cancel()
        self._rebuild(now, reason)
        return True

    def _reset(self, reason: str) -> None:
        self.stats.resyncs += 1
        self.expected = None
        self.sink.clear(reason)

    def _hold(self, now: float, seq: int, payload: bytes) -> None:
        if seq in self._pending:
            return
        self._pending[seq] = payload
        self._pending_bytes += len(payload)
        if self._replay is not None and (len(self._pending) > self.max_pending
                                         or self._pending_bytes > self.max_pending_bytes):
            self._give_up(now, "too many live batches waiting for the replay answer")

    def _drop_pending(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0

    def _emit(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self.expected = seq + 1
        if replayed:
            self.stats.replayed += 1
        self.sink.apply(seq, payload, replayed)

    def _drain(self) -> None:
        """Apply the waiting live batches that follow on; drop those already applied."""
        if not self._pending or self.expected is None:
            return
        for s in [s for s in self._pending if s < self.expected]:
            self._pending_bytes -= len(self._pending.pop(s))
            self.stats.duplicates += 1
        while self.expected in self._pending:
            payload = self._pending.pop(self.expected)
            self._pending_bytes -= len(payload)
            self._emit(self.expected, payload, replayed=False)

    def _settle(self) -> None:
        """Apply every waiting batch; at each hole, clear the pod and start again after it."""
        while self._pending:
            if self.expected is None:
                self.expected = min(self._pending)
            self._drain()
            if self._pending:
                self._reset(f"batches {self.expected}..{min(self._pending) - 1} lost")
        if not self._pending:
            self._pending_bytes = 0

    def _end(self, now: float) -> None:
        r = self._replay
        assert r is not None
        self._replay = None
        self.sink.cancel_replay()
        if self.expected is None and self._pending:  # nothing buffered: the live batches start the pod
            self.expected = min(self._pending)
        self._drain()
        if not self._pending:
            self._full_retries = 0
            self._next_backoff = self.backoff_s
            return
        assert self.expected is not None
        reason = f"batches {self.expected}..{min(self._pending) - 1} neither replayed nor received"
        if not r.full and r.applied == 0:
            self._rebuild(now, f"gap at {self.expected} not in the replay buffer")
            return
        self.stats.replay_holes += 1
        if self._retry_full(now, reason):
            return
        self._reset(reason)
        self._settle()

    def _give_up(self, now: float, reason: str) -> None:
        """Drop the outstanding request; the batches at hand continue the pod (cleared at a hole)."""
        self.gave_up = reason
        self.stats.replay_timeouts += 1
        self._cancel()
        self._suspended_until = now + self._next_backoff
        self._next_backoff = min(self._next_backoff * 2, self.max_backoff_s)
        self._settle()
