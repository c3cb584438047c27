"""``kvfleet epp --config FILE [--grpc-port N] [--health-port N] [--metrics-port N] [--pods FILE]
[--tls-cert-file F --tls-key-file F]``.

The config file is a kvfleet settings YAML (``epp:`` and ``cache:`` sections);
flags override its ports and pods file. Runs until SIGTERM/SIGINT; with ``--drain-seconds S``, a SIGTERM
first turns readiness NOT_SERVING and keeps answering ext_proc streams for ``S`` seconds (a second signal
ends it at once): a pod being deleted leaves the gateway's endpoints some time after it is signalled (Envoy
Gateway's xDS, an Envoy's DNS refresh), and streams that reach it meanwhile are still routed instead of
failing over or failing closed.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvfleet.cache import threadnames
from kvfleet.config import ConfigError, load
from kvfleet.epp.errors import DatastoreError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet epp",
                                description="Envoy ext_proc endpoint picker with cache-aware routing")
    p.add_argument("--config", help="settings YAML (sections epp:, cache:)")
    p.add_argument("--pods", help="static pods/pools YAML (overrides epp.pods_file)")
    p.add_argument("--grpc-port", type=int, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9090)")
    p.add_argument("--host", help="bind address (default 0.0.0.0)")
    p.add_argument("--tls-cert-file",
                   help="serve ext_proc over TLS with this PEM certificate (with --tls-key-file)")
    p.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    p.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED",
                   choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
                   help="assumed request body mode when Envoy does not say (it does from 1.33 on)")
    p.add_argument("--front", choices=["auto", "native", "grpcio"],
                   help="what serves the ext_proc port: the native front kvfleet-epp-front, Python's "
                        "grpc.aio, or auto (native where installed; epp.front)")
    p.add_argument("--drain-seconds", type=float, default=0.0,
                   help="after SIGTERM, report not ready and keep serving this long before stopping (the "
                        "chart: epp.drainSeconds)")
    p.add_argument("--log-level", default="INFO")
    return p


def freeze_startup_heap() -> int:
    """Take every object alive now (the modules, the settings, the chat templates, the assembled picker) out
    of the garbage collector's sight: they live as long as the process, and each full collection walked all
    of them (an EPP serving ``bench.epp``: 48–58 k objects, 17–26 ms a pause of the picker). Returns how many
    are frozen; what is allocated later is collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    threadnames.configure()  # (``kvfleet epp`` did already) the threads started below carry their names
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    over: dict[str, Any] = {}
    for flag, key in (("grpc_port", "grpc_port"), ("health_port", "health_port"),
                      ("metrics_port", "metrics_port"),
                      ("host", "host"), ("pods", "pods_file"), ("tls_cert_file", "tls_cert_file"),
                      ("tls_key_file", "tls_key_file"), ("front", "front")):
        if getattr(args, flag) is not None:
            over[key] = getattr(args, flag)
    try:
        settings = load(args.config, {"epp": over} if over else None)
        from kvfleet.epp.app import Epp

        epp = Epp(settings, body_mode=args.body_mode)
    except (ConfigError, DatastoreError, OSError, ValueError) as exc:
        print(f"kvfleet epp: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        epp.start()
    except (RuntimeError, OSError) as exc:  # a port taken, the native front missing or not starting
        print(f"kvfleet epp: {exc}", file=sys.stderr)
        epp.stop()
        return 2
    frozen = freeze_startup_heap()
    print(f"kvfleet epp: ext_proc :{epp.grpc_port} health :{epp.health_port} metrics :{epp.metrics_port}",
          flush=True)
    logging.getLogger("kvfleet.epp").debug("%d objects of the startup heap frozen", frozen)
    try:
        done.wait()
        if args.drain_seconds > 0:
            done.clear()
            epp.drain()
            print(f"kvfleet epp: draining for {args.drain_seconds:g} s (readiness NOT_SERVING)", flush=True)
            done.wait(args.drain_seconds)
    finally:
        epp.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
