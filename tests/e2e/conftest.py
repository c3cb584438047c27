"""The local stack for e2e tests: real Envoy → kvfleet EPP → simulated engines, all child processes on
loopback.

The ``fleet`` fixture (one per module) starts 4 engines in 2 pools (``pool-a``:
two unified pods; ``pool-b``: a prefill and a decode pod), the EPP with a
static pods file, and Envoy with the EPP as ext_proc (failure mode: closed).
The engines share the stack's transfer secret; each decode pod lists its
pool's prefill pods as ``engine.prefill_peers``.
Every process runs in its own process group and is stopped by PID at
teardown; tests fail loudly if one dies.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvfleet.config.engine import EngineSettings
from kvfleet.demo.stack import (
    Child,
    PodSpec,
    ProcessStack,
    engine_env,
    engine_settings,
    free_port,
    plan_pods,
    pods_file,
    write_yaml,
)

MODEL = "llama-3-8b"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def http_json(url: str, body: Any | None = None, headers: dict[str, str] | None = None,
              timeout: float = 30.0) -> tuple[int, Any, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.strip() else None, dict(r.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return exc.code, parsed, dict(exc.headers)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        text: str = r.read().decode()
        return text


@dataclass
class Fleet:
    stack: ProcessStack
    pods: list[PodSpec]
    workdir: Path
    gateway: str = ""
    epp_ports: tuple[int, int, int] = (0, 0, 0)
    epp: Child | None = None
    engines: dict[str, Child] = field(default_factory=dict)
    secret: str = ""
    #: headers every :meth:`complete` sends (a gateway route's match)
    headers: dict[str, str] = field(default_factory=dict)
    #: the EPP's pods file with one InferencePool per pod group (``pool-a``, ``pool-b``) instead of one pool
    #: whose prefix shards they are
    split_pools: bool = False

    def pod(self, name: str) -> PodSpec:
        return next(p for p in self.pods if p.name == name)

    def start_engine(self, p: PodSpec, **extra: Any) -> Child:
        cfg = {"engine": engine_settings(self.pods, p, MODEL,
                                         **{"time_factor": 0.01, "num_gpu_blocks": 2048, **extra})}
        path = write_yaml(self.workdir / f"{p.name}.yaml", cfg)
        child = self.stack.spawn_kvfleet(p.name, ["engine", "--config", str(path)], engine_env(self.secret))
        self.stack.wait_http(child, f"http://127.0.0.1:{p.port}/health", timeout_s=60)
        self.engines[p.name] = child
        return child

    def start_epp(self) -> Child:
        grpc_port, health_port, metrics_port = self.epp_ports
        pods = pods_file(self.pods, MODEL, tokenizer=EngineSettings().tokenizer)
        if self.split_pools:
            (one,) = pods["pools"]
            groups = sorted({m["shard"] for m in one["pods"]})
            pods["pools"] = [{**one, "name": g, "pods": [{k: v for k, v in m.items() if k != "shard"}
                                                         for m in one["pods"] if m["shard"] == g]}
                             for g in groups]
        pods_path = write_yaml(self.workdir / "pods.yaml", pods)
        cfg = {"epp": {"host": "127.0.0.1", "grpc_port": grpc_port, "health_port": health_port,
                       "metrics_port": metrics_port, "pods_file": str(pods_path), "prefix_shard_blocks": 2}}
        path = write_yaml(self.workdir / "epp.yaml", cfg)
        child = self.stack.spawn_kvfleet("epp", ["epp", "--config", str(path)])
        self.stack.wait_tcp(child, grpc_port, timeout_s=60)
        self.stack.wait_http(child, f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=60)
        self.epp = child
        return child

    def epp_metrics(self) -> str:
        return scrape(f"http://127.0.0.1:{self.epp_ports[2]}/metrics")

    def complete(
        self, prompt: list[int], max_tokens: int = 4, headers: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, Any, dict[str, str]]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **kw}
        return http_json(self.gateway + "/v1/completions", body, headers={**self.headers, **(headers or {})})

    def check_alive(self) -> None:
        for child in self.stack.children:
            if not child.alive():
                raise AssertionError(f"{child.name} died (rc {child.proc.returncode}):\n{child.log_tail()}")


def engines_and_epp(stack: ProcessStack, workdir: Path, split_pools: bool = False) -> Fleet:
    """Four engines in two pools and the EPP over them (a pods file); the caller puts a gateway in front."""
    fleet = Fleet(stack, plan_pods(4, 2, 1), workdir, secret=stack.transfer_secret, split_pools=split_pools)
    fleet.epp_ports = (free_port(), free_port(), free_port())
    for p in fleet.pods:
        fleet.start_engine(p)
    fleet.start_epp()
    return fleet


def start_fleet(workdir: Path) -> Iterator[Fleet]:
    from kvfleet.demo.envoy import envoy_binary
    from kvfleet.epp.envoy import write_bootstrap

    with ProcessStack(workdir) as stack:
        fleet = engines_and_epp(stack, workdir)
        listen, admin = free_port(), free_port()
        boot = write_bootstrap(workdir / "envoy.yaml", listen_port=listen, epp_port=fleet.epp_ports[0],
                               admin_port=admin)
        envoy = stack.spawn("envoy", [envoy_binary(), "-c", str(boot), "--base-id", str(admin), "-l",
                                      "warning", "--concurrency", "1", "--disable-hot-restart"])
        stack.wait_http(envoy, f"http://127.0.0.1:{admin}/ready", timeout_s=60)
        fleet.gateway = f"http://127.0.0.1:{listen}"
        yield fleet
        fleet.check_alive()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from start_fleet(tmp_path_factory.mktemp("fleet"))
