"""Pick gossip: EPP replicas share their speculative picks, so a burst spread over replicas does not scatter.

Every replica subscribes to every pod's KV events, so the exact index is the same on all of them. What
each replica alone knows is its own picks: between a pick and the KV events of its prefill (a queue wait
plus a prefill), a same-prefix request that the gateway sends to another replica sees no hit and may go
elsewhere. Each replica therefore publishes its picks — the pod and the prompt's keys at
:func:`~kvfleet.epp.index.spec_positions` (the positions are absolute, so the sample is the pick) — on a
ZMQ PUB socket, and subscribes to its peers'. A received pick becomes a speculative entry on the named pod
for ``gossip_ttl_s`` (:meth:`~kvfleet.epp.index.BlockIndex.add_speculative_sampled`); the pod's KV events
take over from there, as they do for the replica's own picks.

Wire, one message per pick: ``[payload]`` or, with a secret, ``[payload, HMAC-SHA256(secret, payload)]``;
``payload`` is msgpack ``[1, replica id, pod, [keys]]``. The port is a boundary like any other: a message
larger than :data:`MAX_BYTES` or with more than :data:`MAX_KEYS` keys, undecodable, of another version,
with a missing or wrong tag (when a secret is set), from this replica, or naming a pod the replica does not
serve is dropped and counted by reason (``kvfleet_epp_gossip_picks_total{direction="in",result=...}``). The
pick path never waits: picks go through a bounded queue (full: dropped, counted) to the gossip thread,
which owns both sockets; ZMQ's high-water mark bounds what a slow peer can hold.

Peers are ``host:port`` entries; a name that resolves to several addresses (the chart's headless
``<epp>-replicas`` Service) means each of them, and names are resolved again every :data:`REFRESH_S`,
so replicas that come and go are followed. A replica may list itself: its own messages are dropped by id.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec
import zmq

from kvfleet.epp.index import BlockIndex

log = logging.getLogger(__name__)

VERSION = 1
MAX_KEYS = 4096
MAX_BYTES = 64 * 1024
REFRESH_S = 10.0
_TAG = 32


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


class PickGossip:
    """One replica's gossip: publishes its picks on ``host:port``, applies its peers' to ``index``."""

    def __init__(
        self,
        index: BlockIndex,
        *,
        host: str,
        port: int,
        peers: Sequence[str],
        ttl_s: float,
        known_pod: Callable[[str], bool],
        secret: bytes = b"",
        replica: str = "",
        queue_size: int = 4096,
    ) -> None:
        self.index, self.host, self.port, self.peers, self.ttl_s = index, host, port, tuple(peers), ttl_s
        self.known_pod, self.secret = known_pod, secret
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.out: Counter[str] = Counter()
        """Own picks: ``sent`` or ``dropped`` (the queue was full)."""
        self.received: Counter[str] = Counter()
        """Peers' messages by result: ``applied``, ``self``, ``unknown_pod``, ``too_large``, ``malformed``, ``bad_tag``."""
        self._queue: queue.Queue[tuple[str, list[int]]] = queue.Queue(queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(tuple[int, str, str, list[int]])

    # --- the pick path -----------------------------------------------------------------
    def publish(self, pod: str, sampled: list[int]) -> None:
        """Queue one of this replica's picks (the index's ``on_pick``); never blocks."""
        try:
            self._queue.put_nowait((pod, sampled))
        except queue.Full:
            self.out["dropped"] += 1

    # --- the gossip thread -------------------------------------------------------------
    def start(self) -> PickGossip:
        self._thread = threading.Thread(target=self._run, name="epp-gossip", daemon=True)
        self._thread.start()
        if not self._bound.wait(10):
            raise RuntimeError(f"gossip: could not bind {self.host}:{self.port}")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

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
            next_refresh = 0.0
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_refresh:
                    connected = self._reconnect(sub, connected)
                    next_refresh = now + REFRESH_S
                self._drain(pub)
                if poller.poll(20):
                    for _ in range(1000):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(frames)
            self._drain(pub)
        except Exception:  # the thread must not die silently: log, picks then stay local
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

    def _drain(self, pub: zmq.Socket[bytes]) -> None:
        while True:
            try:
                pod, sampled = self._queue.get_nowait()
            except queue.Empty:
                return
            payload = self._encoder.encode((VERSION, self.replica, pod, sampled[:MAX_KEYS]))
            frames = [payload, hmac.new(self.secret, payload, hashlib.sha256).digest()] if self.secret else [payload]
            try:
                pub.send_multipart(frames, zmq.NOBLOCK)
                self.out["sent"] += 1
            except zmq.Again:
                self.out["dropped"] += 1

    def _receive(self, frames: list[bytes]) -> None:
        self.received[self.apply(frames)] += 1

    def apply(self, frames: Sequence[bytes]) -> str:
        """Check one received message and record its pick; returns the result it is counted under."""
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
            version, replica, pod, keys = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "malformed"
        if version != VERSION or not keys:  # msgpack ints are int64/uint64: any decoded key is a valid block key
            return "malformed"
        if len(keys) > MAX_KEYS:
            return "too_large"
        if replica == self.replica:
            return "self"
        if not self.known_pod(pod):
            return "unknown_pod"
        self.index.add_speculative_sampled(pod, keys, self.ttl_s)
        return "applied"
