"""Fixtures: fake pods on loopback, an in-process picker on free ports, a real Envoy in front."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvfleet.config import load
from kvfleet.demo.envoy import EnvoyProcess
from kvfleet.epp.app import Epp
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.server import health_check
from tests.epp.pods import PodFleet


@pytest.fixture
def fleet() -> Iterator[PodFleet]:
    f = PodFleet(3).start()
    yield f
    f.stop()


def make_epp(fleet: PodFleet, **epp_overrides: Any) -> Epp:
    over: dict[str, Any] = {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0, "metrics_port": 0,
                            "scrape_interval_s": 0.2}
    roles = epp_overrides.pop("roles", None)
    events = epp_overrides.get("events_enabled", True)
    over.update(epp_overrides)
    settings = load(overrides={"epp": over})
    epp = Epp(settings,
              datastore=StaticDatastore(data=fleet.pools_config(events=events, roles=roles))).start()
    assert health_check(f"127.0.0.1:{epp.health_port}")
    return epp


@pytest.fixture
def epp_factory(fleet: PodFleet) -> Iterator[Callable[..., Epp]]:
    started: list[Epp] = []

    def factory(**kw: Any) -> Epp:
        e = make_epp(fleet, **kw)
        started.append(e)
        return e

    yield factory
    for e in started:
        e.stop()


@pytest.fixture
def envoy_factory() -> Iterator[Callable[..., EnvoyProcess]]:
    started: list[EnvoyProcess] = []

    def factory(**kw: Any) -> EnvoyProcess:
        e = EnvoyProcess(**kw).start()
        started.append(e)
        return e

    yield factory
    for e in started:
        if e.proc is not None and e.proc.poll() is not None and e.proc.returncode not in (0, -15):
            pytest.fail(f"envoy died with {e.proc.returncode}: {e.log()[-2000:]}")
        e.stop()
