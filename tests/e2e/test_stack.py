"""Through real Envoy and the EPP to simulated engines: prefix routing, P/D, EPP failure and index rebuild.

Covers, on one running stack (module fixture):
- requests that share a prefix land on the pod that holds it and report it as cached
  (``usage.prompt_tokens_details.cached_tokens``);
- a request the EPP sends to the P/D pool (decode pod + ``x-prefiller-host-port``) returns
  the same tokens as a unified engine given the same prompt;
- a client that names its own prefiller (``x-prefiller-host-port`` to a host outside the
  pool) or sends ``kv_transfer_params`` gets no connection made to that host, no
  ``kv_transfer_params`` and no internal address back; unsigned resets are refused;
- with the EPP killed, Envoy fails closed (5xx, as configured); after a restart the EPP
  rebuilds its index from the engines' KV events (replay) and routing is prefix-aware
  again within a bounded time, which is measured and printed.
"""

from __future__ import annotations

import itertools
import signal
import socket
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from tests.e2e.conftest import MODEL, Fleet, http_json, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

_ids = itertools.count(1)


def fresh_prompt(n: int = 640) -> list[int]:
    base = 1_000_000 * next(_ids)
    return list(range(base, base + n))


def counter(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def predicted_hits(fleet: Fleet) -> float:
    return counter(fleet.epp_metrics(), "kvfleet_epp_predicted_hit_tokens_total")


def wait_routed_with_cache(fleet: Fleet, prefix: list[int], want_pod: str,
                           timeout_s: float) -> tuple[float, dict[str, str], Any]:
    """Send prefix + a new suffix until the EPP predicts a hit and the answer comes from ``want_pod``
    with cached tokens (so the pick was prefix-aware, not luck); returns the wait."""
    t0 = time.monotonic()

    def routed() -> tuple[dict[str, str], Any]:
        predicted = predicted_hits(fleet)
        st, body, hdrs = fleet.complete(prefix + fresh_prompt(20))
        assert (
            st == 200
            and hdrs.get("x-kvfleet-pod") == want_pod
            and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            and predicted_hits(fleet) > predicted
        ), f"answer {(st, body, hdrs)}"
        return hdrs, body

    hdrs, body = wait_for(routed, f"a request routed to {want_pod} with a cache hit", timeout_s=timeout_s,
                          interval_s=0.2)
    return time.monotonic() - t0, hdrs, body


def test_shared_prefix_lands_on_its_pod_and_is_cached(fleet: Fleet) -> None:
    prefix = fresh_prompt(640)
    st, first, hdrs = fleet.complete(prefix + fresh_prompt(20))
    assert st == 200, first
    holder = hdrs["x-kvfleet-pod"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, _, body = wait_routed_with_cache(fleet, prefix, holder, timeout_s=15)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 640 - 16
    for _ in range(3):  # and it keeps doing so
        st, again, hdrs = fleet.complete(prefix + fresh_prompt(20))
        assert hdrs["x-kvfleet-pod"] == holder
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 640 - 16


def test_follow_up_chat_turn_goes_to_its_conversation_with_the_engines_cached_tokens(fleet: Fleet) -> None:
    """The stack's pools run a real model's tokenizer and chat template (Qwen2.5's files, the default of
    the simulator and the EPP): a conversation's second turn, through Envoy, lands on the pod that served
    the first, and the tokens the EPP predicted cached equal those the engine reports cached."""
    base = next(_ids) * 1000
    doc = " ".join(f"Container {i} cleared customs at berth {i % 7} after a {i % 5}-hour inspection."
                   for i in range(base, base + 90))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You answer questions about shipping."},
                                  {"role": "user", "content": doc + "\nWhich were inspected longest?"}]
    st, first, hdrs = http_json(fleet.gateway + "/v1/chat/completions",
                                {"model": MODEL, "messages": msgs, "max_tokens": 8})
    assert st == 200, first
    holder = hdrs["x-kvfleet-pod"]
    assert first["usage"]["prompt_tokens"] > 1000  # Qwen tokens: ~4-5 characters each, not one per byte
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And which berth saw the most?"}]

    def second() -> tuple[float, Any]:
        before = predicted_hits(fleet)
        st, body, hdrs = http_json(fleet.gateway + "/v1/chat/completions",
                                   {"model": MODEL, "messages": msgs, "max_tokens": 4})
        predicted = predicted_hits(fleet) - before
        assert st == 200 and hdrs["x-kvfleet-pod"] == holder and predicted > 0, (st, body, hdrs, predicted)
        return predicted, body

    predicted, body = wait_for(second, "the follow-up turn routed to its conversation", timeout_s=15,
                               interval_s=0.2)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert predicted == cached >= first["usage"]["prompt_tokens"] // 16 * 16


@pytest.mark.parametrize(("message", "status"), [
    ({"role": "narrator", "content": "It was late."}, 200),  # vLLM passes it; Qwen's template skips it
    ({"role": "user"}, 200),  # vLLM takes a message without content
    ({"role": "user", "content": None}, 400),  # and refuses an explicit null (interop: test_chat_tokens)
])
def test_odd_chat_messages_get_the_engines_answer_through_the_gateway(
    fleet: Fleet, message: dict[str, Any], status: int
) -> None:
    """Chat messages at the edge: the picker passes them on (keyed or routed on load), the engine answers as
    vLLM does, and a refusal reaches the client as an OpenAI-shaped 400 naming the field."""
    msgs = [{"role": "system", "content": "Be brief."}, message, {"role": "user", "content": "Hi."}]
    st, body, _ = http_json(fleet.gateway + "/v1/chat/completions",
                            {"model": MODEL, "messages": msgs, "max_tokens": 2})
    assert st == status, body
    if status == 400:
        assert body["error"]["param"] == "messages" and "null" in body["error"]["message"]


def test_pd_returns_the_same_tokens_as_a_unified_engine(fleet: Fleet) -> None:
    decode = next(p for p in fleet.pods if p.role == "decode")
    prefill = next(p for p in fleet.pods if p.role == "prefill")
    unified = next(p for p in fleet.pods if p.role == "both")
    # level 1 shards prompts over pools by prefix: try prompts until one goes to the P/D pool
    for _ in range(40):
        prompt = fresh_prompt(900)
        before = counter(scrape(f"http://127.0.0.1:{prefill.port}/metrics"), "vllm:prompt_tokens_total")
        st, via_pd, hdrs = fleet.complete(prompt, max_tokens=8)
        assert st == 200, via_pd
        if hdrs.get("x-kvfleet-pod") != decode.name:
            continue
        after = counter(scrape(f"http://127.0.0.1:{prefill.port}/metrics"), "vllm:prompt_tokens_total")
        assert after - before == len(prompt), "the prefill pod did not run the prompt"
        st, direct, _ = http_json(f"http://127.0.0.1:{unified.port}/v1/completions",
                                  {"model": MODEL, "prompt": prompt, "max_tokens": 8})
        assert st == 200
        assert via_pd["choices"][0]["text"] == direct["choices"][0]["text"]
        mism = counter(scrape(f"http://127.0.0.1:{decode.port}/metrics"),
                       "kvfleet_engine_kv_mismatched_blocks_total")
        assert mism == 0
        return
    pytest.fail("no prompt was routed to the P/D pool in 40 tries")


def test_client_supplied_pd_controls_are_refused(fleet: Fleet) -> None:
    accepted: list[object] = []
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                continue
            accepted.append(conn)
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    attacker = f"127.0.0.1:{lsock.getsockname()[1]}"
    try:
        for _ in range(6):  # over several prompts, so both shards would see it
            st, body, _ = fleet.complete(fresh_prompt(300), headers={"x-prefiller-host-port": attacker})
            assert st == 400, body  # the gateway refuses it before the picker
            st, body, _ = fleet.complete(fresh_prompt(300), kv_transfer_params={"do_remote_decode": True})
            assert st == 400, body  # the picker refuses it before any engine
            text = str(body)
            assert ("kv_transfer_params" not in (body or {}) and "remote_request_id" not in text
                    and "transfer_port" not in text)
        for p in fleet.pods:  # no cache state changed: nothing is held for a pull on any engine
            held = [s for f in text_string_to_metric_families(scrape(f"http://127.0.0.1:{p.port}/metrics"))
                    if f.name == "kvfleet_engine_held_blocks" for s in f.samples]
            assert held and all(s.value == 0 for s in held), (p.name, held)
        for p in fleet.pods:
            st, body, _ = http_json(f"http://127.0.0.1:{p.port}/kvfleet/v1/reset", {})
            assert st == 403, body
            st, body, _ = http_json(f"http://127.0.0.1:{p.port}/v1/completions",
                                    {"model": MODEL, "prompt": fresh_prompt(40), "max_tokens": 1},
                                    headers={"x-prefiller-host-port": attacker})
            assert st == 403 if p.role != "prefill" else st == 200, body
        time.sleep(0.3)  # a time gap: a connection to the attacker, had one been made, would have arrived
        assert accepted == [], "an engine connected to a prefiller outside its pool"
    finally:
        stop.set()
        t.join(2)
        lsock.close()
    fleet.check_alive()


def test_epp_down_fails_closed_then_restart_rebuilds_the_index(fleet: Fleet,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    prefix = fresh_prompt(640)
    st, _, hdrs = fleet.complete(prefix + fresh_prompt(20))
    assert st == 200
    holder = hdrs["x-kvfleet-pod"]
    wait_routed_with_cache(fleet, prefix, holder, timeout_s=15)
    assert fleet.epp is not None
    fleet.stack.stop(fleet.epp, sig=signal.SIGKILL)
    st, body, _ = fleet.complete(prefix + fresh_prompt(20))
    assert st >= 500, ("with the EPP down and failure_mode_allow off Envoy must fail the request, "
                       f"got {st} {body}")
    t0 = time.monotonic()
    fleet.start_epp()
    waited, _, _ = wait_routed_with_cache(fleet, prefix, holder, timeout_s=30)

    def index_rebuilt() -> bool:
        if counter(fleet.epp_metrics(), "kvfleet_epp_index_entries") >= len(prefix) // 16:
            return True
        fleet.complete(fresh_prompt(20))  # an idle pod publishes nothing; any event lets the EPP see its gap
        return False

    wait_for(index_rebuilt, "the EPP's index rebuilt from the engines' KV events",
             timeout_s=max(0.0, 30 - (time.monotonic() - t0)), interval_s=0.2)
    wait_routed_with_cache(fleet, prefix, holder, timeout_s=10)
    rebuilt = time.monotonic() - t0
    with capsys.disabled():
        print(f"\n[e2e] EPP restart → prefix-aware routing again after {rebuilt:.2f}s "
              f"(first matching answer after {waited:.2f}s)")
