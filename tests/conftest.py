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
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.controlplane import cluster

CONTROL_PLANE_FIXTURES = {"kube_apiserver", "control_plane"}
_unavailable: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: runs against a real kube-apiserver (e2e/controlplane; make test-cluster)")


def mark_folder(items: list[pytest.Item], folder: Path, marker: pytest.MarkDecorator) -> None:
    """Give every collected test under ``folder`` ``marker`` (a folder's conftest calls it from its collection hook)."""
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
    """Path of an admin kubeconfig (client certificate in group system:masters) for the session's API server."""
    return control_plane.kubeconfig
