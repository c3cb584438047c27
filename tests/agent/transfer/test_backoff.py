"""Retry back-off: the delay sequence (exponential, capped, full jitter) and a bounded time to fail."""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import replace

import pytest

from kvfleet.agent.transfer import StreamError, TransferClient, TransferServer
from kvfleet.agent.transfer.backoff import Backoff
from kvfleet.config import ConfigError, load
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer
from tests.agent.transfer.test_faults import OneShot


class Edge(random.Random):
    """An RNG whose ``uniform`` returns one end of the range: the bounds of the jitter."""

    def __init__(self, top: bool) -> None:
        super().__init__(0)
        self.top = top

    def uniform(self, a: float, b: float) -> float:
        return b if self.top else a


def test_ceilings_double_from_the_base_up_to_the_cap() -> None:
    b = Backoff(0.1, 1.0, Edge(top=True))
    assert [round(b.delay(k), 6) for k in range(1, 8)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert Backoff(0.1, 1.0, Edge(top=False)).delay(5) == 0.0  # full jitter: down to no wait at all
    assert b.bound(3) == pytest.approx(0.7) and b.bound(6) == pytest.approx(3.5)
    assert b.ceiling(10_000) == 1.0  # no overflow however many retries


def test_seeded_delays_are_reproducible_and_within_their_ceilings() -> None:
    a, b = Backoff(0.05, 0.4, random.Random(42)), Backoff(0.05, 0.4, random.Random(42))
    seq = [a.delay(k) for k in range(1, 11)]
    assert seq == [b.delay(k) for k in range(1, 11)]
    assert all(0.0 <= d <= a.ceiling(k) for k, d in enumerate(seq, start=1))
    assert len(set(seq)) == len(seq)  # jittered, not a fixed schedule
    assert seq != [Backoff(0.05, 0.4, random.Random(43)).delay(k) for k in range(1, 11)]


async def test_retries_on_the_same_backend_wait_the_drawn_delays(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    server.fault_hook = OneShot(at=1, mode="corrupt", times=1000)
    client.backoff = Backoff(0.01, 0.03, random.Random(7))
    expected = Backoff(0.01, 0.03, random.Random(7))
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    client._sleep = sleep
    handle = client.pull(peer(server), hashes, backends=["tcp"])
    with pytest.raises(Exception, match="checksum"):
        await handle.collect()
    n = client.settings.max_retries
    assert slept == [expected.delay(k) for k in range(1, n + 1)]
    assert handle.stats.backoff_s == pytest.approx(sum(slept))


async def test_a_failover_to_the_next_backend_does_not_wait(
    server: TransferServer, client: TransferClient, hashes: list[int], settings: TransferSettings,
    tmp_path: object,
) -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async with TransferServer(server.source, SECRET,
                              settings=replace(settings, shm_dir=str(tmp_path))) as srv:
        client._sleep = sleep
        handle = client.pull(peer(srv), hashes)  # shm cannot attach on the server: tcp takes over
        assert len(await handle.collect()) == len(hashes)
    assert handle.stats.backends == ["shm", "tcp"] and slept == []


async def test_a_dead_peer_fails_within_a_bounded_time(settings: TransferSettings, hashes: list[int]) -> None:
    """A peer that accepts but never says HELLO: every attempt times out, the waits between are capped."""
    lsock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(lsock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    s = replace(settings, max_retries=3, handshake_timeout_s=0.2, retry_backoff_s=0.1,
                retry_backoff_max_s=0.15)
    client = TransferClient(SECRET, settings=s)
    t = time.monotonic()
    try:
        handle = client.pull(("127.0.0.1", lsock.getsockname()[1]), hashes)
        with pytest.raises(StreamError):
            await handle.wait()
    finally:
        lsock.close()
        for c in held:
            c.close()
    elapsed = time.monotonic() - t
    bound = (s.max_retries + 1) * s.handshake_timeout_s + client.backoff.bound(s.max_retries)
    assert handle.stats.retries == 3 and 0 < handle.stats.backoff_s <= client.backoff.bound(3)
    assert (s.max_retries + 1) * s.handshake_timeout_s <= elapsed < bound + 1.0


@pytest.mark.parametrize("bad", [{"retry_backoff_s": -0.1}, {"retry_backoff_max_s": -1}])
def test_bad_back_off_settings_are_clear_errors(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        load(overrides={"transfer": bad})
