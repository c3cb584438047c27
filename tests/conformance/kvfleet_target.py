"""Launch kvfleet's EPP for the protocol suite: ``python tests/conformance/kvfleet_target.py SPEC.json``.

The suite's only contact with kvfleet (any other EPP gets its own launcher; see README.md here). It turns
the suite's spec (the pool's endpoints, the ports to listen on, the queue length at which the picker should
shed) into kvfleet's settings and static pods file, prints what the target can show (one JSON line), and
runs ``python -m kvfleet epp`` in its place.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

#: ``epp.front`` for this run (conftest.py runs the suite under each)
FRONT_ENV = "KVFLEET_CONFORMANCE_FRONT"


def fronts() -> list[str]:
    """kvfleet's gRPC fronts (``epp.front``) to run the suite under: the native one where it is built
    (tests/epp/test_front.py fails when Go is on PATH and it is not), and grpc.aio."""
    from kvfleet.epp.front import front_program

    return ["native", "grpcio"] if front_program() is not None else ["grpcio"]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    work = Path(spec["workdir"])
    pods = {"pools": [{
        "name": "pool", "models": [spec["model"]], "tokenizer": "bytes",
        "pods": [{"name": f"pod-{i}", "address": ep.rsplit(":", 1)[0], "port": int(ep.rsplit(":", 1)[1]),
                  "metrics": f"http://{ep}/metrics"} for i, ep in enumerate(spec["endpoints"])],
    }]}
    (work / "pods.yaml").write_text(yaml.safe_dump(pods))
    plugins = [{"type": "ready-filter"}, {"type": "prefix-cache-scorer", "weight": 1.0},
               {"type": "queue-scorer", "weight": 1.0},
               {"type": "kv-cache-utilization-scorer", "weight": 0.05},
               {"type": "max-score-picker", "params": {"fallbacks": 2}}]
    epp = {"host": "127.0.0.1", "grpc_port": spec["grpc_port"], "health_port": spec["health_port"],
           "metrics_port": spec["metrics_port"], "pods_file": str(work / "pods.yaml"),
           "events_enabled": False,
           "scrape_interval_s": 0.2, "metrics_staleness_s": 1.0, "shed_queue": float(spec["shed_waiting"]),
           "pool_saturation_queue": float(spec["shed_waiting"]), "plugins": plugins}
    if os.environ.get(FRONT_ENV):  # the suite's run per gRPC front
        epp["front"] = os.environ[FRONT_ENV]
    (work / "epp.yaml").write_text(yaml.safe_dump({"epp": epp}))
    print(json.dumps({
        "metrics": f"http://127.0.0.1:{spec['metrics_port']}/metrics",
        # a Prometheus counter that counts responses the data plane reported served by a fallback endpoint
        "served_by_fallback": 'kvfleet_epp_served_total{by="fallback"}',
    }), flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "kvfleet", "epp", "--config", str(work / "epp.yaml"),
                              "--log-level", "WARNING"])


if __name__ == "__main__":
    main()
