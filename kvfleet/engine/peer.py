"""Engine-to-engine trust: signed internal HTTP requests and the prefill pool's membership.

Signing. The engines of a pool share one transfer secret (``transfer.secret_file``
or ``KVFLEET_TRANSFER_SECRET``, the one that authenticates the KV transfer
engine). An internal request — a decode engine's prefill request carrying
``kv_transfer_params``, ``DELETE /kvfleet/v1/kv/{id}``, ``POST /kvfleet/v1/reset``
— carries three headers::

    x-kvfleet-peer-timestamp: unix seconds (integer)
    x-kvfleet-peer-nonce:     32 hex digits, fresh per request
    x-kvfleet-peer-signature: hex HMAC-SHA256(secret, label ‖ METHOD ‖ path ‖ timestamp ‖ nonce ‖ body)

The receiver accepts it only within ±30 s of its own clock, compares the MAC in
constant time, and refuses a nonce it has already accepted (a recorded
request cannot be replayed). :func:`sign_request` is all a caller needs (the
demo signs its resets with it).

Membership. :class:`PrefillPeers` answers whether an ``x-prefiller-host-port``
names a configured prefill peer (``engine.prefill_peers``) and which address to
connect to. An IP literal is a member if it equals a configured IP literal or
one of the addresses a configured DNS name resolves to (the loop's
``getaddrinfo``, cached for ``ttl_s``); a DNS name only if it is itself
configured (it is never resolved otherwise). The connection then goes to the
checked address, so a later DNS answer cannot redirect it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import random
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from kvfleet.config.engine import HostPort, parse_host_port, parse_ip

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "x-kvfleet-peer-timestamp"
NONCE_HEADER = "x-kvfleet-peer-nonce"
SIGNATURE_HEADER = "x-kvfleet-peer-signature"
MAX_SKEW_S = 30.0
_LABEL = b"kvfleet-peer-http-v1"
_TS = re.compile(r"[0-9]{1,12}")
_NONCE = re.compile(r"[0-9a-f]{32}")
_SIG = re.compile(r"[0-9a-f]{64}")
_MAX_SEEN = 1 << 16

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class PeerAuthError(Exception):
    """An internal request without a valid peer signature; the message says why (no secrets in it)."""


def _mac(secret: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    msg = b"\n".join([_LABEL, method.upper().encode(), path.encode(), timestamp.encode(), nonce.encode(),
                      body])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign_request(secret: bytes, method: str, path: str, body: bytes = b"", *,
                 now: float | None = None) -> dict[str, str]:
    """The three peer headers for one request (``path`` as sent, with any query string)."""
    ts = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(16)
    return {TIMESTAMP_HEADER: ts, NONCE_HEADER: nonce,
            SIGNATURE_HEADER: _mac(secret, method, path, ts, nonce, body)}


class PeerVerifier:
    """Checks signed internal requests (see the module doc); ``secret`` ``None`` refuses them all."""

    def __init__(self, secret: bytes | None, max_skew_s: float = MAX_SKEW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.max_skew_s = max_skew_s
        self.clock = clock
        self._seen: dict[str, float] = {}

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """Raise :class:`PeerAuthError` unless the request is signed with the pool secret, fresh and new."""
        if self.secret is None:
            raise PeerAuthError(
                "this engine has no transfer secret (set transfer.secret_file or KVFLEET_TRANSFER_SECRET)")
        ts, nonce, sig = (headers.get(h, "") for h in (TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER))
        if not (_TS.fullmatch(ts) and _NONCE.fullmatch(nonce) and _SIG.fullmatch(sig)):
            raise PeerAuthError(
                f"missing or malformed peer signature ({TIMESTAMP_HEADER}, {NONCE_HEADER}, "
                f"{SIGNATURE_HEADER})")
        now = self.clock()
        if abs(now - int(ts)) > self.max_skew_s:
            raise PeerAuthError(
                f"peer signature timestamp is more than {self.max_skew_s:.0f}s away from this engine's clock")
        if not hmac.compare_digest(_mac(self.secret, method, path, ts, nonce, body), sig):
            raise PeerAuthError("peer signature does not verify (wrong pool secret?)")
        self._forget(now)
        if nonce in self._seen:
            raise PeerAuthError("peer signature already used (replayed request)")
        self._seen[nonce] = now + 2 * self.max_skew_s

    def _forget(self, now: float) -> None:
        if len(self._seen) < _MAX_SEEN:
            return
        self._seen = {n: t for n, t in self._seen.items() if t > now}
        while len(self._seen) >= _MAX_SEEN:  # only authenticated requests get here: drop the oldest
            self._seen.pop(next(iter(self._seen)))


class NotAPeerError(Exception):
    """The named prefiller is not among the configured prefill peers."""


class PeerUnresolvedError(Exception):
    """A configured prefill peer's DNS name resolved to no address."""


async def loop_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, through the running loop's getaddrinfo (never blocks the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class PrefillPeers:
    """Membership of ``engine.prefill_peers`` (see the module doc)."""

    def __init__(self, peers: Sequence[str], ttl_s: float = 2.0, resolver: Resolver = loop_resolver,
                 timeout_s: float = 2.0) -> None:
        self.peers = [parse_host_port(p) for p in peers]
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.resolver = resolver
        self._cache: dict[tuple[str, int], tuple[float, frozenset[IPAddress]]] = {}

    def __bool__(self) -> bool:
        return bool(self.peers)

    async def addresses(self, peer: HostPort) -> frozenset[IPAddress]:
        """The addresses of one configured peer (its IP, or its name resolved; cached ``ttl_s``)."""
        if peer.ip is not None:
            return frozenset([peer.ip])
        key = (peer.host, peer.port)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            raw = await asyncio.wait_for(self.resolver(peer.host, peer.port), self.timeout_s)
        except (OSError, TimeoutError) as exc:
            log.warning("prefill peer %s does not resolve: %s", peer, exc)
            raw = []
        found = frozenset(ip for ip in (parse_ip(a.split("%", 1)[0]) for a in raw) if ip is not None)
        self._cache[key] = (time.monotonic() + self.ttl_s, found)
        return found

    async def admit(self, target: HostPort) -> HostPort:
        """The address to connect to for ``target``; raises NotAPeerError / PeerUnresolvedError."""
        if target.ip is not None:
            for peer in self.peers:
                if peer.port == target.port and target.ip in await self.addresses(peer):
                    return target
            raise NotAPeerError(str(target))
        for peer in self.peers:
            if peer.ip is None and (peer.host, peer.port) == (target.host, target.port):
                found = sorted(await self.addresses(peer), key=str)
                if not found:
                    raise PeerUnresolvedError(str(target))
                ip = random.choice(found)
                return HostPort(str(ip), target.port, ip)
        raise NotAPeerError(str(target))
