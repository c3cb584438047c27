"""Scheduling: candidate building, the scheduler and its plugins (filters, scorers, pickers), level 1's
ranking.

Layer table:

=============  ======================================  ==========================
module         cares about                             in → out
=============  ======================================  ==========================
framework      plugin contracts, registry              name → plugin
plugins        built-in filters/scorers/pickers        candidates → scores/order
gie            GIE's default EPP scorers and picker    prompt, candidates → scores
profile        one cycle: filter → Σ w·score → pick    candidates → ranked pods
candidates     candidate building: index match,        pods, keys → candidates
               in-flight load, scraped metrics
scheduler      a request's cycles: the profile, then   candidates → pick, fallbacks,
               the P/D prefill cycle; the profiles     prefill pod, predicted hit
pools          level 1: prefix shard → pool            shard key → ranked pools
=============  ======================================  ==========================

Request control (:mod:`kvfleet.epp.requestcontrol`) calls the scheduler; nothing here imports it back.
"""

from kvfleet.epp.scheduling.candidates import CandidateBuilder
from kvfleet.epp.scheduling.framework import (
    REGISTRY,
    Candidate,
    Candidates,
    RequestContext,
    SchedulingRequest,
    create,
    current_request,
    register,
    routing_request,
)
from kvfleet.epp.scheduling.pools import rendezvous_rank
from kvfleet.epp.scheduling.profile import Profile, Ranked
from kvfleet.epp.scheduling.scheduler import Scheduler, SchedulingResult

__all__ = [
    "REGISTRY", "Candidate", "CandidateBuilder", "Candidates", "Profile", "Ranked", "RequestContext",
    "Scheduler", "SchedulingRequest", "SchedulingResult", "create", "current_request", "register",
    "rendezvous_rank", "routing_request",
]
