"""The decode side of prefill/decode in the engine simulator: which prefill engine a request may name
(``x-prefiller-host-port``, a checked member of the prefill pool) and pulling its KV while the request
waits to decode."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvfleet.config.engine import HostPort, parse_host_port
from kvfleet.engine.kv import EngineKV
from kvfleet.engine.pd import PREFILLER_HEADER, KVPuller, RemotePrefillError, request_remote_prefill
from kvfleet.engine.peer import NotAPeerError, PeerUnresolvedError, PrefillPeers
from kvfleet.engine.requests import ApiError, ForbiddenApiError, ParsedRequest, UnavailableApiError
from kvfleet.engine.scheduler import RemoteKV, Request

log = logging.getLogger("kvfleet.engine.server")


async def admit_prefiller(values: list[str], prefill_peers: PrefillPeers | None,
                          transfer: bool) -> tuple[HostPort, HostPort] | None:
    """The ``x-prefiller-host-port`` (its ``values``) as named and the checked member of ``prefill_peers``
    to connect to; ``None`` if absent. ``transfer``: the engine has a transfer secret and a puller."""
    if not values:
        return None
    if len(values) != 1:
        raise ApiError(f"{PREFILLER_HEADER} must be given once", param=PREFILLER_HEADER)
    try:
        target = parse_host_port(values[0])
    except ValueError as exc:
        raise ApiError(f"{PREFILLER_HEADER}: {exc}", param=PREFILLER_HEADER) from None
    if not prefill_peers:
        raise ForbiddenApiError(
            f"prefiller {target} refused: this engine has no prefill peers; list the prefill pool's "
            "members as engine.prefill_peers (HOST:PORT each; a DNS name admits every address it "
            "resolves to)",
            param=PREFILLER_HEADER,
        )
    if not transfer:
        raise ForbiddenApiError(
            "prefill/decode refused: this engine has no transfer secret (set transfer.secret_file or "
            "KVFLEET_TRANSFER_SECRET); KV moves between engines only over the authenticated "
            "transfer path",
            param=PREFILLER_HEADER,
        )
    try:
        return target, await prefill_peers.admit(target)
    except NotAPeerError:
        raise ForbiddenApiError(
            f"prefiller {target} is not a member of this engine's prefill pool (engine.prefill_peers)",
            param=PREFILLER_HEADER,
        ) from None
    except PeerUnresolvedError:
        raise UnavailableApiError(f"prefill peer {target} resolves to no address",
                                  param=PREFILLER_HEADER) from None


async def start_remote_prefill(
    kv: EngineKV, puller: KVPuller, secret: bytes, model: str, req: Request, target: HostPort,
    prefiller: HostPort, parsed: ParsedRequest,
) -> asyncio.Task[None] | None:
    """P/D: have the member ``prefiller`` prefill the prompt, then pull its KV blocks while we wait to
    decode.

    Every landed block is compared with this engine's own bytes; one that
    differs is dropped (counted in ``mismatched_blocks``) and recomputed here.
    ``None`` when the prefill engine is busy (503): the prompt is then prefilled here.
    """
    try:
        grant = await request_remote_prefill(prefiller, secret, model, parsed.token_ids,
                                             parsed.extra_keys)
    except RemotePrefillError as exc:
        if exc.status == 503:
            log.info("prefill engine %s busy (%s): prefilling %s here", target, exc, req.request_id)
            return None
        log.warning("prefill request to %s (%s) failed: %s %s", target, prefiller, exc,
                    exc.__cause__ or "")
        raise UnavailableApiError(f"prefill engine {target} failed: {exc}") from None
    expected = kv.expected_blocks(parsed.token_ids, parsed.extra_keys)
    hashes = list(expected)
    index = {h: i for i, h in enumerate(hashes)}
    bs = kv.block_size
    remote = RemoteKV()
    req.remote = remote
    req.remote_cached_tokens = min(grant.prefill_cached_tokens, len(parsed.token_ids))

    def on_block(block_hash: Any, data: bytes) -> None:
        i = index.get(block_hash)
        if i is None or data != expected[block_hash]:
            kv.mismatched_blocks += 1
            if i is not None:
                remote.rejected += 1
                req.remote_cached_tokens = min(req.remote_cached_tokens or 0, i * bs)
            if remote.rejected <= 1:
                log.warning(
                    "KV block from %s does not match this engine's own bytes: dropped, recomputed here",
                    target)
        else:
            kv.receive(block_hash, data)
        if not remote.first.is_set():
            remote.first.set()

    async def run() -> None:
        try:
            await puller.pull(prefiller, grant, hashes, on_block)
        except Exception as exc:  # any transfer failure fails this request, clearly
            remote.error = UnavailableApiError(
                f"KV transfer from prefill engine {target} failed ({type(exc).__name__})")
            log.warning("KV transfer from %s (%s) failed: %s", target, prefiller, exc)
        finally:
            remote.first.set()
            remote.done.set()

    return asyncio.get_running_loop().create_task(run())
