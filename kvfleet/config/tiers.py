"""Settings of the node agent's tier manager: one spec per tier, the model profile, migration.

Capacities count *encoded* bytes (after the tier's codec). Bandwidth and
latency left at ``0`` / ``-1`` are calibrated when the manager starts
(``calibrate: true``) or fall back to the nominal figures of
:data:`NOMINAL_COSTS`; a positive value overrides both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.cache.cost import DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_PREFILL_TOKENS_PER_S

GiB = 1 << 30
MiB = 1 << 20

#: Nominal (read GB/s, write GB/s, latency µs) per tier, used when not calibrated or configured.
NOMINAL_COSTS: dict[str, tuple[float, float, float]] = {
    "gpu": (1000.0, 1000.0, 1.0),
    "cpu": (20.0, 20.0, 1.0),
    "ssd": (2.0, 1.0, 100.0),
    "remote": (1.0, 1.0, 1000.0),
}


@dataclass(frozen=True)
class TierSpec:
    """One tier: whether it is used, how big it is, when it demotes and how it encodes."""

    enabled: bool = True
    capacity_bytes: int = 1 * GiB
    #: demote when used/capacity rises above this ...
    high_watermark: float = 0.9
    #: ... until it is at or below this.
    low_watermark: float = 0.75
    #: codec name: none, fp8_e4m3, int8, int4.
    codec: str = "none"
    #: storage backend name (registry in kvfleet.agent.tiers.backends); "" = the tier's default.
    backend: str = ""
    read_gbps: float = 0.0
    write_gbps: float = 0.0
    latency_us: float = -1.0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1, got low={self.low_watermark} "
                f"high={self.high_watermark}"
            )
        if self.read_gbps < 0 or self.write_gbps < 0:
            raise ValueError("read_gbps/write_gbps must be >= 0 (0 = calibrate)")


#: ``MemoryTierSpec.device`` values besides ``cuda:N``.
MEMORY_DEVICES = ("auto", "cuda", "cpu", "host")


@dataclass(frozen=True)
class MemoryTierSpec(TierSpec):
    """A memory tier (``cpu``; ``gpu`` on a torch device or standing in for HBM): slabs of fixed slots."""

    #: bytes per slot; 0 = the encoded size of the first block stored (rounded up to 64 bytes).
    slot_bytes: int = 0
    slab_bytes: int = 64 * MiB
    #: where the gpu tier's slots live (read for the gpu tier only; the cpu tier leaves it at auto or host).
    #: "auto" = CUDA when torch is installed and torch.cuda.is_available(), else the host arena standing
    #: in for HBM; "cuda" / "cuda:N" = that CUDA device through torch (start fails when there is none);
    #: "cpu" = the torch code path on the torch cpu device (a stand-in, used by tests); "host" = the arena.
    device: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in MEMORY_DEVICES and not _is_cuda_index(self.device):
            raise ValueError(
                f"device must be one of {', '.join(MEMORY_DEVICES)} or cuda:N, got {self.device!r}")
        if self.backend == "torch" and self.device == "host":
            raise ValueError(
                "backend 'torch' needs a torch device (device auto, cuda, cuda:N or cpu), got device 'host'")
        if self.backend not in ("", "torch") and self.device not in ("auto", "host"):
            raise ValueError(f"device {self.device!r} needs backend 'torch' (or the default ''), got backend "
                             f"{self.backend!r}")


def _is_cuda_index(device: str) -> bool:
    prefix, sep, index = device.partition(":")
    return prefix == "cuda" and bool(sep) and index.isascii() and index.isdigit()


@dataclass(frozen=True)
class SsdTierSpec(TierSpec):
    """The local-disk tier under ``path``: slab files of block slots (backend ``slab``, the default) or a file
    per block (``files``)."""

    capacity_bytes: int = 16 * GiB
    path: str = "/var/lib/kvfleet/ssd"
    #: slab backend: O_DIRECT slot I/O, so the page cache does not hold a second copy of what the
    #: memory tiers cache (falls back to buffered I/O where the filesystem refuses it, e.g. tmpfs).
    direct_io: bool = True


@dataclass(frozen=True)
class RemoteTierSpec(TierSpec):
    """The Redis-protocol tier (Redis, Valkey); keys are ``{prefix}:{pool}:{model}:{hash}``."""

    enabled: bool = False
    capacity_bytes: int = 64 * GiB
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvfleet"
    pool: str = "default"
    model: str = "default"
    socket_timeout_s: float = 1.0
    #: after a connection error, the tier is skipped for this long before retrying.
    retry_after_s: float = 5.0


@dataclass(frozen=True)
class ModelProfile:
    """What a block costs to recompute: the prefill side of the promotion inequality."""

    name: str = "llama-3-8b-fp16"
    #: 2 (K,V) × layers × kv_heads × head_dim × bytes: 2·32·8·128·2 for Llama-3-8B.
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.prefill_tokens_per_s <= 0 or self.block_size <= 0:
            raise ValueError("kv_bytes_per_token, prefill_tokens_per_s and block_size must be > 0")


@dataclass(frozen=True)
class TierSettings:
    """The tier manager: tiers fastest first, model profile, calibration and migration queues."""

    gpu: MemoryTierSpec = field(default_factory=lambda: MemoryTierSpec(capacity_bytes=2 * GiB))
    cpu: MemoryTierSpec = field(default_factory=lambda: MemoryTierSpec(capacity_bytes=8 * GiB))
    ssd: SsdTierSpec = field(default_factory=SsdTierSpec)
    remote: RemoteTierSpec = field(default_factory=RemoteTierSpec)
    model: ModelProfile = field(default_factory=ModelProfile)
    #: measure tier bandwidth/latency at start-up (values set in a spec win).
    calibrate: bool = True
    calibrate_bytes: int = 4 * MiB
    #: blocks moved per migration batch.
    migration_batch: int = 32
    #: bound of each migration queue (promotions, writes to slow tiers).
    queue_depth: int = 1024
    #: promotion threads: their reads overlap each other's checksums and copies and keep several
    #: reads in flight on the disk (a promotion is on a request's path).
    promotion_workers: int = 4
    #: threads writing demoted and spilled blocks to ssd/remote (background work: one by default, so
    #: that it leaves the CPU and the GIL to the engine's step loop; 2 raises demotion throughput by
    #: about a tenth and the step's p99 under full-speed demotion by about half a millisecond).
    demotion_workers: int = 1
    #: emit BlockStored for blocks found in ssd/remote at start-up.
    announce_on_start: bool = True

    def __post_init__(self) -> None:
        if min(self.migration_batch, self.queue_depth, self.promotion_workers, self.demotion_workers) <= 0:
            raise ValueError(
                "migration_batch, queue_depth, promotion_workers and demotion_workers must be > 0")
        if self.cpu.device not in ("auto", "host"):
            raise ValueError("the cpu tier is host memory: device applies to the gpu tier only, got cpu "
                             f"device {self.cpu.device!r}")
