"""The Redis tier against a real redis-server: namespaced keys, demotion ssd → remote and back,
restart re-indexing (a truncated value dropped), and a server that goes away mid-run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfleet.agent.codecs import get_codec
from kvfleet.agent.tiers import BlockNotFoundError, TierUnavailableError, open_store
from kvfleet.agent.tiers.record import key_name, meta_for
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import RemoteTierSpec

from .conftest import BLOCK_NBYTES, Factory, RedisServer, make_block, small_settings


def _remote(server: RedisServer, pool: str = "p1", blocks: int = 64, codec: str = "none") -> RemoteTierSpec:
    return RemoteTierSpec(
        enabled=True,
        url=server.url,
        pool=pool,
        model="m",
        capacity_bytes=blocks * (BLOCK_NBYTES + 200),
        codec=codec,
        high_watermark=0.9,
        low_watermark=0.5,
        socket_timeout_s=0.5,
        retry_after_s=0.2,
    )


def test_store_namespaces(redis_server: RedisServer) -> None:
    """Keys are prefix:pool:model:hash; pools do not see each other's blocks."""
    a = open_store(Tier.REMOTE, _remote(redis_server, "a"))
    b = open_store(Tier.REMOTE, _remote(redis_server, "b"))
    payload = get_codec("none").encode(make_block(1))
    a.write(meta_for(1, make_block(1), "none", None, ()), payload)
    assert redis_server.client().exists(f"kvfleet:a:m:{key_name(1)}")
    _, out = a.read(1)
    assert bytes(out) == payload.tobytes()
    with pytest.raises(BlockNotFoundError):
        b.read(1)
    assert [m.hash for m in b.scan().blocks] == []
    a.close()
    b.close()


def test_demote_to_remote_and_promote_back(tmp_path: Path, redis_server: RedisServer,
                                           manager_factory: Factory, events: EventBuffer) -> None:
    """A full ssd tier sinks blocks into Redis (int8 there); a hit in Redis is promoted back to gpu."""
    s = small_settings(tmp_path, gpu_blocks=4, cpu_blocks=4, ssd_blocks=4,
                       remote=_remote(redis_server, codec="int8"))
    m = manager_factory(s)
    for h in range(20):
        m.put(h, make_block(h))
        assert m.drain(10)
    in_remote = [h for h in range(20) if m.locate(h) is Tier.REMOTE]
    assert in_remote
    assert redis_server.client().exists(f"kvfleet:p1:m:{key_name(in_remote[0])}")
    batch = events.drain()
    assert batch is not None
    stored = {e.block_hashes[0] for e in batch.events if isinstance(e, BlockStored) and e.medium == "REMOTE"}
    assert set(in_remote) <= stored
    h = in_remote[0]
    x = make_block(h).astype(np.float64)
    y = m.get(h)
    assert y is not None and np.abs(y - x).max() <= np.abs(x).max() / 254 + 1e-2
    assert m.drain(10)
    assert m.locate(h) is Tier.GPU
    assert not redis_server.client().exists(f"kvfleet:p1:m:{key_name(h)}")


def test_restart_reindexes_remote(tmp_path: Path, redis_server: RedisServer,
                                  manager_factory: Factory) -> None:
    """A new manager finds the namespace's blocks; a truncated value is dropped and counted."""
    s = small_settings(tmp_path, remote=_remote(redis_server))
    s_remote_only = type(s)(
        gpu=s.gpu, cpu=s.cpu, ssd=type(s.ssd)(enabled=False), remote=s.remote, model=s.model, calibrate=False
    )
    first = manager_factory(s_remote_only, sink=EventBuffer())
    for h in (1, 2, 3):
        first.put(h, make_block(h), tier=Tier.REMOTE, token_ids=range(16))
    assert first.drain(10)
    first.close()
    c = redis_server.client()
    key = f"kvfleet:p1:m:{key_name(2)}"
    c.set(key, c.get(key)[:-10])  # type: ignore[index]
    events = EventBuffer()
    second = manager_factory(s_remote_only, sink=events)
    assert [second.locate(h) for h in (1, 2, 3)] == [Tier.REMOTE, None, Tier.REMOTE]
    assert second.metrics.dropped.labels(tier="remote", reason="truncated")._value.get() == 1
    batch = events.drain()
    assert batch is not None and sorted(e.block_hashes[0] for e in batch.events
                                        if isinstance(e, BlockStored)) == [1, 3]
    assert len(batch.events) == 2
    np.testing.assert_array_equal(second.get(3), make_block(3))


def test_redis_goes_away(tmp_path: Path, redis_server: RedisServer, manager_factory: Factory,
                         events: EventBuffer) -> None:
    """With Redis gone: errors are counted, the other tiers keep serving, the ssd tier becomes the
    last one (drops its LRU blocks with BlockRemoved), and a block that lived in Redis reads as a miss."""
    s = small_settings(tmp_path, gpu_blocks=4, cpu_blocks=4, ssd_blocks=6, remote=_remote(redis_server))
    m = manager_factory(s)
    m.put(999, make_block(999), tier=Tier.REMOTE)
    assert m.drain(10) and m.locate(999) is Tier.REMOTE
    redis_server.stopped_by_test = True  # type: ignore[attr-defined]
    redis_server.stop()
    for h in range(20):
        m.put(h, make_block(h))
        m.drain(0.5)
    assert m.metrics.errors.labels(tier="remote", kind="unavailable")._value.get() >= 1
    assert m.get(999) is None
    batch = events.drain()
    assert batch is not None
    dropped = {h for e in batch.events if isinstance(e, BlockRemoved) and e.medium == "SSD"
               for h in e.block_hashes}
    for h in range(20):
        if m.locate(h) is None:
            assert h in dropped
        else:
            assert m.locate(h) in (Tier.GPU, Tier.CPU, Tier.SSD)
            np.testing.assert_array_equal(m.get(h), make_block(h))
    assert all(m.locate(h) is not None for h in range(16, 20))
    with pytest.raises(TierUnavailableError):
        m.stores[Tier.REMOTE].read(999)
