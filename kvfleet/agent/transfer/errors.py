"""Typed transfer errors; the type, never the message, decides what happens next.

=====================  ==========================================================
``AuthError``          wrong or missing shared secret: permanent, never retried
``FrameError``         malformed or unexpected frame: that connection is closed
``VersionError``       the peer speaks another protocol version: permanent
``ChecksumError``      payload does not match its checksum: retried elsewhere
``IntegrityError``     a frame's keyed MAC does not verify: retried elsewhere
``StreamError``        a connection broke, stalled or timed out: retried elsewhere
``BlockNotFoundError`` the peer does not hold a requested block: permanent
``TransferCancelled``  the caller cancelled the transfer
=====================  ==========================================================
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every transfer error; ``kind`` is the metrics label."""

    kind = "error"
    retryable = False


class AuthError(TransferError):
    """The peer failed the HMAC challenge (or we failed its)."""

    kind = "auth"


class FrameError(TransferError):
    """A frame was malformed (bad magic, version, type, length or hash)."""

    kind = "frame"
    retryable = True


class VersionError(FrameError):
    """The peer speaks another version of the wire protocol: never retried (upgrade the older side)."""

    kind = "version"
    retryable = False


class ChecksumError(TransferError):
    """A block's payload did not match the checksum carried in its frame."""

    kind = "checksum"
    retryable = True


class IntegrityError(ChecksumError):
    """A frame's keyed MAC did not verify: altered in transit (its checksum fixed up) or a wrong session key.

    Handled like a corrupt block: the session fails, the blocks verified before
    it are kept and the rest are asked for again.
    """

    kind = "mac"


class StreamError(TransferError):
    """A connection broke, timed out or stalled mid-transfer."""

    kind = "stream"
    retryable = True


class BlockNotFoundError(TransferError):
    """The peer does not hold the requested block."""

    kind = "not_found"

    def __init__(self, block_hash: int | bytes) -> None:
        super().__init__(f"peer does not hold block {block_hash!r}")
        self.block_hash = block_hash


class TransferCancelled(TransferError):
    """The transfer was cancelled by its caller."""

    kind = "cancelled"


class UnknownBackendError(TransferError, KeyError):
    """A backend name that is not registered; the message lists the known names."""

    kind = "config"

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown transfer backend {name!r}; known: {', '.join(sorted(known))}")
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return str(self.args[0])
