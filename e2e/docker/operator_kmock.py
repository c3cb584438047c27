"""Run ``kvfleet operator`` from the image against the kmock API emulator on the host.

    .venv/bin/python -m e2e.docker.operator_kmock [TAG]

Starts the emulator the operator tests use (``tests/operator/conftest.py``) on a
free loopback port, runs the image's operator in a container on the host network
(read-only root, no capabilities, uid 10001, as the chart runs it) with a
kubeconfig pointing at the emulator, then checks: kopf's liveness ``/healthz``
answers, and a KVCachePool created in the emulator gets its Deployment,
ConfigMap, Service and InferencePool, and a status with ``observedGeneration``.
The container is removed on exit. Needs the dev extras (kmock) on the host.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import kmock
import kopf
import yaml

from kvfleet.operator.kube import ApiClient
from tests.conftest import eventually
from tests.kmockapi import OPERATOR_RESOURCES as RESOURCES
from tests.kmockapi import Emulator
from tests.operator import samples

NS = "default"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthz(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def run(tag: str) -> int:
    emulator = Emulator()
    for key, info in RESOURCES.items():
        emulator.resources[key] = info
    name = f"kvfleet-smoke-operator-{_free_port()}"
    async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        url = str(server.url).rstrip("/")
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                "users": [{"name": "kmock", "user": {"token": "test"}}],
                "contexts": [{"name": "kmock",
                              "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
            }))
            kubeconfig.chmod(0o644)
            Path(tmp).chmod(0o755)
            liveness = f"http://127.0.0.1:{_free_port()}/healthz"
            subprocess.run([
                "docker", "run", "-d", "--name", name, "--network", "host",
                "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "-v", f"{kubeconfig}:/etc/kvfleet/kubeconfig:ro", "-e", "KUBECONFIG=/etc/kvfleet/kubeconfig",
                tag, "operator", "--liveness", liveness,
            ], check=True, stdout=subprocess.DEVNULL)
            api = ApiClient(kopf.ConnectionInfo(server=url, token="test"))
            try:
                async def alive() -> bool:
                    state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name],
                                           capture_output=True, text=True, check=True).stdout.strip()
                    assert state == "true", "operator container exited"
                    return await asyncio.to_thread(_healthz, liveness)

                await eventually(alive, "the operator's liveness endpoint", timeout_s=60)
                print(f"ok: operator liveness {liveness}")
                # what the sample references
                for secret, key in (("kvfleet-transfer", "secret"), ("kv-redis", "url")):
                    await api.create({"apiVersion": "v1", "kind": "Secret",
                                      "metadata": {"name": secret, "namespace": NS},
                                      "data": {key: "c2VjcmV0"}})
                created = await api.create(samples.kvcachepool(name="llama", namespace=NS))

                async def children() -> bool:
                    for kind, child in (("ConfigMap", "llama-p0"), ("Deployment", "llama-p0-unified"),
                                        ("Service", "llama-p0"), ("InferencePool", "llama")):
                        obj = await api.get_or_none(kind, NS, child)
                        assert obj is not None, f"{kind}/{child} missing"
                        assert obj["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
                    return True

                await eventually(children, "the KVCachePool's children", timeout_s=60)
                print("ok: operator rendered ConfigMap, Deployment, Service, InferencePool for KVCachePool "
                      "llama")

                async def status() -> dict[str, Any] | None:
                    obj = await api.get("KVCachePool", NS, "llama")
                    return obj if (obj.get("status") or {}).get("observedGeneration") == 1 else None

                await eventually(status, "the KVCachePool's status", timeout_s=60)
                print("ok: operator wrote KVCachePool status (observedGeneration 1)")
                return 0
            except AssertionError as exc:
                print(f"FAIL: {exc}", file=sys.stderr)
                subprocess.run(["docker", "logs", "--tail", "40", name], check=False)
                return 1
            finally:
                await api.close()
                subprocess.run(["docker", "rm", "-f", name], check=False, stdout=subprocess.DEVNULL)


def main() -> int:
    return asyncio.run(run(sys.argv[1] if len(sys.argv) > 1 else "kvfleet:dev"))


if __name__ == "__main__":
    raise SystemExit(main())
