"""Keyed frame integrity: tags per connection and direction, tampering caught, old peers refused."""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import replace

import numpy as np
import pytest

from kvfleet.agent.transfer import (
    IntegrityError,
    MemoryBlockStore,
    StreamError,
    TransferClient,
    TransferServer,
    VersionError,
    auth,
)
from kvfleet.agent.transfer.frames import FrameType, checksum, encode_control
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer
from tests.conftest import eventually


class Tamper:
    """A man in the middle without the key: alters the ``at``-th BLOCK payload and fixes up its xxh3
    checksum."""

    def __init__(self, at: int = 1, times: int = 1, *, header_only: bool = False) -> None:
        self.at, self.left, self.header_only = at, times, header_only
        self.count = 0
        self.lock = threading.Lock()

    def __call__(self, hdr: bytes, view: memoryview) -> tuple[bytes, bool]:
        with self.lock:
            self.count += 1
            fire = self.count >= self.at and self.left > 0
            self.left -= fire
        if not fire:
            return hdr + bytes(view), False
        if self.header_only:  # a header field the decoder ignores (reserved): only the tag notices
            return hdr[:6] + b"\xff\xff" + hdr[8:] + bytes(view), False
        bad = bytearray(view)
        bad[len(bad) // 2] ^= 0x5A
        fixed = hdr[:20] + checksum(bad).to_bytes(8, "big") + hdr[28:]
        return fixed + bytes(bad), False


def test_tags_depend_on_key_counter_header_and_payload() -> None:
    ns, nc = auth.new_nonce(), auth.new_nonce()
    s2c, c2s = auth.session_keys(SECRET, ns, nc, "tcp", True)
    assert s2c != c2s and len(s2c) == 32
    # every input of the derivation changes the keys
    for other in (
        auth.session_keys(b"other", ns, nc, "tcp", True),
        auth.session_keys(SECRET, nc, ns, "tcp", True),
        auth.session_keys(SECRET, ns, nc, "shm", True),
        auth.session_keys(SECRET, ns, nc, "tcp", False),
    ):
        assert other[0] != s2c and other[1] != c2s
    hdr, body = b"h" * 64, b"payload"
    tx, rx = auth.FrameSeal(s2c), auth.FrameSeal(s2c)
    t0, t1 = tx.tag(hdr, body), tx.tag(hdr, body)
    assert len(t0) == auth.TAG_BYTES and t0 != t1  # the frame counter: no replay of an earlier frame
    assert rx.check(hdr, body, t0) and rx.check(hdr, body, t1)
    assert not auth.FrameSeal(c2s).check(hdr, body, t0)  # wrong key
    assert not auth.FrameSeal(s2c).check(hdr, b"payloaD", t0)  # altered payload
    assert not auth.FrameSeal(s2c).check(b"H" + hdr[1:], body, t0)  # altered header
    replay = auth.FrameSeal(s2c)
    assert replay.check(hdr, body, t0) and not replay.check(hdr, body, t0)  # the same frame twice


@pytest.mark.parametrize("size", [0, 1, 15, 17, 65536, 65537, (9 << 20) + 3])
def test_a_tag_fed_piece_by_piece_equals_the_one_shot_tag(size: int) -> None:
    """The receiver authenticates a payload in the pieces it lands in; the sender tags it whole (one call
    over a joined copy up to 64 KiB, streamed above): both give the same tag at every size."""
    key = auth.session_keys(SECRET, auth.new_nonce(), auth.new_nonce(), "tcp", True)[0]
    hdr, payload = bytes(range(64)), np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    want = auth.FrameSeal(key).tag(hdr, payload)
    mac = auth.FrameSeal(key).begin(hdr)
    for off in range(0, size, 7919):  # odd pieces: not aligned to the 16-byte GHASH block
        mac.update(memoryview(payload)[off : off + 7919])
    assert mac.tag() == want
    if size:
        bad = bytearray(payload)
        bad[size // 2] ^= 1
        assert auth.FrameSeal(key).tag(hdr, bytes(bad)) != want


async def test_a_tampered_payload_with_a_fixed_up_checksum_is_rejected_and_re_requested(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    server.fault_hook = Tamper(at=5)
    handle = client.pull(peer(server), hashes, backends=["tcp"], streams=2)
    blocks = await handle.collect()
    assert [b.seq for b in blocks] == list(range(len(hashes)))
    assert all(bytes(b.data) == bytes(store.get_block(b.block_hash)) for b in blocks)  # type: ignore[arg-type]
    assert handle.stats.retries == 1
    assert client.metrics.errors.labels("mac")._value.get() == 1
    assert client.metrics.errors.labels("checksum")._value.get() == 0  # the checksum matched: it was forged
    assert server.sent_blocks < 2 * len(hashes)  # only the unverified blocks were asked for again


async def test_persistent_tampering_fails_with_an_integrity_error_and_delivers_nothing_forged(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    server.fault_hook = Tamper(at=3, times=1000)
    handle = client.pull(peer(server), hashes, backends=["tcp"], streams=1)
    got = []
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        async for b in handle:
            got.append(bytes(b.data) == bytes(store.get_block(b.block_hash)))  # type: ignore[arg-type]
    assert got == [True, True]  # the blocks before the first forged one, each genuine
    assert handle.state == "failed" and handle.stats.retries == client.settings.max_retries
    assert client.metrics.errors.labels("mac")._value.get() == client.settings.max_retries + 1


async def test_without_payload_mac_the_header_is_still_tagged(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings
) -> None:
    s = replace(settings, payload_mac=False)
    async with TransferServer(store, SECRET, settings=s) as srv:
        client = TransferClient(SECRET, settings=s)
        # happy path
        assert len(await client.pull(peer(srv), hashes, backends=["tcp"]).collect()) == len(hashes)
        srv.fault_hook = Tamper(at=1, times=1000, header_only=True)
        handle = client.pull(peer(srv), hashes[:3], backends=["tcp"], streams=1)
        with pytest.raises(IntegrityError):
            await handle.collect()  # consumed: a failure to raise cannot hang here
        client.close()


async def test_a_wrong_session_key_is_rejected_by_the_receiver(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    real = server._session_keys
    server._session_keys = lambda *a: (b"\x00" * 32, real(*a)[1])  # type: ignore[method-assign]
    handle = client.pull(peer(server), hashes, backends=["tcp"], streams=1)
    with pytest.raises(IntegrityError):
        await handle.collect()
    assert handle.delivered == 0
    assert client.metrics.errors.labels("mac")._value.get() == client.settings.max_retries + 1


async def test_a_wrong_session_key_is_rejected_by_the_sender(
    server: TransferServer, client: TransferClient, hashes: list[int]
) -> None:
    real = server._session_keys
    server._session_keys = lambda *a: (real(*a)[0], b"\x00" * 32)  # type: ignore[method-assign]
    handle = client.pull(peer(server), hashes, backends=["tcp"], streams=1)
    with pytest.raises(StreamError):
        await handle.collect()
    assert handle.delivered == 0 and server.sent_blocks == 0  # the REQUEST's tag failed: nothing was sent
    await eventually(lambda: server.metrics.errors.labels("mac")._value.get() >= 1, "a MAC error counted",
                     timeout_s=2)
    assert server.metrics.errors.labels("mac")._value.get() == client.settings.max_retries + 1


def _old_hello() -> bytes:
    frame = bytearray(encode_control(FrameType.HELLO, {"nonce": auth.new_nonce(), "host": "old",
                                                       "backends": ["tcp"]}))
    frame[2] = 1  # protocol version 1: no frame tags
    return bytes(frame)


async def test_an_old_server_is_refused_with_a_version_error_and_not_retried(
    settings: TransferSettings, hashes: list[int]
) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def serve() -> None:
        for _ in range(2):
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(_old_hello())
                conn.recv(4096)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        client = TransferClient(SECRET, settings=settings)
        handle = client.pull(("127.0.0.1", port), hashes)
        with pytest.raises(VersionError, match="version 1, this side speaks 3"):
            await handle.wait()
        assert handle.stats.retries == 0
        assert client.metrics.errors.labels("version")._value.get() == 1
    finally:
        lsock.close()


async def test_an_old_client_is_refused_and_counted(server: TransferServer, client: TransferClient,
                                                    hashes: list[int]) -> None:
    def old_client() -> bytes:
        with socket.create_connection(peer(server), timeout=5) as s:
            s.recv(4096)  # the HELLO
            frame = bytearray(encode_control(FrameType.AUTH, {"nonce": auth.new_nonce(), "mac": b"x" * 32,
                                                              "backend": "tcp"}))
            frame[2] = 1
            s.sendall(frame)
            return s.recv(100)

    assert await asyncio.to_thread(old_client) == b""  # closed, nothing misread
    await eventually(lambda: server.metrics.errors.labels("version")._value.get() >= 1,
                     "a version error counted", timeout_s=2)
    assert server.metrics.errors.labels("version")._value.get() == 1
    assert len(await client.pull(peer(server), hashes[:3]).collect()) == 3
