"""Model-server metrics: scrape each pod's Prometheus endpoint for vLLM's load gauges.

Names read (vLLM's): ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (0..1; older vLLM: ``vllm:gpu_cache_usage_perc``),
``vllm:cache_config_info`` (label ``block_size``, ``num_gpu_blocks``). Series
with several label sets are summed (gauges) or the max taken (usage). Only those
families' lines reach the exposition parser: a vLLM endpoint publishes hundreds
of histogram lines the picker never reads, and parsing them all cost ≈ 1.7 ms
per scrape of a 125-line page (every pod, every 0.5 s, in every replica); a
malformed line of another family no longer spoils the scrape.

Staleness: :meth:`MetricsStore.get` returns ``None`` for a pod whose last good
scrape is older than ``staleness_s``; the scorers then fall back to the
picker's own in-flight accounting, so a pod that stopped answering neither
looks idle nor saturated forever.

Liveness: the scrape doubles as an active health check. A pod whose metrics
endpoint refuses or resets the connection ``down_after`` times in a row
(default 2: with the 0.5 s interval, a dead pod is out within about a second)
is :meth:`MetricsStore.down` and the router stops picking it until a scrape
succeeds again. A slow answer (timeout) is not death: a busy engine keeps its
traffic. This is what protects installs without Kubernetes readiness (the
static pods file); on Kubernetes the pod's Ready condition applies as well.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    scraped_at: float = 0.0


def gpu_capacity(pm: PodMetrics | None, block_size: int) -> int | None:
    """A pod's GPU cache in blocks of ``block_size`` tokens (``vllm:cache_config_info``: ``num_gpu_blocks`` of
    ``block_size`` tokens), None when the engine does not publish it."""
    if pm is None or not pm.num_gpu_blocks or not pm.block_size:
        return None
    return pm.num_gpu_blocks * pm.block_size // block_size


#: the families read; each of their lines is kept: samples, ``# HELP``, ``# TYPE`` (a name ends at ``{``,
#: space or tab)
READ = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")
_READ_LINES = re.compile(r"^(?:# (?:HELP|TYPE)[ \t]+)?(?:" + "|".join(map(re.escape, READ)) + r")[ \t{].*$",
                         re.MULTILINE)


def parse_metrics(text: str, now: float) -> PodMetrics:
    waiting = running = 0.0
    usage = 0.0
    block_size: int | None = None
    blocks: int | None = None
    wanted = "\n".join(_READ_LINES.findall(text))
    for fam in text_string_to_metric_families(wanted + "\n" if wanted else ""):
        for s in fam.samples:
            if s.name == "vllm:num_requests_waiting":
                waiting += s.value
            elif s.name == "vllm:num_requests_running":
                running += s.value
            elif s.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage = max(usage, s.value)
            elif s.name == "vllm:cache_config_info":
                if s.labels.get("block_size", "").isdigit():
                    block_size = int(s.labels["block_size"])
                if s.labels.get("num_gpu_blocks", "").isdigit():
                    blocks = int(s.labels["num_gpu_blocks"])
    return PodMetrics(waiting, running, min(max(usage, 0.0), 1.0), block_size, blocks, now)


class MetricsStore:
    """Latest metrics per pod, with a staleness threshold."""

    def __init__(self, staleness_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 down_after: int = 2) -> None:
        self.staleness_s = staleness_s
        self.clock = clock
        self.down_after = down_after
        self._data: dict[str, PodMetrics] = {}
        self._refused: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def put(self, pod: str, m: PodMetrics) -> None:
        self._data[pod] = m
        if self._refused.pop(pod, 0) >= self.down_after:
            log.info("pod %s answers again: back in rotation", pod)

    def refused(self, pod: str) -> None:
        """A scrape found nothing listening (connection refused or reset)."""
        n = self._refused.get(pod, 0) + 1
        self._refused[pod] = n
        if n == self.down_after:
            log.warning("pod %s refuses connections: out of rotation until it answers", pod)

    def mark_down(self, pod: str, why: str = "unreachable from the gateway") -> None:
        """Out of rotation now (the gateway could not connect to it, or its KV-event connection dropped);
        a good scrape brings it back."""
        if self._refused.get(pod, 0) < self.down_after:
            self._refused[pod] = self.down_after
            log.warning("pod %s %s: out of rotation until it answers", pod, why)

    def down(self, pod: str) -> bool:
        return self._refused.get(pod, 0) >= self.down_after

    def get(self, pod: str) -> PodMetrics | None:
        return self.get_many((pod,))[0]

    def get_many(self, pods: Sequence[str]) -> list[PodMetrics | None]:
        """:meth:`get` of each of ``pods``, with one clock read."""
        now, limit = self.clock(), self.staleness_s
        got = map(self._data.get, pods)
        return [m if m is not None and now - m.scraped_at <= limit else None for m in got]

    def forget(self, pod: str) -> None:
        self._data.pop(pod, None)
        self._refused.pop(pod, None)


class MetricsScraper:
    """Scrapes every known pod each ``interval_s`` (a small thread pool; timeouts ≤ interval)."""

    def __init__(self, store: MetricsStore, interval_s: float = 0.5) -> None:
        self.store = store
        self.interval_s = interval_s
        self._targets: dict[str, str] = {}
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="scrape")
        self._thread: threading.Thread | None = None

    def set_target(self, pod: str, url: str | None) -> None:
        if url:
            self._targets[pod] = url
        else:
            self._targets.pop(pod, None)
            self.store.forget(pod)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def scrape_once(self) -> None:
        list(self._pool.map(lambda kv: self._scrape(*kv), list(self._targets.items())))

    def _scrape(self, pod: str, url: str) -> None:
        started = self.store.clock()  # the gauges describe the pod at (about) the request: the picker
        try:                             # compares them with its own accounting at that instant
            with urllib.request.urlopen(url, timeout=max(self.interval_s, 0.2)) as resp:
                text = resp.read().decode("utf-8", errors="replace")
            self.store.put(pod, parse_metrics(text, started))
        except Exception as exc:  # any failure makes the data go stale; nothing listening takes the pod out
            self.store.errors[pod] = self.store.errors.get(pod, 0) + 1
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ConnectionRefusedError | ConnectionResetError):
                self.store.refused(pod)
            log.debug("scrape of %s (%s) failed: %s", pod, url, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scrape_once()
