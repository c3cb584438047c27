"""``kvfleet agent``: the node agent as its own process (the sidecar of a model-server pod).

It runs, around one :class:`~kvfleet.agent.tiers.TierManager` (``tiers:`` settings):

- the **transfer server** (``transfer:`` settings, pool secret from
  ``$KVFLEET_TRANSFER_SECRET`` or ``transfer.secret_file``): authenticated peers
  pull any block the agent holds, in whatever tier it is;
- the **KV-event publisher**: every store, move and drop of the tier manager,
  as vLLM ``KVEventBatch`` messages on a ZMQ PUB socket (``--kv-events-port``,
  replay ROUTER on ``--kv-events-replay-port``), so the EPP indexes the agent's
  CPU/SSD/remote blocks with their ``medium``;
- **Prometheus metrics** on ``--metrics-port`` (``kvfleet_tier_*``,
  ``kvfleet_transfer_*``).

SIGTERM/SIGINT stop it cleanly; with an SSD or remote tier, memory blocks are
flushed there first so a restarted agent reuses them. The CPU engine
simulator embeds the same tier manager in-process as its tiers below the GPU
stand-in (:mod:`kvfleet.engine.tiers`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from kvfleet.agent.publisher import PortInUseError, ZmqPublisher
from kvfleet.agent.tiers import TierManager
from kvfleet.agent.transfer import TransferMetrics, TransferServer
from kvfleet.agent.transfer.auth import load_secret
from kvfleet.agent.transfer.errors import AuthError
from kvfleet.cache.events import EventBuffer
from kvfleet.cache.hashing import BlockHash
from kvfleet.config import ConfigError, Settings, load

log = logging.getLogger("kvfleet.agent")


class TierSource:
    """Serves the tier manager's blocks to the transfer server (a :class:`BlockSource`)."""

    def __init__(self, mgr: TierManager) -> None:
        self.mgr = mgr

    def get_block(self, block_hash: BlockHash) -> memoryview | None:
        arr = self.mgr.get(block_hash)
        if arr is None:
            return None
        return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


class Agent:
    """The agent's parts wired together; :meth:`start`, then :meth:`stop` (idempotent)."""

    def __init__(
        self,
        settings: Settings,
        secret: bytes,
        host: str = "0.0.0.0",
        transfer_port: int = 7000,
        kv_events_port: int = 5559,
        kv_events_replay_port: int | None = 5560,
        publish_interval_s: float = 0.05,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.events = EventBuffer()
        self.mgr = TierManager(settings.tiers, sink=self.events, registry=self.registry)
        self.publisher = ZmqPublisher(
            f"tcp://{host}:{kv_events_port}",
            f"tcp://{host}:{kv_events_replay_port}" if kv_events_replay_port else None,
        )
        self.server = TransferServer(
            TierSource(self.mgr),
            secret,
            host=host,
            port=transfer_port,
            settings=settings.transfer,
            metrics=TransferMetrics(self.registry,
                                    link_capacity_bps=settings.transfer.link_capacity_gbps * 1e9),
        )
        self.publish_interval_s = publish_interval_s
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run, name="kvfleet-agent-events", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self.server.start()
        self._pump.start()
        log.info("agent: transfer on %s:%d, KV events on %s", self.server.host, self.server.port,
                 self.publisher.endpoint)

    def _flush_events(self) -> None:
        batch = self.events.drain()
        if batch is not None:
            self.publisher.publish(batch)

    def _run(self) -> None:
        while not self._stop.wait(self.publish_interval_s):
            self._flush_events()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._pump.is_alive():
            self._pump.join(timeout=5)
        self.server.stop()
        self.mgr.close(flush=True)
        self._flush_events()
        self.publisher.close()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfleet agent",
                                 description="Run the kvfleet node agent (tiers, transfer, KV events).")
    ap.add_argument("--config", help="YAML settings file (kvfleet.config.Settings); defaults otherwise")
    ap.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    ap.add_argument("--transfer-port", type=int, default=7000, help="transfer server port (default: 7000)")
    ap.add_argument("--metrics-port", type=int, default=9091, help="Prometheus /metrics port (default: 9091)")
    ap.add_argument("--kv-events-port", type=int, default=5559,
                    help="ZMQ PUB port for KV events (default: 5559)")
    ap.add_argument("--kv-events-replay-port", type=int, default=5560,
                    help="ZMQ ROUTER replay port, 0 to disable (default: 5560)")
    ap.add_argument("--log-level", default="INFO")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load(args.config)
    except (ConfigError, OSError) as exc:
        print(f"kvfleet agent: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        secret = load_secret(settings.transfer.secret_file, settings.transfer.secret_env)
    except (AuthError, OSError) as exc:
        print(f"kvfleet agent: {exc}", file=sys.stderr)
        return 2
    try:
        agent = Agent(
            settings,
            secret,
            host=args.host,
            transfer_port=args.transfer_port,
            kv_events_port=args.kv_events_port,
            kv_events_replay_port=args.kv_events_replay_port or None,
            registry=REGISTRY,
        )
    except (PortInUseError, OSError) as exc:
        print(f"kvfleet agent: cannot start: {exc}", file=sys.stderr)
        return 1
    # The handlers go in before anything is served: a SIGTERM that arrives as soon as /metrics
    # answers (a kubelet stopping a pod that just became ready) still stops the agent cleanly.
    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("agent: signal %d, stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        # Every series is registered by now, so the first scrape already sees them all.
        start_http_server(args.metrics_port, addr=args.host, registry=REGISTRY)
        agent.start()
    except OSError as exc:
        print(f"kvfleet agent: cannot start: {exc}", file=sys.stderr)
        agent.stop()
        return 1
    done.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
