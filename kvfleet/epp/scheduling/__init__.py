"""Scheduling plugins (filters, scorers, pickers) and the two routing levels.

Layer table:

=============  ======================================  ==========================
module         cares about                             in → out
=============  ======================================  ==========================
framework      plugin contracts, registry              name → plugin
plugins        built-in filters/scorers/pickers        candidates → scores/order
gie            GIE's default EPP scorers and picker    prompt, candidates → scores
profile        one cycle: filter → Σ w·score → pick    candidates → ranked pods
pools          level 1: prefix shard → pool            shard key → ranked pools
=============  ======================================  ==========================
"""

from kvfleet.epp.scheduling.framework import (
    REGISTRY,
    Candidate,
    RequestContext,
    SchedulingRequest,
    create,
    current_request,
    register,
    routing_request,
)
from kvfleet.epp.scheduling.pools import rendezvous_rank
from kvfleet.epp.scheduling.profile import Profile, Ranked

__all__ = [
    "REGISTRY", "Candidate", "Profile", "Ranked", "RequestContext", "SchedulingRequest", "create", "current_request",
    "register", "rendezvous_rank", "routing_request",
]
