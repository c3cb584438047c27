"""Settings of the node agent's transfer engine (prefill → decode KV blocks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferSettings:
    """How blocks move between pods.

    ``streams`` parallel TCP connections per transfer; ``window_blocks`` blocks
    each stream may have in flight and unconsumed (flow control: a slow
    receiver slows the sender); ``max_retries`` new sessions for the remaining
    blocks after a broken stream before the transfer fails, the ``k``-th on the
    same backend after a delay drawn uniformly from ``[0, min(retry_backoff_max_s,
    retry_backoff_s · 2^(k-1))]`` (exponential back-off, full jitter; a failover
    to the next backend goes at once); ``backends`` the
    backends this agent offers, best first (topology decides among those both
    peers offer). The pool secret is read from ``secret_file`` (a mounted
    Kubernetes Secret) or else the ``secret_env`` environment variable.
    ``link_capacity_gbps`` is the configured link capacity (GB/s) that the
    bandwidth-utilisation metric divides by. ``mooncake_protocol`` is the
    Mooncake Transfer Engine transport (``tcp``, ``rdma``) when ``mooncake``
    is among ``backends`` and its package imports.

    The server bounds what unauthenticated peers can hold:
    ``handshake_timeout_s`` is the deadline for the whole HELLO/AUTH exchange
    of an accepted connection (however slowly its bytes arrive; the client
    uses it per read); ``max_connections`` caps the server's open connections,
    authenticated or not (a connection over it is closed at once and counted);
    ``max_handshakes`` caps those still in the handshake (at it, the oldest
    one is closed to make room for the new one, so a flood of idle
    connections cannot lock out peers that answer at once).

    Frames after the handshake carry a keyed MAC (HMAC-SHA256 with a
    per-connection key). ``payload_mac`` (the receiver's choice, bound into
    that key) says whether the tag of a tcp ``BLOCK`` frame covers its payload
    too; off, it covers the header only and the payload is guarded by the xxh3
    checksum, against accidents only: for a network where tampering is not a
    concern and the hashing cost is (see ``bench.transfer``'s
    ``tcp_mac_vs_unkeyed``).
    """

    listen_host: str = "127.0.0.1"
    port: int = 0
    streams: int = 4
    window_blocks: int = 8
    max_block_bytes: int = 64 << 20
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    retry_backoff_max_s: float = 1.0
    connect_timeout_s: float = 5.0
    stall_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    max_connections: int = 1024
    max_handshakes: int = 128
    backends: tuple[str, ...] = ("shm", "tcp")
    shm_dir: str = "/dev/shm"
    host_id: str = ""
    secret_file: str = ""
    secret_env: str = "KVFLEET_TRANSFER_SECRET"
    link_capacity_gbps: float = 10.0
    mooncake_protocol: str = "tcp"
    payload_mac: bool = True

    def __post_init__(self) -> None:
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")
        if self.window_blocks < 1:
            raise ValueError(f"window_blocks must be >= 1, got {self.window_blocks}")
        if self.max_block_bytes < 1:
            raise ValueError(f"max_block_bytes must be >= 1, got {self.max_block_bytes}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.retry_backoff_s < 0 or self.retry_backoff_max_s < 0:
            raise ValueError("retry_backoff_s and retry_backoff_max_s must be >= 0")
        for name in ("max_connections", "max_handshakes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("connect_timeout_s", "stall_timeout_s", "handshake_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        known = {"shm", "tcp", "mooncake", "nixl"}
        unknown = [b for b in self.backends if b not in known]
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; known: {sorted(known)}")
