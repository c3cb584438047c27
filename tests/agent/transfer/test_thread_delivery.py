"""``deliver="thread"``: on_block runs in the receiving I/O thread, in order, once per block, also across
failover.

Covers: the callback's thread is not the event loop's; sequence order and
exactly-once over 1 and 3 tcp streams and shm; a stream killed mid-transfer
(resume after the last verified block, nothing delivered twice); a failing
consumer ends the transfer with its error; bad ``deliver`` arguments. And
the warm start: with pooled streams, block 0's REQUEST leaves inside
``pull()`` (before the event loop turns), and a transfer cancelled before its
driver ran closes those streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from kvfleet.agent.transfer import Block, MemoryBlockStore, TransferCancelled, TransferClient, TransferServer
from tests.agent.transfer.conftest import peer
from tests.agent.transfer.test_faults import OneShot


class Recorder:
    """Collects delivered blocks (a copy of their bytes) and the threads that delivered them."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int, bytes]] = []
        self.threads: set[int] = set()

    def __call__(self, block: Block) -> None:
        self.threads.add(threading.get_ident())
        self.blocks.append((block.seq, int(block.block_hash), bytes(block.data)))

    def check(self, hashes: list[int], store: MemoryBlockStore) -> None:
        assert [s for s, _h, _d in self.blocks] == list(range(len(hashes)))
        assert [h for _s, h, _d in self.blocks] == hashes
        assert all(d == bytes(store.get_block(h)) for _s, h, d in self.blocks)  # type: ignore[arg-type]


@pytest.mark.parametrize(("backend", "streams"), [("tcp", 1), ("tcp", 3), ("shm", 1)])
async def test_blocks_reach_the_callback_in_the_io_thread_in_order_once(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int], backend: str,
    streams: int,
) -> None:
    rec = Recorder()
    handle = client.pull(peer(server), hashes, on_block=rec, backends=[backend], streams=streams,
                         deliver="thread")
    stats = await handle.wait()
    rec.check(hashes, store)
    assert threading.get_ident() not in rec.threads
    assert handle.state == "done" and stats.blocks == len(hashes) and stats.first_block_s is not None
    assert stats.bytes == sum(len(d) for _s, _h, d in rec.blocks)


@pytest.mark.parametrize("streams", [1, 3])
async def test_a_killed_stream_resumes_without_duplicates(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int], streams: int
) -> None:
    server.fault_hook = OneShot(at=5, mode="kill")
    rec = Recorder()
    handle = client.pull(peer(server), hashes, on_block=rec, backends=["tcp"], streams=streams,
                         deliver="thread")
    stats = await handle.wait()
    rec.check(hashes, store)
    assert stats.retries >= 1


async def test_a_failing_consumer_in_the_io_thread_ends_the_transfer(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    seen: list[int] = []

    def on_block(block: Block) -> None:
        seen.append(block.seq)
        if len(seen) == 3:
            raise KeyError("consumer broke")

    handle = client.pull(peer(server), hashes, on_block=on_block, backends=["tcp"], deliver="thread")
    with pytest.raises(KeyError, match="consumer broke"):
        await handle.wait()
    assert handle.state == "failed" and seen == [0, 1, 2]


async def test_bad_delivery_arguments_are_rejected(server: TransferServer, client: TransferClient,
                                                   hashes: list[int]) -> None:
    with pytest.raises(ValueError, match="loop, thread"):
        client.pull(peer(server), hashes, on_block=print, deliver="gpu")
    with pytest.raises(ValueError, match="needs an on_block"):
        client.pull(peer(server), hashes, deliver="thread")


async def test_a_warm_pull_requests_block_0_before_returning(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    """With pooled streams, block 0 reaches an in-thread consumer while the event loop is blocked right after
    pull()."""
    await client.pull(peer(server), hashes, backends=["tcp"], streams=1).collect()  # warms the pool
    first = threading.Event()
    rec = Recorder()

    def on_block(block: Block) -> None:
        rec(block)
        first.set()

    handle = client.pull(peer(server), hashes, on_block=on_block, backends=["tcp"], streams=1,
                         deliver="thread")
    assert first.wait(10)  # blocks the event loop: only a request sent inside pull() can bring block 0
    await handle.wait()
    rec.check(hashes, store)


async def test_a_warm_pull_cancelled_before_its_driver_runs_leaves_nothing_behind(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    await client.pull(peer(server), hashes, backends=["tcp"], streams=3).collect()
    handle = client.pull(peer(server), hashes, backends=["tcp"], streams=3)
    handle.cancel()
    with pytest.raises(TransferCancelled):
        await handle.wait()
    assert handle._task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await handle._task
    rec = Recorder()
    await client.pull(peer(server), hashes, on_block=rec, backends=["tcp"], streams=3,
                      deliver="thread").wait()
    rec.check(hashes, store)
