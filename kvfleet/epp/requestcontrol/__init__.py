"""Request control: one request's lifecycle around scheduling (GIE's ``pkg/epp/requestcontrol``).

Layer table:

=============  ======================================================  ==============================
module         cares about                                             in → out
=============  ======================================================  ==============================
director       keys, admission (shedding), calling the scheduler,      request → Decision (+ ticket,
               PreRequest (speculative entries, ticket), ``served``    speculative entries)
locator        the invoked pool, level 1 (prefix shard), ready pods    model, shard key → pod groups
=============  ======================================================  ==============================

Scheduling (:mod:`kvfleet.epp.scheduling`) never imports request control (``.importlinter``).
"""

from kvfleet.epp.requestcontrol.director import Decision, Director
from kvfleet.epp.requestcontrol.locator import Locator

__all__ = ["Decision", "Director", "Locator"]
