"""GIE's default EPP as scheduling plugins: its approximate prefix-cache scorer, queue and KV-utilisation
scorers and max-score picker, so a profile can route exactly as the Gateway API Inference Extension's
endpoint picker does out of the box (the demo's ``gie-approx`` policy).

Read from kubernetes-sigs/gateway-api-inference-extension at tag ``v1.5.0`` (the last release whose
repository still holds the EPP; v1.6.0 moved it out):

* ``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/`` (``hashing.go``,
  ``indexer.go``, ``plugin.go``, ``types.go``) — the prompt hashed in blocks, the per-server LRU index fed by
  PreRequest, the defaults;
* ``pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go`` — score = matched ÷ total blocks;
* ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go`` and
  ``.../scorer/kvcacheutilization/kvcache_utilization.go`` — the load scorers;
* ``pkg/epp/framework/plugins/scheduling/picker/{max_score_picker,common}.go`` — shuffle, then highest score;
* ``pkg/epp/config/loader/defaults.go`` and ``config/charts/epplib/templates/_config.yaml`` — the default
  profile: queue-scorer weight 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score picker.

The algorithm (``gie-prefix-cache-scorer``):

1. hash the prompt (:func:`hash_prompt`): a seed ``xxh64(model ‖ cache_salt)``, then for each full block of
   ``block_size_tokens × 4`` bytes (GIE's 4 characters per token) ``h_i = xxh64(block_i ‖ le64(h_{i−1}))``,
   the prompt cut to ``max_prefix_blocks`` blocks first and a prompt shorter than one block giving no hash.
   A text prompt is hashed as its UTF-8 bytes (exactly GIE's completions path; chat is hashed as the rendered
   conversation where GIE hashes the messages' JSON), a token-id prompt as its ids' little-endian 4-byte
   encoding — so one block is exactly ``block_size_tokens`` tokens (GIE's parser rejects token-id prompts);
2. match: walk the hashes from the first, stop at the first one no server holds, count per server the hashes
   it holds on the way (:meth:`LRUIndexer.match_longest_prefix`);
3. score = matched blocks ÷ prompt blocks (0 for a prompt with no full block);
4. PreRequest (:meth:`GiePrefixCacheScorer.pre_request`): the cycle's pick gets every hash of the prompt in
   its LRU (created at its first pick with the pod's ``num_gpu_blocks`` from ``vllm:cache_config_info``,
   else ``lru_capacity_per_server``: GIE's autoTune); an eviction drops the server from that hash's holders.
   A P/D request runs two cycles (serving pod, prefill pod), so both picks are recorded, as GIE records the
   primary and the ``prefill`` profile's targets. The block size is the first candidate's scraped
   ``block_size`` (autoTune), else ``block_size_tokens``.

Defaults are GIE's: ``block_size_tokens`` 16, ``max_prefix_blocks`` 256 (``max_prefix_tokens`` > 0 overrides
it as ``max_prefix_tokens // block size``), ``lru_capacity_per_server`` 31,250, ``auto_tune`` 1. Not
reproduced: GIE's 2-minute sweep of pods that left the pool (an index entry for a gone pod only costs
memory here: it is never a candidate), and its prefix-match metrics.

The prompt comes from :func:`~kvfleet.epp.scheduling.framework.current_request`; without one (routing by
block keys only) the prefix scores are 0 and nothing is recorded.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvfleet.epp.scheduling.framework import (
    Candidate,
    RequestContext,
    SchedulingRequest,
    column,
    current_request,
    register,
)

#: GIE's defaults (``approximateprefix/types.go``)
BLOCK_SIZE_TOKENS = 16
MAX_PREFIX_BLOCKS = 256
LRU_CAPACITY_PER_SERVER = 31250
CHARS_PER_TOKEN = 4
#: GIE's default profile weights (``config/loader/defaults.go``, the chart's ``default-plugins.yaml``)
DEFAULT_WEIGHTS = {"gie-queue-scorer": 2.0, "gie-kv-cache-utilization-scorer": 2.0,
                   "gie-prefix-cache-scorer": 3.0}


def prompt_bytes(prompt: str | None, token_ids: Sequence[int] | None) -> bytes:
    """What is cut into blocks: the text's UTF-8 bytes, or the token ids as little-endian uint32."""
    if token_ids is not None:
        return np.asarray(token_ids, dtype="<u4").tobytes()
    return (prompt or "").encode()


def hash_prompt(data: bytes, model: str, cache_salt: str | None, block_size_tokens: int,
                max_blocks: int) -> list[int]:
    """GIE's ``hashPrompt``: chained xxh64 of the full blocks of ``block_size_tokens × 4`` bytes (module
    doc)."""
    block = block_size_tokens * CHARS_PER_TOKEN
    if block <= 0 or len(data) < block:
        return []
    data = data[: max_blocks * block]
    prev = xxhash.xxh64_intdigest(model.encode() + (cache_salt or "").encode())
    out: list[int] = []
    for i in range(0, len(data) - block + 1, block):
        prev = xxhash.xxh64_intdigest(data[i : i + block] + prev.to_bytes(8, "little"))
        out.append(prev)
    return out


class LRUIndexer:
    """GIE's ``indexer``: block hash → servers that may hold it, bounded by one LRU of hashes per server."""

    def __init__(self, default_capacity: int = LRU_CAPACITY_PER_SERVER) -> None:
        self.default_capacity = default_capacity
        self.hash_to_pods: dict[int, set[str]] = {}
        self.pod_lru: dict[str, OrderedDict[int, None]] = {}
        self.capacity: dict[str, int] = {}

    def add(self, hashes: Sequence[int], pod: str, capacity: int = 0) -> None:
        """Touch ``hashes`` in ``pod``'s LRU (created with ``capacity`` at the pod's first add, the default
        when ≤ 0), evicting its least recently added hashes beyond it; then mark ``pod`` as a holder of
        each."""
        lru = self.pod_lru.get(pod)
        if lru is None:
            lru = self.pod_lru[pod] = OrderedDict()
            self.capacity[pod] = capacity if capacity > 0 else self.default_capacity
        size = self.capacity[pod]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            if len(lru) > size:
                old, _ = lru.popitem(last=False)
                self._evicted(old, pod)
        for h in hashes:  # as GIE: after the LRU, so a hash this very add evicted is still listed
            self.hash_to_pods.setdefault(h, set()).add(pod)

    def _evicted(self, h: int, pod: str) -> None:
        holders = self.hash_to_pods.get(h)
        if holders is not None:
            holders.discard(pod)
            if not holders:
                del self.hash_to_pods[h]

    def get(self, h: int) -> set[str]:
        return set(self.hash_to_pods.get(h, ()))

    def match_longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per server, the hashes it holds among the leading run of hashes some server holds."""
        out: dict[str, int] = {}
        for h in hashes:
            holders = self.hash_to_pods.get(h)
            if not holders:
                break
            for pod in holders:
                out[pod] = out.get(pod, 0) + 1
        return out

    def remove_pod(self, pod: str) -> None:
        lru = self.pod_lru.pop(pod, None)
        self.capacity.pop(pod, None)
        for h in lru or ():
            self._evicted(h, pod)


@dataclass(frozen=True)
class _PrefixState:
    """What GIE's PrepareRequestData computes once per request: the hashes and each server's match."""

    hashes: tuple[int, ...]
    matches: dict[str, int]
    block_size: int


@register("gie-prefix-cache-scorer", "scorer")
class GiePrefixCacheScorer:
    """GIE's approximate prefix-cache scorer: matched leading prompt blocks ÷ prompt blocks (0..1), from an
    LRU index of block hashes per pod that its own picks fill (``kvfleet.epp.scheduling.gie``). Params:
    ``block_size_tokens`` (16), ``max_prefix_blocks`` (256), ``max_prefix_tokens`` (0: off),
    ``lru_capacity_per_server`` (31250), ``auto_tune`` (1: block size and LRU size from the pods' metrics)."""

    def __init__(self, params: Mapping[str, float]) -> None:
        self.block_size_tokens = int(params.get("block_size_tokens", BLOCK_SIZE_TOKENS))
        self.max_prefix_blocks = int(params.get("max_prefix_blocks", MAX_PREFIX_BLOCKS))
        self.max_prefix_tokens = int(params.get("max_prefix_tokens", 0))
        self.lru_capacity = int(params.get("lru_capacity_per_server", LRU_CAPACITY_PER_SERVER))
        self.auto_tune = bool(params.get("auto_tune", 1.0))
        if (self.block_size_tokens <= 0 or self.max_prefix_blocks <= 0 or self.lru_capacity <= 0
                or self.max_prefix_tokens < 0):
            raise TypeError("block_size_tokens, max_prefix_blocks and lru_capacity_per_server must be > 0")
        self.indexer = LRUIndexer(self.lru_capacity)

    def block_size(self, cands: Sequence[Candidate]) -> int:
        """GIE's ``GetBlockSize``: the first candidate's scraped block size under autoTune, else the param."""
        first = column(cands, "metrics")[0] if self.auto_tune and cands else None
        if first is not None and (first.block_size or 0) > 0:
            return int(first.block_size or 0)
        return self.block_size_tokens

    def state(self, ctx: RequestContext, cands: Sequence[Candidate]) -> _PrefixState:
        st = ctx.state.get(self)
        if not isinstance(st, _PrefixState):
            bs = self.block_size(cands)
            max_blocks = (self.max_prefix_tokens // bs if self.max_prefix_tokens > 0
                          else self.max_prefix_blocks)
            data = prompt_bytes(ctx.prompt, ctx.prompt_token_ids)
            hashes = tuple(hash_prompt(data, ctx.model, ctx.cache_salt, bs, max_blocks))
            st = ctx.state[self] = _PrefixState(hashes, self.indexer.match_longest_prefix(hashes), bs)
        return st

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        ctx = current_request()
        if ctx is None:
            return [0.0] * len(cands)
        st = self.state(ctx, cands)
        if not st.hashes:
            return [0.0] * len(cands)
        return [st.matches.get(p.name, 0) / len(st.hashes) for p in column(cands, "pod")]

    def pre_request(self, req: SchedulingRequest, pick: Candidate) -> None:
        """Record the prompt's hashes on ``pick``; its predicted cached tokens are its matched blocks'
        tokens."""
        ctx = current_request()
        if ctx is None:
            return
        st = self.state(ctx, [pick])
        gpu_blocks = pick.metrics.num_gpu_blocks if self.auto_tune and pick.metrics is not None else None
        self.indexer.add(st.hashes, pick.name, gpu_blocks or 0)
        ctx.predicted_hit_tokens = min(req.num_tokens, st.matches.get(pick.name, 0) * st.block_size)


@register("gie-queue-scorer", "scorer")
class GieQueueScorer:
    """GIE's queue scorer: ``(max_w − w) / (max_w − min_w)`` over the candidates' scraped waiting requests
    (``vllm:num_requests_waiting``; 0 when stale), 1 for all when they are equal."""

    def __init__(self, params: Mapping[str, float]) -> None:
        pass

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        waiting = [pm.waiting if pm is not None else 0.0 for pm in column(cands, "metrics")]
        if not waiting:
            return []
        lo, hi = min(waiting), max(waiting)
        return [1.0 if hi == lo else (hi - w) / (hi - lo) for w in waiting]


@register("gie-kv-cache-utilization-scorer", "scorer")
class GieKVCacheUtilizationScorer:
    """GIE's KV-cache utilisation scorer: ``1 − vllm:kv_cache_usage_perc`` (1 when stale)."""

    def __init__(self, params: Mapping[str, float]) -> None:
        pass

    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> list[float]:
        return [1.0 - (pm.kv_usage if pm is not None else 0.0) for pm in column(cands, "metrics")]


@register("gie-max-score-picker", "picker")
class GieMaxScorePicker:
    """GIE's max-score picker: shuffle, then a stable sort by score (ties fall at random), the first
    ``max_num_of_endpoints`` (default 1: no fallbacks); ``seed`` (default 0) seeds the shuffle."""

    def __init__(self, params: Mapping[str, float]) -> None:
        n = int(params.get("max_num_of_endpoints", 1))
        self.max_endpoints = n if n > 0 else 1
        self._rng = random.Random(int(params.get("seed", 0)))

    def pick(self, req: SchedulingRequest, cands: Sequence[Candidate],
             scores: Sequence[float]) -> list[Candidate]:
        order = list(range(len(cands)))
        self._rng.shuffle(order)
        order.sort(key=lambda i: -scores[i])
        return [cands[i] for i in order[: self.max_endpoints]]


def default_profile() -> list[dict[str, object]]:
    """GIE's default scheduling profile as kvfleet ``epp.plugins`` entries (weights 2/2/3, max-score
    picker)."""
    return [
        {"type": "gie-queue-scorer", "weight": DEFAULT_WEIGHTS["gie-queue-scorer"]},
        {"type": "gie-kv-cache-utilization-scorer",
         "weight": DEFAULT_WEIGHTS["gie-kv-cache-utilization-scorer"]},
        {"type": "gie-prefix-cache-scorer", "weight": DEFAULT_WEIGHTS["gie-prefix-cache-scorer"]},
        {"type": "gie-max-score-picker"},
    ]
