"""KV events over ZMQ, framed exactly as vLLM's ``ZmqEventPublisher`` frames them
(:mod:`kvfleet.cache.kvwire`).

* PUB socket (``tcp://HOST:kv_events_port``): each batch is three frames
  ``[topic, seq (8-byte big-endian, from 0, +1 per batch), msgpack KVEventBatch]``.
* ROUTER replay socket (``tcp://HOST:kv_events_replay_port``): a DEALER/REQ
  peer sends ``[b"", start_seq]``; the publisher answers every buffered batch
  with ``seq >= start_seq`` as ``[b"", seq, payload]`` (no topic frame, as vLLM)
  and ends with ``[b"", -1 (8-byte signed big-endian), b""]``. The last
  ``buffer_steps`` batches are kept (vLLM's ``buffer_steps``), and no more than
  ``buffer_bytes`` of them (oldest dropped first), so a flood of distinct prompts
  cannot grow the engine without bound; the ROUTER never drops part of an answer
  (no send high-water mark: an answer is bounded by the buffer). The PUB socket
  queues at most ``SNDHWM`` batches per slow subscriber (ZMQ then drops, and the
  subscriber sees a gap and replays).

Sending runs on one thread that owns both sockets (ZMQ sockets are not
thread-safe), fed by a queue: the engine's step loop only encodes and enqueues.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from kvfleet.cache import kvwire
from kvfleet.cache.events import KVEventBatch, encode_batch
from kvfleet.cache.kvwire import END_SEQ

__all__ = ["END_SEQ", "PortInUseError", "ZmqPublisher"]

log = logging.getLogger(__name__)
_FORGET = object()


class PortInUseError(OSError):
    """A ZMQ endpoint could not be bound (another process holds the port)."""


class ZmqPublisher:
    """PUB + replay ROUTER on one thread (see the module doc)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10000,
        buffer_bytes: int = 32 << 20,
        sndhwm: int = 1000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._queue: queue.Queue[bytes | object | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_steps = max(1, buffer_steps)
        self.buffer_cap = max(1, buffer_bytes)
        self.buffer_bytes = 0
        self._seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, max(1, sndhwm))
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.SNDHWM, 0)
                self._router.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(0)
            if self._router is not None:
                self._router.close(0)
            raise PortInUseError(
                f"cannot bind KV-event endpoint: {exc} ({endpoint}, {replay_endpoint})") from exc
        self.published = 0
        self.replayed = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, batch: KVEventBatch) -> None:
        """Encode and queue a batch (never blocks on the network)."""
        self._queue.put(encode_batch(batch))

    def publish_encoded(self, payload: bytes) -> None:
        """Queue a batch already encoded (:func:`~kvfleet.cache.events.encode_batch`)."""
        self._queue.put(bytes(payload))

    def forget_history(self) -> None:
        """Drop the replay buffer before the next batch (after a cache reset nothing older matters).

        Sequence numbers keep counting, so a subscriber asking for an older
        ``start_seq`` sees the buffer begin later and resyncs from what is left,
        which starts with the reset's ``AllBlocksCleared``.
        """
        self._queue.put(_FORGET)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while True:
            if self._router is not None and poller.poll(timeout=0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if payload is None:
                return
            if payload is _FORGET:
                self._buffer.clear()
                self.buffer_bytes = 0
                continue
            assert isinstance(payload, bytes)
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            self.buffer_bytes += len(payload)
            while len(self._buffer) > 1 and (len(self._buffer) > self._buffer_steps
                                             or self.buffer_bytes > self.buffer_cap):
                self.buffer_bytes -= len(self._buffer.popleft()[1])
            try:
                self._pub.send_multipart(kvwire.live_frames(self.topic, seq, payload), copy=False)
                self.published += 1
            except zmq.ZMQError as exc:  # pragma: no cover - socket closed under us
                log.warning("kv events: send failed (%s)", exc)

    def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ident, start = kvwire.parse_replay_request(frames)
            except kvwire.KVWireError as exc:
                log.warning("kv events: malformed replay request (%s)", exc)
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart(kvwire.replay_item(ident, seq, payload))
                    self.replayed += 1
            self._router.send_multipart(kvwire.replay_end(ident))
