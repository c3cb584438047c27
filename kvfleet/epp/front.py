"""The native gRPC front: ``kvfleet-epp-front`` serves the ext_proc port, this module serves its calls.

Python's ``grpc.aio`` costs about as much CPU per ext_proc stream as a warm decision does (docs/epp.md). The
front (``native/epp-front``, Go, grpc-go) takes that work: HTTP/2, flow control, TLS and message framing. It
decides nothing. Each call's messages reach this process as their serialized bytes over one Unix socket (a
socket pair; the front inherits its end), and :class:`Bridge` runs them through the same
:class:`~kvfleet.epp.server.ExtProcServicer` steps as the ``grpc.aio`` server does, so the protocol has one
implementation. The frames (both ways: u32 length of what follows, u64 call id, u8 kind, payload) are
described in ``native/epp-front/main.go``. One exception, asked for per call: the answer to a response's
chunks (a streamed token each) depends only on the body mode
(:attr:`~kvfleet.epp.server.Stream.chunk_answer`), so after the pick the bridge follows its answers with ECHO
(the count of the call's messages answered, how many bytes of the chunks it reads, the fixed answer) and the
front answers the chunks itself while it has handed this process nothing unanswered, without a round trip per
token; the bodies the picker reads (the usage, ``epp.response_body_sample``) come as BODY ahead of the next
message, and the last chunk still comes here (``tests/epp/test_front.py`` checks the front's answers against
this module's).

A second exception, set once for all calls (AHEAD, sent when the front says HELLO: the servicer's default
request body mode and :func:`~kvfleet.epp.protocol.empty_request_headers_response`'s bytes): in BUFFERED
mode Envoy sends a request's headers, waits for their answer, then the whole body, and the answer to headers
that do not end the request is that fixed "continue". The front gives it itself and hands the headers over
(HEADERS) with the body, in one write (an ext_proc call's OPEN waits for its first frame as well): one
wake-up and one write of this process per request less. The headers are still
checked here, as the first step of the call: what :class:`~kvfleet.epp.server.ExtProcServicer` refuses on
them (a path it does not serve, a wrong method, a declared body over the limit) is answered to the body,
with the same immediate response (:attr:`_Call.refused`), and the call ends there.

The front serves the methods this module knows: ext_proc's ``Process`` and ``grpc.health.v1.Health``'s
``Check`` and ``Watch`` (GIE's service names, :class:`~kvfleet.epp.server.HealthServicer`); any other gets
UNIMPLEMENTED. When the front exits unexpectedly, :class:`NativeFront` starts it again on the same port; while
it is down, Envoy's failure mode applies (FailOpen / FailClose). When this process exits, the socket closes
and the front fails its calls with UNAVAILABLE and exits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from grpc import StatusCode
from grpc_health.v1 import health_pb2

from kvfleet.epp import protocol
from kvfleet.epp import server as srv

log = logging.getLogger(__name__)

#: the front's program: this environment variable, else ``kvfleet/epp/bin/`` (built with the package), else
#: PATH
FRONT_ENV = "KVFLEET_EPP_FRONT"
FRONT_NAME = "kvfleet-epp-front"
PROCESS = f"/{srv.EXT_PROC_SERVICE}/Process"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"

HELLO, OPEN, MSG, HALF_CLOSE, CANCEL, END, ERROR, ECHO, BODY, AHEAD, HEADERS = range(1, 12)
_HEAD = struct.Struct("<IQB")
_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")
_ECHO = struct.Struct("<QI")
#: the answer to request headers that do not end the request (BUFFERED): AHEAD's bytes
_CONTINUE = protocol.empty_request_headers_response().SerializeToString()
#: a frame beyond the largest message plus this is a broken front: the connection is dropped
_SLACK = 1 << 16


def front_program() -> str | None:
    """The path of the front's program, or ``None`` when it is not installed."""
    env = os.environ.get(FRONT_ENV, "")
    if env:
        return env if os.access(env, os.X_OK) else None
    local = Path(__file__).parent / "bin" / FRONT_NAME
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which(FRONT_NAME)


def decode_open(payload: bytes) -> tuple[str, list[tuple[str, str]]]:
    """A call's method and metadata from its OPEN frame."""
    (n,) = _U16.unpack_from(payload, 0)
    method = payload[2:2 + n].decode(errors="replace")
    off, md = 2 + n, []
    while off < len(payload):
        (kn,) = _U16.unpack_from(payload, off)
        key = payload[off + 2:off + 2 + kn].decode(errors="replace")
        off += 2 + kn
        (vn,) = _U32.unpack_from(payload, off)
        md.append((key, payload[off + 4:off + 4 + vn].decode(errors="replace")))
        off += 4 + vn
    return method, md


@dataclass
class _Call:
    method: str
    metadata: list[tuple[str, str]]
    st: srv.Stream | None = None
    #: a message of this call is on the routing thread; later frames wait in ``pending``
    busy: bool = False
    pending: collections.deque[tuple[int, bytes]] = field(default_factory=collections.deque)
    watch: asyncio.Task[None] | None = None
    #: the call's messages answered (ECHO's count: the front answers a chunk only when it has handed
    #: this process nothing unanswered)
    answered: int = 0
    #: the answer due instead of the call's next message: the servicer's refusal of request headers the front
    #: had already answered (HEADERS)
    refused: list[pb.ProcessingResponse] | None = None


class Bridge(asyncio.Protocol):
    """The picker's end of the socket: frames in, the servicer's steps, frames out.

    Runs on the event loop; a message that routes a long body (or meets a pick in progress) goes to the
    servicer's routing thread like on the ``grpc.aio`` server, and the call's later frames wait for it.
    """

    def __init__(self, servicer: srv.ExtProcServicer, health: srv.HealthServicer, max_message_bytes: int,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.servicer, self.health = servicer, health
        self.max_frame = max_message_bytes + _SLACK
        self.calls: dict[int, _Call] = {}
        self.buf = bytearray()
        #: frames to write: one write per batch of input (or per routed message), not per frame
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.on_lost = on_lost
        #: request headers the front answered (AHEAD) and handed over with their call's next frame
        self.headers_ahead = 0

    # --- the socket ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for cid in list(self.calls):
            self._drop(cid)
        self.transport = None
        if not self.port.done():
            self.port.set_exception(ConnectionError(f"{FRONT_NAME} closed its socket before serving"))
        if self.on_lost is not None:
            self.on_lost()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        off, end = 0, len(buf)
        # the view is released before the resize below (a viewed bytearray cannot change size)
        with memoryview(buf) as view:
            while end - off >= 4:
                (n,) = _U32.unpack_from(buf, off)
                if n < 9 or n > self.max_frame:
                    log.error("epp front: bad frame length %d: dropping the connection", n)
                    if self.transport is not None:
                        self.transport.abort()
                    return
                if end - off < 4 + n:
                    break
                _, cid, kind = _HEAD.unpack_from(buf, off)
                payload = bytes(view[off + 13:off + 4 + n])  # one copy
                off += 4 + n
                try:
                    self._frame(cid, kind, payload)
                except Exception:  # one call fails (as a handler's exception fails its call), not the socket
                    log.exception("epp front: call %d", cid)
                    self._fail(cid, StatusCode.INTERNAL, "internal error in the endpoint picker")
        del buf[:off]
        self._flush()

    def _send(self, cid: int, kind: int, payload: bytes = b"") -> None:
        self.out.append(_HEAD.pack(9 + len(payload), cid, kind))
        if payload:
            self.out.append(payload)

    def _flush(self) -> None:
        if self.out:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(b"".join(self.out))
            self.out.clear()

    def _end(self, cid: int) -> None:
        self._send(cid, END)
        self._drop(cid)

    def _fail(self, cid: int, code: StatusCode, message: str) -> None:
        self._send(cid, ERROR, _U32.pack(code.value[0]) + message.encode()[:4096])
        self._drop(cid)

    def _drop(self, cid: int) -> None:
        call = self.calls.pop(cid, None)
        if call is not None:
            self.servicer.close_stream(call.st)
            if call.watch is not None:
                call.watch.cancel()

    # --- calls ----------------------------------------------------------------------------------------------
    def _frame(self, cid: int, kind: int, payload: bytes) -> None:
        if kind == HELLO:
            if not self.port.done():
                self.port.set_result(int(payload))
            self._send(0, AHEAD, bytes([self.servicer.default_mode & 0xFF]) + _CONTINUE)
            return
        if kind == OPEN:
            method, md = decode_open(payload)
            self.calls[cid] = _Call(method, md)
            if method not in (PROCESS, HEALTH_CHECK, HEALTH_WATCH):
                self._fail(cid, StatusCode.UNIMPLEMENTED, f"unknown method {method}")
            return
        call = self.calls.get(cid)
        if call is None:  # ended here already (an answer, an error) or never opened
            return
        if kind == CANCEL:
            self._drop(cid)
        elif call.busy:
            call.pending.append((kind, payload))
        else:
            self._step(cid, call, kind, payload)

    def _step(self, cid: int, call: _Call, kind: int, payload: bytes) -> None:
        if call.method != PROCESS:
            self._health(cid, call, kind, payload)
            return
        if kind == HALF_CLOSE:  # the client is done: the stream ends as Process's loop does
            if call.refused is not None:  # headers refused and no body came: the refusal still goes out
                for resp in call.refused:
                    self._send(cid, MSG, resp.SerializeToString())
            self._end(cid)
            return
        if kind == BODY:  # chunks the front answered: their bodies, in the stream's order
            if call.st is not None:
                self.servicer.captured(call.st, payload)
            return
        try:
            msg = pb.ProcessingRequest.FromString(payload)
        except DecodeError as exc:
            self._fail(cid, StatusCode.INTERNAL, f"undecodable ProcessingRequest: {exc}")
            return
        if call.st is None:
            call.st = self.servicer.open_stream(msg, call.metadata)
        if call.refused is not None:  # the headers the front answered were refused: so is what follows
            self._answer(cid, call, msg, call.refused)
            return
        out = self.servicer.step(call.st, msg)
        if kind == HEADERS:  # answered by the front already: only a refusal is left to give
            self.headers_ahead += 1
            self._ahead(cid, call, out)
            return
        if out is None:
            call.busy = True
            fut = asyncio.get_running_loop().run_in_executor(
                self.servicer.route_pool, self.servicer.routed, call.st, msg)
            fut.add_done_callback(lambda f: self._routed(cid, call, msg, f))
            return
        self._answer(cid, call, msg, out)

    def _ahead(self, cid: int, call: _Call, out: list[pb.ProcessingResponse] | None) -> None:
        """The servicer's answer ``out`` to request headers the front answered with :data:`_CONTINUE`: the
        same answer, nothing to send; a refusal (an immediate response) answers the call's next message."""
        if out is not None and len(out) == 1:
            if out[0].HasField("immediate_response"):
                call.refused = out
                return
            if out[0].SerializeToString() == _CONTINUE:
                return
        # the front's rule and the servicer's disagree (the front answered what it should not have)
        log.error("epp front: call %d: request headers answered ahead, but the picker answers %s", cid, out)
        self._fail(cid, StatusCode.INTERNAL, "request headers answered ahead of the endpoint picker")

    def _answer(self, cid: int, call: _Call, msg: pb.ProcessingRequest,
                out: list[pb.ProcessingResponse]) -> None:
        for resp in out:
            self._send(cid, MSG, resp.SerializeToString())
        if self.servicer.finished(msg, out):
            self._end(cid)
            return
        call.answered += 1
        st = call.st
        if st is not None and st.chunk_answer is not None:
            self._send(cid, ECHO, _ECHO.pack(call.answered, st.chunk_capture) + st.chunk_answer)

    def _routed(self, cid: int, call: _Call, msg: pb.ProcessingRequest,
                fut: asyncio.Future[list[pb.ProcessingResponse]]) -> None:
        call.busy = False
        if self.calls.get(cid) is not call:  # reset while routing: release what the pick took
            self.servicer.close_stream(call.st)
            return
        try:
            if fut.cancelled():  # the routing thread is stopping
                self._fail(cid, StatusCode.UNAVAILABLE, "the endpoint picker is stopping")
                return
            exc = fut.exception()
            if exc is not None:  # _handle answers its own errors; this is the executor itself failing
                self._fail(cid, StatusCode.INTERNAL, f"routing failed: {exc}")
                return
            self._answer(cid, call, msg, fut.result())
            while call.pending and not call.busy and self.calls.get(cid) is call:
                kind, payload = call.pending.popleft()
                self._step(cid, call, kind, payload)
        finally:
            self._flush()

    def _health(self, cid: int, call: _Call, kind: int, payload: bytes) -> None:
        if kind != MSG or call.watch is not None:
            if kind == HALF_CLOSE and call.method == HEALTH_CHECK:
                self._fail(cid, StatusCode.INVALID_ARGUMENT, "Check takes one request")
            return
        try:
            service = health_pb2.HealthCheckRequest.FromString(payload).service
        except DecodeError as exc:
            self._fail(cid, StatusCode.INTERNAL, f"undecodable HealthCheckRequest: {exc}")
            return
        if call.method == HEALTH_CHECK:
            status = self.health.status(service)
            if status is None:
                self._fail(cid, StatusCode.NOT_FOUND, f"unknown service {service!r}")
                return
            self._send(cid, MSG, health_pb2.HealthCheckResponse(status=status).SerializeToString())
            self._end(cid)
        else:
            call.watch = asyncio.get_running_loop().create_task(self._watch(cid, service))

    async def _watch(self, cid: int, service: str) -> None:
        """The servicer's own Watch stream, each change sent as it comes (cancelled when the call ends)."""
        async for resp in self.health.Watch(health_pb2.HealthCheckRequest(service=service), None):
            self._send(cid, MSG, resp.SerializeToString())
            self._flush()


class NativeFront:
    """Runs ``kvfleet-epp-front`` on ``host:port`` for a servicer, on the running event loop; restarts it
    when it exits while serving (same port) and stops it with :meth:`stop`."""

    def __init__(self, program: str, servicer: srv.ExtProcServicer, health: srv.HealthServicer, host: str,
                 port: int, max_message_bytes: int = 64 << 20, tls_cert_file: str = "",
                 tls_key_file: str = "", grace_s: float = 0.5) -> None:
        self.program, self.servicer, self.health = program, servicer, health
        self.grace_s = grace_s
        self.host, self.port, self.max_message_bytes = host, port, max_message_bytes
        self.tls = (tls_cert_file, tls_key_file) if tls_cert_file or tls_key_file else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.bridge: Bridge | None = None
        self.restarts = 0
        self._stopping = False
        self._serving = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, timeout_s: float = 30.0) -> int:
        """Start the front; returns the port it serves on once it does."""
        self._loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [self.program, "--fd", str(theirs.fileno()), "--listen", f"{self.host}:{self.port}",
               "--max-message-bytes", str(self.max_message_bytes), "--grace", f"{self.grace_s}s"]
        if self.tls is not None:
            cmd += ["--tls-cert-file", self.tls[0], "--tls-key-file", self.tls[1]]
        try:
            # its own session: a terminal's Ctrl-C reaches the picker, which stops the front in order
            self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            theirs.close()
        _, self.bridge = await self._loop.connect_accepted_socket(
            lambda: Bridge(self.servicer, self.health, self.max_message_bytes, self._lost), mine)
        try:
            self.port = await asyncio.wait_for(asyncio.shield(self.bridge.port), timeout_s)
        except (TimeoutError, ConnectionError) as exc:
            code = self.proc.poll()
            self._kill()
            raise RuntimeError(f"{self.program} did not start serving on {self.host}:{self.port} "
                               f"({'exit code ' + str(code) if code is not None else exc})") from None
        self._serving = True
        log.info("epp: ext_proc served by %s (pid %d) on :%d", FRONT_NAME, self.proc.pid, self.port)
        return self.port

    def _lost(self) -> None:
        serving, self._serving = self._serving, False
        if self._stopping or self._loop is None or not serving:  # not serving yet: start() reports it
            return
        code = self.proc.poll() if self.proc is not None else None
        log.error("epp: %s exited (code %s) or closed its socket: restarting it on :%d", FRONT_NAME, code,
                  self.port)
        self._kill()
        self.restarts += 1
        self._loop.create_task(self._restart())

    async def _restart(self) -> None:
        delay = min(5.0, 0.2 * self.restarts)
        while not self._stopping:
            await asyncio.sleep(delay)
            try:
                await self.start()
                return
            except (OSError, RuntimeError) as exc:
                log.error("epp: %s did not restart: %s", FRONT_NAME, exc)
                delay = min(5.0, delay * 2 + 0.2)

    def _kill(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
        threading.Thread(target=_reap, args=(proc,), daemon=True).start()

    async def stop(self) -> None:
        """Stop serving: the front takes no new call and gives the calls in flight ``grace_s`` to finish (as
        ``grpc.aio``'s ``stop(grace)``), answered by this process meanwhile; then it exits."""
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s + 1.0
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if self.bridge is not None and self.bridge.transport is not None:
            self.bridge.transport.close()
        self._kill()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 5.0
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
