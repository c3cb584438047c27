"""Fixtures of the interop suite: the interpreters of the real vLLM and SGLang releases
(scripts/interop_venvs.py builds them), the engine arguments the operator renders for a pool, and running a
checker script in a release's venv.

Every test here is marked ``interop`` (``make test-interop``; ``make unit`` leaves them to it). A
release whose venv is not built makes its tests skip with the command that builds it, unless
``KVFLEET_REQUIRE_INTEROP=1`` (``make test-interop``), where that is an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cache.hashing import BlockHasher, hashes_as_ints
from kvfleet.config import Settings
from kvfleet.config.operator import OperatorSettings
from kvfleet.demo.envoy import free_port
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.subscriber import EventSubscriber
from kvfleet.operator.engines import kv_events_config
from kvfleet.operator.manifests import ENGINE_CONTAINER, render_children
from kvfleet.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


HERE = Path(__file__).resolve().parent
TINY = HERE / "data" / "tiny-llama"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.conftest import mark_folder

    mark_folder(items, Path(__file__).parent, pytest.mark.interop)


def release(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` → ``(0, 5, 23)``, comparable with :mod:`kvfleet.operator.engines`' version constants."""
    return tuple(int(x) for x in version.split("."))


def engine_python(engine: str, version: str) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import interop_venvs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    found: Path | None = interop_venvs.python(engine, version)
    if found is None:
        reason = (f"{engine} {version} interop venv not built "
                  "(python scripts/interop_venvs.py build, or make interop)")
        if os.environ.get("KVFLEET_REQUIRE_INTEROP", "") not in ("", "0"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def vllm_python(version: str) -> Path:
    return engine_python("vllm", version)


def engine_args(
    pool: dict[str, Any], command: list[str], local_model: Callable[[list[str]], list[str]],
) -> dict[str, list[str]]:
    """role → the arguments of the engine container the operator renders for ``pool`` (whose command must be
    ``command``), passed through ``local_model``, which points them at the local config (no weights, no
    hub)."""
    out: dict[str, list[str]] = {}
    for child in render_children(pool, parse_spec(pool["spec"], "p"), Settings()):
        if child["kind"] != "Deployment":
            continue
        (engine,) = [c for c in child["spec"]["template"]["spec"]["containers"]
                     if c["name"] == ENGINE_CONTAINER]
        assert engine["command"] == command
        out[child["metadata"]["labels"]["kvfleet.io/role"]] = local_model(list(engine["args"]))
    return out


def run_checker(
    engine: str, version: str, script: str, cases: Mapping[str, list[str]], tmp: Path, env: Mapping[str, str],
) -> dict[str, dict[str, Any]]:
    """``script`` (tests/interop/, it prints one ``RESULT {json}`` line per case) in ``engine`` ``version``'s
    venv over ``cases`` (id → argv); id → its result. Fails with the script's stderr when a case has no
    result."""
    py = engine_python(engine, version)
    path = tmp / f"cases-{engine}-{version}.json"
    path.write_text(json.dumps([{"id": k, "argv": v} for k, v in cases.items()]))
    proc = subprocess.run([str(py), str(HERE / script), str(path)], capture_output=True, text=True,
                          timeout=900, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "HF_HUB_OFFLINE": "1",
                                            "TRANSFORMERS_OFFLINE": "1", **env})
    results = {r["id"]: r for r in (json.loads(line[7:]) for line in proc.stdout.splitlines()
                                    if line.startswith("RESULT "))}
    assert set(results) == set(cases), f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return results


# --- real engines' KV-event publishers into the EPP's subscriber ------------------------------------------


class Driver:
    """A driver script (tests/interop/*_publish.py) in ``engine`` ``version``'s venv, fed one JSON command a
    line; each command is answered by one ``OK {json}`` line. Its publisher binds the ``--kv-events-config``
    the operator renders, on free ports."""

    def __init__(self, engine: str, version: str, script: str, ports: tuple[int, int], tmp: Path,
                 env: Mapping[str, str]) -> None:
        config = kv_events_config(OperatorSettings(kv_events_port=ports[0], kv_events_replay_port=ports[1]))
        self.config = config
        self.proc = subprocess.Popen(
            [str(engine_python(engine, version)), str(HERE / script)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=(tmp / f"{engine}-{time.monotonic_ns()}.log").open("wb"),
            text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONHASHSEED": "0", **env})

    def cmd(self, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("OK "), f"publisher: {line!r} (exit {self.proc.poll()})"
        out: dict[str, Any] = json.loads(line[3:])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cmd(op="exit")
            self.proc.wait(30)


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids below 32,000."""
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def held(idx: BlockIndex, hasher: BlockHasher, toks: Sequence[int], pod: str) -> int:
    """How many leading full blocks of ``toks`` the index holds for ``pod``."""
    m = idx.match(hashes_as_ints(hasher.hash_tokens(list(toks))), [pod]).get(pod)
    return m.blocks if m else 0


def join(
    sub: EventSubscriber, idx: BlockIndex, hasher: BlockHasher, ports: tuple[int, int], pod: str,
) -> PodEventApplier:
    """The EPP subscribing to ``pod``'s publisher as it does in a cluster: recomputed keys, the rendered
    topic."""
    applier = PodEventApplier(pod, idx, hasher, recompute_keys=True)
    sub.add_pod(pod, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", applier, topic="kv-events")
    return applier


@pytest.fixture(params=["sha256_cbor", "xxh3_64"])
def algo(request: pytest.FixtureRequest) -> str:
    """The pool's ``hashAlgo``: the picker's keys, recomputed from the events' token ids."""
    return str(request.param)


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def subscriber() -> Iterator[EventSubscriber]:
    sub = EventSubscriber(replay_timeout_s=2.0)
    sub.start()
    yield sub
    sub.stop()
