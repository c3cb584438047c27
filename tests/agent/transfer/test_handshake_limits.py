"""What a peer without the secret can hold on a server, measured on real loopback sockets.

Covers: ``AUTH`` frames announcing 16 MiB bodies are closed from their header
alone, with the body dripping a byte at a time, and the server's memory does
not grow; a handshake dripped a byte at a time (header or body) is cut at the
``handshake_timeout_s`` deadline for the whole exchange, not per read; 400
idle connections take no thread each and ``max_connections`` refuses what is
over it; at ``max_handshakes`` the oldest pending handshake makes room, so a
peer that answers at once still gets in. A peer with the secret transfers
while each flood is going on. Each refusal is counted.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import replace

import pytest

from kvfleet.agent.transfer import MemoryBlockStore, TransferClient, TransferServer, auth
from kvfleet.agent.transfer.frames import FrameType, encode_control, encode_header
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer
from tests.conftest import eventually


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _errors(srv: TransferServer, kind: str) -> float:
    return float(srv.metrics.errors.labels(kind)._value.get())


def _auth_frame(body_len: int | None = None) -> bytes:
    """A well-formed AUTH frame (wrong MAC: it never gets that far), or one announcing ``body_len`` bytes."""
    frame = encode_control(FrameType.AUTH, {"nonce": b"n" * 32, "mac": b"m" * 32, "backend": "tcp"})
    if body_len is None:
        return frame
    return encode_header(FrameType.AUTH, length=body_len) + b"x" * min(body_len, 4096)


def _closed(s: socket.socket) -> bool:
    """True once the server closed ``s`` (what it sent before, its HELLO, is read and dropped)."""
    try:
        while True:
            if not s.recv(65536, socket.MSG_DONTWAIT):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _connect(srv: TransferServer) -> socket.socket:
    s = socket.create_connection(peer(srv), timeout=5)
    s.settimeout(None)  # blocking: MSG_DONTWAIT then means what it says (a timeout would poll first)
    return s


class Drip:
    """Connections that each send ``payload`` one byte every ``interval`` seconds until the server closes
    them."""

    def __init__(self, srv: TransferServer, n: int, payload: bytes, *, first: int = 0,
                 interval: float = 0.05) -> None:
        self.payload, self.first, self.interval = payload, first, interval
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        self.closed_at: dict[int, float] = {}
        for _ in range(n):
            s = _connect(srv)
            if first:
                s.sendall(payload[:first])  # e.g. a whole header at once, then its body a byte at a time
            self.socks.append(s)
            self.opened.append(time.monotonic())

    def run(self, until_s: float) -> None:
        end = time.monotonic() + until_s
        pos = self.first
        while len(self.closed_at) < len(self.socks) and time.monotonic() < end:
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                if _closed(s):
                    self.closed_at[i] = time.monotonic()
                    continue
                if pos < len(self.payload):
                    try:
                        s.send(self.payload[pos : pos + 1])
                    except OSError:
                        self.closed_at[i] = time.monotonic()
            pos += 1
            time.sleep(self.interval)

    def lifetimes(self) -> list[float]:
        """Seconds from connect to close, per connection (inf: still open)."""
        return [self.closed_at[i] - self.opened[i] if i in self.closed_at else float("inf")
                for i in range(len(self.socks))]

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture
def limited(settings: TransferSettings) -> TransferSettings:
    return replace(settings, handshake_timeout_s=1.0, backends=("tcp",))


async def _transfer_during(client: TransferClient, srv: TransferServer, hashes: list[int],
                           store: MemoryBlockStore, **kw: object) -> None:
    blocks = await client.pull(peer(srv), hashes, **kw).collect()  # type: ignore[arg-type]
    assert [b.seq for b in blocks] == list(range(len(hashes)))
    assert all(bytes(b.data) == bytes(store.get_block(b.block_hash)) for b in blocks)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
async def test_16_mib_auth_bodies_are_refused_unread_and_memory_stays_flat(
    store: MemoryBlockStore, hashes: list[int], limited: TransferSettings
) -> None:
    async with TransferServer(store, SECRET, settings=limited) as srv:
        client = TransferClient(SECRET, settings=limited)
        await _transfer_during(client, srv, hashes[:2], store)  # warm: the client's own allocations are made
        rss0 = _rss_bytes()
        # each announces a 16 MiB AUTH body, sends its first bytes, then drips the rest
        drip = await asyncio.to_thread(Drip, srv, 24, _auth_frame(16 << 20), first=64 + 16)
        try:
            dripping = asyncio.create_task(asyncio.to_thread(drip.run, limited.handshake_timeout_s + 2.0))
            await _transfer_during(client, srv, hashes, store)
            await dripping
            grown = _rss_bytes() - rss0
            lifetimes = drip.lifetimes()
        finally:
            drip.close()
            client.close()
        assert max(lifetimes) < limited.handshake_timeout_s, lifetimes
        assert grown < 20 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
        assert _errors(srv, "frame") == 24  # oversized: judged from the header
        assert srv.pending_handshakes == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["header", "body"])
async def test_a_dripped_handshake_is_cut_at_the_deadline_for_the_whole_exchange(
    store: MemoryBlockStore, hashes: list[int], limited: TransferSettings, phase: str
) -> None:
    """A byte every 50 ms keeps each read alive; the deadline covers the whole exchange."""
    async with TransferServer(store, SECRET, settings=limited) as srv:
        first = 0 if phase == "header" else 64
        drip = await asyncio.to_thread(Drip, srv, 24, _auth_frame(), first=first)
        client = TransferClient(SECRET, settings=limited)
        try:
            dripping = asyncio.create_task(asyncio.to_thread(drip.run, limited.handshake_timeout_s + 2.0))
            await _transfer_during(client, srv, hashes, store)
            await dripping
            lifetimes = drip.lifetimes()
        finally:
            drip.close()
            client.close()
        deadline = limited.handshake_timeout_s
        assert all(deadline - 0.1 <= t < deadline + 0.8 for t in lifetimes), lifetimes
        assert _errors(srv, "handshake_timeout") == 24
        assert srv.metrics.auth_rejections._value.get() == 0  # never got as far as the MAC


def _open_idle(srv: TransferServer, n: int) -> list[socket.socket]:
    return [_connect(srv) for _ in range(n)]


@pytest.mark.timeout(60)
async def test_400_idle_connections_take_no_thread_each_and_the_cap_refuses_the_rest(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings
) -> None:
    s = replace(settings, backends=("tcp",), max_connections=64, max_handshakes=128, handshake_timeout_s=30.0)
    async with TransferServer(store, SECRET, settings=s) as srv:
        client = TransferClient(SECRET, settings=s)
        # one pooled, authenticated connection
        await _transfer_during(client, srv, hashes[:3], store, streams=1)
        threads0 = threading.active_count()
        idle = await asyncio.to_thread(_open_idle, srv, 400)
        try:
            await eventually(lambda: srv.accepted >= 401, "401 connections accepted", timeout_s=10)
            threads = threading.active_count()
            assert threads - threads0 < 10, f"{threads - threads0} threads for 400 idle connections"
            # the pooled connection still works during the flood
            await _transfer_during(client, srv, hashes, store, streams=1)
            await eventually(lambda: sum(map(_closed, idle)) >= 400 - 63,
                             "the connections over the cap closed", timeout_s=10)
            closed = sum(map(_closed, idle))
            assert srv.pending_handshakes + srv.connections == 64
            assert _errors(srv, "max_connections") == 400 - 63
            assert closed == 400 - 63  # refused at once, not at the handshake deadline (30 s)
        finally:
            for sock in idle:
                sock.close()
            client.close()


@pytest.mark.timeout(60)
async def test_at_max_handshakes_the_oldest_makes_room_for_a_peer_that_answers(
    store: MemoryBlockStore, hashes: list[int], settings: TransferSettings
) -> None:
    s = replace(settings, backends=("tcp",), max_handshakes=16, handshake_timeout_s=30.0)
    async with TransferServer(store, SECRET, settings=s) as srv:
        threads0 = threading.active_count()
        idle = await asyncio.to_thread(_open_idle, srv, 100)
        client = TransferClient(SECRET, settings=s)
        try:
            await eventually(lambda: srv.accepted >= 100, "100 connections accepted", timeout_s=10)
            threads = threading.active_count()
            assert threads - threads0 < 10, f"{threads - threads0} threads for 100 idle connections"
            # a fresh peer (no pooled connection) gets in while the idle ones fill every handshake slot
            await _transfer_during(client, srv, hashes, store, streams=2)
            assert srv.connections == 2
            await eventually(lambda: sum(map(_closed, idle)) + srv.pending_handshakes >= 100,
                             "every idle connection closed or pending", timeout_s=10)
            closed = sum(map(_closed, idle))
            assert closed >= 100 - 16 and _errors(srv, "max_handshakes") == closed
            assert closed + srv.pending_handshakes == 100 and srv.pending_handshakes <= 16
        finally:
            for sock in idle:
                sock.close()
            client.close()


async def test_a_valid_peer_is_unaffected_by_the_limits(server: TransferServer, client: TransferClient,
                                                        hashes: list[int]) -> None:
    """The AUTH a real client sends is far below the limit; the exchange takes well under the deadline."""
    assert len(_auth_frame()) - 64 < auth.MAX_AUTH_BYTES // 16
    assert len(await client.pull(peer(server), hashes).collect()) == len(hashes)
    assert server.pending_handshakes == 0 and _errors(server, "handshake_timeout") == 0
