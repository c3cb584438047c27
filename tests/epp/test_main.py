"""The ``kvfleet epp`` entry point (a real subprocess on free ports) and the metric names (golden list)."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvfleet.demo.envoy import free_port
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.front import front_program
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.main import freeze_startup_heap, main
from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.server import health_check
from tests.conftest import wait_for

GOLDEN_METRICS = sorted([
    "inference_extension_scheduler_e2e_duration_seconds",
    "inference_model_request",
    "inference_model_request_error",
    "inference_pool_average_kv_cache_utilization",
    "inference_pool_average_queue_size",
    "inference_pool_ready_pods",
    "kvfleet_epp_engine_cached_tokens",
    "kvfleet_epp_engine_hash_map_entries",
    "kvfleet_epp_index_bytes",
    "kvfleet_epp_index_entries",
    "kvfleet_epp_index_speculative_blocks",
    "kvfleet_epp_kv_event_batches",
    "kvfleet_epp_kv_event_gaps",
    "kvfleet_epp_kv_event_key_evictions",
    "kvfleet_epp_kv_event_lag_seconds",
    "kvfleet_epp_kv_event_orphans",
    "kvfleet_epp_kv_event_rejected",
    "kvfleet_epp_kv_event_replay_holes",
    "kvfleet_epp_kv_event_replay_timeouts",
    "kvfleet_epp_kv_event_restarts",
    "kvfleet_epp_kv_event_resyncs",
    "kvfleet_epp_kv_event_unknown_medium",
    "kvfleet_epp_misprediction_tokens",
    "kvfleet_epp_pod_inflight",
    "kvfleet_epp_pod_pending_tokens",
    "kvfleet_epp_pool_followup_share",
    "kvfleet_epp_pool_key_mismatch",
    "kvfleet_epp_response_bodies_skipped",
    "kvfleet_epp_predicted_hit_tokens",
    "kvfleet_epp_prompt_tokens",
    "kvfleet_epp_reuse_forgotten_sends",
    "kvfleet_epp_reuse_shortened_hits",
    "kvfleet_epp_reuse_sketch_bytes",
    "kvfleet_epp_served",
    "kvfleet_epp_speculative_dropped",
    "kvfleet_epp_thread_cpu_seconds",
    "kvfleet_epp_unkeyed_requests",
    "process_cpu_seconds",
    "process_max_fds",
    "process_open_fds",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_virtual_memory_bytes",
])


def test_metric_names_are_stable() -> None:
    """Metric names are API: any rename or addition must update this golden list (and docs/epp.md)."""
    m = EppMetrics()
    ds = StaticDatastore(data={"pools": [{"name": "a", "models": ["m"],
                                          "pods": [{"name": "p", "address": "h", "port": 1}]}]})
    m.attach_state(BlockIndex(), InflightTracker(), MetricsStore(), ds.pools, dict)
    m.attach_threads()
    assert sorted({fam.name for fam in m.registry.collect()}) == GOLDEN_METRICS


def test_the_startup_heap_leaves_the_collectors_sight() -> None:
    """What is alive when the EPP has started is frozen: a full collection no longer walks it."""
    held = [[i] for i in range(20_000)]  # containers the collector tracks
    try:
        assert freeze_startup_heap() >= len(held) and gc.get_freeze_count() >= len(held)
    finally:
        gc.unfreeze()


def test_bad_config_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "epp.yaml"
    bad.write_text("epp: {grpc_prot: 1}\n")
    assert main(["--config", str(bad)]) == 2
    pods = tmp_path / "pods.yaml"
    pods.write_text("pools: [{name: a, pods: [{name: x}]}]\n")
    assert main(["--pods", str(pods), "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0"]) == 2


def _gone(pid: int) -> bool:
    """``pid`` has exited (reaped, or a zombie awaiting its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_front_that_cannot_start_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text(yaml.safe_dump({"pools": [{"name": "a", "models": ["m"],
                                               "pods": [{"name": "p", "address": "127.0.0.1", "port": 1}]}]}))
    monkeypatch.setenv("KVFLEET_EPP_FRONT", str(tmp_path / "no-such-program"))
    assert main(["--pods", str(pods), "--front", "native", "--grpc-port", "0", "--health-port", "0",
                 "--metrics-port", "0"]) == 2
    assert "kvfleet-epp-front is not installed" in capsys.readouterr().err


def test_process_serves_health_and_stops_on_sigterm(tmp_path: Path) -> None:
    """``python -m kvfleet.epp.main`` binds the configured ports, reports SERVING, exports its CPU per named
    thread (its front's process too), exits 0 on SIGTERM."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(yaml.safe_dump({"pools": [{"name": "a", "models": ["m"],
                                               "pods": [{"name": "p", "address": "127.0.0.1", "port": 1}]}]}))
    health, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.epp.main", "--pods", str(pods), "--host", "127.0.0.1",
         "--grpc-port", str(free_port()), "--health-port", str(health), "--metrics-port", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the EPP exited ({proc.returncode}): "
                            f"{proc.stderr.read().decode() if proc.stderr else ''}")
            return health_check(f"127.0.0.1:{health}", 0.5)

        wait_for(healthy, "the EPP's gRPC health SERVING", timeout_s=20, interval_s=0.1)
        children = [int(c) for t in Path(f"/proc/{proc.pid}/task").glob("*")
                    for c in (t / "children").read_text().split()]
        assert children or front_program() is None, "the native gRPC front runs as the EPP's child"
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        threads = {line.split('thread="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line.startswith("kvfleet_epp_thread_cpu_seconds_total{")}
        assert {"ext-proc-loop", "metrics-scraper"} <= set(threads), threads
        assert ("kvfleet-epp-front" in threads) == bool(children), threads
        assert "process_cpu_seconds_total" in text
        proc.terminate()
        assert proc.wait(10) == 0
        for pid in children:  # the native gRPC front stops with it
            wait_for(functools.partial(_gone, pid), f"the EPP's child {pid} gone", timeout_s=10,
                     interval_s=0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _models_exchange(target: str) -> bool:
    """One ext_proc stream asking for ``GET /v1/models`` (answered by the picker itself): answered?"""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    headers = pb.HttpHeaders(end_of_stream=True, headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in ((":path", "/v1/models"),
                                                                       (":method", "GET"))]))
    with grpc.insecure_channel(target) as ch:
        try:
            got = list(pb_grpc.ExternalProcessorStub(ch).Process(
                iter([pb.ProcessingRequest(request_headers=headers)]), timeout=5))
        except grpc.RpcError:
            return False
    return any(r.HasField("immediate_response") for r in got)


def test_sigterm_drains_before_stopping(tmp_path: Path) -> None:
    """With ``--drain-seconds``, a SIGTERM turns readiness NOT_SERVING (liveness and the ext_proc service's
    health stay SERVING) and the ext_proc port keeps answering streams until the drain ends, then the EPP
    exits 0; a second signal ends the drain at once."""
    import signal
    import time

    pods = tmp_path / "pods.yaml"
    pods.write_text(yaml.safe_dump({"pools": [{"name": "a", "models": ["m"],
                                               "pods": [{"name": "p", "address": "127.0.0.1", "port": 1}]}]}))

    def start(drain: float) -> tuple[subprocess.Popen[bytes], str, str]:
        grpc_port, health = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.epp.main", "--pods", str(pods), "--host", "127.0.0.1",
             "--grpc-port", str(grpc_port), "--health-port", str(health), "--metrics-port", str(free_port()),
             "--drain-seconds", str(drain)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: proc.poll() is not None or health_check(f"127.0.0.1:{health}", 0.5),
                 "the EPP's readiness SERVING", timeout_s=20, interval_s=0.1)
        assert proc.poll() is None
        return proc, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{health}"

    proc, target, health = start(3.0)
    try:
        assert _models_exchange(target)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not health_check(health, 0.5), "readiness NOT_SERVING", timeout_s=5, interval_s=0.05)
        assert health_check(health, 0.5, service="liveness") and proc.poll() is None
        # a gateway health-checking the ext_proc service keeps the draining replica
        assert health_check(health, 0.5, service="envoy.service.ext_proc.v3.ExternalProcessor")
        assert _models_exchange(target), "ext_proc streams are answered while draining"
        assert proc.wait(15) == 0 and time.monotonic() - t0 >= 2.5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    proc, _, _ = start(60.0)
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_thread_cpu_only_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvfleet_epp_thread_cpu_seconds_total{thread}``: a pool's threads share their label; a thread that
    ends, is renamed or whose id comes back with another thread leaves its count to its label, so no series
    falls; the front's process counts under ``kvfleet-epp-front`` across a restart; past the label bound,
    ``other``."""
    from kvfleet.cache import threadnames
    from kvfleet.epp import metrics as em

    readings: dict[str, dict[int, tuple[str, float]]] = {}
    monkeypatch.setattr(threadnames, "thread_cpu", lambda pid="self": readings.get(str(pid), {}))
    monkeypatch.setattr(threadnames, "process_cpu", lambda pid="self": (
        sum(c for _, c in readings[str(pid)].values()) if str(pid) in readings else None))
    front: list[int | None] = [None]
    m = EppMetrics()
    m.attach_threads(lambda: front[0])

    def scrape() -> dict[str, float]:
        fam = next(f for f in m.registry.collect() if f.name == "kvfleet_epp_thread_cpu_seconds")
        return {s.labels["thread"]: round(s.value, 6) for s in fam.samples}

    readings["self"] = {1: ("scrape_0", 1.0), 2: ("scrape_1", 0.5), 3: ("python", 0.1)}
    assert scrape() == {"scrape": 1.5, "python": 0.1}
    readings["self"] = {2: ("scrape_1", 0.1), 3: ("epp-gossip", 0.3)}  # 1 ended; 2 is a new thread; 3 renamed
    assert scrape() == {"scrape": 1.6, "python": 0.1, "epp-gossip": 0.2}
    front[0] = 40
    readings["40"] = {40: ("kvfleet-epp-fro", 2.0), 41: ("kvfleet-epp-fro", 1.0)}
    assert scrape()["kvfleet-epp-front"] == 3.0
    front[0] = 50  # restarted: a new process
    readings["50"] = {50: ("kvfleet-epp-fro", 0.5)}
    assert scrape()["kvfleet-epp-front"] == 3.5
    readings["self"] = {100 + i: (f"t{chr(97 + i % 26)}{chr(97 + i // 26)}", 0.01)
                        for i in range(em._ThreadCollector.MAX_LABELS)}
    got = scrape()
    assert len(got) == em._ThreadCollector.MAX_LABELS + 1 and got["other"] > 0  # the bound, then "other"
