"""The ``kvfleet agent`` role: tiers served to peers over the transfer engine, tier events on ZMQ,
Prometheus metrics, clean stop, and clear errors for a missing secret or bad config."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import zmq

from kvfleet.agent.main import Agent
from kvfleet.agent.transfer import TransferClient
from kvfleet.cache.events import BlockStored, decode_batch
from kvfleet.cache.tiers import Tier
from kvfleet.config import Settings
from tests.agent.tiers.conftest import make_block, small_settings
from tests.conftest import wait_for

SECRET = b"pool-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_peer_pulls_a_block_the_agent_holds_and_sees_its_event(tmp_path: Path) -> None:
    """A block put into the agent's CPU tier is announced (medium CPU) and a peer pulls it byte-exact."""
    settings = Settings(tiers=small_settings(tmp_path / "ssd"))
    ev_port, replay_port = free_port(), free_port()
    agent = Agent(settings, SECRET, host="127.0.0.1", transfer_port=0, kv_events_port=ev_port,
                  kv_events_replay_port=replay_port)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{ev_port}")
    agent.start()
    try:
        # ZMQ's slow joiner: put probe blocks until one's event arrives, so the SUB is surely connected
        for probe in range(100):
            agent.mgr.put(10_000 + probe, make_block(probe), tier=Tier.CPU, token_ids=list(range(16)))
            if sub.poll(100):
                break
        else:
            raise AssertionError("no KV event published in 10 s")
        while sub.poll(200):  # drop the probes' events
            sub.recv_multipart()
        block = make_block(7)
        agent.mgr.put(1234, block, tier=Tier.CPU, token_ids=list(range(16)))
        assert sub.poll(5000), "no KV event published"
        _topic, _seq, payload = sub.recv_multipart()
        batch = decode_batch(payload)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored and stored[0].block_hashes == [1234] and stored[0].medium == "CPU"

        import asyncio

        async def pull() -> bytes:
            async with TransferClient(SECRET) as client:
                blocks = await client.pull(("127.0.0.1", agent.server.port), [1234]).collect()
            return bytes(blocks[0].data)

        assert asyncio.run(pull()) == block.tobytes()
    finally:
        sub.close(0)
        agent.stop()
        agent.stop()  # idempotent


def _run_agent(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"tiers:\n  calibrate: false\n  ssd:\n    path: {tmp_path / 'ssd'}\n")
    return subprocess.Popen(
        [sys.executable, "-m", "kvfleet", "agent", "--config", str(cfg), "--host", "127.0.0.1", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_agent_process_serves_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    metrics_port = free_port()
    env = {**os.environ, "KVFLEET_TRANSFER_SECRET": "s3cret"}
    proc = _run_agent(
        tmp_path,
        env,
        "--metrics-port", str(metrics_port),
        "--transfer-port", str(free_port()),
        "--kv-events-port", str(free_port()),
        "--kv-events-replay-port", str(free_port()),
    )  # fmt: skip
    try:
        def metrics() -> str | None:
            if proc.poll() is not None:
                pytest.fail(f"the agent exited ({proc.returncode}): "
                            f"{proc.stderr.read() if proc.stderr else ''!r}")
            try:
                return str(urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                                  timeout=1).read().decode())
            except OSError:
                return None

        body = wait_for(metrics, "the agent's /metrics", timeout_s=20)
        assert "kvfleet_tier_" in body and "kvfleet_transfer_" in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_missing_secret_and_bad_config_are_clear_errors(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVFLEET_TRANSFER_SECRET"}
    proc = _run_agent(tmp_path, env, "--metrics-port", str(free_port()))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "KVFLEET_TRANSFER_SECRET" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  nope: 1\n")
    out = subprocess.run([sys.executable, "-m", "kvfleet", "agent", "--config", str(bad)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "tiers.nope" in out.stderr

