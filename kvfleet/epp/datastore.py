"""Where the picker learns of pools and pods: a static YAML file, or Kubernetes (see ``kube.py``).

The file format (``pods_file``)::

    pools:
      - name: pool-a
        models: [llama]          # models this pool serves
        weight: 1.0              # capacity weight for level-1 rendezvous hashing
        pods:
          - name: pod-0
            address: 127.0.0.1
            port: 8000
            role: both           # both | prefill | decode
            shard: "0"           # prefix shard inside the pool (label kvfleet.io/shard); optional
            events: tcp://127.0.0.1:5557     # KV-event PUB endpoint (optional)
            replay: tcp://127.0.0.1:5558     # replay ROUTER endpoint (optional)
            metrics: http://127.0.0.1:8000/metrics  (optional)

:meth:`StaticDatastore.reload` re-reads the file; listeners hear of pods that
came and went, so the event subscriber and metrics scraper follow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from kvfleet.epp.errors import DatastoreError

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class Pod:
    """One model-server endpoint."""

    name: str = ""
    address: str = ""
    port: int = 0
    pool: str = ""
    role: str = "both"
    #: the prefix shard (a pod subset of the pool, label ``kvfleet.io/shard``) level 1 routes to; "" = one shard
    shard: str = ""
    events: str | None = None
    replay: str | None = None
    metrics: str | None = None
    ready: bool = True

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


@dataclass(frozen=True)
class Pool:
    """A set of pods serving the same models (an InferencePool)."""

    name: str = ""
    models: tuple[str, ...] = ()
    weight: float = 1.0
    pods: tuple[Pod, ...] = field(default_factory=tuple)

    @property
    def disaggregated(self) -> bool:
        roles = {p.role for p in self.pods}
        return "prefill" in roles and "decode" in roles


PodListener = Callable[[Sequence[Pod], Sequence[Pod]], None]
"""Called with (added or changed pods, removed pods)."""


class Datastore(Protocol):
    """The picker's view of the fleet."""

    def pools(self) -> Sequence[Pool]: ...

    def subscribe(self, listener: PodListener) -> None: ...

    def has_synced(self) -> bool:
        """``True`` once the first full view of pools and pods is in (the picker is ready then)."""
        ...


class _ListenerMixin:
    def __init__(self) -> None:
        self._listeners: list[PodListener] = []
        self._pools: tuple[Pool, ...] = ()
        self._lock = threading.Lock()
        self._synced = threading.Event()

    def pools(self) -> Sequence[Pool]:
        return self._pools

    def has_synced(self) -> bool:
        return self._synced.is_set()

    def subscribe(self, listener: PodListener) -> None:
        self._listeners.append(listener)
        pods = [p for pool in self._pools for p in pool.pods]
        if pods:
            listener(pods, [])

    def _set_pools(self, pools: Sequence[Pool]) -> None:
        with self._lock:
            old = {p.name: p for pool in self._pools for p in pool.pods}
            new = {p.name: p for pool in pools for p in pool.pods}
            self._pools = tuple(pools)
        changed = [p for n, p in new.items() if old.get(n) != p]
        gone = [p for n, p in old.items() if n not in new]
        if changed or gone:
            for listener in self._listeners:
                listener(changed, gone)


def pools_from_dict(data: Any, source: str = "<config>") -> list[Pool]:
    """Validate and build pools; raises :class:`DatastoreError` naming the bad entry."""
    if not isinstance(data, dict) or not isinstance(data.get("pools"), list):
        raise DatastoreError(f"{source}: expected a mapping with a 'pools' list")
    pools: list[Pool] = []
    seen: set[str] = set()
    for i, raw in enumerate(data["pools"]):
        where = f"{source}: pools[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise DatastoreError(f"{where}: needs a 'name'")
        models = raw.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise DatastoreError(f"{where}.models must be a list of strings")
        pods: list[Pod] = []
        for j, rp in enumerate(raw.get("pods") or []):
            pw = f"{where}.pods[{j}]"
            if not isinstance(rp, dict):
                raise DatastoreError(f"{pw}: must be a mapping")
            unknown = set(rp) - {"name", "address", "port", "role", "shard", "events", "replay", "metrics", "ready"}
            if unknown:
                raise DatastoreError(f"{pw}: unknown key(s) {sorted(unknown)}")
            try:
                pod = Pod(
                    name=str(rp["name"]),
                    address=str(rp["address"]),
                    port=int(rp["port"]),
                    pool=raw["name"],
                    role=str(rp.get("role", "both")),
                    shard=str(rp.get("shard", "")),
                    events=rp.get("events"),
                    replay=rp.get("replay"),
                    metrics=rp.get("metrics"),
                    ready=bool(rp.get("ready", True)),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise DatastoreError(f"{pw}: needs name, address and an integer port ({exc})") from None
            if pod.role not in ROLES:
                raise DatastoreError(f"{pw}.role must be one of {', '.join(ROLES)}")
            if pod.name in seen:
                raise DatastoreError(f"{pw}: duplicate pod name {pod.name!r}")
            seen.add(pod.name)
            pods.append(pod)
        try:
            weight = float(raw.get("weight", 1.0))
        except (TypeError, ValueError):
            raise DatastoreError(f"{where}.weight must be a number") from None
        if weight <= 0:
            raise DatastoreError(f"{where}.weight must be > 0")
        pools.append(Pool(name=raw["name"], models=tuple(models), weight=weight, pods=tuple(pods)))
    return pools


class StaticDatastore(_ListenerMixin):
    """Pools and pods from a YAML file (or a mapping); :meth:`reload` applies edits."""

    def __init__(self, path: str | Path | None = None, data: Any = None) -> None:
        super().__init__()
        self.path = None if path is None else Path(path)
        self._mtime = 0.0
        if data is not None:
            self._set_pools(pools_from_dict(data))
        elif self.path is not None:
            self.reload(force=True)
        self._synced.set()  # a file or a mapping is the whole view at once

    def set(self, data: Any) -> None:
        self._set_pools(pools_from_dict(data))

    def reload(self, force: bool = False) -> bool:
        """Re-read the file when it changed; a bad file keeps the previous pools and raises."""
        if self.path is None:
            return False
        mtime = self.path.stat().st_mtime
        if not force and mtime == self._mtime:
            return False
        try:
            data = yaml.safe_load(self.path.read_text())
        except yaml.YAMLError as exc:
            raise DatastoreError(f"{self.path}: not valid YAML: {exc}") from None
        pools = pools_from_dict(data, str(self.path))
        self._mtime = mtime
        self._set_pools(pools)
        return True
