"""The simulator's OpenAI-compatible HTTP server (aiohttp).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (vLLM
names, :mod:`kvfleet.engine.metrics`), and the internal ``DELETE
/kvfleet/v1/kv/{id}`` (free the blocks a prefill-only request kept) and
``POST /kvfleet/v1/reset`` (empty every tier).

Trust. Internal requests — a body with ``kv_transfer_params``, the two
internal endpoints — must be signed with the pool's transfer secret
(:mod:`kvfleet.engine.peer`); without a valid signature they are refused with
403 before anything is scheduled or freed, and only signed callers ever see
``kv_transfer_params`` (request ids, the transfer port). A decode engine acts
on ``x-prefiller-host-port`` only for a member of ``engine.prefill_peers``
(else 403, no connection made), and uses a transferred block only if its bytes
equal its own (else the block is recomputed and counted as mismatched). Blocks
kept for decode engines to pull are capped at half the GPU blocks (503 above that).

Prompts are token ids (``prompt`` as a list of ints) or text, tokenized as a vLLM server of the model
does (``engine.tokenizer``: the model's tokenizer files and chat template, :mod:`kvfleet.cache.modeltok`;
or the byte-level tokenizer, :mod:`kvfleet.cache.tokens`);
chat ``messages`` are rendered with the model's template (or kvfleet's default with ``bytes``), so the EPP's
block keys equal the engine's. Every response carries
``usage.prompt_tokens_details.cached_tokens`` and the header
``x-kvfleet-pod`` (which pod served it).

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``:
400 malformed JSON / bad fields / over the context limit / a malformed
``x-prefiller-host-port``, 403 an unsigned internal request or a prefiller
outside the pool, 404 unknown model, 503 when the engine cannot take the request.

:class:`EngineServer`'s handlers share one state (the scheduler, the KV, the holds kept for decode engines,
the publisher, the trust checks) and read top to bottom as the request flows (parse → trust → schedule →
complete or stream); request validation and tokenization (:mod:`kvfleet.engine.requests`), the KV, the
scheduler, P/D and the metrics are their own modules.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvfleet.agent.publisher import ZmqPublisher
from kvfleet.agent.transfer import AuthError, TransferClient, TransferServer
from kvfleet.agent.transfer.auth import load_secret
from kvfleet.agent.transfer.metrics import TransferMetrics
from kvfleet.cache.errors import LockedError
from kvfleet.cache.events import EventBuffer
from kvfleet.cache.modeltok import ModelTokenizer, load_model_tokenizer
from kvfleet.cache.tokens import ByteTokenizer, salt_extra_keys
from kvfleet.config import Settings
from kvfleet.engine.decode import admit_prefiller, start_remote_prefill
from kvfleet.engine.kv import EngineKV, output_alphabet
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.pd import (
    PREFILLER_HEADER,
    GpuBlockSource,
    KVPuller,
    TransferKVPuller,
    hash_to_json,
)
from kvfleet.engine.peer import PeerAuthError, PeerVerifier, PrefillPeers
from kvfleet.engine.requests import (
    ApiError,
    ConflictApiError,
    ForbiddenApiError,
    NotFoundApiError,
    ParsedRequest,
    UnavailableApiError,
    chat_ids,
    check_request_fields,
    check_sampling,
    prompt_ids,
)
from kvfleet.engine.scheduler import (
    CapacityError,
    FailEvent,
    FinishEvent,
    Request,
    Scheduler,
    SchedulerClosedError,
    TokenEvent,
)
from kvfleet.engine.tiers import NoTiers, open_tiers

log = logging.getLogger(__name__)

POD_HEADER = "x-kvfleet-pod"
HOLD_SECONDS = 60.0
#: At most this share of the GPU blocks may be held for remote decode at once.
MAX_HELD_FRACTION = 0.5
#: How often KV events that the tier manager's threads buffered between steps are published.
BACKGROUND_FLUSH_S = 0.05


def error_response(exc: ApiError) -> web.Response:
    body = {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.status}}
    return web.json_response(body, status=exc.status)


@dataclass
class Hold:
    """A prefill-only request whose blocks this engine keeps for a decode engine, until released or
    ``deadline``."""

    req: Request
    blocks: int
    deadline: float


class EngineServer:
    """One simulated model server: HTTP API, scheduler, KV cache, event publisher."""

    def __init__(self, settings: Settings, puller: KVPuller | None = None) -> None:
        self.settings = settings
        self.es = settings.engine
        self.events = EventBuffer()
        registry = CollectorRegistry(auto_describe=False)
        tiers = open_tiers(self.es, settings.cache.block_size, settings.tiers, sink=self.events,
                           registry=registry)
        self.kv = EngineKV(self.es, settings.cache, sink=self.events, tiers=tiers, model=settings.tiers.model)
        self.tokenizer: ByteTokenizer | ModelTokenizer = (
            ByteTokenizer() if self.es.tokenizer == "bytes" else load_model_tokenizer(self.es.tokenizer))
        tok = self.tokenizer
        alphabet = None if isinstance(tok, ByteTokenizer) else output_alphabet(tok.encode)
        self.sched = Scheduler(self.kv, on_step=self.flush_events, alphabet=alphabet)
        self.metrics = EngineMetrics(self.sched, self.kv, settings.cache, held=lambda: self.held_blocks,
                                     registry=registry, replay=self._replay_bytes)
        #: the P/D transfers (prefill side: served, decode side: pulled) on the engine's own /metrics
        self.transfer_metrics = TransferMetrics(self.metrics.registry,
                                                settings.transfer.link_capacity_gbps * 1e9)
        self.publisher: ZmqPublisher | None = None
        self.transfer_server: TransferServer | None = None
        self.secret = self._secret()
        self.verifier = PeerVerifier(self.secret)
        self.prefill_peers = PrefillPeers(self.es.prefill_peers)
        self.puller: KVPuller | None = puller or self._default_puller()
        self.holds: dict[str, Hold] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.created = int(time.time())

    def _secret(self) -> bytes | None:
        t = self.settings.transfer
        try:
            return load_secret(t.secret_file, t.secret_env)
        except (AuthError, OSError):
            return None

    def _default_puller(self) -> KVPuller | None:
        if self.secret is None:
            log.info("no transfer secret configured: prefill/decode and the internal endpoints are refused")
            return None
        return TransferKVPuller(TransferClient(self.secret, settings=self.settings.transfer,
                                               metrics=self.transfer_metrics), self.secret)

    # -- lifecycle ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_delete("/kvfleet/v1/kv/{request_id}", self.kv_release)
        app.router.add_post("/kvfleet/v1/reset", self.reset)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    def start_publisher(self) -> None:
        """Bind the KV-event sockets (raises PortInUseError) and publish what is buffered.

        That includes the ``BlockStored`` events of the SSD blocks the tier manager re-indexed
        when it opened (``tiers.announce_on_start``).
        """
        host = self.es.host
        self.publisher = ZmqPublisher(
            f"tcp://{host}:{self.es.kv_events_port}",
            f"tcp://{host}:{self.es.kv_events_replay_port}" if self.es.kv_events_replay_port else None,
            topic=self.es.kv_events_topic,
            buffer_steps=self.es.replay_buffer_steps,
            buffer_bytes=self.es.replay_buffer_bytes,
        )
        self.flush_events()

    async def _on_startup(self, app: web.Application) -> None:
        if self.secret is not None and self.es.role != "decode":
            self.transfer_server = TransferServer(
                GpuBlockSource(self.kv), self.secret, host=self.es.host, settings=self.settings.transfer,
                metrics=self.transfer_metrics
            )
            self.transfer_server.start()
        self.sched.start()
        loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self._sweep_holds())
        if not isinstance(self.kv.tiers, NoTiers):
            self._flusher = loop.create_task(self._flush_background_events())

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in (self._sweeper, self._flusher):
            if task is not None:
                task.cancel()
        await self.sched.close()
        if self.puller is not None:
            await self.puller.close()
        if self.transfer_server is not None:
            self.transfer_server.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.kv.close)
        self.flush_events()
        if self.publisher is not None:
            self.publisher.close()

    def flush_events(self) -> None:
        batch = self.events.drain()
        if batch is not None and self.publisher is not None:
            self.publisher.publish(batch)

    async def _flush_background_events(self) -> None:
        """Publish the events the tier manager's threads add between steps (a write landing on SSD, say).

        The scheduler drains the buffer once per step; an idle engine has no steps, so this does it
        every :data:`BACKGROUND_FLUSH_S` while something is buffered.
        """
        while True:
            await asyncio.sleep(BACKGROUND_FLUSH_S)
            if len(self.events):
                self.flush_events()

    async def _sweep_holds(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid, hold in list(self.holds.items()):
                if hold.deadline < now and hold.req.finished:
                    self.holds.pop(rid, None)
                    if self.sched.release(rid):
                        log.warning("released KV of %s: no decode engine pulled it within %.0fs", rid,
                                    HOLD_SECONDS)

    def _replay_bytes(self) -> tuple[int, int]:
        """The KV-event replay buffer's bytes held and bound ((0, 0) without a publisher)."""
        pub = self.publisher
        return (0, 0) if pub is None else (pub.buffer_bytes, pub.buffer_cap)

    @property
    def held_blocks(self) -> int:
        """Blocks of finished prefill-only requests kept for a decode engine to pull."""
        return sum(h.blocks for rid, h in self.holds.items() if rid in self.sched.held)

    def unhold(self, request_id: str) -> bool:
        """Free a held request's blocks; ``False`` if none are held (yet) for it."""
        if not self.sched.release(request_id):
            return False
        self.holds.pop(request_id, None)
        return True

    def _hold_cap(self) -> int:
        return max(1, int(self.es.num_gpu_blocks * MAX_HELD_FRACTION))

    # -- trust --------------------------------------------------------------------------------
    def _authenticate(self, request: web.Request, body: bytes, what: str) -> None:
        """403 unless the request carries a valid peer signature (pool transfer secret)."""
        try:
            self.verifier.verify(request.method, request.raw_path, request.headers, body)
        except PeerAuthError as exc:
            raise ForbiddenApiError(
                f"{what} is reserved for engines of this pool (requests signed with the pool's transfer "
                f"secret): {exc}"
            ) from None

    # -- parsing ------------------------------------------------------------------------------
    @staticmethod
    def _json(raw: bytes) -> dict[str, Any]:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError("request body must be a JSON object")
        return data

    def _parse(self, data: Mapping[str, Any], chat: bool, remote_decode: bool = False) -> ParsedRequest:
        model = data.get("model", self.es.model)
        if model != self.es.model:
            raise NotFoundApiError(f"The model `{model}` does not exist.", param="model")
        check_sampling(data)
        check_request_fields(data, chat)
        ids = chat_ids(self.tokenizer, data) if chat else prompt_ids(self.tokenizer, data.get("prompt"))
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens", 16))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError("max_tokens must be a positive integer", param="max_tokens")
        max_tokens = min(max_tokens, self.es.max_output_tokens)
        limit = self.es.max_model_len
        if len(ids) + max_tokens > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion).",
                param="prompt",
            )
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("stream must be a boolean", param="stream")
        opts = data.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage", True)) if isinstance(opts, dict) else True
        salt = data.get("cache_salt")  # checked by check_request_fields
        if remote_decode:
            stream = False  # the decode engine reads one JSON answer
        return ParsedRequest(chat, ids, max_tokens, stream, include_usage, salt_extra_keys(salt),
                             remote_decode)

    # -- handlers -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pod": self.es.pod_name, "role": self.es.role})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.es.model,
            "object": "model",
            "created": self.created,
            "owned_by": "kvfleet",
            "root": self.es.model,
            "max_model_len": self.es.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        pull: asyncio.Task[None] | None = None
        try:
            raw = await request.read()
            data = self._json(raw)
            remote_decode = False
            if "kv_transfer_params" in data:
                self._authenticate(request, raw, "kv_transfer_params")
                ktp = data["kv_transfer_params"]
                if ktp is not None and not isinstance(ktp, dict):
                    raise ApiError("kv_transfer_params must be an object", param="kv_transfer_params")
                remote_decode = bool(ktp and ktp.get("do_remote_decode"))
            parsed = self._parse(data, chat, remote_decode)
            prefiller = None
            if not remote_decode and self.es.role != "prefill":
                prefiller = await admit_prefiller(
                    request.headers.getall(PREFILLER_HEADER, []), self.prefill_peers,
                    self.secret is not None and self.puller is not None)
            req = Request(
                request_id=self.sched.new_id("chatcmpl" if chat else "cmpl"),
                token_ids=parsed.token_ids,
                max_tokens=1 if remote_decode else parsed.max_tokens,
                extra_keys=parsed.extra_keys,
                hold_blocks=remote_decode,
            )
            blocks = 0
            if remote_decode:
                blocks = self._check_hold(req)
            if prefiller is not None:
                assert self.secret is not None and self.puller is not None
                pull = await start_remote_prefill(self.kv, self.puller, self.secret, self.es.model, req,
                                                  *prefiller, parsed)
            self.sched.submit(req)
            if remote_decode:
                self.holds[req.request_id] = Hold(req, blocks, time.monotonic() + HOLD_SECONDS)
        except ApiError as exc:
            if pull is not None:
                pull.cancel()
            return error_response(exc)
        except CapacityError as exc:
            if pull is not None:
                pull.cancel()
            return error_response(ApiError(str(exc), param="prompt"))
        except SchedulerClosedError as exc:
            if pull is not None:
                pull.cancel()
            return error_response(UnavailableApiError(str(exc)))
        try:
            if parsed.stream:
                return await self._stream(request, req, parsed)
            return await self._complete(req, parsed)
        finally:
            if pull is not None and not pull.done():
                pull.cancel()

    def _check_hold(self, req: Request) -> int:
        """Blocks a prefill-only request will pin; 503 if this engine cannot serve them or is at its cap."""
        if self.transfer_server is None:
            raise UnavailableApiError(
                "this engine serves no KV transfer port (role decode): it cannot prefill for others")
        need = -(-(len(req.token_ids) + 1) // self.kv.block_size)
        if self.held_blocks + need > self._hold_cap():
            raise self._over_cap(self.held_blocks, need)
        return need

    def _over_cap(self, held: int, need: int) -> UnavailableApiError:
        return UnavailableApiError(
            f"too much KV held for remote decode: {held} blocks held, this request needs {need}, "
            f"the cap is {self._hold_cap()} (half the GPU blocks); retry later"
        )

    async def _collect(self, req: Request) -> str:
        while True:
            ev = await req.events.get()
            if isinstance(ev, FinishEvent):
                return ev.reason
            if isinstance(ev, FailEvent):
                raise ev.error

    def _usage(self, req: Request) -> dict[str, Any]:
        n = len(req.token_ids)
        return {
            "prompt_tokens": n,
            "completion_tokens": len(req.generated),
            "total_tokens": n + len(req.generated),
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    def _headers(self, req: Request) -> dict[str, str]:
        return {POD_HEADER: self.es.pod_name, "x-kvfleet-cached-tokens": str(req.cached_tokens)}

    def _observe(self, req: Request) -> None:
        now = time.monotonic()
        if req.first_token_at is not None:
            self.metrics.ttft.observe(req.first_token_at - req.arrival)
        self.metrics.e2e.observe(now - req.arrival)

    async def _complete(self, req: Request, parsed: ParsedRequest) -> web.Response:
        try:
            reason = await self._collect(req)
        except ApiError as exc:
            self.holds.pop(req.request_id, None)
            return error_response(exc)
        except (CapacityError, SchedulerClosedError, RuntimeError) as exc:
            self.holds.pop(req.request_id, None)
            return error_response(UnavailableApiError(str(exc)))
        hold = self.holds.get(req.request_id) if parsed.remote_decode else None
        if hold is not None and self.held_blocks > self._hold_cap():
            # Admitted while others were still running; holding it now would pass the cap.
            self.unhold(req.request_id)
            self.holds.pop(req.request_id, None)
            return error_response(self._over_cap(self.held_blocks, hold.blocks))
        self._observe(req)
        text = self.tokenizer.decode(req.generated)
        body: dict[str, Any] = {"id": req.request_id, "created": int(time.time()), "model": self.es.model}
        if parsed.chat:
            body["object"] = "chat.completion"
            body["choices"] = [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                 "logprobs": None}
            ]
        else:
            body["object"] = "text_completion"
            body["choices"] = [
                {"index": 0, "text": text, "token_ids": list(req.generated), "finish_reason": reason,
                 "logprobs": None}
            ]
        body["usage"] = self._usage(req)
        if parsed.remote_decode:  # only ever for a signed peer request (see _serve)
            if hold is not None:
                hold.deadline = time.monotonic() + HOLD_SECONDS
            body["kv_transfer_params"] = {
                "remote_engine_id": self.es.pod_name,
                "remote_request_id": req.request_id,
                "num_blocks": len(req.block_hashes),
                "transfer_port": self.transfer_server.port if self.transfer_server is not None else None,
                "block_hashes": [hash_to_json(h) for h in req.block_hashes],
            }
        return web.json_response(body, headers=self._headers(req))

    async def _stream(self, request: web.Request, req: Request, parsed: ParsedRequest) -> web.StreamResponse:
        # Wait for the first event before committing to a 200, so early failures get a real status.
        first = await req.events.get()
        if isinstance(first, FailEvent):
            err = first.error
            return error_response(err if isinstance(err, ApiError) else UnavailableApiError(str(err)))
        resp = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._headers(req)},
        )
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if parsed.chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            c: dict[str, Any] = {"id": req.request_id, "object": obj, "created": created,
                                 "model": self.es.model, "choices": choices}
            if usage is not None:
                c["usage"] = usage
            return b"data: " + json.dumps(c).encode() + b"\n\n"

        def piece(text: str, reason: str | None, first_piece: bool) -> dict[str, Any]:
            if parsed.chat:
                delta: dict[str, Any] = {"content": text}
                if first_piece:
                    delta["role"] = "assistant"
                return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        ev: TokenEvent | FinishEvent | FailEvent = first
        n = 0
        try:
            while True:
                if isinstance(ev, TokenEvent):
                    await resp.write(chunk([piece(self.tokenizer.decode([ev.token_id]), None, n == 0)]))
                    n += 1
                elif isinstance(ev, FinishEvent):
                    await resp.write(chunk([piece("", ev.reason, n == 0)]))
                    break
                else:
                    fail = {"error": {"message": str(ev.error), "type": "service_unavailable", "param": None,
                                      "code": 503}}
                    await resp.write(b"data: " + json.dumps(fail).encode() + b"\n\n")
                    break
                ev = await req.events.get()
            if parsed.include_usage:
                await resp.write(chunk([], self._usage(req)))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        self._observe(req)
        await resp.write_eof()
        return resp

    async def kv_release(self, request: web.Request) -> web.Response:
        """A decode engine finished pulling (through the transfer engine): free the held blocks (signed
        only)."""
        try:
            self._authenticate(request, await request.read(), "releasing held KV")
        except ApiError as exc:
            return error_response(exc)
        rid = request.match_info["request_id"]
        if not self.unhold(rid):
            return error_response(NotFoundApiError(f"no KV held for request {rid[:128]!r}",
                                                   param="request_id"))
        return web.json_response({"released": rid})

    async def reset(self, request: web.Request) -> web.Response:
        """Empty every cache tier (``AllBlocksCleared`` + tier removals); signed only; 409 while requests
        run."""
        try:
            self._authenticate(request, await request.read(), "reset")
        except ApiError as exc:
            return error_response(exc)
        if self.sched.num_running or self.sched.num_waiting:
            return error_response(ConflictApiError("requests are running; reset refused"))
        for rid in list(self.sched.held):
            self.sched.release(rid)
        self.holds.clear()
        try:
            self.kv.reset()
        except LockedError as exc:
            return error_response(ConflictApiError(str(exc)))
        if self.publisher is not None:
            self.publisher.forget_history()
        self.flush_events()
        return web.json_response({"reset": self.es.pod_name})
