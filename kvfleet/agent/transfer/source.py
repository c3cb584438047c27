"""Where blocks come from (sender side): a ``BlockSource`` maps block hash → bytes.

The tiers' block storage implements it; :class:`MemoryBlockStore` is the plain
in-memory one (the engine simulator and tests use it). The returned buffer is
sent straight from its memory, so it must stay unchanged while a transfer
reads it (blocks are content-addressed: the bytes of a hash never change).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from kvfleet.agent.transfer.frames import BlockHash

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class BlockSource(Protocol):
    """Read access to local KV blocks by hash; must be safe to call from I/O threads."""

    def get_block(self, block_hash: BlockHash) -> Buffer | None:
        """The block's bytes, or ``None`` when it is not held here."""
        ...


class MemoryBlockStore:
    """A thread-safe dict of block hash → bytes; also usable as a destination."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, Buffer] = {}
        self._lock = threading.Lock()

    def put(self, block_hash: BlockHash, data: Buffer) -> None:
        with self._lock:
            self._blocks[block_hash] = data

    def get_block(self, block_hash: BlockHash) -> Buffer | None:
        with self._lock:
            return self._blocks.get(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._blocks.pop(block_hash, None)

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[BlockHash]:
        with self._lock:
            return iter(list(self._blocks))
