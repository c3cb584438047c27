"""Session fixtures shared by every test folder: a real Kubernetes control plane.

``kube_apiserver`` is the path of an admin kubeconfig for a real kube-apiserver (with etcd and
kube-controller-manager) of the Kubernetes release pinned in ``e2e/controlplane/go.mod``,
started once per session on 127.0.0.1 and stopped at its end; ``control_plane`` is the
:class:`e2e.controlplane.cluster.ControlPlane` itself (its ``server``, its ``request`` as
the admin, ``service_account_kubeconfig`` for a ServiceAccount's identity).

The binaries are built once per pin into a cache outside the repository. When a selected
test needs them and they are missing, they are built at the end of collection, before any
test runs (so a cold build is not charged to one test's timeout). When they cannot be built
(no Go, no module proxy) those tests skip with the reason, unless ``KVFLEET_REQUIRE_CLUSTER=1``
(``make test-cluster``), where that is an error.

``wait_for`` (and ``eventually``, its asyncio twin) is the one way tests wait for a condition.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

import pytest

from e2e.controlplane import cluster

T = TypeVar("T")

CONTROL_PLANE_FIXTURES = {"kube_apiserver", "control_plane"}
_unavailable: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: runs against a real kube-apiserver (e2e/controlplane; make test-cluster)")


def mark_folder(items: list[pytest.Item], folder: Path, marker: pytest.MarkDecorator) -> None:
    """Give every collected test under ``folder`` ``marker`` (a folder's conftest calls it from its collection
    hook)."""
    for item in items:
        if folder in Path(str(item.fspath)).parents:
            item.add_marker(marker)


def _required() -> bool:
    return os.environ.get("KVFLEET_REQUIRE_CLUSTER", "") not in ("", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test using the control plane is a ``cluster`` test wherever it lives (before ``-m`` selects)."""
    for item in items:
        if CONTROL_PLANE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(CONTROL_PLANE_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items):
        return
    try:
        if not cluster.binaries().present():
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            cluster.build(log=lambda m: reporter.write_line(f"control plane: {m}") if reporter else None)
    except cluster.Unavailable as exc:
        _unavailable.append(str(exc))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager, for the whole session."""
    try:
        bins = cluster.build() if not _unavailable else None
    except cluster.Unavailable as exc:
        _unavailable.append(str(exc))
        bins = None
    if bins is None:
        reason = f"no real Kubernetes control plane: {_unavailable[0]}"
        if _required():
            pytest.fail(reason)
        pytest.skip(reason)
    with cluster.ControlPlane(tmp_path_factory.mktemp("controlplane"), bins) as cp:
        yield cp


@pytest.fixture(scope="session")
def kube_apiserver(control_plane: cluster.ControlPlane) -> Path:
    """Path of an admin kubeconfig (client certificate in group system:masters) for the session's API
    server."""
    return control_plane.kubeconfig


class _Waiting:
    """The state of one wait: its deadline, the next pause, the probe's last answer."""

    FIRST_PAUSE_S = 0.01

    def __init__(self, what: str, timeout_s: float, interval_s: float) -> None:
        self.what, self.timeout_s, self.interval_s = what, timeout_s, interval_s
        self.deadline = time.monotonic() + timeout_s
        self.pause = min(self.FIRST_PAUSE_S, interval_s)
        self.last: object = None

    def next_pause(self) -> float:
        """The pause before the next probe (the last one falls on the deadline); once the time is up, an
        AssertionError naming ``what``."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {self.timeout_s:g} s waiting for {self.what}; "
                                 f"last: {self.last!r}")
        pause, self.pause = min(self.pause, left), min(self.pause * 2, self.interval_s)
        return pause


def wait_for(
    probe: Callable[[], T | None], what: str, timeout_s: float = 30.0, interval_s: float = 0.25
) -> T:
    """Call ``probe`` until it returns a truthy value, and return that value.

    ``what`` names the awaited condition in the failure (an AssertionError after ``timeout_s``
    with the probe's last answer; the last probe runs at the deadline, so "within ``timeout_s``"
    is what passes). The pauses between probes start at 10 ms and double up to ``interval_s``,
    so a quick condition is seen at once and a slow one (a probe that runs kubectl) is not
    polled in a busy loop; a test that measures how long something took passes a small
    ``interval_s``. An AssertionError raised by ``probe`` counts as "not yet" and is the last
    answer; any other exception (or ``pytest.fail``) ends the wait.
    """
    waiting = _Waiting(what, timeout_s, interval_s)
    while True:
        try:
            value = probe()
            if value:
                return value
            waiting.last = value
        except AssertionError as exc:
            waiting.last = exc
        time.sleep(waiting.next_pause())


@overload
async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = ..., interval_s: float = ...
) -> T: ...
@overload
async def eventually(
    probe: Callable[[], T | None], what: str, timeout_s: float = ..., interval_s: float = ...
) -> T: ...


async def eventually(
    probe: Callable[[], Any], what: str, timeout_s: float = 30.0, interval_s: float = 0.25
) -> Any:
    """:func:`wait_for` inside an event loop: ``probe`` may be a coroutine function, and the loop runs between
    probes."""
    waiting = _Waiting(what, timeout_s, interval_s)
    while True:
        try:
            answer = probe()
            value = await answer if inspect.isawaitable(answer) else answer
            if value:
                return value
            waiting.last = value
        except AssertionError as exc:
            waiting.last = exc
        await asyncio.sleep(waiting.next_pause())


@pytest.fixture
def decoded_payloads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the KV-event payloads the EPP's subscriber hands to the decoder (the batches it does not
    apply from their bytes), in order."""
    from kvfleet.cache.events import DecodedBatch
    from kvfleet.epp import subscriber

    sizes: list[int] = []
    real = subscriber.decode_batch_lenient  # type: ignore[attr-defined]

    def counted(payload: bytes) -> DecodedBatch:
        sizes.append(len(payload))
        result: DecodedBatch = real(payload)
        return result

    monkeypatch.setattr(subscriber, "decode_batch_lenient", counted)
    return sizes
