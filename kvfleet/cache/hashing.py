"""Block hashing: token ids → full blocks → chained block hashes.

``h_i = H(h_{i-1}, tokens_i, extra_i)`` from a seeded root, for every *full*
block of ``block_size`` tokens (the partial tail is never hashed), so equal
hashes mean equal prefixes. Two algorithms, chosen by name:

``xxh3_64`` (default)
    64-bit, fast, computed over a whole prompt at once. Each block's content
    digest is ``c_i = xxh3_64(tokens_i as little-endian uint32 [‖ cbor(extra_i)])``
    and the chain, a polynomial state ``s_i = P·s_{i-1} + c_i (mod 2^64)`` whose
    published hash is ``h_i = fmix64(s_i)``, MurmurHash3's bijective finaliser,
    are one compiled pass over the prompt (:mod:`kvfleet.cache.digest`).
    Because ``fmix64`` is invertible, ``h_i`` is a function of ``h_{i-1}`` and
    the block alone, so a chain resumes from any parent hash.

``sha256_cbor``
    vLLM's reproducible scheme, byte-identical to
    ``vllm.v1.core.kv_cache_utils.hash_block_tokens`` with ``sha256_cbor``:
    ``h_i = sha256(cbor2.dumps((h_{i-1}, tuple(tokens_i), extra_i), canonical=True))``
    with the root ``NONE_HASH = sha256(cbor2.dumps(seed))`` (seed
    ``"vllm-none-hash"`` unless ``PYTHONHASHSEED`` is set). Checked against
    vectors produced by vLLM itself (``tests/cache/data/``).

Hashes come back as a numpy array: ``uint64`` for ``xxh3_64``, ``object``
(32-byte ``bytes``) for ``sha256_cbor``. :func:`to_int64` maps either to the
64-bit integer vLLM publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import cbor2
import numpy as np
import numpy.typing as npt
import xxhash

from kvfleet.cache.digest import chain, chain_each, digest_chain, digest_rows
from kvfleet.cache.errors import UnknownAlgorithmError

#: A block hash: a 64-bit unsigned int (``xxh3_64``) or 32 bytes (``sha256_cbor``).
BlockHash = int | bytes

_MASK = (1 << 64) - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_C1_INV, _C2_INV = pow(_C1, -1, 1 << 64), pow(_C2, -1, 1 << 64)


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser (a bijection on 64-bit integers)."""
    x ^= x >> 33
    x = (x * _C1) & _MASK
    x ^= x >> 33
    x = (x * _C2) & _MASK
    x ^= x >> 33
    return x


def _unxorshift33(x: int) -> int:
    # x ^ (x >> 33) is its own inverse for shifts >= 32 bits on 64-bit words.
    return x ^ (x >> 33)


def fmix64_inverse(h: int) -> int:
    """Inverse of :func:`fmix64`: recovers the chain state from a published hash."""
    x = _unxorshift33(h)
    x = (x * _C2_INV) & _MASK
    x = _unxorshift33(x)
    x = (x * _C1_INV) & _MASK
    return _unxorshift33(x)


ExtraKeys = Sequence[Any | None] | None
"""Per-block extra keys (e.g. the cache salt on block 0, LoRA name): ``extra[i]`` for block ``i``."""


class HashAlgorithm(Protocol):
    """A chained block-hash scheme (registered by name in :data:`ALGORITHMS`)."""

    name: str

    def root(self, seed: str) -> BlockHash:
        """The hash that stands for the empty prefix (the parent of block 0)."""
        ...

    def chain(
        self,
        tokens: npt.NDArray[np.uint32],
        block_size: int,
        parent: BlockHash,
        extra_keys: ExtraKeys,
    ) -> npt.NDArray[Any]:
        """Hashes of every full block of ``tokens`` (length a multiple of block_size)."""
        ...

    def chain_each(self, rows: npt.NDArray[np.uint32], parents: Sequence[BlockHash]) -> npt.NDArray[Any]:
        """The hash of each row of ``rows`` (one block of tokens each) continuing its own parent."""
        ...


class Xxh3Chain:
    """``xxh3_64`` content digests chained by a vectorised polynomial state (see module doc)."""

    name = "xxh3_64"

    def root(self, seed: str) -> BlockHash:
        return fmix64(xxhash.xxh3_64_intdigest(seed.encode()))

    def chain(
        self,
        tokens: npt.NDArray[np.uint32],
        block_size: int,
        parent: BlockHash,
        extra_keys: ExtraKeys,
    ) -> npt.NDArray[np.uint64]:
        n = len(tokens) // block_size
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        if not isinstance(parent, int):
            raise TypeError("xxh3_64 chains continue from an int parent hash")
        words = np.ascontiguousarray(tokens[: n * block_size], dtype="<u4")
        rows = words.view(np.uint8).reshape(n, 4 * block_size)
        state = fmix64_inverse(parent)
        if not extra_keys or all(e is None for e in extra_keys[:n]):
            return digest_chain(rows, state)
        digests = digest_rows(rows)
        for i, extra in enumerate(extra_keys[:n]):  # a cache salt on block 0, LoRA...: their digest again
            if extra is not None:
                block = words[i * block_size : (i + 1) * block_size].tobytes()
                digests[i] = xxhash.xxh3_64_intdigest(block + cbor2.dumps(extra, canonical=True))
        return chain(digests, state)

    def chain_each(self, rows: npt.NDArray[np.uint32],
                   parents: Sequence[BlockHash]) -> npt.NDArray[np.uint64]:
        ints = [p for p in parents if isinstance(p, int)]
        if len(ints) != len(parents):
            raise TypeError("xxh3_64 chains continue from an int parent hash")
        words = np.ascontiguousarray(rows, dtype="<u4")
        states = np.array([fmix64_inverse(p) for p in ints], dtype=np.uint64)
        return chain_each(digest_rows(words.view(np.uint8).reshape(len(words), -1)), states)


class Sha256CborChain:
    """vLLM's ``sha256_cbor``: SHA-256 over canonical CBOR of ``(parent, tokens, extra)``."""

    name = "sha256_cbor"

    def root(self, seed: str) -> BlockHash:
        return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()

    def chain(
        self,
        tokens: npt.NDArray[np.uint32],
        block_size: int,
        parent: BlockHash,
        extra_keys: ExtraKeys,
    ) -> npt.NDArray[np.object_]:
        n = len(tokens) // block_size
        out = np.empty(n, dtype=object)
        toks: list[int] = tokens[: n * block_size].tolist()
        prev = parent
        for i in range(n):
            extra = None
            if extra_keys is not None and i < len(extra_keys):
                extra = extra_keys[i]
                if isinstance(extra, list):
                    extra = tuple(extra)
            payload = (prev, tuple(toks[i * block_size : (i + 1) * block_size]), extra)
            prev = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
            out[i] = prev
        return out

    def chain_each(self, rows: npt.NDArray[np.uint32],
                   parents: Sequence[BlockHash]) -> npt.NDArray[np.object_]:
        out = np.empty(len(rows), dtype=object)
        for i, (row, parent) in enumerate(zip(rows, parents, strict=True)):
            out[i] = self.chain(row, len(row), parent, None)[0]
        return out


#: name → algorithm. Unknown names raise :class:`UnknownAlgorithmError` listing these.
ALGORITHMS: dict[str, HashAlgorithm] = {a.name: a for a in (Xxh3Chain(), Sha256CborChain())}


def get_algorithm(name: str) -> HashAlgorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UnknownAlgorithmError(
            f"unknown hash algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}") from None


def as_tokens(token_ids: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.uint32]:
    """Token ids as a contiguous ``uint32`` array (no copy when already one)."""
    arr = np.asarray(token_ids)
    if arr.dtype != np.uint32:
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2^32)")
        arr = arr.astype(np.uint32)
    return np.ascontiguousarray(arr)


@dataclass(frozen=True)
class BlockHasher:
    """Hashes token sequences into chained block keys with one algorithm, block size and seed.

    >>> h = BlockHasher(block_size=4)
    >>> len(h.hash_tokens(range(10)))   # two full blocks; the partial tail is not hashed
    2
    """

    block_size: int = 16
    algo: str = "xxh3_64"
    seed: str = "vllm-none-hash"
    _impl: HashAlgorithm = field(init=False, repr=False, compare=False)
    root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        impl = get_algorithm(self.algo)
        object.__setattr__(self, "_impl", impl)
        object.__setattr__(self, "root", impl.root(self.seed))

    def hash_tokens(
        self,
        token_ids: Sequence[int] | npt.NDArray[Any],
        parent: BlockHash | None = None,
        extra_keys: ExtraKeys = None,
    ) -> npt.NDArray[Any]:
        """Chained hashes of every full block of ``token_ids``.

        ``parent`` continues a chain (the hash of the block just before
        ``token_ids[0]``); ``None`` starts from the root. ``extra_keys[i]``, when
        given and not ``None``, is mixed into block ``i`` (vLLM puts the cache salt
        on block 0 and LoRA/multimodal keys on the blocks they cover).
        """
        tokens = as_tokens(token_ids)
        return self._impl.chain(tokens, self.block_size, self.root if parent is None else parent, extra_keys)

    def hash_each(self, token_rows: npt.NDArray[Any],
                  parents: Sequence[BlockHash | None]) -> npt.NDArray[Any]:
        """The hash of each row of ``token_rows`` (``n × block_size`` token ids: one block each, of ``n``
        different chains) continuing its own parent (``None``: the root), as :meth:`hash_tokens` of that one
        block would give it; one compiled pass for ``xxh3_64``."""
        rows = as_tokens(token_rows)
        if rows.ndim != 2 or rows.shape[1] != self.block_size or rows.shape[0] != len(parents):
            raise ValueError(f"{len(parents)} rows of {self.block_size} token ids expected")
        return self._impl.chain_each(rows, [self.root if p is None else p for p in parents])

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size


def to_int64(block_hash: BlockHash) -> int:
    """The 64-bit integer form of a hash, as vLLM publishes with int block hashes.

    ints pass through; bytes map to their last 8 bytes, big-endian (vLLM's rule).
    """
    if isinstance(block_hash, int):
        return block_hash & _MASK
    return int.from_bytes(block_hash[-8:], "big")


class BlockKeys(Sequence[int]):
    """A prompt's block keys, read as ints, held as the ``uint64`` array they were hashed into (``u64``).

    The picker reads a few keys of a prompt one by one (its shard key, its sampled positions) and hands the
    whole prompt to its compiled probes as the array: a list of 13.7 k Python ints for a 220 KB prompt cost
    ≈ 0.2 ms to build and the probes converted it back. Equal to any sequence of the same ints."""

    __slots__ = ("_item", "u64")

    def __init__(self, hashes: npt.NDArray[np.uint64]) -> None:
        self.u64 = hashes
        self._item = hashes.item

    def __len__(self) -> int:
        return len(self.u64)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            out: list[int] = self.u64[i].tolist()
            return out
        return int(self._item(i))

    def __iter__(self) -> Iterator[int]:
        return iter(self.u64.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockKeys):
            return bool(np.array_equal(self.u64, other.u64))
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return False
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockKeys({self.u64.tolist()!r})"


def hashes_as_ints(hashes: npt.NDArray[Any] | Sequence[BlockHash]) -> list[int]:
    """:func:`to_int64` over a hash array, fast for ``uint64`` arrays."""
    if isinstance(hashes, np.ndarray) and hashes.dtype == np.uint64:
        out: list[int] = hashes.tolist()
        return out
    return [to_int64(h) for h in hashes]


def block_keys(hashes: npt.NDArray[Any]) -> Sequence[int]:
    """:func:`hashes_as_ints` as a :class:`BlockKeys` where the hashes are ``uint64`` (``xxh3_64``)."""
    if hashes.dtype == np.uint64:
        return BlockKeys(hashes)
    return hashes_as_ints(hashes)
