"""Run by a vLLM interop venv's interpreter: vLLM's own KV-event publisher, driven line by line from stdin.

Commands, one JSON object a line (each answered with one ``OK {...}`` line on stdout):

* ``{"op": "start", "config": {...}, "hash": "sha256_cbor", "block_size": 16}``: vLLM's
  ``EventPublisherFactory.create(KVEventsConfig(**config))`` — the publisher a vLLM engine builds from
  ``--kv-events-config`` — and vLLM's block hashing (``hash_block_tokens`` with ``hash``, from
  ``init_none_hash``), as its KV cache manager does;
* ``{"op": "store", "tokens": [...], "cached": N, "medium": "GPU"}``: the full blocks of ``tokens`` after
  the first ``cached`` tokens (a follow-up turn, a decode block) as one ``BlockStored`` whose
  ``parent_block_hash`` is the hash of the block before them, in a ``KVEventBatch``;
* ``{"op": "remove", "tokens": [...], "blocks": K}``: ``BlockRemoved`` of the last K full blocks;
* ``{"op": "clear"}``: ``AllBlocksCleared``; ``{"op": "exit"}``: ``shutdown()``.

Nothing of kvfleet is imported here.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> int:
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventPublisherFactory,
        KVEventBatch,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    publisher: Any = None
    hash_fn: Any = None
    block_size = 16

    def chain(tokens: list[int]) -> list[bytes]:
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
            parent = kcu.hash_block_tokens(hash_fn, parent, tokens[start:start + block_size])
            hashes.append(parent)
        return hashes

    def ext(h: bytes) -> Any:
        return kcu.maybe_convert_block_hash(h)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, Any] = {}
        if op == "start":
            block_size = int(cmd["block_size"])
            hash_fn = get_hash_fn_by_name(cmd["hash"])
            kcu.init_none_hash(hash_fn)
            publisher = EventPublisherFactory.create(KVEventsConfig(**cmd["config"]), data_parallel_rank=0)
        elif op == "store":
            tokens, cached = list(cmd["tokens"]), int(cmd.get("cached", 0))
            hashes = chain(tokens)
            first = cached // block_size
            new = hashes[first:]
            event = BlockStored(block_hashes=[ext(h) for h in new],
                                parent_block_hash=ext(hashes[first - 1]) if first else None,
                                token_ids=tokens[first * block_size:len(hashes) * block_size],
                                block_size=block_size, lora_id=None,
                                medium=cmd.get("medium", "GPU"), lora_name=None)
            publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
            out["blocks"] = len(new)
        elif op == "remove":
            hashes = chain(list(cmd["tokens"]))[-int(cmd["blocks"]):]
            publisher.publish(KVEventBatch(ts=time.time(), events=[
                BlockRemoved(block_hashes=[ext(h) for h in hashes], medium="GPU")]))
        elif op == "clear":
            publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        elif op == "exit":
            publisher.shutdown()
            print("OK {}", flush=True)
            return 0
        print("OK " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
