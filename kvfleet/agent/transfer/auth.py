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

    tag_n = HMAC-SHA256(key, n ‖ header ‖ SHA-256(bytes after the header))

``n`` counts the frames of that direction on that connection, so a frame
cannot be replayed, reordered or dropped unnoticed. The bytes after the
header are a control frame's body, and a ``BLOCK`` frame's payload when the
receiver asked for ``payload_mac`` (else only the header, whose xxh3 checksum
then guards the payload against accidents only). HMAC-SHA256 rather than
keyed BLAKE2b: OpenSSL's SHA-256 uses the CPU's SHA extensions, about 2.5 ×
hashlib's BLAKE2b here. The sender caches each block's SHA-256, as it caches
its xxh3 checksum, so only the receiver hashes the payload on every transfer.

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

from kvfleet.agent.transfer.errors import AuthError, FrameError
from kvfleet.agent.transfer.frames import FrameType, Header, decode_body, decode_header

_LABEL = b"kvfleet-transfer-v2"
NONCE_BYTES = 32
MAX_AUTH_BYTES = 4096
#: Bytes of the MAC that follows every frame after the handshake (a full HMAC-SHA256).
TAG_BYTES = 32
#: SHA-256 of nothing: the digest a tag covers for a frame with no bytes after its header.
EMPTY_DIGEST = hashlib.sha256(b"").digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """HMAC-SHA256 over the label, role (``b"c"``/``b"s"``) and both nonces."""
    return hmac.new(secret, _LABEL + role + nonce_s + nonce_c, hashlib.sha256).digest()


def verify(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes, got: object) -> None:
    """Raise :class:`AuthError` unless ``got`` is the expected MAC."""
    if not isinstance(got, bytes) or not hmac.compare_digest(mac(secret, role, nonce_s, nonce_c), got):
        raise AuthError("HMAC challenge failed (wrong pool secret?)")


def payload_digest(data: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of the bytes that follow a header (hashlib releases the GIL while it hashes)."""
    return hashlib.sha256(data).digest()


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


class FrameSeal:
    """Tags (or checks) the frames of one direction of one connection, in order.

    Not thread-safe on its own: the sender tags under the channel's send lock,
    the receiver checks in its one I/O thread.
    """

    __slots__ = ("_key", "counter")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.counter = 0

    def tag(self, header: bytes | bytearray | memoryview, rest_digest: bytes = EMPTY_DIGEST) -> bytes:
        """The next frame's tag (advances the frame counter)."""
        t = hmac.digest(self._key, self.counter.to_bytes(8, "big") + bytes(header) + rest_digest, "sha256")
        self.counter += 1
        return t

    def check(self, header: bytes | bytearray | memoryview, rest_digest: bytes,
              got: bytes | bytearray | memoryview) -> bool:
        """True when ``got`` is the next frame's tag (constant-time; advances the counter either way)."""
        return hmac.compare_digest(self.tag(header, rest_digest), bytes(got))


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
