"""Block hashing: vLLM's sha256_cbor vectors, chain properties of xxh3_64, registry errors."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.cache.errors import UnknownAlgorithmError
from kvfleet.cache.hashing import BlockHasher, fmix64, fmix64_inverse, hashes_as_ints, to_int64


def _seed(case: dict[str, Any]) -> str:
    return "vllm-none-hash" if case["seed"] == "default" else "0"


def test_sha256_cbor_matches_vllm_vectors(sha256_vectors: dict[str, Any]) -> None:
    """Every case produced by vLLM 0.33's own hash_block_tokens (block sizes 16/32, salt, seeds)."""
    assert len(sha256_vectors["cases"]) >= 6
    for case in sha256_vectors["cases"]:
        hasher = BlockHasher(block_size=case["block_size"], algo="sha256_cbor", seed=_seed(case))
        got = [h.hex() for h in hasher.hash_tokens(case["token_ids"], extra_keys=case["extra_keys"])]
        assert got == case["block_hashes"], case["name"]


def test_sha256_cbor_root_is_vllm_none_hash(sha256_vectors: dict[str, Any]) -> None:
    """NONE_HASH for the default seed and for PYTHONHASHSEED=0."""
    assert BlockHasher(algo="sha256_cbor").root.hex() == sha256_vectors["none_hash"]["default"]  # type: ignore[union-attr]
    assert (BlockHasher(algo="sha256_cbor", seed="0").root.hex()  # type: ignore[union-attr]
            == sha256_vectors["none_hash"]["PYTHONHASHSEED=0"])


def test_int_form_matches_vllm_int_hashes(sha256_vectors: dict[str, Any]) -> None:
    """The int published with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is the last 8 bytes, big-endian."""
    first = bytes.fromhex(sha256_vectors["cases"][0]["block_hashes"][0])
    assert to_int64(first) == 2233398808101521225  # from vllm_kv_event_batch_inthash.msgpack
    assert to_int64(12345) == 12345


def test_partial_tail_is_not_hashed() -> None:
    h = BlockHasher(block_size=16)
    assert len(h.hash_tokens(range(15))) == 0
    assert len(h.hash_tokens(range(47))) == 2


def test_chain_resumes_from_any_parent() -> None:
    """h_i depends only on h_{i-1} and block i: hashing a suffix from a parent gives the same hashes."""
    h = BlockHasher(block_size=8)
    full = h.hash_tokens(np.arange(80))
    for cut in range(1, 10):
        tail = h.hash_tokens(np.arange(cut * 8, 80), parent=int(full[cut - 1]))
        assert tail.tolist() == full[cut:].tolist()


def test_prefix_property_and_divergence() -> None:
    """Equal prefixes give equal hashes; after one differing token every later hash differs."""
    h = BlockHasher(block_size=4)
    a = h.hash_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = h.hash_tokens([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


def test_extra_keys_and_seed_change_hashes() -> None:
    h = BlockHasher(block_size=4)
    plain = h.hash_tokens(range(8))
    salted = h.hash_tokens(range(8), extra_keys=[("salt",), None])
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert BlockHasher(block_size=4, seed="other").hash_tokens(range(8))[0] != plain[0]


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_fmix64_is_a_bijection(x: int) -> None:
    assert fmix64_inverse(fmix64(x)) == x


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=200))
def test_xxh3_matches_a_scalar_reference(tokens: list[int]) -> None:
    """The vectorised chain equals a per-block scalar evaluation of the documented formula."""
    import xxhash

    bs = 4
    h = BlockHasher(block_size=bs, seed="s")
    mask = (1 << 64) - 1
    p = 0x9E3779B97F4A7C15
    state = fmix64_inverse(h.root)  # type: ignore[arg-type]
    want = []
    for i in range(len(tokens) // bs):
        c = xxhash.xxh3_64_intdigest(np.asarray(tokens[i * bs : (i + 1) * bs], dtype="<u4").tobytes())
        state = (state * p + c) & mask
        want.append(fmix64(state))
    assert hashes_as_ints(h.hash_tokens(tokens)) == want


def test_unknown_algorithm_lists_known_names() -> None:
    with pytest.raises(UnknownAlgorithmError, match="sha256_cbor") as exc:
        BlockHasher(algo="md5")
    assert "xxh3_64" in str(exc.value)


def test_invalid_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        BlockHasher().hash_tokens([-1] * 16)


@pytest.mark.parametrize("row", [4, 16, 64, 128, 240, 256, 1024])
def test_compiled_block_digests_equal_the_xxhash_package(row: int) -> None:
    """The compiled digests (vendored xxhash.h) equal the ``xxhash`` package's ``xxh3_64`` on every length
    class XXH3 treats apart (≤ 16, ≤ 128, ≤ 240 bytes and longer)."""
    import xxhash

    from kvfleet.cache.digest import digest_rows

    rows = np.random.default_rng(row).integers(0, 256, (33, row), dtype=np.uint8)
    assert digest_rows(rows).tolist() == [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows]
    assert len(digest_rows(rows[:0])) == 0
    with pytest.raises(ValueError, match="C-contiguous 2-D uint8"):
        digest_rows(rows[:, ::2])


@pytest.mark.parametrize("extra", [False, True])
def test_compiled_chain_is_the_documented_recurrence(extra: bool) -> None:
    """The compiled chain (one pass: digest, ``s_i = P·s_{i-1} + c_i mod 2^64``, ``fmix64``) equals the module
    doc's recurrence computed here with Python integers, from a root and from an arbitrary parent, with and
    without extra keys (which take the digest-then-chain path)."""
    import cbor2
    import xxhash

    from kvfleet.cache.hashing import Xxh3Chain, fmix64, fmix64_inverse

    rng = np.random.default_rng(7)
    for block_size in (1, 16, 64):
        tokens = rng.integers(0, 2**32, 37 * block_size, dtype=np.uint32)
        root = Xxh3Chain().root("vllm-none-hash")
        assert isinstance(root, int)
        for parent in (root, int(rng.integers(0, 2**63)) * 2 + 1):
            keys = [("salt",) if i in (0, 5) else None for i in range(37)] if extra else None
            state, want = fmix64_inverse(parent), []
            for i in range(37):
                block = tokens[i * block_size:(i + 1) * block_size].astype("<u4").tobytes()
                if keys is not None and keys[i] is not None:
                    block += cbor2.dumps(keys[i], canonical=True)
                state = (state * 0x9E3779B97F4A7C15 + xxhash.xxh3_64_intdigest(block)) % 2**64
                want.append(fmix64(state))
            assert Xxh3Chain().chain(tokens, block_size, parent, keys).tolist() == want


def test_extra_keys_follow_the_documented_digest() -> None:
    """A block with extra keys digests its tokens ‖ cbor(extra); the blocks without keep the compiled
    digest."""
    import cbor2
    import xxhash

    bs = 16
    tokens = list(range(1000, 1000 + 4 * bs))
    extras: list[Any] = [("salt",), None, ["lora", 3], None]
    h = BlockHasher(block_size=bs, seed="s")
    state = fmix64_inverse(h.root)  # type: ignore[arg-type]
    want = []
    for i in range(4):
        data = np.asarray(tokens[i * bs : (i + 1) * bs], dtype="<u4").tobytes()
        if extras[i] is not None:
            data += cbor2.dumps(extras[i], canonical=True)
        state = (state * 0x9E3779B97F4A7C15 + xxhash.xxh3_64_intdigest(data)) & ((1 << 64) - 1)
        want.append(fmix64(state))
    assert hashes_as_ints(h.hash_tokens(tokens, extra_keys=extras)) == want


def test_block_keys_read_as_ints_from_their_array() -> None:
    from kvfleet.cache.hashing import BlockKeys, block_keys

    hashes = BlockHasher(block_size=4).hash_tokens(range(40))
    keys = block_keys(hashes)
    ints = hashes_as_ints(hashes)
    assert isinstance(keys, BlockKeys) and keys.u64 is hashes and len(keys) == 10
    assert keys == ints and ints == list(keys) and keys != ints[:-1] and keys != "x"
    assert keys[3] == ints[3] and type(keys[3]) is int and keys[-1] == ints[-1]
    assert keys[2:5] == ints[2:5] and type(keys[2:5]) is list
    with pytest.raises(IndexError):
        keys[10]
    assert type(block_keys(BlockHasher(block_size=4, algo="sha256_cbor").hash_tokens(range(8)))) is list


@pytest.mark.parametrize("algo", ["xxh3_64", "sha256_cbor"])
def test_hash_each_is_hash_tokens_of_each_block(algo: str) -> None:
    """One block of each of several chains, each continuing its own parent (the root for ``None``): what
    :meth:`BlockHasher.hash_tokens` gives for that block; the rows must be whole blocks, one per parent."""
    h = BlockHasher(4, algo)
    rng = random.Random(7)
    prompts = [[rng.randrange(1 << 32) for _ in range(4 * rng.randint(1, 3))] for _ in range(6)]
    tails = [h.hash_tokens(p)[-1] for p in prompts]
    parents: list[Any] = [int(t) if algo == "xxh3_64" else t for t in tails] + [None]
    rows = np.array([[rng.randrange(1 << 32) for _ in range(4)] for _ in parents], dtype=np.uint32)
    each = hashes_as_ints(h.hash_each(rows, parents))
    one = [hashes_as_ints(h.hash_tokens(list(r), parent=p))[0]
           for r, p in zip(rows.tolist(), parents, strict=True)]
    assert each == one
    with pytest.raises(ValueError):
        h.hash_each(rows[:, :3], parents)
    with pytest.raises(ValueError):
        h.hash_each(rows, parents[:-1])
