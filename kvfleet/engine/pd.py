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

:class:`HttpKVPuller` streams the blocks over the prefill engine's HTTP port
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

from kvfleet.cache.hashing import BlockHash, ExtraKeys
from kvfleet.engine.kv import _hash_bytes, _hash_from

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
    """Step 1: run the prompt on ``prefiller`` and return its ``kv_transfer_params``."""
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
    return params


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
