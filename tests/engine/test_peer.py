"""Internal engine requests need the pool's signature; what they can pin is bounded.

Covers, over real HTTP: a client body carrying ``kv_transfer_params`` (any
value) without a valid peer signature — none, another secret, a stale
timestamp, a replayed nonce, a tampered body — is a 403 with an OpenAI-shaped
error, nothing is scheduled or held, and the answer names no internal address
or port; a signed one is served and its blocks are held; ``DELETE
/kvfleet/v1/kv/{id}`` and ``POST /kvfleet/v1/reset`` unsigned are 403 and change
nothing, signed they work; an engine without a transfer secret refuses them
all; blocks held for remote decode stop at half the GPU blocks (503, then
accepted again after a release), also for requests admitted together. Directly:
the signature covers method, path, timestamp, nonce and body, within ±30 s;
``PrefillPeers`` matches IP literals, resolved names and configured names only,
and caches lookups.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from kvfleet.config import ConfigError, load
from kvfleet.config.engine import parse_host_port
from kvfleet.engine.peer import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    NotAPeerError,
    PeerAuthError,
    PeerUnresolvedError,
    PeerVerifier,
    PrefillPeers,
    sign_request,
)
from tests.engine.conftest import SECRET, EngineFactory, RunningEngine

MODEL = "llama-3-8b"


def prefill_body(n: int = 64, ktp: Any = None, start: int = 0) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": list(range(start, start + n)),
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True} if ktp is None else ktp,
    }


def assert_refused(eng: RunningEngine, st: int, out: Any, text: str) -> None:
    assert st == 403, text
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["code"] == 403 and out["error"]["type"] == "permission_error"
    assert "kv_transfer_params" not in out
    port = eng.server.transfer_server.port if eng.server.transfer_server is not None else None
    for leak in ("127.0.0.1", "remote_host", "remote_port", "transfer_port", "remote_request_id"):
        assert leak not in text
    if port is not None:
        assert str(port) not in text


@pytest.mark.parametrize("ktp", [{"do_remote_decode": True}, {}, None, "yes", {"do_remote_decode": False}])
async def test_unsigned_kv_transfer_params_are_refused(
    make_engine: EngineFactory, pool_secret: bytes, ktp: Any
) -> None:
    eng = await make_engine(role="prefill")
    raw_body = prefill_body(ktp=ktp)
    raw_body["kv_transfer_params"] = ktp
    st, out, text = await eng.call("POST", "/v1/completions", raw_body)
    assert_refused(eng, st, out, text)
    assert eng.server.sched.held == {} and eng.server.holds == {}
    assert eng.server.sched.stats.prompt_tokens == 0
    assert eng.server.kv.blocks.usage == 0


async def test_badly_signed_kv_transfer_params_are_refused(
    make_engine: EngineFactory, pool_secret: bytes
) -> None:
    eng = await make_engine(role="both")
    path = "/v1/completions"
    raw = json.dumps(prefill_body()).encode()
    stale = sign_request(SECRET, "POST", path, raw, now=time.time() - 120)
    tampered = sign_request(SECRET, "POST", path, json.dumps(prefill_body(start=1)).encode())
    wrong_path = sign_request(SECRET, "POST", "/v1/chat/completions", raw)
    for headers in (stale, tampered, wrong_path,
                    {**sign_request(SECRET, "POST", path, raw), SIGNATURE_HEADER: "0" * 64}):
        st, out, text = await eng.call("POST", path, prefill_body(), headers=headers)
        assert_refused(eng, st, out, text)
    st, out, text = await eng.call("POST", path, prefill_body(), signed=True, secret=b"another-pool")
    assert_refused(eng, st, out, text)
    assert "wrong pool secret" in out["error"]["message"]
    # A valid request replayed with the same headers is refused the second time.
    good = sign_request(SECRET, "POST", path, raw)
    st, out, _ = await eng.call("POST", path, prefill_body(), headers=good)
    assert st == 200 and "kv_transfer_params" in out
    st, out, text = await eng.call("POST", path, prefill_body(), headers=good)
    assert_refused(eng, st, out, text)
    assert "replayed" in out["error"]["message"]
    assert list(eng.server.sched.held) == list(eng.server.holds) and len(eng.server.holds) == 1


async def test_signed_prefill_is_held_then_released_only_when_signed(
    make_engine: EngineFactory, pool_secret: bytes
) -> None:
    eng = await make_engine(role="prefill")
    st, out, _ = await eng.call("POST", "/v1/completions", prefill_body(70), signed=True)
    assert st == 200, out
    ktp = out["kv_transfer_params"]
    rid = ktp["remote_request_id"]
    assert ktp["num_blocks"] == 4 and len(ktp["block_hashes"]) == 4
    assert ktp["transfer_port"] == eng.server.transfer_server.port  # type: ignore[union-attr]
    assert "remote_host" not in ktp and "transfer_host" not in ktp
    assert set(eng.server.sched.held) == {rid}
    st, out, text = await eng.call("DELETE", f"/kvfleet/v1/kv/{rid}")
    assert_refused(eng, st, out, text)
    st, out, text = await eng.call("DELETE", f"/kvfleet/v1/kv/{rid}", signed=True, secret=b"another-pool")
    assert_refused(eng, st, out, text)
    assert set(eng.server.sched.held) == {rid}
    st, out, _ = await eng.call("DELETE", f"/kvfleet/v1/kv/{rid}", signed=True)
    assert st == 200 and out == {"released": rid}
    assert eng.server.sched.held == {} and eng.server.holds == {}
    st, _, _ = await eng.call("DELETE", f"/kvfleet/v1/kv/{rid}", signed=True)
    assert st == 404


async def test_reset_needs_a_signature(make_engine: EngineFactory, pool_secret: bytes) -> None:
    eng = await make_engine()
    req = {"model": MODEL, "prompt": list(range(64)), "max_tokens": 1}
    await eng.post("/v1/completions", req)
    for signed in (False, True):
        st, out, text = await eng.call("POST", "/kvfleet/v1/reset", signed=signed, secret=b"another-pool")
        assert_refused(eng, st, out, text)
    _, again, _ = await eng.post("/v1/completions", req)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    st, out, _ = await eng.call("POST", "/kvfleet/v1/reset", signed=True)
    assert st == 200 and out == {"reset": eng.server.es.pod_name}
    _, again, _ = await eng.post("/v1/completions", req)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_without_a_secret_internal_requests_are_refused(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFLEET_TRANSFER_SECRET", raising=False)
    eng = await make_engine(role="prefill")
    for method, path, body in (
        ("POST", "/v1/completions", prefill_body()),
        ("POST", "/kvfleet/v1/reset", None),
        ("DELETE", "/kvfleet/v1/kv/cmpl-sim-0-0", None),
    ):
        st, out, text = await eng.call(method, path, body, signed=True)
        assert_refused(eng, st, out, text)
        assert "no transfer secret" in out["error"]["message"]
    assert eng.server.sched.stats.prompt_tokens == 0


async def test_blocks_held_for_remote_decode_are_capped(
    make_engine: EngineFactory, pool_secret: bytes
) -> None:
    eng = await make_engine(role="prefill", num_gpu_blocks=64)  # cap: 32 blocks
    st, first, _ = await eng.call("POST", "/v1/completions", prefill_body(320), signed=True)  # 21 blocks
    assert st == 200
    assert eng.server.held_blocks == 21
    st, out, text = await eng.call("POST", "/v1/completions", prefill_body(320, start=5000), signed=True)
    assert st == 503 and out["error"]["type"] == "service_unavailable", text
    assert "cap is 32" in out["error"]["message"]
    assert "kv_transfer_params" not in out
    assert len(eng.server.sched.held) == 1
    rid = first["kv_transfer_params"]["remote_request_id"]
    st, _, _ = await eng.call("DELETE", f"/kvfleet/v1/kv/{rid}", signed=True)
    assert st == 200 and eng.server.held_blocks == 0
    st, _, _ = await eng.call("POST", "/v1/completions", prefill_body(320, start=5000), signed=True)
    assert st == 200


async def test_the_cap_holds_for_concurrent_prefills(make_engine: EngineFactory, pool_secret: bytes) -> None:
    """Two prefill-only requests admitted together: the one whose hold would pass the cap is a 503 and
    freed."""
    eng = await make_engine(role="prefill", num_gpu_blocks=64)  # cap: 32 blocks
    calls = [eng.call("POST", "/v1/completions", prefill_body(320, start=s), signed=True) for s in (0, 5000)]
    results = await asyncio.gather(*calls)
    assert sorted(st for st, _, _ in results) == [200, 503], results
    assert len(eng.server.sched.held) == 1 and eng.server.held_blocks == 21
    assert len(eng.server.holds) == 1


async def test_a_decode_engine_does_not_prefill_for_others(
    make_engine: EngineFactory, pool_secret: bytes
) -> None:
    eng = await make_engine(role="decode")
    st, out, text = await eng.call("POST", "/v1/completions", prefill_body(), signed=True)
    assert st == 503 and "no KV transfer port" in out["error"]["message"], text
    assert eng.server.sched.stats.prompt_tokens == 0 and eng.server.holds == {}


# -- the pieces directly -------------------------------------------------------------------------


def test_signature_covers_every_part_and_the_window() -> None:
    clock = [1_000_000.0]
    v = PeerVerifier(SECRET, clock=lambda: clock[0])
    h = sign_request(SECRET, "POST", "/kvfleet/v1/reset", b"", now=clock[0])
    assert set(h) == {TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER}
    for method, path, body in (("GET", "/kvfleet/v1/reset", b""), ("POST", "/kvfleet/v1/reset?x=1", b""),
                               ("POST", "/kvfleet/v1/reset", b"{}")):
        with pytest.raises(PeerAuthError):
            v.verify(method, path, h, body)
    clock[0] += 29
    v.verify("post", "/kvfleet/v1/reset", h, b"")
    with pytest.raises(PeerAuthError, match="replayed"):
        v.verify("POST", "/kvfleet/v1/reset", h, b"")
    late = sign_request(SECRET, "POST", "/p", now=clock[0] - 31)
    with pytest.raises(PeerAuthError, match="30s"):
        v.verify("POST", "/p", late, b"")
    with pytest.raises(PeerAuthError, match="malformed"):
        v.verify("POST", "/p", {**late, TIMESTAMP_HEADER: "-5"}, b"")
    with pytest.raises(PeerAuthError, match="no transfer secret"):
        PeerVerifier(None).verify("POST", "/p", sign_request(SECRET, "POST", "/p"), b"")


async def test_prefill_peers_membership() -> None:
    lookups: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        lookups.append(host)
        if host == "gone.ns.svc":
            raise OSError("NXDOMAIN")
        return ["10.1.0.5", "fd00::5", "::ffff:10.1.0.6"]

    peers = PrefillPeers(["10.0.0.1:8000", "[fd00::1]:8000", "pool.ns.svc:8000", "gone.ns.svc:9000"],
                         resolver=resolver)
    for ok in ("10.0.0.1:8000", "[fd00:0::1]:8000", "10.1.0.5:8000", "[fd00::5]:8000", "10.1.0.6:8000",
               "[::ffff:10.1.0.5]:8000"):
        got = await peers.admit(parse_host_port(ok))
        assert got == parse_host_port(ok)
    for bad in ("10.0.0.1:8001", "10.1.0.7:8000", "other.ns.svc:8000", "pool.ns.svc:8001", "10.1.0.5:9000"):
        with pytest.raises(NotAPeerError):
            await peers.admit(parse_host_port(bad))
    named = await peers.admit(parse_host_port("POOL.ns.svc:8000"))
    assert (named.ip is not None and str(named.ip) in ("10.1.0.5", "fd00::5", "10.1.0.6")
            and named.port == 8000)
    with pytest.raises(PeerUnresolvedError):
        await peers.admit(parse_host_port("gone.ns.svc:9000"))
    assert "other.ns.svc" not in lookups
    assert lookups.count("pool.ns.svc") == 1  # cached for the TTL


def test_prefill_peers_setting_is_validated() -> None:
    assert (load(None, {"engine": {"prefill_peers": ["p.ns.svc:8000", "[::1]:1"]}}).engine.prefill_peers
            == ("p.ns.svc:8000", "[::1]:1"))
    for bad in (["p.ns.svc"], ["10.0.0.1:70000"], ["a:1,b:2"]):
        with pytest.raises(ConfigError, match="prefill_peers"):
            load(None, {"engine": {"prefill_peers": bad}})
