"""Typed errors of the tier stores and the tier manager; behaviour branches on the type."""

from __future__ import annotations


class TierError(Exception):
    """Base of every tier error."""


class UnknownBackendError(TierError, ValueError):
    """A storage backend name is not registered; the message lists the known names."""


class TierFullError(TierError):
    """The store has no room for the block now (demotion may make room)."""


class BlockTooLargeError(TierError):
    """The block can never fit this store (bigger than a slot); use another tier."""


class BlockNotFoundError(TierError, KeyError):
    """The manager or store does not hold this block hash."""


class CorruptBlockError(TierError):
    """A stored record fails its checks (magic, header, checksum, name); ``reason`` says which."""

    def __init__(self, message: str, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


class TruncatedBlockError(CorruptBlockError):
    """A stored record is shorter (or longer) than its header says."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="truncated")


class TierIOError(TierError):
    """The store's medium failed (disk full, I/O error); ``kind`` is a metric label."""

    def __init__(self, message: str, kind: str = "io") -> None:
        super().__init__(message)
        self.kind = kind


class TierUnavailableError(TierIOError):
    """The store cannot be reached now (Redis down); the manager skips it for a while."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="unavailable")


class BackpressureError(TierError):
    """A migration queue is full; the caller should retry later or recompute."""
