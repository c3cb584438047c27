"""``kvfleet operator``: run the kopf operator for KVCachePool and InferencePool.

Options: ``--config`` (kvfleet Settings YAML; the ``operator`` section is used),
``--namespace`` (repeatable; default: all namespaces), ``--liveness`` (kopf's
health endpoint, default ``http://0.0.0.0:<operator.liveness_port>/healthz``),
``--verbose``.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

from kvfleet.config import ConfigError, load
from kvfleet.operator.handlers import Runtime, build_registry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet operator",
                                     description="Reconcile KVCachePools and InferencePools (kopf).")
    parser.add_argument("--config", default=None, help="kvfleet settings YAML")
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable)")
    parser.add_argument("--liveness", default=None, help="liveness endpoint URL (kopf)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    try:
        settings = load(args.config)
    except (ConfigError, OSError) as exc:
        print(f"kvfleet operator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rt = Runtime(settings=settings)
    liveness = args.liveness or f"http://0.0.0.0:{settings.operator.liveness_port}/healthz"
    kopf.run(
        registry=build_registry(rt),
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0
