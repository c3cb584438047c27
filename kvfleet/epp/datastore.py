"""Where the picker learns of pools and pods: a static YAML file, or Kubernetes (see ``kube.py``).

The file format (``pods_file``)::

    pools:
      - name: pool-a
        models: [llama]          # models this pool serves
        weight: 1.0              # multiplies the pool's capacity (level 1: kvfleet.epp.scheduling.pools)
        block_size: 16           # the pool's KV block size and hashing (default: the picker's cache settings)
        hash_algo: xxh3_64       # xxh3_64 | sha256_cbor
        tokenizer: builtin:qwen2.5   # the engines' tokenizer (default: the picker's epp.tokenizer)
        chat_dialect: vllm       # vllm | sglang | sglang-0.5.3: how the engines feed the chat template
        hash_seed: vllm-none-hash
        weights: {prefix: 1.0, load: 1.0, hotspotDecay: 0.1}   # KVCachePool spec.routing.weights
        pods:
          - name: pod-0
            address: 127.0.0.1
            port: 8000
            role: both           # both | prefill | decode
            shard: "0"           # prefix shard inside the pool (label kvfleet.io/shard); optional
            events: tcp://127.0.0.1:5557     # KV-event PUB endpoint (optional)
            replay: tcp://127.0.0.1:5558     # replay ROUTER endpoint (optional)
            metrics: http://127.0.0.1:8000/metrics  (optional)
            kv_blocks: 8192      # the engine's GPU KV blocks (optional): level-1 capacity

:meth:`StaticDatastore.reload` re-reads the file; listeners hear of pods that
came and went, so the event subscriber and metrics scraper follow.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from kvfleet.cache.hashing import ALGORITHMS
from kvfleet.cache.modeltok import DIALECTS
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
    #: the prefix shard (a pod subset of the pool, label ``kvfleet.io/shard``) level 1 routes to;
    #: "" = one shard
    shard: str = ""
    events: str | None = None
    replay: str | None = None
    metrics: str | None = None
    ready: bool = True
    #: the engine's GPU KV blocks (pods file ``kv_blocks``, annotation ``kvfleet.io/kv-blocks``);
    #: ``None``: unknown
    kv_blocks: int | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


@dataclass(frozen=True)
class PoolCache:
    """How a pool's engines key their KV blocks and how the picker weighs its scorers for that pool.

    ``None`` = the picker's own setting (``cache.block_size``, ``cache.hash_algo``, ``cache.hash_seed``,
    ``epp.hotspot_beta``). ``prefix_weight`` multiplies the prefix scorers' weights of the scheduling
    profile, ``load_weight`` the load scorers' (queue, KV utilisation, in-flight); ``hotspot_decay`` is the
    hot-spot decay β of the prefix scorer. The operator writes them in the InferencePool's
    ``kvfleet.io/routing`` annotation from the KVCachePool's ``blockSize``, ``hashAlgo`` and
    ``routing.weights``.

    ``tokenizer``: how the pool's engines turn a request into token ids (``bytes``, ``builtin:NAME``, a
    directory with the model's tokenizer files, or a Hugging Face repository ``hf:ORG/NAME[@REV]``;
    :mod:`kvfleet.epp.tokenize`), ``None`` = the picker's ``epp.tokenizer``; ``chat_dialect``: how their
    OpenAI layer feeds the chat template (:data:`kvfleet.cache.modeltok.DIALECTS`; ``None`` = ``vllm``).
    The operator writes both from the KVCachePool's ``model.tokenizer`` and engine.
    """

    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    prefix_weight: float = 1.0
    load_weight: float = 1.0
    hotspot_decay: float | None = None
    tokenizer: str | None = None
    chat_dialect: str | None = None

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.hash_algo is not None and self.hash_algo not in ALGORITHMS:
            raise ValueError(
                f"hash_algo must be one of {', '.join(sorted(ALGORITHMS))}, got {self.hash_algo!r}")
        if self.prefix_weight < 0 or self.load_weight < 0:
            raise ValueError("routing weights must be >= 0")
        if self.hotspot_decay is not None and self.hotspot_decay < 0:
            raise ValueError("hotspotDecay must be >= 0")
        if self.tokenizer is not None and not self.tokenizer.strip():
            raise ValueError("tokenizer must be a non-empty string")
        if self.chat_dialect is not None and self.chat_dialect not in DIALECTS:
            raise ValueError(f"chatDialect must be one of {', '.join(DIALECTS)}, got {self.chat_dialect!r}")


@dataclass(frozen=True)
class Pool:
    """A set of pods serving the same models (an InferencePool), or a prefix shard of one (a pod subset).

    ``weight`` multiplies the capacity level 1 derives from the pods
    (:func:`kvfleet.epp.scheduling.pools.capacity`)."""

    name: str = ""
    models: tuple[str, ...] = ()
    weight: float = 1.0
    pods: tuple[Pod, ...] = field(default_factory=tuple)
    cache: PoolCache = field(default_factory=PoolCache)

    @functools.cached_property
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


def pool_cache(raw: Mapping[str, Any], where: str) -> PoolCache:
    """A pool's :class:`PoolCache` from ``block_size``/``hash_algo``/``hash_seed``/``weights`` (camelCase
    ``blockSize``/``hashAlgo``/``hashSeed`` too, as the operator writes them); raises DatastoreError."""
    weights = raw.get("weights") or {}
    if not isinstance(weights, Mapping):
        raise DatastoreError(f"{where}.weights must be a mapping")
    unknown = set(weights) - {"prefix", "load", "hotspotDecay"}
    if unknown:
        raise DatastoreError(
            f"{where}.weights: unknown key(s) {sorted(unknown)}; known: prefix, load, hotspotDecay")

    def opt(*names: str) -> Any:
        return next((raw[n] for n in names if raw.get(n) is not None), None)

    try:
        bs, algo = opt("block_size", "blockSize"), opt("hash_algo", "hashAlgo")
        seed = opt("hash_seed", "hashSeed")
        tok, dialect = opt("tokenizer"), opt("chat_dialect", "chatDialect")
        decay = weights.get("hotspotDecay")
        return PoolCache(
            block_size=None if bs is None else int(bs),
            hash_algo=None if algo is None else str(algo),
            hash_seed=None if seed is None else str(seed),
            prefix_weight=float(weights.get("prefix", 1.0)),
            load_weight=float(weights.get("load", 1.0)),
            hotspot_decay=None if decay is None else float(decay),
            tokenizer=None if tok is None else str(tok),
            chat_dialect=None if dialect is None else str(dialect),
        )
    except (TypeError, ValueError) as exc:
        raise DatastoreError(f"{where}: {exc}") from None


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
        unknown_keys = set(raw) - {"name", "models", "weight", "pods", "block_size", "blockSize", "hash_algo",
                                   "hashAlgo", "hash_seed", "hashSeed", "weights", "tokenizer",
                                   "chat_dialect", "chatDialect"}
        if unknown_keys:
            raise DatastoreError(f"{where}: unknown key(s) {sorted(unknown_keys)}")
        models = raw.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise DatastoreError(f"{where}.models must be a list of strings")
        pods: list[Pod] = []
        for j, rp in enumerate(raw.get("pods") or []):
            pw = f"{where}.pods[{j}]"
            if not isinstance(rp, dict):
                raise DatastoreError(f"{pw}: must be a mapping")
            unknown = set(rp) - {"name", "address", "port", "role", "shard", "events", "replay", "metrics",
                                 "ready", "kv_blocks"}
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
                    kv_blocks=None if rp.get("kv_blocks") is None else int(rp["kv_blocks"]),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise DatastoreError(f"{pw}: needs name, address and an integer port ({exc})") from None
            if pod.kv_blocks is not None and pod.kv_blocks <= 0:
                raise DatastoreError(f"{pw}.kv_blocks must be > 0")
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
        cache = pool_cache(raw, where)
        pools.append(
            Pool(name=raw["name"], models=tuple(models), weight=weight, pods=tuple(pods), cache=cache))
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
