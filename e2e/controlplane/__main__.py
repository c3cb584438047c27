"""``python -m e2e.controlplane build|up|info``.

* ``build``: build the pinned binaries unless they are cached (``make cluster``).
* ``up``: start a control plane in a temporary folder, print its kubeconfig, run until
  Ctrl-C (``make cluster-up``; ``--workdir DIR`` keeps certificates, data and logs there).
* ``info``: the pins, where the binaries and the Go caches are, and their sizes on disk.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from e2e.controlplane import cluster


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.controlplane",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("command", choices=["build", "up", "info"])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="up: keep certificates, etcd data and logs here")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            bins = cluster.build()
            print(f"{bins.dir} ({json.dumps(bins.info())})")
        elif args.command == "info":
            root = cluster.cache_root()
            bins = cluster.binaries()
            print(json.dumps({
                **cluster.pins(), "binaries": str(bins.dir), "built": bins.present(),
                "binaries_disk": _mib(cluster.du(bins.dir)),
                "go_module_cache_disk": _mib(cluster.du(root / "go" / "mod")),
                "go_build_cache_disk": _mib(cluster.du(root / "go" / "build")),
                **({"build": bins.info()} if bins.present() else {}),
            }, indent=2))
        else:
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            with cluster.running(args.workdir) as cp:
                print(f"control plane {cluster.pins()['kubernetes']} at {cp.server}; "
                      f"started in {cp.startup_s['total']:.1f} s")
                print(f"export KUBECONFIG={cp.kubeconfig}")
                print("Ctrl-C stops it.", flush=True)
                try:
                    while not stop.is_set():
                        cp.check()
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
    except cluster.Unavailable as exc:
        print(f"control plane unavailable: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
