"""Replica gossip: EPP replicas share their picks and their in-flight load, so N replicas route as one.

Every replica subscribes to every pod's KV events, so the exact index is the same on all of them. What
each replica alone knows is its own traffic: its picks (between a pick and the KV events of its prefill, a
same-prefix request that the gateway sends to another replica sees no hit and may go elsewhere) and its
tickets (requests in flight, prefill work pending, requests of a prefix still waiting for their first
token: with N replicas each sees about 1/N of every pod's load between two metrics scrapes, and a burst
piles onto the pod that looks idle to all of them). Each replica therefore publishes both on a ZMQ PUB
socket and subscribes to its peers':

* a pick — the pod and the prompt's keys at :func:`~kvfleet.epp.index.spec_positions` (absolute positions,
  so the sample is the pick), its ticket and its pool's follow-up sample
  (:class:`~kvfleet.epp.index.PickOrigin`) — becomes a speculative entry on that pod
  (:meth:`~kvfleet.epp.index.BlockIndex.add_speculative_sampled`) that lives as the peer's own does: until
  the ticket's first token, then the pod's speculative TTL, dropped by the pod's removals (without its
  ticket, ``ttl_s``); the pod's KV events take over from there; the sample is folded into the pool's
  follow-up share as the replica's own (:class:`PeerApplier`);
* a ticket change (open, first token, close, move: :attr:`~kvfleet.epp.inflight.InflightTracker.on_ticket`)
  is applied to the replica's tracker as the peer's ticket
  (:meth:`~kvfleet.epp.inflight.InflightTracker.remote`), so its scorers see the whole fleet's in-flight load.

A replica that sends nothing for :data:`SILENT_S` (it sends an empty message every :data:`HEARTBEAT_S`) is
gone: its tickets are closed. A restarted replica has a new id, so its predecessor's tickets go the same way.

Wire, one message per batch of what was queued when the gossip thread woke (picks and ticket changes, up
to :data:`BATCH_BYTES` of payload and :data:`BATCH_TICKETS` ticket changes; a receiver applies a message's
ticket changes, then its picks): ``[payload]`` or, with a secret, ``[payload, HMAC-SHA256(secret,
payload)]``; ``payload`` is msgpack :class:`Message` ``[VERSION, replica id, [picks], [ticket changes]]``.
The port is a boundary like any other. A whole message is dropped and counted
(``kvfleet_epp_gossip_messages_total{direction="in",result}``) if larger than :data:`MAX_BYTES`,
undecodable, of another version, with a missing or wrong tag (when a secret is set) or from this replica;
inside a message each pick and ticket change is checked on its own (a pod the replica does not serve, more
than :data:`MAX_KEYS` keys, an unknown event, a token count that is negative or not finite, more peer
tickets than the tracker holds) and counted (``kvfleet_epp_gossip_picks_total`` /
``kvfleet_epp_gossip_tickets_total``, ``direction="in"``). The pick path never waits: changes go through a
bounded queue (full: dropped, counted) to the gossip thread, which owns both sockets and is woken through a
pipe; ZMQ's high-water mark bounds what a slow peer can hold.

Peers are ``host:port`` entries; a name that resolves to several addresses (the chart's headless
``<epp>-replicas`` Service) means each of them, and names are resolved again every :data:`REFRESH_S`,
so replicas that come and go are followed. A replica may list itself: its own messages are dropped by id.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import get_args

import msgspec
import zmq

from kvfleet.epp.index import BlockIndex, PickOrigin
from kvfleet.epp.inflight import InflightTracker, Ticket, TicketEvent

log = logging.getLogger(__name__)

VERSION = 2
MAX_KEYS = 4096
MAX_BYTES = 64 * 1024
BATCH_TICKETS = 256
#: a message's payload is kept under this (estimated: :func:`_wire_bytes`), half of :data:`MAX_BYTES`
BATCH_BYTES = MAX_BYTES // 2
REFRESH_S = 10.0
HEARTBEAT_S = 1.0
SILENT_S = 5.0
#: the gossip thread's batching window: woken by its own changes alone, it waits this long before sending
#: them (the rest of a pick's burst joins); after applying peers' messages, this long before the next (what
#: comes meanwhile is applied together, the first message after a quiet spell at once)
COALESCE_S = 0.002
MAX_TOKENS = 1e9
_TAG = 32
EVENTS: tuple[TicketEvent, ...] = get_args(TicketEvent)


class Pick(msgspec.Struct, array_like=True, frozen=True):
    """``blocks``: the prompt's length (0: unknown; a peer of an older release sends none). ``ticket``,
    ``covered`` and ``pool``: the pick's :class:`~kvfleet.epp.index.PickOrigin` (−1, −1 and "" from a peer
    of an older release, or for a pick without one). Fields are only ever added at the end: a receiver of
    an older release ignores those it does not know."""

    pod: str
    keys: list[int]
    blocks: int = 0
    ticket: int = -1
    covered: float = -1.0
    pool: str = ""


class TicketChange(msgspec.Struct, array_like=True, frozen=True):
    """``event`` indexes :data:`EVENTS`; ``pods`` are the ticket's pods (``open``) or (old, new)
    (``move``)."""

    event: int
    tid: int
    pods: list[str]
    prefix: int = 0
    tokens: float = 0.0


class Message(msgspec.Struct, array_like=True, frozen=True):
    version: int
    replica: str
    picks: list[Pick]
    tickets: list[TicketChange]


def _wire_bytes(item: Pick | TicketChange) -> int:
    """At most the msgpack bytes of ``item`` (9 per integer, names as ASCII: :data:`BATCH_BYTES` leaves the
    margin)."""
    if isinstance(item, Pick):
        return 24 + len(item.pod) + 9 * len(item.keys)
    return 42 + sum(5 + len(p) for p in item.pods)


def resolve(peers: Sequence[str]) -> set[str]:
    """``host:port`` entries → the set of ``tcp://ip:port`` they name now (a name may resolve to several)."""
    out: set[str] = set()
    for peer in peers:
        host, _, port = peer.rpartition(":")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.debug("gossip: peer %s does not resolve: %s", peer, exc)
            continue
        for family, _, _, _, addr in infos:
            ip = str(addr[0])
            out.add(f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}")
    return out


class ReplicaGossip:
    """One replica's gossip: publishes its picks and ticket changes on ``host:port``, applies its peers' to
    ``index`` and ``tracker`` (``tracker=None``: picks only) through a :class:`PeerApplier` (``pick_ttl``:
    a pod's speculative TTL after a pick's first token; ``on_followup``: where the picks' follow-up samples
    go)."""

    def __init__(
        self,
        index: BlockIndex,
        *,
        host: str,
        port: int,
        peers: Sequence[str],
        ttl_s: float,
        known_pod: Callable[[str], bool],
        tracker: InflightTracker | None = None,
        secret: bytes = b"",
        replica: str = "",
        queue_size: int = 16384,
        pick_ttl: Callable[[str], float] | None = None,
        on_followup: Callable[[str, float], None] | None = None,
    ) -> None:
        self.tracker = tracker
        self.host, self.port, self.peers, self.secret = host, port, tuple(peers), secret
        #: the receiving side (:class:`PeerApplier`): the index, the pods known and the TTLs are its
        self.peers_applier = PeerApplier(index, tracker, known_pod, ttl_s, pick_ttl, on_followup)
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.messages: Counter[str] = Counter()
        """Peers' messages by result: ``ok``, ``self``, ``too_large``, ``malformed``, ``bad_tag``; own:
        ``sent``, ``dropped``."""
        self.picks_out: Counter[str] = Counter()
        """Own picks: ``sent`` or ``dropped`` (queue or socket full)."""
        self.picks_in: Counter[str] = Counter()
        """Peers' picks: ``applied``, ``unknown_pod``, ``too_large``, ``malformed``."""
        self.tickets_out: Counter[str] = Counter()
        self.tickets_in: Counter[str] = Counter()
        """Peers' ticket changes: ``applied``, ``unknown_pod``, ``malformed``, ``refused`` (tracker full or
        repeated)."""
        self.peers_gone = 0
        self._heard: dict[str, float] = {}
        self._queue: queue.Queue[Pick | TicketChange] = queue.Queue(queue_size)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    # --- the pick path -----------------------------------------------------------------
    def publish(self, pod: str, sampled: list[int], blocks: int = 0,
                origin: PickOrigin | None = None) -> None:
        """Queue one of this replica's picks (the index's ``on_pick``); never blocks."""
        self._put(pick_message(pod, sampled, blocks, origin), self.picks_out)

    def publish_ticket(self, event: TicketEvent, t: Ticket, moved: tuple[str, str] | None) -> None:
        """Queue a change of one of this replica's tickets (the tracker's ``on_ticket``); never blocks."""
        self._put(ticket_change(event, t, moved), self.tickets_out)

    def _put(self, item: Pick | TicketChange, counter: Counter[str]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            counter["dropped"] += 1
            return
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the thread is awake already
            os.write(self._wake_w, b"\0")

    @property
    def live_peers(self) -> int:
        """Peer replicas heard from within :data:`SILENT_S`."""
        now = time.monotonic()
        return sum(1 for t in list(self._heard.values()) if now - t < SILENT_S)

    # --- the gossip thread -------------------------------------------------------------
    def start(self) -> ReplicaGossip:
        self._thread = threading.Thread(target=self._run, name="epp-gossip", daemon=True)
        self._thread.start()
        if not self._bound.wait(10):
            raise RuntimeError(f"gossip: could not bind {self.host}:{self.port}")
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self._thread is not None:
            self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        ctx = zmq.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        try:
            for s in (pub, sub):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 10_000)
                s.setsockopt(zmq.RCVHWM, 10_000)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + _TAG + 64)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            host = "*" if self.host in ("", "0.0.0.0", "::") else self.host
            if self.port:
                pub.bind(f"tcp://{host}:{self.port}")
            else:
                self.port = pub.bind_to_random_port(f"tcp://{host}")
            self._bound.set()
            connected: set[str] = set()
            next_refresh = next_beat = 0.0
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_refresh:
                    connected = self._reconnect(sub, connected)
                    next_refresh = now + REFRESH_S
                if now >= next_beat:
                    self._send(pub, [], [])
                    self._forget_silent(now)
                    next_beat = now + HEARTBEAT_S
                ready = dict(poller.poll(int(HEARTBEAT_S * 1000)))
                if self._wake_r in ready and sub not in ready:
                    # own changes only: let the rest of this pick's burst join them (its ticket and pick, the
                    # picks that follow at once), one message instead of several
                    time.sleep(COALESCE_S)
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._drain(pub)
                if sub in ready:
                    for _ in range(1000):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.messages[self.apply(frames)] += 1
                # peers' messages: applied at once, and what comes in the next COALESCE_S waits and is
                # applied in one wake-up (a wake-up cost a replica more than applying its peer's pick and
                # tickets: ≈ 0.15 against 0.07 ms per request routed elsewhere). Sleeping before applying
                # them instead held each change up to 2 ms more: peers routed on picks up to 4 ms old
                if sub in ready:
                    time.sleep(COALESCE_S)
            self._drain(pub)
        except Exception:  # the thread must not die silently: log, picks and load then stay local
            log.exception("gossip: stopped")
        finally:
            self._bound.set()
            pub.close(0)
            sub.close(0)
            ctx.term()

    def _reconnect(self, sub: zmq.Socket[bytes], connected: set[str]) -> set[str]:
        want = resolve(self.peers)
        for addr in sorted(want - connected):
            sub.connect(addr)
        for addr in sorted(connected - want):
            sub.disconnect(addr)
        if want != connected:
            log.info("gossip: %d peer address(es)", len(want))
        return want

    def _forget_silent(self, now: float) -> None:
        for replica, heard in list(self._heard.items()):
            if now - heard >= SILENT_S:
                del self._heard[replica]
                self.peers_gone += 1
                n = self.tracker.forget_origin(replica) if self.tracker is not None else 0
                log.info("gossip: replica %s silent for %.0f s: its %d ticket(s) closed",
                         replica, SILENT_S, n)

    def _drain(self, pub: zmq.Socket[bytes]) -> None:
        """Send what is queued, as few messages as fit: a receiving replica pays a wake-up, a decode and a
        check per message (one message per pick cost an idle replica ≈ 2 wake-ups per request routed by its
        peers)."""
        picks: list[Pick] = []
        tickets: list[TicketChange] = []
        size = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            cost = _wire_bytes(item)
            if (picks or tickets) and (size + cost > BATCH_BYTES or len(tickets) >= BATCH_TICKETS):
                self._send(pub, picks, tickets)
                picks, tickets, size = [], [], 0
            if isinstance(item, Pick):
                picks.append(item)
            else:
                tickets.append(item)
            size += cost
        if picks or tickets:
            self._send(pub, picks, tickets)

    def _send(self, pub: zmq.Socket[bytes], picks: list[Pick], tickets: list[TicketChange]) -> None:
        payload = self._encoder.encode(Message(VERSION, self.replica, picks, tickets))
        frames = ([payload, hmac.new(self.secret, payload, hashlib.sha256).digest()] if self.secret
                  else [payload])
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
            result = "sent"
        except zmq.Again:
            result = "dropped"
        self.messages[result] += 1
        self.picks_out[result] += len(picks)
        self.tickets_out[result] += len(tickets)

    # --- a peer's message ----------------------------------------------------------------
    def apply(self, frames: Sequence[bytes]) -> str:
        """Check one received message and apply what it carries; returns the result the message is counted
        under."""
        if not frames or len(frames) > 2 or len(frames[0]) > MAX_BYTES:
            return "too_large" if frames and len(frames[0]) > MAX_BYTES else "malformed"
        payload = bytes(frames[0])
        if self.secret:
            tag = bytes(frames[1]) if len(frames) == 2 else b""
            if not hmac.compare_digest(tag, hmac.new(self.secret, payload, hashlib.sha256).digest()):
                return "bad_tag"
        elif len(frames) != 1:
            return "malformed"
        try:
            msg = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "malformed"
        if msg.version != VERSION:
            return "malformed"
        if msg.replica == self.replica:
            return "self"
        self._heard[msg.replica] = time.monotonic()
        for change in msg.tickets:
            self.tickets_in[self.peers_applier.ticket(msg.replica, change)] += 1
        for pick in msg.picks:
            self.picks_in[self.peers_applier.pick(msg.replica, pick)] += 1
        return "ok"


def pick_message(pod: str, sampled: Sequence[int], blocks: int = 0, origin: PickOrigin | None = None) -> Pick:
    """The wire form of one of this replica's picks (at most :data:`MAX_KEYS` keys: a longer sample is cut
    and its length dropped)."""
    keys = list(sampled[:MAX_KEYS])
    blocks = blocks if len(sampled) <= MAX_KEYS else 0
    if origin is None:
        return Pick(pod, keys, blocks)
    return Pick(pod, keys, blocks, origin.ticket, origin.covered, origin.pool)


def ticket_change(event: TicketEvent, t: Ticket, moved: tuple[str, str] | None) -> TicketChange:
    """The wire form of a change of one of this replica's tickets."""
    if event == "open" or moved:
        return TicketChange(EVENTS.index(event), t.id, list(moved or t.pods), t.prefix, t.tokens)
    return TicketChange(EVENTS.index(event), t.id, [])


class PeerApplier:
    """What a peer replica's picks and ticket changes do here, each checked on its own (the result it is
    counted under is returned): the one implementation of a replica's receiving side, which the routing
    simulation's replicas use too (``bench.routing``'s ``KvfleetReplicas``).

    A peer's pick is counted as the peer counts it. With its ticket held here (the ticket's ``open`` comes
    before the pick: both are queued at the pick, in that order), its speculative entries live until the
    ticket's first token, then ``pick_ttl(pod)`` as served entries (the pod's removal events drop them), or
    expire then if the peer moved the ticket off that pod (a fallback served). Without its ticket (a peer of
    an older release, a lost ``open``, a ticket already closed, ``tracker`` None) they live ``ttl_s``. Before
    this, a peer's pick lived ``ttl_s`` (30 s) from its receipt and was never served: picks stayed live
    longer on the peers than on their picker, and the follow-up share they feed read higher there. The
    pick's ``covered`` (its pool's follow-up sample, 0..1) goes to ``on_followup(pool, covered)``.
    """

    def __init__(
        self,
        index: BlockIndex,
        tracker: InflightTracker | None,
        known_pod: Callable[[str], bool],
        ttl_s: float,
        pick_ttl: Callable[[str], float] | None = None,
        on_followup: Callable[[str, float], None] | None = None,
    ) -> None:
        self.index, self.tracker, self.known_pod, self.ttl_s = index, tracker, known_pod, ttl_s
        self.pick_ttl = pick_ttl or (lambda pod: ttl_s)
        self.on_followup = on_followup

    def pick(self, origin: str, pick: Pick) -> str:
        if not pick.keys:  # msgpack ints are int64/uint64: any decoded key is a valid block key
            return "malformed"
        if len(pick.keys) > MAX_KEYS:
            return "too_large"
        if not self.known_pod(pick.pod):
            return "unknown_pod"
        if self.on_followup is not None and pick.pool and 0.0 <= pick.covered <= 1.0:
            self.on_followup(pick.pool, pick.covered)
        blocks, tracker = max(0, pick.blocks), self.tracker
        t = tracker.remote_ticket(origin, pick.ticket) if tracker is not None and pick.ticket >= 0 else None
        if t is None or tracker is None:
            self.index.add_speculative_sampled(pick.pod, pick.keys, self.ttl_s, blocks=blocks)
            return "applied"
        lease = self.index.add_speculative_sampled(pick.pod, pick.keys, tracker.max_age_s, blocks=blocks)
        pod, index, pick_ttl = pick.pod, self.index, self.pick_ttl

        def served() -> None:
            if pod in t.pods:
                index.extend(lease, pick_ttl(pod))
            else:  # moved off this pod: the fallback's own pick holds the prefix
                lease.expiry = 0.0

        if not tracker.when_first_byte(t, served):
            served()
        return "applied"

    def ticket(self, origin: str, c: TicketChange) -> str:
        if self.tracker is None:
            return "refused"
        if not 0 <= c.event < len(EVENTS):
            return "malformed"
        event = EVENTS[c.event]
        if event == "open" and not (1 <= len(c.pods) <= 2 and math.isfinite(c.tokens)
                                    and 0 <= c.tokens <= MAX_TOKENS):
            return "malformed"
        if event == "move" and len(c.pods) != 2:
            return "malformed"
        if not all(self.known_pod(p) for p in c.pods):
            return "unknown_pod"
        ok = self.tracker.remote(origin, event, c.tid, tuple(c.pods), c.prefix, c.tokens)
        return "applied" if ok else "refused"
