"""The plugin framework: what filters, scorers and pickers see, and the name → factory registry.

A scheduling cycle gets one :class:`SchedulingRequest` and the candidate pods
(:class:`Candidate`, everything the picker knows about one pod for this
request). Filters drop candidates, scorers return one number per candidate
(multiplied by the plugin's weight and summed), the picker orders the
survivors (the first is the pick, the rest are fallbacks).

Candidate building hands a cycle :class:`Candidates`: the same candidates held as columns, one per
:class:`Candidate` field. The built-in plugins read the columns they need (:func:`column`), and a
:class:`Candidate` object is built only when one is read (the picker's order, a ``pre_request`` hook, the
pick's evidence). Any ``Sequence[Candidate]`` is accepted where :class:`Candidates` is (:func:`column` reads
its objects' fields instead).

Plugins that read the prompt themselves (a GIE-style approximate prefix index,
``kvfleet.epp.scheduling.gie``) find the request being routed in
:func:`current_request` (a :class:`RequestContext` the ext_proc server sets around
each routing call with :func:`routing_request`; ``None`` elsewhere), and a plugin
with a ``pre_request`` method (:class:`PreRequest`) hears of each cycle's pick
(GIE's PreRequest hook): the profile calls it once the picker has ordered the pods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar, cast, overload

from kvfleet.epp.datastore import Pod
from kvfleet.epp.errors import UnknownPluginError
from kvfleet.epp.podmetrics import PodMetrics, gpu_capacity

T = TypeVar("T")


@dataclass(frozen=True)
class SchedulingRequest:
    """The request as scheduling sees it (tokens already keyed)."""

    num_tokens: int = 0
    block_size: int = 16
    prefill_s_per_token: float = 1e-4
    hotspot_beta: float = 0.1
    #: the prefix shard key (the key of block ``min(K, n) − 1``), for affinity
    shard: int = 0
    #: the blocks the shard key covers (``min(K, n)``; 0: a prompt shorter than one block)
    shard_blocks: int = 0
    #: the share of the invoked pool's recent prompts that a live pick covered (blocks of a prompt sent to a
    #: candidate within the speculative TTL after its first token: the request follows an earlier one
    #: closely); an exponential average over the pool's last ≈ 100 decisions before this one
    #: (:data:`~kvfleet.epp.requestcontrol.director.FOLLOWUP_ALPHA`)
    followup_share: float = 0.0
    #: requests of the hot key expected to follow: its rate × the age of its popularity run
    #: (:meth:`~kvfleet.epp.inflight.InflightTracker.popularity`)
    hot_followers: float = 0.0

    @property
    def prefill_s(self) -> float:
        return self.num_tokens * self.prefill_s_per_token


@dataclass(slots=True)
class Candidate:
    """One pod for one request (read-only by convention: not frozen, as a frozen dataclass costs ≈ 2 µs more
    per construction, ≈ 0.15 ms per decision over 64 pods).

    ``hit_blocks``/``hit_weighted``: prefix blocks the pod holds (tier-weighted sum).
    ``inflight``: the picker's requests on the pod not yet finished;
    ``same_prefix``: those counted under this request's hot key (the key of the longest prefix any
    candidate holds: :meth:`~kvfleet.epp.router.Router.hotspot_key`) still waiting for their first token;
    ``pending_tokens``/``pending_requests``: predicted uncached tokens (and requests)
    routed there whose first token has not come back yet (queued prefill work);
    ``pending_elapsed_s``: seconds the pod has already worked on those requests (since the later of its
    last first token and the oldest of them: :meth:`~kvfleet.epp.inflight.InflightTracker.pending_elapsed`);
    ``metrics``: fresh model-server metrics, or ``None`` when stale/absent;
    ``scrape_pending``: the picker's pending requests on the pod at the instant those
    metrics were scraped (``None``: unknown, ``pending_requests`` stands in).
    """

    pod: Pod
    hit_blocks: int = 0
    hit_weighted: float = 0.0
    #: of ``hit_blocks``, those only the picker's speculative entries vouch for
    spec_blocks: int = 0
    inflight: int = 0
    same_prefix: int = 0
    pending_tokens: float = 0.0
    pending_requests: int = 0
    pending_elapsed_s: float = 0.0
    #: the queueing delay the pod's recent past predicts
    #: (:meth:`~kvfleet.epp.inflight.InflightTracker.expected_waits`)
    expected_wait_s: float = 0.0
    #: blocks the index holds on the pod's GPU tier
    held_blocks: int = 0
    #: the prefix a live pick on the pod covers (:attr:`~kvfleet.epp.index.PodMatch.picked`)
    picked_blocks: int = 0
    #: the pod's recent utilisation as the picker sees it
    #: (:attr:`~kvfleet.epp.inflight.PodView.busy_share`)
    busy_share: float = 0.0
    metrics: PodMetrics | None = None
    scrape_pending: int | None = None
    #: requests and predicted uncached tokens per second the hot key's requests brought to the pod since
    #: the first of those still waiting there (:attr:`~kvfleet.epp.inflight.PodView.prefix_rate`)
    prefix_arrivals: float = 0.0
    prefix_rate: float = 0.0

    @property
    def name(self) -> str:
        return self.pod.name


#: :class:`Candidate`'s fields in order: a column's position in :attr:`Candidates.columns`
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Candidate))
_POSITION = {name: i for i, name in enumerate(FIELDS)}


class Candidates(Sequence[Candidate]):
    """One cycle's candidates as columns, in :class:`Candidate`'s field order (:data:`FIELDS`):
    ``columns[j][i]`` is field ``j`` of candidate ``i``.

    Plugins read whole columns (:func:`column`); a :class:`Candidate` is built when an item is read and then
    kept, so the objects a cycle hands on (the picker's order) are the same objects each time they are read.
    Building all 64 objects of a decision, most never read, cost ≈ 25–60 µs. Read-only like
    :class:`Candidate`.
    """

    __slots__ = ("_capacity", "_items", "_memo", "columns", "names")

    def __init__(self, columns: Sequence[Sequence[Any]], names: Sequence[str] | None = None,
                 capacity: tuple[int, Sequence[int | None]] | None = None) -> None:
        if len(columns) != len(FIELDS):
            raise ValueError(f"{len(columns)} columns for {len(FIELDS)} candidate fields")
        n = len(columns[0])
        if any(len(c) != n for c in columns):
            raise ValueError("candidate columns of unequal length")
        self.columns = columns
        #: the pods' names (``Candidate.name``)
        self.names: Sequence[str] = [p.name for p in columns[0]] if names is None else names
        self._items: list[Candidate | None] = [None] * n
        #: (block size, each pod's GPU cache in blocks of it): what candidate building already computed
        self._capacity = capacity
        #: per-cycle values several plugins read (:meth:`memo`)
        self._memo: dict[Hashable, Any] = {}

    @classmethod
    def of(cls, cands: Sequence[Candidate]) -> Candidates:
        """``cands`` as columns (itself when it already is)."""
        if isinstance(cands, Candidates):
            return cands
        out = cls([[getattr(c, f) for c in cands] for f in FIELDS])
        out._items = list(cands)
        return out

    def take(self, positions: Sequence[int]) -> Candidates:
        """The candidates at ``positions`` (a filter's survivors), objects already built kept."""
        out = Candidates([[col[i] for i in positions] for col in self.columns],
                         [self.names[i] for i in positions])
        out._items = [self._items[i] for i in positions]
        return out

    def position(self, cand: Candidate) -> int:
        """Where ``cand`` (an object read from here) stands."""
        for i, it in enumerate(self._items):
            if it is cand:
                return i
        raise ValueError(f"candidate {cand.name!r} was not read from these candidates")

    def capacity(self, block_size: int) -> Sequence[int | None]:
        """Each pod's GPU cache in blocks of ``block_size`` tokens
        (:func:`~kvfleet.epp.podmetrics.gpu_capacity`; None where its engine does not publish it)."""
        if self._capacity is None or self._capacity[0] != block_size:
            pms = self.columns[_POSITION["metrics"]]
            self._capacity = (block_size, [gpu_capacity(pm, block_size) for pm in pms])
        return self._capacity[1]

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, computed once for these candidates under ``key`` (a value several plugins of one cycle
        read, such as :func:`~kvfleet.epp.scheduling.plugins.followers`)."""
        try:
            return cast(T, self._memo[key])
        except KeyError:
            value = self._memo[key] = make()
            return value

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> list[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | list[Candidate]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        item = self._items[i]
        if item is None:
            item = self._items[i] = Candidate(*[col[i] for col in self.columns])
        return item

    def __iter__(self) -> Iterator[Candidate]:
        for i in range(len(self._items)):
            yield self[i]


def column(cands: Sequence[Candidate], name: str) -> Sequence[Any]:
    """Field ``name`` of every candidate, in order (a :class:`Candidates`' own column; read from the objects
    of any other sequence)."""
    if isinstance(cands, Candidates):
        return cands.columns[_POSITION[name]]
    return [getattr(c, name) for c in cands]


@dataclass
class RequestContext:
    """The request being routed, as a plugin that keys the prompt itself sees it (GIE's ``LLMRequest``).

    Exactly one of ``prompt`` (text; chat already rendered) and ``prompt_token_ids`` is set.
    ``predicted_hit_tokens``: a plugin that predicts the pick's cached tokens from an index of its own
    writes it here, and the server then reports that prediction (decision log, misprediction metrics)
    instead of the block index's; ``state``: per-plugin scratch for this request (GIE's plugin state).
    """

    request_id: str = ""
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    cache_salt: str | None = None
    predicted_hit_tokens: int | None = None
    state: dict[object, Any] = field(default_factory=dict)


_CURRENT: ContextVar[RequestContext | None] = ContextVar("kvfleet_routing_request", default=None)


def current_request() -> RequestContext | None:
    """The request being routed in this thread, or ``None`` (routing by keys only: ``Router.route_keys``)."""
    return _CURRENT.get()


@contextlib.contextmanager
def routing_request(ctx: RequestContext) -> Iterator[RequestContext]:
    """``with routing_request(ctx): router.route(...)``: plugins see ``ctx`` during that call."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


class Filter(Protocol):
    def filter(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]: ...


class Scorer(Protocol):
    def score(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> Sequence[float]: ...


class Picker(Protocol):
    def pick(self, req: SchedulingRequest, cands: Sequence[Candidate],
             scores: Sequence[float]) -> list[Candidate]: ...


class PreRequest(Protocol):
    """A plugin told of each cycle's pick (the first of the picker's order), before the request is sent."""

    def pre_request(self, req: SchedulingRequest, pick: Candidate) -> None: ...


Plugin = Filter | Scorer | Picker
Factory = Callable[[Mapping[str, float]], Plugin]


@dataclass(frozen=True)
class Registration:
    kind: str
    factory: Factory
    doc: str


REGISTRY: dict[str, Registration] = {}


def register(name: str, kind: str) -> Callable[[type], type]:
    """Class decorator: ``@register("queue-scorer", "scorer")``; the class docstring is its contract."""

    def deco(cls: type) -> type:
        REGISTRY[name] = Registration(kind, cls, (cls.__doc__ or "").strip())
        return cls

    return deco


def create(name: str, params: Mapping[str, float]) -> tuple[str, Plugin]:
    """Instantiate a registered plugin; unknown names raise :class:`UnknownPluginError` listing the known
    ones."""
    reg = REGISTRY.get(name)
    if reg is None:
        raise UnknownPluginError(f"unknown scheduling plugin {name!r}; known: {', '.join(sorted(REGISTRY))}")
    try:
        return reg.kind, reg.factory(params)
    except TypeError as exc:
        raise UnknownPluginError(f"plugin {name!r}: bad params {dict(params)}: {exc}") from None
