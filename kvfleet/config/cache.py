"""Settings of the KV-cache core: block size and block hashing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheSettings:
    """How token sequences become block keys; must agree between engines and the EPP.

    ``hash_algo`` is ``xxh3_64`` (fast, 64-bit) or ``sha256_cbor`` (vLLM's
    reproducible scheme, byte-identical to vLLM's ``--prefix-caching-hash-algo sha256_cbor``).
    ``hash_seed`` seeds the root hash; for ``sha256_cbor`` the vLLM default is
    ``vllm-none-hash`` (what vLLM uses when ``PYTHONHASHSEED`` is unset).
    """

    block_size: int = 16
    hash_algo: str = "xxh3_64"
    hash_seed: str = "vllm-none-hash"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
