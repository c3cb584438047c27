"""Topology-aware backend choice: same host → shm; both RDMA-class → it; else tcp.

A peer advertises a :class:`PeerInfo` in its HELLO. The host id is the node
name when set (``KVFLEET_NODE_NAME``, from the Kubernetes downward API), else
the kernel's boot id — equal boot ids mean one kernel, i.e. the same host.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Backends that move bytes through an RDMA-class engine, best first.
RDMA_CLASS: tuple[str, ...] = ("mooncake", "nixl")


@dataclass(frozen=True)
class PeerInfo:
    """What one side offers: its host id and the backends it can run."""

    host_id: str = ""
    backends: tuple[str, ...] = field(default_factory=lambda: ("tcp",))


def local_host_id(configured: str = "") -> str:
    """The configured id, else ``$KVFLEET_NODE_NAME``, else the boot id, else the hostname."""
    if configured:
        return configured
    node = os.environ.get("KVFLEET_NODE_NAME", "")
    if node:
        return node
    try:
        return "boot:" + Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "host:" + socket.gethostname()


def choose_backends(local: PeerInfo, remote: PeerInfo, preference: Sequence[str] = ()) -> list[str]:
    """Backends both sides can run, best first; the tail is the failover path.

    ``shm`` only when both run on the same host; then the RDMA-class engines
    both advertise; then ``tcp``. ``preference``, if given, filters and
    reorders (a name not listed is dropped).
    """
    common = [b for b in local.backends if b in remote.backends]
    order: list[str] = []
    if "shm" in common and local.host_id and local.host_id == remote.host_id:
        order.append("shm")
    order += [b for b in RDMA_CLASS if b in common]
    if "tcp" in common:
        order.append("tcp")
    if preference:
        order = [b for b in preference if b in order]
    return order
