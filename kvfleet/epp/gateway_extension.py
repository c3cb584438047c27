"""Envoy Gateway extension server: InferencePool backends through kvfleet's gateway configuration.

Envoy Gateway (EG) has no InferencePool support of its own. It hands a route's custom backends to an
extension server (its ``extensionManager``: ``backendResources`` and the xDS translator's post hooks) over
gRPC (``envoygateway.extension.EnvoyGatewayExtension``, EG's ``proto/extension``). ``kvfleet
gateway-extension`` is that server for InferencePools (``inference.networking.k8s.io/v1``). It turns EG's
translation into what ``kvfleet gateway-config`` (:mod:`kvfleet.epp.envoy`) renders for the standalone
gateway, from the same builders:

* **PostRouteModify**: a route whose backend is an InferencePool gets the pool (namespace, name, its
  ``endpointPickerRef`` Service and port, ``failureMode``, the fallback Services of annotation
  :data:`ANN_FALLBACK`) as route metadata under :data:`META_NS`;
* **PostClusterModify**: the pool's cluster becomes ``ORIGINAL_DST`` on the picker's header
  ``x-gateway-destination-endpoint`` (GIE's reference data path), with the same metadata;
* **PostTranslateModify**: one picker cluster per pool (HTTP/2, health-checked on GIE's ext_proc health
  service), a FailOpen cluster over the pool's fallback Services; in each HTTP listener that serves a pool
  route, the client routing headers stripped and one ext_proc filter per pool (request and response
  phases, ``upstream.address`` for the served endpoint), disabled on every other route; each pool route
  split as the standalone gateway routes: refused P/D headers → 400, ``/kvfleet/`` → 404, a request the
  picker picked for → the pool's cluster (matched on the picker's ``envoy.lb`` metadata), one with no
  pick → the fallback Services (FailOpen) or 503 JSON (FailClose, or FailOpen with no fallback).

A malformed InferencePool (an ``endpointPickerRef`` that is not a Service, no port) never breaks the
translation: its routes answer 503 JSON naming the problem and every other route is left as EG made it.

EG's messages: :mod:`kvfleet.epp.egproto`. EG v1.9.1 is what was run (kind e2e, ``GATEWAY=envoy-gateway``).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2  # noqa: F401  (registers types we parse)
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from envoy.type.matcher.v3 import metadata_pb2
from google.protobuf import json_format
from google.protobuf.any_pb2 import Any as AnyPb
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvfleet.epp.egproto import MESSAGES, SERVICE
from kvfleet.epp.envoy import (
    epp_cluster,
    ext_proc_filter,
    internal_route,
    local_replies,
    no_pick_response,
    picked_match,
    refused_routes,
    strip_filter,
    upstream_cluster,
)
from kvfleet.epp.protocol import DEST_HEADER

log = logging.getLogger("kvfleet.gateway_extension")

#: route and cluster metadata namespace holding a pool (JSON of :class:`Pool`)
META_NS = "kvfleet.io/inferencepool"
#: InferencePool annotation: the Services a FailOpen request goes to with the picker down (``name:port``,
#: comma-separated, in the pool's namespace); the operator writes its shards' headless Services there
ANN_FALLBACK = "kvfleet.io/fallback-services"
#: InferencePool annotation: the picker's replicas each by its own address (a headless Service over the
#: ``endpointPickerRef`` Service's pods, ``name:port``): the ext_proc cluster resolves it to every replica,
#: health-checks and balances them; without it the Service's one address (a ClusterIP: one connection, one
#: replica gets every stream)
ANN_EPP_REPLICAS = "kvfleet.io/epp-replicas"
IP_API = "inference.networking.k8s.io/v1"
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
STRIP_FILTER = "kvfleet.strip-routing-headers"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"




@dataclass(frozen=True)
class Pool:
    """What the gateway needs of one InferencePool; ``error`` set when the pool cannot be served."""

    namespace: str
    name: str
    epp_service: str = ""
    epp_port: int = 0
    failure_mode: str = "FailClose"
    fallback: tuple[tuple[str, int], ...] = ()
    error: str = ""
    #: ``(host, port)`` of the picker's replicas (:data:`ANN_EPP_REPLICAS`), else the Service itself
    replicas: tuple[str, int] | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def epp_target(self) -> tuple[str, int]:
        """Where the picker is reached: its replicas' headless Service when annotated, else its Service."""
        return self.replicas or (self.epp_service, self.epp_port)

    @property
    def epp_cluster(self) -> str:
        """One cluster per picker Service: pools sharing a picker share its health and ejections."""
        host, port = self.epp_target
        return f"kvfleet-epp/{self.namespace}/{host}:{port}"

    @property
    def fallback_cluster(self) -> str:
        return f"kvfleet-fallback/{self.key}"

    @property
    def filter_name(self) -> str:
        return f"kvfleet.epp/{self.key}"

    def to_json(self) -> str:
        return json.dumps(
            {
                "namespace": self.namespace,
                "name": self.name,
                "epp_service": self.epp_service,
                "epp_port": self.epp_port,
                "failure_mode": self.failure_mode,
                "fallback": [list(f) for f in self.fallback],
                "error": self.error,
                "replicas": list(self.replicas) if self.replicas else None,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Pool:
        d = json.loads(text)
        return cls(
            namespace=str(d["namespace"]),
            name=str(d["name"]),
            epp_service=str(d["epp_service"]),
            epp_port=int(d["epp_port"]),
            failure_mode=str(d["failure_mode"]),
            fallback=tuple((str(h), int(p)) for h, p in d["fallback"]),
            error=str(d["error"]),
            replicas=(str(d["replicas"][0]), int(d["replicas"][1])) if d.get("replicas") else None,
        )


def parse_pool(obj: dict[str, Any]) -> Pool | None:
    """An InferencePool (``inference.networking.k8s.io/v1``, as EG passes it: the object as JSON) → a
    :class:`Pool`; None for any other kind. A pool that cannot be served gets ``error``, never raises."""
    if obj.get("apiVersion") != IP_API or obj.get("kind") != "InferencePool":
        return None
    meta = obj.get("metadata") or {}
    ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    spec: dict[str, Any] = obj["spec"] if isinstance(obj.get("spec"), dict) else {}
    ref = spec.get("endpointPickerRef") if isinstance(spec.get("endpointPickerRef"), dict) else None
    where = f"InferencePool {ns}/{name}"
    if ref is None:
        return Pool(
            ns, name, error=f"{where} has no endpointPickerRef: this gateway routes only through a picker"
        )
    group, kind = ref.get("group") or "", ref.get("kind") or "Service"
    if group != "" or kind != "Service":
        return Pool(
            ns, name, error=f"{where}: endpointPickerRef must name a core Service, got {group}/{kind}"
        )
    port = (ref.get("port") or {}).get("number") if isinstance(ref.get("port"), dict) else None
    svc = ref.get("name")
    if not isinstance(svc, str) or not svc:
        return Pool(ns, name, error=f"{where}: endpointPickerRef.name is required")
    if not isinstance(port, int) or not 0 < port < 65536:
        return Pool(ns, name, error=f"{where}: endpointPickerRef.port.number is required (1-65535)")
    mode = ref.get("failureMode") or "FailClose"
    if mode not in ("FailClose", "FailOpen"):
        return Pool(ns, name, error=f"{where}: endpointPickerRef.failureMode must be FailClose or FailOpen")
    annotations = meta.get("annotations") or {}
    fallback = _endpoints(annotations, ANN_FALLBACK, where)
    replicas = _endpoints(annotations, ANN_EPP_REPLICAS, where)[:1]
    return Pool(ns, name, epp_service=svc, epp_port=port, failure_mode=mode, fallback=tuple(fallback),
                replicas=replicas[0] if replicas else None)


def _endpoints(annotations: dict[str, Any], key: str, where: str) -> list[tuple[str, int]]:
    """``name:port`` entries of annotation ``key`` (comma-separated); a malformed one is logged, skipped."""
    out: list[tuple[str, int]] = []
    for item in str(annotations.get(key, "")).split(","):
        host, _, p = item.strip().rpartition(":")
        if host and p.isdigit() and 0 < int(p) < 65536:
            out.append((host, int(p)))
        elif item.strip():
            log.warning("%s: ignoring %s entry %r (expected NAME:PORT)", where, key, item)
    return out


def _pools_in(resources: Sequence[Any]) -> list[Pool]:
    out = []
    for res in resources:
        try:
            obj = json.loads(res.unstructured_bytes)
        except (ValueError, UnicodeDecodeError):
            log.warning(
                "an extension resource that is not JSON (%d bytes) was ignored", len(res.unstructured_bytes)
            )
            continue
        if isinstance(obj, dict) and (pool := parse_pool(obj)) is not None:
            out.append(pool)
    return out


def _tag(meta: Any, pool: Pool) -> None:
    meta.filter_metadata[META_NS].fields["pool"].string_value = pool.to_json()


def pool_of(meta: Any) -> Pool | None:
    """The pool a route or cluster was tagged with (:data:`META_NS`), or None."""
    if META_NS not in meta.filter_metadata or "pool" not in meta.filter_metadata[META_NS].fields:
        return None
    return Pool.from_json(meta.filter_metadata[META_NS].fields["pool"].string_value)


@dataclass
class Translation:
    """PostTranslateModify's work on one translation; counts for the log."""

    pools: dict[str, Pool] = field(default_factory=dict)
    routes: int = 0
    listeners: int = 0


class Extension:
    """The hooks, on protobuf messages; each returns what EG should use."""

    def __init__(
        self,
        cluster_domain: str = "cluster.local",
        body_mode: str = "FULL_DUPLEX_STREAMED",
        message_timeout_s: float = 10.0,
    ) -> None:
        self.cluster_domain = cluster_domain
        self.body_mode = body_mode
        self.message_timeout_s = message_timeout_s

    def _fqdn(self, svc: str, ns: str) -> str:
        return svc if "." in svc else f"{svc}.{ns}.svc.{self.cluster_domain}"

    # -- hooks ------------------------------------------------------------------------------------------
    def post_route_modify(self, req: Any) -> Any:
        out = MESSAGES["PostRouteModifyResponse"]()
        out.route.CopyFrom(req.route)
        pools = _pools_in(req.post_route_context.extension_resources)
        if pools:
            pool = (
                pools[0]
                if len(pools) == 1
                else Pool(
                    pools[0].namespace, pools[0].name, error="a route rule may have one InferencePool backend"
                )
            )
            _tag(out.route.metadata, pool)
        return out

    def post_cluster_modify(self, req: Any) -> Any:
        out = MESSAGES["PostClusterModifyResponse"]()
        c = out.cluster
        c.CopyFrom(req.cluster)
        pools = _pools_in(req.post_cluster_context.backend_extension_resources)
        if not pools:
            return out
        c.type = cluster_pb2.Cluster.ORIGINAL_DST
        c.lb_policy = cluster_pb2.Cluster.CLUSTER_PROVIDED
        for f in (
            "eds_cluster_config",
            "load_assignment",
            "load_balancing_policy",
            "common_lb_config",
            "health_checks",
        ):
            c.ClearField(f)
        c.original_dst_lb_config.use_http_header = True
        c.original_dst_lb_config.http_header_name = DEST_HEADER
        c.connect_timeout.FromSeconds(2)
        _tag(c.metadata, pools[0])
        return out

    def post_translate_modify(self, req: Any) -> Any:
        out = MESSAGES["PostTranslateModifyResponse"]()
        out.clusters.extend(req.clusters)
        out.secrets.extend(req.secrets)
        out.listeners.extend(req.listeners)
        out.routes.extend(req.routes)
        t = Translation()
        pool_configs: dict[str, list[Pool]] = {}  # route configuration name -> its pools
        for rc in out.routes:
            for vh in rc.virtual_hosts:
                for r in vh.routes:
                    if (p := pool_of(r.metadata)) is not None:
                        t.pools.setdefault(p.key, p)
                        pool_configs.setdefault(rc.name, [])
                        if p not in pool_configs[rc.name]:
                            pool_configs[rc.name].append(p)
        if not t.pools:
            return out
        names = {c.name for c in out.clusters}
        for p in t.pools.values():
            if p.error:
                continue
            if p.epp_cluster not in names:
                host, port = p.epp_target
                d = epp_cluster(p.epp_cluster, [(self._fqdn(host, p.namespace), port)])
                out.clusters.add().CopyFrom(json_format.ParseDict(d, cluster_pb2.Cluster()))
                names.add(p.epp_cluster)  # pools sharing a picker share its cluster
            if p.failure_mode == "FailOpen" and p.fallback and p.fallback_cluster not in names:
                d = upstream_cluster(
                    p.fallback_cluster, [(self._fqdn(h, p.namespace), port) for h, port in p.fallback]
                )
                out.clusters.add().CopyFrom(json_format.ParseDict(d, cluster_pb2.Cluster()))
                names.add(p.fallback_cluster)
        for listener in out.listeners:
            if self._patch_listener(listener, pool_configs):
                t.listeners += 1
        all_filters = [p.filter_name for p in t.pools.values() if not p.error]
        for rc in out.routes:
            if rc.name not in pool_configs:
                continue
            for vh in rc.virtual_hosts:
                t.routes += self._patch_virtual_host(vh, all_filters)
        log.info(
            "translation: %d InferencePool(s) %s, %d route(s), %d listener(s)",
            len(t.pools),
            ", ".join(sorted(t.pools)),
            t.routes,
            t.listeners,
        )
        return out

    # -- pieces -----------------------------------------------------------------------------------------
    def _patch_listener(self, listener: Any, pool_configs: dict[str, list[Pool]]) -> bool:
        changed = False
        chains = list(listener.filter_chains)
        if listener.HasField("default_filter_chain"):
            chains.append(listener.default_filter_chain)
        for chain in chains:
            for flt in chain.filters:
                if flt.name != HCM or flt.typed_config.type_url != HCM_TYPE:
                    continue
                hcm = hcm_pb2.HttpConnectionManager()
                flt.typed_config.Unpack(hcm)
                pools = pool_configs.get(hcm.rds.route_config_name) if hcm.HasField("rds") else None
                if not pools:
                    continue
                present = {f.name for f in hcm.http_filters}
                add = [] if STRIP_FILTER in present else [{**strip_filter(), "name": STRIP_FILTER}]
                for p in pools:
                    if not p.error and p.filter_name not in present:
                        add.append(
                            ext_proc_filter(
                                p.epp_cluster,
                                name=p.filter_name,
                                body_mode=self.body_mode,
                                failure_mode_allow=p.failure_mode == "FailOpen",
                                pool=p.name,
                                message_timeout_s=self.message_timeout_s,
                            )
                        )
                if add:
                    new = [json_format.ParseDict(d, hcm_pb2.HttpFilter()) for d in add]
                    filters = list(hcm.http_filters)
                    at = (
                        len(filters) - 1
                        if filters and filters[-1].name == "envoy.filters.http.router"
                        else len(filters)
                    )
                    del hcm.http_filters[:]
                    hcm.http_filters.extend(filters[:at] + new + filters[at:])
                if not hcm.HasField("local_reply_config"):
                    json_format.ParseDict(local_replies(), hcm.local_reply_config)
                flt.typed_config.Pack(hcm)
                changed = True
        return changed

    def _patch_virtual_host(self, vh: Any, all_filters: list[str]) -> int:
        def disabled(names: Sequence[str]) -> dict[str, Any]:
            return {n: {"@type": _EXT_PROC_PER_ROUTE, "disabled": True} for n in names}

        routes = list(vh.routes)
        if not any(pool_of(r.metadata) is not None for r in routes):
            for r in routes:
                _merge_per_filter(r, disabled(all_filters))
            return 0
        new: list[Any] = [
            json_format.ParseDict(internal_route(disabled(all_filters)), route_components_pb2.Route())
        ]
        count = 0
        for r in routes:
            pool = pool_of(r.metadata)
            if pool is None:
                _merge_per_filter(r, disabled(all_filters))
                new.append(r)
                continue
            count += 1
            others = [n for n in all_filters if n != pool.filter_name]
            if pool.error:
                bad = _route_like(r, route_components_pb2.Route())
                json_format.ParseDict(
                    {**no_pick_response(), "typed_per_filter_config": disabled(all_filters)}, bad
                )
                bad.direct_response.body.inline_string = json.dumps(
                    {"error": {"code": 503, "type": "invalid_inference_pool", "message": pool.error}}
                )
                new.append(bad)
                log.error("%s", pool.error)
                continue
            for d in refused_routes({}, disabled(all_filters)):
                ref = json_format.ParseDict(d, route_components_pb2.Route())
                ref.match.MergeFrom(r.match)
                ref.name = f"{r.name}/refused"
                new.append(ref)
            picked = route_components_pb2.Route()
            picked.CopyFrom(r)
            picked.match.dynamic_metadata.add().CopyFrom(
                json_format.ParseDict(picked_match(), metadata_pb2.MetadataMatcher())
            )
            _merge_per_filter(picked, disabled(others))
            new.append(picked)
            unpicked = route_components_pb2.Route()
            unpicked.CopyFrom(r)
            unpicked.name = f"{r.name}/no-pick"
            _merge_per_filter(unpicked, disabled(others))
            if pool.failure_mode == "FailOpen" and pool.fallback:
                unpicked.route.cluster = pool.fallback_cluster
            else:
                unpicked.ClearField("route")
                json_format.ParseDict(no_pick_response(), unpicked)
            new.append(unpicked)
        del vh.routes[:]
        vh.routes.extend(new)
        return count


def extension_manager(hostname: str, port: int) -> dict[str, Any]:
    """Envoy Gateway's ``extensionManager`` (its EnvoyGateway config) for this server at ``hostname:port``:
    InferencePools as custom backends, the post hooks this server implements, every listener and route
    in the translation hook (the chart's install notes print the same)."""
    return {
        "backendResources": [{"group": IP_API.split("/")[0], "kind": "InferencePool", "version": "v1"}],
        "hooks": {"xdsTranslator": {
            "translation": {"listener": {"includeAll": True}, "route": {"includeAll": True}},
            "post": ["Route", "Cluster", "Translation"]}},
        "service": {"fqdn": {"hostname": hostname, "port": port}},
    }


def _route_like(r: Any, out: Any) -> Any:
    out.name = r.name
    out.match.CopyFrom(r.match)
    out.metadata.CopyFrom(r.metadata)
    return out


def _merge_per_filter(route: Any, per_filter: dict[str, Any]) -> None:
    for name, cfg in per_filter.items():
        if name in route.typed_per_filter_config:
            continue
        msg = ext_proc_pb2.ExtProcPerRoute(disabled=bool(cfg.get("disabled")))
        a = AnyPb()
        a.Pack(msg)
        route.typed_per_filter_config[name].CopyFrom(a)


def _unary(
    fn: Callable[[Any], Any], req_cls: type[Message], resp_cls: type[Message]
) -> grpc.RpcMethodHandler:
    def handle(req: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(req)
        except Exception as exc:  # a hook must answer; EG logs the status and keeps its last good config
            log.exception("hook failed")
            context.abort(grpc.StatusCode.INTERNAL, f"kvfleet gateway-extension: {type(exc).__name__}: {exc}")
            raise  # unreachable: abort raises

    return grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=req_cls.FromString, response_serializer=resp_cls.SerializeToString
    )


def handlers(ext: Extension) -> grpc.GenericRpcHandler:
    """EG's EnvoyGatewayExtension service; hooks kvfleet has nothing to add to answer with their input."""
    m = MESSAGES

    def same(field_name: str, resp: str) -> Callable[[Any], Any]:
        def fn(req: Any) -> Any:
            out = m[resp]()
            getattr(out, field_name).CopyFrom(getattr(req, field_name))
            return out

        return fn

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "PostRouteModify": _unary(
                ext.post_route_modify, m["PostRouteModifyRequest"], m["PostRouteModifyResponse"]
            ),
            "PostClusterModify": _unary(
                ext.post_cluster_modify, m["PostClusterModifyRequest"], m["PostClusterModifyResponse"]
            ),
            "PostTranslateModify": _unary(
                ext.post_translate_modify, m["PostTranslateModifyRequest"], m["PostTranslateModifyResponse"]
            ),
            "PostVirtualHostModify": _unary(
                same("virtual_host", "PostVirtualHostModifyResponse"),
                m["PostVirtualHostModifyRequest"],
                m["PostVirtualHostModifyResponse"],
            ),
            "PostHTTPListenerModify": _unary(
                same("listener", "PostHTTPListenerModifyResponse"),
                m["PostHTTPListenerModifyRequest"],
                m["PostHTTPListenerModifyResponse"],
            ),
            "PostEndpointsModify": _unary(
                same("load_assignment", "PostEndpointsModifyResponse"),
                m["PostEndpointsModifyRequest"],
                m["PostEndpointsModifyResponse"],
            ),
        },
    )


def serve(ext: Extension, address: str, max_message_mb: int = 64) -> tuple[grpc.Server, int]:
    """Start the server on ``address`` (``host:port``; port 0 picks one); returns it and its port."""
    opts = [
        ("grpc.max_receive_message_length", max_message_mb << 20),
        ("grpc.max_send_message_length", max_message_mb << 20),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)
    server.add_generic_rpc_handlers((handlers(ext),))
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    hs.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, port


def main(argv: Sequence[str] | None = None) -> int:
    """``kvfleet gateway-extension``: serve EG's extension hooks until SIGTERM."""
    p = argparse.ArgumentParser(
        prog="kvfleet gateway-extension",
        description="Envoy Gateway extension server: routes to InferencePools through "
        "their endpoint picker (EG's extensionManager points here)",
    )
    p.add_argument("--listen", default="0.0.0.0:5005", help="gRPC address (default: 0.0.0.0:5005)")
    p.add_argument("--cluster-domain", default="cluster.local")
    p.add_argument(
        "--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED"
    )
    p.add_argument("--message-timeout-s", type=float, default=10.0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server, port = serve(
            Extension(args.cluster_domain, args.body_mode, args.message_timeout_s), args.listen
        )
    except (OSError, RuntimeError) as exc:
        print(f"kvfleet gateway-extension: {exc}", file=sys.stderr)
        return 2
    log.info("serving %s on port %d", SERVICE, port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(5).wait()
    return 0
