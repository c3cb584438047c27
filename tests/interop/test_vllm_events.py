"""vLLM's own KV-event publisher into kvfleet's EPP subscriber: the index holds exactly the blocks vLLM
stored.

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

from pathlib import Path

from kvfleet.cache.hashing import BlockHasher
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.subscriber import EventSubscriber
from tests.conftest import wait_for
from tests.interop.conftest import Driver, held, join, tokens

VERSION = "0.33.0"
BS = 16
# what the operator renders for the pool (docs/operator.md)
VLLM_HASH = {"sha256_cbor": "sha256_cbor", "xxh3_64": "sha256"}
POD = "vllm-0"


class VllmPublisher(Driver):
    """vllm_publish.py in the vLLM venv: one vLLM publisher process."""

    def __init__(self, algo: str, ports: tuple[int, int], tmp: Path) -> None:
        super().__init__("vllm", VERSION, "vllm_publish.py", ports, tmp,
                         {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR",
                          "VLLM_NO_USAGE_STATS": "1"})
        self.cmd(op="start", config=self.config, hash=VLLM_HASH[algo], block_size=BS)


def test_real_publisher_turns_decode_and_eviction(
    algo: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path,
    decoded_payloads: list[int],
) -> None:
    """... and once the pod has shown it hashes like the picker (``sha256_cbor``, vLLM publishing its
    hashes' 64-bit ints), vLLM's batches are applied from their bytes (the compiled scan): none of the later
    turn's, decode's or eviction's reach the decoder; a pod hashing otherwise (vLLM's ``sha256`` for an
    ``xxh3_64`` pool) has its keys recomputed from every batch's events."""
    through_decoder = decoded_payloads
    # vLLM seeds its root hash with PYTHONHASHSEED (0 in the drivers' environment; unset, "vllm-none-hash",
    # the picker's default hash_seed): with the same seed the sha256_cbor pod hashes like the picker, as in a
    # cluster
    idx = BlockIndex()
    hasher = BlockHasher(BS, algo, seed="0") if algo == "sha256_cbor" else BlockHasher(BS, algo)
    pub = VllmPublisher(algo, ports, tmp_path)
    try:
        join(subscriber, idx, hasher, ports, POD)
        first = tokens(1, 4 * BS + 5)  # 4 full blocks and a partial one (never hashed)
        # ZMQ's slow joiner: the first batches may go before the SUB is connected; the replay fills them in
        assert pub.cmd(op="store", tokens=first)["blocks"] == 4
        wait_for(lambda: held(idx, hasher, first, POD) == 4, "the first turn's 4 blocks")
        through_decoder.clear()
        follow = first[:4 * BS] + tokens(2, 3 * BS)  # the next turn: 3 new blocks chained on the first 4
        assert pub.cmd(op="store", tokens=follow, cached=4 * BS)["blocks"] == 3
        wait_for(lambda: held(idx, hasher, follow, POD) == 7, "the follow-up turn chained on its parent")
        decoded = follow + tokens(3, BS)  # one decode block
        pub.cmd(op="store", tokens=decoded, cached=7 * BS)
        wait_for(lambda: held(idx, hasher, decoded, POD) == 8, "the decode block")
        assert idx.num_pod_keys(POD) == 8  # exactly what vLLM stored, nothing more
        pub.cmd(op="remove", tokens=decoded, blocks=2)
        wait_for(lambda: idx.num_pod_keys(POD) == 6, "the two evicted blocks gone")
        assert held(idx, hasher, decoded, POD) == 6 and held(idx, hasher, first, POD) == 4
        stats = subscriber.stats[POD]
        assert stats.resyncs == 0 and stats.restarts == 0, stats
        from_bytes = through_decoder == [] if algo == "sha256_cbor" else len(through_decoder) >= 3
        assert stats.batches >= 4 and from_bytes, through_decoder
    finally:
        pub.close()


def test_late_epp_replays_and_restart_rebuilds(
    algo: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path,
) -> None:
    idx, hasher = BlockIndex(), BlockHasher(BS, algo)
    pub = VllmPublisher(algo, ports, tmp_path)
    old = [tokens(10 + i, 2 * BS) for i in range(3)]
    try:
        for prompt in old:  # published before any EPP listens
            pub.cmd(op="store", tokens=prompt)
        join(subscriber, idx, hasher, ports, POD)
        wait_for(lambda: all(held(idx, hasher, t, POD) == 2 for t in old),
                 "the history, from vLLM's replay endpoint")
        assert idx.num_pod_keys(POD) == 6
        stats = subscriber.stats[POD]
        assert stats.resyncs == 0 and stats.replayed >= 3, stats
    finally:
        pub.close()
    # the engine restarts: a new vLLM process on the same ports, sequence numbers from 0, an empty cache
    pub = VllmPublisher(algo, ports, tmp_path)
    try:
        fresh = tokens(99, 3 * BS)

        def rebuilt() -> bool:  # re-publish until the reconnected SUB sees it (slow joiner)
            if held(idx, hasher, fresh, POD) == 3:
                return True
            pub.cmd(op="store", tokens=fresh)
            raise AssertionError(f"not rebuilt yet: {subscriber.stats[POD]}")

        wait_for(rebuilt, "the restarted vLLM's blocks indexed", timeout_s=20, interval_s=0.3)
        wait_for(lambda: idx.num_pod_keys(POD) == 3, "no stale block of the previous process")
        assert all(held(idx, hasher, t, POD) == 0 for t in old)
        assert subscriber.stats[POD].restarts + subscriber.stats[POD].resyncs >= 1
    finally:
        pub.close()
