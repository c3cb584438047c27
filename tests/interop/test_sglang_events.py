"""SGLang's own radix cache and KV-event publisher into kvfleet's EPP subscriber: the index holds what SGLang
holds.

tests/interop/sglang_publish.py runs in an SGLang venv: SGLang's ``RadixCache`` (its simulated constructor,
events on, page size 16) and the publisher ``EventPublisherFactory.create`` builds from the
``--kv-events-config`` the operator renders (ZMQ PUB and the replay ROUTER, topic ``kv-events``; only the
ports are free ones). What SGLang emits (one event per inserted node, its pages' position-aware SHA-256 chain
as int64 hashes, the parent link of the node's first page, coalesced batches, ``BlockRemoved`` per evicted
leaf) is indexed by kvfleet's :class:`EventSubscriber` and :class:`PodEventApplier` with recomputed keys, as
the EPP runs, for both pool hash algorithms.

SGLang 0.5.23 (``SGLANG_CHAINED_EVENTS`` and later): after every step (a first turn, a follow-up turn, a
decode page, a diverging prompt that splits a node, evictions of LRU leaves) each prompt's indexed prefix
equals SGLang's own ``match_prefix`` and the pod's entries equal the pages in SGLang's tree; nothing is an
orphan, nothing resyncs. An EPP that joins late replays instead of resyncing; a restarted SGLang is rebuilt
with no stale block.

SGLang 0.5.3 (before ``SGLANG_CHAINED_EVENTS``): its events hash a page by its tokens alone and give every
node's first page no parent, so a follow-up turn or the tail of a split node cannot be placed in its prompt.
The test pins what that costs (first turns only), which is why the operator publishes no KV events from those
images and the EPP routes their pods on its own picks (docs/operator.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cache.hashing import BlockHasher
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.subscriber import EventSubscriber
from kvfleet.operator.engines import SGLANG_CHAINED_EVENTS, SGLANG_TESTED
from tests.conftest import wait_for
from tests.interop.conftest import Driver, held, join, release, tokens

pytestmark = pytest.mark.timeout(600)  # each SGLang process imports torch: tens of seconds on a busy machine

PAGE = 16
POD = "sglang-0"
CHAINED = [".".join(map(str, v)) for v in SGLANG_TESTED if v >= SGLANG_CHAINED_EVENTS]
UNCHAINED = [".".join(map(str, v)) for v in SGLANG_TESTED if v < SGLANG_CHAINED_EVENTS]
ALGOS = ("sha256_cbor", "xxh3_64")


class SglangPublisher(Driver):
    """sglang_publish.py in an SGLang venv: SGLang's radix cache and publisher in one process."""

    def __init__(self, version: str, ports: tuple[int, int], tmp: Path) -> None:
        super().__init__("sglang", version, "sglang_publish.py", ports, tmp, {"SGLANG_LOG_LEVEL": "error"})
        self.cmd(op="start", config=self.config, page_size=PAGE)


@dataclass
class Epp:
    """One EPP view of the SGLang pod: the pool's hash algorithm, its index, the pod's name in it. Both
    algorithms subscribe to the same SGLang process (SGLang hashes the same way whatever the pool
    declares)."""

    algo: str
    idx: BlockIndex = field(default_factory=BlockIndex)

    @property
    def pod(self) -> str:
        return f"{POD}-{self.algo}"

    @property
    def hasher(self) -> BlockHasher:
        return BlockHasher(PAGE, self.algo)

    def held(self, prompt: list[int]) -> int:
        return held(self.idx, self.hasher, prompt, self.pod)

    def join(self, sub: EventSubscriber, ports: tuple[int, int]) -> None:
        join(sub, self.idx, self.hasher, ports, self.pod)


def _agrees(epps: list[Epp], pub: SglangPublisher, prompts: list[list[int]]) -> bool:
    """Every prompt's indexed prefix is SGLang's own match, and the pod's entries are SGLang's pages."""
    total = 0
    for p in prompts:
        answer: dict[str, Any] = pub.cmd(op="match", tokens=p)
        total = answer["total_pages"]
        if any(e.held(p) != answer["pages"] for e in epps):
            return False
    return all(e.idx.num_pod_keys(e.pod) == total for e in epps)


@pytest.mark.parametrize("version", CHAINED)
def test_turns_splits_decode_and_evictions_match_sglang(
    version: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path,
) -> None:
    epps = [Epp(a) for a in ALGOS]
    pub = SglangPublisher(version, ports, tmp_path)
    try:
        for e in epps:
            e.join(subscriber, ports)
        first = tokens(1, 4 * PAGE + 5)  # SGLang caches the page-aligned 4 pages
        follow = first[:4 * PAGE] + tokens(2, 3 * PAGE)  # the next turn: a child node of 3 pages
        decoded = follow + tokens(3, PAGE)  # one decode page
        # diverges after 2 pages: SGLang splits the first node
        branch = first[:2 * PAGE] + tokens(4, 2 * PAGE)
        prompts = [first, follow, decoded, branch]
        expected = [4, 7, 8, 4]
        for i, p in enumerate(prompts):
            assert pub.cmd(op="insert", tokens=p)["events"] >= 1
            wait_for(lambda p=p, n=expected[i]: all(e.held(p) == n for e in epps),  # type: ignore[misc]
                     f"prompt {i}: {expected[i]} blocks indexed")
            wait_for(lambda: _agrees(epps, pub, prompts), f"the index agreeing with SGLang after prompt {i}")
        assert all(e.idx.num_pod_keys(e.pod) == 10 for e in epps)
        for n in (PAGE, 3 * PAGE, 100 * PAGE):  # LRU leaves, then everything
            pub.cmd(op="evict", tokens=n)
            wait_for(lambda: _agrees(epps, pub, prompts),
                     f"the index agreeing with SGLang after evicting {n} tokens")
        assert all(e.idx.num_pod_keys(e.pod) == 0 for e in epps)
        for e in epps:
            stats = subscriber.stats[e.pod]
            assert stats.resyncs == 0 and stats.restarts == 0 and stats.rejected == 0, stats
            assert (stats.ingest.orphans == 0 and stats.ingest.stored == 10
                    and stats.ingest.unknown_medium == 0), stats.ingest
    finally:
        pub.close()


@pytest.mark.parametrize("version", CHAINED)
def test_late_epp_replays_and_restart_rebuilds(
    version: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path,
) -> None:
    epps = [Epp(a) for a in ALGOS]
    pub = SglangPublisher(version, ports, tmp_path)
    old = [tokens(10 + i, 2 * PAGE) for i in range(3)]
    try:
        for prompt in old:  # cached before any EPP listens
            pub.cmd(op="insert", tokens=prompt)
        for e in epps:
            e.join(subscriber, ports)
        wait_for(lambda: all(e.held(t) == 2 for t in old for e in epps),
                 "the history, from SGLang's replay endpoint")
        for e in epps:
            stats = subscriber.stats[e.pod]
            assert e.idx.num_pod_keys(e.pod) == 6 and stats.resyncs == 0 and stats.replayed >= 3, stats
    finally:
        pub.close()
    # SGLang restarts: a new process on the same ports, sequence numbers from 0, an empty tree
    pub = SglangPublisher(version, ports, tmp_path)
    try:
        fresh = [tokens(99 + k, 3 * PAGE) for k in range(200)]
        k = 0

        def rebuilt() -> bool:  # new prompts until the reconnected SUBs see one (slow joiner)
            nonlocal k
            if all(e.held(fresh[0]) == 3 for e in epps):
                return True
            if k == len(fresh):
                pytest.fail(f"restart not rebuilt after {k} prompts: {subscriber.stats}")
            pub.cmd(op="insert", tokens=fresh[k])
            k += 1
            raise AssertionError(f"not rebuilt yet: {subscriber.stats}")

        wait_for(rebuilt, "the restarted SGLang's pages indexed", timeout_s=20, interval_s=0.3)
        wait_for(lambda: _agrees(epps, pub, old + fresh[:k]), "the index equal to the new SGLang's tree")
        for e in epps:
            assert all(e.held(t) == 0 for t in old)
            assert subscriber.stats[e.pod].restarts + subscriber.stats[e.pod].resyncs >= 1
    finally:
        pub.close()


@pytest.mark.parametrize("version", UNCHAINED)
def test_unchained_events_lose_follow_up_turns(
    version: str, ports: tuple[int, int], subscriber: EventSubscriber, tmp_path: Path,
) -> None:
    """What SGLang before SGLANG_CHAINED_EVENTS publishes: a first turn is indexed, a follow-up turn (a child
    node whose first page has no parent in the event) and the tail of a split node are not: the operator
    publishes no KV events from these images."""
    assert release(version) < SGLANG_CHAINED_EVENTS
    idx, hasher = BlockIndex(), BlockHasher(PAGE, "sha256_cbor")
    pub = SglangPublisher(version, ports, tmp_path)
    try:
        join(subscriber, idx, hasher, ports, POD)
        first = tokens(1, 4 * PAGE)
        pub.cmd(op="insert", tokens=first)
        wait_for(lambda: held(idx, hasher, first, POD) == 4, "the first turn")
        follow = first + tokens(2, 3 * PAGE)
        pub.cmd(op="insert", tokens=follow)
        assert pub.cmd(op="match", tokens=follow)["pages"] == 7  # SGLang holds the whole second turn
        wait_for(lambda: subscriber.stats[POD].ingest.stored >= 7, "the second turn's events")
        assert held(idx, hasher, follow, POD) == 4  # its three new pages were keyed as a prompt of their own
        branch = first[:2 * PAGE] + tokens(4, 2 * PAGE)
        # splits the first node: its 4 pages removed, 2 + 2 stored again, 2 new ones
        pub.cmd(op="insert", tokens=branch)
        wait_for(lambda: (subscriber.stats[POD].ingest.removed >= 4
                          and subscriber.stats[POD].ingest.stored >= 13), "the split's events")
        assert (pub.cmd(op="match", tokens=first)["pages"] == 4
                and pub.cmd(op="match", tokens=branch)["pages"] == 4)
        # both tails stored parentless
        assert held(idx, hasher, first, POD) == 2 and held(idx, hasher, branch, POD) == 2
    finally:
        pub.close()
