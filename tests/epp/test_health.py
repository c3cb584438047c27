"""Dead pods are routed around without Kubernetes: the metrics scrape is the picker's active health check.

Covers: with the static pods file, a pod that refuses connections is out of rotation within 2 s of the
picker starting (measured) and no request through a real Envoy reaches it, even under a round-robin
picker that would send it every third request; when something answers on its port again it is back in
rotation; a pod whose metrics answer slowly (a timeout, a busy engine) stays in.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from kvfleet.demo.envoy import EnvoyProcess, free_port
from kvfleet.epp.podmetrics import MetricsScraper, MetricsStore
from tests.conftest import wait_for
from tests.epp.pods import PodFleet, post

pytestmark = pytest.mark.e2e
EnvoyF = Callable[..., EnvoyProcess]


class Revenant(BaseHTTPRequestHandler):
    """A pod that comes back: answers /metrics and completions on the dead pod's port."""

    served: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        body = b'vllm:num_requests_waiting{model_name="m"} 0\n'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        Revenant.served.append(self.path)
        body = json.dumps({"choices": [{"text": "back"}], "usage": {"prompt_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("x-pod", "ghost")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def ghost_port() -> Iterator[int]:
    yield free_port()


def test_dead_pod_is_out_within_two_seconds_and_back_when_it_answers(
    fleet: PodFleet, envoy_factory: EnvoyF, ghost_port: int
) -> None:
    from kvfleet.config import load
    from kvfleet.epp.app import Epp
    from kvfleet.epp.datastore import StaticDatastore

    data = fleet.pools_config()
    data["pools"][0]["pods"].append({"name": "ghost", "address": "127.0.0.1", "port": ghost_port,
                                     "metrics": f"http://127.0.0.1:{ghost_port}/metrics"})
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0,
                                       "plugins": [
                                           {"type": "ready-filter"},
                                           {"type": "round-robin-picker", "params": {"fallbacks": 0}}]}})
    started = time.monotonic()
    epp = Epp(settings, datastore=StaticDatastore(data=data)).start()
    try:
        wait_for(lambda: epp.store.down("ghost"), timeout_s=2.0, what="the dead pod out of rotation",
                 interval_s=0.02)
        out_after = time.monotonic() - started
        print(f"[health] dead pod out of rotation {out_after:.2f}s after the picker started")
        env = envoy_factory(epp_port=epp.grpc_port)
        url = f"http://127.0.0.1:{env.listen_port}/v1/completions"
        got = [post(url, {"model": "m", "prompt": f"{i}"}) for i in range(12)]
        assert [s for s, _, _ in got] == [200] * 12
        assert {h["x-pod"] for _, h, _ in got} == {"pod-0", "pod-1", "pod-2"}
        server = ThreadingHTTPServer(("127.0.0.1", ghost_port), Revenant)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            wait_for(lambda: not epp.store.down("ghost"), timeout_s=3.0, what="the pod back in rotation")
            got = [post(url, {"model": "m", "prompt": f"again {i}"}) for i in range(8)]
            assert "ghost" in {h.get("x-pod") for _, h, _ in got} and Revenant.served
        finally:
            server.shutdown()
            server.server_close()
    finally:
        epp.stop()


def test_a_slow_pod_is_not_dead() -> None:
    """Timeouts only make the metrics stale; only refused connections take a pod out."""
    import socket

    with socket.socket() as lsock:  # accepts, never answers
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(8)
        store = MetricsStore()
        scraper = MetricsScraper(store, interval_s=0.2)
        scraper.set_target("slow", f"http://127.0.0.1:{lsock.getsockname()[1]}/metrics")
        scraper.set_target("dead", f"http://127.0.0.1:{free_port()}/metrics")
        for _ in range(3):
            scraper.scrape_once()
        scraper.stop()
        assert store.down("dead") and not store.down("slow") and store.errors["slow"] == 3


def test_gateway_reports_an_unreachable_pod_at_once(
    fleet: PodFleet, envoy_factory: EnvoyF, ghost_port: int
) -> None:
    """A dead pod without a metrics endpoint (no scrape to notice it): the first request routed there fails
    (503 JSON ``upstream_unavailable``), Envoy tells the picker, and no later request goes there; the client
    never sees the internal header."""
    from kvfleet.config import load
    from kvfleet.epp.app import Epp
    from kvfleet.epp.datastore import StaticDatastore
    from kvfleet.epp.protocol import UNREACHABLE_HEADER

    data = fleet.pools_config()
    data["pools"][0]["pods"].insert(0, {"name": "ghost", "address": "127.0.0.1", "port": ghost_port})
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0,
                                       "plugins": [
                                           {"type": "ready-filter"},
                                           {"type": "round-robin-picker", "params": {"fallbacks": 0}}]}})
    epp = Epp(settings, datastore=StaticDatastore(data=data)).start()
    try:
        env = envoy_factory(epp_port=epp.grpc_port)
        url = f"http://127.0.0.1:{env.listen_port}/v1/completions"
        got = [post(url, {"model": "m", "prompt": f"{i}"}) for i in range(12)]
        failed = [(s, json.loads(b)["error"]["type"]) for s, _, b in got if s != 200]
        assert failed == [(503, "upstream_unavailable")], failed
        assert all(UNREACHABLE_HEADER not in h for _, h, _ in got)
        assert epp.store.down("ghost")
    finally:
        epp.stop()


def test_a_dropped_kv_event_connection_takes_the_pod_out_at_once(fleet: PodFleet) -> None:
    """An engine killed with -9 drops its KV-event connection: the picker takes it out of rotation at once
    (no scrape needed: this pod has no metrics endpoint), well before any request could fail there."""
    import zmq

    from kvfleet.config import load
    from kvfleet.epp.app import Epp
    from kvfleet.epp.datastore import StaticDatastore

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    data = fleet.pools_config()
    data["pools"][0]["pods"].append({"name": "doomed", "address": "127.0.0.1", "port": free_port(),
                                     "events": f"tcp://127.0.0.1:{port}"})
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0}})
    epp = Epp(settings, datastore=StaticDatastore(data=data)).start()
    try:
        wait_for(lambda: "doomed" in epp.subscriber.stats, what="the picker subscribed")

        def heard() -> bool:  # garbage is rejected and counted: proof the connection is up
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"])
            return epp.subscriber.stats["doomed"].rejected > 0

        wait_for(heard, what="the KV-event connection up")
        assert not epp.store.down("doomed")
        pub.close(0)
        t0 = time.monotonic()
        wait_for(lambda: epp.store.down("doomed"), timeout_s=2.0, what="the pod out of rotation",
                 interval_s=0.02)
        print(f"[health] out of rotation {1000 * (time.monotonic() - t0):.0f} ms "
              "after its KV-event socket closed")
    finally:
        epp.stop()
