"""Transfer metrics (Prometheus); the names are API and pinned by a golden test.

==========================================================  =====================================
``kvfleet_transfer_bytes_total{backend,direction}``         payload bytes sent / received
``kvfleet_transfer_blocks_total{backend,direction}``        blocks sent / received (verified)
``kvfleet_transfer_retries_total{backend}``                 remaining blocks re-requested
``kvfleet_transfer_failovers_total{from_backend,to_backend}``  backend switches mid-transfer
``kvfleet_transfer_errors_total{kind}``                     errors by :class:`TransferError` kind
``kvfleet_transfer_auth_rejections_total``                  peers rejected by the HMAC challenge
``kvfleet_transfer_bandwidth_bytes_per_second{backend}``    last completed transfer's goodput
``kvfleet_transfer_link_capacity_bytes_per_second``         configured link capacity
``kvfleet_transfer_bandwidth_utilisation{backend}``         goodput / capacity (seed 5.7)
==========================================================  =====================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TransferMetrics:
    """All transfer series on one registry (a private one by default, for tests)."""

    def __init__(self, registry: CollectorRegistry | None = None, link_capacity_bps: float = 0.0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.bytes = Counter("kvfleet_transfer_bytes", "Block payload bytes moved.", ["backend", "direction"],
                             registry=r)
        self.blocks = Counter("kvfleet_transfer_blocks", "Blocks moved.", ["backend", "direction"],
                              registry=r)
        self.retries = Counter("kvfleet_transfer_retries", "Re-requests of remaining blocks.", ["backend"],
                               registry=r)
        self.failovers = Counter(
            "kvfleet_transfer_failovers", "Backend switches mid-transfer.", ["from_backend", "to_backend"],
            registry=r
        )
        self.errors = Counter("kvfleet_transfer_errors", "Transfer errors by kind.", ["kind"], registry=r)
        self.auth_rejections = Counter("kvfleet_transfer_auth_rejections",
                                       "Peers rejected by the HMAC challenge.", registry=r)
        self.bandwidth = Gauge(
            "kvfleet_transfer_bandwidth_bytes_per_second", "Goodput of the last completed transfer.",
            ["backend"], registry=r
        )
        self.capacity = Gauge(
            "kvfleet_transfer_link_capacity_bytes_per_second", "Configured link capacity.", registry=r
        )
        self.utilisation = Gauge(
            "kvfleet_transfer_bandwidth_utilisation", "Goodput / configured link capacity.", ["backend"],
            registry=r
        )
        self.capacity.set(link_capacity_bps)
        self._capacity = link_capacity_bps

    def moved(self, backend: str, direction: str, nbytes: int) -> None:
        self.bytes.labels(backend, direction).inc(nbytes)
        self.blocks.labels(backend, direction).inc()

    def completed(self, backend: str, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        bps = nbytes / seconds
        self.bandwidth.labels(backend).set(bps)
        if self._capacity > 0:
            self.utilisation.labels(backend).set(bps / self._capacity)
