"""Fixtures: in-process simulated engines served over real loopback HTTP and ZMQ on free ports.

``pool_secret`` gives the engines started after it the pool's transfer secret
(``KVFLEET_TRANSFER_SECRET``); ``RunningEngine.call(..., signed=True)`` signs a
request with it as a pool peer would.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet.config import load
from kvfleet.demo.envoy import free_port as free_port  # re-exported for the engine tests
from kvfleet.engine.peer import sign_request
from kvfleet.engine.server import EngineServer

SECRET = b"test-pool-secret"


@dataclass
class RunningEngine:
    server: EngineServer
    url: str
    host_port: str
    runner: web.AppRunner

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, dict[str, str]]:
        async with aiohttp.ClientSession() as s, s.post(self.url + path, json=body, headers=headers) as r:
            data = await r.json(content_type=None)
            return r.status, data, dict(r.headers)

    async def call(
        self, method: str, path: str, body: Any = None, headers: Any = None, *, signed: bool = False,
        secret: bytes = SECRET,
    ) -> tuple[int, Any, str]:
        """One request with a JSON body (or none); ``signed`` adds the peer signature. Returns status, JSON,
        raw text."""
        raw = b"" if body is None else json.dumps(body).encode()
        hdrs: Any = headers if headers is not None else {}
        if signed:
            hdrs = {**hdrs, **sign_request(secret, method, path, raw)}
        if body is not None and isinstance(hdrs, dict):
            hdrs = {"Content-Type": "application/json", **hdrs}
        async with (aiohttp.ClientSession() as s,
                    s.request(method, self.url + path, data=raw, headers=hdrs) as r):
            text = await r.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = None
            return r.status, data, text


EngineFactory = Callable[..., Awaitable[RunningEngine]]


@pytest.fixture
def pool_secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[bytes]:
    monkeypatch.setenv("KVFLEET_TRANSFER_SECRET", SECRET.decode())
    yield SECRET


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    """Start engines with ``engine`` setting overrides; all are stopped at teardown."""
    started: list[RunningEngine] = []

    async def start(
        cache: dict[str, Any] | None = None, sections: dict[str, Any] | None = None, **engine: Any
    ) -> RunningEngine:
        port = free_port()
        overrides: dict[str, Any] = {
            "engine": {
                "port": port,
                "kv_events_port": free_port(),
                "kv_events_replay_port": free_port(),
                "time_factor": 0.0,
                "num_gpu_blocks": 256,
                "pod_name": f"sim-{len(started)}",
                **engine,
            }
        }
        if cache:
            overrides["cache"] = cache
        overrides.update(sections or {})
        server = EngineServer(load(None, overrides))
        server.start_publisher()
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        eng = RunningEngine(server, f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", runner)
        started.append(eng)
        return eng

    yield start
    for eng in reversed(started):
        await eng.runner.cleanup()
