"""The target EPP of the protocol suite, started by a launcher command over its own pool of model servers.

``EPP_CONFORMANCE_LAUNCH`` names the launcher (default: kvfleet's, ``kvfleet_target.py`` here). It is run
as ``LAUNCH SPEC.json`` where the spec gives the pool's endpoints (``ip:port``, metrics at
``http://ip:port/metrics``), the model, the ports to serve ext_proc and gRPC health on, and
``shed_waiting`` (the queue length at which the target should shed); it prints one JSON line of what the
target can show (``metrics``: its Prometheus URL, ``served_by_fallback``: a counter of responses served by
a fallback endpoint; both optional) and then runs the EPP until terminated.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conformance import kvfleet_target
from tests.conformance.extproc import FULL_DUPLEX, Exchange, completion, health
from tests.conformance.modelservers import ModelServer, free_port

HERE = Path(__file__).parent
LAUNCH_ENV = "EPP_CONFORMANCE_LAUNCH"
#: kvfleet_target.py: the gRPC front of a run
FRONT_ENV = "KVFLEET_CONFORMANCE_FRONT"
MODEL = "m"
SHED_WAITING = 50


@dataclass
class Target:
    address: str
    health_address: str
    servers: list[ModelServer]
    caps: dict[str, Any]
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.servers]

    def exchange(self, mode: int = FULL_DUPLEX) -> Exchange:
        return Exchange(self.channel, mode)

    def counter(self, selector: str) -> float | None:
        """The value of a Prometheus sample ``name{labels}`` on the target's metrics page (None: absent)."""
        url = self.caps.get("metrics")
        if not url:
            return None
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(selector + " "):
                    return float(line.split()[-1])
        return 0.0

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the target EPP exited with {self.proc.returncode}"

    def wait_picks(self, timeout_s: float = 30.0) -> None:
        """Until the target is ready and picks for the model (its pool's metrics scraped)."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            self.alive()
            if health(self.health_address, "readiness") == "SERVING":
                ex = self.exchange()
                try:
                    last = ex.request(completion("ready?", MODEL))
                finally:
                    ex.close()
                if last.status is None and last.endpoints:
                    return
            time.sleep(0.2)
        raise AssertionError(f"the target never picked within {timeout_s}s (last answer {last})")


#: kvfleet's launcher runs the suite once per gRPC front it has (kvfleet_target.fronts); another EPP's once
FRONTS = [""] if os.environ.get(LAUNCH_ENV) else kvfleet_target.fronts()


@pytest.fixture(scope="module", params=FRONTS)
def target(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Target]:
    work = tmp_path_factory.mktemp("epp-target")
    servers = [ModelServer() for _ in range(3)]
    for s in servers:
        s.start()
    spec = {"endpoints": [s.endpoint for s in servers], "model": MODEL, "grpc_port": free_port(),
            "health_port": free_port(), "metrics_port": free_port(), "shed_waiting": SHED_WAITING,
            "workdir": str(work)}
    (work / "spec.json").write_text(json.dumps(spec))
    launch = os.environ.get(LAUNCH_ENV) or f"{shlex.quote(sys.executable)} {HERE / 'kvfleet_target.py'}"
    log = (work / "target.log").open("wb")
    env = {**os.environ, FRONT_ENV: request.param} if request.param else None
    proc = subprocess.Popen([*shlex.split(launch), str(work / "spec.json")], stdout=subprocess.PIPE,
                            stderr=log, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        caps = json.loads(line) if line.strip() else {}
        t = Target(f"127.0.0.1:{spec['grpc_port']}", f"127.0.0.1:{spec['health_port']}", servers, caps, proc)
        t.wait_picks()
        yield t
        t.alive()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for s in servers:
            s.stop()
