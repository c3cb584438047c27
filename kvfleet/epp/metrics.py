"""The picker's Prometheus metrics, all in one place (names are API; golden-tested).

GIE-compatible names where GIE has one:

* ``inference_model_request_total{model_name}`` — requests seen
* ``inference_model_request_error_total{model_name,error_code}`` — requests answered with an error
* ``inference_extension_scheduler_e2e_duration_seconds`` — time to pick (parse, key, route)
* ``inference_pool_ready_pods{name}``, ``inference_pool_average_queue_size{name}``,
  ``inference_pool_average_kv_cache_utilization{name}`` — per pool (from scraped metrics)

kvfleet's own:

* ``kvfleet_epp_prompt_tokens_total`` / ``kvfleet_epp_predicted_hit_tokens_total`` — their ratio is
  the predicted prefix hit ratio
* ``kvfleet_epp_engine_cached_tokens_total`` — ``usage.prompt_tokens_details.cached_tokens`` reported
  by engines for requests the picker predicted
* ``kvfleet_epp_misprediction_tokens_total{direction="over"|"under"}`` — |predicted − reported| hit
  tokens, split by sign (router misprediction, seed 5.7)
* ``kvfleet_epp_index_entries`` — (block, pod) entries in the index (a block held by three pods counts
  three times), ``kvfleet_epp_index_bytes`` — bytes of its table, ``kvfleet_epp_index_speculative_blocks`` —
  speculative (pick) entries, ``kvfleet_epp_speculative_dropped_total`` — speculative entries dropped by
  ``max_speculative_entries`` (expired ones not counted), ``kvfleet_epp_engine_hash_map_entries`` — engine
  block hashes mapped to the picker's keys (kvfleet/epp/ingest.py; at most ``1 << 18`` per pod)
* ``kvfleet_epp_reuse_shortened_hits_total`` — candidates whose held prefix was cut to what should survive
  until the request runs (kvfleet/epp/reuse.py), ``kvfleet_epp_reuse_forgotten_sends_total`` — sketch
  entries forgotten at the ``reuse_sketch_entries`` bound, ``kvfleet_epp_reuse_sketch_bytes`` — their memory
* ``kvfleet_epp_pod_inflight{pod}``, ``kvfleet_epp_pod_pending_tokens{pod}`` — the picker's load view
* ``kvfleet_epp_pool_followup_share{name}`` — per pool, the share of recent prompts a live pick covered
  (requests following an earlier one closely; the queue scorer counts a pod's expected wait once more for
  each follow-up it predicts from it: kvfleet/epp/scheduling/plugins.py)
* ``kvfleet_epp_kv_event_batches_total{pod}``, ``kvfleet_epp_kv_event_gaps_total{pod}``,
  ``kvfleet_epp_kv_event_resyncs_total{pod}`` — the event feed, and its faults:
  ``kvfleet_epp_kv_event_rejected_total{pod}`` (messages or events dropped as invalid),
  ``kvfleet_epp_kv_event_restarts_total{pod}`` (publisher restarts seen),
  ``kvfleet_epp_kv_event_replay_holes_total{pod}``, ``kvfleet_epp_kv_event_replay_timeouts_total{pod}``,
  ``kvfleet_epp_kv_event_orphans_total{pod}`` (blocks that could not be keyed),
  ``kvfleet_epp_kv_event_unknown_medium_total{pod}``, ``kvfleet_epp_kv_event_key_evictions_total{pod}``
  (engine-hash map bound), ``kvfleet_epp_kv_event_lag_seconds{pod}`` (how far ingestion is behind: the age
  of the last batch applied, by its timestamp, while more are queued; 0 when caught up); the ``pod``
  label takes only the pods currently subscribed
* replica gossip (present only with gossip on; kvfleet/epp/gossip.py):
  ``kvfleet_epp_gossip_messages_total{direction="out"|"in", result}`` (out: ``sent``, ``dropped``; in:
  ``ok``, ``self``, ``too_large``, ``malformed``, ``bad_tag``), ``kvfleet_epp_gossip_picks_total`` and
  ``kvfleet_epp_gossip_tickets_total`` ``{direction, result}`` (out: ``sent``, ``dropped``; in:
  ``applied``, ``unknown_pod``, ``malformed``, ``too_large`` / ``refused``), ``kvfleet_epp_gossip_peers``
  (replicas heard from in the last 5 s), ``kvfleet_epp_remote_tickets`` (their requests in flight)
* ``kvfleet_epp_thread_cpu_seconds_total{thread}`` — the picker's CPU per thread, by the thread's name without
  its numbers (kvfleet/cache/threadnames.py: ``ext-proc-loop`` the ext_proc streams and the picks,
  ``epp-route`` long bodies' picks, ``kv-events``, ``epp-gossip``, ``metrics-scraper`` and ``scrape`` the
  engines' metrics, ...), the native gRPC front process under ``kvfleet-epp-front``; a thread that ends
  leaves its count to its name (monotonic)
* the client library's standard ``process_*`` metrics (``process_cpu_seconds_total``,
  ``process_resident_memory_bytes``, ...) of the picker's process
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfleet.cache import threadnames
from kvfleet.epp.datastore import Pool
from kvfleet.epp.gossip import ReplicaGossip
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.subscriber import FeedStats


class _GossipCollector(Collector):
    def __init__(self, gossip: ReplicaGossip) -> None:
        self.gossip = gossip

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        g = self.gossip
        labels = ["direction", "result"]
        fam = CounterMetricFamily("kvfleet_epp_gossip_messages",
                                  "Gossip messages sent to other EPP replicas (out) and received "
                                  "from them (in), by result", labels=labels)
        for result in ("sent", "dropped"):
            fam.add_metric(["out", result], g.messages[result])
        for result in ("ok", "self", "too_large", "malformed", "bad_tag"):
            fam.add_metric(["in", result], g.messages[result])
        yield fam
        for name, what, out, into, results in (
            ("picks", "Picks", g.picks_out, g.picks_in, ("applied", "unknown_pod", "too_large", "malformed")),
            ("tickets", "In-flight ticket changes", g.tickets_out, g.tickets_in,
             ("applied", "unknown_pod", "malformed", "refused")),
        ):
            fam = CounterMetricFamily(f"kvfleet_epp_gossip_{name}",
                                      f"{what} shared with other EPP replicas (out) and received "
                                      "from them (in), by result", labels=labels)
            for result in ("sent", "dropped"):
                fam.add_metric(["out", result], out[result])
            for result in results:
                fam.add_metric(["in", result], into[result])
            yield fam
        yield GaugeMetricFamily("kvfleet_epp_gossip_peers", "Other EPP replicas heard from in the last 5 s",
                                value=g.live_peers)
        yield GaugeMetricFamily("kvfleet_epp_remote_tickets",
                                "Other replicas' requests in flight, as gossiped",
                                value=g.tracker.remote_count() if g.tracker is not None else 0)


class _StateCollector(Collector):
    def __init__(
        self,
        index: BlockIndex,
        tracker: InflightTracker,
        store: MetricsStore,
        pools: Callable[[], Sequence[Pool]],
        feeds: Callable[[], dict[str, FeedStats]],
        key_map: Callable[[], int] = lambda: 0,
        followups: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.index, self.tracker, self.store, self.pools, self.feeds = index, tracker, store, pools, feeds
        self.key_map, self.followups = key_map, followups

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("kvfleet_epp_index_entries", "(block, pod) entries in the global index",
                                value=self.index.num_entries)
        yield GaugeMetricFamily("kvfleet_epp_index_bytes", "Bytes of the global index's hash table",
                                value=self.index.nbytes)
        yield CounterMetricFamily(
            "kvfleet_epp_speculative_dropped",
            "Speculative index entries dropped by the max_speculative_entries bound",
            value=self.index.speculative_dropped,
        )
        yield GaugeMetricFamily(
            "kvfleet_epp_index_speculative_blocks", "Speculative (pick-based) index entries",
            value=self.index.num_speculative
        )
        reuse = self.index.reuse
        yield CounterMetricFamily("kvfleet_epp_reuse_shortened_hits",
                                  "Candidates whose held prefix was cut to what is expected to survive in "
                                  "the pod's cache until the request runs", value=reuse.shortened)
        yield CounterMetricFamily("kvfleet_epp_reuse_forgotten_sends",
                                  "Picks' sampled keys the per-pod reuse sketches forgot at their "
                                  "reuse_sketch_entries bound", value=reuse.forgotten())
        yield GaugeMetricFamily("kvfleet_epp_reuse_sketch_bytes", "Bytes of the per-pod reuse sketches",
                                value=reuse.memory_bytes)
        yield GaugeMetricFamily("kvfleet_epp_engine_hash_map_entries",
                                "Engine block hashes mapped to the picker's keys, over every pod (bounded "
                                "per pod)", value=self.key_map())
        inflight = GaugeMetricFamily("kvfleet_epp_pod_inflight",
                                     "Requests routed to the pod and not finished", labels=["pod"])
        pending = GaugeMetricFamily(
            "kvfleet_epp_pod_pending_tokens",
            "Predicted uncached tokens routed to the pod, first token not back", labels=["pod"]
        )
        ready = GaugeMetricFamily("inference_pool_ready_pods", "Ready pods per pool", labels=["name"])
        queue = GaugeMetricFamily("inference_pool_average_queue_size", "Average waiting requests per pod",
                                  labels=["name"])
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization", "Average KV-cache utilisation",
                               labels=["name"])
        follow = GaugeMetricFamily("kvfleet_epp_pool_followup_share",
                                   "Share of the pool's recent prompts a live pick covered (requests "
                                   "following an earlier one closely)", labels=["name"])
        shares = self.followups()
        for pool in self.pools():
            follow.add_metric([pool.name], shares.get(pool.name, 0.0))
            # ready in the datastore and not out of rotation (refusing scrapes, KV-event connection lost):
            # the pods the picker would pick, as a dead engine stops counting at once, not when its Pod does
            up = sum(1 for p in pool.pods if p.ready and not self.store.down(p.name))
            ready.add_metric([pool.name], up)
            fresh = [m for m in self.store.get_many([p.name for p in pool.pods]) if m is not None]
            queue.add_metric([pool.name], sum(m.waiting for m in fresh) / len(fresh) if fresh else 0.0)
            kv.add_metric([pool.name], sum(m.kv_usage for m in fresh) / len(fresh) if fresh else 0.0)
            for p in pool.pods:
                n, tokens, _ = self.tracker.load(p.name)
                inflight.add_metric([p.name], n)
                pending.add_metric([p.name], tokens)
        yield from (inflight, pending, ready, queue, kv, follow)
        families = [
            CounterMetricFamily(f"kvfleet_epp_kv_event_{name}", doc, labels=["pod"])
            for name, doc, _ in _FEED_COUNTERS
        ]
        lag = GaugeMetricFamily(
            "kvfleet_epp_kv_event_lag_seconds",
            "How far the pod's KV-event ingestion is behind: age of the last batch applied while more "
            "are queued (this clock minus the batch's timestamp); 0 when caught up",
            labels=["pod"],
        )
        for pod, st in sorted(self.feeds().items()):
            for fam, (_, _, value) in zip(families, _FEED_COUNTERS, strict=True):
                fam.add_metric([pod], value(st))
            lag.add_metric([pod], st.lag_s)
        yield from families
        yield lag


#: per-pod feed counters: name (after ``kvfleet_epp_kv_event_``), help, value
_FEED_COUNTERS: list[tuple[str, str, Callable[[FeedStats], int]]] = [
    ("batches", "KV-event batches applied", lambda st: st.batches),
    ("gaps", "Sequence gaps seen", lambda st: st.gaps),
    ("resyncs", "Times the pod's entries were cleared to stay exact", lambda st: st.resyncs),
    ("rejected", "KV-event messages or events dropped as invalid", lambda st: st.rejected),
    ("restarts", "Publisher restarts seen (sequence number not above the last)", lambda st: st.restarts),
    ("replay_holes", "Replay answers with batches missing", lambda st: st.replay_holes),
    ("replay_timeouts", "Replay requests not answered in time", lambda st: st.replay_timeouts),
    ("orphans", "Stored blocks that could not be keyed (unknown parent)", lambda st: st.ingest.orphans),
    ("unknown_medium", "Events with an unknown medium (indexed in the slowest tier)",
     lambda st: st.ingest.unknown_medium),
    ("key_evictions", "Engine-hash map entries dropped by its bound", lambda st: st.ingest.key_evictions),
]


class _ThreadCollector(Collector):
    """``kvfleet_epp_thread_cpu_seconds_total{thread}`` (module doc). Each thread's count is its CPU since it
    was first seen under its label; one that ends, is renamed or whose id is reused leaves what it counted
    to its label, so every series only grows. At most :attr:`MAX_LABELS` labels (then ``other``)."""

    MAX_LABELS = 64
    FRONT = "kvfleet-epp-front"

    def __init__(self, front_pid: Callable[[], int | None]) -> None:
        self._front_pid = front_pid
        #: thread id (a process: minus its pid) → (label, CPU seconds when first seen there, last reading)
        self._seen: dict[int, tuple[str, float, float]] = {}
        self._retired: dict[str, float] = {}
        self._lock = threading.Lock()

    def _label(self, name: str) -> str:
        """The series ``name`` counts under (every label has an entry in ``_retired`` from then on)."""
        lab = threadnames.label(name)
        if lab not in self._retired and len(self._retired) >= self.MAX_LABELS:
            lab = "other"
        self._retired.setdefault(lab, 0.0)
        return lab

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self._family()  # what registering asks for, read nothing yet

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily("kvfleet_epp_thread_cpu_seconds",
                                   "CPU seconds of the picker's threads, by thread name (its front's "
                                   "process: kvfleet-epp-front)", labels=["thread"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:  # scrapes may come at once
            now = {tid: (self._label(name), cpu) for tid, (name, cpu) in threadnames.thread_cpu().items()}
            pid = self._front_pid()
            front = threadnames.process_cpu(pid) if pid is not None else None
            if pid is not None and front is not None:  # the whole process: its ended threads stay counted
                now[-pid] = (self._label(self.FRONT), front)
            for tid, (lab, base, last) in list(self._seen.items()):
                got = now.get(tid)
                if got is None or got[0] != lab or got[1] < last:  # ended, renamed or a new thread
                    self._retired[lab] += last - base
                    del self._seen[tid]
                    if got is not None and got[1] >= last:  # renamed: the time before stays with the old name
                        self._seen[tid] = (got[0], last, got[1])
                else:
                    self._seen[tid] = (lab, base, got[1])
            for tid, (lab, cpu) in now.items():
                if tid not in self._seen:
                    self._seen[tid] = (lab, 0.0, cpu)
            totals = dict(self._retired)
            for lab, base, last in self._seen.values():
                totals[lab] += last - base
        fam = self._family()
        for lab in sorted(totals):
            fam.add_metric([lab], totals[lab])
        yield fam


class EppMetrics:
    """Counters updated on the request path, plus a collector that reads the state at scrape time."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("inference_model_request", "Requests seen by the picker", ["model_name"],
                                registry=r)
        self.errors = Counter(
            "inference_model_request_error", "Requests answered with an error", ["model_name", "error_code"],
            registry=r
        )
        self.pick_seconds = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time to pick an endpoint (parse, tokenize, key, route)",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.prompt_tokens = Counter("kvfleet_epp_prompt_tokens", "Prompt tokens of routed requests",
                                     registry=r)
        self.predicted_hit = Counter("kvfleet_epp_predicted_hit_tokens", "Prompt tokens predicted cached",
                                     registry=r)
        self.response_bodies_skipped = Counter(
            "kvfleet_epp_response_bodies_skipped",
            "Inference responses whose body the picker does not read (epp.response_body_sample): Envoy "
            "skips it (BUFFERED) or it is handed back unread (FULL_DUPLEX_STREAMED)",
            registry=r,
        )
        self.engine_cached = Counter(
            "kvfleet_epp_engine_cached_tokens",
            "Cached tokens reported by engines (usage.prompt_tokens_details)", registry=r
        )
        self.key_mismatch = Gauge(
            "kvfleet_epp_pool_key_mismatch",
            "1 while a pool's engines report cached tokens the index never predicted (they key blocks "
            "differently from the pool's declared block size / hash algorithm / seed)",
            ["pool"],
            registry=r,
        )
        self.served = Counter(
            "kvfleet_epp_served",
            "Responses whose serving endpoint the gateway reported: by the pick, or by a fallback",
            ["by"],
            registry=r,
        )
        self.misprediction = Counter(
            "kvfleet_epp_misprediction_tokens", "|predicted - reported| cached tokens", ["direction"],
            registry=r
        )
        self.unkeyed_requests = Counter(
            "kvfleet_epp_unkeyed_requests",
            "Inference requests routed on load because their prompt tokens could not be computed as the "
            "pool's engines compute them (reason: tokenizer_loading, tokenizer_unavailable, content_part, "
            "tool_choice, template_error, ...)",
            ["pool", "reason"], registry=r,
        )

    def attach_state(
        self,
        index: BlockIndex,
        tracker: InflightTracker,
        store: MetricsStore,
        pools: Callable[[], Sequence[Pool]],
        feeds: Callable[[], dict[str, FeedStats]],
        key_map: Callable[[], int] = lambda: 0,
        followups: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.registry.register(_StateCollector(index, tracker, store, pools, feeds, key_map, followups))

    def attach_threads(self, front_pid: Callable[[], int | None] = lambda: None) -> None:
        """The picker's CPU per thread (``front_pid``: its native front's process, when running) and the
        client library's ``process_*`` metrics of this process."""
        self.registry.register(_ThreadCollector(front_pid))
        ProcessCollector(registry=self.registry)

    def attach_gossip(self, gossip: ReplicaGossip) -> None:
        """The ``kvfleet_epp_gossip_*`` families and ``kvfleet_epp_remote_tickets``: what is shared with other
        replicas."""
        self.registry.register(_GossipCollector(gossip))

    def observe_cached(self, predicted: int, reported: int) -> None:
        self.engine_cached.inc(reported)
        if predicted > reported:
            self.misprediction.labels("over").inc(predicted - reported)
        elif reported > predicted:
            self.misprediction.labels("under").inc(reported - predicted)
