"""Transport of the write path: ZMQ SUB to every pod's KV-event publisher, in vLLM's framing.

Each message is ``[topic, seq (8-byte big-endian), msgpack KVEventBatch]``. One
thread owns every socket (ZMQ sockets are not thread-safe) and polls them; each
pod's batches are applied in sequence order by that pod's
:class:`~kvfleet.epp.ingest.PodEventApplier`.

Bootstrap: when a pod is added (picker start, pod discovered) the subscriber
asks its replay buffer for everything from sequence 0 right away (ROUTER
socket: send ``[b"", start_seq]``, receive ``[b"", topic, seq, payload]`` …
end marker with seq ``-1``), so the blocks of an idle pod are known before it
publishes again; live batches already covered by the replay are skipped.
Gaps: a later sequence than expected is filled from the replay buffer. When replay is
not configured, times out or no longer covers the gap, the pod's blocks are
cleared and whatever replay still has is applied (a partial resync, counted in
``resyncs``). A sequence that goes backwards means the publisher restarted: the
pod is cleared and the stream accepted from there.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvfleet.cache.errors import EventDecodeError
from kvfleet.cache.events import decode_batch
from kvfleet.epp.ingest import PodEventApplier

log = logging.getLogger(__name__)
_SEQ = struct.Struct(">q")


@dataclass
class FeedStats:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    decode_errors: int = 0


@dataclass
class _Feed:
    pod: str
    endpoint: str
    replay: str | None
    applier: PodEventApplier
    sock: zmq.Socket[bytes]
    expected: int = 0
    stats: FeedStats | None = None


class EventSubscriber:
    """Subscribes to pods' KV events; :meth:`add_pod`/:meth:`remove_pod` are safe from any thread."""

    def __init__(self, replay_timeout_s: float = 1.0, on_batch: Callable[[str], None] | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._cmds: queue.Queue[tuple[str, tuple[object, ...]]] = queue.Queue()
        self._feeds: dict[str, _Feed] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_timeout_s = replay_timeout_s
        self.on_batch = on_batch
        self.stats: dict[str, FeedStats] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def add_pod(self, pod: str, endpoint: str, replay: str | None, applier: PodEventApplier) -> None:
        self._cmds.put(("add", (pod, endpoint, replay, applier)))

    def remove_pod(self, pod: str) -> None:
        self._cmds.put(("remove", (pod,)))

    # --- the socket thread ------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._commands(poller)
                if not self._feeds:  # zmq's poll returns at once with nothing registered: never spin
                    self._stop.wait(0.05)
                    continue
                for sock, _ in poller.poll(50):
                    feed = next((f for f in self._feeds.values() if f.sock is sock), None)
                    if feed is None:
                        continue
                    for _ in range(1000):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(feed, frames)
        finally:
            for f in self._feeds.values():
                f.sock.close(linger=0)

    def _commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                cmd, args = self._cmds.get_nowait()
            except queue.Empty:
                return
            pod = str(args[0])
            old = self._feeds.pop(pod, None)
            if old is not None:
                poller.unregister(old.sock)
                old.sock.close(linger=0)
            if cmd == "add":
                _, endpoint, replay, applier = args
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(str(endpoint))
                stats = self.stats.setdefault(pod, FeedStats())
                assert isinstance(applier, PodEventApplier)
                feed = _Feed(pod, str(endpoint), None if replay is None else str(replay), applier, sock, 0, stats)
                self._feeds[pod] = feed
                poller.register(sock, zmq.POLLIN)
                if feed.replay is not None:
                    self._bootstrap(feed)

    def _bootstrap(self, feed: _Feed) -> None:
        """Apply the pod's replay buffer from sequence 0 (its history may start later: a reset or a
        bounded buffer; what it holds is the pod's state since then)."""
        assert feed.stats is not None
        got = self._replay(feed, 0)
        if not got:
            return
        for seq, payload in got:
            self._apply(feed, payload)
            feed.stats.replayed += 1
            feed.expected = seq + 1

    def _on_message(self, feed: _Feed, frames: list[bytes]) -> None:
        assert feed.stats is not None
        if len(frames) != 3 or len(frames[1]) != 8:
            feed.stats.decode_errors += 1
            return
        seq = _SEQ.unpack(frames[1])[0]
        if seq == 0 and feed.expected > 0:  # the publisher restarted
            feed.stats.resyncs += 1
            feed.applier.reset()
            feed.expected = 0
        if seq > feed.expected:
            feed.stats.gaps += 1
            self._fill_gap(feed, seq)
        if seq < feed.expected:
            return  # duplicate (already applied through replay)
        self._apply(feed, frames[2])
        feed.expected = seq + 1

    def _apply(self, feed: _Feed, payload: bytes) -> None:
        assert feed.stats is not None
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            feed.stats.decode_errors += 1
            log.warning("pod %s: dropped undecodable KV event batch: %s", feed.pod, exc)
            return
        feed.applier.apply(batch)
        feed.stats.batches += 1
        if self.on_batch is not None:
            self.on_batch(feed.pod)

    def _fill_gap(self, feed: _Feed, upto: int) -> None:
        """Apply batches ``[expected, upto)`` from the replay endpoint, or resync."""
        assert feed.stats is not None
        got = self._replay(feed, feed.expected) if feed.replay else None
        if got is None or not got or got[0][0] > feed.expected:
            feed.stats.resyncs += 1
            log.warning("pod %s: KV event gap %d..%d not replayable; resyncing", feed.pod, feed.expected, upto)
            feed.applier.reset()
            got = self._replay(feed, 0) if feed.replay else None
        for seq, payload in got or []:
            if seq >= upto:
                break
            self._apply(feed, payload)
            feed.stats.replayed += 1
        feed.expected = upto

    def _replay(self, feed: _Feed, start: int) -> list[tuple[int, bytes]] | None:
        assert feed.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(feed.replay)
            sock.send_multipart([b"", _SEQ.pack(start)])
            while True:
                if not sock.poll(int(self.replay_timeout_s * 1000)):
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = _SEQ.unpack(frames[2])[0] if len(frames[2]) == 8 else -2
                if seq == -1:
                    return out
                if seq >= start:
                    out.append((seq, frames[3]))
        finally:
            sock.close(linger=0)
