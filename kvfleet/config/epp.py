"""Settings of the endpoint picker (``kvfleet epp``): ports, request limits, index, scheduling, cost model."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.cache.cost import DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_PREFILL_TOKENS_PER_S


@dataclass(frozen=True)
class PluginSpec:
    """One scheduling plugin of the profile: its registered ``type``, a ``weight`` (scorers) and
    parameters."""

    type: str = ""
    weight: float = 1.0
    params: dict[str, float] = field(default_factory=dict)


def default_plugins(fallbacks: int = 0) -> tuple[PluginSpec, ...]:
    """The default scheduling profile; ``fallbacks``: next-best endpoints the picker returns after its pick (0
    unless the gateway walks the list: ``kvfleet gateway-config --routing override_host``)."""
    return (
        PluginSpec(type="ready-filter"),
        PluginSpec(type="prefix-cache-scorer", weight=1.0),
        PluginSpec(type="queue-scorer", weight=1.0),
        PluginSpec(type="kv-cache-utilization-scorer", weight=0.05),
        PluginSpec(type="prefix-affinity-scorer", weight=1.0),
        PluginSpec(type="eviction-cost-scorer", weight=1.0),
        PluginSpec(type="recompute-load-scorer", weight=1.0),
        PluginSpec(type="copy-value-scorer", weight=1.0),
        PluginSpec(type="max-score-picker", params={"fallbacks": fallbacks}),
    )


@dataclass(frozen=True)
class CostModelSettings:
    """The cost model the scorers price hits and queues with (seconds, bytes).

    A block found in a slower tier is worth what it saves after its load cost:
    ``weight(tier) = max(0, 1 - load_s_per_token(tier) / prefill_s_per_token)`` with
    ``load_s_per_token = kv_bytes_per_token / bandwidth(tier)``.
    """

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    cpu_gbps: float = 20.0
    ssd_gbps: float = 2.0
    remote_gbps: float = 1.0

    def __post_init__(self) -> None:
        if min(self.prefill_tokens_per_s, self.cpu_gbps, self.ssd_gbps, self.remote_gbps) <= 0:
            raise ValueError("cost model rates must be > 0")


@dataclass(frozen=True)
class EppSettings:
    """Everything ``kvfleet epp`` needs; defaults are a working local configuration.

    ``datastore`` is ``static`` (pods and pools from ``pods_file``) or
    ``kubernetes`` (watch Pods and InferencePools in ``namespace``; with
    ``service_name`` set, only the InferencePools whose ``endpointPickerRef``
    names that Service, as GIE has an EPP serve the pools that reference it).
    ``tokenizer``: the tokenizer of pools that declare none (``bytes``, ``builtin:NAME``, a directory with
    the model's tokenizer files, ``hf:ORG/NAME[@REV]``; kvfleet/epp/tokenize.py); hub files are cached in
    ``tokenizer_cache_dir`` (empty: ``$TMPDIR/kvfleet-tokenizers``).
    ``tls_cert_file``/``tls_key_file``: serve ext_proc over TLS (PEM files; the chart
    mounts them from a Secret); both empty = plaintext h2c. Health stays plaintext.
    ``front``: what serves the ext_proc port. ``native``: the compiled gRPC front ``kvfleet-epp-front``
    (kvfleet/epp/front.py; it passes each stream's messages to this process over a Unix socket and takes
    gRPC's own per-message work off the picker); ``grpcio``: Python's ``grpc.aio`` in this process; ``auto``:
    ``native`` where the front is installed (the image, a build with Go), else ``grpcio``, logged at start.
    ``inline_route_bytes``: a request whose body is at most this long is routed on the ext_proc event loop
    itself (one thread hop less: ≈ 0.1 ms of CPU per decision); a longer one (its tokenizing and hashing can
    take milliseconds, which would hold up the other streams' messages) on the routing thread; picks stay
    serialized either way (0: every request on the routing thread).
    ``response_body_sample``: the share of inference responses whose body the picker reads (the usage's
    cached tokens: the key check, ``kvfleet_epp_engine_cached_tokens_total``, the misprediction counters, the
    decision log); for the others its answer to the response headers asks Envoy (``allow_mode_override``,
    which ``kvfleet gateway-config`` sets) not to send the body: each streamed chunk is otherwise a round trip
    through the picker. The first token and the stream's end still reach it (the response headers; the
    ext_proc stream's close). Envoy honours that only where the response body mode is ``STREAMED`` (the
    ``BUFFERED`` body mode's); with ``FULL_DUPLEX_STREAMED`` (GIE's reference, Envoy Gateway's) Envoy sends
    every chunk anyway and the picker hands the unread ones back unread. Either way the native front answers
    the chunks without a round trip to this process (docs/epp.md, The gRPC front). 1: every response
    (default).
    ``events_coalesce_s``: under sustained KV-event traffic the ingestion thread reads its sockets at most
    once per this many seconds, applying the batches that arrived meanwhile together (one wake-up for
    several: each costs more CPU than the batch it brings, and every replica receives every pod's batches);
    the first batch after a quiet spell is read at once. 0: each batch as it comes.
    ``speculative_ttl_s``: how long a pick counts as cached on its pod before KV
    events confirm it; with ``events_enabled: false`` the index is built from
    picks only (approximate mode) and ``approximate_ttl_s`` applies.
    ``max_speculative_entries``: bound on the index's speculative (pick) entries
    (20–37 bytes each, compiled; a 220 KB prompt's pick is ≈ 370): beyond it, expired picks
    and then the oldest are dropped and counted (``kvfleet_epp_speculative_dropped_total``).
    ``reuse_sketch_entries``: per pod, the picks' sampled keys remembered to tell whether a held prefix will
    still be cached when a request runs (kvfleet/epp/reuse.py; 112 bytes each, about as many as the
    blocks of reuse distance covered, 0: off); beyond it the index is trusted as it is.
    ``gossip_port``: share this replica's picks with the other EPP replicas (ZMQ PUB on this port; 0 = off)
    and apply theirs from ``gossip_peers`` (``host:port``; a name resolving to several addresses, such as
    the chart's headless ``<epp>-replicas`` Service, means each) for ``gossip_ttl_s``; with
    ``gossip_secret_file`` every message carries an HMAC-SHA256 tag under that secret (kvfleet/epp/gossip.py).
    ``prefix_shard_pools``: level 1 (prefix shard → pool by rendezvous hashing on
    the key of block ``prefix_shard_blocks``); ``false`` schedules over the serving
    pods of every pool in one cycle (what a plain load balancer does: baselines).
    """

    host: str = "0.0.0.0"
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    datastore: str = "static"
    pods_file: str = ""
    namespace: str = "default"
    service_name: str = ""
    tokenizer: str = "builtin:qwen2.5"
    tokenizer_cache_dir: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    max_body_bytes: int = 8 * 1024 * 1024
    inline_route_bytes: int = 16 * 1024
    response_body_sample: float = 1.0
    front: str = "auto"
    events_enabled: bool = True
    events_coalesce_s: float = 0.02
    speculative_ttl_s: float = 10.0
    approximate_ttl_s: float = 300.0
    max_speculative_entries: int = 1_000_000
    reuse_sketch_entries: int = 4096
    gossip_port: int = 0
    gossip_peers: tuple[str, ...] = ()
    gossip_ttl_s: float = 30.0
    gossip_secret_file: str = ""
    recompute_keys: bool = True
    scrape_interval_s: float = 0.5
    metrics_staleness_s: float = 5.0
    prefix_shard_pools: bool = True
    prefix_shard_blocks: int = 4
    pool_saturation_queue: float = 32.0
    shed_queue: float = 0.0
    pd_min_uncached_tokens: int = 512
    hotspot_beta: float = 0.1
    plugins: tuple[PluginSpec, ...] = field(default_factory=default_plugins)
    cost: CostModelSettings = field(default_factory=CostModelSettings)

    def __post_init__(self) -> None:
        if self.datastore not in ("static", "kubernetes"):
            raise ValueError(f"datastore must be 'static' or 'kubernetes', got {self.datastore!r}")
        if self.max_body_bytes <= 0 or self.prefix_shard_blocks <= 0:
            raise ValueError("max_body_bytes and prefix_shard_blocks must be > 0")
        if self.front not in ("auto", "native", "grpcio"):
            raise ValueError(f"front must be 'auto', 'native' or 'grpcio', got {self.front!r}")
        if self.inline_route_bytes < 0:
            raise ValueError("inline_route_bytes must be >= 0")
        if not 0.0 <= self.response_body_sample <= 1.0:
            raise ValueError(f"response_body_sample must be within [0, 1], got {self.response_body_sample}")
        if not 0.0 <= self.events_coalesce_s <= 1.0:
            raise ValueError(f"events_coalesce_s must be within [0, 1], got {self.events_coalesce_s}")
        if self.max_speculative_entries <= 0:
            raise ValueError("max_speculative_entries must be > 0")
        if not 0 <= self.reuse_sketch_entries <= 1 << 24:
            raise ValueError("reuse_sketch_entries must be 0..16777216")
        if not 0 <= self.gossip_port <= 65535 or self.gossip_ttl_s <= 0:
            raise ValueError("gossip_port must be 0..65535 and gossip_ttl_s > 0")
        for peer in self.gossip_peers:
            host, sep, port = peer.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"gossip_peers entries are host:port, got {peer!r}")
