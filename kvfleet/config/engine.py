"""Settings of the CPU-fallback engine simulator (``kvfleet engine``).

The simulator behaves like a vLLM pod whose timing comes from a model profile
(the seeds' cost model): prefill runs at ``prefill_tokens_per_s`` over the
uncached suffix only, each decode step costs ``decode_ms_per_step``, and a hit
in a slower tier pays that tier's read cost instead of prefill.
``time_factor`` scales every simulated duration into wall time (0.1 = ten
times faster than the modelled GPU), so a demo fits in minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class EngineProfile:
    """Speed and KV footprint of one model on one accelerator.

    Defaults: Llama-3-8B (32 layers, 8 KV heads of 128, fp16 → 128 KiB of KV per
    token) on one H100, with published vLLM throughput figures rounded.
    """

    name: str = "llama-3-8b-h100"
    prefill_tokens_per_s: float = 16000.0
    decode_ms_per_step: float = 9.0
    decode_ms_per_seq: float = 0.05
    kv_bytes_per_token: int = 131072
    max_model_len: int = 131072

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_ms_per_step < 0 or self.decode_ms_per_seq < 0:
            raise ValueError("profile speeds must be positive")
        if self.kv_bytes_per_token <= 0 or self.max_model_len <= 0:
            raise ValueError("kv_bytes_per_token and max_model_len must be > 0")


#: Built-in profiles by name (``engine.profile_name``); ``engine.profile`` overrides fields.
PROFILES: dict[str, EngineProfile] = {
    "llama-3-8b-h100": EngineProfile(),
    "llama-3-70b-h100x4": EngineProfile(
        name="llama-3-70b-h100x4", prefill_tokens_per_s=6000.0, decode_ms_per_step=22.0, kv_bytes_per_token=327680
    ),
    "qwen2.5-7b-l4": EngineProfile(
        name="qwen2.5-7b-l4", prefill_tokens_per_s=3500.0, decode_ms_per_step=28.0, kv_bytes_per_token=57344
    ),
}


@dataclass(frozen=True)
class EngineTierSettings:
    """The simulator's own slower tiers, used when no kvfleet agent tier manager is configured.

    ``cpu_blocks`` host blocks (LRU), then ``ssd_dir`` with up to ``ssd_blocks``
    block files that survive a restart (empty ``ssd_dir`` disables the SSD tier).
    Read bandwidths price a promotion in the cost model.
    """

    cpu_blocks: int = 0
    ssd_dir: str = ""
    ssd_blocks: int = 65536
    cpu_read_gbps: float = 20.0
    ssd_read_gbps: float = 3.0

    def __post_init__(self) -> None:
        if self.cpu_blocks < 0 or self.ssd_blocks < 0:
            raise ValueError("tier capacities must be >= 0")
        if self.cpu_read_gbps <= 0 or self.ssd_read_gbps <= 0:
            raise ValueError("tier bandwidths must be > 0")


@dataclass(frozen=True)
class EngineSettings:
    """One simulated model server.

    ``role``: ``both`` (unified), ``prefill`` or ``decode``. A decode engine
    that gets ``x-prefiller-host-port`` asks that engine to prefill and pulls
    the KV blocks from it. ``sim_kv_values_per_token`` is the size of the tiny
    deterministic KV stand-in (fp16 values per token), so blocks can be checked
    byte-for-byte after a transfer or a tier round trip.
    """

    model: str = "llama-3-8b"
    profile_name: str = "llama-3-8b-h100"
    profile: EngineProfile | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    kv_events_port: int = 5557
    kv_events_replay_port: int = 5558
    kv_events_topic: str = ""
    pod_name: str = "sim-0"
    pool: str = "default"
    role: str = "both"
    time_factor: float = 1.0
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_output_tokens: int = 4096
    sim_kv_values_per_token: int = 8
    replay_buffer_steps: int = 10000
    tiers: EngineTierSettings = field(default_factory=EngineTierSettings)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.time_factor < 0:
            raise ValueError("time_factor must be >= 0")
        if self.num_gpu_blocks <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("num_gpu_blocks, max_num_seqs and max_num_batched_tokens must be > 0")
        if self.profile is None and self.profile_name not in PROFILES:
            raise ValueError(f"unknown profile {self.profile_name!r}; known: {', '.join(sorted(PROFILES))}")
        if self.sim_kv_values_per_token <= 0:
            raise ValueError("sim_kv_values_per_token must be > 0")

    @property
    def model_profile(self) -> EngineProfile:
        """The effective profile: ``profile`` when given, else the named built-in one."""
        return self.profile if self.profile is not None else PROFILES[self.profile_name]
