"""KVCachePool ``spec`` → typed, validated records (the operator's view of the CRD).

The API server applies the CRD's defaults and CEL rules before the operator
sees an object; :func:`parse_spec` applies the same defaults and checks the
same rules again (plus what only the operator knows, such as name lengths), so
an object that slipped past validation — an older CRD, a server without CEL —
still ends as a clear :class:`InvalidSpecError`, never a crash or a retry loop.
The defaults here equal the CRD's (checked by tests/operator/test_crd_schema.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.quantity import QuantityError, to_bytes

ENGINES = ("vllm", "sglang", "sim")
TIER_ORDER = ("gpu", "cpu", "ssd", "remote")
CODECS = ("none", "fp8_e4m3", "int8", "int4")
BACKENDS = ("shm", "tcp", "nixl", "mooncake")
HASH_ALGOS = ("xxh3_64", "sha256_cbor")
FAILURE_MODES = ("FailOpen", "FailClose")
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
#: Longest KVCachePool name: children are named ``<name>-p<NN>-prefill`` (≤ 63 characters).
MAX_NAME_LEN = 50


class InvalidSpecError(ValueError):
    """The KVCachePool cannot be realised as written; ``field`` is the offending path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelProfile:
    kv_bytes_per_token: int = 131072
    prefill_tokens_per_second: int = 10000
    decode_ms_per_token: float = 20.0


@dataclass(frozen=True)
class ModelSpec:
    name: str = ""
    tokenizer: str = ""
    profile: ModelProfile = field(default_factory=ModelProfile)


@dataclass(frozen=True)
class EngineSpec:
    kind: str = "sim"
    image: str = ""
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()

    @property
    def gpu(self) -> bool:
        """Real engines run on GPUs; the simulator is the CPU fallback."""
        return self.kind != "sim"


@dataclass(frozen=True)
class RoleSpec:
    name: str = "unified"
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Watermarks:
    high: float = 0.9
    low: float = 0.7


@dataclass(frozen=True)
class SecretRef:
    name: str = ""
    key: str = ""


@dataclass(frozen=True)
class TierSpec:
    name: str = "gpu"
    gpu_share: float | None = None
    capacity_bytes: int | None = None
    codec: str = "none"
    watermarks: Watermarks = field(default_factory=Watermarks)
    volume: Mapping[str, Any] | None = None
    redis_url: SecretRef | None = None


@dataclass(frozen=True)
class TransferSpec:
    backends: tuple[str, ...] = ("shm", "tcp")
    streams: int = 4
    secret: SecretRef | None = None


@dataclass(frozen=True)
class RoutingSpec:
    prefix_weight: float = 1.0
    load_weight: float = 1.0
    hotspot_decay: float = 0.1
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class PoolSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    block_size: int = 16
    hash_algo: str = "xxh3_64"
    engine: EngineSpec = field(default_factory=EngineSpec)
    roles: tuple[RoleSpec, ...] = (RoleSpec(),)
    pools: int = 1
    tiers: tuple[TierSpec, ...] = (TierSpec(name="gpu", gpu_share=0.9),)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    routing: RoutingSpec = field(default_factory=RoutingSpec)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode run in separate pods (P/D)."""
        return any(r.name == "prefill" for r in self.roles)

    def tier(self, name: str) -> TierSpec | None:
        return next((t for t in self.tiers if t.name == name), None)


# --- parsing -----------------------------------------------------------------


def _map(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidSpecError(path, f"must be an object, got {type(value).__name__}")
    return value


def _int(m: Mapping[str, Any], key: str, default: int, path: str, lo: int, hi: int) -> int:
    v = m.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidSpecError(f"{path}{key}", f"must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise InvalidSpecError(f"{path}{key}", f"must be in {lo}..{hi}, got {v}")
    return v


def _num(m: Mapping[str, Any], key: str, default: float, path: str, lo: float, hi: float,
         lo_open: bool = False) -> float:
    v = m.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidSpecError(f"{path}{key}", f"must be a number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise InvalidSpecError(f"{path}{key}", f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _enum(m: Mapping[str, Any], key: str, default: str, path: str, allowed: Sequence[str]) -> str:
    v = m.get(key, default)
    if v not in allowed:
        raise InvalidSpecError(f"{path}{key}", f"must be one of {', '.join(allowed)}; got {v!r}")
    return str(v)


def _str(m: Mapping[str, Any], key: str, path: str, required: bool = False, max_len: int = 1024) -> str:
    v = m.get(key, "")
    if not isinstance(v, str) or (required and not v):
        raise InvalidSpecError(f"{path}{key}", "is required" if required else f"must be a string, got {v!r}")
    if len(v) > max_len:
        raise InvalidSpecError(f"{path}{key}", f"must be at most {max_len} characters, got {len(v)}")
    return v


def _secret(value: Any, path: str, default_key: str) -> SecretRef:
    m = _map(value, path)
    return SecretRef(name=_str(m, "name", f"{path}.", required=True), key=str(m.get("key") or default_key))


def _roles(value: Any) -> tuple[RoleSpec, ...]:
    m = _map(value, "roles") if value is not None else {"unified": {}}
    unknown = sorted(set(m) - {"unified", "prefill", "decode"})
    if unknown:
        raise InvalidSpecError("roles",
                               f"unknown role(s) {', '.join(unknown)}; known: unified, prefill, decode")
    if ("prefill" in m) != ("decode" in m):
        raise InvalidSpecError("roles", "prefill and decode must be given together")
    if ("unified" in m) == ("prefill" in m):
        raise InvalidSpecError("roles", "give either unified or prefill+decode, not both and not neither")
    out = []
    for name in ("unified", "prefill", "decode"):
        if name in m:
            r = _map(m[name], f"roles.{name}")
            out.append(RoleSpec(
                name=name,
                replicas=_int(r, "replicas", 1, f"roles.{name}.", 0, 1024),
                resources=dict(_map(r.get("resources"), f"roles.{name}.resources")),
            ))
    return tuple(out)


def _tier(value: Any, i: int) -> TierSpec:
    path = f"tiers[{i}]"
    m = _map(value, path)
    name = _enum(m, "name", "", f"{path}.", TIER_ORDER)
    if name == "gpu":
        if "gpuShare" not in m or "capacity" in m:
            raise InvalidSpecError(path,
                                   "the gpu tier takes gpuShare; cpu, ssd and remote tiers take capacity")
    elif "capacity" not in m or "gpuShare" in m:
        raise InvalidSpecError(path, "the gpu tier takes gpuShare; cpu, ssd and remote tiers take capacity")
    capacity: int | None = None
    if "capacity" in m:
        try:
            capacity = to_bytes(m["capacity"])
        except QuantityError as exc:
            raise InvalidSpecError(f"{path}.capacity", str(exc)) from exc
        if capacity <= 0:
            raise InvalidSpecError(f"{path}.capacity", "capacity must be greater than 0")
    wm = _map(m.get("watermarks"), f"{path}.watermarks")
    watermarks = Watermarks(
        high=_num(wm, "high", 0.9, f"{path}.watermarks.", 0.0, 1.0, lo_open=True),
        low=_num(wm, "low", 0.7, f"{path}.watermarks.", 0.0, 1.0),
    )
    if not watermarks.low < watermarks.high:
        raise InvalidSpecError(f"{path}.watermarks", "watermarks.low must be below watermarks.high")
    if "volume" in m and name != "ssd":
        raise InvalidSpecError(path, "volume is only for the ssd tier")
    if ("redis" in m) != (name == "remote"):
        raise InvalidSpecError(path, "the remote tier needs redis.urlSecretRef" if name == "remote"
                               else "redis is only for the remote tier")
    redis = _map(m.get("redis"), f"{path}.redis")
    return TierSpec(
        name=name,
        gpu_share=_num(m, "gpuShare", 0.9, f"{path}.", 0.0, 1.0, lo_open=True) if name == "gpu" else None,
        capacity_bytes=capacity,
        codec=_enum(m, "codec", "none", f"{path}.", CODECS),
        watermarks=watermarks,
        volume=dict(_map(m.get("volume"), f"{path}.volume")) if "volume" in m else None,
        redis_url=(_secret(redis.get("urlSecretRef"), f"{path}.redis.urlSecretRef", "url")
                   if name == "remote" else None),
    )


def _tiers(value: Any) -> tuple[TierSpec, ...]:
    if value is None:
        return PoolSpec().tiers
    if not isinstance(value, list) or not 1 <= len(value) <= 4:
        raise InvalidSpecError("tiers", "must be a list of 1 to 4 tiers")
    tiers = tuple(_tier(t, i) for i, t in enumerate(value))
    ranks = [TIER_ORDER.index(t.name) for t in tiers]
    if ranks != sorted(set(ranks)) or ranks[0] != 0:
        raise InvalidSpecError(
            "tiers", "tiers must start with gpu (the engine's own KV memory) and be ordered gpu, cpu, ssd, "
                     "remote, each at most once")
    return tiers


def parse_spec(spec: Mapping[str, Any] | None, name: str = "") -> PoolSpec:
    """Validate and default a KVCachePool spec; raise :class:`InvalidSpecError` on the first problem."""
    if len(name) > MAX_NAME_LEN:
        raise InvalidSpecError("metadata.name",
                               f"must be at most {MAX_NAME_LEN} characters (children add suffixes)")
    s = _map(spec, "<root>")
    model = _map(s.get("model"), "model")
    profile = _map(model.get("profile"), "model.profile")
    engine = _map(s.get("engine"), "engine")
    args = engine.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidSpecError("engine.args", "must be a list of strings")
    env = engine.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, Mapping) and "name" in e for e in env):
        raise InvalidSpecError("engine.env", "must be a list of EnvVar objects with a name")
    transfer = _map(s.get("transfer"), "transfer")
    backends = transfer.get("backends", list(TransferSpec().backends))
    if not isinstance(backends, list) or not backends or any(b not in BACKENDS for b in backends):
        raise InvalidSpecError("transfer.backends", f"must be a non-empty list of {', '.join(BACKENDS)}")
    if len(set(backends)) != len(backends):
        raise InvalidSpecError("transfer.backends", "transfer backends must be unique")
    routing = _map(s.get("routing"), "routing")
    weights = _map(routing.get("weights"), "routing.weights")
    out = PoolSpec(
        model=ModelSpec(
            name=_str(model, "name", "model.", required=True, max_len=253),
            tokenizer=_str(model, "tokenizer", "model."),
            profile=ModelProfile(
                kv_bytes_per_token=_int(profile, "kvBytesPerToken", 131072, "model.profile.", 1, 2**40),
                prefill_tokens_per_second=_int(profile, "prefillTokensPerSecond", 10000, "model.profile.", 1,
                                               2**40),
                decode_ms_per_token=_num(profile, "decodeMsPerToken", 20.0, "model.profile.", 0.0, 1e9,
                                         lo_open=True),
            ),
        ),
        block_size=_int(s, "blockSize", 16, "", 1, 1024),
        hash_algo=_enum(s, "hashAlgo", "xxh3_64", "", HASH_ALGOS),
        engine=EngineSpec(
            kind=_enum(engine, "kind", "sim", "engine.", ENGINES),
            image=_str(engine, "image", "engine."),
            args=tuple(args),
            env=tuple(dict(e) for e in env),
        ),
        roles=_roles(s.get("roles")),
        pools=_int(s, "pools", 1, "", 1, 64),
        tiers=_tiers(s.get("tiers")),
        transfer=TransferSpec(
            backends=tuple(backends),
            streams=_int(transfer, "streams", 4, "transfer.", 1, 64),
            secret=(_secret(transfer["secretRef"], "transfer.secretRef", "secret")
                    if "secretRef" in transfer else None),
        ),
        routing=RoutingSpec(
            prefix_weight=_num(weights, "prefix", 1.0, "routing.weights.", 0.0, 1e9),
            load_weight=_num(weights, "load", 1.0, "routing.weights.", 0.0, 1e9),
            hotspot_decay=_num(weights, "hotspotDecay", 0.1, "routing.weights.", 0.0, 1.0),
            failure_mode=_enum(routing, "failureMode", "FailClose", "routing.", FAILURE_MODES),
        ),
    )
    if out.engine.kind == "vllm" and out.block_size not in VLLM_BLOCK_SIZES:
        raise InvalidSpecError("blockSize",
                               f"vLLM supports blockSize {', '.join(map(str, VLLM_BLOCK_SIZES))}")
    if out.disaggregated and all(b == "shm" for b in out.transfer.backends):
        raise InvalidSpecError("transfer.backends", "prefill/decode roles need a network transfer backend "
                                                    "(tcp, nixl or mooncake), not shm alone")
    vllm_backend = any(b in ("nixl", "mooncake") for b in out.transfer.backends)
    if out.engine.kind == "vllm" and out.disaggregated and not vllm_backend:
        raise InvalidSpecError("transfer.backends", "vLLM prefill/decode needs the nixl or mooncake backend "
                                                    "(vLLM's NixlConnector/MooncakeConnector)")
    return out
