"""Assembly of one picker process: datastore → (subscriber, scraper) → index → router → gRPC servers.

:class:`Epp` owns every thread and socket it starts; :meth:`Epp.start` binds
(port 0 picks a free port; the bound ports are in ``grpc_port``/``health_port``/
``metrics_port``) and :meth:`Epp.stop` releases all of it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import start_http_server

from kvfleet.config import Settings
from kvfleet.epp.datastore import Datastore, Pod, StaticDatastore
from kvfleet.epp.front import FRONT_ENV, FRONT_NAME, NativeFront, front_program
from kvfleet.epp.gossip import ReplicaGossip
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.inflight import InflightTracker
from kvfleet.epp.ingest import PodEventApplier
from kvfleet.epp.metrics import EppMetrics
from kvfleet.epp.podmetrics import MetricsScraper, MetricsStore
from kvfleet.epp.router import Router
from kvfleet.epp.server import ExtProcServicer, HealthServicer
from kvfleet.epp.subscriber import EventSubscriber
from kvfleet.epp.tokenize import PoolTokenizers

log = logging.getLogger(__name__)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
    """TLS for the ext_proc port when both files are set (a Secret mounted by the chart); else ``None``."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("epp.tls_cert_file and epp.tls_key_file must be set together")
    with open(cert_file, "rb") as c, open(key_file, "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


def make_datastore(settings: Settings) -> Datastore:
    s = settings.epp
    if s.datastore == "kubernetes":
        from kvfleet.epp.kube import KubernetesDatastore

        kube: Datastore = KubernetesDatastore(namespace=s.namespace, epp_service=s.service_name)
        return kube
    return StaticDatastore(s.pods_file or None)


class Epp:
    """The endpoint picker; ``datastore`` may be given (tests), else built from settings."""

    def __init__(self, settings: Settings | None = None, datastore: Datastore | None = None,
                 body_mode: str = "FULL_DUPLEX_STREAMED") -> None:
        self.settings = settings or Settings()
        s = self.settings.epp
        self.datastore = datastore if datastore is not None else make_datastore(self.settings)
        self.index = BlockIndex(max_speculative=s.max_speculative_entries,
                                reuse_entries=s.reuse_sketch_entries)
        self.tracker = InflightTracker()
        self.store = MetricsStore(staleness_s=s.metrics_staleness_s)
        self.scraper = MetricsScraper(self.store, s.scrape_interval_s)
        # a dropped KV-event connection (a killed engine) takes the pod out of rotation until a scrape answers
        self.subscriber = EventSubscriber(
            on_disconnect=lambda pod: self.store.mark_down(pod, "dropped its KV-event connection"),
            coalesce_s=s.events_coalesce_s)
        self.router = Router(s, self.settings.cache, self.datastore, self.index, self.store,
                             PoolTokenizers(s.tokenizer, s.tokenizer_cache_dir), self.tracker)
        self.metrics = EppMetrics()
        self.metrics.attach_threads(lambda: self.front.proc.pid if self.front and self.front.proc else None)
        self.metrics.attach_state(self.index, self.tracker, self.store, self.datastore.pools,
                                  lambda: dict(self.subscriber.stats),
                                  lambda: sum(len(a) for a in list(self.appliers.values())),
                                  self.router.director.followup_shares)
        self.servicer = ExtProcServicer(self.router, self.metrics, s.max_body_bytes, body_mode,
                                       s.inline_route_bytes, s.response_body_sample)
        self.appliers: dict[str, PodEventApplier] = {}
        self._pod_names: frozenset[str] = frozenset()
        self.gossip: ReplicaGossip | None = None
        if s.gossip_port or s.gossip_peers:
            secret = b""
            if s.gossip_secret_file:
                with open(s.gossip_secret_file, "rb") as f:
                    secret = f.read().strip()
                if not secret:
                    raise ValueError(f"epp.gossip_secret_file {s.gossip_secret_file} is empty")
            self.gossip = ReplicaGossip(self.index, host=s.host, port=s.gossip_port, peers=s.gossip_peers,
                                        ttl_s=s.gossip_ttl_s, known_pod=lambda name: name in self._pod_names,
                                        tracker=self.tracker, secret=secret,
                                        pick_ttl=self.router.director.pick_ttl_of,
                                        on_followup=self.router.director.peer_followup)
            self.index.on_pick = self.gossip.publish
            self.tracker.on_ticket = self.gossip.publish_ticket
            self.router.before_decision = self.gossip.receive
            self.router.after_decision = self.gossip.flush
            self.metrics.attach_gossip(self.gossip)
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        #: the native gRPC front serving the ext_proc port (``epp.front``), or None under grpc.aio
        self.front: NativeFront | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._http: Any = None
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None
        self.grpc_port = s.grpc_port
        self.health_port = s.health_port
        self.metrics_port = s.metrics_port
        self.serving = False
        self._unhealthy_logged = False
        self._draining = False

    def _on_pods(self, changed: Sequence[Pod], gone: Sequence[Pod]) -> None:
        s = self.settings.epp
        self._pod_names = frozenset(p.name for pool in self.datastore.pools() for p in pool.pods)
        for pod in gone:
            self.subscriber.remove_pod(pod.name)
            self.scraper.set_target(pod.name, None)
            self.index.clear_pod(pod.name)
            self.tracker.forget(pod.name)
            self.appliers.pop(pod.name, None)
        pools = {p.name: p for p in self.datastore.pools()}
        for pod in changed:
            self.scraper.set_target(pod.name, pod.metrics)
            if s.events_enabled and pod.events:
                hasher = self.router.hasher_for(pools.get(pod.pool))  # the pool's block size and hashing
                applier = PodEventApplier(pod.name, self.index, hasher, s.recompute_keys)
                self.appliers[pod.name] = applier
                self.subscriber.add_pod(pod.name, pod.events, pod.replay, applier)

    def start(self) -> Epp:
        s = self.settings.epp
        self.subscriber.start()
        self.scraper.start()
        if self.gossip is not None:
            self.gossip.start()
        self.datastore.subscribe(self._on_pods)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="ext-proc-loop", daemon=True)
        self._loop_thread.start()
        if self.gossip is not None:
            self.gossip.use_loop(self._loop)
        asyncio.run_coroutine_threadsafe(self._start_grpc(), self._loop).result(30)
        self._http, _ = start_http_server(s.metrics_port, addr=s.host, registry=self.metrics.registry)
        self.metrics_port = self._http.server_port
        self._janitor = threading.Thread(target=self._housekeeping, name="epp-janitor", daemon=True)
        self._janitor.start()
        self.serving = True
        log.info("epp: ext_proc on :%d, health on :%d, metrics on :%d", self.grpc_port, self.health_port,
                 self.metrics_port)
        return self

    async def _start_grpc(self) -> None:
        s = self.settings.epp
        health = HealthServicer(alive=lambda: not self._stop.is_set(), ready=self.ready,
                                streams=lambda: self.ready(draining=False))
        program = front_program() if s.front != "grpcio" else None
        if s.front == "native" and program is None:
            raise RuntimeError(f"epp.front is 'native' but {FRONT_NAME} is not installed (build it with Go: "
                               f"pip install . with `go` on PATH, or set {FRONT_ENV}); 'auto' falls back to "
                               "grpcio")
        if program is not None:
            self.front = NativeFront(program, self.servicer, health, s.host, s.grpc_port, 64 << 20,
                                     s.tls_cert_file, s.tls_key_file)
            self.grpc_port = await self.front.start()
        else:
            if s.front == "auto":
                log.warning("epp: %s is not installed: ext_proc is served by grpc.aio (more CPU per "
                            "decision; docs/epp.md)", FRONT_NAME)
            self._grpc = grpc.aio.server(
                options=[("grpc.max_receive_message_length", 64 << 20),
                         ("grpc.max_send_message_length", 64 << 20)],
            )
            pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, self._grpc)
            health_pb2_grpc.add_HealthServicer_to_server(health, self._grpc)
            creds = server_credentials(s.tls_cert_file, s.tls_key_file)
            target = f"{s.host}:{s.grpc_port}"
            if creds is None:
                self.grpc_port = self._grpc.add_insecure_port(target)
            else:
                self.grpc_port = self._grpc.add_secure_port(target, creds)
            await self._grpc.start()
        self._health = grpc.aio.server()  # plaintext: kubelet's gRPC probes do not speak TLS
        health_pb2_grpc.add_HealthServicer_to_server(health, self._health)
        self.health_port = self._health.add_insecure_port(f"{s.host}:{s.health_port}")
        await self._health.start()

    def drain(self) -> None:
        """Report not ready from now on, serving on (``kvfleet epp --drain-seconds``: before :meth:`stop`)."""
        self._draining = True

    def ready(self, draining: bool = True) -> bool:
        """Readiness (GIE): serving and not draining, the datastore has its first full view of pools and
        pods, and the KV-event ingestion is alive (a dead or stuck ingestion thread would route on a frozen
        index). ``draining=False``: whether it answers streams, draining or not."""
        if not (self.serving and self.datastore.has_synced()) or (draining and self._draining):
            return False
        if self.settings.epp.events_enabled and not self.subscriber.healthy():
            if not self._unhealthy_logged:
                log.error("epp: KV-event ingestion stopped (last round %.1fs ago): readiness NOT_SERVING",
                          self.subscriber.heartbeat_age())
                self._unhealthy_logged = True
            return False
        self._unhealthy_logged = False
        return True

    async def _stop_grpc(self) -> None:
        if self.front is not None:
            await self.front.stop()
        for srv in (self._grpc, self._health):
            if srv is not None:
                await srv.stop(grace=0.5)

    def _housekeeping(self) -> None:
        while not self._stop.wait(1.0):
            self.index.expire()
            self.tracker.reap()
            reload = getattr(self.datastore, "reload", None)
            if reload is not None:
                try:
                    reload()
                except Exception as exc:  # a bad edit keeps the previous pools
                    log.error("epp: pods file not reloaded: %s", exc)

    def stop(self) -> None:
        self.serving = False
        self._stop.set()
        loop, self._loop = self._loop, None  # a second stop() finds nothing left to stop
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._stop_grpc(), loop).result(5)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                if self._loop_thread is not None:
                    self._loop_thread.join(timeout=5)
                loop.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.servicer.route_pool.shutdown(wait=False)
        self.subscriber.stop()
        self.scraper.stop()
        if self.gossip is not None:
            self.gossip.stop()
        stop = getattr(self.datastore, "stop", None)
        if stop is not None:
            stop()
        if self._janitor is not None:
            self._janitor.join(timeout=3)
