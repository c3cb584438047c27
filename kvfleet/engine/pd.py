"""Prefill/decode disaggregation between simulated engines (llm-d's convention).

A decode engine that receives ``x-prefiller-host-port: HOST:PORT``:

1. asks that engine to prefill: ``POST /v1/completions`` with the prompt's token
   ids, ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``;
   the prefill engine runs the prompt, keeps its blocks and answers with
   ``kv_transfer_params`` (``remote_request_id``, ``remote_host``,
   ``remote_port``, ``num_blocks``);
2. pulls the blocks through a :class:`KVPuller` and installs each as it lands
   (the scheduler starts the sequence when the first block is in and emits the
   first token once all are, since the simulated output depends on every
   block's bytes: a corrupted transfer changes the answer);
3. the prefill engine frees its blocks when the pull ends (or after a timeout).

:class:`TransferKVPuller` moves the blocks with the node agent's transfer
engine (:mod:`kvfleet.agent.transfer`: shm on one host, else parallel TCP
streams, HMAC-authenticated with the pool secret, in-order delivery with
failover) from the prefill engine's :class:`~kvfleet.agent.transfer.TransferServer`,
which serves the GPU stand-in's blocks (:class:`GpuBlockSource`), then tells
the prefill engine to release them (``DELETE /kvfleet/v1/kv/{id}``). It is
used whenever a pool secret is configured (``KVFLEET_TRANSFER_SECRET`` or
``transfer.secret_file``).

:class:`HttpKVPuller`, the fallback without a secret, streams the blocks over the prefill engine's HTTP port
(``GET /kvfleet/v1/kv/{request_id}``), one frame per block:
``[u16 hash length][hash][u32 data length][data]``; a frame arrives as soon
as it is read, so the first block lands before the last one is sent.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp
import numpy as np
import numpy.typing as npt

from kvfleet.agent.transfer import Block, TransferClient
from kvfleet.cache.hashing import BlockHash, ExtraKeys
from kvfleet.engine.kv import EngineKV, _hash_bytes, _hash_from

PREFILLER_HEADER = "x-prefiller-host-port"
_LEN = struct.Struct("<HI")

OnBlock = Callable[[BlockHash, bytes], None]


class RemotePrefillError(OSError):
    """The prefill engine refused or failed the prefill request."""


class KVPuller(Protocol):
    """Fetches a prefill-only request's blocks from a prefill engine, calling ``on_block`` as each lands."""

    async def pull(self, prefiller: str, params: Mapping[str, Any], on_block: OnBlock) -> int:
        """Returns the number of blocks received; raises on a failed transfer."""
        ...

    async def close(self) -> None: ...


def encode_block_frame(block_hash: BlockHash, data: bytes) -> bytes:
    hb = _hash_bytes(block_hash)
    return _LEN.pack(len(hb), len(data)) + hb + data


async def request_remote_prefill(
    prefiller: str, model: str, token_ids: npt.NDArray[np.uint32], extra_keys: ExtraKeys, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Step 1: run the prompt on ``prefiller``; its ``kv_transfer_params`` plus ``prefill_cached_tokens``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": token_ids.tolist(),
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    if extra_keys:
        first = extra_keys[0]
        if isinstance(first, tuple) and len(first) == 1 and isinstance(first[0], str):
            body["cache_salt"] = first[0]
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s,
            s.post(f"http://{prefiller}/v1/completions", json=body) as r,
        ):
            data = await r.json(content_type=None)
            if r.status != 200:
                raise RemotePrefillError(f"HTTP {r.status}: {data}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RemotePrefillError(str(exc) or type(exc).__name__) from exc
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or "remote_request_id" not in params:
        raise RemotePrefillError("prefill engine answered without kv_transfer_params")
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {**params, "prefill_cached_tokens": cached if isinstance(cached, int) else 0}


class HttpKVPuller:
    """Pulls blocks over the prefill engine's HTTP port (see the module doc)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def pull(self, prefiller: str, params: Mapping[str, Any], on_block: OnBlock) -> int:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        host = params.get("remote_host") or prefiller.rsplit(":", 1)[0]
        port = params.get("remote_port") or prefiller.rsplit(":", 1)[1]
        rid = params["remote_request_id"]
        n = 0
        async with self._session.get(f"http://{host}:{port}/kvfleet/v1/kv/{rid}") as r:
            if r.status != 200:
                raise RemotePrefillError(f"KV pull: HTTP {r.status}")
            while True:
                try:
                    head = await r.content.readexactly(_LEN.size)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise RemotePrefillError("KV pull: stream cut inside a frame") from exc
                    break
                hl, dl = _LEN.unpack(head)
                raw = await r.content.readexactly(hl + dl)
                h = _hash_from(raw[:hl])
                if h is None:
                    raise RemotePrefillError("KV pull: empty block hash")
                on_block(h, raw[hl:])
                n += 1
        expected = params.get("num_blocks")
        if isinstance(expected, int) and n != expected:
            raise RemotePrefillError(f"KV pull: got {n} of {expected} blocks")
        return n

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def hash_to_json(h: BlockHash) -> int | str:
    """Block hashes in ``kv_transfer_params``: ints as they are, SHA-256 bytes as ``"hex:..."``."""
    return "hex:" + h.hex() if isinstance(h, bytes) else int(h)


def hash_from_json(v: Any) -> BlockHash:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v.startswith("hex:"):
        return bytes.fromhex(v[4:])
    raise RemotePrefillError(f"bad block hash in kv_transfer_params: {v!r}")


class GpuBlockSource:
    """The transfer engine's ``BlockSource`` over an engine's GPU stand-in (read from I/O threads)."""

    def __init__(self, kv: EngineKV) -> None:
        self.kv = kv

    def get_block(self, block_hash: BlockHash) -> bytes | None:
        block = self.kv.gpu_data.get(block_hash)
        return None if block is None else block.data


async def release_remote(prefiller: str, request_id: str, session: aiohttp.ClientSession) -> None:
    """Tell the prefill engine it may free the blocks it kept for us (best effort)."""
    try:
        async with session.delete(f"http://{prefiller}/kvfleet/v1/kv/{request_id}") as r:
            await r.read()
    except (aiohttp.ClientError, TimeoutError):
        pass  # the prefill engine frees held blocks after a timeout anyway


class TransferKVPuller:
    """Pulls through the agent's transfer engine (see the module doc); HTTP for requests without a transfer port."""

    def __init__(self, client: TransferClient, fallback: KVPuller | None = None) -> None:
        self.client = client
        self.fallback = fallback or HttpKVPuller()
        self._session: aiohttp.ClientSession | None = None

    async def pull(self, prefiller: str, params: Mapping[str, Any], on_block: OnBlock) -> int:
        port = params.get("transfer_port")
        if not isinstance(port, int) or not port:
            return await self.fallback.pull(prefiller, params, on_block)
        hashes = [hash_from_json(v) for v in params.get("block_hashes", [])]
        host = str(params.get("transfer_host") or prefiller.rsplit(":", 1)[0])

        def land(block: Block) -> None:
            on_block(block.block_hash, bytes(block.data))

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            handle = self.client.pull((host, port), hashes, on_block=land)
            await handle.wait()
        finally:
            await release_remote(prefiller, str(params["remote_request_id"]), self._session)
        return len(hashes)

    async def close(self) -> None:
        await self.fallback.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
