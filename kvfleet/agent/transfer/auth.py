"""Mutual HMAC-SHA256 challenge/response with the pool's shared secret.

1. server → ``HELLO{nonce_s, host, backends}``
2. client → ``AUTH{nonce_c, mac_c = HMAC(secret, "c" ‖ nonce_s ‖ nonce_c), backend}``
3. server checks ``mac_c`` (constant-time) → ``AUTH_OK{mac_s = HMAC(secret, "s" ‖ nonce_s ‖ nonce_c)}``
   or ``AUTH_FAIL`` and close; the client checks ``mac_s`` the same way.

The secret never crosses the wire; fresh 32-byte nonces on both sides defeat
replay of a recorded exchange. The secret comes from a file (in Kubernetes a
mounted Secret the chart creates) or an environment variable.

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

_LABEL = b"kvfleet-transfer-v1"
NONCE_BYTES = 32
MAX_AUTH_BYTES = 4096


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """HMAC-SHA256 over the label, role (``b"c"``/``b"s"``) and both nonces."""
    return hmac.new(secret, _LABEL + role + nonce_s + nonce_c, hashlib.sha256).digest()


def verify(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes, got: object) -> None:
    """Raise :class:`AuthError` unless ``got`` is the expected MAC."""
    if not isinstance(got, bytes) or not hmac.compare_digest(mac(secret, role, nonce_s, nonce_c), got):
        raise AuthError("HMAC challenge failed (wrong pool secret?)")


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


def check_auth(secret: bytes, nonce_s: bytes, header: Header, payload: bytes, offered: tuple[str, ...]) -> tuple[bytes, str]:
    """Verify a client's ``AUTH`` body; returns its nonce and the backend it chose.

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
    return nonce_c, str(backend)


def load_secret(path: str = "", env: str = "KVFLEET_TRANSFER_SECRET") -> bytes:
    """The pool secret from ``path`` (stripped) or else ``$env``; empty is an error."""
    raw = Path(path).read_bytes().strip() if path else os.environ.get(env, "").encode()
    if not raw:
        raise AuthError(f"no transfer secret: set {env} or a secret file")
    return raw
