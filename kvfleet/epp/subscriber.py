"""Transport of the write path: ZMQ SUB to every pod's KV-event publisher, in vLLM's framing.

Frames, replay request/answer and restart semantics are :mod:`kvfleet.cache.kvwire`'s;
each pod's stream is ordered by its own :class:`~kvfleet.cache.kvwire.FeedSequencer`
and its batches applied in order by its :class:`~kvfleet.epp.ingest.PodEventApplier`.

One thread owns every socket (ZMQ sockets are not thread-safe) and never blocks
on one pod: the live SUB sockets, the replay DEALER sockets (one per pod with a
request outstanding) and the SUB sockets' connection monitors share one poller,
each socket is read at most ``burst`` messages per round, and a replay request
is a per-pod state with a deadline, checked every round. A pod whose replay
endpoint is silent delays only its own batches (by ``replay_timeout_s``, then
its endpoint is not asked again for a back-off period); every other pod keeps
being indexed.

Bootstrap: when a pod is added (picker start, pod discovered or changed) its
entries are cleared and rebuilt from its replay buffer from sequence 0, so an
idle pod's blocks are known before it publishes again; live batches that arrive
meanwhile wait and follow the replayed ones. A gap is filled from the replay
endpoint; a sequence number not above the last live one (any, not only 0), or a
reconnection of the live socket, means the publisher may have restarted: the
pod is cleared and rebuilt. Holes (batches missing between the replayed range
and the live stream, or inside an answer) clear the pod and re-request it; the
index never keeps entries across a missing batch.

Validation: every message is checked on its own. Bad frames, a topic other than
the pod's (when one is given), a payload above ``max_batch_bytes``, undecodable
msgpack, unknown event types, invalid fields (token ids outside 32 bits, ...)
are counted per pod in ``FeedStats.rejected``, logged at most every
``log_every_s`` per pod and reason, and dropped; when what was dropped may have
removed blocks, the pod's entries are cleared. Nothing a pod sends can stop the
thread; :meth:`EventSubscriber.healthy` turns false if it stops anyway (died, or
one round took longer than ``stall_after_s``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvfleet.cache import kvwire
from kvfleet.cache.errors import EventDecodeError
from kvfleet.cache.events import KVEventBatch, decode_batch_lenient
from kvfleet.cache.kvwire import FeedSequencer, KVWireError, SequenceStats
from kvfleet.epp.ingest import IngestStats, PodEventApplier

log = logging.getLogger(__name__)


@dataclass
class FeedStats(SequenceStats):
    """One pod's feed counters (the sequencer's, plus what the subscriber and the applier count)."""

    batches: int = 0
    """Batches applied."""
    rejected: int = 0
    """Messages or events dropped as invalid (frames, topic, size, msgpack, event type, fields)."""
    lag_s: float = 0.0
    """How far ingestion is behind: the age of the last live batch applied (this host's wall clock minus
    the batch's ``ts``, so skew between the hosts is included) while more are queued behind it; 0 once
    the pod's socket has been read empty."""
    ingest: IngestStats = field(default_factory=IngestStats)


class _Feed:
    """One pod's sockets and state; the :class:`~kvfleet.cache.kvwire.FeedSink` of its sequencer."""

    def __init__(
        self,
        owner: EventSubscriber,
        pod: str,
        endpoint: str,
        replay: str | None,
        topic: bytes | None,
        applier: PodEventApplier,
        stats: FeedStats,
    ) -> None:
        self.owner, self.pod, self.endpoint, self.replay, self.topic = owner, pod, endpoint, replay, topic
        self.applier, self.stats = applier, stats
        self.sub: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.dealer: zmq.Socket[bytes] | None = None
        self.disconnected = False
        self.seq = FeedSequencer(
            self,
            replay=replay is not None,
            stats=stats,
            timeout_s=owner.replay_timeout_s,
            backoff_s=owner.replay_backoff_s,
            max_backoff_s=owner.max_replay_backoff_s,
        )

    # FeedSink
    def apply(self, seq: int, payload: bytes, replayed: bool) -> None:
        try:
            self.owner._apply(self, seq, payload, replayed)
        except Exception as exc:  # the sequencer goes on with the next batch; this one may be half applied
            self.owner._reject(self, "error", f"batch {seq} failed: {exc!r}")
            self.owner._unsafe(self)

    def clear(self, reason: str) -> None:
        # a first subscription keeps the picks already made on the pod (by this replica or gossiped by others)
        self.applier.reset(picks=reason != "subscribed")
        if reason != "subscribed":
            self.owner._log(self, "resync", f"pod {self.pod}: KV-event entries cleared: {reason}",
                            logging.INFO)

    def request_replay(self, start: int) -> None:
        self.owner._open_replay(self, start)

    def cancel_replay(self) -> None:
        self.owner._close_replay(self)


def _recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The next message's frames (:class:`zmq.Again` when there is none): ``recv_multipart`` asks the socket
    for ``RCVMORE`` after every frame; a frame knows it itself (≈ 1 µs less per three-frame message)."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:  # the rest of a message arrives with its first frame
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


class EventSubscriber:
    """Subscribes to pods' KV events; :meth:`add_pod`/:meth:`remove_pod` are safe from any thread."""

    def __init__(
        self,
        replay_timeout_s: float = 2.0,
        on_batch: Callable[[str], None] | None = None,
        *,
        on_disconnect: Callable[[str], None] | None = None,
        max_batch_bytes: int = 16 << 20,
        stall_after_s: float = 10.0,
        replay_backoff_s: float = 5.0,
        max_replay_backoff_s: float = 60.0,
        burst: int = 256,
        log_every_s: float = 30.0,
        coalesce_s: float = 0.0,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._cmds: queue.Queue[tuple[str, tuple[object, ...]]] = queue.Queue()
        self._feeds: dict[str, _Feed] = {}
        self._owners: dict[zmq.Socket[bytes], tuple[_Feed, str]] = {}
        self._poller = zmq.Poller()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}
        self.replay_timeout_s = replay_timeout_s
        self.replay_backoff_s = replay_backoff_s
        self.max_replay_backoff_s = max_replay_backoff_s
        self.max_batch_bytes = max_batch_bytes
        self.stall_after_s = stall_after_s
        self.burst = burst
        self.log_every_s = log_every_s
        #: under sustained traffic, one round (one wake-up of the thread) per this many seconds: the batches
        #: that arrive meanwhile wait in their sockets and are read together (:meth:`_run`)
        self.coalesce_s = coalesce_s
        self._drained_at: float | None = None
        #: rounds that found messages to read (each a wake-up of the thread, bar the first of a burst)
        self.reads = 0
        self.on_batch = on_batch
        #: called with the pod's name when its KV-event connection drops (a killed engine: at once)
        self.on_disconnect = on_disconnect
        #: per pod currently subscribed (entries go with the pod, so metric labels stay bounded)
        self.stats: dict[str, FeedStats] = {}

    def start(self) -> None:
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def add_pod(
        self, pod: str, endpoint: str, replay: str | None, applier: PodEventApplier, topic: str | None = None
    ) -> None:
        """Subscribe to (or re-subscribe) ``pod``; with ``topic``, messages on any other topic are
        rejected."""
        self._cmds.put(("add", (pod, endpoint, replay, applier, topic)))

    def remove_pod(self, pod: str) -> None:
        self._cmds.put(("remove", (pod,)))

    def healthy(self) -> bool:
        """The ingestion thread runs and its last round started less than ``stall_after_s`` ago."""
        t = self._thread
        return (t is not None and t.is_alive() and not self._stop.is_set()
                and self.heartbeat_age() <= self.stall_after_s)

    def heartbeat_age(self) -> float:
        """Seconds since the ingestion loop last started a round."""
        return time.monotonic() - self._beat

    # --- the socket thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat = time.monotonic()
                self._commands()
                if not self._owners:  # zmq's poll returns at once with nothing registered: never spin
                    self._stop.wait(0.05)
                    continue
                self._gather()
                events = self._poller.poll(self._poll_ms())
                self._drained_at = time.monotonic() if events else None
                self.reads += bool(events)
                for sock, _ in events:
                    owner = self._owners.get(sock)
                    if owner is not None:
                        self._read(owner[0], sock, owner[1])
                now = time.monotonic()
                for feed in list(self._feeds.values()):
                    feed.seq.poll(now)
                    if feed.seq.gave_up:
                        self._log(feed, "replay",
                                  f"pod {feed.pod}: KV-event replay from {feed.replay}: {feed.seq.gave_up}")
                        feed.seq.gave_up = ""
        except Exception:  # healthy() reports it from now on
            log.exception("kv events: ingestion loop stopped")
        finally:
            for f in list(self._feeds.values()):
                self._close_feed(f)

    def _gather(self) -> None:
        """With ``coalesce_s``, after a round that read messages, wait until that many seconds have passed
        since it: each wake-up of this thread costs more CPU than applying a batch (a thread woken from cold
        caches on a busy host), and a pod publishes a batch per engine step that fills a block, so a
        64-token answer is four or five batches. The first batch after a quiet spell is read at once; under
        sustained traffic a batch waits at most ``coalesce_s`` (the picker's speculative entries already
        cover its own picks, and the batches of an answer's decoded blocks matter only to the next turn)."""
        if self.coalesce_s > 0.0 and self._drained_at is not None:
            rest = self._drained_at + self.coalesce_s - time.monotonic()
            if rest > 0.0:
                self._stop.wait(rest)

    def _poll_ms(self) -> int:
        wait = 0.05
        now = time.monotonic()
        for feed in self._feeds.values():
            d = feed.seq.deadline
            if d is not None:
                wait = min(wait, max(0.0, d - now))
        return max(1, int(wait * 1000))

    def _read(self, feed: _Feed, sock: zmq.Socket[bytes], kind: str) -> None:
        try:
            self._read_burst(feed, sock, kind)
        finally:
            if kind != "monitor":  # the stores the burst's batches left held, indexed at once
                feed.stats.rejected += feed.applier.flush()

    def _read_burst(self, feed: _Feed, sock: zmq.Socket[bytes], kind: str) -> None:
        for _ in range(self.burst):
            if self._owners.get(sock, (None, ""))[0] is not feed:
                return  # closed or replaced by what the last message caused
            try:
                frames = _recv_frames(sock)
            except zmq.Again:
                if kind == "live":
                    feed.stats.lag_s = 0.0  # caught up: nothing queued behind the last batch applied
                return
            self._beat = time.monotonic()  # alive while it works through a burst, not only between rounds
            try:
                if kind == "live":
                    self._on_live(feed, frames)
                elif kind == "replay":
                    self._on_replay(feed, frames)
                else:
                    self._on_monitor(feed, frames)
            except Exception as exc:  # nothing a pod sends may stop the thread
                feed.stats.rejected += 1
                self._log(feed, "error", f"pod {feed.pod}: KV-event message dropped: {exc!r}")

    def _on_live(self, feed: _Feed, frames: list[bytes]) -> None:
        try:
            msg = kvwire.parse_live(frames)
        except KVWireError as exc:
            self._reject(feed, "frames", f"bad live message: {exc}")
            return
        if feed.topic is not None and msg.topic != feed.topic:
            self._reject(feed, "topic", f"topic {msg.topic[:64]!r}, expected {feed.topic[:64]!r}")
            return
        feed.seq.on_live(time.monotonic(), msg.seq, msg.payload)

    def _on_replay(self, feed: _Feed, frames: list[bytes]) -> None:
        try:
            seq, payload = kvwire.parse_replay_answer(frames)
        except KVWireError as exc:
            self._reject(feed, "frames", f"bad replay message: {exc}")
            return
        feed.seq.on_replay(time.monotonic(), seq, payload)

    def _on_monitor(self, feed: _Feed, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            feed.disconnected = True
            if self.on_disconnect is not None:
                try:
                    self.on_disconnect(feed.pod)
                except Exception as exc:  # a callback must not stop ingestion
                    self._log(feed, "callback", f"pod {feed.pod}: on_disconnect failed: {exc!r}")
        elif event == zmq.EVENT_CONNECTED and feed.disconnected:
            feed.disconnected = False
            feed.seq.on_reconnect(time.monotonic())

    def _apply(self, feed: _Feed, seq: int, payload: bytes, replayed: bool) -> None:
        st = feed.stats
        if len(payload) > self.max_batch_bytes:
            self._reject(feed, "size", f"batch {seq} of {len(payload)} bytes (cap {self.max_batch_bytes})")
            self._unsafe(feed)
            return
        done = feed.applier.apply_payload(payload)  # vLLM's layout, every event valid: from the bytes
        if done is None:
            try:
                decoded = decode_batch_lenient(payload)
            except EventDecodeError as exc:
                self._reject(feed, "decode", f"batch {seq}: {exc}")
                self._unsafe(feed)
                return
            for reason in decoded.refused:
                self._reject(feed, "event", f"batch {seq}: {reason}")
            batch = decoded.batch
            if decoded.reset_at is not None:
                self._unsafe(feed)
                batch = KVEventBatch(ts=batch.ts, events=batch.events[decoded.reset_at :],
                                     data_parallel_rank=batch.data_parallel_rank)
            done = batch.ts, feed.applier.apply(batch)
        ts, failed = done
        st.rejected += failed
        st.batches += 1
        if not replayed and math.isfinite(ts):  # a pod's timestamp is its word: inf/NaN say nothing
            st.lag_s = time.time() - ts
        if self.on_batch is not None:
            try:
                self.on_batch(feed.pod)
            except Exception as exc:
                self._log(feed, "callback", f"pod {feed.pod}: on_batch failed: {exc!r}")

    def _unsafe(self, feed: _Feed) -> None:
        """What was dropped may have removed blocks: forget the pod's entries (the stream goes on)."""
        feed.stats.resyncs += 1
        feed.applier.reset()

    def _reject(self, feed: _Feed, kind: str, msg: str) -> None:
        feed.stats.rejected += 1
        self._log(feed, kind, f"pod {feed.pod}: KV event dropped: {msg}")

    def _log(self, feed: _Feed, kind: str, msg: str, level: int = logging.WARNING) -> None:
        """At most one line per pod and kind every ``log_every_s`` (with the count of those held back)."""
        key = (feed.pod, kind)
        now = time.monotonic()
        last, held = self._logged.get(key, (-1e9, 0))
        if now - last < self.log_every_s:
            self._logged[key] = (last, held + 1)
            return
        self._logged[key] = (now, 0)
        log.log(level, "%s%s", msg[:500], f" ({held} similar not logged)" if held else "")

    # --- sockets ----------------------------------------------------------------------
    def _register(self, sock: zmq.Socket[bytes], feed: _Feed, kind: str) -> None:
        self._owners[sock] = (feed, kind)
        self._poller.register(sock, zmq.POLLIN)

    def _unregister(self, sock: zmq.Socket[bytes] | None) -> None:
        if sock is None:
            return
        if self._owners.pop(sock, None) is not None:
            self._poller.unregister(sock)
        sock.close(linger=0)

    def _open_replay(self, feed: _Feed, start: int) -> None:
        self._close_replay(feed)
        assert feed.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # the answer is bounded by the publisher's buffer; never drop part of it
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes + 4096)
        try:
            sock.connect(feed.replay)
            sock.send_multipart(kvwire.replay_request(start), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the deadline gives the request up
            self._log(feed, "replay", f"pod {feed.pod}: replay request to {feed.replay} not sent: {exc}")
        feed.dealer = sock
        self._register(sock, feed, "replay")

    def _close_replay(self, feed: _Feed) -> None:
        sock, feed.dealer = feed.dealer, None
        self._unregister(sock)

    def _close_feed(self, feed: _Feed) -> None:
        self._close_replay(feed)
        if feed.sub is not None:
            if feed.monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    feed.sub.disable_monitor()
            self._unregister(feed.monitor)
            self._unregister(feed.sub)
        feed.sub = feed.monitor = None

    def _commands(self) -> None:
        while True:
            try:
                cmd, args = self._cmds.get_nowait()
            except queue.Empty:
                return
            pod = str(args[0])
            old = self._feeds.pop(pod, None)
            if old is not None:
                self._close_feed(old)
            if cmd == "remove":
                self.stats.pop(pod, None)
                for key in [k for k in self._logged if k[0] == pod]:
                    del self._logged[key]
                continue
            _, endpoint, replay, applier, topic = args
            assert isinstance(applier, PodEventApplier)
            stats = self.stats.setdefault(pod, FeedStats())
            applier.stats = stats.ingest  # the pod's counters survive a re-subscription
            feed = _Feed(
                self, pod, str(endpoint), None if replay is None else str(replay),
                None if topic is None else str(topic).encode(), applier, stats,
            )
            try:
                self._subscribe(feed)
            except zmq.ZMQError as exc:
                log.error("pod %s: cannot subscribe to KV events at %s: %s", pod, endpoint, exc)
                self._close_feed(feed)
                continue
            self._feeds[pod] = feed
            feed.seq.start(time.monotonic())

    def _subscribe(self, feed: _Feed) -> None:
        sub = self._ctx.socket(zmq.SUB)
        feed.sub = sub
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        feed.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(feed.endpoint)
        self._register(sub, feed, "live")
        self._register(feed.monitor, feed, "monitor")
