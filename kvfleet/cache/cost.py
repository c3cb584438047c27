"""The cost rule of kvfleet, in one place (seed chapter 2.3): when a cached block pays for itself.

Every part that weighs a cached block against recomputing it uses these functions: the agent's tier manager
(:mod:`kvfleet.agent.tiers.cost`: promote a slow-tier hit or not), the engine simulator (the same rule for its
own tiers), the EPP's scorers (:func:`kvfleet.epp.scheduling.candidates.tier_weights`: what a hit in a slow
tier is worth) and the routing simulation (``bench/routing.py``)::

    prefill  = tokens / prefill_tokens_per_s
    read     = latency(slow) + bytes / read_bandwidth(slow)
    write    = latency(fast) + bytes / write_bandwidth(fast)

    prefill > read + write   → PROMOTE          (read it, keep it in the fast tier)
    prefill > read           → SERVE_IN_PLACE   (read it, leave it where it is)
    otherwise                → RECOMPUTE        (cheaper to prefill again: a miss)

    value of a hit = max(0, 1 − read / prefill)  (the share of the prefill a hit saves)

The model defaults (one 8B model in fp16 on one GPU) are the single source for every settings class that
needs them.
"""

from __future__ import annotations

from enum import StrEnum

#: Prefill throughput of the default model profile (tokens/s): the one default every settings class uses.
DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
#: KV bytes per token of the default model: 2 (K,V) × 32 layers × 8 KV heads × 128 × 2 bytes (Llama-3-8B,
#: fp16).
DEFAULT_KV_BYTES_PER_TOKEN = 131_072


class Action(StrEnum):
    PROMOTE = "promote"
    SERVE_IN_PLACE = "serve_in_place"
    RECOMPUTE = "recompute"


def prefill_s(tokens: float, prefill_tokens_per_s: float) -> float:
    """Seconds to recompute ``tokens`` of KV."""
    return tokens / prefill_tokens_per_s


def move_s(nbytes: float, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """Seconds to read or write ``nbytes`` at ``bytes_per_s`` after ``latency_s``."""
    return latency_s + nbytes / bytes_per_s


def promotion(prefill: float, read: float, write: float) -> Action:
    """The seeds' inequality: promote a slow-tier hit iff recomputing costs more than reading it and writing
    it into the fast tier; serve it in place iff it costs more than reading it; else recompute."""
    if prefill > read + write:
        return Action.PROMOTE
    if prefill > read:
        return Action.SERVE_IN_PLACE
    return Action.RECOMPUTE


def hit_value(prefill: float, read: float) -> float:
    """What a hit is worth, as the share of its recompute it saves after its read cost (0 when reading costs
    as much as recomputing)."""
    return max(0.0, 1.0 - read / prefill) if prefill > 0 else 0.0
