"""The native gRPC front (``kvfleet-epp-front``, kvfleet/epp/front.py) against the picker served by grpc.aio:
the same answers over real gRPC, health and refusals on its port, calls that end early, a killed front, and
a broken socket. Every test runs the real front program built by ``pip install`` (Go on PATH)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.epp import front as fr
from kvfleet.epp.app import Epp
from kvfleet.epp.protocol import DEST_HEADER, POOL_METADATA
from tests.epp.pods import PodFleet

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED

pytestmark = pytest.mark.skipif(fr.front_program() is None and shutil.which("go") is None,
                                reason="no Go toolchain: kvfleet-epp-front is not built")


def test_the_front_is_installed_where_go_is() -> None:
    assert fr.front_program() is not None, "pip install with `go` on PATH builds kvfleet-epp-front"


def _headers(path: str, method: str = "POST", extra: tuple[tuple[str, str], ...] = ()) -> pb.HttpHeaders:
    pairs = [(":path", path), (":method", method), *extra]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))


def _exchange(path: str, body: bytes | None, method: str = "POST", mode: int = FULL_DUPLEX,
              response: bool = True) -> list[pb.ProcessingRequest]:
    cfg = pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode)
    msgs = [pb.ProcessingRequest(request_headers=_headers(path, method), protocol_config=cfg)]
    if body is None:
        msgs[0].request_headers.end_of_stream = True
    else:
        msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    if response:
        msgs += [
            pb.ProcessingRequest(response_headers=_headers("", extra=((":status", "200"),))),
            pb.ProcessingRequest(response_body=pb.HttpBody(
                body=json.dumps({"usage": {"prompt_tokens": 9}}).encode(), end_of_stream=True)),
        ]
    return msgs


def _body(prompt: str, model: str = "m", **kw: Any) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, **kw}).encode()


#: (name, messages): what a data plane sends, answered alike by both fronts
CASES: list[tuple[str, list[pb.ProcessingRequest]]] = [
    ("completion", _exchange("/v1/completions", _body("the same prompt " * 40))),
    ("chat", _exchange("/v1/chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi " * 30}]}).encode())),
    ("buffered", _exchange("/v1/completions", _body("buffered " * 30), mode=BUFFERED)),
    ("models", _exchange("/v1/models", None, method="GET", response=False)),
    ("internal path", _exchange("/kvfleet/blocks", b"{}", response=False)),
    ("wrong method", _exchange("/v1/completions", None, method="DELETE", response=False)),
    ("bad json", _exchange("/v1/completions", b"{not json", response=False)),
    ("unknown model", _exchange("/v1/completions", _body("x", model="nope"), response=False)),
    ("too large", _exchange("/v1/completions", _body("y" * 70_000), response=False)),
]


def _call(target: str, msgs: list[pb.ProcessingRequest],
          metadata: tuple[tuple[str, str], ...] = ()) -> list[pb.ProcessingResponse]:
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=10, metadata=metadata))


@pytest.fixture
def pair(epp_factory: Callable[..., Epp]) -> Iterator[tuple[Epp, Epp]]:
    native = epp_factory(front="native", max_body_bytes=65_536, events_enabled=False)
    aio = epp_factory(front="grpcio", max_body_bytes=65_536, events_enabled=False)
    assert native.front is not None and aio.front is None
    yield native, aio


def _endpoints(resps: list[pb.ProcessingResponse]) -> list[str]:
    found = []
    for r in resps:
        for part in (r.request_headers, r.request_body):
            for h in part.response.header_mutation.set_headers:
                if h.header.key == DEST_HEADER:
                    found.append(h.header.raw_value.decode())
    return found


def _strip_endpoint(resps: list[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
    out = []
    for r in resps:
        c = pb.ProcessingResponse()
        c.CopyFrom(r)
        for part in (c.request_headers, c.request_body):
            for h in part.response.header_mutation.set_headers:
                if h.header.key == DEST_HEADER:
                    h.header.raw_value = b"<pick>"
        c.ClearField("dynamic_metadata")
        out.append(c)
    return out


@pytest.mark.parametrize("name,msgs", CASES, ids=[c[0] for c in CASES])
def test_both_fronts_answer_alike(pair: tuple[Epp, Epp], name: str, msgs: list[pb.ProcessingRequest]) -> None:
    native, aio = pair
    a = _call(f"127.0.0.1:{native.grpc_port}", msgs)
    b = _call(f"127.0.0.1:{aio.grpc_port}", msgs)
    assert a, name
    assert _strip_endpoint(a) == _strip_endpoint(b)
    assert len(_endpoints(a)) == len(_endpoints(b))


#: request headers the picker refuses (name, path, method, headers), sent in BUFFERED mode (kvfleet's chart)
REFUSED_HEADERS = [
    ("internal path", "/kvfleet/blocks", "POST", ()),
    ("unknown path", "/v2/nothing", "POST", ()),
    ("wrong method", "/v1/completions", "PUT", ()),
    ("declared too large", "/v1/completions", "POST", (("content-length", "70000"),)),
]


def _buffered(path: str, method: str = "POST", extra: tuple[tuple[str, str], ...] = (),
              body: bytes | None = b"{}") -> list[pb.ProcessingRequest]:
    cfg = pb.ProtocolConfiguration(request_body_mode=BUFFERED, response_body_mode=BUFFERED)
    msgs = [pb.ProcessingRequest(request_headers=_headers(path, method, extra), protocol_config=cfg)]
    if body is not None:
        msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    return msgs


@pytest.mark.parametrize("name,path,method,extra", REFUSED_HEADERS, ids=[c[0] for c in REFUSED_HEADERS])
def test_buffered_headers_are_answered_ahead_and_a_refusal_comes_with_the_body(
        pair: tuple[Epp, Epp], name: str, path: str, method: str, extra: tuple[tuple[str, str], ...]) -> None:
    """BUFFERED request headers get the fixed answer from the front; the picker still checks them, and what
    grpc.aio's server refuses at once (Envoy then sends no body) comes as the same immediate response to
    the body, sent or not."""
    native, aio = pair
    assert native.front is not None and native.front.bridge is not None
    bridge = native.front.bridge
    want = _call(f"127.0.0.1:{aio.grpc_port}", _buffered(path, method, extra))
    assert [r.WhichOneof("response") for r in want] == ["immediate_response"], name
    for body in (b"{}", None):  # with the body; headers only, then the client's end of the stream
        before = bridge.headers_ahead
        got = _call(f"127.0.0.1:{native.grpc_port}", _buffered(path, method, extra, body))
        assert got == [pb.ProcessingResponse(request_headers=pb.HeadersResponse()), want[0]], name
        assert bridge.headers_ahead == before + 1


def _not_ahead() -> list[tuple[str, list[pb.ProcessingRequest]]]:
    """First messages the front must hand to the picker unanswered: not exactly BUFFERED request headers that
    go on."""
    body = _body("not ahead " * 30)
    streamed = _buffered("/v1/completions", body=body)
    streamed[0].protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    observed = _buffered("/v1/completions", body=body)
    observed[0].observability_mode = True
    # an HttpHeaders field the front does not know (number 9, a varint): kept by protobuf as unknown
    odd_headers = pb.HttpHeaders.FromString(_headers("/v1/completions").SerializeToString() + b"\x48\x01")
    odd = _buffered("/v1/completions", body=body)
    odd[0].request_headers.CopyFrom(odd_headers)
    assert b"\x48\x01" in odd[0].SerializeToString()
    body_first = _buffered("/v1/completions", body=body)[1:]
    return [("STREAMED", streamed), ("observability mode", observed), ("unknown headers field", odd),
            ("body first", body_first)]


@pytest.mark.parametrize("name,msgs", _not_ahead(), ids=[c[0] for c in _not_ahead()])
def test_what_is_not_exactly_buffered_headers_goes_to_the_picker(
        pair: tuple[Epp, Epp], name: str, msgs: list[pb.ProcessingRequest]) -> None:
    """The front reads a call's first message only to answer it ahead: anything but exactly BUFFERED request
    headers that go on (another mode, observability mode, a field it does not read, a body first, headers
    twice) goes to the picker, and both fronts answer alike."""
    native, aio = pair
    assert native.front is not None and native.front.bridge is not None
    before = native.front.bridge.headers_ahead
    a = _call(f"127.0.0.1:{native.grpc_port}", msgs)
    b = _call(f"127.0.0.1:{aio.grpc_port}", msgs)
    assert _strip_endpoint(a) == _strip_endpoint(b), name
    assert native.front.bridge.headers_ahead == before, name


def test_request_headers_sent_twice_in_one_message_go_to_the_picker(pair: tuple[Epp, Epp]) -> None:
    """A first message holding the request_headers field twice (protobuf merges them; no data plane sends it)
    is not what the front answers ahead: the picker reads the merged headers, as under grpc.aio."""
    native, aio = pair
    assert native.front is not None and native.front.bridge is not None
    msgs = _buffered("/v1/completions", body=_body("twice " * 30))
    raw = [msgs[0].SerializeToString() + pb.ProcessingRequest(
        request_headers=_headers("/v1/completions")).SerializeToString(), msgs[1].SerializeToString()]
    before = native.front.bridge.headers_ahead
    out = []
    for port in (native.grpc_port, aio.grpc_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            out.append([pb.ProcessingResponse.FromString(r)
                        for r in ch.stream_stream(fr.PROCESS)(iter(raw), timeout=10)])
    assert [r.WhichOneof("response") for r in out[0]] == ["request_headers", "request_body"]
    assert _strip_endpoint(out[0]) == _strip_endpoint(out[1])
    assert native.front.bridge.headers_ahead == before


def test_only_buffered_headers_that_go_on_are_answered_ahead(epp_factory: Callable[..., Epp]) -> None:
    """The front answers request headers only in BUFFERED mode (the stream's, else the picker's default) and
    only when a body follows; a data plane that waits for the answer before it sends the body (Envoy) gets
    it from the front, and the pick comes with the body's answer."""
    epp = epp_factory(front="native", events_enabled=False, max_body_bytes=65_536)
    assert epp.front is not None and epp.front.bridge is not None
    bridge = epp.front.bridge
    target = f"127.0.0.1:{epp.grpc_port}"
    for msgs in (CASES[0][1], _exchange("/v1/models", None, method="GET", response=False)):
        before = bridge.headers_ahead
        assert _call(target, msgs)
        assert bridge.headers_ahead == before, "FULL_DUPLEX_STREAMED, or headers that end the request"

    async def envoy_like() -> list[pb.ProcessingResponse]:
        msgs = _buffered("/v1/completions", body=_body("ahead " * 40))
        answered = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            yield msgs[0]
            await answered.wait()  # as Envoy in BUFFERED mode: the body after the headers' answer
            yield msgs[1]

        out = []
        async with grpc.aio.insecure_channel(target) as ch:
            async for resp in pb_grpc.ExternalProcessorStub(ch).Process(requests(), timeout=10):
                out.append(resp)
                answered.set()
        return out

    before = bridge.headers_ahead
    out = asyncio.run(envoy_like())
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert len(_endpoints(out)) == 1
    assert bridge.headers_ahead == before + 1


def test_an_ext_proc_call_reaches_the_picker_with_its_first_message(epp_factory: Callable[..., Epp]) -> None:
    """The front holds a call's OPEN until the call's first frame (one wake-up of the picker for both): a call
    cancelled before it sent anything never opens there; one half-closed at once ends OK, unanswered."""
    epp = epp_factory(front="native", events_enabled=False)
    assert epp.front is not None and epp.front.bridge is not None
    bridge = epp.front.bridge
    target = f"127.0.0.1:{epp.grpc_port}"

    async def run() -> list[pb.ProcessingResponse]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)

            async def silent() -> AsyncIterator[pb.ProcessingRequest]:
                await asyncio.Event().wait()
                yield pb.ProcessingRequest()

            call = stub.Process(silent())
            await asyncio.sleep(0.3)
            assert not bridge.calls, "opened before its first frame"
            call.cancel()

            async def empty() -> AsyncIterator[pb.ProcessingRequest]:
                return
                yield pb.ProcessingRequest()

            return [r async for r in stub.Process(empty(), timeout=5)]

    assert asyncio.run(run()) == []
    time.sleep(0.2)
    assert not bridge.calls
    assert _endpoints(_call(target, CASES[0][1]))  # and it serves on


def test_the_invoked_pool_reaches_the_picker(epp_factory: Callable[..., Epp]) -> None:
    """gRPC metadata crosses the front: a pool the picker does not serve is refused with 503."""
    epp = epp_factory(front="native", events_enabled=False)
    out = _call(f"127.0.0.1:{epp.grpc_port}", _exchange("/v1/completions", _body("p " * 20), response=False),
                metadata=((POOL_METADATA, "no-such-pool"),))
    assert out[-1].immediate_response.status.code == 503


def test_health_on_the_front_s_port(epp_factory: Callable[..., Epp]) -> None:
    epp = epp_factory(front="native")
    with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", ""):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_unknown_methods_and_undecodable_messages_are_refused(epp_factory: Callable[..., Epp]) -> None:
    epp = epp_factory(front="native")
    with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
        other = ch.unary_unary("/foo.Bar/Baz")
        with pytest.raises(grpc.RpcError) as err:
            other(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        process = ch.stream_stream(fr.PROCESS)
        with pytest.raises(grpc.RpcError) as err:
            list(process(iter([b"\xff\xff\xff"]), timeout=5))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "undecodable" in (err.value.details() or "")
        # the front and the picker serve on
        assert _endpoints(_call(f"127.0.0.1:{epp.grpc_port}", CASES[0][1]))


def _inflight(epp: Epp) -> int:
    return sum(epp.tracker.load(p.name)[0] for pool in epp.datastore.pools() for p in pool.pods)


def test_a_call_cancelled_after_its_pick_releases_it(epp_factory: Callable[..., Epp]) -> None:
    """The client resets the stream once it has its pick (Envoy does when the client goes away): the
    in-flight ticket the pick opened is closed."""
    epp = epp_factory(front="native", events_enabled=False)

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for m in _exchange("/v1/completions", _body("cancel me " * 30), response=False):
            yield m
        await asyncio.Event().wait()  # the data plane's side stays open until the reset

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
            call = pb_grpc.ExternalProcessorStub(ch).Process(requests())
            async for resp in call:
                if _endpoints([resp]):
                    break
            assert _inflight(epp) == 1
            call.cancel()

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while _inflight(epp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _inflight(epp) == 0


def test_routing_thread_keeps_each_call_s_order(epp_factory: Callable[..., Epp]) -> None:
    """Every request routed on the routing thread (``inline_route_bytes`` 0): a call's later messages wait
    for its pick, and many calls at once are each answered in order."""
    epp = epp_factory(front="native", inline_route_bytes=0, events_enabled=False)
    msgs = CASES[0][1]

    async def one(ch: grpc.aio.Channel, i: int) -> list[str]:
        call = pb_grpc.ExternalProcessorStub(ch).Process(iter(_exchange(
            "/v1/completions", _body(f"prompt {i} " * 40))))
        return [r.WhichOneof("response") async for r in call]

    async def run() -> list[list[str]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
            return await asyncio.gather(*(one(ch, i) for i in range(32)))

    want = [r.WhichOneof("response") for r in _call(f"127.0.0.1:{epp.grpc_port}", msgs)]
    assert want[:2] == ["request_headers", "request_body"]
    for got in asyncio.run(run()):
        assert got == want


def test_a_killed_front_is_restarted_on_its_port(epp_factory: Callable[..., Epp]) -> None:
    epp = epp_factory(front="native", events_enabled=False)
    assert epp.front is not None and epp.front.proc is not None
    port, old = epp.grpc_port, epp.front.proc
    os.kill(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        proc = epp.front.proc
        if proc is not old and proc is not None and epp.front.port == port:
            try:
                if _endpoints(_call(f"127.0.0.1:{port}", CASES[0][1])):
                    break
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    else:
        pytest.fail("the front was not restarted")
    assert epp.front.restarts == 1


def test_a_stopping_picker_lets_the_calls_in_flight_finish(epp_factory: Callable[..., Epp]) -> None:
    """Stopped (SIGTERM in a pod), the front takes no new call but the ones in flight get their grace (as
    under grpc.aio's ``stop(grace)``): a response phase arriving meanwhile is answered; the call ends OK."""
    epp = epp_factory(front="native", events_enabled=False)
    msgs = _exchange("/v1/completions", _body("in flight " * 30))
    go_on = asyncio.Event()

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs[:2]:
            yield m
        await go_on.wait()
        for m in msgs[2:]:
            yield m

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
            call = pb_grpc.ExternalProcessorStub(ch).Process(requests())
            got = []
            async for resp in call:
                got.append(resp.WhichOneof("response"))
                if len(got) == 2:  # picked: now stop the picker, then send the response phase
                    stopping = asyncio.get_running_loop().run_in_executor(None, epp.stop)
                    await asyncio.sleep(0.2)
                    go_on.set()
            await stopping
            assert await call.code() == grpc.StatusCode.OK
            return got

    assert asyncio.run(run()) == ["request_headers", "request_body", "response_headers", "response_body"]


def test_the_front_exits_with_the_picker(epp_factory: Callable[..., Epp]) -> None:
    epp = epp_factory(front="native", events_enabled=False)
    assert epp.front is not None and epp.front.proc is not None
    proc = epp.front.proc
    epp.stop()
    proc.wait(10)
    with pytest.raises(grpc.RpcError):
        _call(f"127.0.0.1:{epp.grpc_port}", CASES[0][1])


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def test_the_bridge_drops_a_broken_socket_and_ignores_strangers() -> None:
    """Frames for calls it does not know are ignored; a call whose frames break the picker fails alone; a
    frame longer than any message aborts the socket."""
    from kvfleet.epp.metrics import EppMetrics
    from kvfleet.epp.server import ExtProcServicer, HealthServicer
    from tests.epp.test_scheduling import router

    async def run() -> _Transport:
        svc = ExtProcServicer(router(), EppMetrics(), 1 << 20)
        bridge = fr.Bridge(svc, HealthServicer(lambda: True, lambda: True), 1 << 20)
        t = _Transport()
        bridge.connection_made(t)
        bridge.data_received(fr._HEAD.pack(9 + 3, 77, fr.MSG) + b"abc")  # no such call
        assert t.written == [] and not t.aborted
        bridge.data_received(fr._HEAD.pack(9 + 1, 5, fr.OPEN) + b"\x07")  # a truncated OPEN: that call fails
        (_, cid, kind), = [fr._HEAD.unpack_from(w) for w in t.written]
        assert (cid, kind) == (5, fr.ERROR) and not t.aborted
        bridge.data_received(fr._HEAD.pack(9 + (1 << 20) + fr._SLACK + 1, 1, fr.MSG)[:4])
        svc.route_pool.shutdown(wait=True)
        return t

    assert asyncio.run(run()).aborted


def test_a_taken_port_fails_the_start_clearly(fleet: PodFleet) -> None:
    import socket

    from kvfleet.config import load
    from kvfleet.epp.datastore import StaticDatastore

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        settings = load(overrides={"epp": {"host": "127.0.0.1", "grpc_port": taken.getsockname()[1],
                                           "health_port": 0, "metrics_port": 0, "front": "native"}})
        epp = Epp(settings, datastore=StaticDatastore(data=fleet.pools_config()))
        with pytest.raises(RuntimeError, match="did not start serving"):
            epp.start()
        epp.stop()
    finally:
        taken.close()


def test_a_body_of_megabytes_crosses_the_socket(epp_factory: Callable[..., Epp]) -> None:
    """A message many socket reads long (3 MB, BUFFERED: one body message) is reassembled and routed."""
    epp = epp_factory(front="native", events_enabled=False, max_body_bytes=8 << 20)
    prompt = "".join(chr(97 + i % 26) for i in range(3 << 20))
    out = _call(f"127.0.0.1:{epp.grpc_port}", _exchange("/v1/completions", _body(prompt), mode=BUFFERED,
                                                        response=False))
    assert _endpoints(out), [r.WhichOneof("response") for r in out]


def test_a_method_name_too_long_for_a_frame_is_refused(epp_factory: Callable[..., Epp]) -> None:
    """A call's method crosses the socket with a 16-bit length. A path of ext_proc's method padded past 64 KiB
    would wrap that length to the method itself and have its padding read as the call's gRPC metadata (a
    pool name, say): the front refuses it, and serves on."""
    epp = epp_factory(front="native", events_enabled=False)
    crafted = fr.PROCESS + "x" * (1 << 16)  # its length ≡ len(PROCESS) modulo 2**16
    msg = _exchange("/v1/models", None, method="GET", response=False)[0].SerializeToString()
    big_headers = [("grpc.max_metadata_size", 1 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}", options=big_headers) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary(crafted)(msg, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert _endpoints(_call(f"127.0.0.1:{epp.grpc_port}", CASES[0][1]))


def _streamed_response(chunks: list[bytes], extra: pb.HttpBody | None = None,
                       response_mode: int = FULL_DUPLEX) -> list[pb.ProcessingRequest]:
    """An exchange whose response streams ``chunks``, then one with the usage, then an empty last one, as
    Envoy sends it: the response headers carry the attribute the filter asks for, every chunk the metadata.
    ``extra``: one more chunk message, in the middle. ``response_mode``: FULL_DUPLEX_STREAMED (the request's
    too), or STREAMED (the request BUFFERED: kvfleet's chart)."""
    msgs = _exchange("/v1/completions", _body("stream me " * 30), response=False,
                     mode=FULL_DUPLEX if response_mode == FULL_DUPLEX else BUFFERED)
    msgs[0].protocol_config.response_body_mode = response_mode
    heads = pb.ProcessingRequest(response_headers=_headers("", extra=((":status", "200"),)))
    heads.attributes["envoy.filters.http.ext_proc"].fields["upstream.address"].string_value = "10.0.0.1:8000"
    msgs.append(heads)
    usage = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}}
    bodies = [pb.ProcessingRequest(response_body=pb.HttpBody(body=c))
              for c in [*chunks, f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()]]
    for m in bodies:  # Envoy attaches the forwarded metadata namespaces to every message
        m.metadata_context.filter_metadata["envoy.lb"].fields["x"].string_value = "y"
    if extra is not None:
        bodies.insert(len(bodies) // 2, pb.ProcessingRequest(response_body=extra))
    last = pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))
    return [*msgs, *bodies, last]


#: streamed tokens, an empty chunk, and chunks whose lengths take 1, 2 and 3 varint bytes at every level
CHUNKS = [b"data: {\"text\": \"tok\"}\n\n", b"", b"x" * 100, b"y" * 200, b"z" * 300_000, b"data: more\n\n"]
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED


def _as_envoy(target: str, msgs: list[pb.ProcessingRequest], tokens_wait: bool = True
              ) -> list[pb.ProcessingResponse]:
    """``msgs`` sent as Envoy does: the response phase only once the pick is answered (its request reaches
    the upstream then), and here its chunks only once the response headers are too (a stream's tokens come
    after its headers; ``tokens_wait=False``: right behind them)."""
    out: list[pb.ProcessingResponse] = []
    first = next(i for i, m in enumerate(msgs) if m.HasField("response_headers"))
    waits = (first, first + 1) if tokens_wait else (first,)

    async def run() -> None:
        answered = asyncio.Event()
        want = [2, 3]  # the pick's answers (two in either mode), then the response headers'

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            for i, m in enumerate(msgs):
                if i in waits:
                    await answered.wait()
                    answered.clear()
                    await asyncio.sleep(0.05)
                yield m

        opts = [("grpc.max_receive_message_length", 8 << 20)]
        async with grpc.aio.insecure_channel(target, options=opts) as ch:
            async for resp in pb_grpc.ExternalProcessorStub(ch).Process(requests(), timeout=10):
                out.append(resp)
                if want and len(out) == want[0]:
                    want.pop(0)
                    answered.set()

    asyncio.run(run())
    return out


def _serialized(resps: list[pb.ProcessingResponse]) -> list[bytes]:
    return [r.SerializeToString() for r in _strip_endpoint(resps)]


#: chunks that, sent at once, pass the bodies the front holds for a call (1 MB) while an answer is due
BIG = [b"a" * 700_000, b"b" * 700_000, b"c" * 10]


@pytest.mark.parametrize("mode,sample,extra", [
    (FULL_DUPLEX, 0.0, None), (FULL_DUPLEX, 1.0, None), (STREAMED, 1.0, None),
    (FULL_DUPLEX, 1.0, pb.HttpBody(body=b"odd", end_of_stream_without_message=True))],
    ids=["full duplex, unread", "full duplex, read", "streamed, read", "a field the front does not read"])
def test_the_front_answers_a_response_s_chunks(epp_factory: Callable[..., Epp], mode: int, sample: float,
                                               extra: pb.HttpBody | None) -> None:
    """The answer to a response's chunk depends only on the body mode, so the native front gives it itself:
    the chunk handed back (FULL_DUPLEX_STREAMED) or an empty BodyResponse (STREAMED), the bytes the
    picker's own answers have (the ``grpc.aio`` server's, where Python answers every chunk), in order
    behind the picker's answer to the response headers. Only the last chunk reaches the picker's handler;
    a response it reads (``response_body_sample``) has its chunks' bodies handed over all the same, so the
    usage counts alike on both fronts. A chunk with a field the front does not read goes to the picker,
    and the chunks after it keep their order. A client that sends its whole exchange at once gets the same
    answers."""
    native = epp_factory(front="native", events_enabled=False, response_body_sample=sample)
    aio = epp_factory(front="grpcio", events_enabled=False, response_body_sample=sample)
    msgs = _streamed_response(CHUNKS, extra, mode)
    sent = [m.response_body.body for m in msgs if m.HasField("response_body")]
    seen: list[bytes] = []
    handle = native.servicer._response_body

    def counted(st: Any, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        seen.append(body.body)
        return handle(st, body)

    native.servicer._response_body = counted  # type: ignore[method-assign]
    big = [("grpc.max_receive_message_length", 8 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{aio.grpc_port}", options=big) as ch:
        b = list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=10))
    a = _as_envoy(f"127.0.0.1:{native.grpc_port}", msgs)
    assert _serialized(a) == _serialized(b)
    assert [r.WhichOneof("response") for r in a[-len(sent) - 1:]] == ["response_headers"] + [
        "response_body"] * len(sent)
    if mode == FULL_DUPLEX:
        assert [r.response_body.response.body_mutation.streamed_response.body for r in a[-len(sent):]] == sent
    assert seen == ([sent[-1]] if extra is None else [extra.body, sent[-1]])
    cached = native.metrics.engine_cached._value.get()
    assert cached == aio.metrics.engine_cached._value.get() == (7 if sample else 0)
    assert native.metrics.response_bodies_skipped._value.get() == (0 if sample else 1)
    # a client that sends its whole exchange at once (the chunks may come before the front is told to answer
    # them, or while the picker's answers are due): the same answers, in order
    with grpc.insecure_channel(f"127.0.0.1:{native.grpc_port}", options=big) as ch:
        c = list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=10))
    assert _serialized(c) == _serialized(b)
    assert native.metrics.engine_cached._value.get() == 2 * cached


def test_chunks_that_come_while_the_picker_answers_wait_for_it(epp_factory: Callable[..., Epp]) -> None:
    """Tokens right behind the response headers, the picker slow to answer those: the front answers the
    chunks meanwhile and holds the answers until the picker's is out (Envoy takes them in order), up to
    1 MB of chunk bodies; past that, chunks go to the picker, in order behind the held ones."""
    native = epp_factory(front="native", events_enabled=False)
    aio = epp_factory(front="grpcio", events_enabled=False)
    msgs = _streamed_response(BIG)
    sent = [m.response_body.body for m in msgs if m.HasField("response_body")]
    seen: list[bytes] = []
    handle, step = native.servicer._response_body, native.servicer.step

    def counted(st: Any, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        seen.append(body.body)
        return handle(st, body)

    def slow(st: Any, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        if msg.HasField("response_headers"):
            time.sleep(0.3)
        return step(st, msg)

    native.servicer._response_body = counted  # type: ignore[method-assign]
    native.servicer.step = slow  # type: ignore[method-assign]
    big = [("grpc.max_receive_message_length", 8 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{aio.grpc_port}", options=big) as ch:
        b = list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=10))
    a = _as_envoy(f"127.0.0.1:{native.grpc_port}", msgs, tokens_wait=False)
    assert _serialized(a) == _serialized(b)
    assert seen == [BIG[1], sent[-1]], [len(x) for x in seen]


def test_a_malformed_chunk_is_refused_and_the_front_serves_on(epp_factory: Callable[..., Epp]) -> None:
    """Once the front answers a call's chunks, a response-body message it cannot parse (its HttpBody cut
    short) is not answered as a chunk: it goes to the picker, which fails the call with INTERNAL; the
    picker's ticket is released and the next call is served."""
    epp = epp_factory(front="native", events_enabled=False)
    msgs = _streamed_response(CHUNKS[:1])
    head = [m.SerializeToString() for m in msgs[:3]]  # request headers and body, response headers
    good = msgs[3].SerializeToString()
    bad = b"\x2a\x05\x0a\x09abc"  # response_body {body: 9 bytes announced, 3 there}

    async def run() -> None:
        answered = asyncio.Event()

        async def requests() -> AsyncIterator[bytes]:
            for m in head:
                yield m
            await answered.wait()
            await asyncio.sleep(0.05)
            yield good
            yield bad
            await asyncio.Event().wait()

        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
            call = ch.stream_stream(fr.PROCESS)(requests(), timeout=10)
            got = 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    got += 1
                    if got == 3:  # the pick's two answers and the response headers'
                        answered.set()
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "undecodable" in (err.value.details() or "")
            assert got == 4  # the good chunk, answered by the front

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while _inflight(epp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _inflight(epp) == 0
    assert _endpoints(_call(f"127.0.0.1:{epp.grpc_port}", CASES[0][1]))
