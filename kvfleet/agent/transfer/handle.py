"""The asyncio face of a transfer: :class:`TransferHandle`, the blocks it delivers and its stats.

The handle delivers blocks strictly in sequence order, each exactly once, as
soon as the gap before it closes, whichever stream or session they came on:
to an ``async for`` over it, or to an ``on_block`` callback on the event loop
or (``deliver="thread"``) in the receiving I/O thread. Each delivered block
gives its stream a credit back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.agent.transfer.connection import _Stream
from kvfleet.agent.transfer.errors import TransferCancelled
from kvfleet.agent.transfer.frames import BlockHash

#: Where ``on_block`` runs: the event loop thread, or the receiving I/O thread.
DELIVERY: tuple[str, ...] = ("loop", "thread")


@dataclass(frozen=True, slots=True)
class Block:
    """One delivered block: its position in the batch, its hash and its bytes."""

    seq: int
    block_hash: BlockHash
    data: memoryview


@dataclass
class TransferStats:
    """What one transfer did; filled in as it runs."""

    blocks: int = 0
    bytes: int = 0
    retries: int = 0
    failovers: int = 0
    backoff_s: float = 0.0  # waited between retries in total
    backends: list[str] = field(default_factory=list)
    started: float = 0.0
    first_block_s: float | None = None
    finished_s: float | None = None


class TransferHandle:
    """A running transfer: async-iterate it for blocks in sequence order, or pass ``on_block``.

    ``await handle.wait()`` returns when every block was delivered (or raises
    the :class:`TransferError` that ended it); ``handle.cancel()`` stops it
    (then ``wait`` raises :class:`TransferCancelled`). Without ``on_block``
    the blocks must be consumed (iterate, or ``await handle.collect()``):
    unconsumed blocks hold the sender's credits.

    With ``deliver="thread"`` the ``on_block`` callback runs in the receiving
    I/O thread, right after the block's checksum was verified: no hop to the
    event loop before the consumer sees it. Calls are serialised by a lock and
    stay in sequence order, each block once; the callback must not block on
    the event loop (use ``loop.call_soon_threadsafe``). A block whose delivery
    is already under way when the transfer is cancelled still completes.
    """

    def __init__(self, hashes: Sequence[BlockHash], on_block: Callable[[Block], Any] | None, *,
                 in_thread: bool = False) -> None:
        self.block_hashes = list(hashes)
        self.stats = TransferStats(started=time.perf_counter())
        self._on_block = on_block
        self._in_thread = in_thread and on_block is not None
        self._lock = threading.Lock()  # guards _landed/_next/credits while I/O threads deliver
        self._stopped = False
        self.complete = False  # every block delivered (set in the I/O thread with deliver="thread")
        self._landed: dict[int, tuple[Block, _Stream | None]] = {}
        self._next = 0
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._finish_hooks: list[Callable[[TransferHandle], Any]] = []
        self._holding: set[_Stream] = set()

    # -- observing ------------------------------------------------------------
    def done(self) -> bool:
        return self._done.done()

    @property
    def state(self) -> str:
        """``running``, ``done``, ``failed`` or ``cancelled``."""
        if not self._done.done():
            return "running"
        if self._error is None:
            return "done"
        return "cancelled" if isinstance(self._error, TransferCancelled) else "failed"

    def exception(self) -> BaseException | None:
        return self._error

    @property
    def delivered(self) -> int:
        return self._next

    async def wait(self) -> TransferStats:
        await asyncio.shield(self._done)
        return self.stats

    def cancel(self) -> None:
        if not self._done.done():
            self._finish(TransferCancelled("transfer cancelled"))

    def add_done_callback(self, fn: Callable[[TransferHandle], Any]) -> None:
        self._done.add_done_callback(lambda _f: fn(self))

    async def collect(self) -> list[Block]:
        return [b async for b in self]

    def __aiter__(self) -> AsyncIterator[Block]:
        if self._on_block is not None:
            raise RuntimeError("this transfer delivers through on_block; it cannot also be iterated")
        return self._iterate()  # a new iterator continues where the last one stopped

    async def _iterate(self) -> AsyncIterator[Block]:
        n = len(self.block_hashes)
        while self._next < n:
            got = self._landed.pop(self._next, None)
            if got is None:
                if self._error is not None:
                    raise self._error
                self._flush_credits()
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._deliver(*got):
                self._finish(None)
            yield got[0]
        if self._error is not None and not isinstance(self._error, TransferCancelled):
            raise self._error

    # -- fed by the driver (event-loop thread) --------------------------------
    def _is_needed(self, seq: int) -> bool:
        return seq >= self._next and seq not in self._landed

    def _landed_block(self, block: Block, stream: _Stream | None) -> None:
        if not self._is_needed(block.seq) or self._done.done():
            return  # a duplicate from an older session: never delivered twice
        if block.seq == 0 and self.stats.first_block_s is None:
            self.stats.first_block_s = time.perf_counter() - self.stats.started
        self._landed[block.seq] = (block, stream)
        if self._on_block is not None:
            while self._next in self._landed:
                b, s = self._landed.pop(self._next)
                try:
                    self._on_block(b)
                except Exception as exc:  # the consumer's failure ends the transfer
                    self._finish(exc)
                    return
                if self._deliver(b, s):
                    self._finish(None)
            self._flush_credits()
        else:
            self._wake.set()

    # -- fed by an I/O thread (deliver="thread") --------------------------------
    def _landed_in_thread(self, block: Block, stream: _Stream | None) -> None:
        """Deliver ``block`` and any landed successors to ``on_block`` from this I/O thread."""
        assert self._on_block is not None
        with self._lock:
            if self._stopped or not self._is_needed(block.seq):
                return  # a duplicate from an older session, or the transfer ended
            if block.seq == 0 and self.stats.first_block_s is None:
                self.stats.first_block_s = time.perf_counter() - self.stats.started
            self._landed[block.seq] = (block, stream)
            while self._next in self._landed and not self._stopped:
                b, s = self._landed.pop(self._next)
                try:
                    self._on_block(b)
                except Exception as exc:  # the consumer's failure ends the transfer
                    self._stopped = True
                    self._loop.call_soon_threadsafe(self._finish, exc)
                    return
                if self._deliver(b, s):
                    self._stopped = self.complete = True  # the session's _landed, posted next, finishes
            self._flush_credits()

    def _deliver(self, block: Block, stream: _Stream | None) -> bool:
        """Account one delivered block; True when it was the last one."""
        self._next = block.seq + 1
        self.stats.blocks += 1
        self.stats.bytes += len(block.data)
        if stream is not None and stream.give_back(stream.batch):
            self._holding.add(stream)
        if self._next == len(self.block_hashes):
            self.stats.finished_s = time.perf_counter() - self.stats.started
            return True
        return False

    def _flush_credits(self) -> None:
        for st in self._holding:
            st.flush()
        self._holding.clear()

    def _finish(self, error: BaseException | None) -> None:
        if self._done.done():
            return
        self._stopped = True
        self._error = error
        if error is None:
            self._done.set_result(None)
        else:
            self._done.set_exception(error)
            self._done.exception()  # mark retrieved: iteration reports it too
            if self._task is not None and self._task is not asyncio.current_task():
                self._task.cancel()  # stop the driver: its session closes its streams
        for hook in self._finish_hooks:
            hook(self)
        self._wake.set()

    def _missing(self) -> list[tuple[int, BlockHash]]:
        with self._lock:
            return [(s, self.block_hashes[s]) for s in range(self._next, len(self.block_hashes))
                    if s not in self._landed]
