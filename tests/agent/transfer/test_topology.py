"""Topology-aware backend choice: same host → shm; common RDMA-class engine → it; else tcp; the tail is the
failover path."""

from __future__ import annotations

import pytest

from kvfleet.agent.transfer import PeerInfo, choose_backends, local_host_id


@pytest.mark.parametrize(
    ("local", "remote", "expected"),
    [
        (PeerInfo("a", ("shm", "tcp")), PeerInfo("a", ("shm", "tcp")), ["shm", "tcp"]),
        (PeerInfo("a", ("shm", "tcp")), PeerInfo("b", ("shm", "tcp")), ["tcp"]),
        (PeerInfo("a", ("shm", "mooncake", "tcp")), PeerInfo("b", ("mooncake", "tcp")), ["mooncake", "tcp"]),
        (PeerInfo("a", ("shm", "nixl", "mooncake", "tcp")), PeerInfo("a", ("shm", "nixl", "mooncake", "tcp")),
         ["shm", "mooncake", "nixl", "tcp"]),
        (PeerInfo("a", ("nixl", "tcp")), PeerInfo("b", ("mooncake", "tcp")), ["tcp"]),
        # unknown hosts are never "same"
        (PeerInfo("", ("shm", "tcp")), PeerInfo("", ("shm", "tcp")), ["tcp"]),
        (PeerInfo("a", ("shm",)), PeerInfo("b", ("tcp",)), []),
    ],
)
def test_choice(local: PeerInfo, remote: PeerInfo, expected: list[str]) -> None:
    assert choose_backends(local, remote) == expected


def test_preference_filters_and_reorders() -> None:
    same = PeerInfo("a", ("shm", "tcp"))
    assert choose_backends(same, same, preference=["tcp", "shm"]) == ["tcp", "shm"]
    assert choose_backends(same, same, preference=["tcp"]) == ["tcp"]


def test_host_id_prefers_configured_then_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert local_host_id("given") == "given"
    monkeypatch.setenv("KVFLEET_NODE_NAME", "node-7")
    assert local_host_id() == "node-7"
    monkeypatch.delenv("KVFLEET_NODE_NAME")
    assert local_host_id() and local_host_id() == local_host_id()
