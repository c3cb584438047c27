"""A restarted engine process reuses its SSD tier and re-announces those blocks as KV events.

Covers: blocks demoted GPU → SSD (the node agent's tier manager: checksummed records
in its slab files) survive a SIGTERM + restart of ``kvfleet engine`` on the same
directory, which re-indexes them (``kvfleet_tier_reindexed_blocks_total{tier="ssd"}``);
the same prompt is then served from SSD (``cached_tokens`` > 0,
``kvfleet_engine_tier_hit_blocks_total{tier="ssd"}`` grows) with the same output; the
restarted publisher re-announces the recovered
blocks (BlockStored, medium SSD) in its replay buffer, and an EPP subscriber that ran
through the restart (the EPP's :class:`EventSubscriber` and :class:`PodEventApplier`,
keys recomputed as the EPP runs) sees the new process, rebuilds the pod and then holds
the prompt's recovered blocks for it in the SSD tier.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from kvfleet.cache import kvwire
from kvfleet.cache.events import BlockStored, decode_batch
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.tiers import Tier
from kvfleet.config import Settings
from kvfleet.demo.stack import ProcessStack, plan_pods
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.subscriber import EventSubscriber
from tests.conftest import wait_for
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
        tiers = {"tiers": {"cpu_blocks": 0, "ssd_dir": str(ssd), "ssd_blocks": 1024}, "num_gpu_blocks": 64}
        child = fleet.start_engine(pod, **tiers)
        cache = Settings().cache
        hasher = BlockHasher(cache.block_size, cache.hash_algo, cache.hash_seed)
        idx, sub = BlockIndex(), EventSubscriber(replay_timeout_s=2.0)
        sub.start()
        try:
            sub.add_pod(pod.name, f"tcp://127.0.0.1:{pod.events_port}", f"tcp://127.0.0.1:{pod.replay_port}",
                        PodEventApplier(pod.name, idx, hasher, recompute_keys=True))
            url = f"http://127.0.0.1:{pod.port}/v1/completions"
            prompt = list(range(40_000, 40_000 + 640))  # 40 blocks
            keys = hashes_as_ints(hasher.hash_tokens(prompt))
            st, first, _ = http_json(url, {"model": MODEL, "prompt": prompt, "max_tokens": 6})
            assert st == 200
            # the EPP follows the first process
            wait_index(lambda: held(idx, keys, pod.name) == 40, idx, keys, pod.name, sub)
            # 63 blocks each: push every block of the first prompt out of the GPU to SSD
            for base in (90_000, 95_000):
                st, _, _ = http_json(url, {"model": MODEL, "prompt": list(range(base, base + 1000)),
                                           "max_tokens": 1})
                assert st == 200
            metrics = f"http://127.0.0.1:{pod.port}/metrics"
            wait_for(lambda: tier_sample(scrape(metrics), "kvfleet_tier_blocks", "ssd") >= 30,
                     "30 blocks written to the SSD tier")
            assert fleet.stack.stop(child, sig=signal.SIGTERM) == 0
            fleet.start_engine(pod, **tiers)
            assert tier_sample(scrape(metrics), "kvfleet_tier_reindexed_blocks_total", "ssd") >= 30
            assert replayed_ssd_blocks(pod.replay_port) >= 30
            # the EPP side, before the prompt is served again: the restart was seen (sequence numbers from 0
            # again), the pod rebuilt from what the new process announced, and the prompt's recovered blocks
            # indexed on SSD for it
            wait_index(lambda: sub.stats[pod.name].restarts + sub.stats[pod.name].resyncs >= 1
                       and on_ssd(idx, keys, pod.name) >= 30,
                       idx, keys, pod.name, sub)
            st, again, _ = http_json(url, {"model": MODEL, "prompt": prompt, "max_tokens": 6})
            assert st == 200
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 30 * 16
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            assert tier_sample(scrape(metrics), "kvfleet_engine_tier_hit_blocks_total", "ssd") >= 30
            fleet.check_alive()
            # and the EPP's view after the prompt was served again: the whole prompt, on the pod
            wait_index(lambda: held(idx, keys, pod.name) == 40, idx, keys, pod.name, sub)
        finally:
            sub.stop()


def wait_index(probe: Callable[[], bool], idx: BlockIndex, keys: list[int], pod: str,
               sub: EventSubscriber) -> None:
    def indexed() -> bool:
        assert probe(), (f"EPP index: {held(idx, keys, pod)} blocks held, {on_ssd(idx, keys, pod)} on SSD, "
                         f"{sub.stats.get(pod)}")
        return True

    wait_for(indexed, f"the EPP's index of {pod}", timeout_s=20, interval_s=0.1)


def on_ssd(idx: BlockIndex, keys: list[int], pod: str) -> int:
    return sum(1 for k in keys if idx.pod_tiers(pod, k) == {Tier.SSD})


def held(idx: BlockIndex, keys: list[int], pod: str) -> int:
    m = idx.match(keys, [pod]).get(pod)
    return m.blocks if m else 0


def tier_sample(text: str, name: str, tier: str) -> float:
    """The sum of the samples ``name`` with label ``tier`` in a ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("tier") == tier)

