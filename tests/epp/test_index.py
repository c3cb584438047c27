"""The global block index (prefix walk, tiers, speculative picks) and the engine adapter (events → index)."""

from __future__ import annotations

import gc
import random
import threading
from pathlib import Path

import numpy as np

from kvfleet.cache.events import AllBlocksCleared, KVEventBatch, decode_batch, removed, stored
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints, to_int64
from kvfleet.cache.tiers import Tier
from kvfleet.cache.tokens import salt_extra_keys
from kvfleet.config.epp import CostModelSettings
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.router import tier_weights
from kvfleet.epp.speculative import Lease, spec_positions

DATA = Path(__file__).parents[1] / "cache" / "data"


class TestMatch:
    """match() counts the longest held prefix per pod and weights it by the best tier held."""

    def test_prefix_stops_at_first_hole(self) -> None:
        """Within the exact-walk budget the found prefixes are verified block by block: a hole cuts them."""
        idx = BlockIndex()
        idx.add("a", [1, 2, 3, 4])
        idx.add("b", [1, 2])
        idx.remove("a", [3])
        m = idx.match([1, 2, 3, 4], ["a", "b", "c"])
        assert (m["a"].blocks, m["b"].blocks) == (2, 2) and "c" not in m

    def test_search_beyond_the_walk_budget_credits_past_a_hole(self) -> None:
        """Beyond ``exact_walk_blocks`` the search's answer stands (chained keys: "held" is monotone unless
        events were lost): a pod holding the prompt's last block is credited in full despite a hole; one whose
        chain ends at block 59 with a hole at 49 is credited at one of the two boundaries (a held block, then
        a missing one)."""
        keys = list(range(100, 200))
        for budget in (0, 10_000):
            idx = BlockIndex(exact_walk_blocks=budget)
            idx.add("a", keys)
            idx.add("b", keys[:60])
            idx.remove("a", [keys[49]])
            idx.remove("b", [keys[49]])
            m = idx.match(keys, ["a", "b"])
            if budget:
                assert (m["a"].blocks, m["b"].blocks) == (49, 49)  # verified: cut at the hole
            else:
                assert m["a"].blocks == 100 and m["b"].blocks in (49, 60)

    def test_a_long_prompt_among_many_candidates_is_answered_exactly(self) -> None:
        """256 candidate pods, four holding a 4k-token prompt (256 blocks): only those holding its first block
        are searched (the last block is probed for them alone), and their found prefixes, 1,024 blocks in
        all, are verified block by block: a hole cuts one."""
        keys = list(range(10_000, 10_256))
        idx = BlockIndex()  # exact_walk_blocks 1,024
        for i in range(252):
            idx.add(f"other-{i}", [i + 1, i + 2])  # hold blocks, none of this prompt's
        for pod in ("a", "b", "c", "d"):
            idx.add(pod, keys)
        idx.remove("a", [keys[100]])
        m = idx.match(keys, [f"other-{i}" for i in range(252)] + ["a", "b", "c", "d"])
        assert {p: x.blocks for p, x in m.items()} == {"a": 100, "b": 256, "c": 256, "d": 256}

    def test_search_finds_every_prefix_length(self) -> None:
        keys = [(k * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for k in range(1, 1001)]
        idx = BlockIndex(exact_walk_blocks=0, initial_capacity=16)
        lengths = [0, 1, 2, 15, 16, 17, 255, 256, 999, 1000]
        for i, n in enumerate(lengths):
            idx.add(f"p{i}", keys[:n])
        m = idx.match(keys, [f"p{i}" for i in range(len(lengths))] + ["nobody"])
        assert {p: x.blocks for p, x in m.items()} == {f"p{i}": n for i, n in enumerate(lengths) if n}
        assert idx.num_entries == sum(lengths) and idx.num_pod_keys("p8") == 999

    def test_tier_weights(self) -> None:
        idx = BlockIndex()
        idx.add("a", [1, 2], Tier.CPU)
        idx.add("a", [1], Tier.GPU)
        m = idx.match([1, 2], ["a"], tier_weights=[1.0, 0.5, 0.25, 0.0])
        assert m["a"].blocks == 2 and m["a"].weighted == 1.5
        idx.remove("a", [1], Tier.GPU)
        assert idx.pod_tiers("a", 1) == {Tier.CPU}
        idx.remove("a", [1], Tier.CPU)
        assert idx.match([1, 2], ["a"]) == {}

    def test_speculative_entries_expire_and_combine_with_events(self) -> None:
        idx = BlockIndex()
        idx.add_speculative("a", [1, 2, 3], ttl_s=10, now=0.0)
        assert idx.match([1, 2, 3, 4], ["a"], now=5.0)["a"].speculative == 3
        idx.add("a", [1, 2], Tier.CPU)  # events: the first two blocks, in CPU
        m = idx.match([1, 2, 3], ["a"], tier_weights=[1.0, 0.5, 0.0, 0.0], now=5.0)["a"]
        assert (m.blocks, m.weighted, m.speculative) == (3, 2.0, 1)
        assert idx.match([1, 2, 3], ["a"], now=11.0)["a"].blocks == 2
        assert idx.expire(now=11.0) == 3 and idx.num_speculative == 0

    def test_long_prompts_are_sampled(self) -> None:
        """Speculative entries of a long prompt are sparse but still credit its prefix."""
        idx = BlockIndex()
        keys = list(range(10_000, 10_000 + 2000))
        idx.add_speculative("a", keys, ttl_s=10, now=0.0)
        assert idx.num_speculative < 250
        assert idx.match(keys, ["a"], now=1.0)["a"].blocks == 2000  # the last block is always sampled
        # a shorter prompt of the same prefix
        credited = idx.match([*keys[:1000], 1, 2], ["a"], now=1.0)["a"].blocks
        assert (credited == max(p for p in spec_positions(2000) if p < 1000) + 1
                and 1000 - 16 <= credited <= 1000)
        # one grid
        assert spec_positions(3000)[: len(spec_positions(2000)) - 1] == list(spec_positions(2000))[:-1]

    def test_tier_weights_by_search(self) -> None:
        """Without the walk, L_r (the prefix held in tiers ≤ r) is searched per tier:
        Σ (L_r − L_{r−1}) · w_r."""
        keys = list(range(1, 301))
        idx = BlockIndex(exact_walk_blocks=0)
        idx.add("a", keys[:100], Tier.GPU)
        idx.add("a", keys[:250], Tier.CPU)
        idx.add("a", keys[:300], Tier.SSD)
        m = idx.match(keys, ["a"], tier_weights=[1.0, 0.5, 0.25, 0.0])["a"]
        assert (m.blocks, m.weighted) == (300, 100 * 1.0 + 150 * 0.5 + 50 * 0.25)
        walked = BlockIndex()
        walked.add("a", keys[:100], Tier.GPU)
        walked.add("a", keys[:250], Tier.CPU)
        walked.add("a", keys[:300], Tier.SSD)
        assert walked.match(keys, ["a"], tier_weights=[1.0, 0.5, 0.25, 0.0])["a"] == m

    def test_speculative_entries_are_capped(self) -> None:
        """Beyond ``max_speculative`` the oldest picks go first (counted); the newest stay."""
        idx = BlockIndex(max_speculative=100)
        old, new = list(range(1000, 1064)), list(range(2000, 2064))
        idx.add_speculative("a", old, ttl_s=10, now=0.0)
        idx.add_speculative("b", new, ttl_s=10, now=0.0)
        assert idx.num_speculative == 64 and idx.speculative_dropped == 64
        assert idx.match(old, ["a"], now=1.0) == {} and idx.match(new, ["b"], now=1.0)["b"].blocks == 64
        idx.add_speculative("c", old[:30], ttl_s=1, now=0.0)  # 94 entries
        # 124 > 100: the expired pick c goes, not the oldest b
        idx.add_speculative("d", old[:30], ttl_s=10, now=5.0)
        assert idx.speculative_dropped == 64 and idx.num_speculative == 94
        assert (idx.match(new, ["b"], now=5.0)["b"].blocks == 64
                and idx.match(old[:30], ["c", "d"], now=5.0).keys() == {"d"})

    def test_the_bound_does_not_scan_every_pick_per_pick(self) -> None:
        """At the bound, a pick makes room by dropping the oldest picks; the picks are scanned for expired
        ones only once one can have expired, and at most once per ``EXPIRE_EVERY_S`` (a scan per pick cost
        1.6 ms a pick with 13,000 picks listed)."""
        idx = BlockIndex(max_speculative=1_000)
        for i in range(2_000):  # nothing can expire: no scan
            idx.add_speculative("a", list(range(i * 10, i * 10 + 10)), ttl_s=1e6, now=float(i) / 1000)
        assert idx.num_speculative == 1_000 and idx.expire_scans == 0
        lease = idx.add_speculative("b", [1, 2, 3], ttl_s=1e6, now=2.0)
        lease.expiry = 2.5  # an earlier expiry now counts
        for i in range(2_000):  # from 2.0 to 4.0 a pick expires every millisecond: two scans (2.1, 3.1)
            idx.add_speculative("c", list(range(i * 10, i * 10 + 10)), ttl_s=0.001, now=2.0 + i / 1000)
        assert idx.expire_scans == 2 and not {e for e in idx.speculative_entries() if e[1] == "b"}

    def test_repeated_picks_do_not_pile_up(self) -> None:
        """A prompt picked again and again re-uses its entries; the picks taken over are forgotten, so the
        bookkeeping stays bounded by the entries, not by the number of picks."""
        idx = BlockIndex(max_speculative=1000)
        keys = list(range(500, 564))
        for i in range(5000):
            idx.add_speculative("a" if i % 2 else "b", keys, ttl_s=100, now=float(i) / 1000)
        assert idx.num_speculative == 128 and idx.speculative_dropped == 0
        assert len(idx._spec_picks) <= 2 * 128 + 1024 + 1
        assert idx.expire(now=1000.0) == 128 and idx.num_speculative == 0 and not idx._spec_picks

    def test_expiry_follows_the_owning_pick(self) -> None:
        """Random overlapping picks, extended or not, then expiry at several instants: the entries left are
        exactly those whose latest pick (the owner) has not expired, as a scan of every entry would find."""
        rng = random.Random(3)
        idx = BlockIndex(max_speculative=10**6)
        model: dict[tuple[int, str], Lease] = {}
        for i in range(300):
            pod = rng.choice("abc")
            start, n = rng.randrange(0, 40), rng.randrange(1, 90)
            keys = list(range(1000 + start, 1000 + start + n))
            lease = idx.add_speculative(pod, keys, ttl_s=rng.uniform(1, 50), now=float(i) / 10)
            for k in (keys[j] for j in spec_positions(n)):
                model[k, pod] = lease
            if rng.random() < 0.3:
                idx.extend(lease, rng.uniform(1, 50), now=float(i) / 10)
        for t in (10.0, 30.0, 60.0, 100.0):
            expected = {e for e, lease in model.items() if lease.expiry > t}
            dropped = idx.expire(now=t)
            got = idx.speculative_entries()
            assert got == expected and idx.num_speculative == len(expected)
            assert dropped == len(model) - len(expected)
            model = {e: lease for e, lease in model.items() if e in expected}

    def test_a_freed_lease_reaches_nothing(self) -> None:
        """A pick whose entries were all taken over is freed in the store and its id given to a later pick;
        the first pick's handle then neither extends nor expires the later pick, and reports no entries."""
        idx = BlockIndex()
        old = idx.add_speculative("a", [1, 2, 3], ttl_s=10, now=0.0)
        idx.add_speculative("a", [1, 2, 3], ttl_s=10, now=0.0)  # takes every entry over
        later = idx.add_speculative("a", [7, 8], ttl_s=5, now=0.0)  # the freed id, next generation
        assert old.owned == 0 and later.owned == 2
        idx.extend(old, 1000.0, now=0.0)
        old.expiry = 0.0
        assert idx.match([7, 8], ["a"], now=1.0)["a"].blocks == 2
        assert idx.match([7, 8], ["a"], now=6.0) == {}  # its own TTL, not the stale handle's
        assert old.expiry == 0.0 and old.served  # the handle keeps what it was told

    def test_served_picks_drop_on_removal_in_either_key_form(self) -> None:
        """A removal drops the entries of served picks only, whether the keys came as signed int64 or as
        their uint64 form."""
        idx = BlockIndex()
        keys = [-5, -6, 7]
        served = idx.add_speculative("a", keys, ttl_s=10, now=0.0)
        idx.add_speculative("b", keys, ttl_s=10, now=0.0)
        idx.extend(served, 10.0, now=0.0)
        idx.remove("a", [k & ((1 << 64) - 1) for k in keys])
        idx.remove("b", keys)
        assert idx.speculative_entries() == {(k & ((1 << 64) - 1), "b") for k in keys}
        assert idx.num_speculative == 3

    def test_a_strided_removal_drops_what_it_names(self) -> None:
        """Keys handed over as a strided view reach the compiled store and the reuse sketch as the keys they
        are."""
        idx = BlockIndex()
        idx.extend(idx.add_speculative("a", list(range(1, 11)), ttl_s=10, now=0.0), 10.0, now=0.0)
        idx.remove("a", np.arange(1, 21, dtype=np.uint64)[::2])  # 1, 3, …, 19
        assert idx.speculative_entries() == {(k, "a") for k in (2, 4, 6, 8, 10)}
        idx.add_speculative_sampled("b", np.arange(100, 140, dtype=np.uint64)[::2], ttl_s=10, now=0.0)
        assert {k for k, p in idx.speculative_entries() if p == "b"} == set(range(100, 140, 2))
        assert idx.reuse.distance("b", [101])[0] == -1  # the reuse sketch was sent the same keys

    def test_speculative_entries_are_not_python_objects(self) -> None:
        """100,000 entries over 2,000 picks: the garbage collector tracks a few objects per pick (the lease,
        the pick's record), none per entry, and the store holds under 40 bytes per entry."""
        idx = BlockIndex(max_speculative=10**6)
        gc.collect()
        before = len(gc.get_objects())
        for i in range(2000):
            idx.add_speculative(f"p{i % 16}", list(range(i * 50, i * 50 + 50)), ttl_s=10, now=0.0)
        assert idx.num_speculative == 100_000
        gc.collect()
        assert len(gc.get_objects()) - before < 4 * 2000
        assert idx._specs.stats()[1] < 40 * 100_000
        assert idx.expire(now=20.0) == 100_000
        idx.add_speculative("p0", [1], ttl_s=10, now=20.0)
        assert idx.speculative_entries() == {(1, "p0")}

    def test_threads_share_the_store(self) -> None:
        """Picks, their first tokens and fallbacks (the router's thread), peers' picks (the gossip thread),
        removals and pod resets (the ingestion thread) and lookups at once: the count stays the entries'."""
        idx = BlockIndex(max_speculative=5_000)
        errors: list[BaseException] = []

        def run(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(1500):
                    pod, start = f"p{rng.randrange(6)}", rng.randrange(200)
                    keys = list(range(start, start + rng.randrange(1, 120)))
                    op = rng.random()
                    if op < 0.4:
                        lease = idx.add_speculative(pod, keys, ttl_s=rng.uniform(0.001, 5))
                        if rng.random() < 0.5:
                            idx.extend(lease, rng.uniform(0.001, 5))
                        if rng.random() < 0.1:
                            lease.expiry = 0.0
                    elif op < 0.6:
                        idx.add_speculative_sampled(pod, keys, ttl_s=1.0)
                    elif op < 0.8:
                        idx.remove(pod, keys)
                    elif op < 0.98:
                        idx.match(keys, [f"p{j}" for j in range(6)])
                    else:
                        idx.clear_pod(pod)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(seed,)) for seed in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert idx.num_speculative == len(idx.speculative_entries()) <= 5_000 + 120

    def test_clear_pod(self) -> None:
        idx = BlockIndex()
        idx.add("a", [1, 2])
        idx.add("b", [1])
        idx.clear_pod("a")
        assert idx.num_keys == 1 and idx.match([1], ["a", "b"]).keys() == {"b"}

    def test_gpu_blocks_are_counted_per_pod(self) -> None:
        """``num_pod_gpu_keys``: entries with the GPU tier, whatever other tiers the key is on."""
        idx = BlockIndex()
        idx.add("a", [1, 2, 3])
        idx.add("a", [3, 4], Tier.CPU)
        idx.add("a", [4])  # already held (CPU): now on the GPU as well
        assert idx.num_pod_gpu_keys("a") == 4 and idx.num_pod_keys("a") == 4
        idx.add("a", [1, 2])  # again: counted once
        idx.remove("a", [1, 4])  # GPU only: 4 stays on the CPU
        assert idx.num_pod_gpu_keys("a") == 2 and idx.num_pod_keys("a") == 3
        idx.remove("a", [3], None)
        assert idx.num_pod_gpu_keys("a") == 1
        idx.clear_pod("a")
        assert idx.num_pod_gpu_keys("a") == 0 and idx.num_pod_gpu_keys("b") == 0

    def test_a_new_subscription_keeps_the_picks(self) -> None:
        """Clearing a pod's exact entries for a first subscription leaves its picks; a resync or removal drops
        them."""
        idx = BlockIndex()
        idx.add("a", [1, 2])
        idx.add_speculative("a", [1, 2, 3, 4], 30.0)
        idx.clear_pod("a", picks=False)
        m = idx.match([1, 2, 3, 4], ["a"])["a"]
        assert m.blocks == 4 and m.speculative == 4 and idx.num_entries == 0
        idx.clear_pod("a")
        assert idx.match([1, 2, 3, 4], ["a"]) == {} and idx.num_speculative == 0


class TestTierWeights:
    """Tier weights come from the cost model: what a hit saves after its load cost."""

    def test_derived_from_bandwidth(self) -> None:
        w = tier_weights(CostModelSettings(prefill_tokens_per_s=10_000, kv_bytes_per_token=100_000,
                                           cpu_gbps=10, ssd_gbps=1, remote_gbps=0.5))
        # prefill 100 µs/token; CPU load 10 µs/token → 0.9; SSD 100 µs → 0; remote slower → 0
        assert w[Tier.GPU.rank] == 1.0 and abs(w[Tier.CPU.rank] - 0.9) < 1e-9
        assert w[Tier.SSD.rank] == 0.0 and w[Tier.REMOTE.rank] == 0.0


class TestIngest:
    """The engine adapter keys blocks by engine hashes or by keys recomputed from token ids."""

    def test_engine_hashes_and_removal(self) -> None:
        h = BlockHasher(4)
        keys = hashes_as_ints(h.hash_tokens(list(range(12))))
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h)
        ap.apply(KVEventBatch(ts=0, events=[stored(keys, None, list(range(12)), 4, "GPU"),
                                            stored(keys[:1], None, list(range(4)), 4, "CPU")]))
        assert idx.match(keys, ["p"])["p"].blocks == 3 and idx.pod_tiers("p", keys[0]) == {Tier.GPU, Tier.CPU}
        ap.apply(KVEventBatch(ts=0, events=[removed(keys[1:2], "GPU")]))
        assert idx.match(keys, ["p"])["p"].blocks == 1
        ap.apply(KVEventBatch(ts=0, events=[AllBlocksCleared()]))
        assert idx.match(keys, ["p"]) == {}

    def test_recomputed_keys_from_foreign_hashes(self) -> None:
        h = BlockHasher(4)
        ours = hashes_as_ints(h.hash_tokens(list(range(12))))
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        foreign = [1001, 1002, 1003]
        ap.apply(KVEventBatch(ts=0, events=[stored(foreign[:2], None, list(range(8)), 4, "GPU")]))
        ap.apply(KVEventBatch(ts=0, events=[stored(foreign[2:], 1002, list(range(8, 12)), 4, "GPU")]))
        assert idx.match(ours, ["p"])["p"].blocks == 3
        ap.apply(KVEventBatch(ts=0, events=[removed([1003], "GPU")]))
        assert idx.match(ours, ["p"])["p"].blocks == 2
        ap.apply(KVEventBatch(ts=0, events=[stored([5], 9999, list(range(4)), 4, "GPU")]))
        assert ap.stats.orphans == 1 and ap.hashes_like_us is None

    def test_recompute_keeps_salted_chains_of_a_pod_that_hashes_like_us(self) -> None:
        """Events carry no salt: after an unsalted block proves the pod hashes like the picker, a salted first
        block (engine hash ≠ recomputation) is keyed by the engine's hashes, and its later blocks chain from
        them."""
        h = BlockHasher(4)
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, h, recompute_keys=True)
        plain = hashes_as_ints(h.hash_tokens(list(range(100, 104))))
        ap.apply(KVEventBatch(ts=0, events=[stored(plain, None, list(range(100, 104)), 4, "GPU")]))
        assert ap.hashes_like_us is True
        salted = hashes_as_ints(h.hash_tokens(list(range(12)), extra_keys=salt_extra_keys("tenant-a")))
        ap.apply(KVEventBatch(ts=0, events=[stored(salted[:2], None, list(range(8)), 4, "GPU")]))
        ap.apply(KVEventBatch(ts=0, events=[stored(salted[2:], salted[1], list(range(8, 12)), 4, "GPU")]))
        assert idx.match(salted, ["p"])["p"].blocks == 3 and ap.stats.orphans == 0
        unsalted = hashes_as_ints(h.hash_tokens(list(range(12))))
        assert idx.match(unsalted, ["p"]) == {}

    def test_vllm_produced_batches(self) -> None:
        """Batches encoded by vLLM itself (bytes and int hashes) land in the index with their tiers."""
        batch = decode_batch((DATA / "vllm_kv_event_batch.msgpack").read_bytes())
        idx = BlockIndex()
        ap = PodEventApplier("p", idx, BlockHasher(16, "sha256_cbor"))
        ap.apply(KVEventBatch(ts=0, events=batch.events[:2]))
        k0, k1 = (to_int64(h) for h in batch.events[0].block_hashes)  # type: ignore[union-attr]
        assert idx.pod_tiers("p", k1) == {Tier.GPU, Tier.CPU}
        ap.apply(KVEventBatch(ts=0, events=batch.events[2:3]))
        assert idx.pod_tiers("p", k1) == {Tier.CPU} and idx.match([k0, k1], ["p"])["p"].blocks == 2
        ap.apply(KVEventBatch(ts=0, events=batch.events[3:]))
        assert idx.num_keys == 0 and ap.stats.cleared == 1
        ints = decode_batch((DATA / "vllm_kv_event_batch_inthash.msgpack").read_bytes())
        ap.apply(ints)
        assert idx.match([2233398808101521225], ["p"])["p"].blocks == 1
