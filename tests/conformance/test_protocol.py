"""GIE's endpoint picker protocol (v1.0), rule by rule, against an EPP driven over ext_proc gRPC only.

Rules (docs/proposals/004-endpoint-picker-protocol of gateway-api-inference-extension):

1. The pick is set both as the request header ``x-gateway-destination-endpoint`` and as dynamic metadata
   ``envoy.lb`` → ``x-gateway-destination-endpoint``, with the same value: one ``ip:port`` or an ordered,
   comma-separated list (primary first, then fallbacks), each an endpoint of the pool.
2. A subset hint (``envoy.lb.subset_hint`` → ``x-gateway-destination-endpoint-subset`` in the request's
   ``metadata_context``) is honoured: every endpoint returned is in it, the fallbacks too (never widened).
3. A subset with no eligible endpoint, or an empty one: ImmediateResponse 503.
4. No ready endpoint in the pool: ImmediateResponse 503; picks resume when endpoints come back.
5. A request the picker sheds (every endpoint saturated): ImmediateResponse 429.
6. Streaming (FULL_DUPLEX_STREAMED): a request body in several chunks is picked once it is complete and is
   streamed back to the data plane byte for byte, after the destination is set; a response body in chunks
   is streamed back byte for byte. BUFFERED mode picks with the body answer.
7. ``x-gateway-destination-endpoint-served`` in the response's ``metadata_context`` is read: the response
   phase continues, and (where the target shows it) the target counts a response served by a fallback.
8. gRPC health: ``liveness``, ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` are
   SERVING on a ready picker; an unknown service name is NOT_FOUND.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.conformance.conftest import MODEL, SHED_WAITING, Target
from tests.conformance.extproc import BUFFERED, EXT_PROC_SERVICE, Pick, completion, health

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(120)]

ENDPOINT = re.compile(r"^\d{1,3}(\.\d{1,3}){3}:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$")
NOWHERE = "10.255.255.1:8000"


def pick(target: Target, body: bytes | None = None, **kw: object) -> Pick:
    ex = target.exchange(**({"mode": kw.pop("mode")} if "mode" in kw else {}))  # type: ignore[arg-type]
    try:
        return ex.request(body if body is not None else completion(f"hello {time.monotonic_ns()}", MODEL),
                          **kw)  # type: ignore[arg-type]
    finally:
        ex.close()


def test_pick_is_set_as_header_and_metadata_with_the_same_endpoint_list(target: Target) -> None:
    for _ in range(10):
        p = pick(target)
        assert p.status is None, f"no pick: {p.status} {p.immediate_body!r}"
        assert p.header is not None, "x-gateway-destination-endpoint header not set"
        assert p.metadata is not None, "envoy.lb / x-gateway-destination-endpoint metadata not set"
        assert p.header == p.metadata, f"header {p.header!r} and metadata {p.metadata!r} differ"
        eps = p.endpoints
        assert eps and all(ENDPOINT.match(e) for e in eps), f"not ip:port entries: {p.header!r}"
        assert len(set(eps)) == len(eps), f"an endpoint listed twice: {eps}"
        assert set(eps) <= set(target.endpoints), f"{eps} outside the pool {target.endpoints}"


@pytest.mark.parametrize("size", [1, 2])
def test_subset_hint_is_honoured_and_never_widened(target: Target, size: int) -> None:
    for first in range(len(target.endpoints)):
        subset = [target.endpoints[(first + i) % len(target.endpoints)] for i in range(size)]
        p = pick(target, subset=subset)
        assert p.status is None, f"subset {subset}: no pick ({p.status})"
        assert p.endpoints and set(p.endpoints) <= set(subset), f"subset {subset} widened to {p.endpoints}"
        assert p.header == p.metadata


@pytest.mark.parametrize("subset", [[NOWHERE], []], ids=["no-eligible-endpoint", "empty"])
def test_subset_without_an_eligible_endpoint_is_503(target: Target, subset: list[str]) -> None:
    p = pick(target, subset=subset)
    assert p.status == 503, f"subset {subset}: expected 503, got {p.status} / {p.header}"
    assert p.header is None


def pick_until(target: Target, status: int, what: str, timeout_s: float = 20.0) -> None:
    """Pick until the target answers ``status``; until then every answer must be a pick."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        last = pick(target)
        if last.status == status:
            return
        assert last.status is None, f"expected a pick or {status}, got {last.status}"
        time.sleep(0.2)
    raise AssertionError(f"no {status} {what}: {last}")


def test_no_ready_endpoint_is_503_and_picks_resume(target: Target) -> None:
    try:
        for s in target.servers:
            s.stop()
        pick_until(target, 503, "with every endpoint down")
    finally:
        for s in target.servers:
            s.start()
    target.wait_picks()


def test_a_saturated_pool_sheds_with_429(target: Target) -> None:
    try:
        for s in target.servers:
            s.waiting = SHED_WAITING * 4
        pick_until(target, 429, "with every endpoint saturated")
    finally:
        for s in target.servers:
            s.waiting = 0
    target.wait_picks()


@pytest.mark.parametrize("chunks", [1, 3, 17])
def test_streamed_request_body_is_picked_when_complete_and_streamed_back(target: Target, chunks: int) -> None:
    body = json.dumps({"model": MODEL, "prompt": "the quick brown fox " * 400, "max_tokens": 4}).encode()
    p = pick(target, body, chunks=chunks)
    assert p.status is None and p.endpoints
    assert p.body_ended and p.body_back == body, "the request body did not come back byte for byte"


def test_buffered_mode_picks_with_the_body_answer(target: Target) -> None:
    p = pick(target, mode=BUFFERED)
    assert p.status is None and p.endpoints and p.header == p.metadata


def test_response_phase_reads_the_served_endpoint_and_streams_the_body(target: Target) -> None:
    counter = target.caps.get("served_by_fallback")
    before = target.counter(counter) if counter else None
    ex = target.exchange()
    try:
        p = ex.request(completion(f"served {time.monotonic_ns()}", MODEL))
        assert p.status is None and len(p.endpoints) >= 1
        served = p.endpoints[1] if len(p.endpoints) > 1 else p.endpoints[0]
        answer = json.dumps({"choices": [{"text": "ok"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                       "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
        assert ex.respond(served, answer, chunks=4) == answer
    finally:
        ex.close()
    if counter and len(p.endpoints) > 1:
        assert target.counter(counter) == (before or 0.0) + 1, "the served (fallback) endpoint was not read"


@pytest.mark.parametrize("service", ["liveness", "readiness", EXT_PROC_SERVICE])
def test_health_services_are_serving_on_a_ready_picker(target: Target, service: str) -> None:
    assert health(target.health_address, service) == "SERVING"


def test_an_unknown_health_service_is_not_found(target: Target) -> None:
    assert health(target.health_address, "no.such.Service") == "NOT_FOUND"
