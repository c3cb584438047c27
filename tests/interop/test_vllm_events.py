"""vLLM's own KV-event publisher into kvfleet's EPP subscriber: the index holds exactly the blocks vLLM stored.

vLLM 0.33.0's ``EventPublisherFactory.create(KVEventsConfig(...))`` runs in its interop venv
(tests/interop/vllm_publish.py) with the ``--kv-events-config`` the operator renders (ZMQ PUB and the
replay ROUTER, topic ``kv-events``; only the ports are free ones), and vLLM's own block hashing (the hash
the operator renders for the pool: ``sha256_cbor``, or vLLM's default ``sha256`` for an ``xxh3_64`` pool).
kvfleet's :class:`EventSubscriber` and :class:`PodEventApplier` (recompute_keys, as the EPP runs) index
them. Covered for both pool hash algorithms: a first turn, a follow-up turn (a ``parent_block_hash``),
a decode block, an eviction; an EPP that joins after vLLM published replays instead of resyncing; a
publisher restart (a new vLLM process, sequence numbers from 0) is detected and the pod rebuilt, with
no stale block left.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.config.operator import OperatorSettings
from kvfleet.epp.envoy import free_port
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.subscriber import EventSubscriber
from kvfleet.operator.engines import kv_events_config
from tests.interop.conftest import vllm_python

HERE = Path(__file__).resolve().parent
VERSION = "0.33.0"
BS = 16
VLLM_HASH = {"sha256_cbor": "sha256_cbor", "xxh3_64": "sha256"}  # what the operator renders for the pool (docs/operator.md)


class VllmPublisher:
    """vllm_publish.py in the vLLM venv: one vLLM publisher process."""

    def __init__(self, algo: str, ports: tuple[int, int], tmp: Path) -> None:
        config = kv_events_config(OperatorSettings(kv_events_port=ports[0], kv_events_replay_port=ports[1]))
        self.proc = subprocess.Popen([str(vllm_python(VERSION)), str(HERE / "vllm_publish.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=(tmp / f"publisher-{time.monotonic_ns()}.log").open("wb"), text=True,
                                     env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR",
                                          "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1"})
        self.cmd(op="start", config=config, hash=VLLM_HASH[algo], block_size=BS)

    def cmd(self, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("OK "), f"vLLM publisher: {line!r} (exit {self.proc.poll()})"
        out: dict[str, Any] = json.loads(line[3:])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cmd(op="exit")
            self.proc.wait(30)


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def _keys(hasher: BlockHasher, tokens: list[int]) -> list[int]:
    return hashes_as_ints(hasher.hash_tokens(tokens))


def _held(idx: BlockIndex, hasher: BlockHasher, tokens: list[int]) -> int:
    """How many leading full blocks of ``tokens`` the index holds for the pod."""
    m = idx.match(_keys(hasher, tokens), ["vllm-0"]).get("vllm-0")
    return m.blocks if m else 0


def _wait(probe: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(params=["sha256_cbor", "xxh3_64"])
def algo(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def subscriber() -> Iterator[EventSubscriber]:
    sub = EventSubscriber(replay_timeout_s=2.0)
    sub.start()
    yield sub
    sub.stop()


def _join(sub: EventSubscriber, idx: BlockIndex, hasher: BlockHasher, ports: tuple[int, int]) -> PodEventApplier:
    applier = PodEventApplier("vllm-0", idx, hasher, recompute_keys=True)
    sub.add_pod("vllm-0", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", applier, topic="kv-events")
    return applier


def test_real_publisher_turns_decode_and_eviction(algo: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path) -> None:
    idx, hasher = BlockIndex(), BlockHasher(BS, algo)
    pub = VllmPublisher(algo, ports, tmp_path)
    try:
        _join(subscriber, idx, hasher, ports)
        first = _tokens(1, 4 * BS + 5)  # 4 full blocks and a partial one (never hashed)
        # ZMQ's slow joiner: the first batches may go before the SUB is connected; the replay fills them in
        assert pub.cmd(op="store", tokens=first)["blocks"] == 4
        _wait(lambda: _held(idx, hasher, first) == 4, "the first turn's 4 blocks")
        follow = first[:4 * BS] + _tokens(2, 3 * BS)  # the next turn: 3 new blocks chained on the first 4
        assert pub.cmd(op="store", tokens=follow, cached=4 * BS)["blocks"] == 3
        _wait(lambda: _held(idx, hasher, follow) == 7, "the follow-up turn chained on its parent")
        decoded = follow + _tokens(3, BS)  # one decode block
        pub.cmd(op="store", tokens=decoded, cached=7 * BS)
        _wait(lambda: _held(idx, hasher, decoded) == 8, "the decode block")
        assert idx.num_pod_keys("vllm-0") == 8  # exactly what vLLM stored, nothing more
        pub.cmd(op="remove", tokens=decoded, blocks=2)
        _wait(lambda: idx.num_pod_keys("vllm-0") == 6, "the two evicted blocks gone")
        assert _held(idx, hasher, decoded) == 6 and _held(idx, hasher, first) == 4
        stats = subscriber.stats["vllm-0"]
        assert stats.resyncs == 0 and stats.restarts == 0, stats
    finally:
        pub.close()


def test_late_epp_replays_and_restart_rebuilds(algo: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path) -> None:
    idx, hasher = BlockIndex(), BlockHasher(BS, algo)
    pub = VllmPublisher(algo, ports, tmp_path)
    old = [_tokens(10 + i, 2 * BS) for i in range(3)]
    try:
        for tokens in old:  # published before any EPP listens
            pub.cmd(op="store", tokens=tokens)
        _join(subscriber, idx, hasher, ports)
        _wait(lambda: all(_held(idx, hasher, t) == 2 for t in old), "the history, from vLLM's replay endpoint")
        assert idx.num_pod_keys("vllm-0") == 6
        stats = subscriber.stats["vllm-0"]
        assert stats.resyncs == 0 and stats.replayed >= 3, stats
    finally:
        pub.close()
    # the engine restarts: a new vLLM process on the same ports, sequence numbers from 0, an empty cache
    pub = VllmPublisher(algo, ports, tmp_path)
    try:
        fresh = _tokens(99, 3 * BS)
        deadline = time.monotonic() + 20
        while _held(idx, hasher, fresh) != 3:  # re-publish until the reconnected SUB sees it (slow joiner)
            assert time.monotonic() < deadline, f"restart not rebuilt: {subscriber.stats['vllm-0']}"
            pub.cmd(op="store", tokens=fresh)
            time.sleep(0.3)
        _wait(lambda: idx.num_pod_keys("vllm-0") == 3, "no stale block of the previous process")
        assert all(_held(idx, hasher, t) == 0 for t in old)
        assert subscriber.stats["vllm-0"].restarts + subscriber.stats["vllm-0"].resyncs >= 1
    finally:
        pub.close()
