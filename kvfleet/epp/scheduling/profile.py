"""A scheduling profile: the configured filters, weighted scorers and one picker, run as one cycle;
then the plugins with a ``pre_request`` hook hear of the pick."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, mul

from kvfleet.config.epp import PluginSpec
from kvfleet.epp.errors import UnknownPluginError
from kvfleet.epp.scheduling import gie as _gie  # noqa: F401  (registers the GIE-style plugins)
from kvfleet.epp.scheduling import plugins as _builtin  # noqa: F401  (registers the built-ins)
from kvfleet.epp.scheduling.framework import (
    Candidate,
    Candidates,
    Filter,
    Picker,
    PreRequest,
    SchedulingRequest,
    Scorer,
    create,
)


@dataclass(frozen=True)
class Ranked:
    """The picker's order with each pod's total score (same order)."""

    pods: tuple[Candidate, ...]
    scores: tuple[float, ...]


class Profile:
    """``filters → Σ weight·scorer → picker``, built from :class:`~kvfleet.config.epp.PluginSpec` s."""

    def __init__(self, specs: Sequence[PluginSpec]) -> None:
        self.filters: list[Filter] = []
        self.scorers: list[tuple[float, Scorer]] = []
        self.hooks: list[PreRequest] = []
        picker: Picker | None = None
        for spec in specs:
            kind, plugin = create(spec.type, spec.params)
            if callable(getattr(plugin, "pre_request", None)):
                self.hooks.append(plugin)  # type: ignore[arg-type]
            if kind == "filter":
                self.filters.append(plugin)  # type: ignore[arg-type]
            elif kind == "scorer":
                self.scorers.append((spec.weight, plugin))  # type: ignore[arg-type]
            else:
                if picker is not None:
                    raise UnknownPluginError("a profile takes exactly one picker")
                picker = plugin  # type: ignore[assignment]
        if picker is None:
            _, picker = create("max-score-picker", {})  # type: ignore[assignment]
        assert picker is not None
        self.picker: Picker = picker

    def run(self, req: SchedulingRequest, cands: Sequence[Candidate]) -> Ranked:
        """Filter, score (summed in the profile's order) and pick; the pick's ``pre_request`` hooks run before
        it returns."""
        alive = Candidates.of(cands)
        for f in self.filters:
            alive = Candidates.of(f.filter(req, alive))
            if not len(alive):
                return Ranked((), ())
        n = len(alive)
        totals = [0.0] * n
        for weight, scorer in self.scorers:  # weight 1 (the default) skips the product: t + 1.0·s == t + s
            scores = scorer.score(req, alive)
            if len(scores) != n:
                raise ValueError(f"scorer {type(scorer).__name__}: {len(scores)} scores for {n} candidates")
            # map over operator's functions: the loop in C (t + s, as a comprehension would add them)
            totals = list(map(add, totals, scores if weight == 1.0 else map(mul, repeat(weight), scores)))
        order = self.picker.pick(req, alive, totals)
        if order:
            for hook in self.hooks:
                hook.pre_request(req, order[0])
        return Ranked(tuple(order), tuple(totals[alive.position(c)] for c in order))
