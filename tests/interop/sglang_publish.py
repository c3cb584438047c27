"""Run by an SGLang interop venv's interpreter: SGLang's own radix cache and KV-event publisher, driven from
stdin.

SGLang's scheduler publishes KV events by taking the radix cache's queued events after each step and
publishing them as one ``KVEventBatch`` through the publisher that ``EventPublisherFactory.create`` built from
``--kv-events-config`` (``SchedulerKvEventsPublisher.publish_kv_events`` in 0.5.23,
``Scheduler._publish_kv_events`` in 0.5.3). This script does the same with SGLang's real ``RadixCache`` (the
CPU-only simulated constructor SGLang's own tests use, events enabled, the pool's page size) and SGLang's real
publisher: the events, their hashes, their parents, their coalescing and their framing are SGLang's.

Commands, one JSON object a line (each answered with one ``OK {...}`` line on stdout):

* ``{"op": "start", "config": {...}, "page_size": 16}``: the publisher (``json.dumps(config)``, as the flag
  carries it) and an empty radix cache;
* ``{"op": "insert", "tokens": [...]}``: what the scheduler does when a request's KV is cached (the
  page-aligned key inserted; a follow-up turn or a decode step inserts a longer key, a diverging prompt splits
  a node), then one publish step; answers ``{"events": N}``;
* ``{"op": "match", "tokens": [...]}``: SGLang's own ``match_prefix``: how many leading full pages the cache
  holds (answers ``{"pages": N, "total_pages": M}``, ``M`` = every page in the tree);
* ``{"op": "evict", "tokens": N}``: ``evict`` of at least ``N`` tokens (LRU leaves), then one publish step;
* ``{"op": "clear"}``: ``reset()`` (``AllBlocksCleared``) and a publish step; ``{"op": "exit"}``:
  ``shutdown()``.

Nothing of kvfleet is imported here.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


class _Allocator:
    """The token-to-KV-pool allocator the radix cache frees evicted slots to: nothing to free here."""

    device = "cpu"

    def free(self, *_: Any, **__: Any) -> None:
        return None

    def free_segment(self, *_: Any, **__: Any) -> None:
        return None


def main() -> int:
    import sglang.srt.mem_cache.base_prefix_cache as base
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    params = hasattr(base, "InsertParams")  # 0.5.2x: Params dataclasses; 0.5.3: positional arguments
    publisher: Any = None
    tree: Any = None
    page = 1

    def step() -> int:
        events = tree.take_events()
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return len(events)

    def make_tree(page_size: int) -> Any:
        if hasattr(RadixCache, "create_simulated"):
            return RadixCache.create_simulated(page_size=page_size, enable_kv_cache_events=True,
                                               mock_allocator=_Allocator())
        return RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=_Allocator(),
                          page_size=page_size, enable_kv_cache_events=True)

    def pages(tokens: list[int]) -> int:
        key = RadixKey(list(tokens))
        if params:
            m = tree.match_prefix(base.MatchPrefixParams(key=key))
            n = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
        else:
            n = len(tree.match_prefix(key).device_indices)
        return int(n) // page

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, Any] = {}
        if op == "start":
            page = int(cmd["page_size"])
            publisher = EventPublisherFactory.create(json.dumps(cmd["config"]), 0)
            tree = make_tree(page)
        elif op == "insert":
            tokens = list(cmd["tokens"])
            if params:
                tree.insert(base.InsertParams(key=RadixKey(tokens)))
            else:
                tree.insert(RadixKey(tokens[: len(tokens) // page * page]))
            out["events"] = step()
        elif op == "match":
            out["pages"] = pages(list(cmd["tokens"]))
            out["total_pages"] = int(tree.total_size()) // page
        elif op == "evict":
            if params:
                tree.evict(base.EvictParams(num_tokens=int(cmd["tokens"])))
            else:
                tree.evict(int(cmd["tokens"]))
            out["events"] = step()
            out["total_pages"] = int(tree.total_size()) // page
        elif op == "clear":
            tree.reset()
            out["events"] = step()
        elif op == "exit":
            publisher.shutdown()
            print("OK {}", flush=True)
            return 0
        print("OK " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
