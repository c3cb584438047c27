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

import ipaddress
import re
from dataclasses import dataclass, field

ROLES = ("both", "prefill", "decode")

#: Longest ``host:port`` accepted (a DNS name is at most 253 characters).
MAX_HOST_PORT_LEN = 261
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class HostPort:
    """One ``host:port``: ``host`` is a normalised IP literal (``ip`` set) or a lower-case DNS name."""

    host: str
    port: int
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None

    @property
    def url_host(self) -> str:
        """The host as it goes into a URL (IPv6 in brackets)."""
        return f"[{self.host}]" if isinstance(self.ip, ipaddress.IPv6Address) else self.host

    def __str__(self) -> str:
        return f"{self.url_host}:{self.port}"


def parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP literal (an IPv4-mapped IPv6 address becomes its IPv4 address), else ``None``."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id is not None:
            return None
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
    return ip


def parse_host_port(value: str) -> HostPort:
    """Parse exactly one ``host:port`` strictly; raises ValueError saying what is wrong.

    ``host`` is an IPv4 literal, a bracketed IPv6 literal (``[::1]:8000``) or a
    DNS name (RFC 1123 labels, at most 253 characters); ``port`` is 1–65535 in
    plain digits. Lists, whitespace, userinfo, paths and zone ids are refused.
    """
    if not isinstance(value, str) or not value:
        raise ValueError("expected HOST:PORT, got an empty value")
    if len(value) > MAX_HOST_PORT_LEN:
        raise ValueError(f"expected one HOST:PORT, got {len(value)} characters")
    if not value.isascii() or not value.isprintable() or any(c in value for c in " \t,;/@?#%"):
        raise ValueError("expected one HOST:PORT without spaces, lists, paths or zone ids")
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 : end + 2] != ":":
            raise ValueError("expected [IPV6]:PORT")
        host_text, port_text = value[1:end], value[end + 2 :]
        ip = parse_ip(host_text)
        if not isinstance(ip, ipaddress.IPv6Address) and not (ip is not None and ":" in host_text):
            raise ValueError(f"{host_text!r} is not an IPv6 address")
    else:
        host_text, sep, port_text = value.rpartition(":")
        if not sep or not host_text:
            raise ValueError("expected HOST:PORT")
        if ":" in host_text:
            raise ValueError("an IPv6 address must be in brackets: [ADDRESS]:PORT")
        ip = parse_ip(host_text)
    if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port must be an integer in 1..65535, got {port_text[:16]!r}")
    if ip is not None:
        return HostPort(str(ip), int(port_text), ip)
    name = host_text.lower().removesuffix(".")
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"{host_text[:64]!r} is neither an IP address nor a DNS name")
    return HostPort(name, int(port_text))


@dataclass(frozen=True)
class EngineTierSettings:
    """The tiers below the simulator's GPU stand-in: the node agent's tier manager, sized in blocks.

    ``cpu_blocks`` host blocks (an LRU; 0 = no cpu tier), then the ssd tier in
    ``ssd_dir`` with room for ``ssd_blocks`` blocks, kept across restarts
    (empty ``ssd_dir`` or 0 = none). The rest of the manager's settings (codecs,
    the ssd backend, watermarks, the remote tier) is the top-level ``tiers:``
    (:mod:`kvfleet.engine.tiers`). The read bandwidths price a promotion into
    the GPU stand-in in the engine's cost model.
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

    ``prefill_peers``: the engines this one may ask to prefill, each
    ``HOST:PORT`` (IP literal or DNS name; a name counts for every address it
    resolves to, so a headless Service name admits each pod of the prefill
    pool). An ``x-prefiller-host-port`` naming anything else is refused with
    403 before any connection is made; empty refuses every prefiller. P/D also
    needs the pool's transfer secret (``transfer.secret_file`` or
    ``KVFLEET_TRANSFER_SECRET``): it signs the engines' requests to each other
    and authenticates the KV transfer.

    ``replay_buffer_steps`` / ``replay_buffer_bytes``: the KV-event replay buffer
    keeps at most that many batches and that many bytes of them (oldest first out).

    ``tokenizer``: how prompts become token ids, as a vLLM server of that model does
    (:mod:`kvfleet.cache.modeltok`): ``builtin:NAME`` (files shipped with kvfleet), a directory with the
    model's ``tokenizer.json`` and chat template, or ``bytes`` (one token per UTF-8 byte and kvfleet's own
    chat template; for tests that need no files).
    """

    model: str = "llama-3-8b"
    tokenizer: str = "builtin:qwen2.5"
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
    replay_buffer_bytes: int = 32 * 1024 * 1024
    prefill_peers: tuple[str, ...] = ()
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
        if self.replay_buffer_steps <= 0 or self.replay_buffer_bytes <= 0:
            raise ValueError("replay_buffer_steps and replay_buffer_bytes must be > 0")
        if not self.tokenizer.strip():
            raise ValueError("tokenizer must be bytes, builtin:NAME or a directory")
        for peer in self.prefill_peers:
            try:
                parse_host_port(peer)
            except ValueError as exc:
                raise ValueError(f"prefill_peers: {peer!r}: {exc}") from None
