"""Fault injection on real sockets: killed streams, corrupt frames, stalls, missing blocks, dead peers.

Each case ends in exact delivery (every block once, in order, checksums verified)
or in one clear typed error; the server survives every one of them.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import replace

import pytest

from kvfleet.agent.transfer import (
    BlockNotFoundError,
    ChecksumError,
    MemoryBlockStore,
    StreamError,
    TransferClient,
    TransferServer,
)
from kvfleet.agent.transfer.client import _connect
from kvfleet.agent.transfer.frames import HEADER_SIZE, VERSION, FrameType, encode_control
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer
from tests.conftest import eventually


class OneShot:
    """A fault hook that misbehaves on the ``at``-th BLOCK frame sent (``times`` times), else sends
    normally."""

    def __init__(self, at: int, mode: str, times: int = 1) -> None:
        self.at, self.mode, self.left = at, mode, times
        self.count = 0
        self.fired = 0
        self.lock = threading.Lock()
        self.release = threading.Event()

    def __call__(self, hdr: bytes, view: memoryview) -> tuple[bytes, bool]:
        with self.lock:
            self.count += 1
            fire = self.count >= self.at and self.left > 0
            if fire:
                self.left -= 1
                self.fired += 1
        if not fire:
            return hdr + bytes(view), False
        if self.mode == "kill":
            return hdr + bytes(view[: len(view) // 2]), True
        if self.mode == "corrupt":
            bad = bytearray(view)
            bad[len(bad) // 3] ^= 0xFF
            return hdr + bytes(bad), False
        if self.mode == "bad-magic":
            return b"XX" + hdr[2:] + bytes(view), False
        if self.mode == "wrong-seq":  # a well-formed frame for a block that was not asked for next
            return (hdr[:8] + (int.from_bytes(hdr[8:12], "big") + 1000).to_bytes(4, "big") + hdr[12:]
                    + bytes(view), False)
        if self.mode == "stall":
            self.release.wait(10)
            return hdr + bytes(view), False
        raise AssertionError(self.mode)


async def _pull_all(client: TransferClient, srv: TransferServer, hashes: list[int], store: MemoryBlockStore,
                    streams: int) -> None:
    handle = client.pull(peer(srv), hashes, backends=["tcp"], streams=streams)
    blocks = await handle.collect()
    assert [b.seq for b in blocks] == list(range(len(hashes)))
    assert all(bytes(b.data) == bytes(store.get_block(b.block_hash)) for b in blocks)  # type: ignore[arg-type]
    assert handle.stats.retries >= 1


@pytest.mark.parametrize("mode", ["kill", "corrupt", "bad-magic", "wrong-seq"])
@pytest.mark.parametrize("streams", [1, 3])
async def test_a_broken_stream_resumes_after_the_last_verified_block(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int], mode: str,
    streams: int,
) -> None:
    hook = OneShot(at=5, mode=mode)
    server.fault_hook = hook
    await _pull_all(client, server, hashes, store, streams)
    assert hook.fired == 1
    assert client.metrics.retries.labels("tcp")._value.get() >= 1
    # resumed, not restarted: the blocks verified before the fault were not asked for again
    assert server.sent_blocks < 2 * len(hashes)


async def test_a_stalled_sender_times_out_and_the_rest_comes_on_a_new_session(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings
) -> None:
    s = replace(settings, stall_timeout_s=0.5)
    hook = OneShot(at=4, mode="stall")
    async with TransferServer(store, SECRET, settings=s) as srv:
        srv.fault_hook = hook
        try:
            await _pull_all(TransferClient(SECRET, settings=s), srv, hashes, store, streams=2)
        finally:
            hook.release.set()


async def test_persistent_corruption_fails_with_a_checksum_error(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    server.fault_hook = OneShot(at=1, mode="corrupt", times=1000)
    handle = client.pull(peer(server), hashes, backends=["tcp"])
    with pytest.raises(ChecksumError):
        await handle.collect()
    assert handle.state == "failed" and handle.stats.retries == client.settings.max_retries
    assert client.metrics.errors.labels("checksum")._value.get() == client.settings.max_retries + 1


async def test_a_missing_block_fails_at_once_without_retry(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    handle = client.pull(peer(server), [*hashes[:3], 999_999, *hashes[3:5]], backends=["tcp"], streams=1)
    got = []
    with pytest.raises(BlockNotFoundError) as err:
        async for b in handle:
            got.append(b.seq)
    assert err.value.block_hash == 999_999 and handle.stats.retries == 0
    assert got == [0, 1, 2]  # everything before the gap was delivered


async def test_a_stalled_receiver_slows_the_sender_instead_of_buffering(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings
) -> None:
    """Flow control: an unconsumed transfer stops at streams × window blocks sent, and never times out."""
    s = replace(settings, window_blocks=2, streams=2, stall_timeout_s=0.3)
    async with TransferServer(store, SECRET, settings=s) as srv:
        client = TransferClient(SECRET, settings=s)
        handle = client.pull(peer(srv), hashes, backends=["tcp"])
        await eventually(lambda: srv.sent_blocks >= 4, "streams × window blocks sent", timeout_s=2)
        await asyncio.sleep(0.8)  # longer than the stall timeout: a starved stream is not a stalled one
        assert srv.sent_blocks == 4
        blocks = await handle.collect()
    assert len(blocks) == len(hashes) and handle.stats.retries == 0


async def test_a_dead_peer_is_a_clear_stream_error(settings: TransferSettings, hashes: list[int]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = TransferClient(SECRET, settings=replace(settings, max_retries=1, connect_timeout_s=1.0))
    handle = client.pull(("127.0.0.1", port), hashes)
    with pytest.raises(StreamError, match="cannot connect"):
        await handle.wait()
    assert handle.state == "failed" and handle.stats.retries == 1


async def test_shm_failure_fails_over_to_tcp(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings, tmp_path: object
) -> None:
    """The server cannot see the receiver's shm directory (as across pods without a shared mount)."""
    server_settings = replace(settings, shm_dir=str(tmp_path))
    async with TransferServer(store, SECRET, settings=server_settings) as srv:
        client = TransferClient(SECRET, settings=settings)
        handle = client.pull(peer(srv), hashes)
        blocks = await handle.collect()
    assert len(blocks) == len(hashes)
    assert handle.stats.backends == ["shm", "tcp"] and handle.stats.failovers == 1
    assert client.metrics.failovers.labels("shm", "tcp")._value.get() == 1


def _raw_connect(srv: TransferServer) -> socket.socket:
    s = socket.create_connection(peer(srv), timeout=5)
    s.recv(4096)  # the HELLO
    return s


async def test_malformed_frames_close_only_that_connection_and_are_counted(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    for junk in (b"\x00" * HEADER_SIZE, b"GET / HTTP/1.1\r\n\r\n" + b"x" * 60,
                 encode_control(FrameType.REQUEST, [[0, 1]])):
        s = await asyncio.to_thread(_raw_connect, server)
        s.sendall(junk)
        assert await asyncio.to_thread(s.recv, 100) == b""  # closed by the server
        s.close()
    # after a successful handshake too
    ch, _remote, _backend = await asyncio.to_thread(_connect, "127.0.0.1", server.port, SECRET, client.local,
                                                    client.settings, "tcp")
    ch.send(b"KT" + bytes([VERSION, 0x63]) + b"\x00" * (HEADER_SIZE - 4))
    with pytest.raises(StreamError):
        await asyncio.to_thread(ch.recv_header)
    ch.close()
    await eventually(lambda: server.metrics.errors.labels("frame")._value.get() >= 4,
                     "four frame errors counted", timeout_s=2)
    assert server.metrics.errors.labels("frame")._value.get() == 4
    assert len(await client.pull(peer(server), hashes[:4]).collect()) == 4


async def test_a_failing_consumer_ends_the_transfer_with_its_error(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    seen: list[int] = []

    def on_block(block: object) -> None:
        seen.append(1)
        if len(seen) == 3:
            raise KeyError("consumer broke")

    handle = client.pull(peer(server), hashes, on_block=on_block, backends=["tcp"])
    with pytest.raises(KeyError, match="consumer broke"):
        await handle.wait()
    assert handle.state == "failed" and len(seen) == 3
    assert handle._task is not None
    task = handle._task
    await eventually(task.done, "the driver stopped (its streams closed instead of waiting forever)",
                     timeout_s=1)
