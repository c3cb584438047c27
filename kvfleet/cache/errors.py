"""Typed errors of the cache core: callers branch on the type, never on the message."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error raised by :mod:`kvfleet.cache`."""


class OutOfBlocksError(CacheError):
    """The pool has no free block and nothing evictable: the caller must wait or preempt.

    Raised before any state changes, so a failed allocation leaves the pool as it was.
    """

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"out of KV blocks: need {needed}, {available} free or evictable")
        self.needed = needed
        self.available = available


class UnknownSequenceError(CacheError, KeyError):
    """An operation named a sequence id the block manager does not hold."""


class LockedError(CacheError):
    """An operation would free a node or block that is still locked or referenced."""


class EventDecodeError(CacheError, ValueError):
    """A KV-event payload is not a valid ``KVEventBatch`` (bad msgpack or schema)."""


class UnknownAlgorithmError(CacheError, ValueError):
    """A hash algorithm (or other registry name) is not known; the message lists the known names."""
