"""The mooncake backend on a real Mooncake Transfer Engine (TCP transport), where the package imports.

Skipped when ``mooncake.engine`` does not import (package ``kvfleet[mooncake]``
or its libibverbs system libraries missing); see docs/transfer.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest

from kvfleet.agent.transfer import MemoryBlockStore, TransferClient, TransferServer
from kvfleet.agent.transfer import mooncake as mc
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer

pytestmark = pytest.mark.skipif(not mc.available(), reason="mooncake.engine does not import here")


@pytest.fixture
def mc_settings(settings: TransferSettings) -> TransferSettings:
    return replace(settings, backends=("shm", "mooncake", "tcp"), max_block_bytes=1 << 20)


@pytest.fixture
async def mc_server(store: MemoryBlockStore, mc_settings: TransferSettings) -> AsyncIterator[TransferServer]:
    async with TransferServer(store, SECRET, settings=mc_settings) as srv:
        yield srv


@pytest.fixture
def remote_client(mc_settings: TransferSettings) -> Iterator[TransferClient]:
    """A client on "another host": shm is out, both offer mooncake."""
    c = TransferClient(SECRET, settings=replace(mc_settings, host_id="node-b"))
    yield c
    c.close()


async def test_topology_picks_mooncake_across_hosts_and_delivers_exactly(
    mc_server: TransferServer, remote_client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    for _ in range(2):  # the second transfer reuses the pooled stream and both registered rings
        handle = remote_client.pull(peer(mc_server), hashes)
        blocks = await handle.collect()
        assert handle.stats.backends == ["mooncake"] and handle.stats.retries == 0
        assert [b.seq for b in blocks] == list(range(len(hashes)))
        assert all(bytes(b.data) == bytes(store.get_block(b.block_hash) or b"") for b in blocks)
    assert remote_client.metrics.blocks.labels("mooncake", "received")._value.get() == 2 * len(hashes)


async def test_a_failed_mooncake_read_fails_over_to_tcp(
    mc_server: TransferServer, remote_client: TransferClient, store: MemoryBlockStore, hashes: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real failed read: the first one asks the sender's engine for memory it never registered."""
    real_read = mc.MooncakeEngine.read
    calls = []

    def read(self: mc.MooncakeEngine, target: str, local_ptr: int, remote_ptr: int, length: int) -> None:
        calls.append(1)
        real_read(self, target, local_ptr, remote_ptr + (1 << 40) if len(calls) == 3 else remote_ptr, length)

    monkeypatch.setattr(mc.MooncakeEngine, "read", read)
    handle = remote_client.pull(peer(mc_server), hashes)
    blocks = await handle.collect()
    assert [b.seq for b in blocks] == list(range(len(hashes)))
    assert all(bytes(b.data) == bytes(store.get_block(b.block_hash) or b"") for b in blocks)
    assert handle.stats.backends == ["mooncake", "tcp"] and handle.stats.failovers == 1


async def test_same_host_still_prefers_shm(mc_server: TransferServer, mc_settings: TransferSettings,
                                           hashes: list[int]) -> None:
    c = TransferClient(SECRET, settings=mc_settings)
    handle = c.pull(peer(mc_server), hashes)
    await handle.collect()
    c.close()
    assert handle.stats.backends == ["shm"]
