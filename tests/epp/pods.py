"""Test-side model-server pods: tiny aiohttp servers with a prefix cache that publish vLLM KV events over ZMQ.

Each :class:`FakePod` keys prompts exactly as the engine simulator does
(byte-level tokens of the rendered prompt, the core's chained block hash),
keeps the set of blocks it "computed", answers OpenAI requests with
``usage.prompt_tokens_details.cached_tokens`` and the pod's name, and publishes
``BlockStored`` batches with vLLM's framing ``[topic, seq, msgpack]``
(:class:`KVEventPublisher`, with a ROUTER replay endpoint; frames from
:mod:`kvfleet.cache.kvwire`). ``/metrics`` serves
vLLM's gauge names.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from typing import Any

import zmq
from aiohttp import web

from kvfleet.cache import kvwire
from kvfleet.cache.events import KVEventBatch, encode_batch, stored
from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.cache.tokens import ByteTokenizer, render_chat, salt_extra_keys


class KVEventPublisher:
    """ZMQ PUB of KV-event batches plus a ROUTER replay endpoint, framed by :mod:`kvfleet.cache.kvwire`
    (vLLM's wire format), with faults to inject: lost messages, a restart, a silent replay endpoint,
    holes in replay answers, other topics, arbitrary payloads."""

    def __init__(
        self, buffer_steps: int = 10_000, topic: bytes = b"", ports: tuple[int, int] | None = None
    ) -> None:
        """``ports``: (PUB, ROUTER) to bind (a restarted pod on its old ports); default free ones."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)
        if ports is None:
            ports = (self.pub.bind_to_random_port("tcp://127.0.0.1"), self.router.bind_to_random_port("tcp://127.0.0.1"))
        else:
            self.pub.bind(f"tcp://127.0.0.1:{ports[0]}")
            self.router.bind(f"tcp://127.0.0.1:{ports[1]}")
        self.endpoint = f"tcp://127.0.0.1:{ports[0]}"
        self.replay_endpoint = f"tcp://127.0.0.1:{ports[1]}"
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        #: fault injection: replay requests are read and never answered
        self.replay_silent = False
        #: fault injection: these sequence numbers are left out of replay answers
        self.replay_skip: set[int] = set()
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch, *, drop: bool = False) -> int:
        """Send one batch; ``drop`` buffers it for replay without sending it (simulates a lost message)."""
        return self.publish_raw(encode_batch(batch), drop=drop)

    def publish_raw(self, payload: bytes, *, drop: bool = False, topic: bytes | None = None) -> int:
        """Send any payload as the next batch (``topic`` overrides the publisher's)."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if not drop:
                self.pub.send_multipart(
                    kvwire.live_frames(self.topic if topic is None else topic, seq, payload))
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send raw frames on the PUB socket (malformed messages)."""
        with self._lock:
            self.pub.send_multipart(frames)

    def restart(self) -> None:
        """What a restarted engine looks like on the wire: sequence numbers from 0 again, no history."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            ident, start = kvwire.parse_replay_request(frames)
            self.replay_requests.append(start)
            if self.replay_silent:
                continue
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start and s not in self.replay_skip]
            for s, p in items:
                self.router.send_multipart(kvwire.replay_item(ident, s, p))
            self.router.send_multipart(kvwire.replay_end(ident))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(0)
        self.router.close(0)


class FakePod:
    """One pod: prefix cache of block hashes, OpenAI endpoints, KV events, vLLM metrics."""

    def __init__(self, name: str, block_size: int = 16, delay_s: float = 0.0) -> None:
        self.name = name
        self.hasher = BlockHasher(block_size)
        self.tok = ByteTokenizer()
        self.blocks: set[int] = set()
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.other: list[tuple[str, str]] = []
        self.running = 0
        self.publisher = KVEventPublisher()
        self.port = 0
        self.publish_events = True

    def handle(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        text = render_chat(body["messages"]) if path.endswith("chat/completions") else body["prompt"]
        tokens = self.tok.encode(text)
        salt = body.get("cache_salt")
        hashes = self.hasher.hash_tokens(tokens, extra_keys=salt_extra_keys(salt))
        keys = hashes_as_ints(hashes)
        hit = 0
        for k in keys:
            if k not in self.blocks:
                break
            hit += 1
        new = keys[hit:]
        self.blocks.update(new)
        if new and self.publish_events:
            bs = self.hasher.block_size
            parent = keys[hit - 1] if hit else None
            ev = stored(new, parent, tokens[hit * bs : len(keys) * bs].tolist(), bs, "GPU")
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[ev]))
        self.requests.append(body)
        cached = hit * self.hasher.block_size
        return {
            "id": f"cmpl-{len(self.requests)}",
            "object": "text_completion",
            "model": body.get("model"),
            "pod": self.name,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": 1, "total_tokens": len(tokens) + 1,
                      "prompt_tokens_details": {"cached_tokens": cached}},
        }

    async def _stream(self, request: web.Request, data: dict[str, Any], tokens: int,
                      headers: dict[str, str]) -> web.StreamResponse:
        """The answer as server-sent events, a write per token (a body chunk each through a proxy), then the
        usage and ``[DONE]``, as vLLM streams with ``stream_options.include_usage``."""
        resp = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            chunk = {"id": data["id"], "object": "text_completion", "model": data["model"],
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}], "usage": None}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.002)
        await resp.write(f"data: {json.dumps({**data, 'choices': []})}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.running += 1
            try:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                data = self.handle(request.path, body)
            finally:
                self.running -= 1
            headers = {
                "x-pod": self.name,
                "x-seen-destination": request.headers.get("x-gateway-destination-endpoint", ""),
                "x-seen-prefiller": request.headers.get("x-prefiller-host-port", "")}
            if body.get("stream"):
                return await self._stream(request, data, int(body.get("max_tokens") or 4), headers)
            return web.json_response(data, headers=headers)

        async def metrics(request: web.Request) -> web.Response:
            text = (
                f"vllm:num_requests_waiting{{model_name=\"m\"}} 0\n"
                f"vllm:num_requests_running{{model_name=\"m\"}} {self.running}\n"
                f"vllm:kv_cache_usage_perc{{model_name=\"m\"}} {min(1.0, len(self.blocks) / 10000):.4f}\n"
            )
            return web.Response(text=text, content_type="text/plain")

        async def other(request: web.Request) -> web.Response:
            self.other.append((request.method, request.path))
            return web.json_response({"error": {"code": 404, "message": f"no {request.path}"}}, status=404,
                                     headers={"x-pod": self.name})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", completions)
        app.router.add_get("/metrics", metrics)
        app.router.add_route("*", "/{tail:.*}", other)
        return app


class PodFleet:
    """Runs several FakePods on one background event loop (loopback, free ports)."""

    def __init__(self, n: int, delay_s: float = 0.0, block_size: int = 16) -> None:
        self.pods = [FakePod(f"pod-{i}", block_size, delay_s) for i in range(n)]
        self.loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> PodFleet:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        for pod in self.pods:
            runner = web.AppRunner(pod.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            pod.port = runner.addresses[0][1]
            self._runners.append(runner)

    def kill(self, i: int) -> None:
        """Pod ``i`` dies: its HTTP server and its KV-event publisher close (the others keep serving)."""
        asyncio.run_coroutine_threadsafe(self._runners[i].cleanup(), self.loop).result(10)
        self.pods[i].publisher.close()

    def stop(self) -> None:
        async def _stop() -> None:
            for r in self._runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        for pod in self.pods:
            pod.publisher.close()

    def pools_config(
        self, model: str = "m", events: bool = True, roles: list[str] | None = None
    ) -> dict[str, Any]:
        pods = []
        for i, pod in enumerate(self.pods):
            entry: dict[str, Any] = {"name": pod.name, "address": "127.0.0.1", "port": pod.port,
                                     "metrics": f"http://127.0.0.1:{pod.port}/metrics"}
            if events:
                entry["events"] = pod.publisher.endpoint
                entry["replay"] = pod.publisher.replay_endpoint
            if roles:
                entry["role"] = roles[i]
            pods.append(entry)
        # the fake pods tokenize one token per byte (kvfleet.cache.tokens): the pool says so, as real ones do
        return {"pools": [{"name": "pool-a", "models": [model], "tokenizer": "bytes", "pods": pods}]}

    def by_port(self, port: int) -> FakePod:
        return next(p for p in self.pods if p.port == port)


def post(
    url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    """A plain HTTP POST (urllib); returns (status, headers, body) for any status."""
    return request(url, body, "POST", headers, timeout)


def request(
    url: str, body: Any, method: str = "POST", headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request (urllib; ``body`` None = none, bytes as they are, else JSON);
    (status, headers, body)."""
    import urllib.error
    import urllib.request

    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
