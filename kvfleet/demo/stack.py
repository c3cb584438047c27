"""The local stack as child processes: engines, the EPP, Envoy — started, probed, and always stopped.

Every child runs in its own session (process group) with its output in a log
file; :class:`ProcessStack` remembers them and :meth:`ProcessStack.stop_all`
sends SIGTERM to each group, waits, then SIGKILLs what is left, so no process
outlives the stack (also on Ctrl-C, via ``with ProcessStack() as stack``).

Each stack has its own transfer secret (``transfer_secret``, fresh per run),
given to its engines as ``KVFLEET_TRANSFER_SECRET`` (:func:`engine_env`): it
authenticates their KV transfers and signs their requests to each other and
the stack's own resets (:func:`reset_engine`). :func:`prefill_peers` lists the
prefill pods an engine may name in ``x-prefiller-host-port``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvfleet.demo.envoy import free_port as envoy_free_port
from kvfleet.engine.peer import sign_request


class StackError(RuntimeError):
    """A child failed to start or died; the message carries the tail of its log."""


class PortTakenError(StackError):
    """A port the stack needs is already in use."""


def free_port() -> int:
    """A free loopback port below the ephemeral range (:func:`kvfleet.demo.envoy.free_port`)."""
    return envoy_free_port("127.0.0.1")


def check_port_free(port: int, what: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise PortTakenError(f"port {port} ({what}) is already in use on 127.0.0.1: "
                                 "stop what holds it or pick another") from None


@dataclass
class Child:
    """One started process."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the process so far (Linux ``/proc``), ``None`` if unknown."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class ProcessStack:
    """Starts children in their own process groups and stops every one of them."""

    workdir: Path
    children: list[Child] = field(default_factory=list)
    transfer_secret: str = field(default_factory=lambda: secrets.token_hex(16))

    def __enter__(self) -> ProcessStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop_all()

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def spawn_kvfleet(self, name: str, role_args: Sequence[str], env: dict[str, str] | None = None) -> Child:
        return self.spawn(name, [sys.executable, "-m", "kvfleet", *role_args], env)

    def wait_http(self, child: Child, url: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not child.alive():
                raise StackError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise StackError(f"{child.name} not ready at {url} after {timeout_s:.0f}s:\n{child.log_tail()}")

    def wait_tcp(self, child: Child, port: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not child.alive():
                raise StackError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
            time.sleep(0.1)
        raise StackError(f"{child.name} not listening on {port} after {timeout_s:.0f}s:\n{child.log_tail()}")

    def stop(self, child: Child, timeout_s: float = 5.0, sig: int = signal.SIGTERM) -> int:
        """Stop one child's process group; returns its exit code."""
        if child.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, sig)
            try:
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)
        else:
            # The leader is gone; make sure nothing else of its group survived.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
        if child in self.children:
            self.children.remove(child)
        return int(child.proc.returncode or 0)

    def stop_all(self) -> None:
        for child in list(reversed(self.children)):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if child.alive():
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for child in list(reversed(self.children)):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.05, deadline - time.monotonic()))
        for child in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(5)
        self.children.clear()

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]


@dataclass(frozen=True)
class PodSpec:
    """One engine of the stack and the ports it uses."""

    name: str
    pool: str
    role: str
    port: int
    events_port: int
    replay_port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def plan_pods(num_pods: int = 4, num_pools: int = 2, pd_pools: int = 1) -> list[PodSpec]:
    """``num_pods`` engines over ``num_pools`` pools; the last ``pd_pools`` pools are prefill/decode.

    A P/D pool alternates prefill and decode pods (at least one of each).
    """
    if num_pods < num_pools or num_pools < 1:
        raise ValueError("need at least one pod per pool")
    pods: list[PodSpec] = []
    per = [num_pods // num_pools + (1 if i < num_pods % num_pools else 0) for i in range(num_pools)]
    k = 0
    for p, n in enumerate(per):
        pd = p >= num_pools - pd_pools and n >= 2
        for j in range(n):
            role = ("prefill" if j % 2 == 0 else "decode") if pd else "both"
            pods.append(PodSpec(f"pod-{k}", f"pool-{chr(ord('a') + p)}", role, free_port(), free_port(),
                                free_port()))
            k += 1
    return pods


def pods_file(pods: Sequence[PodSpec], model: str, kv_blocks: int | None = None,
              tokenizer: str | None = None) -> dict[str, Any]:
    """The EPP's static pods/pools file (``kvfleet.epp.datastore`` format): one InferencePool ``pool``
    whose prefix shards are the planned pod groups (``shard: pool-a``, ``pool-b``, ...), as the
    operator renders a KVCachePool. ``kv_blocks`` (each engine's GPU blocks) lets level 1 weigh the
    shards by capacity in blocks (:mod:`kvfleet.epp.scheduling.pools`; else by pods). ``tokenizer``
    declares the engines' tokenizer for the pool (else the EPP's own default applies)."""
    members = [
        {
            "name": p.name,
            "address": "127.0.0.1",
            "port": p.port,
            "role": p.role,
            "shard": p.pool,
            "events": f"tcp://127.0.0.1:{p.events_port}",
            "replay": f"tcp://127.0.0.1:{p.replay_port}",
            "metrics": f"http://127.0.0.1:{p.port}/metrics",
            **({"kv_blocks": kv_blocks} if kv_blocks else {}),
        }
        for p in pods
    ]
    pool: dict[str, Any] = {"name": "pool", "models": [model], "pods": members}
    if tokenizer:
        pool["tokenizer"] = tokenizer
    return {"pools": [pool]}


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def prefill_peers(pods: Sequence[PodSpec], pod: PodSpec) -> list[str]:
    """``engine.prefill_peers`` of ``pod``: the prefill pods of its pool (none for a prefill pod or a unified
    pool)."""
    if pod.role == "prefill":
        return []
    return [q.endpoint for q in pods if q.pool == pod.pool and q.role == "prefill"]


def engine_settings(pods: Sequence[PodSpec], pod: PodSpec, model: str, **extra: Any) -> dict[str, Any]:
    """The ``engine:`` settings of one planned pod: model, loopback ports, name, shard, role, prefill peers
    (``extra`` adds or overrides fields: time factor, block counts, tiers)."""
    return {
        "model": model, "host": "127.0.0.1", "port": pod.port, "kv_events_port": pod.events_port,
        "kv_events_replay_port": pod.replay_port, "pod_name": pod.name, "pool": pod.pool, "role": pod.role,
        "prefill_peers": prefill_peers(pods, pod), **extra,
    }


def engine_env(secret: str) -> dict[str, str]:
    """The environment that gives an engine the stack's transfer secret."""
    return {"KVFLEET_TRANSFER_SECRET": secret}


def reset_engine(port: int, secret: str, timeout_s: float = 10.0) -> None:
    """Empty one engine's cache (``POST /kvfleet/v1/reset``, signed with the stack's transfer secret)."""
    path = "/kvfleet/v1/reset"
    headers = sign_request(secret.encode(), "POST", path, b"")
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST", data=b"", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()
