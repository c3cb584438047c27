"""Continuous batching with cost-model timing: the simulator's step loop.

One asyncio task runs steps the way vLLM's scheduler does: every step first
continues running prefills (chunked at ``max_num_batched_tokens``), admits
waiting requests in arrival order while sequences and KV blocks allow
(allocation reuses the cached prefix, see :class:`~kvfleet.engine.kv.EngineKV`),
and decodes one token for every sequence past its prefill. A step lasts::

    step = decode_ms_per_step + n_decode · decode_ms_per_seq
         + prefill_tokens / model.prefill_tokens_per_s + slow-tier read time of promoted blocks

(modelled seconds), slept as ``step · time_factor`` wall seconds. Only the
uncached suffix is prefilled; a fully cached prompt still computes its last
token, as vLLM does. A P/D decode sequence waits (without a step) until its
first transferred block lands, then prefills only its partial tail — plus
every transferred block that was refused (its bytes differed from this
engine's own), which it recomputes before its first token.

The loop never blocks on I/O: callers get tokens through an asyncio queue per
request, and KV events are drained once per step into ``on_step``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.cache.errors import OutOfBlocksError
from kvfleet.cache.hashing import BlockHash, ExtraKeys
from kvfleet.engine.kv import Admission, EngineKV, output_token

log = logging.getLogger(__name__)


class SchedulerClosedError(RuntimeError):
    """The engine is shutting down; the request was not run."""


class CapacityError(RuntimeError):
    """The request can never fit in the KV pool (needs more blocks than exist)."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``index`` 0 is the first token)."""

    token_id: int
    index: int


@dataclass(frozen=True)
class FinishEvent:
    """The request ended: ``reason`` is ``length`` or ``stop``."""

    reason: str


@dataclass(frozen=True)
class FailEvent:
    """The request failed inside the engine."""

    error: Exception


@dataclass
class RemoteKV:
    """P/D decode: the prompt's KV arrives from a prefill engine.

    ``first`` is set when the first block lands, ``done`` when all have (or
    the transfer failed, with ``error`` set). ``rejected`` counts blocks whose
    bytes did not verify (recomputed here, ``recomputed`` of them charged so far).
    """

    first: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    rejected: int = 0
    recomputed: int = 0


@dataclass
class Request:
    """A request inside the scheduler; the server reads ``events`` and the timing fields."""

    request_id: str
    token_ids: npt.NDArray[np.uint32]
    max_tokens: int
    extra_keys: ExtraKeys = None
    hold_blocks: bool = False
    remote: RemoteKV | None = None
    events: asyncio.Queue[TokenEvent | FinishEvent | FailEvent] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    admission: Admission | None = None
    prefilled: int = 0
    to_prefill: int = 0
    generated: list[int] = field(default_factory=list)
    digest: int | None = None
    first_token_at: float | None = None
    finished: bool = False
    remote_cached_tokens: int | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not computed for this request: on the prefill engine for P/D, else here."""
        if self.remote_cached_tokens is not None:
            return self.remote_cached_tokens
        return self.admission.cached_tokens if self.admission else 0

    @property
    def block_hashes(self) -> list[BlockHash]:
        return self.admission.block_hashes if self.admission else []


@dataclass
class StepStats:
    """Counters the metrics exporter reads."""

    steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed here (uncached suffix, refused transferred blocks)
    generation_tokens: int = 0
    finished: int = 0
    failed: int = 0
    modelled_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)


class Scheduler:
    """The continuous-batching loop over an :class:`EngineKV` (see the module doc)."""

    def __init__(self, kv: EngineKV, on_step: Callable[[], None] = lambda: None,
                 alphabet: Sequence[int] | None = None) -> None:
        self.kv = kv
        self.alphabet = alphabet  # the output characters' ids under the engine's tokenizer (kv.output_token)
        self.settings = kv.settings
        self.model = kv.model
        self.on_step = on_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}
        self.stats = StepStats()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._ids = itertools.count()

    # -- public -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in [*self.waiting, *self.running]:
            r.events.put_nowait(FailEvent(SchedulerClosedError("engine shutting down")))
        self.waiting.clear()
        self.running.clear()

    def submit(self, req: Request) -> Request:
        """Queue a request; tokens arrive on ``req.events``."""
        if self._closed:
            raise SchedulerClosedError("engine shutting down")
        bs = self.kv.block_size
        need = -(-(len(req.token_ids) + req.max_tokens) // bs)
        if need > self.settings.num_gpu_blocks:
            raise CapacityError(
                f"request needs {need} KV blocks, the engine has {self.settings.num_gpu_blocks}")
        self.waiting.append(req)
        self._wake.set()
        return req

    def release(self, request_id: str) -> bool:
        """Free the blocks a prefill-only request kept for a decode engine to pull."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req.request_id)
        self._wake.set()
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self._closed:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                progressed = await self._step()
            except Exception:  # a bug must not wedge every request: fail them loudly
                log.exception("scheduler step failed")
                for r in [*self.running, *self.waiting]:
                    self._fail(r, RuntimeError("engine step failed"))
                self.running.clear()
                self.waiting.clear()
                progressed = True
            if not progressed:
                # Only remote-KV waits or blocked admissions: sleep until something changes.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.005)

    async def _step(self) -> bool:
        budget = self.settings.max_num_batched_tokens
        prefill_tokens = 0
        promote_s = 0.0
        completing: list[Request] = []
        decoding: list[Request] = []
        for r in self.running:
            if r.remote is not None and not r.remote.first.is_set():
                continue
            if r.remote is not None and r.remote.error is not None:
                continue
            if r.prefilled < r.to_prefill:
                take = min(r.to_prefill - r.prefilled, budget)
                if take <= 0:
                    continue
                r.prefilled += take
                budget -= take
                prefill_tokens += take
                if r.prefilled >= r.to_prefill:
                    completing.append(r)
            else:
                decoding.append(r)
        while self.waiting and len(self.running) < self.settings.max_num_seqs and budget > 0:
            r = self.waiting[0]
            try:
                adm = self.kv.admit(r.request_id, r.token_ids, r.extra_keys)
            except OutOfBlocksError as exc:
                if not self.running and not self.held:
                    self.waiting.popleft()
                    self._fail(r, CapacityError(str(exc)))
                    continue
                break
            self.waiting.popleft()
            r.admission = adm
            promote_s += adm.promote_seconds
            n = len(r.token_ids)
            if r.remote is not None:
                # Full blocks come from the prefill engine; only the partial tail is computed here.
                r.to_prefill = max(1, n - len(adm.block_hashes) * self.kv.block_size)
            else:
                r.to_prefill = max(1, n - adm.cached_tokens)
            self.stats.prompt_tokens += n
            self.running.append(r)
            if r.remote is not None and not r.remote.first.is_set():
                continue
            take = min(r.to_prefill, budget)
            r.prefilled = take
            budget -= take
            prefill_tokens += take
            if r.prefilled >= r.to_prefill:
                completing.append(r)
        # A P/D sequence emits its first token only once every block has landed
        # (and the refused ones are recomputed).
        completing_ready = []
        for r in completing:
            if r.remote is not None:
                if r.remote.error is not None:
                    continue  # failed just below
                if not r.remote.done.is_set():
                    r.prefilled = r.to_prefill - 1  # retry the last token next step
                    continue
                if r.remote.rejected > r.remote.recomputed:
                    r.to_prefill += (r.remote.rejected - r.remote.recomputed) * self.kv.block_size
                    r.remote.recomputed = r.remote.rejected
                    continue
            completing_ready.append(r)
        for r in list(self.running):
            if r.remote is not None and r.remote.error is not None:
                self.running.remove(r)
                self.kv.free(r.request_id)
                self._fail(r, r.remote.error)
        if not completing_ready and not decoding and prefill_tokens == 0:
            return False
        dt = prefill_tokens / self.model.prefill_tokens_per_s + promote_s
        if decoding or completing_ready or prefill_tokens:
            dt += (self.settings.decode_ms_per_step / 1000.0
                   + len(decoding) * self.settings.decode_ms_per_seq / 1000.0)
        self.stats.steps += 1
        self.stats.modelled_seconds += dt
        self.on_step()
        if self.settings.time_factor > 0:
            await asyncio.sleep(dt * self.settings.time_factor)
        else:
            await asyncio.sleep(0)
        now = time.monotonic()
        for r in completing_ready:
            self.stats.prefill_tokens += r.to_prefill
            r.digest = self.kv.digest(r.token_ids, r.block_hashes)
            r.first_token_at = now
            self.stats.ttft.append(now - r.arrival)
            self._emit(r)
        for r in decoding:
            self._emit(r)
        self.on_step()
        return True

    def _emit(self, r: Request) -> None:
        assert r.digest is not None
        idx = len(r.generated)
        tok = output_token(r.digest, idx, self.alphabet)
        r.generated.append(tok)
        self.stats.generation_tokens += 1
        r.events.put_nowait(TokenEvent(tok, idx))
        if len(r.generated) >= r.max_tokens:
            self._finish(r, "length")
            return
        try:
            self.kv.append(r.request_id, [tok])
        except OutOfBlocksError:
            self._finish(r, "length")  # out of KV: stop here rather than preempting (documented)

    def _finish(self, r: Request, reason: str) -> None:
        r.finished = True
        self.running.remove(r)
        if r.hold_blocks:
            self.held[r.request_id] = r
        else:
            self.kv.free(r.request_id)
        self.stats.finished += 1
        r.events.put_nowait(FinishEvent(reason))

    def _fail(self, r: Request, exc: Exception) -> None:
        r.finished = True
        self.stats.failed += 1
        r.events.put_nowait(FailEvent(exc))

    def new_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{self.settings.pod_name}-{next(self._ids)}"

    def debug_state(self) -> dict[str, Any]:
        return {"waiting": len(self.waiting), "running": len(self.running), "held": len(self.held)}
