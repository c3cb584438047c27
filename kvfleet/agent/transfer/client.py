"""The receiving side: pull blocks from a peer's :class:`TransferServer`.

:class:`TransferClient` is the entry point; the work is done a layer down:

* :mod:`.handle` — the asyncio face: :class:`TransferHandle` delivers blocks
  strictly in sequence order, each exactly once, to ``async for`` or to
  ``on_block`` (on the event loop, or with ``deliver="thread"`` in the I/O
  thread that received the block);
* :mod:`.failover` — one attempt is a session of N authenticated streams
  (tcp) or one (shm, mooncake), the missing blocks striped over them
  round-robin so that block 0 lands first, each payload received straight
  into its destination slot and checked (keyed MAC for tcp; :mod:`.auth`); a
  failed session is followed by one for the remaining blocks only, on the next
  backend at once or the same one after a jittered back-off, up to
  ``max_retries``;
* :mod:`.connection` — the handshake, one stream per connection with its I/O
  thread and its credits (flow control: streams × window blocks in flight at
  most), and the pool of idle authenticated streams per (peer, backend), so a
  warm transfer starts with one REQUEST frame.

Block 0's path is kept short: with pooled streams its REQUEST leaves inside
``pull()``; a stream's I/O thread is waiting in ``recv`` before its REQUEST is
written; stream 0 starts before the others connect. ``Block``,
``TransferHandle``, ``TransferStats``, ``Allocator`` and ``Peer`` stay
importable from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from kvfleet.agent.transfer.backoff import Backoff
from kvfleet.agent.transfer.connection import BACKENDS as BACKENDS
from kvfleet.agent.transfer.connection import Allocator as Allocator
from kvfleet.agent.transfer.connection import Peer as Peer
from kvfleet.agent.transfer.connection import _connect as _connect
from kvfleet.agent.transfer.connection import _Connections, _default_alloc, _parse_peer
from kvfleet.agent.transfer.connection import _Stream as _Stream
from kvfleet.agent.transfer.errors import TransferError, UnknownBackendError
from kvfleet.agent.transfer.failover import _Session, drive
from kvfleet.agent.transfer.frames import BlockHash
from kvfleet.agent.transfer.handle import DELIVERY as DELIVERY
from kvfleet.agent.transfer.handle import Block as Block
from kvfleet.agent.transfer.handle import TransferHandle as TransferHandle
from kvfleet.agent.transfer.handle import TransferStats as TransferStats
from kvfleet.agent.transfer.metrics import TransferMetrics
from kvfleet.agent.transfer.topology import choose_backends
from kvfleet.config.transfer import TransferSettings


class TransferClient(_Connections):
    """Pulls blocks from peers' transfer servers; one client per agent."""

    def __init__(self, secret: bytes, *, settings: TransferSettings | None = None,
                 metrics: TransferMetrics | None = None) -> None:
        super().__init__(secret, settings=settings, metrics=metrics)
        self.backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        self._sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep  # injectable for tests

    async def __aenter__(self) -> TransferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def pull(
        self,
        peer: Peer,
        block_hashes: Iterable[BlockHash],
        on_block: Callable[[Block], Any] | None = None,
        *,
        alloc: Allocator | None = None,
        streams: int | None = None,
        backends: Sequence[str] | None = None,
        deliver: str = "loop",
    ) -> TransferHandle:
        """Start pulling ``block_hashes`` from ``peer``; returns at once (call from a coroutine).

        ``alloc`` gives each block its destination buffer (default: a new
        bytearray); ``streams`` overrides the tcp stream count; ``backends``
        restricts and orders the backends tried (default: the topology's choice).
        ``deliver`` says where ``on_block`` runs: ``"loop"`` (the event loop
        thread) or ``"thread"`` (the receiving I/O thread, as soon as the block
        is verified: the lowest first-block latency; see :class:`TransferHandle`).
        """
        for name in backends or ():
            if name not in BACKENDS:
                raise UnknownBackendError(name, list(BACKENDS))
        if deliver not in DELIVERY:
            raise ValueError(f"deliver must be one of {', '.join(DELIVERY)}, got {deliver!r}")
        if deliver == "thread" and on_block is None:
            raise ValueError('deliver="thread" needs an on_block callback')
        handle = TransferHandle(list(block_hashes), on_block, in_thread=deliver == "thread")
        host, port = _parse_peer(peer)
        n = streams if streams is not None else self.settings.streams
        if n < 1:
            raise ValueError(f"streams must be >= 1, got {n}")
        handle._finish_hooks.append(self._record)
        if not handle.block_hashes:
            handle._finish(None)
            return handle
        alloc = alloc or _default_alloc
        candidates = list(backends) if backends else None
        known = self._remotes.get((host, port))
        if candidates is None and known is not None:
            candidates = choose_backends(self.local, known)
        warm: _Session | None = None
        if candidates:  # pooled streams: block 0's request goes out before this call returns
            session = _Session(self, handle, host, port, alloc, n)
            try:
                if session.start_warm(candidates[0]):
                    warm = session
            except TransferError:  # a pooled connection died under us: the driver reconnects
                session.close()
        handle._task = asyncio.get_running_loop().create_task(
            self._drive(handle, host, port, alloc, n, candidates, warm))
        if warm is not None:  # closed also when the task is cancelled before it runs
            close_warm = warm.close
            handle._task.add_done_callback(lambda _t: close_warm())
        return handle

    #: ``transfer(block_hashes, peer)`` reads well where the caller thinks in batches.
    def transfer(self, block_hashes: Iterable[BlockHash], peer: Peer, **kw: Any) -> TransferHandle:
        return self.pull(peer, block_hashes, **kw)

    async def _drive(
        self, handle: TransferHandle, host: str, port: int, alloc: Allocator, n: int,
        candidates: list[str] | None, warm: _Session | None,
    ) -> None:
        await drive(self, handle, host, port, alloc, n, candidates, warm, self.backoff, self._sleep)

    def _record(self, handle: TransferHandle) -> None:
        if handle.state == "done" and handle.stats.finished_s:
            backend = handle.stats.backends[-1] if handle.stats.backends else "none"
            self.metrics.completed(backend, handle.stats.bytes, handle.stats.finished_s)
