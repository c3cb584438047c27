"""Fixtures for the cache-core tests: the vLLM-produced interop vectors (see data/PROVENANCE.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def sha256_vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / "vllm_sha256_cbor_vectors.json").read_text())
    return data


@pytest.fixture(scope="session")
def vllm_batch_bytes() -> bytes:
    return (DATA / "vllm_kv_event_batch.msgpack").read_bytes()


@pytest.fixture(scope="session")
def vllm_inthash_batch_bytes() -> bytes:
    return (DATA / "vllm_kv_event_batch_inthash.msgpack").read_bytes()
