"""Metric names are API: the exposition after a transfer matches the golden list, and the values add up."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvfleet.agent.transfer import MemoryBlockStore, TransferClient, TransferServer
from tests.agent.transfer.conftest import peer

GOLDEN = {
    "kvfleet_transfer_bytes_total",
    "kvfleet_transfer_blocks_total",
    "kvfleet_transfer_retries_total",
    "kvfleet_transfer_failovers_total",
    "kvfleet_transfer_errors_total",
    "kvfleet_transfer_auth_rejections_total",
    "kvfleet_transfer_bandwidth_bytes_per_second",
    "kvfleet_transfer_link_capacity_bytes_per_second",
    "kvfleet_transfer_bandwidth_utilisation",
}


def _names(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")} | {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }


async def test_exposition_names_and_values(
    server: TransferServer, client: TransferClient, store: MemoryBlockStore, hashes: list[int]
) -> None:
    handle = client.pull(peer(server), hashes, backends=["tcp"])
    await handle.collect()
    text = generate_latest(client.metrics.registry).decode()
    assert GOLDEN <= _names(text)
    total = sum(len(store.get_block(h) or b"") for h in hashes)
    assert client.metrics.bytes.labels("tcp", "received")._value.get() == total
    assert client.metrics.blocks.labels("tcp", "received")._value.get() == len(hashes)
    assert server.metrics.bytes.labels("tcp", "sent")._value.get() == total
    bw = client.metrics.bandwidth.labels("tcp")._value.get()
    assert bw > 0
    cap = client.settings.link_capacity_gbps * 1e9
    assert client.metrics.utilisation.labels("tcp")._value.get() == bw / cap
