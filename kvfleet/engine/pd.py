"""Prefill/decode disaggregation between simulated engines (llm-d's convention).

A decode engine that receives ``x-prefiller-host-port: HOST:PORT`` naming a
member of its prefill pool (``engine.prefill_peers``, checked by
:class:`~kvfleet.engine.peer.PrefillPeers` before any connection):

1. asks that engine to prefill: ``POST /v1/completions`` with the prompt's token
   ids, ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``,
   signed with the pool's transfer secret (:func:`~kvfleet.engine.peer.sign_request`;
   the prefill engine refuses ``kv_transfer_params`` without a valid signature).
   The prefill engine runs the prompt, keeps its blocks and answers with
   ``kv_transfer_params`` (``remote_request_id``, ``transfer_port``,
   ``num_blocks``, ``block_hashes``);
2. pulls the prompt's full blocks — the hashes it computed itself — with the
   node agent's transfer engine (:mod:`kvfleet.agent.transfer`: shm on one
   host, else parallel TCP streams, HMAC-authenticated with the pool secret,
   in-order delivery with failover) from the prefill engine's
   :class:`~kvfleet.agent.transfer.TransferServer`, which serves the GPU
   stand-in's blocks (:class:`GpuBlockSource`). It connects to the member
   address it checked and the ``transfer_port`` of the answer, never to a host
   named in a response. Each block is checked against the decode engine's own
   bytes as it lands (see :mod:`kvfleet.engine.server`);
3. tells the prefill engine to free the blocks (signed
   ``DELETE /kvfleet/v1/kv/{id}``; they are freed after a timeout anyway).

A prefill engine that answers 503 (busy: at its cap of blocks held for remote
decode, or shutting down) leaves the prompt to the decode engine, which
prefills it itself; any other failure fails the request with a 503.

There is no other KV path between engines: without a transfer secret P/D is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np
import numpy.typing as npt

from kvfleet.agent.transfer import Block, TransferClient
from kvfleet.cache.hashing import BlockHash, ExtraKeys
from kvfleet.config.engine import HostPort
from kvfleet.engine.kv import EngineKV
from kvfleet.engine.peer import sign_request

PREFILLER_HEADER = "x-prefiller-host-port"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")

OnBlock = Callable[[BlockHash, bytes], None]


class RemotePrefillError(OSError):
    """The prefill engine refused or failed the prefill request, or the KV transfer failed.

    ``status`` is the prefill engine's HTTP status when it answered (503: busy, e.g. at its hold cap).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KVGrant:
    """What a prefill engine's answer lets the decode engine pull: the held request and the transfer port."""

    request_id: str
    transfer_port: int
    num_blocks: int
    prefill_cached_tokens: int


class KVPuller(Protocol):
    """Fetches a prefill-only request's blocks from a prefill engine, calling ``on_block`` as each lands."""

    async def pull(self, prefiller: HostPort, grant: KVGrant, block_hashes: Sequence[BlockHash],
                   on_block: OnBlock) -> int:
        """Returns the number of blocks received; raises on a failed transfer."""
        ...

    async def close(self) -> None: ...


def parse_grant(data: Any) -> KVGrant:
    """The prefill engine's answer, strictly: ``kv_transfer_params`` and ``usage.prompt_tokens_details``."""
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise RemotePrefillError("prefill engine answered without kv_transfer_params")
    rid, port, num = params.get("remote_request_id"), params.get("transfer_port"), params.get("num_blocks", 0)
    if not isinstance(rid, str) or not _REQUEST_ID.fullmatch(rid):
        raise RemotePrefillError("prefill engine answered with a malformed remote_request_id")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise RemotePrefillError("prefill engine offers no KV transfer port")
    if not isinstance(num, int) or isinstance(num, bool) or num < 0:
        raise RemotePrefillError("prefill engine answered with a malformed num_blocks")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else 0
    return KVGrant(rid, port, num, cached)


async def request_remote_prefill(
    prefiller: HostPort,
    secret: bytes,
    model: str,
    token_ids: npt.NDArray[np.uint32],
    extra_keys: ExtraKeys,
    timeout_s: float = 120.0,
) -> KVGrant:
    """Step 1: run the prompt on ``prefiller`` (a checked member address), signed with the pool secret."""
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
    raw = json.dumps(body).encode()
    path = "/v1/completions"
    headers = {"Content-Type": "application/json", **sign_request(secret, "POST", path, raw)}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s,
            s.post(f"http://{prefiller}{path}", data=raw, headers=headers) as r,
        ):
            data = await r.json(content_type=None)
            if r.status != 200:
                err = data.get("error") if isinstance(data, dict) else None
                msg = err.get("message") if isinstance(err, dict) else None
                raise RemotePrefillError(f"HTTP {r.status}: {str(msg)[:300] if msg else 'no error message'}",
                                         r.status)
    except aiohttp.ClientConnectionError as exc:
        raise RemotePrefillError(f"cannot reach it ({type(exc).__name__})") from exc
    except TimeoutError as exc:
        raise RemotePrefillError(f"no answer within {timeout_s:.0f}s") from exc
    except (aiohttp.ClientError, ValueError) as exc:
        raise RemotePrefillError(f"malformed answer ({type(exc).__name__})") from exc
    return parse_grant(data)


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


async def release_remote(prefiller: HostPort, request_id: str, secret: bytes,
                         session: aiohttp.ClientSession) -> None:
    """Tell the prefill engine it may free the blocks it kept for us (signed; best effort)."""
    path = f"/kvfleet/v1/kv/{request_id}"
    try:
        async with session.delete(f"http://{prefiller}{path}",
                                  headers=sign_request(secret, "DELETE", path)) as r:
            await r.read()
    except (aiohttp.ClientError, TimeoutError):
        pass  # the prefill engine frees held blocks after a timeout anyway


class TransferKVPuller:
    """Pulls through the agent's transfer engine from the checked prefiller address (see the module doc)."""

    def __init__(self, client: TransferClient, secret: bytes) -> None:
        self.client = client
        self.secret = secret
        self._session: aiohttp.ClientSession | None = None

    async def pull(self, prefiller: HostPort, grant: KVGrant, block_hashes: Sequence[BlockHash],
                   on_block: OnBlock) -> int:
        def land(block: Block) -> None:
            on_block(block.block_hash, bytes(block.data))

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            handle = self.client.pull((prefiller.host, grant.transfer_port), list(block_hashes),
                                      on_block=land)
            await handle.wait()
        finally:
            await release_remote(prefiller, grant.request_id, self.secret, self._session)
        return len(block_hashes)

    async def close(self) -> None:
        self.client.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
