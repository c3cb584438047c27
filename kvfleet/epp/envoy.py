"""Envoy bootstrap for a gateway in front of the picker (``kvfleet gateway-config``).

:func:`bootstrap` renders the one gateway configuration kvfleet ships: the demo
and the tests run it, and the Helm chart's gateway runs exactly this too (its
init container calls ``kvfleet gateway-config``, :func:`main`). What it does:

* a request carrying a header that steers prefill/decode
  (:data:`~kvfleet.epp.protocol.CLIENT_REFUSED_HEADERS`: ``x-prefiller-host-port``,
  the engines' peer-signature headers) matches a route that answers 400 JSON with
  ext_proc disabled: the picker never sees it, in every failure mode;
* a ``header_mutation`` filter first removes every routing header a client may have
  sent (:data:`~kvfleet.epp.protocol.CLIENT_STRIPPED_HEADERS`:
  ``x-gateway-destination-endpoint``, ``-subset``, ``-served``): only the picker sets them;
* the ext_proc filter sends headers and body to the picker (``body_mode``:
  ``FULL_DUPLEX_STREAMED``, GIE's reference, or ``BUFFERED``) and the response
  phase too (first token, cached tokens, misprediction), asking Envoy for the
  attribute ``upstream.address`` so the picker learns which endpoint served; ``allow_mode_override`` lets
  the picker skip a response's body (``epp.response_body_sample``: honoured by Envoy in ``BUFFERED``, ignored
  in ``FULL_DUPLEX_STREAMED``);
* the route to the pods cluster matches on the picker's dynamic metadata
  (``envoy.lb`` → ``x-gateway-destination-endpoint``), which no client can set;
  the ``ORIGINAL_DST`` cluster takes its address from the picker's header
  (``routing="header"``) or that metadata (``routing="metadata"``): one endpoint, so the picker must
  return no fallbacks (``max-score-picker`` ``fallbacks: 0``, the default);
* ``routing="override_host"`` (pods known up front: a pods file, the local stack): the pods cluster
  lists ``pod_endpoints`` and Envoy's override-host load balancer takes the picker's ordered
  ``ip:port,ip:port`` list from that metadata; a pod that refuses the connection or resets it before
  its response began is retried on the next endpoint of the list (GIE protocol v0.4 fallbacks:
  with the picker's ``fallbacks: 2``, a request picked onto a pod that just died is served by the
  next-best pod instead of failing). An endpoint outside ``pod_endpoints`` is never used;
* ``failure_mode_allow`` (GIE's FailOpen): with the picker unreachable, the
  request goes to the fallback cluster: ``fallback_endpoints`` (``ip:port``) or
  ``fallback_service`` (a DNS name such as a pool's headless Service, resolved to
  all its pods); never to an address a client names. Without either, FailOpen
  answers 503;
* ``/kvfleet/`` (the engines' internal API) is answered 404 by Envoy itself (ext_proc disabled there too);
* Envoy's own errors are OpenAI-style JSON (``local_reply_config``): the picker unreachable under
  FailClose → 503 ``endpoint_picker_unavailable``; the picked pod refusing, resetting or timing out →
  ``upstream_unavailable`` with Envoy's status;
* the admin API listens on 127.0.0.1 only; ``health_port`` opens a listener whose
  ``/ready`` is proxied to the admin's ``/ready`` (for kubelet probes) and nothing else;
* ``epp_tls_ca``: TLS to the picker, verified against that CA file, with
  ``epp_tls_sni`` (default: ``epp_host``); the picker serves TLS with the
  cert of ``epp.tls_cert_file``/``tls_key_file``;
* ``subset_hint``: a fixed list of endpoints handed to the picker as
  ``envoy.lb.subset_hint`` metadata (how a gateway restricts a route to a subset;
  set by the gateway's configuration, never from a client header).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvfleet.epp.protocol import (
    CLIENT_REFUSED_HEADERS,
    CLIENT_STRIPPED_HEADERS,
    DEST_HEADER,
    DEST_METADATA_NS,
    EXT_PROC_SERVICE,
    INTERNAL_PREFIX,
    POOL_METADATA,
    SUBSET_KEY,
    SUBSET_NS,
    UNREACHABLE_HEADER,
    UPSTREAM_ATTRIBUTE,
)

_T = "type.googleapis.com/"
_PREVIOUS_HOSTS = _T + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
_ROUND_ROBIN = _T + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
#: how the gateway reaches the picked pod (:func:`bootstrap`)
ROUTING_MODES = ("header", "metadata", "override_host")
_JSON_503 = ('{"error": {"code": 503, "type": "no_ready_endpoint", '
             '"message": "no endpoint was picked for this request"}}')
_JSON_REFUSED = (
    '{"error": {"code": 400, "type": "invalid_request_error", "message": "the request sets a header that '
    'only the gateway and the engines may set (' + ", ".join(CLIENT_REFUSED_HEADERS) + ')"}}'
)
_JSON_404 = ('{"error": {"code": 404, "type": "not_found_error", '
             '"message": "not served through the gateway"}}')


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port); raises ValueError."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


def upstream_cluster(name: str, endpoints: Sequence[tuple[str, int]], http2: bool = False) -> dict[str, Any]:
    """STATIC for IP endpoints, STRICT_DNS (every address of the name) for DNS names."""
    dns = any(not _is_ip(h) for h, _ in endpoints)
    c: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(h, p)}} for h, p in endpoints]}],
        },
    }
    if dns:
        c["dns_lookup_family"] = "V4_PREFERRED"
    if http2:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return c


def strip_filter() -> dict[str, Any]:
    """Removes every routing header a client may have sent; only the picker sets them."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": h} for h in CLIENT_STRIPPED_HEADERS]},
        },
    }


def local_replies() -> dict[str, Any]:
    """Envoy's own error answers as OpenAI-style JSON: the picker unreachable (FailClose) → 503, an upstream
    that refuses, resets or times out → its status; the picker's own ImmediateResponses keep their bodies."""
    def body(kind: str, message: str) -> dict[str, Any]:
        return {"json_format": {"error": {"code": "%RESPONSE_CODE%", "type": kind, "message": message}},
                "content_type": "application/json"}

    cel = "envoy.access_loggers.extension_filters.cel"
    return {"mappers": [
        {
            "filter": {"extension_filter": {"name": cel, "typed_config": {
                "@type": _T + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": "response.code_details.startsWith('ext_proc_error')"}}},
            "status_code": 503,
            "body_format_override": body("endpoint_picker_unavailable",
                                         "the endpoint picker did not answer; retry"),
        },
        {   # nothing listening at the picked pod: tell the picker (response header) so it stops picking it
            "filter": {"response_flag_filter": {"flags": ["UF"]}},
            "headers_to_add": [{"header": {"key": UNREACHABLE_HEADER, "value": "%UPSTREAM_HOST%"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            "body_format_override": body("upstream_unavailable", "%RESPONSE_CODE_DETAILS%"),
        },
        {
            "filter": {"response_flag_filter": {"flags": ["UH", "UO", "URX", "NR", "UC", "UT", "DC"]}},
            "body_format_override": body("upstream_unavailable", "%RESPONSE_CODE_DETAILS%"),
        },
    ]}


def _subset_filter(endpoints: Sequence[str]) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_NS, "value": {SUBSET_KEY: list(endpoints)}}],
        },
    }


def ext_proc_filter(cluster: str, *, name: str = "envoy.filters.http.ext_proc",
                    body_mode: str = "FULL_DUPLEX_STREAMED", failure_mode_allow: bool = False,
                    response_processing: bool = True, message_timeout_s: float = 10.0,
                    pool: str = "") -> dict[str, Any]:
    """The ext_proc HTTP filter that calls the picker at ``cluster``: headers and body of the request, and the
    response phase (``response_processing``) with the attribute ``upstream.address`` (the served endpoint);
    a stream that cannot be opened on one picker replica is opened on another. ``pool``: the InferencePool
    this filter serves, named to the picker on each stream (gRPC metadata ``x-kvfleet-inference-pool``) so
    its picks stay in that pool."""
    if body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(f"body_mode must be FULL_DUPLEX_STREAMED or BUFFERED, got {body_mode!r}")
    streamed = body_mode == "FULL_DUPLEX_STREAMED"
    mode: dict[str, str] = {
        "request_header_mode": "SEND",
        "request_body_mode": body_mode,
        "request_trailer_mode": "SEND" if streamed else "SKIP",
        "response_header_mode": "SEND" if response_processing else "SKIP",
        "response_body_mode": ("FULL_DUPLEX_STREAMED" if streamed else "STREAMED")
        if response_processing else "NONE",
        "response_trailer_mode": "SEND" if streamed and response_processing else "SKIP",
    }
    return {
        "name": name,
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": cluster},
                "timeout": "10s",
                **({"initial_metadata": [{"key": POOL_METADATA, "value": pool}]} if pool else {}),
                "retry_policy": {
                    "retry_on": "connect-failure,refused-stream,unavailable,reset",
                    "num_retries": 2,
                    "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"},
                    "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                              "typed_config": {"@type": _PREVIOUS_HOSTS}}],
                    "host_selection_retry_max_attempts": 3,
                },
            },
            "failure_mode_allow": failure_mode_allow,
            # the picker may skip a response's body (epp.response_body_sample; body mode BUFFERED)
            "allow_mode_override": True,
            "message_timeout": f"{message_timeout_s}s",
            "processing_mode": mode,
            "response_attributes": [UPSTREAM_ATTRIBUTE],
            "metadata_options": {
                "receiving_namespaces": {"untyped": [DEST_METADATA_NS]},
                "forwarding_namespaces": {"untyped": [SUBSET_NS, DEST_METADATA_NS]},
            },
        },
    }


def epp_cluster(name: str, replicas: Sequence[tuple[str, int]], *, tls_ca: str = "", tls_sni: str = "",
                health_interval_s: float = 0.5) -> dict[str, Any]:
    """The picker's cluster (HTTP/2): replicas health-checked on GIE's ext_proc health service and ejected
    on local connect failures, so a dead replica stops getting streams within about a second; TLS verified
    against ``tls_ca`` when given."""
    epp = upstream_cluster(name, replicas, http2=True)
    interval = f"{health_interval_s}s"
    # A busy picker may answer a check late: three misses (or a NOT_SERVING answer three times) take it
    # out; a dead one is ejected at its first refused connection by the outlier detection below.
    epp["health_checks"] = [{
        "timeout": "1s", "interval": interval, "no_traffic_interval": interval,
        "unhealthy_threshold": 3, "healthy_threshold": 1,
        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
    }]
    epp["outlier_detection"] = {"split_external_local_origin_errors": True,
                                "consecutive_local_origin_failure": 1,
                                "base_ejection_time": "2s", "max_ejection_percent": 100}
    epp["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    if tls_ca:
        sni = tls_sni or replicas[0][0]
        epp["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": sni,
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "validation_context": {
                        "trusted_ca": {"filename": tls_ca},
                        "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": sni}}],
                    },
                },
            },
        }
    return epp


def picked_match() -> dict[str, Any]:
    """Route match on the picker's dynamic metadata (``envoy.lb`` → ``x-gateway-destination-endpoint``):
    set only by the picker, never by a client."""
    return {"filter": DEST_METADATA_NS, "path": [{"key": DEST_HEADER}], "value": {"present_match": True}}


def _json_reply(status: int, body: str) -> dict[str, Any]:
    return {"direct_response": {"status": status, "body": {"inline_string": body}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}]}


def no_pick_response() -> dict[str, Any]:
    """What a request with no pick gets where nothing else may serve it: 503 JSON ``no_ready_endpoint``."""
    return _json_reply(503, _JSON_503)


def refused_routes(match: dict[str, Any], per_filter: dict[str, Any]) -> list[dict[str, Any]]:
    """Routes answering 400 JSON to a request matching ``match`` that carries a header steering
    prefill/decode with no pick (the client sent it: the picker sets ``x-prefiller-host-port`` with its
    pick); ``per_filter`` disables the picker there, so it never sees such a request."""
    out = []
    for h in CLIENT_REFUSED_HEADERS:
        m = {**match, "headers": [*match.get("headers", []), {"name": h, "present_match": True}],
             "dynamic_metadata": [*match.get("dynamic_metadata", []), {**picked_match(), "invert": True}]}
        out.append({"match": m, **_json_reply(400, _JSON_REFUSED), "typed_per_filter_config": per_filter})
    return out


def internal_route(per_filter: dict[str, Any]) -> dict[str, Any]:
    """``/kvfleet/`` (the engines' internal API) answered 404 JSON by Envoy itself, the picker disabled."""
    return {"match": {"prefix": INTERNAL_PREFIX}, **_json_reply(404, _JSON_404),
            "typed_per_filter_config": per_filter}


def _health_listener(port: int, admin_port: int) -> dict[str, Any]:
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "health",
        "route_config": {"name": "health", "virtual_hosts": [{"name": "health", "domains": ["*"], "routes": [
            {"match": {"path": "/ready"}, "route": {"cluster": "kvfleet-admin"}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
        ]}]},
        "http_filters": [{"name": "envoy.filters.http.router",
                          "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "name": "health",
        "address": _addr("0.0.0.0", port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }


def bootstrap(
    *,
    listen_port: int,
    epp_host: str = "127.0.0.1",
    epp_port: int = 9002,
    routing: str = "header",
    body_mode: str = "FULL_DUPLEX_STREAMED",
    failure_mode_allow: bool = False,
    fallback_endpoints: Sequence[str] = (),
    fallback_service: str = "",
    admin_port: int = 0,
    listen_host: str = "127.0.0.1",
    health_port: int = 0,
    subset_hint: Sequence[str] | None = None,
    response_processing: bool = True,
    message_timeout_s: float = 10.0,
    upstream_timeout_s: float = 300.0,
    use_epp: bool = True,
    epp_tls_ca: str = "",
    epp_tls_sni: str = "",
    epp_endpoints: Sequence[str] = (),
    epp_health_interval_s: float = 0.5,
    pod_endpoints: Sequence[str] = (),
    pod_retries: int = 2,
) -> dict[str, Any]:
    """The bootstrap as a mapping (``yaml.safe_dump`` it, or :func:`write_bootstrap`).

    ``epp_endpoints`` (``host:port`` each) lists several picker replicas instead of ``epp_host``/``epp_port``.
    """
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
    if (routing == "override_host") != bool(pod_endpoints):
        raise ValueError("routing 'override_host' takes pod_endpoints (the pods' ip:port), and only it does")
    pods = [split_endpoint(e) for e in pod_endpoints]
    if any(not _is_ip(h) for h, _ in pods):
        raise ValueError("pod_endpoints must be ip:port (the addresses the picker returns)")
    if body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(f"body_mode must be FULL_DUPLEX_STREAMED or BUFFERED, got {body_mode!r}")
    if fallback_endpoints and fallback_service:
        raise ValueError("give fallback_endpoints or fallback_service, not both")
    ext_proc = ext_proc_filter("kvfleet-epp", body_mode=body_mode, failure_mode_allow=failure_mode_allow,
                               response_processing=response_processing, message_timeout_s=message_timeout_s)
    filters: list[dict[str, Any]] = [strip_filter()]
    if subset_hint is not None:
        filters.append(_subset_filter(subset_hint))
    if use_epp:
        filters.append(ext_proc)
    filters.append({"name": "envoy.filters.http.router",
                    "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}})
    timeout = f"{upstream_timeout_s}s"
    no_ext_proc = {"envoy.filters.http.ext_proc": {
        "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}}
    picked = picked_match()
    # A refused header with no pick: the client sent it (the picker sets x-prefiller-host-port with its pick).
    routes = refused_routes({"prefix": "/"}, no_ext_proc)
    routes.append(internal_route(no_ext_proc))
    if use_epp:
        to_pods: dict[str, Any] = {"cluster": "kvfleet-pods", "timeout": timeout}
        if routing == "override_host" and pod_retries > 0:
            # a pod that refuses the connection or resets it before any response header: nothing reached the
            # client yet, so the next endpoint of the picker's list serves it (Envoy never retries once the
            # response has begun; a pod that died mid-prefill costs that prefill twice, the client nothing)
            to_pods["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset",
                                       "num_retries": pod_retries,
                                       "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"}}
        routes.append({"match": {"prefix": "/", "dynamic_metadata": [picked]}, "route": to_pods})
    fallback = [split_endpoint(e) for e in fallback_endpoints]
    if fallback_service:
        fallback = [split_endpoint(fallback_service)]
    if fallback:
        routes.append(
            {"match": {"prefix": "/"}, "route": {"cluster": "kvfleet-fallback", "timeout": timeout}})
    else:
        routes.append({"match": {"prefix": "/"}, **no_pick_response()})
    if routing == "header":
        odst: dict[str, Any] = {"use_http_header": True, "http_header_name": DEST_HEADER}
    else:
        odst = {"metadata_key": {"key": DEST_METADATA_NS, "path": [{"key": DEST_HEADER}]}}
    clusters: list[dict[str, Any]] = []
    if use_epp:
        replicas = [split_endpoint(e) for e in epp_endpoints] or [(epp_host, epp_port)]
        epp = epp_cluster("kvfleet-epp", replicas, tls_ca=epp_tls_ca, tls_sni=epp_tls_sni or epp_host,
                          health_interval_s=epp_health_interval_s)
        clusters.append(epp)
        if routing == "override_host":
            pods_cluster = upstream_cluster("kvfleet-pods", pods)
            del pods_cluster["lb_policy"]
            pods_cluster["connect_timeout"] = "2s"
            pods_cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": {
                    "@type": _T + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                    "override_host_sources": [
                        {"metadata": {"key": DEST_METADATA_NS, "path": [{"key": DEST_HEADER}]}}],
                    # used only when no endpoint of the picker's list is in the cluster (a pods-file edit the
                    # gateway has not been given yet): a pool member, never an address from the request
                    "fallback_policy": {"policies": [{"typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {"@type": _ROUND_ROBIN},
                    }}]},
                },
            }}]}
            clusters.append(pods_cluster)
        else:
            clusters.append(
                {
                    "name": "kvfleet-pods",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": odst,
                }
            )
    if fallback:
        clusters.append(upstream_cluster("kvfleet-fallback", fallback))
    listeners: list[dict[str, Any]] = []
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "stream_idle_timeout": timeout,
        # RFC 3986 dot segments resolved and slashes merged before routing: /v1/../kvfleet/x is /kvfleet/x
        "normalize_path": True,
        "merge_slashes": True,
        "route_config": {"name": "kvfleet",
                         "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
        "local_reply_config": local_replies(),
    }
    listeners.append(
        {
            "name": "gateway",
            "address": _addr(listen_host, listen_port),
            "filter_chains": [{
                "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
        }
    )
    if health_port:
        if not admin_port:
            raise ValueError("health_port needs a fixed admin_port")
        listeners.append(_health_listener(health_port, admin_port))
        clusters.append(upstream_cluster("kvfleet-admin", [("127.0.0.1", admin_port)]))
    return {
        "admin": {"address": _addr("127.0.0.1", admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def write_bootstrap(path: str | Path, **kwargs: Any) -> Path:
    p = Path(path)
    p.write_text(yaml.safe_dump(bootstrap(**kwargs), sort_keys=False))
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet gateway-config",
        description="Write the Envoy gateway configuration in front of the kvfleet EPP (what the chart's "
                    "gateway runs)",
    )
    p.add_argument("--out", default="-", help="file to write (default: stdout)")
    p.add_argument("--listen-port", type=int, default=8080)
    p.add_argument("--listen-host", default="0.0.0.0")
    p.add_argument("--admin-port", type=int, default=9901, help="admin API port, on 127.0.0.1 only")
    p.add_argument("--health-port", type=int, default=0, help="listener serving only /ready (kubelet probes)")
    p.add_argument("--epp", required=True,
                   help="the EPP's ext_proc address, HOST:PORT (a DNS name is resolved)")
    p.add_argument("--epp-tls-ca", default="",
                   help="verify the EPP's TLS certificate against this CA file (enables TLS)")
    p.add_argument("--epp-tls-sni", default="",
                   help="server name expected in the EPP's certificate (default: the EPP host)")
    p.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose")
    p.add_argument("--fallback-service", default="",
                   help="FailOpen target, HOST:PORT (e.g. a pool's headless Service)")
    p.add_argument("--routing", choices=ROUTING_MODES, default="header")
    p.add_argument("--pod-endpoint", action="append", default=[], dest="pod_endpoints",
                   help="with --routing override_host: a pod's IP:PORT (repeat for each pod)")
    p.add_argument("--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
                   default="FULL_DUPLEX_STREAMED")
    p.add_argument("--upstream-timeout-s", type=float, default=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``kvfleet gateway-config``: render :func:`bootstrap` from flags (the chart's init container)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        epp_host, epp_port = split_endpoint(args.epp)
        if args.fallback_service:
            split_endpoint(args.fallback_service)
        cfg = bootstrap(
            listen_port=args.listen_port, listen_host=args.listen_host, admin_port=args.admin_port,
            health_port=args.health_port, epp_host=epp_host, epp_port=epp_port, epp_tls_ca=args.epp_tls_ca,
            epp_tls_sni=args.epp_tls_sni, failure_mode_allow=args.failure_mode == "FailOpen",
            fallback_service=args.fallback_service, routing=args.routing, body_mode=args.body_mode,
            upstream_timeout_s=args.upstream_timeout_s, pod_endpoints=args.pod_endpoints,
        )
    except ValueError as exc:
        print(f"kvfleet gateway-config: {exc}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(cfg, sort_keys=False)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0
