"""Prometheus metrics of the simulator, under vLLM's names so a scraper treats it as a vLLM pod.

Read at scrape time from the scheduler and the KV cache (a custom collector:
the step loop never touches one of these metric objects), plus two histograms
observed per request. Names (``model_name`` label on each, as vLLM does):

========================================  =======  ===========================================
name                                      type     meaning
========================================  =======  ===========================================
vllm:num_requests_running                 gauge    sequences in the running batch
vllm:num_requests_waiting                 gauge    requests queued for admission
vllm:kv_cache_usage_perc                  gauge    referenced GPU blocks / all (0..1)
vllm:gpu_cache_usage_perc                 gauge    same value, the pre-0.10 vLLM name
vllm:prefix_cache_queries_total           counter  prompt tokens looked up in the prefix cache
vllm:prefix_cache_hits_total              counter  of those, tokens served from cache (any tier)
vllm:prompt_tokens_total                  counter  prompt tokens admitted
vllm:generation_tokens_total              counter  tokens generated
vllm:request_success_total                counter  finished requests
vllm:cache_config_info                    gauge 1  labels: block_size, num_gpu_blocks, hash algo
vllm:time_to_first_token_seconds          hist.    arrival → first token (wall seconds)
vllm:e2e_request_latency_seconds          hist.    arrival → last token
kvfleet_engine_tier_hit_blocks_total      counter  blocks served from cache, label ``tier``
kvfleet_engine_kv_mismatched_blocks_total counter  received blocks refused (bytes differed)
kvfleet_engine_kv_event_replay_bytes      gauge    KV-event payload bytes held for replay
kvfleet_engine_kv_event_replay_cap_bytes  gauge    their bound (``replay_buffer_bytes``)
========================================  =======  ===========================================

With tiers below the GPU, the same registry also carries the tier manager's
``kvfleet_tier_*`` series (docs/tiers.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.config.cache import CacheSettings
from kvfleet.engine.kv import EngineKV
from kvfleet.engine.scheduler import Scheduler

_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, sched: Scheduler, kv: EngineKV, cache: CacheSettings, held: Callable[[], int],
                 replay: Callable[[], tuple[int, int]]) -> None:
        self.sched = sched
        self.kv = kv
        self.cache = cache
        self.held = held
        self.replay = replay
        self.model = sched.settings.model

    def collect(self) -> Iterator[Metric]:
        m = self.model
        s = self.sched.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([m], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m], value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    self.sched.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    self.sched.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", self.kv.usage)
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name).", self.kv.usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", self.kv.queries_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", self.kv.hit_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield counter("vllm:request_success", "Count of successfully processed requests.", s.finished)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "prefix_caching_hash_algo",
                    "cache_dtype"],
        )
        info.add_metric(
            [str(self.cache.block_size), str(self.kv.settings.num_gpu_blocks), "True", self.cache.hash_algo,
             "auto"], 1.0
        )
        yield info
        tiers = CounterMetricFamily("kvfleet_engine_tier_hit_blocks", "Cached blocks served, per tier.",
                                    labels=["model_name", "tier"])
        for tier, n in self.kv.tier_hits.items():
            tiers.add_metric([m, tier], n)
        yield tiers
        yield gauge("kvfleet_engine_held_blocks", "GPU blocks held for a decode engine to pull (P/D).",
                    self.held())
        yield counter(
            "kvfleet_engine_kv_mismatched_blocks",
            "Received KV blocks refused because their bytes differed from this engine's own "
            "(recomputed instead).",
            self.kv.mismatched_blocks,
        )
        held_bytes, cap_bytes = self.replay()
        yield gauge("kvfleet_engine_kv_event_replay_bytes",
                    "KV-event batch payload bytes kept for replay to subscribers that missed them.",
                    held_bytes)
        yield gauge("kvfleet_engine_kv_event_replay_cap_bytes",
                    "Bound of the KV-event replay buffer in bytes (oldest batches dropped above it).",
                    cap_bytes)


class EngineMetrics:
    """A private registry (one per engine) with the collector and the per-request histograms.

    ``registry``: the engine's registry when it already holds other series (the tier manager's
    ``kvfleet_tier_*``, docs/tiers.md); a new one by default. ``replay``: the KV-event replay buffer's
    (bytes held, bound), read at scrape time.
    """

    def __init__(
        self,
        sched: Scheduler,
        kv: EngineKV,
        cache: CacheSettings,
        held: Callable[[], int] = lambda: 0,
        registry: CollectorRegistry | None = None,
        replay: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(sched, kv, cache, held, replay))
        model = sched.settings.model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            ["model_name"], registry=self.registry, buckets=_BUCKETS,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            ["model_name"], registry=self.registry, buckets=_BUCKETS,
        ).labels(model)
