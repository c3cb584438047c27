"""A restarted engine process reuses its SSD tier and re-announces those blocks as KV events.

Covers: blocks demoted GPU → SSD (block files with checksummed headers) survive a
SIGTERM + restart of ``kvfleet engine`` on the same directory; the same prompt is
then served from SSD (``cached_tokens`` > 0, ``kvfleet_engine_tier_hit_blocks_total{tier="ssd"}``
grows) with the same output; the restarted publisher re-announces the recovered
blocks (BlockStored, medium SSD) in its replay buffer, which is how an EPP learns them.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import zmq

from kvfleet.cache import kvwire
from kvfleet.cache.events import BlockStored, decode_batch
from kvfleet.demo.stack import ProcessStack, plan_pods
from tests.e2e.conftest import MODEL, Fleet, http_json, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def replayed_ssd_blocks(replay_port: int) -> int:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        n = 0
        while True:
            seq, payload = kvwire.parse_replay_answer(sock.recv_multipart())
            if seq == kvwire.END:
                return n
            for ev in decode_batch(payload).events:
                if isinstance(ev, BlockStored) and ev.medium == "SSD":
                    n += len(ev.block_hashes)
    finally:
        sock.close(0)


def test_restarted_engine_serves_from_its_ssd_tier(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    with ProcessStack(tmp_path / "logs") as stack:
        fleet = Fleet(stack, plan_pods(1, 1, 0), tmp_path / "logs")
        pod = fleet.pods[0]
        tiers = {"tiers": {"cpu_blocks": 0, "ssd_dir": str(ssd)}, "num_gpu_blocks": 64}
        child = fleet.start_engine(pod, **tiers)
        url = f"http://127.0.0.1:{pod.port}/v1/completions"
        prompt = list(range(40_000, 40_000 + 640))  # 40 blocks
        st, first, _ = http_json(url, {"model": MODEL, "prompt": prompt, "max_tokens": 6})
        assert st == 200
        for base in (90_000, 95_000):  # 63 blocks each: push every block of the first prompt out of the GPU to SSD
            st, _, _ = http_json(url, {"model": MODEL, "prompt": list(range(base, base + 1000)), "max_tokens": 1})
            assert st == 200
        assert len(list(ssd.glob("*.kvb"))) >= 30
        assert fleet.stack.stop(child, sig=signal.SIGTERM) == 0
        fleet.start_engine(pod, **tiers)
        assert replayed_ssd_blocks(pod.replay_port) >= 30
        st, again, _ = http_json(url, {"model": MODEL, "prompt": prompt, "max_tokens": 6})
        assert st == 200
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 30 * 16
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert counter_tier(scrape(f"http://127.0.0.1:{pod.port}/metrics"), "ssd") >= 30
        fleet.check_alive()


def counter_tier(text: str, tier: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvfleet_engine_tier_hit_blocks_total" and s.labels.get("tier") == tier
    )

