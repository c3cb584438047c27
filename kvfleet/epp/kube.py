"""Pools and pods from Kubernetes: InferencePools (``inference.networking.k8s.io/v1``) and the Pods they
select.

:func:`pools_from_objects` is the pure mapping (tested on plain objects):

* an InferencePool's ``spec.selector.matchLabels`` selects Pods in its namespace;
  ``spec.targetPorts[0].number`` is the serving port (further target ports,
  data-parallel ranks in GIE, are not used); every pod of a pool stays in that
  pool, so whatever the picker returns lies inside the InferencePool the route
  invoked (GIE v1.6);
* ``spec.endpointPickerRef`` is optional (GIE v1.6): with ``epp_service`` set,
  only pools whose ref is a core-group ``Service`` of that name are ours, so a
  pool without one (or naming another picker) is skipped; without
  ``epp_service`` every pool is taken, with or without a ref;
* models: the pool's annotation ``kvfleet.io/models`` (comma-separated; absent
  means every model, ``*``); weight (a multiplier of the capacity level 1 derives from the
  pool's pods): ``kvfleet.io/weight`` (default 1);
  block size, hash algorithm and routing weights: ``kvfleet.io/routing`` (JSON, written by
  the operator; :func:`routing_cache`);
* a Pod is ready when it has an IP, is not being deleted and its ``Ready``
  condition is ``True``; its role comes from label ``kvfleet.io/role``
  (``both`` by default), its prefix shard inside the pool from label
  ``kvfleet.io/shard`` (the operator renders one InferencePool per KVCachePool
  whose shards are pod subsets; absent: ``""``, the pool is one shard); KV
  events from annotation ``kvfleet.io/kv-events-port`` (default 5557) and
  ``kvfleet.io/kv-replay-port`` (optional); metrics from
  ``kvfleet.io/metrics-port`` (default: the serving port) at ``/metrics``; its GPU KV blocks (level-1
  capacity, optional) from annotation ``kvfleet.io/kv-blocks``.

:class:`KubernetesDatastore` keeps both lists current with two watch threads
(list, then watch from the list's resourceVersion; on any error or expiry,
list again after a short backoff) and rebuilds the pools on every change.
The watch loop is tested against kmock's Kubernetes API emulator
(``tests/epp/test_kube.py``), not against a real API server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvfleet.epp.datastore import ROLES, Pod, Pool, PoolCache, _ListenerMixin, pool_cache
from kvfleet.epp.errors import DatastoreError

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
ANN_MODELS, ANN_WEIGHT, ANN_ROUTING = "kvfleet.io/models", "kvfleet.io/weight", "kvfleet.io/routing"
ANN_EVENTS, ANN_REPLAY = "kvfleet.io/kv-events-port", "kvfleet.io/kv-replay-port"
ANN_METRICS = "kvfleet.io/metrics-port"
LABEL_ROLE, LABEL_SHARD = "kvfleet.io/role", "kvfleet.io/shard"
ANN_KV_BLOCKS = "kvfleet.io/kv-blocks"


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    cur: Any = obj
    for p in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(p)
    return cur


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    if _get(pod, "metadata", "deletionTimestamp") or not _get(pod, "status", "podIP"):
        return False
    conds = _get(pod, "status", "conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds
               if isinstance(c, Mapping))


def names_picker(ip: Mapping[str, Any], epp_service: str) -> bool:
    """Whether the InferencePool's ``endpointPickerRef`` is the core-group Service ``epp_service`` (absent
    ref: no)."""
    ref = _get(ip, "spec", "endpointPickerRef")
    if not isinstance(ref, Mapping):
        return False
    return bool(ref.get("name") == epp_service and (ref.get("kind") or "Service") == "Service"
                and not ref.get("group"))


def _port(ip: Mapping[str, Any]) -> int:
    ports = _get(ip, "spec", "targetPorts") or []
    first = ports[0] if isinstance(ports, Sequence) and ports else None
    try:
        return int(first.get("number", 8000)) if isinstance(first, Mapping) else 8000
    except (TypeError, ValueError):
        return 8000


def pools_from_objects(
    inference_pools: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], epp_service: str = ""
) -> list[Pool]:
    """InferencePool and Pod objects (as plain dicts) → pools with their selected pods.

    With ``epp_service``, InferencePools whose ``endpointPickerRef`` names another
    Service (another endpoint picker's pools) or that have none are left out.
    """
    out: list[Pool] = []
    for ip in inference_pools:
        if epp_service and not names_picker(ip, epp_service):
            continue
        name = str(_get(ip, "metadata", "name") or "")
        ns = _get(ip, "metadata", "namespace")
        labels: Mapping[str, str] = _get(ip, "spec", "selector", "matchLabels") or {}
        port = _port(ip)
        ann: Mapping[str, str] = _get(ip, "metadata", "annotations") or {}
        models = tuple(m.strip() for m in ann.get(ANN_MODELS, "*").split(",") if m.strip()) or ("*",)
        try:
            weight = float(ann.get(ANN_WEIGHT, "1"))
        except ValueError:
            weight = 1.0
        members: list[Pod] = []
        for p in pods:
            if ns is not None and _get(p, "metadata", "namespace") not in (None, ns):
                continue
            plabels: Mapping[str, str] = _get(p, "metadata", "labels") or {}
            if not labels or any(plabels.get(k) != v for k, v in labels.items()):
                continue
            pann: Mapping[str, str] = _get(p, "metadata", "annotations") or {}
            ip_addr = str(_get(p, "status", "podIP") or "")
            role = plabels.get(LABEL_ROLE, "both")
            events_port = pann.get(ANN_EVENTS, "5557")
            replay_port = pann.get(ANN_REPLAY)
            metrics_port = pann.get(ANN_METRICS, str(port))
            members.append(Pod(
                name=str(_get(p, "metadata", "name")),
                address=ip_addr,
                port=port,
                pool=name,
                role=role if role in ROLES else "both",
                shard=str(plabels.get(LABEL_SHARD, "")),
                events=f"tcp://{ip_addr}:{events_port}" if ip_addr and events_port else None,
                replay=f"tcp://{ip_addr}:{replay_port}" if ip_addr and replay_port else None,
                metrics=f"http://{ip_addr}:{metrics_port}/metrics" if ip_addr else None,
                ready=_pod_ready(p),
                kv_blocks=_positive_int(pann.get(ANN_KV_BLOCKS)),
            ))
        out.append(Pool(name=name, models=models, weight=weight if weight > 0 else 1.0,
                        pods=tuple(sorted(members, key=lambda x: x.name)),
                        cache=routing_cache(name, ann.get(ANN_ROUTING))))
    return out


def _positive_int(value: Any) -> int | None:
    """An annotation's positive integer, else ``None`` (absent or malformed: unknown)."""
    try:
        n = int(str(value))
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def routing_cache(pool: str, annotation: str | None) -> PoolCache:
    """The pool's :class:`PoolCache` from the operator's ``kvfleet.io/routing`` JSON (``blockSize``,
    ``hashAlgo``, ``hashSeed``, ``tokenizer``, ``chatDialect``,
    ``prefix_weight``, ``load_weight``, ``hotspot_decay``); absent or
    invalid: the picker's defaults (an invalid one is logged)."""
    if not annotation:
        return PoolCache()
    try:
        data = json.loads(annotation)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        weights = {k: data[f] for k, f in (("prefix", "prefix_weight"), ("load", "load_weight"),
                                            ("hotspotDecay", "hotspot_decay")) if data.get(f) is not None}
        raw = {k: data[k] for k in ("blockSize", "hashAlgo", "hashSeed", "tokenizer", "chatDialect")
               if data.get(k) is not None}
        return pool_cache({**raw, "weights": weights}, f"InferencePool {pool} annotation {ANN_ROUTING}")
    except (ValueError, DatastoreError) as exc:
        log.warning("InferencePool %s: %s ignored: %s", pool, ANN_ROUTING, exc)
        return PoolCache()


class KubernetesDatastore(_ListenerMixin):
    """Watches InferencePools and Pods in one namespace (in-cluster config, else the kubeconfig)."""

    def __init__(self, namespace: str = "default", backoff_s: float = 2.0, api_client: Any = None,
                 epp_service: str = "") -> None:
        super().__init__()
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            api_client = client.ApiClient()
        self.namespace = namespace
        self.epp_service = epp_service
        self.backoff_s = backoff_s
        self._api = api_client
        self._watches: dict[str, Any] = {}
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._objs: dict[str, dict[str, Mapping[str, Any]]] = {"pools": {}, "pods": {}}
        self._listed: set[str] = set()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=("pods", self._list_pods), daemon=True,
                             name="watch-pods"),
            threading.Thread(target=self._watch, args=("pools", self._list_pools), daemon=True,
                             name="watch-pools"),
        ]
        for t in self._threads:
            t.start()

    def _list_pods(self) -> Any:
        return self.core.api_client.sanitize_for_serialization(self.core.list_namespaced_pod(self.namespace))

    def _list_pools(self) -> Any:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)

    def _watch(self, kind: str, lister: Callable[..., Any]) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                listing = lister()
                items = listing.get("items", []) if isinstance(listing, dict) else []
                self._objs[kind] = {str(_get(o, "metadata", "name")): o for o in items}
                self._listed.add(kind)
                self._rebuild()
                if self._listed == {"pods", "pools"}:
                    self._synced.set()  # both first lists are in: the picker may report ready
                rv = _get(listing, "metadata", "resourceVersion")
                w = watch.Watch()  # type: ignore[no-untyped-call]
                self._watches[kind] = w
                func: Callable[..., Any] = self.core.list_namespaced_pod
                args: tuple[Any, ...] = (self.namespace,)
                if kind != "pods":
                    func = self.custom.list_namespaced_custom_object
                    args = (GROUP, VERSION, self.namespace, PLURAL)
                stream = w.stream(func, *args, resource_version=rv, timeout_seconds=60)  # type: ignore[no-untyped-call]
                for ev in stream:
                    if self._stop.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
                        return
                    obj = ev.get("raw_object") or ev.get("object")
                    if not isinstance(obj, Mapping):
                        obj = self.core.api_client.sanitize_for_serialization(obj)
                    name = str(_get(obj, "metadata", "name"))
                    if ev.get("type") == "DELETED":
                        self._objs[kind].pop(name, None)
                    elif ev.get("type") in ("ADDED", "MODIFIED"):
                        self._objs[kind][name] = obj
                    self._rebuild()
            except Exception as exc:  # expired resourceVersion, connection loss: list again
                log.warning("kubernetes watch of %s restarted: %s", kind, exc)
                self._stop.wait(self.backoff_s)

    def _rebuild(self) -> None:
        self._set_pools(pools_from_objects(list(self._objs["pools"].values()),
                                           list(self._objs["pods"].values()), self.epp_service))

    def stop(self) -> None:
        """Stop both watches now: flag them, then close the client's connections under the blocked reads."""
        self._stop.set()
        for w in list(self._watches.values()):
            w.stop()
        with contextlib.suppress(AttributeError):
            self._api.rest_client.pool_manager.clear()
        for t in self._threads:
            t.join(timeout=5)
