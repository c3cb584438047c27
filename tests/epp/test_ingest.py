"""The engine adapter (events → index): recomputed keys for sha256_cbor chains with parents (vLLM-produced
vectors and batches, tests/cache/data/PROVENANCE.md), tier mediums of real engines, the bounded engine-hash
map, and one bad event costing only itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cache.events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    removed,
    stored,
)
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints, to_int64
from kvfleet.cache.tiers import Tier
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier

DATA = Path(__file__).parents[1] / "cache" / "data"
VECTORS: dict[str, Any] = json.loads((DATA / "vllm_sha256_cbor_vectors.json").read_text())
DEFAULT_CASES = [c for c in VECTORS["cases"] if c["seed"] == "default"]


def vllm_events(case: dict[str, Any], *, ints: bool = False, per_block: bool = True) -> list[BlockStored]:
    """BlockStored events as vLLM emits them for one request: the first block without a parent, each later
    block (decode, follow-up turn, chunked prefill) with the previous block's hash as parent."""
    bs = case["block_size"]
    hashes: list[int | bytes] = [bytes.fromhex(h) for h in case["block_hashes"]]
    if ints:
        hashes = [to_int64(h) for h in hashes]
    toks = case["token_ids"]
    if not per_block:
        return [stored(hashes, None, toks[: len(hashes) * bs], bs, "GPU")]
    return [
        stored([h], None if i == 0 else hashes[i - 1], toks[i * bs : (i + 1) * bs], bs, "GPU")
        for i, h in enumerate(hashes)
    ]


def picker_keys(case: dict[str, Any]) -> list[int]:
    """The keys the picker computes for the case's tokens (what the router matches)."""
    return [to_int64(bytes.fromhex(h)) for h in case["block_hashes"]]


class TestSha256Recompute:
    """hash_algo sha256_cbor with recompute_keys (the default): blocks stored with a parent are indexed."""

    @pytest.mark.parametrize("ints", [False, True], ids=["bytes", "int-hashes"])
    def test_vllm_chains_with_parents_are_indexed(self, ints: bool) -> None:
        idx = BlockIndex()
        appliers = {bs: PodEventApplier("p", idx, BlockHasher(bs, "sha256_cbor"), recompute_keys=True)
                    for bs in (16, 32)}
        total = 0
        for case in DEFAULT_CASES:
            if case["extra_keys"]:
                continue
            ap = appliers[case["block_size"]]
            ap.apply(KVEventBatch(ts=0.0, events=list(vllm_events(case, ints=ints))))
            keys = picker_keys(case)
            total += len(keys)
            assert idx.match(keys, ["p"])["p"].blocks == len(keys), case["name"]
        assert all(ap.stats.orphans == 0 for ap in appliers.values())
        assert sum(ap.stats.stored for ap in appliers.values()) == total
        assert all(ap.hashes_like_us for ap in appliers.values())

    def test_vllm_produced_batch_with_a_parent(self) -> None:
        """vLLM's own batch: the CPU BlockStored has a parent; with recompute it lands in the CPU tier."""
        batch = decode_batch((DATA / "vllm_kv_event_batch.msgpack").read_bytes())
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(16, "sha256_cbor"), recompute_keys=True)
        ap.apply(KVEventBatch(ts=0.0, events=batch.events[:2]))
        k0, k1 = (to_int64(h) for h in batch.events[0].block_hashes)  # type: ignore[union-attr]
        assert idx.pod_tiers("p", k1) == {Tier.GPU, Tier.CPU} and ap.stats.orphans == 0
        ap.apply(KVEventBatch(ts=0.0, events=batch.events[2:3]))
        assert idx.pod_tiers("p", k1) == {Tier.CPU} and idx.match([k0, k1], ["p"])["p"].blocks == 2

    def test_parent_stored_before_the_subscription_is_resumed(self) -> None:
        """A follow-up block whose parent the picker never saw: resumed from the engine's parent hash (the pod
        hashes like the picker), so it is indexed instead of counted as an orphan."""
        case = DEFAULT_CASES[1]  # bytes_hello: 3 blocks
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(16, "sha256_cbor"), recompute_keys=True)
        ap.apply(KVEventBatch(ts=0.0, events=list(vllm_events(case)[1:])))
        keys = picker_keys(case)
        assert ap.stats.orphans == 0 and all(idx.pod_tiers("p", k) == {Tier.GPU} for k in keys[1:])

    def test_salted_chain_continues_from_the_engine_hash(self) -> None:
        salted = next(c for c in DEFAULT_CASES if c["extra_keys"])
        plain = DEFAULT_CASES[0]
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(16, "sha256_cbor"), recompute_keys=True)
        # shows the pod hashes like the picker
        ap.apply(KVEventBatch(ts=0.0, events=list(vllm_events(plain))))
        ap.apply(KVEventBatch(ts=0.0, events=list(vllm_events(salted))))
        keys = picker_keys(salted)
        assert idx.match(keys, ["p"])["p"].blocks == 2 and ap.stats.orphans == 0

    def test_foreign_hash_with_an_unknown_parent_is_an_orphan(self) -> None:
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(16, "sha256_cbor"), recompute_keys=True)
        ap.apply(KVEventBatch(ts=0.0,
                              events=[stored([b"\x01" * 32], b"\x02" * 32, list(range(16)), 16, "GPU")]))
        ap.apply(KVEventBatch(ts=0.0, events=[stored([77], 78, list(range(16)), 16, "GPU")]))
        assert ap.stats.orphans == 2 and idx.num_keys == 0


class TestMediums:
    @pytest.mark.parametrize(
        ("medium", "tier"),
        [("GPU", Tier.GPU), (None, Tier.GPU), ("gpu", Tier.GPU), ("CPU", Tier.CPU), ("CPU_PINNED", Tier.CPU),
         ("cpu-pinned", Tier.CPU), ("STORAGE", Tier.SSD), ("DISK", Tier.SSD), ("disk", Tier.SSD),
         ("SSD", Tier.SSD), ("EXTERNAL", Tier.REMOTE), ("external", Tier.REMOTE),
         ("SHARED_STORAGE", Tier.REMOTE), ("REMOTE", Tier.REMOTE)],
    )
    def test_real_engine_mediums(self, medium: str | None, tier: Tier) -> None:
        assert Tier.from_medium(medium) is tier
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        ap.apply(KVEventBatch(ts=0.0, events=[stored([5], None, [1, 2, 3, 4], 4, medium)]))  # type: ignore[arg-type]
        ap.apply(KVEventBatch(ts=0.0, events=[stored([6], None, [1, 2, 3, 4], 4, medium)]))  # type: ignore[arg-type]
        ap.apply(KVEventBatch(ts=0.0, events=[removed([6], medium)]))  # type: ignore[arg-type]
        assert idx.pod_tiers("p", 5) == {tier} and idx.pod_tiers("p", 6) == set()
        assert ap.stats.unknown_medium == 0

    def test_unknown_medium_is_counted_and_indexed_slowest(self) -> None:
        with pytest.raises(ValueError, match="unknown KV medium"):
            Tier.from_medium("TAPE")
        assert Tier.from_medium("TAPE", default=Tier.slowest()) is Tier.REMOTE
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        ap.apply(KVEventBatch(ts=0.0, events=[stored([5], None, [1, 2, 3, 4], 4, "TAPE")]))
        assert idx.pod_tiers("p", 5) == {Tier.REMOTE} and ap.stats.unknown_medium == 1
        ap.apply(KVEventBatch(ts=0.0, events=[removed([5], "TAPE")]))
        assert idx.num_keys == 0 and ap.stats.unknown_medium == 2


class TestBoundsAndIsolation:
    def test_engine_map_entries_go_with_the_block(self) -> None:
        """An entry stays while the block is in some tier of the pod, and goes when it left every tier."""
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        ap.apply(KVEventBatch(ts=0.0, events=[stored([101, 102], None, list(range(8)), 4, "GPU"),
                                                stored([102], 101, list(range(4, 8)), 4, "CPU")]))
        assert len(ap) == 2
        ap.apply(KVEventBatch(ts=0.0, events=[removed([102], "GPU")]))
        assert len(ap) == 2  # still on CPU
        ap.apply(KVEventBatch(ts=0.0, events=[removed([102], "CPU"), removed([101], "GPU")]))
        assert len(ap) == 0 and idx.num_keys == 0

    def test_engine_map_is_capped(self) -> None:
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True, max_keys=100)
        for i in range(1000):
            ap.apply(KVEventBatch(ts=0.0, events=[stored([10_000 + i], None, [i, 1, 2, 3], 4, "GPU")]))
        assert len(ap) == 100 and ap.stats.key_evictions == 900 and ap.stats.stored == 1000
        ap.apply(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        assert len(ap) == 0

    def test_one_bad_event_costs_only_itself(self) -> None:
        """A token id beyond 32 bits (built in Python, not decoded) fails in hashing: counted, skipped."""
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        good = hashes_as_ints(h.hash_tokens([1, 2, 3, 4]))
        bad = stored([9], None, [2**32 + 1, 2, 3, 4], 4, "GPU")
        failed = ap.apply(KVEventBatch(ts=0.0, events=[bad, stored(good, None, [1, 2, 3, 4], 4, "GPU")]))
        assert failed == 1 and ap.stats.rejected == 1 and idx.match(good, ["p"])["p"].blocks == 1

    def test_a_failed_removal_clears_the_pod(self) -> None:
        """A removal that cannot be applied may have removed anything: the pod's entries go (no phantom)."""
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        ap.apply(KVEventBatch(ts=0.0, events=[stored([5], None, [1, 2, 3, 4], 4, "GPU")]))
        bad = removed(["not-a-hash"], "GPU")  # type: ignore[list-item]
        failed = ap.apply(KVEventBatch(ts=0.0, events=[bad, stored([6], None, [1, 2, 3, 4], 4, "GPU")]))
        assert failed == 1 and idx.pod_tiers("p", 5) == set() and idx.pod_tiers("p", 6) == {Tier.GPU}


class TestRemovalRuns:
    """Engines publish one BlockRemoved per evicted block (and the simulator's tiers one BlockStored per
    demoted block): a run of them is one index operation, and a bad one in a run is still isolated."""

    def test_a_run_of_removals_is_applied_at_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4), recompute_keys=True)
        ap.apply(KVEventBatch(ts=0.0,
                              events=[stored(list(range(100, 150)), None, list(range(200)), 4, "GPU")]))
        calls: list[int] = []
        real = idx.remove

        def counted(pod: str, keys: Any, tier: Tier | None = Tier.GPU) -> None:
            keys = list(keys)
            calls.append(len(keys))
            real(pod, keys, tier)

        monkeypatch.setattr(idx, "remove", counted)
        events: list[Any] = [removed([h], "GPU") for h in range(100, 140)]
        failed = ap.apply(KVEventBatch(ts=0.0,
                                       events=[*events, removed([140], "CPU"), removed([141], "GPU")]))
        # the GPU run of 40, then the CPU one (a different medium), then one
        assert failed == 0 and calls == [40, 1, 1]
        assert idx.num_pod_keys("p") == 9 and ap.stats.removed == 42 and len(ap) == 9

    def test_a_bad_event_in_a_run_costs_only_itself(self) -> None:
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        ap.apply(KVEventBatch(ts=0.0, events=[stored([5, 6], None, list(range(8)), 4, "GPU")]))
        bad = removed(["not-a-hash"], "GPU")  # type: ignore[list-item]
        failed = ap.apply(KVEventBatch(ts=0.0, events=[removed([6], "GPU"), bad,
                                                       stored([7], None, [1, 2, 3, 4], 4, "GPU")]))
        assert failed == 1 and ap.stats.rejected == 1 and idx.pod_tiers("p", 7) == {Tier.GPU}

    def test_a_run_of_stores_is_applied_at_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Demotion as the simulator publishes it (per block: removed from the GPU, then stored on the CPU):
        one index operation per run, and the index ends as if the events were applied one by one."""
        events: list[Any] = [stored(list(range(100, 140)), None, list(range(160)), 4, "GPU")]
        events += [removed([h], "GPU") for h in range(100, 120)]
        events += [stored([h], None, [1, 2, 3, 4], 4, "CPU") for h in range(100, 120)]
        events += [stored([h], None, [1, 2, 3, 4], 4, "TAPE") for h in range(120, 123)]
        one_by_one = BlockIndex()
        single = PodEventApplier("p", one_by_one, BlockHasher(4))
        for ev in events:
            single.apply(KVEventBatch(ts=0.0, events=[ev]))
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        adds = recorded_adds(monkeypatch, idx)
        assert ap.apply(KVEventBatch(ts=0.0, events=events)) == 0
        assert [len(a) for a in adds] == [40, 20, 3]
        assert ap.stats == single.stats and ap.stats.unknown_medium == 3
        for h in range(100, 140):
            assert idx.pod_tiers("p", h) == one_by_one.pod_tiers("p", h), h
        assert idx.pod_tiers("p", 105) == {Tier.CPU} and idx.pod_tiers("p", 121) == {Tier.GPU, Tier.REMOTE}

    def test_stores_are_not_merged_when_keys_are_recomputed(self) -> None:
        """Recomputed keys chain from each event's parent: those stores stay one by one."""
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        keys = hashes_as_ints(h.hash_tokens(list(range(8))))
        ap.apply(KVEventBatch(ts=0.0, events=[stored([keys[0]], None, [0, 1, 2, 3], 4, "GPU"),
                                                stored([keys[1]], keys[0], [4, 5, 6, 7], 4, "GPU")]))
        assert idx.match(keys, ["p"])["p"].blocks == 2 and ap.stats.orphans == 0

    def test_a_bad_store_in_a_run_costs_only_itself(self) -> None:
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        bad = stored(["not-a-hash"], None, [1, 2, 3, 4], 4, "CPU")  # type: ignore[list-item]
        events: list[Any] = [stored([5], None, [1, 2, 3, 4], 4, "CPU"), bad,
                             stored([6], None, [1, 2, 3, 4], 4, "CPU")]
        failed = ap.apply(KVEventBatch(ts=0.0, events=events))
        assert failed == 1 and ap.stats.rejected == 1 and ap.stats.stored == 2
        assert idx.pod_tiers("p", 5) == {Tier.CPU} and idx.pod_tiers("p", 6) == {Tier.CPU}


def recorded_adds(monkeypatch: pytest.MonkeyPatch, idx: BlockIndex) -> list[list[int]]:
    """The keys of every :meth:`BlockIndex.add` on ``idx`` from now on, call by call."""
    adds: list[list[int]] = []
    real = idx.add

    def add(pod: str, keys: Any, tier: Tier = Tier.GPU) -> None:
        adds.append([int(k) for k in keys])
        real(pod, keys, tier)

    monkeypatch.setattr(idx, "add", add)
    return adds


def mixed_events(seed: int, h: BlockHasher, rounds: int = 40) -> tuple[list[Any], list[int]]:
    """Events of a pod that hashes like ``h``: requests stored on the GPU and demoted block by block
    (:meth:`TestHashesAsKeys.demotions`), salted requests (their own hashes, chained, some in an unknown
    medium), stores of another block size, clears, decode steps (one block per event, chained on the
    prompt's last) and removals; and the picker's keys of every block."""
    import random

    rng = random.Random(seed)
    events: list[Any] = []
    every: list[int] = []
    for r in range(rounds):
        evs, keys = TestHashesAsKeys.demotions(h, rng.randint(1, 6), 10_000 * r)
        every += keys
        kind = rng.random()
        if kind < 0.15:  # a salted request: its own hashes, chained
            salted = [rng.getrandbits(63) for _ in keys]
            every += salted
            evs = [stored(salted, None, list(range(4 * len(keys))), 4, "GPU")]
            evs += [stored([s], salted[i - 1] if i else None, [9, 9, 9, 9], 4,
                           rng.choice(["CPU", "TAPE"])) for i, s in enumerate(salted)]
        elif kind < 0.25:
            evs.append(stored([keys[0]], None, list(range(8)), 8, "CPU"))
        elif kind < 0.28:
            evs.append(AllBlocksCleared())
        elif kind < 0.5:  # decode steps: one block per event, chained from the prompt's last
            toks = list(range(5_000_000 + 100 * r, 5_000_000 + 100 * r + 4 * rng.randint(1, 8)))
            more = hashes_as_ints(h.hash_tokens(toks, parent=keys[-1]))
            every += more
            evs += [stored([k], (more[i - 1] if i else keys[-1]), toks[4 * i : 4 * i + 4], 4, "GPU")
                    for i, k in enumerate(more)]
        evs += [removed([k], rng.choice(["GPU", "CPU"])) for k in keys if rng.random() < 0.3]
        events += evs
    return events, every


class TestHashesAsKeys:
    """A pod that has shown it hashes like the picker: later stores are keyed by its hashes without hashing
    their tokens again, with the index and counters the recomputation would give."""

    @staticmethod
    def demotions(h: BlockHasher, n: int, first: int) -> tuple[list[Any], list[int]]:
        """A request's blocks stored on the GPU, then demoted one by one as the simulator publishes it."""
        toks = list(range(first, first + 4 * n))
        keys = hashes_as_ints(h.hash_tokens(toks))
        events: list[Any] = [stored(keys, None, toks, 4, "GPU")]
        for i, k in enumerate(keys):
            parent = keys[i - 1] if i else None
            events += [removed([k], "GPU"), stored([k], parent, toks[4 * i : 4 * i + 4], 4, "CPU")]
        return events, keys

    def test_stores_after_the_first_are_not_hashed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        first, keys = self.demotions(h, 8, 0)
        ap.apply(KVEventBatch(ts=0.0, events=first))
        assert ap.hashes_like_us is True
        events, keys2 = self.demotions(h, 8, 1000)
        events = [ev for ev in events if ev.medium == "GPU"] + [ev for ev in events if ev.medium == "CPU"]
        hashed: list[int] = []
        real = BlockHasher.hash_tokens

        def counted(self: BlockHasher, toks: Any, **kw: Any) -> Any:
            hashed.append(len(toks))
            return real(self, toks, **kw)

        monkeypatch.setattr(BlockHasher, "hash_tokens", counted)
        adds = recorded_adds(monkeypatch, idx)
        assert ap.apply(KVEventBatch(ts=0.0, events=events)) == 0
        # the GPU store, then the eight CPU stores at once
        assert hashed == [] and [len(a) for a in adds] == [8, 8]
        assert all(idx.pod_tiers("p", k) == {Tier.CPU} for k in keys + keys2)
        assert ap.stats.orphans == 0 and len(ap) == 0

    def test_what_the_shortcut_cannot_take_is_recomputed(self) -> None:
        """Another block size is an orphan as before; a bytes parent on an xxh3 pod is recomputed (and
        orphaned: the picker cannot chain from it)."""
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        ap.apply(KVEventBatch(ts=0.0, events=self.demotions(h, 2, 0)[0]))
        bad_size = stored([11], None, list(range(8)), 8, "CPU")
        bytes_parent = stored([12], b"\x01" * 32, [1, 2, 3, 4], 4, "CPU")
        fine = stored([13], None, [5, 6, 7, 8], 4, "CPU")
        assert ap.apply(KVEventBatch(ts=0.0, events=[bad_size, bytes_parent, fine])) == 0
        assert ap.stats.orphans == 2 and idx.pod_tiers("p", 13) == {Tier.CPU}
        assert idx.pod_tiers("p", 11) == set() and idx.pod_tiers("p", 12) == set()

    @pytest.mark.parametrize("algo", ["xxh3_64", "sha256_cbor"])
    @pytest.mark.parametrize("seed", range(4))
    def test_same_index_as_recomputing_every_event(self, seed: int, algo: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """Random demotions, evictions, salted blocks (a hash the recomputation does not give) with children,
        other block sizes, unknown mediums, clears, decode steps (:func:`mixed_events`): applied with and
        without the shortcut, the index and the counters end the same (the engine-hash map may differ: it then
        holds identities the shortcut does without).
        For ``sha256_cbor`` the events carry the hashes' 64-bit ints, as vLLM publishes them by default."""
        h = BlockHasher(4, algo)
        events, every = mixed_events(seed, h)
        batches = [events[i : i + 17] for i in range(0, len(events), 17)]

        hashed: list[int] = []
        real = BlockHasher.hash_tokens

        def counted(self: BlockHasher, toks: Any, **kw: Any) -> Any:
            hashed.append(len(toks))
            return real(self, toks, **kw)

        def run(shortcut: bool) -> tuple[PodEventApplier, BlockIndex, int]:
            idx = BlockIndex()
            ap = PodEventApplier("p", idx, h, recompute_keys=True)
            hashed.clear()
            monkeypatch.setattr(BlockHasher, "hash_tokens", counted)
            if not shortcut:
                monkeypatch.setattr(ap, "_hash_is_key", lambda ev: False)
                monkeypatch.setattr(PodEventApplier, "_keys_are_hashes", property(lambda self: False))
            for b in batches:
                assert ap.apply(KVEventBatch(ts=0.0, events=b)) == 0
            monkeypatch.undo()
            return ap, idx, len(hashed)

        fast, fast_idx, fast_hashed = run(True)
        slow, slow_idx, slow_hashed = run(False)
        assert fast_hashed < slow_hashed / 5, (fast_hashed, slow_hashed)  # the shortcut took most events
        assert fast.stats == slow.stats and fast.stats.stored > 100
        assert [fast_idx.pod_tiers("p", k) for k in every] == [slow_idx.pod_tiers("p", k) for k in every]


class TestFromBytes:
    """``apply_payload``: a batch in vLLM's layout applied from its bytes (the compiled scan), stores held
    across the batches of one read: the index and the counters end as decoding every batch and applying
    its events would leave them."""

    @staticmethod
    def workload(seed: int, h: BlockHasher) -> tuple[list[bytes], list[int]]:
        """:func:`mixed_events`, encoded 17 events a batch."""
        events, every = mixed_events(seed, h)
        return [encode_batch(KVEventBatch(ts=float(i), events=events[i : i + 17]))
                for i in range(0, len(events), 17)], every

    @pytest.mark.parametrize("recompute", [False, True])
    @pytest.mark.parametrize("seed", range(3))
    def test_same_index_as_decoding_every_batch(self, seed: int, recompute: bool) -> None:
        h = BlockHasher(4)
        batches, every = self.workload(seed, h)
        slow_idx = BlockIndex()
        slow = PodEventApplier("p", slow_idx, h, recompute_keys=recompute)
        for payload in batches:
            assert slow.apply(decode_batch(payload)) == 0
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=recompute)
        from_bytes = 0
        for i, payload in enumerate(batches):
            done = ap.apply_payload(payload)
            from_bytes += done is not None
            if done is None:
                assert ap.apply(decode_batch(payload)) == 0
            else:
                assert done == (float(17 * i), 0)
            if i % 5 == 4:  # the subscriber flushes after each read of a socket
                ap.flush()
        ap.flush()
        assert from_bytes > len(batches) // 2, from_bytes
        assert ap.stats == slow.stats and ap.stats.stored > 100
        assert [idx.pod_tiers("p", k) for k in every] == [slow_idx.pod_tiers("p", k) for k in every]

    def test_the_stores_of_a_read_are_one_index_operation(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Ten step batches of 16 one-block stores: held, then one add of 160 keys; a removal between two
        batches flushes the stores before it (the order of a pod's events stands)."""
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(16))
        adds = recorded_adds(monkeypatch, idx)
        step: list[list[Any]] = [[stored([100 * b + i], None, list(range(16)), 16, "GPU") for i in range(16)]
                for b in range(10)]
        for events in step:
            assert ap.apply_payload(encode_batch(KVEventBatch(ts=0.0, events=events))) == (0.0, 0)
        assert adds == [] and idx.num_pod_keys("p") == 0
        assert ap.flush() == 0 and [len(a) for a in adds] == [160] and ap.stats.stored == 160
        ap.apply_payload(encode_batch(KVEventBatch(ts=0.0, events=[stored([7], None, [0] * 16, 16, "GPU")])))
        ap.apply_payload(encode_batch(KVEventBatch(ts=0.0, events=[removed([7], "GPU")])))
        ap.flush()
        assert [len(a) for a in adds] == [160, 1] and idx.pod_tiers("p", 7) == set()

    def test_a_batch_beyond_the_lasting_buffers(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A prefill batch larger than the scanner's lasting buffers is scanned with buffers of its own and
        indexed before the call returns; the stores held before it are indexed first (one add each), and the
        next step batch is held again."""
        from kvfleet.cache.events import SCAN_KEYS

        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(4))
        adds = recorded_adds(monkeypatch, idx)
        step = KVEventBatch(ts=0.0, events=[stored([1, 2], None, list(range(8)), 4, "GPU")])
        big_keys = list(range(10, 10 + SCAN_KEYS // 4))
        big = encode_batch(KVEventBatch(ts=0.0, events=[stored(big_keys, 2, list(range(4 * len(big_keys))), 4,
                                                                 "GPU")]))
        assert len(big) > SCAN_KEYS
        assert ap.apply_payload(encode_batch(step)) == (0.0, 0) and adds == []
        assert ap.apply_payload(big) == (0.0, 0)
        assert adds == [[1, 2], big_keys]
        ap.apply_payload(encode_batch(KVEventBatch(ts=0.0, events=[stored([3], None, [0] * 4, 4, "GPU")])))
        assert len(adds) == 2 and ap.flush() == 0 and adds[-1] == [3]
        assert ap.stats.stored == 3 + len(big_keys) and idx.num_pod_keys("p") == 3 + len(big_keys)

    def test_hash_keys_is_the_appliers_rule(self) -> None:
        """The scan's per-run ``hash_keys`` is what :meth:`PodEventApplier._hash_is_key` says of every store
        in the run, for both chains (xxh3 ints, sha256_cbor 32-byte bytes)."""
        import random

        from kvfleet.cache.events import scan_batch

        rng = random.Random(9)
        for algo in ("xxh3_64", "sha256_cbor"):
            ap = PodEventApplier("p", BlockIndex(), BlockHasher(4, algo=algo), recompute_keys=True)
            for _ in range(300):
                n = rng.randint(1, 3)
                hashes: list[Any] = [rng.choice([rng.getrandbits(64), bytes(32), b"\x01" * 8])
                                     for _ in range(n)]
                parent = rng.choice([None, rng.getrandbits(64), bytes(32)])
                ev = stored(hashes, parent, list(range(rng.choice([4 * n - 1, 4 * n, 4 * n + 3]))),
                            rng.choice([4, 8]), "GPU")
                scan = scan_batch(encode_batch(KVEventBatch(ts=0.0, events=[ev])), 4, algo == "sha256_cbor")
                assert scan is not None
                assert scan.runs[0].hash_keys == ap._hash_is_key(ev), ev

    def test_the_subscriber_reads_vllm_batches_from_their_bytes(self, decoded_payloads: list[int]) -> None:
        """Over real ZMQ sockets: step batches in vLLM's layout never reach the decoder; a batch in another
        layout (SGLang's event arrays) still does, and is indexed."""
        import msgspec

        from kvfleet.epp.subscriber import EventSubscriber
        from tests.conftest import wait_for
        from tests.epp.pods import KVEventPublisher

        decoded = decoded_payloads
        pub = KVEventPublisher()
        sub = EventSubscriber(replay_timeout_s=1.0)
        sub.start()
        idx = BlockIndex()
        try:
            sub.add_pod("p", pub.endpoint, pub.replay_endpoint, PodEventApplier("p", idx, BlockHasher(16)))
            for b in range(20):
                steps: list[Any] = [stored([1000 * b + i], None, list(range(16)), 16, "GPU")
                                    for i in range(16)]
                pub.publish(KVEventBatch(ts=0.0, events=steps))
            wait_for(lambda: idx.num_pod_keys("p") == 320, "the step batches indexed", timeout_s=10)
            assert decoded == []
            event = ["BlockStored", [99_999], None, list(range(16)), 16, None, "CPU"]
            sglang = msgspec.msgpack.encode([0.0, [event]])
            pub.publish_raw(sglang)
            wait_for(lambda: idx.pod_tiers("p", 99_999) == {Tier.CPU}, "the SGLang-layout batch indexed",
                     timeout_s=10)
            assert decoded == [len(sglang)]
        finally:
            sub.stop()
            pub.close()


class TestRecomputedSteps:
    """A pod whose keys are recomputed (its hash or seed is not the picker's): a decode step's one-block
    stores are hashed in one call and indexed in one add, with the outcome of recomputing them one by one."""

    @staticmethod
    def steps(seed: int, picker: BlockHasher, engine: BlockHasher) -> tuple[list[KVEventBatch], list[int]]:
        """Batches of an engine serving several requests at once: prompts (multi-block stores), decode steps
        (one block per running request, chained on its last), a parent stored in the same batch, a parent
        never seen, another block size, removals and a clear; the picker's keys of every block."""
        import random

        rng = random.Random(seed)
        batches: list[KVEventBatch] = []
        every: list[int] = []
        running: dict[int, tuple[list[int], list[int]]] = {}  # request → (tokens, engine hashes)

        for step in range(60):
            events: list[Any] = []
            for r in [r for r in running if rng.random() < 0.8]:  # decode: a block for each running request
                toks, hs = running[r]
                new = [rng.randrange(1 << 17) for _ in range(4)]
                h = hashes_as_ints(engine.hash_tokens(toks + new))[-1]
                events.append(stored([h], hs[-1], new, 4, rng.choice(["GPU", "GPU", "CPU"])))
                running[r] = (toks + new, [*hs, h])
                every += hashes_as_ints(picker.hash_tokens(toks + new))[-1:]
            if rng.random() < 0.4:  # a new request's prompt
                r = 1000 * seed + step
                toks = [rng.randrange(1 << 17) for _ in range(4 * rng.randint(1, 4))]
                hs = hashes_as_ints(engine.hash_tokens(toks))
                events.insert(rng.randrange(len(events) + 1), stored(hs, None, toks, 4, "GPU"))
                running[r] = (toks, hs)
                every += hashes_as_ints(picker.hash_tokens(toks))
                if rng.random() < 0.5:  # its next block in the same batch
                    new = [rng.randrange(1 << 17) for _ in range(4)]
                    h = hashes_as_ints(engine.hash_tokens(toks + new))[-1]
                    events.append(stored([h], hs[-1], new, 4, "GPU"))
                    running[r] = (toks + new, [*hs, h])
                    every += hashes_as_ints(picker.hash_tokens(toks + new))[-1:]
            kind = rng.random()
            if kind < 0.1:
                events.append(stored([rng.getrandbits(63)], rng.getrandbits(63), [1, 2, 3, 4], 4, "GPU"))
            elif kind < 0.15:
                events.append(stored([rng.getrandbits(63)], None, list(range(8)), 8, "GPU"))
            elif kind < 0.3 and running:
                r = rng.choice(list(running))
                events.append(removed(running.pop(r)[1][-2:], "GPU"))
            elif kind < 0.32:
                events.append(AllBlocksCleared())
            batches.append(KVEventBatch(ts=float(step), events=events))
        return batches, every

    @pytest.mark.parametrize("algo", ["xxh3_64", "sha256_cbor"])
    @pytest.mark.parametrize("like", [False, True], ids=["hashes-differ", "hashes-alike"])
    @pytest.mark.parametrize("seed", range(3))
    def test_same_as_one_by_one(self, seed: int, like: bool, algo: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
        picker = BlockHasher(4, algo)
        engine = picker if like else BlockHasher(4, "sha256_cbor" if algo == "xxh3_64" else "xxh3_64")
        batches, every = self.steps(seed, picker, engine)
        hashed: list[int] = []
        real = BlockHasher.hash_each

        def counted(self: BlockHasher, rows: Any, parents: Any) -> Any:
            hashed.append(len(parents))
            return real(self, rows, parents)

        def run(together: bool) -> tuple[PodEventApplier, BlockIndex]:
            idx = BlockIndex()
            ap = PodEventApplier("p", idx, picker, recompute_keys=True, max_keys=200)
            monkeypatch.setattr(BlockHasher, "hash_each", counted)
            if not together:
                monkeypatch.setattr(ap, "_recompute_stores",
                                    lambda stores: sum(ap._apply_one(ev) for ev in stores))
            for b in batches:
                assert ap.apply(b) == 0
            monkeypatch.undo()
            return ap, idx

        fast, fast_idx = run(True)
        assert like or sum(hashed) > 100, hashed  # the steps were hashed together (alike: by their hashes)
        slow, slow_idx = run(False)
        assert fast.stats == slow.stats and fast.stats.stored > 100, (fast.stats, slow.stats)
        assert fast.hashes_like_us == slow.hashes_like_us
        assert list(fast._engine_to_key.items()) == list(slow._engine_to_key.items())
        assert [fast_idx.pod_tiers("p", k) for k in every] == [slow_idx.pod_tiers("p", k) for k in every]
