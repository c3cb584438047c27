"""Several picker replicas behind one Envoy: streams spread over them, a killed replica costs at most what
was in flight on it.

Covers, with real processes (``kvfleet epp`` ×2 reading one pods file, a real Envoy with both in its ext_proc
cluster, gRPC health checks on GIE's ext_proc service name, outlier ejection and stream retries): both
replicas pick; ``kill -9`` of one under steady load fails at most the requests in flight at that instant and
none that start 1 s later; the survivor serves everything after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from kvfleet.demo.envoy import EnvoyProcess, free_port
from kvfleet.epp.server import health_check
from tests.conftest import wait_for
from tests.epp.pods import PodFleet, post

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
EnvoyF = Callable[..., EnvoyProcess]


class Replica:
    """One ``kvfleet epp`` process; ``ports`` (grpc, health, metrics) restarts a picker on its old ports."""

    def __init__(self, tmp: Path, index: int, pods: Path, ports: tuple[int, int, int] | None = None) -> None:
        self.grpc, self.health, self.metrics = ports or (free_port(), free_port(), free_port())
        cfg = tmp / f"epp-{index}.yaml"
        cfg.write_text(yaml.safe_dump({"epp": {"host": "127.0.0.1", "scrape_interval_s": 0.2}}))
        self.log = open(tmp / f"epp-{index}.log", "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "epp", "--config", str(cfg), "--pods", str(pods),
             "--grpc-port", str(self.grpc), "--health-port", str(self.health),
             "--metrics-port", str(self.metrics), "--log-level", "WARNING"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for(lambda: self.proc.poll() is None and health_check(f"127.0.0.1:{self.health}", 0.3),
                 timeout_s=30, what=f"replica {index} ready")

    def requests(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=2) as r:
            return sum(float(ln.split()[-1]) for ln in r.read().decode().splitlines()
                       if ln.startswith("inference_model_request_total{"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        self.log.close()


def _picks(replica: Replica) -> bool:
    """The replica is up and has picked at least once."""
    try:
        return replica.requests() > 0
    except OSError:
        return False


@pytest.fixture
def replicas(fleet: PodFleet, tmp_path: Path) -> Iterator[list[Replica]]:
    pods = tmp_path / "pods.yaml"
    pods.write_text(yaml.safe_dump(fleet.pools_config()))
    rs = [Replica(tmp_path, i, pods) for i in range(2)]
    yield rs
    for r in rs:
        r.stop()


def test_kill_one_replica_under_load(replicas: list[Replica], envoy_factory: EnvoyF) -> None:
    env = envoy_factory(epp_endpoints=[f"127.0.0.1:{r.grpc}" for r in replicas])
    url = f"http://127.0.0.1:{env.listen_port}/v1/completions"
    for i in range(20):
        assert post(url, {"model": "m", "prompt": f"warm {i}"})[0] == 200
    assert all(r.requests() > 0 for r in replicas), "Envoy did not spread streams over both replicas"

    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            t0 = time.monotonic()
            status = post(url, {"model": "m", "prompt": f"client {k} request {n} " * 20}, timeout=10)[0]
            with lock:
                results.append((t0, time.monotonic(), status))
            n += 1

    with ThreadPoolExecutor(4) as ex:
        for k in range(4):
            ex.submit(client, k)
        time.sleep(1.5)  # steady load before the kill
        killed_at = time.monotonic()
        os.killpg(replicas[0].proc.pid, signal.SIGKILL)
        replicas[0].proc.wait(5)
        time.sleep(2.5)  # load goes on with one replica gone
        stop.set()
    in_flight = sum(1 for t0, t1, _ in results if t0 <= killed_at < t1)
    failed = [(t0 - killed_at, s) for t0, _, s in results if s != 200]
    late = [(t0 - killed_at, s) for t0, _, s in results if s != 200 and t0 >= killed_at + 1.0]
    after = [s for t0, _, s in results if t0 >= killed_at + 1.0]
    print(f"[replicas] {len(results)} requests, {len(failed)} failed ({in_flight} in flight at the kill), "
          f"{len(after)} after +1 s")
    assert len(failed) <= in_flight, (failed, in_flight)
    assert late == [] and len(after) >= 10


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_restart_of_a_single_replica_under_fail_open_loses_nothing(
    fleet: PodFleet, tmp_path: Path, envoy_factory: EnvoyF, body_mode: str
) -> None:
    """One replica, FailOpen with the pool as fallback: kill -9 and restart it 1 s later under steady load.
    BUFFERED (the chart's default): every request is answered 200 (by the pick, or by a pool member while the
    picker is away). FULL_DUPLEX_STREAMED: Envoy cannot fail open a stream that broke while the body was
    being streamed, so the requests whose streams were on the picker as it died, and a client's next request
    when it starts before Envoy can see the picker gone (≤ 0.1 s), may fail; none other does."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(yaml.safe_dump(fleet.pools_config()))
    replica = Replica(tmp_path, 0, pods)
    try:
        env = envoy_factory(epp_port=replica.grpc, failure_mode_allow=True, body_mode=body_mode,
                            fallback_endpoints=[f"127.0.0.1:{p.port}" for p in fleet.pods])
        url = f"http://127.0.0.1:{env.listen_port}/v1/completions"
        results: list[tuple[float, float, int]] = []
        stop = threading.Event()

        def client(k: int) -> None:
            n = 0
            while not stop.is_set():
                t0 = time.monotonic()
                status = post(url, {"model": "m", "prompt": f"client {k} request {n} " * 20}, timeout=10)[0]
                results.append((t0, time.monotonic(), status))
                n += 1

        with ThreadPoolExecutor(4) as ex:
            for k in range(4):
                ex.submit(client, k)
            time.sleep(1.0)  # steady load before the kill
            killed_at = time.monotonic()
            os.killpg(replica.proc.pid, signal.SIGKILL)
            replica.proc.wait(5)
            replica.log.close()
            time.sleep(1.0)  # the picker stays away for 1 s under load
            replica = Replica(tmp_path, 1, pods, (replica.grpc, replica.health, replica.metrics))
            # load goes on until the restarted picker picks again (it is up and Envoy's health check has seen
            # it)
            try:
                wait_for(lambda: _picks(replica), "the restarted picker picking", timeout_s=20,
                         interval_s=0.2)
            finally:
                stop.set()
        failed = [(t0, t1) for t0, t1, s in results if s != 200]
        in_flight = sum(1 for t0, t1, _ in results if t0 <= killed_at < t1)
        print(f"[replicas] restart under FailOpen ({body_mode}): {len(results)} requests, "
              f"{len(failed)} failed ({in_flight} in flight at the kill)")
        assert len(results) > 50
        if body_mode == "BUFFERED":
            assert failed == []
        else:
            # what was on the picker as it died, or started before Envoy could see it gone (≤ 0.1 s): a client
            # whose request failed at the kill may start its next one, and lose it too, within that window
            assert all(t0 < killed_at + 0.1 and t1 > killed_at for t0, t1 in failed), failed
    finally:
        replica.stop()

