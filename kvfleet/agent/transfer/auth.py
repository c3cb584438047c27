"""Mutual HMAC-SHA256 challenge/response with the pool's shared secret, then keyed frames.

1. server → ``HELLO{nonce_s, host, backends}``
2. client → ``AUTH{nonce_c, mac_c = HMAC(secret, "c" ‖ nonce_s ‖ nonce_c), backend, payload_mac}``
3. server checks ``mac_c`` (constant-time) → ``AUTH_OK{mac_s = HMAC(secret, "s" ‖ nonce_s ‖ nonce_c)}``
   or ``AUTH_FAIL`` and close; the client checks ``mac_s`` the same way.

The secret never crosses the wire; fresh 32-byte nonces on both sides defeat
replay of a recorded exchange. The secret comes from a file (in Kubernetes a
mounted Secret the chart creates) or an environment variable.

Both sides then derive two session keys (:func:`session_keys`: HKDF-SHA256
of the secret, salted with both nonces, bound to the chosen backend and
``payload_mac`` so a man in the middle cannot change either choice), and every
later frame carries a :data:`TAG_BYTES` tag from a :class:`FrameSeal`::

    tag_n = GMAC-AES-256(key, nonce = 0^32 ‖ n, header ‖ bytes after the header)

(the header has a fixed size and carries the length of what follows, so the
concatenation is unambiguous).

GMAC is AES-GCM with no plaintext (NIST SP 800-38D): a MAC that is secure
while no nonce repeats under one key. ``n`` counts the frames of that
direction on that connection (64 bits), and each connection has its own two
keys, so no nonce repeats; and a frame cannot be replayed, reordered or
dropped unnoticed. The bytes after the header are a control frame's body, and
a ``BLOCK`` frame's payload when the receiver asked for ``payload_mac`` (else
only the header, whose xxh3 checksum then guards the payload against
accidents only). GMAC rather than HMAC-SHA256: OpenSSL's GHASH with the CPU's
carry-less multiply runs about 10 × SHA-256 with the SHA extensions on one
core here (``bench.transfer`` prints both), so the receiver's pass over every
payload byte no longer halves a loopback stream.

An ``AUTH`` frame is about 120 bytes; one announcing more than
:data:`MAX_AUTH_BYTES` is refused from its header alone (:func:`check_auth_header`),
before any of its body is read or a buffer for it allocated.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvfleet.agent.transfer.errors import AuthError, FrameError
from kvfleet.agent.transfer.frames import FrameType, Header, decode_body, decode_header

_LABEL = b"kvfleet-transfer-v3"
NONCE_BYTES = 32
MAX_AUTH_BYTES = 4096
#: Bytes of the MAC that follows every frame after the handshake (a full GCM tag).
TAG_BYTES = 16
#: Frames with at most this many bytes are tagged in one call over a joined copy; longer ones stream.
_ONE_SHOT_BYTES = 64 << 10


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """HMAC-SHA256 over the label, role (``b"c"``/``b"s"``) and both nonces."""
    return hmac.new(secret, _LABEL + role + nonce_s + nonce_c, hashlib.sha256).digest()


def verify(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes, got: object) -> None:
    """Raise :class:`AuthError` unless ``got`` is the expected MAC."""
    if not isinstance(got, bytes) or not hmac.compare_digest(mac(secret, role, nonce_s, nonce_c), got):
        raise AuthError("HMAC challenge failed (wrong pool secret?)")


def session_keys(secret: bytes, nonce_s: bytes, nonce_c: bytes, backend: str,
                 payload_mac: bool) -> tuple[bytes, bytes]:
    """``(server → client, client → server)`` frame keys of one connection.

    HKDF-SHA256 (RFC 5869): extract with both nonces as the salt and the pool
    secret as the input key; expand with the label, the chosen backend and the
    ``payload_mac`` choice, so a connection whose AUTH choices were altered in
    transit ends up with keys the other side does not share.
    """
    prk = hmac.new(nonce_s + nonce_c, secret, hashlib.sha256).digest()
    info = b"%s|session|%s|payload_mac=%d|" % (_LABEL, backend.encode(), int(payload_mac))
    return (
        hmac.new(prk, info + b"s2c\x01", hashlib.sha256).digest(),
        hmac.new(prk, info + b"c2s\x01", hashlib.sha256).digest(),
    )


class FrameMac:
    """The tag of one frame, fed piece by piece (:meth:`FrameSeal.begin`): a block's payload is
    authenticated as each piece lands, without a second pass or a joined copy."""

    __slots__ = ("_ctx",)

    def __init__(self, key: bytes, nonce: bytes, header: bytes | bytearray | memoryview) -> None:
        self._ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        self._ctx.authenticate_additional_data(header)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if len(data):
            self._ctx.authenticate_additional_data(data)

    def tag(self) -> bytes:
        self._ctx.finalize()
        return bytes(self._ctx.tag)


class FrameSeal:
    """Tags (or checks) the frames of one direction of one connection, in order.

    Not thread-safe on its own: the sender tags under the channel's send lock,
    the receiver checks in its one I/O thread.
    """

    __slots__ = ("_aead", "_key", "counter")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._aead = AESGCM(key)
        self.counter = 0

    def _nonce(self) -> bytes:
        n = self.counter.to_bytes(12, "big")
        self.counter += 1
        return n

    def begin(self, header: bytes | bytearray | memoryview) -> FrameMac:
        """The next frame's tag, to be fed the bytes after ``header`` (advances the frame counter)."""
        return FrameMac(self._key, self._nonce(), header)

    def tag(self, header: bytes | bytearray | memoryview,
            rest: bytes | bytearray | memoryview = b"") -> bytes:
        """The next frame's tag over ``header`` and the covered ``rest`` (advances the frame counter)."""
        if len(rest) <= _ONE_SHOT_BYTES:
            return self._aead.encrypt(self._nonce(), b"", bytes(header) + bytes(rest))
        mac = self.begin(header)
        mac.update(rest)
        return mac.tag()

    def check(self, header: bytes | bytearray | memoryview, rest: bytes | bytearray | memoryview,
              got: bytes | bytearray | memoryview) -> bool:
        """True when ``got`` is the next frame's tag (constant-time; advances the counter either way)."""
        return hmac.compare_digest(self.tag(header, rest), bytes(got))


def check_nonce(nonce: object) -> bytes:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise AuthError("malformed nonce")
    return nonce


def check_auth_header(buf: bytes | bytearray | memoryview) -> Header:
    """Decode the header of the frame a server expects right after its HELLO.

    Raises :class:`FrameError` unless it is a well-formed ``AUTH`` header whose
    body is at most :data:`MAX_AUTH_BYTES`.
    """
    h = decode_header(buf, MAX_AUTH_BYTES, max_control=MAX_AUTH_BYTES)
    if h.type != FrameType.AUTH:
        raise FrameError(f"expected AUTH, got {h.type.name}")
    return h


def check_auth(
    secret: bytes, nonce_s: bytes, header: Header, payload: bytes, offered: tuple[str, ...]
) -> tuple[bytes, str, bool]:
    """Verify a client's ``AUTH`` body; returns its nonce, the backend it chose and its ``payload_mac``
    choice.

    :class:`AuthError` for a bad nonce or MAC, :class:`FrameError` for a
    malformed body or a backend that was not offered.
    """
    body: Any = decode_body(header, payload)
    if not isinstance(body, dict):
        raise FrameError("AUTH body must be a map")
    nonce_c = check_nonce(body.get("nonce"))
    verify(secret, b"c", nonce_s, nonce_c, body.get("mac"))
    backend = body.get("backend")
    if backend not in offered:
        raise FrameError(f"peer chose backend {backend!r} not offered")
    payload_mac = body.get("payload_mac")
    if not isinstance(payload_mac, bool):
        raise FrameError("AUTH needs payload_mac (bool)")
    return nonce_c, str(backend), payload_mac


def load_secret(path: str = "", env: str = "KVFLEET_TRANSFER_SECRET") -> bytes:
    """The pool secret from ``path`` (stripped) or else ``$env``; empty is an error."""
    raw = Path(path).read_bytes().strip() if path else os.environ.get(env, "").encode()
    if not raw:
        raise AuthError(f"no transfer secret: set {env} or a secret file")
    return raw
