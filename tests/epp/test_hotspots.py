"""Hot-spot mechanisms, pinned on the router: a hot-prefix storm spreads once the holder's queue costs
more than a miss elsewhere, a session's own history is not damped by other sessions of its application,
and a document's readers wait for its first prefill rather than recompute it."""

from __future__ import annotations

import math
from typing import Any

from kvfleet.config import load
from kvfleet.epp import inflight
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import InferenceRequest
from kvfleet.epp.router import Router
from kvfleet.epp.tokenize import load_tokenizer
from tests.epp.test_scheduling import pools

#: byte-level tokens: one block = 16 bytes; the default cost model prefills 10,000 tokens/s
T_TOK = 1e-4
OVERHEAD_S = 0.01


def router(n: int, beta: float = 0.1, tracker: InflightTracker | None = None) -> Router:
    plugins: list[dict[str, Any]] = [
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer", "params": {"running_s": 0.0, "overhead_s": OVERHEAD_S}},
        {"type": "max-score-picker", "params": {"fallbacks": 0}},
    ]
    s = load(overrides={"epp": {"plugins": plugins, "hotspot_beta": beta}})
    return Router(s.epp, s.cache, StaticDatastore(data=pools(n)), BlockIndex(), MetricsStore(),
                  load_tokenizer("bytes"), tracker)


def text(tag: str, blocks: int) -> str:
    """``blocks`` full 16-byte blocks of text no other tag shares."""
    unit = f"<{tag}>".ljust(16, ".")[:16]
    return unit * blocks


class TestStorm:
    def test_spreads_once_the_holders_queue_costs_more_than_a_miss(self) -> None:
        """One pod holds a 64-block prefix; a burst of requests sharing it (each with 10 blocks of its own)
        arrives before any first token. The holder takes them while its queue costs less than the prefix's
        prefill (what a miss on an idle pod costs on top), then the burst spreads. Decay off: the load term
        alone. (With the load gain on the holder too, its own growing queue raised the candidates' mean
        queue and with it its own hit value, and all 30 piled onto it.)"""
        r = router(4, beta=0.0)
        prefix = text("storm", 64)
        holder = "p0-2"
        r.index.add(holder, r.keys_of(r.tokenizer.encode(prefix), None))
        picks = []
        for i in range(30):
            d = r.route(InferenceRequest(model="m", prompt=prefix + text(f"q{i}", 10)))
            picks.append(d.pod)  # no first token yet: every request is still queued
        prefix_s = 64 * 16 * T_TOK
        per_request_s = 10 * 16 * T_TOK + OVERHEAD_S
        bound = math.ceil(prefix_s / per_request_s) + 1
        first_away = next(i for i, p in enumerate(picks) if p != holder)
        assert picks[:first_away] == [holder] * first_away and 1 < first_away <= bound, picks
        # each copy's pod becomes a holder in turn: the burst ends up spread over every pod
        assert len(set(picks)) == 4 and max(picks.count(p) for p in set(picks)) <= 30 / 4 + bound, picks


class TestSessions:
    def test_own_history_wins_over_a_busy_shard(self) -> None:
        """Both pods hold the application's 20-block system prompt; pod A also holds this session's
        history (20 more blocks) and decodes 40 requests of other sessions of the application (same prefix
        shard). The session's next turn goes to A: requests of other sessions, past their first token and
        holding other prefixes, do not damp its own hit. (Counted per shard until the stream's end they
        did: 40 blocks / (1 + 0.1·40) < 20 blocks on the idle pod.)"""
        r = router(2)
        a, b = "p0-0", "p0-1"
        system = text("system", 20)
        session = system + text("history", 20)
        r.index.add(a, r.keys_of(r.tokenizer.encode(session), None))
        r.index.add(b, r.keys_of(r.tokenizer.encode(system), None))
        for i in range(40):
            d = r.route(InferenceRequest(model="m", prompt=system + text(f"other{i}", 2)),
                        subset=["10.0.0.1:8000"])
            assert d.pod == a and d.ticket is not None
            d.ticket.first_byte()  # decoding: in flight until its stream ends
        assert r.tracker.load(a)[0] == 40
        d = r.route(InferenceRequest(model="m", prompt=session + text("next", 2)))
        assert d.pod == a and d.predicted_hit_tokens == 40 * 16


class TestDocument:
    def picks(self, gap_s: float) -> list[str]:
        """A 100-block document, then 8 readers (each with 2 blocks of its own) ``gap_s`` apart, none
        answered yet."""
        now = [0.0]
        r = router(4, tracker=InflightTracker(clock=lambda: now[0]))
        doc = text("doc", 100)
        out = [r.route(InferenceRequest(model="m", prompt=doc + text("q0", 2))).pod]
        for i in range(1, 9):
            now[0] += gap_s
            out.append(r.route(InferenceRequest(model="m", prompt=doc + text(f"q{i}", 2))).pod)
        return out

    def test_readers_wait_for_a_document_still_being_computed(self) -> None:
        """Readers every 30 ms, each bringing its own 2 blocks and an engine step (about 20 ms of work
        with what the sampled speculative entries leave uncached): they come slower than the holder
        serves them, and its queue (the document's first prefill, 0.16 s, less the time spent on it)
        stays below what recomputing the document costs. They all wait for it there.
        With their count damping the hit (β 0.1), every other reader from the second on recomputed the
        document on an idle pod."""
        picks = self.picks(0.03)
        assert picks == [picks[0]] * 9, picks


class TestPopularity:
    def test_a_prefix_s_popularity_run(self) -> None:
        """:meth:`InflightTracker.popularity`: the hot key's requests per second since the first of its run
        and the run's age; a gap longer than ``history_s`` starts a new run; the least recently seen keys
        are forgotten past ``POPULARITY_KEYS``."""
        now = [0.0]
        t = InflightTracker(clock=lambda: now[0], history_s=10.0)
        assert t.popularity(7) == (0.0, 0.0)
        for _ in range(5):
            t.open(("a",), 7, 10.0)
            now[0] += 1.0
        rate, age = t.popularity(7)
        assert (rate, age) == (1.0, 5.0)
        now[0] += 11.0  # silent longer than the history: no run
        assert t.popularity(7) == (0.0, 0.0)
        t.open(("a",), 7, 10.0)
        now[0] += 2.0
        assert t.popularity(7) == (0.5, 2.0)

    def test_popularity_is_bounded(self, monkeypatch: Any) -> None:
        monkeypatch.setattr(inflight, "POPULARITY_KEYS", 4)
        t = InflightTracker()
        for key in range(10):
            t.open(("a",), key, 1.0)
        assert len(t._pop) == 4
        assert t.popularity(0) == (0.0, 0.0) and t.popularity(9)[0] > 0.0
