"""Settings of the CPU-fallback engine simulator (``kvfleet engine``).

The simulator behaves like a vLLM pod whose timing comes from the cost model:
prefill runs at the model profile's ``prefill_tokens_per_s`` over the uncached
suffix only (the profile is the tier manager's
:class:`~kvfleet.config.tiers.ModelProfile`, ``tiers.model``: one source for
prefill speed and KV bytes per token), each decode step costs
``decode_ms_per_step`` (+ ``decode_ms_per_seq`` per running sequence), and a
hit in a slower tier pays that tier's read cost instead of prefill.
``time_factor`` scales every simulated duration into wall time (0.1 = ten
times faster than the modelled GPU), so a demo fits in minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class EngineTierSettings:
    """The tiers below the simulator's GPU stand-in.

    ``backend``: ``local`` — the simulator's own small tiers: ``cpu_blocks``
    host blocks (LRU), then ``ssd_dir`` with up to ``ssd_blocks`` block files
    that survive a restart (empty ``ssd_dir`` disables it); read bandwidths
    price a promotion. ``agent`` — the node agent's tier manager, configured by
    the top-level ``tiers:`` settings (its GPU tier is turned off); ``none``.
    """

    backend: str = "local"
    cpu_blocks: int = 0
    ssd_dir: str = ""
    ssd_blocks: int = 65536
    cpu_read_gbps: float = 20.0
    ssd_read_gbps: float = 3.0

    def __post_init__(self) -> None:
        if self.backend not in ("local", "agent", "none"):
            raise ValueError(f"tiers.backend must be one of local, agent, none; got {self.backend!r}")
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
    decode_ms_per_step: float = 9.0
    decode_ms_per_seq: float = 0.05
    max_model_len: int = 131072
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
        if self.decode_ms_per_step < 0 or self.decode_ms_per_seq < 0 or self.max_model_len <= 0:
            raise ValueError("decode times must be >= 0 and max_model_len > 0")
        if self.sim_kv_values_per_token <= 0:
            raise ValueError("sim_kv_values_per_token must be > 0")
