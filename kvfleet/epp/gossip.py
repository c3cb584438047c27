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

Wire: a decision's changes leave in one message when its pick is made (its ticket's open, then the pick: a P/D
pick's second pod in a second), with the first tokens, ends and moves of other tickets since the last message
(with no pick, a timer of the event loop they happened on sends those within :data:`COALESCE_S`: see
:meth:`ReplicaGossip.use_loop`; changes made on other threads, the gossip thread); what waited (the sockets
not up yet) in as few messages as fit :data:`BATCH_BYTES` of payload and :data:`BATCH_TICKETS` ticket changes.
A receiver applies a message's ticket changes, then its picks. A message is ``[payload]`` or, with a secret,
``[payload, HMAC-SHA256(secret, payload)]``; ``payload`` is msgpack :class:`Message` ``[VERSION, replica id,
[picks], [ticket changes]]``. The port is a boundary like any other. A whole message is dropped and counted
(``kvfleet_epp_gossip_messages_total{direction="in",result}``) if larger than :data:`MAX_BYTES`, undecodable,
of another version, with a missing or wrong tag (when a secret is set) or from this replica; inside a message
each pick and ticket change is checked on its own (a pod the replica does not serve, more than
:data:`MAX_KEYS` keys, an unknown event, a token count that is negative or not finite, more peer tickets than
the tracker holds) and counted (``kvfleet_epp_gossip_picks_total`` / ``kvfleet_epp_gossip_tickets_total``,
``direction="in"``). The pick path never waits on the network: it sends without blocking (a peer at ZMQ's
high-water mark: dropped, counted; before the sockets are up at most ``queue_size`` changes wait). A replica
applies its peers' messages before each of its decisions (:meth:`ReplicaGossip.receive`), and its gossip
thread applies them when it routes nothing, one go per :data:`APPLY_WINDOW_S` (a wake-up of a thread costs
more than applying a message, and the decisions apply what has come first); the thread also sends the
heartbeats and follows the peers' addresses. Both sockets are shared by the threads behind a lock each.
Before, the pick path queued its changes for the gossip thread, which sent and applied them when the
interpreter let it run: a burst of decisions held the GIL, and picks reached the peers 10–22 ms late (``python
-m bench.gossip``).

Peers are ``host:port`` entries; a name that resolves to several addresses (the chart's headless
``<epp>-replicas`` Service) means each of them, and names are resolved again every :data:`REFRESH_S`,
so replicas that come and go are followed. A replica may list itself: its own messages are dropped by id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import os
import select
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
#: the sending window: a first token, end or move waits this long for a pick to take it along, then leaves
#: with the others of the window in one message (from a timer of the event loop it happened on, see
#: :meth:`ReplicaGossip.use_loop`, else from the gossip thread)
COALESCE_S = 0.002
#: the gossip thread's receiving window: signalled that peers' messages have come, it waits this long before
#: applying them, so a replica that routes little applies them in one wake-up per window instead of one per
#: message; one that routes takes them before each decision (:meth:`ReplicaGossip.receive`) and never waits
#: for this window
APPLY_WINDOW_S = 0.02
#: when a change leaves (``ReplicaGossip._put``): now (a pick, with what waited before it), with the next pick
#: (a ticket's open: its pick follows in the same decision), or with the next pick or the gossip thread's next
#: send, whichever comes first (a first token, an end, a move)
NOW, HOLD, SOON = 0, 1, 2
#: the gossip thread's longest wait for the SUB socket's descriptor (its signal is edge-triggered)
IDLE_WAIT_S = 0.05
#: peers' messages applied in one go at most (a go holds the SUB socket's lock: a pick path waiting for it
#: waits one go at most; between two decisions a replica's peers send a few, a flood is left to the next
#: decisions and the thread), and by the gossip thread in one wake-up
RECEIVE_GO = 64
RECEIVE_MAX = 1000
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
        #: this replica's changes not sent yet (a decision's ticket open until its pick; all of them while
        #: the sockets are not up), at most ``queue_size``
        self._pending: list[Pick | TicketChange] = []
        self._queue_size = queue_size
        #: the PUB socket and ``_pending`` (the pick paths send, the gossip thread its heartbeats); the SUB
        #: socket (the pick paths and the gossip thread receive). A ZMQ socket may change threads behind a
        #: lock (a full memory barrier), never be used by two at once
        self._pub_lock = threading.Lock()
        self._sub_lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.Socket[bytes] | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the gossip thread was woken for changes that wait (``_pending``) and has not sent them yet
        self._woken = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        #: the event loop whose timers send the changes that wait, when they happen on its thread
        self._loop: asyncio.AbstractEventLoop | None = None

    def use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send the first tokens, ends and moves that happen on ``loop``'s thread (the ext_proc streams') from
        a timer of ``loop`` (:data:`COALESCE_S`) instead of waking the gossip thread: a wake-up of another
        thread costs the loop the GIL twice (the thread's wake and its send after the window), once per
        first token and end of a busy replica; a timer runs between the loop's own callbacks. Changes
        made on other threads (the routing thread's, the janitor's) still wake the gossip thread."""
        self._loop = loop

    # --- the pick path -----------------------------------------------------------------
    def publish(self, pod: str, sampled: list[int], blocks: int = 0,
                origin: PickOrigin | None = None) -> None:
        """Send one of this replica's picks (the index's ``on_pick``) now, with the changes held back before
        it (its ticket's open, other tickets' first tokens and ends), in one message; never blocks on the
        network."""
        self._put(pick_message(pod, sampled, blocks, origin), self.picks_out, NOW)

    def publish_ticket(self, event: TicketEvent, t: Ticket, moved: tuple[str, str] | None) -> None:
        """Share a change of one of this replica's tickets (the tracker's ``on_ticket``): an ``open`` is held
        back for its pick, which follows in the same decision (:meth:`flush` sends it when none does); a
        first token, end or move leaves with the next pick, or from the gossip thread within
        :data:`COALESCE_S` when no pick comes."""
        self._put(ticket_change(event, t, moved), self.tickets_out, HOLD if event == "open" else SOON)

    def flush(self) -> None:
        """Send what is held back (the router calls it at the end of each decision: a ticket opened
        without a pick, for a request with no full block or not an inference)."""
        with self._pub_lock:
            if self._pending and self._pub is not None:
                self._drain(self._pub)

    def _put(self, item: Pick | TicketChange, counter: Counter[str], when: int) -> None:
        with self._pub_lock:
            if len(self._pending) >= self._queue_size:  # the sockets are not up (or gone): bounded
                counter["dropped"] += 1
                return
            self._pending.append(item)
            if self._pub is None:
                return
            if when == NOW:
                self._drain(self._pub)
            elif when == SOON and not self._woken:
                self._woken = True  # one send is due (the loop's timer or the thread's): it takes them all
                loop = self._loop
                if loop is not None and asyncio._get_running_loop() is loop:
                    loop.call_later(COALESCE_S, self._send_due)
                    return
                with contextlib.suppress(BlockingIOError):  # the pipe is full: the thread is awake already
                    os.write(self._wake_w, b"\0")

    def _send_due(self) -> None:
        """Send what waited for the window (the loop's timer, or the gossip thread woken for it)."""
        with self._pub_lock:
            self._woken = False
            if self._pending and self._pub is not None:
                self._drain(self._pub)

    def receive(self) -> int:
        """Apply the peers' messages that have come; returns how many. The router calls it before each
        decision, so a busy replica routes on its peers' latest picks and load instead of what its gossip
        thread last got the interpreter to apply (``python -m bench.gossip``); at most :data:`RECEIVE_GO`
        messages (a flood is left to the next decisions and the thread). While the gossip thread is applying,
        it waits for that go to finish (the same messages; the thread, holding the socket's lock and waiting
        for the GIL, gets it at once): skipping them instead left a burst's decisions up to a switch interval
        (5 ms) behind, each time the thread got in."""
        with self._sub_lock:
            sub = self._sub
            if sub is None or not int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return 0
            return self._receive(sub)

    def _receive(self, sub: zmq.Socket[bytes]) -> int:
        n = 0
        while n < RECEIVE_GO:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.messages[self.apply(frames)] += 1
            n += 1
        return n

    @property
    def live_peers(self) -> int:
        """Peer replicas heard from within :data:`SILENT_S`."""
        now = time.monotonic()
        return sum(1 for t in list(self._heard.values()) if now - t < SILENT_S)

    # --- the gossip thread -------------------------------------------------------------
    def start(self, thread: bool = True) -> ReplicaGossip:
        """Bind the PUB socket (its port chosen when ``port`` is 0), connect the SUB socket to the peers and
        start the gossip thread (``thread=False``: the sockets alone, for the pick paths: no heartbeats, the
        peers' addresses not followed, nothing applied between decisions)."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        for sock in (pub, sub):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.setsockopt(zmq.RCVHWM, 10_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + _TAG + 64)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        host = "*" if self.host in ("", "0.0.0.0", "::") else self.host
        try:
            if self.port:
                pub.bind(f"tcp://{host}:{self.port}")
            else:
                self.port = pub.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            pub.close(0)
            sub.close(0)
            ctx.term()
            raise RuntimeError(f"gossip: could not bind {self.host}:{self.port}: {e}") from e
        self._ctx = ctx
        connected = self._reconnect(sub, set(), resolve(self.peers))
        with self._sub_lock:
            self._sub = sub
        with self._pub_lock:
            self._pub = pub
            if self._pending:
                self._drain(pub)
        if thread:
            self._thread = threading.Thread(target=self._run, args=(connected,), name="epp-gossip",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self._thread is not None:
            self._thread.join(5)
        with self._pub_lock:
            if self._pub is not None:
                self._drain(self._pub)
                self._pub.close(0)
                self._pub = None
        with self._sub_lock:
            if self._sub is not None:
                self._sub.close(0)
                self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self, connected: set[str]) -> None:
        sub, pub = self._sub, self._pub
        assert sub is not None and pub is not None
        try:
            with self._sub_lock:
                fd = int(sub.getsockopt(zmq.FD))
            next_refresh, next_beat = time.monotonic() + REFRESH_S, 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_refresh:
                    want = resolve(self.peers)  # names: may wait on DNS, holding no lock
                    with self._sub_lock:
                        connected = self._reconnect(sub, connected, want)
                    next_refresh = now + REFRESH_S
                if now >= next_beat:
                    with self._pub_lock:
                        self._drain(pub)
                        self._send(pub, [], [])
                    self._forget_silent(now)
                    next_beat = now + HEARTBEAT_S
                # the SUB socket's descriptor signals new messages (edge-triggered: a pick path that took
                # them may leave it quiet, hence the bounded wait)
                ready, _, _ = select.select([fd, self._wake_r], [], [], min(IDLE_WAIT_S, next_beat - now))
                woken = self._wake_r in ready
                if woken:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                    # this replica's first tokens and ends of the next window leave in one message (a pick
                    # meanwhile takes them along at once)
                    time.sleep(COALESCE_S)
                    self._send_due()
                elif ready:
                    # peers' messages have come: what comes in the window is applied in one wake-up (a
                    # wake-up costs more than applying a peer's pick and tickets); a replica that routes
                    # meanwhile takes them before its decisions (receive) and leaves none here. A change to
                    # send ends the wait (the pipe: handled on the next turn)
                    select.select([self._wake_r], [], [], APPLY_WINDOW_S)
                n = got = self.receive()
                while got and n < RECEIVE_MAX:
                    # until the socket says nothing is left (reading its state re-arms the descriptor, which
                    # then signals only what comes after), one go at a time: a pick path may take the lock
                    # between two
                    got = self.receive()
                    n += got
        except Exception:  # the thread must not die silently: log, picks and load then stay local
            log.exception("gossip: stopped")

    def _reconnect(self, sub: zmq.Socket[bytes], connected: set[str], want: set[str]) -> set[str]:
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
        """Send what is held back, as few messages as fit (the caller holds the PUB lock): a receiving
        replica pays a decode and a check per message."""
        pending, self._pending = self._pending, []
        picks: list[Pick] = []
        tickets: list[TicketChange] = []
        size = 0
        for item in pending:
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
        except zmq.ZMQError:  # full (a slow peer at the high-water mark) or closed
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
