"""The picker's own accounting of requests it routed: in flight per pod and per prefix, pending prefill work.

A :class:`Ticket` is opened at the pick; :meth:`Ticket.first_byte` (response
headers came back: the prefill is done) removes its predicted uncached tokens
from the pod's pending work and its count from the hot-spot counter
(:meth:`InflightTracker.same_prefix`: requests of one prefix still waiting for
their first token on a pod); :meth:`Ticket.close` (stream end) removes it from
the in-flight counts. Both are idempotent. Tickets older than ``max_age_s``
are reaped so a lost stream cannot pin a pod as busy.

The hot-spot counter counts a request only until its first token: a request
that is decoding no longer competes for the pod's prefill, so it must not damp
the hit of the next request of its prefix (counting until stream end let dozens
of decoding requests of one application outweigh a session's own history;
``hot_until_close=True`` keeps that former behaviour for comparisons).

:meth:`InflightTracker.pending_at` answers "how many of my requests were still
waiting for their first token on this pod at time ``t``" (the instant a metrics
scrape read the engine's ``waiting`` gauge), from the pending tickets and the
first-token times of the last ``history_s`` seconds. Only that many of the
scraped waiting requests are the picker's own: comparing the gauge with the
pending count *now* instead counted every request whose first token came back
since the scrape as someone else's queued request (a phantom queue).

Peers' tickets: with several EPP replicas behind one gateway each replica routes a share of the requests,
so its own tickets are a share of each pod's load. :attr:`InflightTracker.on_ticket` reports every change
of a local ticket (``open``, ``first``, ``close``, ``move``; :mod:`kvfleet.epp.gossip` publishes them) and
:meth:`InflightTracker.remote` applies a peer's, keyed by (peer, ticket id): a peer's ticket counts in the
in-flight, pending and hot-spot figures exactly as a local one (its start is the time it arrived). At most
``max_remote`` of them are held (beyond: refused and counted by the caller); a silent peer's are dropped
with :meth:`InflightTracker.forget_origin`; a lost close is reaped at ``max_age_s`` like a local one.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

TicketEvent = Literal["open", "first", "close", "move"]


@dataclass
class _Load:
    inflight: int = 0
    pending_tokens: float = 0.0
    pending_requests: int = 0
    #: busy seconds and first tokens, each decayed with time constant ``history_s`` (:meth:`_fold`), and
    #: the instant they were last folded
    busy_s: float = 0.0
    served: float = 0.0
    mark: float = 0.0


class _Run:
    """One prefix's current run on one pod: its requests still waiting there for their first token
    (``count``), when the first of the run was opened (``since``: the run ends when ``count`` drops to
    0), and the requests of the run opened so far (``opened``) with their predicted uncached tokens
    (``tokens``)."""

    __slots__ = ("count", "opened", "since", "tokens")

    def __init__(self, since: float) -> None:
        self.count, self.since, self.opened, self.tokens = 0, since, 0, 0.0

    def rates(self, now: float) -> tuple[float, float]:
        """(requests, predicted uncached tokens) per second the prefix brought to the pod during the run
        (a run younger than 1 ms counts as 1 ms old)."""
        age = max(1e-3, now - self.since)
        return self.opened / age, self.tokens / age


class Ticket:
    """One routed request; ``on_first_byte`` runs once when its first token comes back."""

    def __init__(
        self, tracker: InflightTracker, tid: int, pods: tuple[str, ...], prefix: int, tokens: float,
        on_first_byte: Callable[[], None] | None = None, origin: str | None = None,
    ) -> None:
        self.tracker, self.id, self.pods, self.prefix, self.tokens = tracker, tid, pods, prefix, tokens
        self.on_first_byte = on_first_byte
        #: the peer replica that opened it (``None``: this replica)
        self.origin = origin
        self.key: Hashable = tid if origin is None else (origin, tid)
        self.started = tracker.clock()
        self.pending = True
        self.open = True
        #: counted in the tracker's hot-spot counter under ``prefix``
        self.hot = True

    def first_byte(self) -> None:
        self.tracker._first_byte(self)

    def close(self) -> None:
        self.tracker._close(self)


class PodView(NamedTuple):
    """One pod as a pick sees it (:meth:`InflightTracker.view`)."""

    inflight: int
    pending_tokens: float
    pending_requests: int
    same_prefix: int
    pending_elapsed_s: float
    expected_wait_s: float
    scrape_pending: int | None
    #: the share of the last ``history_s`` (decayed) the pod had a request of the picker waiting for its
    #: first token (:meth:`InflightTracker.view`)
    busy_share: float = 0.0
    #: the hot prefix's requests and predicted uncached tokens per second on the pod over its current run
    #: (:meth:`_Run.rates`; 0 when none of it waits there): the followers' load on the pod
    prefix_arrivals: float = 0.0
    prefix_rate: float = 0.0


#: hot keys whose popularity runs the tracker keeps, the least recently seen forgotten first (≈ 250 B each:
#: at most ≈ 4 MB); a key away longer than ``history_s`` has no run to keep anyway
POPULARITY_KEYS = 16_384


class InflightTracker:
    def __init__(
        self, max_age_s: float = 600.0, clock: Callable[[], float] = time.monotonic, history_s: float = 10.0,
        hot_until_close: bool = False, max_remote: int = 100_000,
    ) -> None:
        self.clock = clock
        self.max_remote = max_remote
        #: called (outside the lock) after each change of a local ticket: ``(event, ticket, moved)`` with
        #: ``moved`` the (old, new) pods of a ``move``
        self.on_ticket: Callable[[TicketEvent, Ticket, tuple[str, str] | None], None] | None = None
        self.hot_until_close = hot_until_close
        self.max_age_s = max_age_s
        self.history_s = history_s
        #: per pod: (opened, first token) of tickets whose first token came back in the last ``history_s``
        self._recent: dict[str, deque[tuple[float, float]]] = defaultdict(deque)
        self._loads: dict[str, _Load] = defaultdict(_Load)
        #: per pod: its tickets still waiting for their first token (what :meth:`pending_at` counts)
        self._pending: dict[str, dict[Hashable, Ticket]] = defaultdict(dict)
        #: per pod: when the last of the picker's requests there got its first token
        self._last_first: dict[str, float] = {}
        #: per (pod, prefix): the prefix's current run there (:class:`_Run`), while one of it waits
        self._prefix: dict[tuple[str, int], _Run] = {}
        self._tickets: dict[Hashable, Ticket] = {}
        #: per hot key: [first request of its current popularity run, last request, requests in the run]
        self._pop: dict[int, list[float]] = {}
        self._remote: dict[str, set[int]] = defaultdict(set)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(
        self, pods: tuple[str, ...], prefix: int, predicted_uncached_tokens: float,
        on_first_byte: Callable[[], None] | None = None
    ) -> Ticket:
        t = Ticket(self, next(self._ids), pods, prefix, predicted_uncached_tokens, on_first_byte)
        with self._lock:
            self._add(t)
        self._emit("open", t)
        return t

    def _decayed(self, load: _Load, now: float) -> tuple[float, float]:
        """The pod's decayed busy seconds and first tokens at ``now`` (busy: a request of the picker waits
        there for its first token), from their values at ``load.mark``."""
        keep = math.exp(-max(0.0, now - load.mark) / self.history_s)
        busy = self.history_s * (1.0 - keep) if load.pending_requests else 0.0
        return load.busy_s * keep + busy, load.served * keep

    def _fold(self, load: _Load, now: float) -> None:
        """Brings the pod's decayed figures up to ``now``; the caller then changes ``pending_requests``."""
        if now > load.mark:
            load.busy_s, load.served = self._decayed(load, now)
            load.mark = now

    def _add(self, t: Ticket) -> None:
        self._tickets[t.key] = t
        now = self.clock()
        pop = self._pop.pop(t.prefix, None)
        if pop is None or now - pop[1] > self.history_s:
            pop = [now, now, 0.0]
            if len(self._pop) >= POPULARITY_KEYS:
                del self._pop[next(iter(self._pop))]
        pop[1] = now
        pop[2] += 1.0
        self._pop[t.prefix] = pop
        for pod in t.pods:
            load = self._loads[pod]
            self._fold(load, now)
            load.inflight += 1
            load.pending_tokens += t.tokens
            load.pending_requests += 1
            self._pending[pod][t.key] = t
            self._count(pod, t, now)

    def _emit(self, event: TicketEvent, t: Ticket, moved: tuple[str, str] | None = None) -> None:
        if t.origin is None and self.on_ticket is not None:
            self.on_ticket(event, t, moved)

    def _first_byte(self, t: Ticket) -> None:
        with self._lock:
            if not t.pending:
                return
            t.pending = False
            now = self.clock()
            for pod in t.pods:
                load = self._loads[pod]
                self._fold(load, now)
                load.served += 1.0
                load.pending_tokens = max(0.0, load.pending_tokens - t.tokens)
                load.pending_requests = max(0, load.pending_requests - 1)
                self._pending[pod].pop(t.key, None)
                self._last_first[pod] = now
                recent = self._recent[pod]
                recent.append((t.started, now))
                while recent and recent[0][1] < now - self.history_s:
                    recent.popleft()
            if not self.hot_until_close:
                self._cool(t)
        if t.on_first_byte is not None:
            t.on_first_byte()
        self._emit("first", t)

    def _close(self, t: Ticket) -> None:
        self._first_byte(t)
        with self._lock:
            if not t.open:
                return
            t.open = False
            self._tickets.pop(t.key, None)
            mine = self._remote.get(t.origin) if t.origin is not None else None
            if mine is not None:  # not recreated for a forgotten peer
                mine.discard(t.id)
            for pod in t.pods:
                self._loads[pod].inflight = max(0, self._loads[pod].inflight - 1)
            self._cool(t)
        self._emit("close", t)

    def _cool(self, t: Ticket) -> None:
        """Takes ``t`` out of the hot-spot counter (idempotent; the caller holds the lock)."""
        if not t.hot:
            return
        t.hot = False
        for pod in t.pods:
            self._uncount(pod, t.prefix)

    def _count(self, pod: str, t: Ticket, now: float) -> None:
        """Counts ``t`` in its prefix's run on ``pod`` (a run starts with its first request)."""
        run = self._prefix.get((pod, t.prefix))
        if run is None:
            run = self._prefix[(pod, t.prefix)] = _Run(now)
        run.count += 1
        run.opened += 1
        run.tokens += t.tokens

    def _uncount(self, pod: str, prefix: int) -> None:
        key = (pod, prefix)
        run = self._prefix.get(key)
        if run is not None:
            run.count -= 1
            if run.count <= 0:
                del self._prefix[key]

    def move(self, t: Ticket, old: str, new: str) -> None:
        """The request of ``t`` is served by ``new`` instead of ``old`` (the gateway used a fallback)."""
        with self._lock:
            if old not in t.pods or new in t.pods:
                return
            self._move(t, old, new)
        self._emit("move", t, (old, new))

    def _move(self, t: Ticket, old: str, new: str) -> None:
        t.pods = tuple(new if p == old else p for p in t.pods)
        src, dst = self._loads[old], self._loads[new]
        if t.open:
            src.inflight = max(0, src.inflight - 1)
            dst.inflight += 1
        if t.hot:
            self._uncount(old, t.prefix)
            self._count(new, t, self.clock())
        if t.pending:
            now = self.clock()
            self._fold(src, now)
            self._fold(dst, now)
            src.pending_tokens = max(0.0, src.pending_tokens - t.tokens)
            src.pending_requests = max(0, src.pending_requests - 1)
            dst.pending_tokens += t.tokens
            dst.pending_requests += 1
            self._pending[old].pop(t.key, None)
            self._pending[new][t.key] = t

    # --- peers' tickets ------------------------------------------------------------------
    def remote(
        self, origin: str, event: TicketEvent, tid: int, pods: tuple[str, ...] = (), prefix: int = 0,
        tokens: float = 0.0,
    ) -> bool:
        """Apply a change of peer ``origin``'s ticket ``tid`` (``pods`` is the ticket's pods for ``open``, the
        (old, new) pair for ``move``). False when refused: over ``max_remote``, or a repeated ``open``;
        a change of a ticket this tracker does not hold (lost open, already closed) is ignored."""
        if event == "open":
            with self._lock:
                if len(self._remote[origin]) >= self.max_remote or (origin, tid) in self._tickets:
                    return False
                self._remote[origin].add(tid)
                self._add(Ticket(self, tid, pods, prefix, tokens, origin=origin))
            return True
        t = self._tickets.get((origin, tid))
        if t is None:
            return True
        if event == "first":
            t.first_byte()
        elif event == "close":
            t.close()
        elif len(pods) == 2:
            with self._lock:
                if pods[0] in t.pods and pods[1] not in t.pods:
                    self._move(t, pods[0], pods[1])
        return True

    def remote_ticket(self, origin: str, tid: int) -> Ticket | None:
        """Peer ``origin``'s ticket ``tid``, while this tracker holds it."""
        return self._tickets.get((origin, tid))

    def when_first_byte(self, t: Ticket, fn: Callable[[], None]) -> bool:
        """Run ``fn`` at ``t``'s first token, after what already runs then; False (``fn`` not kept) when it
        has come already."""
        with self._lock:
            if not t.pending:
                return False
            prev = t.on_first_byte
            if prev is None:
                t.on_first_byte = fn
            else:
                def both() -> None:
                    prev()
                    fn()
                t.on_first_byte = both
            return True

    def forget_origin(self, origin: str) -> int:
        """Close every ticket of peer ``origin`` (it went silent); returns how many."""
        with self._lock:
            tids = self._remote.pop(origin, set())
            tickets = [self._tickets[(origin, tid)] for tid in tids if (origin, tid) in self._tickets]
        for t in tickets:
            t.close()
        return len(tickets)

    def remote_count(self) -> int:
        return sum(len(v) for v in self._remote.values())

    def reap(self) -> int:
        cutoff = self.clock() - self.max_age_s
        old = [t for t in list(self._tickets.values()) if t.started < cutoff]
        for t in old:
            t.close()
        return len(old)

    def load(self, pod: str) -> tuple[int, float, int]:
        """(in flight, pending tokens, pending requests) of ``pod``."""
        ld = self._loads.get(pod)
        return (0, 0.0, 0) if ld is None else (ld.inflight, ld.pending_tokens, ld.pending_requests)

    def pending_at(self, pod: str, t: float) -> int:
        """The picker's requests on ``pod`` opened by ``t`` whose first token had not come back at ``t``
        (exact for ``t`` within the last ``history_s``; older first tokens are forgotten)."""
        with self._lock:
            return self._pending_at(pod, t)

    def _pending_at(self, pod: str, t: float) -> int:
        n = sum(1 for tk in self._pending.get(pod, {}).values() if tk.started <= t)
        # first tokens are recorded in time order: those after ``t`` are the deque's tail
        for opened, first in reversed(self._recent.get(pod, ())):
            if first <= t:
                break
            n += opened <= t
        return n

    def pending_elapsed(self, pod: str) -> float:
        """Seconds ``pod`` has already worked on the picker's requests still waiting there for their first
        token: since the later of the last first token it returned and the oldest of those requests'
        picks (0 when none waits). The pod's unfinished prefill work is then the pending work minus this
        (a work-conserving server, whatever order or batching it serves them in)."""
        with self._lock:
            return self._elapsed(pod, self.clock())

    def _elapsed(self, pod: str, now: float) -> float:
        pending = self._pending.get(pod)
        if not pending:
            return 0.0
        oldest = min(tk.started for tk in pending.values())
        return max(0.0, now - max(oldest, self._last_first.get(pod, oldest)))

    def expected_waits(self, pods: Sequence[str]) -> list[float]:
        """Per pod of ``pods`` (one lock, one clock read), the queueing delay a request arriving there can
        expect over the coming ``history_s``, from its recent past: ``s̄ · u / (1 − u)`` (M/M/1) with
        ``u`` the fraction of the last ``history_s`` (exponentially decayed) the pod spent with a request
        of the picker waiting for its first token and ``s̄ = busy seconds / first tokens`` its mean
        prefill; 0 without history. ``u`` counts up to 0.5, so the figure is at most ``s̄``: beyond that
        the pod's pending work, which the queue scorer knows exactly, already says it is busy, and the
        M/M/1 term near saturation (``u ≤ 0.95``: up to 19 ``s̄``) counted that queue a second time and
        sent conversations away from their cached history (on the Mooncake conversation trace at ρ 0.8
        with 250-block caches, TTFT p90 1.25 × the oracle's, against 1.08 × with the cap at 0.5).

        A new context (a session's first turn, an agent's task, a document's first reader) stays where it
        is placed: its later requests follow its cached prefix. The instantaneous queue says nothing about
        that future (it is empty most of the time below saturation), so without this term every new
        context went to the few pods holding its shared system prompt, and the pods without it stayed
        idle."""
        return [v.expected_wait_s for v in self.view(pods, 0, [None] * len(pods))]

    def view(self, pods: Sequence[str], hot: int, scraped_at: Sequence[float | None]) -> list[PodView]:
        """What a pick needs of each of ``pods``, under one lock and one clock read: :meth:`load`,
        :meth:`same_prefix` of ``hot``, :meth:`pending_elapsed` (0 with nothing pending), the expected wait
        (:meth:`expected_waits`), the busy share (the share of the last ``history_s``, exponentially decayed,
        the pod spent with a request of the picker waiting for its first token: its recent utilisation as the
        picker sees it, 0 to 1) and, where ``scraped_at`` gives the instant of a scrape that saw waiting
        requests, :meth:`pending_at` that instant (else None). The one place these figures are computed."""
        out = []
        loads, prefix, pending, recent = self._loads, self._prefix, self._pending, self._recent
        h, exp, elapsed, new = self.history_s, math.exp, self._elapsed, tuple.__new__
        with self._lock:
            now = self.clock()
            # _pending_at and _decayed inlined, and each view made by tuple.__new__ (a NamedTuple's own
            # constructor is a Python call): this runs for every candidate of every decision
            for pod, at in zip(pods, scraped_at, strict=True):
                ld = loads.get(pod)
                scraped = None
                if at is not None:
                    waiting = pending.get(pod)
                    scraped = sum(1 for tk in waiting.values() if tk.started <= at) if waiting else 0
                    for opened, first in reversed(recent.get(pod, ())):
                        if first <= at:
                            break
                        scraped += opened <= at
                run = prefix.get((pod, hot))
                same, (arrivals, rate) = (run.count, run.rates(now)) if run else (0, (0.0, 0.0))
                if ld is None:
                    out.append(new(PodView, (0, 0.0, 0, same, 0.0, 0.0, scraped, 0.0, arrivals, rate)))
                    continue
                requests = ld.pending_requests
                age = now - ld.mark
                keep = exp(-age / h) if age > 0.0 else 1.0
                busy = ld.busy_s * keep
                if requests:
                    busy += h * (1.0 - keep)
                served = ld.served * keep
                share = busy / h
                if served >= 1.0:
                    u = share if share < 0.5 else 0.5
                    wait = busy / served * u / (1.0 - u)
                else:
                    wait = 0.0
                out.append(new(PodView, (ld.inflight, ld.pending_tokens, requests, same,
                                         elapsed(pod, now) if requests else 0.0, wait, scraped,
                                         share if share < 1.0 else 1.0, arrivals, rate)))
        return out

    def popularity(self, prefix: int) -> tuple[float, float]:
        """(requests per second, seconds) of ``prefix``'s current popularity run: the picker's requests under
        the hot key since the first of a run with no gap longer than ``history_s``; (0, 0) when none."""
        with self._lock:
            pop = self._pop.get(prefix)
            if pop is None:
                return 0.0, 0.0
            now = self.clock()
            if now - pop[1] > self.history_s:
                return 0.0, 0.0
            age = max(1e-3, now - pop[0])
            return pop[2] / age, age

    def same_prefix(self, pod: str, prefix: int) -> int:
        """The picker's requests keyed ``prefix`` on ``pod`` still waiting for their first token
        (until their stream ends with ``hot_until_close``)."""
        run = self._prefix.get((pod, prefix))
        return run.count if run is not None else 0

    def forget(self, pod: str) -> None:
        with self._lock:
            self._loads.pop(pod, None)
            self._recent.pop(pod, None)
            self._pending.pop(pod, None)
            self._last_first.pop(pod, None)
