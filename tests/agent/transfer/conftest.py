"""Fixtures: a block store with random blocks, a real transfer server on a free loopback port."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest

from kvfleet.agent.transfer import MemoryBlockStore, TransferClient, TransferServer
from kvfleet.config.transfer import TransferSettings

SECRET = b"pool-secret-for-tests"
BLOCK = 64 * 1024


@pytest.fixture
def shm_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvfleet-shm-",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield d


@pytest.fixture
def settings(shm_dir: str) -> TransferSettings:
    return TransferSettings(streams=3, window_blocks=4, max_retries=3, stall_timeout_s=5.0, shm_dir=shm_dir,
                            host_id="node-a")


@pytest.fixture
def store() -> MemoryBlockStore:
    s = MemoryBlockStore()
    for i in range(1, 25):
        s.put(i, os.urandom(BLOCK + i))  # distinct lengths catch slot mix-ups
    return s


@pytest.fixture
def hashes(store: MemoryBlockStore) -> list[int]:
    return sorted(int(h) for h in store)


@pytest.fixture
async def server(store: MemoryBlockStore, settings: TransferSettings) -> AsyncIterator[TransferServer]:
    async with TransferServer(store, SECRET, settings=settings) as srv:
        yield srv


@pytest.fixture
def client(settings: TransferSettings) -> Iterator[TransferClient]:
    c = TransferClient(SECRET, settings=settings)
    yield c
    c.close()


def peer(srv: TransferServer) -> tuple[str, int]:
    return ("127.0.0.1", srv.port)


def tcp_only(settings: TransferSettings) -> TransferSettings:
    return replace(settings, backends=("tcp",))
