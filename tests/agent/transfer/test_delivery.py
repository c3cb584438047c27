"""Delivery over real loopback sockets and shared memory: every block exactly once, in sequence order, as it
lands."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from kvfleet.agent.transfer import Block, MemoryBlockStore, TransferClient, TransferServer
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer


def _check(blocks: list[Block], hashes: list[int], store: MemoryBlockStore) -> None:
    assert [b.seq for b in blocks] == list(range(len(hashes)))
    assert [b.block_hash for b in blocks] == hashes
    for b in blocks:
        assert bytes(b.data) == bytes(store.get_block(b.block_hash))  # type: ignore[arg-type]


@pytest.mark.parametrize(("backend", "streams"), [("tcp", 1), ("tcp", 3), ("tcp", 8), ("shm", 1)])
async def test_iteration_yields_every_block_once_in_order(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int], backend: str,
    streams: int,
) -> None:
    handle = client.pull(peer(server), hashes, backends=[backend], streams=streams)
    blocks = await handle.collect()
    _check(blocks, hashes, store)
    stats = await handle.wait()
    assert handle.state == "done" and stats.backends == [backend] and stats.retries == 0
    assert stats.blocks == len(hashes) and stats.bytes == sum(len(b.data) for b in blocks)


async def test_topology_picks_shm_on_the_same_host(server: TransferServer, client: TransferClient,
                                                   hashes: list[int]) -> None:
    handle = client.pull(peer(server), hashes)
    await handle.collect()
    assert handle.stats.backends == ["shm"]


async def test_topology_picks_tcp_across_hosts(server: TransferServer, settings: TransferSettings,
                                               hashes: list[int]) -> None:
    other = TransferClient(SECRET, settings=replace(settings, host_id="node-b"))
    handle = other.pull(f"127.0.0.1:{server.port}", hashes)
    await handle.collect()
    assert handle.stats.backends == ["tcp"]


async def test_on_block_callback_and_transfer_alias(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    got: list[Block] = []
    handle = client.transfer(hashes, peer(server), on_block=got.append, backends=["tcp"])
    await handle.wait()
    _check(got, hashes, store)
    with pytest.raises(RuntimeError):
        handle.__aiter__()


async def test_blocks_land_in_the_callers_preallocated_slots(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    sizes = [len(store.get_block(h)) for h in hashes]  # type: ignore[arg-type]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    arena = bytearray(sum(sizes))
    view = memoryview(arena)
    handle = client.pull(peer(server), hashes, alloc=lambda seq, h, n: view[offsets[seq] : offsets[seq] + n],
                         backends=["tcp"])
    await handle.collect()
    assert bytes(arena) == b"".join(bytes(store.get_block(h)) for h in hashes)  # type: ignore[arg-type]


async def test_bytes_hashes_and_repeated_blocks(settings: TransferSettings) -> None:
    store = MemoryBlockStore()
    hs = [os.urandom(32) for _ in range(5)]
    for h in hs:
        store.put(h, os.urandom(1000))
    batch = [*hs, hs[0]]  # the same block twice in one batch is two deliveries
    async with TransferServer(store, SECRET, settings=settings) as srv:
        blocks = await TransferClient(SECRET, settings=settings).pull(peer(srv), batch,
                                                                      backends=["tcp"]).collect()
    assert [b.block_hash for b in blocks] == batch
    assert bytes(blocks[-1].data) == bytes(blocks[0].data)


async def test_empty_batch_completes_at_once(server: TransferServer, client: TransferClient) -> None:
    handle = client.pull(peer(server), [])
    assert await handle.collect() == []
    assert handle.state == "done"


async def test_first_block_is_delivered_before_the_batch_is_sent(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings
) -> None:
    """Pipelining: with a 2-block window the first block reaches the consumer while most of the batch is
    unsent."""
    s = replace(settings, window_blocks=2, streams=1)
    async with TransferServer(store, SECRET, settings=s) as srv:
        handle = TransferClient(SECRET, settings=s).pull(peer(srv), hashes, backends=["tcp"])
        it = handle.__aiter__()
        first = await it.__anext__()
        assert first.seq == 0 and not handle.done()
        assert srv.sent_blocks <= 3 < len(hashes)
        rest = [b async for b in it]
    assert len(rest) == len(hashes) - 1


async def test_cancel_stops_the_transfer_and_is_observable(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    handle = client.pull(peer(server), hashes, backends=["tcp"])
    it = handle.__aiter__()
    await it.__anext__()
    handle.cancel()
    assert handle.state == "cancelled"
    from kvfleet.agent.transfer import TransferCancelled

    with pytest.raises(TransferCancelled):
        await handle.wait()
    # the server keeps serving others
    again = await client.pull(peer(server), hashes[:3], backends=["tcp"]).collect()
    assert len(again) == 3


async def test_many_concurrent_transfers_share_one_server(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    handles = [client.pull(peer(server), hashes[i::3], backends=["tcp"], streams=2) for i in range(3)]
    results = await asyncio.gather(*(h.collect() for h in handles))
    for i, blocks in enumerate(results):
        _check(blocks, hashes[i::3], store)


async def test_idle_authenticated_streams_are_reused(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    await client.pull(peer(server), hashes, backends=["tcp"], streams=3).collect()
    opened = server.accepted
    assert opened == 3
    for _ in range(3):
        _check(await client.pull(peer(server), hashes, backends=["tcp"], streams=3).collect(), hashes, store)
    assert server.accepted == opened


async def test_pooled_streams_of_a_restarted_peer_are_replaced(
    store: MemoryBlockStore, settings: TransferSettings, hashes: list[int]
) -> None:
    client = TransferClient(SECRET, settings=settings)
    async with TransferServer(store, SECRET, settings=settings) as srv:
        port = srv.port
        await client.pull(peer(srv), hashes, backends=["tcp"]).collect()
    async with TransferServer(store, SECRET, settings=settings, port=port) as srv2:
        handle = client.pull(peer(srv2), hashes, backends=["tcp"])
        _check(await handle.collect(), hashes, store)
        assert handle.stats.retries == 0  # dead pooled streams are dropped before use, not retried
    client.close()


async def test_unknown_backend_names_are_refused_with_the_known_ones(client: TransferClient,
                                                                     hashes: list[int]) -> None:
    from kvfleet.agent.transfer import UnknownBackendError

    with pytest.raises(UnknownBackendError, match="known: mooncake, shm, tcp"):
        client.pull(("127.0.0.1", 1), hashes, backends=["nixl"])
    with pytest.raises(ValueError, match="host:port"):
        client.pull("no-port", hashes)
