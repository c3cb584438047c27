"""Run in a vLLM release's venv: the prefix-cache hits vLLM's own KV cache manager gives a sequence of
requests served one after another, with a cache of a given number of blocks.

Reads a JSON file ``{"capacity": C, "block_size": B, "requests": [[block id, ...], ...]}``: each request's
prompt is its blocks, a block ``B`` tokens of its id (vLLM's block hashing chains them, so a block's hash
is its whole prefix's). Each request goes through ``KVCacheManager.get_computed_blocks`` (the hit),
``allocate_slots`` (evicting what the pool gives up) and ``free`` (as a finished request), on a manager of
``C`` cacheable blocks (plus vLLM's null block). Prints ``RESULT [hit blocks, ...]``.

Nothing of kvfleet is imported here.
"""

from __future__ import annotations

import inspect
import json
import sys


def main() -> None:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # releases before the module was split out
        from vllm.utils import get_hash_fn_by_name

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    bs, capacity = int(spec["block_size"]), int(spec["capacity"])
    attention = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=capacity + 1, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], attention)])
    sizes = {k: bs for k in ("scheduler_block_size", "hash_block_size")
             if k in inspect.signature(KVCacheManager).parameters}  # later releases take them
    manager = KVCacheManager(config, max_model_len=1 << 20, enable_caching=True, **sizes)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(bs, hash_fn)
    hits = []
    for i, blocks in enumerate(spec["requests"]):
        tokens = [b for b in blocks for _ in range(bs)]
        req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1), None, None, block_hasher=hasher)
        computed, n = manager.get_computed_blocks(req)[:2]
        if manager.allocate_slots(req, len(tokens) - n, n, computed) is None:
            raise SystemExit(f"request {i}: no room for {len(blocks)} blocks in {capacity}")
        manager.free(req)
        hits.append(n // bs)
    print("RESULT " + json.dumps(hits), flush=True)


if __name__ == "__main__":
    main()
