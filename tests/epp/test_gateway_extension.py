"""``kvfleet gateway-extension`` (Envoy Gateway's extension hooks) on EG-shaped xDS, and over real gRPC.

The run through real Envoy Gateway is tests/e2e/test_envoy_gateway.py; these pin each rewrite on its own.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401  (EG's router filter, parsed below)
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import json_format

from kvfleet.epp.egproto import MESSAGES, SERVICE
from kvfleet.epp.gateway_extension import (
    ANN_EPP_REPLICAS,
    ANN_FALLBACK,
    HCM,
    STRIP_FILTER,
    Extension,
    Pool,
    parse_pool,
    pool_of,
    serve,
)
from kvfleet.epp.protocol import DEST_HEADER, POOL_METADATA


def inference_pool(
    name: str = "p",
    mode: str | None = "FailClose",
    ref: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    epp = {"name": "epp", "port": {"number": 9002}} if ref is None else ref
    if mode is not None and ref is None:
        epp["failureMode"] = mode
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ns", "annotations": annotations or {}},
        "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": epp,
        },
    }


def resource(obj: dict[str, Any]) -> Any:
    return MESSAGES["ExtensionResource"](unstructured_bytes=json.dumps(obj).encode())


def test_a_pool_is_read_with_its_picker_mode_and_fallback() -> None:
    p = parse_pool(inference_pool(mode="FailOpen", annotations={ANN_FALLBACK: "p-p0:8000, p-p1:8000, junk"}))
    assert p == Pool("ns", "p", "epp", 9002, "FailOpen", (("p-p0", 8000), ("p-p1", 8000)))
    assert (parse_pool(inference_pool(mode=None)) or Pool("", "")).failure_mode == "FailClose"  # GIE default
    assert parse_pool({"apiVersion": "v1", "kind": "Service"}) is None


def test_a_pool_survives_its_trip_through_route_metadata() -> None:
    p = Pool("ns", "p", "epp", 9002, "FailOpen", (("a", 1), ("b", 2)), "", ("epp-replicas", 9002))
    assert Pool.from_json(p.to_json()) == p and Pool.from_json(Pool("ns", "q").to_json()) == Pool("ns", "q")


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ({"group": "x.io", "kind": "Thing", "name": "a", "port": {"number": 1}}, "core Service"),
        ({"name": "epp"}, "port.number"),
        ({"name": "epp", "port": {"number": 70000}}, "port.number"),
        ({"port": {"number": 9002}}, "name is required"),
        ({"name": "epp", "port": {"number": 9002}, "failureMode": "Maybe"}, "FailClose or FailOpen"),
    ],
)
def test_a_pool_that_cannot_be_served_says_why(ref: dict[str, Any], says: str) -> None:
    p = parse_pool(inference_pool(ref=ref))
    assert p is not None and says in p.error and "ns/p" in p.error
    spec_less = inference_pool()
    del spec_less["spec"]["endpointPickerRef"]
    assert "no endpointPickerRef" in (parse_pool(spec_less) or Pool("", "")).error


def test_the_pool_cluster_becomes_original_dst_on_the_pickers_header() -> None:
    ext = Extension()
    eg = json_format.ParseDict(
        {
            "name": "httproute/ns/r/rule/0",
            "type": "EDS",
            "eds_cluster_config": {"eds_config": {"ads": {}}},
            "lb_policy": "LEAST_REQUEST",
            "connect_timeout": "10s",
        },
        cluster_pb2.Cluster(),
    )
    req = MESSAGES["PostClusterModifyRequest"](cluster=eg)
    assert ext.post_cluster_modify(req).cluster == eg  # no InferencePool: untouched
    req.post_cluster_context.backend_extension_resources.append(resource(inference_pool()))
    c = ext.post_cluster_modify(req).cluster
    assert c.type == cluster_pb2.Cluster.ORIGINAL_DST and c.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED
    assert (
        c.original_dst_lb_config.use_http_header and c.original_dst_lb_config.http_header_name == DEST_HEADER
    )
    assert not c.HasField("eds_cluster_config") and c.name == eg.name
    assert pool_of(c.metadata) == parse_pool(inference_pool())


def test_a_route_to_a_pool_is_tagged_and_two_pools_in_one_rule_are_refused() -> None:
    ext = Extension()
    req = MESSAGES["PostRouteModifyRequest"](
        route=route_pb2.RouteConfiguration().virtual_hosts.add().routes.add()
    )
    req.route.name = "r"
    assert pool_of(ext.post_route_modify(req).route.metadata) is None
    req.post_route_context.extension_resources.append(resource(inference_pool()))
    assert pool_of(ext.post_route_modify(req).route.metadata) == parse_pool(inference_pool())
    req.post_route_context.extension_resources.append(resource(inference_pool("q")))
    assert "one InferencePool" in (pool_of(ext.post_route_modify(req).route.metadata) or Pool("", "")).error


def _translation(pools: list[dict[str, Any]]) -> Any:
    """What EG hands PostTranslateModify: a listener whose default chain's HCM takes RDS ``ns/gw/http``, its
    route configuration with one route per pool (tagged by PostRouteModify) and one plain route."""
    ext = Extension()
    rc = route_pb2.RouteConfiguration(name="ns/gw/http")
    vh = rc.virtual_hosts.add(name="ns/gw/http/*", domains=["*"])
    for i, obj in enumerate(pools):
        r = vh.routes.add(name=f"httproute/ns/r{i}/rule/0/match/0/*")
        json_format.ParseDict(
            {"prefix": "/", "headers": [{"name": "x-pool", "string_match": {"exact": str(i)}}]}, r.match
        )
        r.route.cluster = f"httproute/ns/r{i}/rule/0"
        req = MESSAGES["PostRouteModifyRequest"](route=r)
        req.post_route_context.extension_resources.append(resource(obj))
        r.CopyFrom(ext.post_route_modify(req).route)
    plain = vh.routes.add(name="httproute/ns/web/rule/0/match/0/*")
    plain.match.prefix = "/static"
    plain.route.cluster = "httproute/ns/web/rule/0"
    hcm = json_format.ParseDict(
        {
            "stat_prefix": "http-10080",
            "rds": {"config_source": {"ads": {}}, "route_config_name": "ns/gw/http"},
            "http_filters": [
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    },
                }
            ],
        },
        hcm_pb2.HttpConnectionManager(),
    )
    lst = listener_pb2.Listener(name="ns/gw/http")
    lst.default_filter_chain.filters.add(name=HCM).typed_config.Pack(hcm)
    req = MESSAGES["PostTranslateModifyRequest"]()
    req.listeners.append(lst)
    req.routes.append(rc)
    return req


def _hcm(out: Any) -> Any:
    h = hcm_pb2.HttpConnectionManager()
    out.listeners[0].default_filter_chain.filters[0].typed_config.Unpack(h)
    return h


def _disabled(route: Any) -> set[str]:
    out = set()
    for name, a in route.typed_per_filter_config.items():
        per = ext_proc_pb2.ExtProcPerRoute()
        a.Unpack(per)
        if per.disabled:
            out.add(name)
    return out


def test_translation_adds_the_picker_per_pool_and_splits_its_routes() -> None:
    closed = inference_pool("a")
    opened = inference_pool("b", "FailOpen", annotations={ANN_FALLBACK: "b-p0:8000"})
    out = Extension().post_translate_modify(_translation([closed, opened]))
    pa, pb = parse_pool(closed), parse_pool(opened)
    assert pa is not None and pb is not None
    assert [f.name for f in _hcm(out).http_filters] == [
        STRIP_FILTER,
        pa.filter_name,
        pb.filter_name,
        "envoy.filters.http.router",
    ]
    modes = {}
    for f in _hcm(out).http_filters[1:3]:
        cfg = ext_proc_pb2.ExternalProcessor()
        f.typed_config.Unpack(cfg)
        modes[f.name] = (cfg.failure_mode_allow, cfg.grpc_service.envoy_grpc.cluster_name)
    # both pools name the same picker Service: one cluster, whose health both share
    assert modes == {pa.filter_name: (False, pa.epp_cluster), pb.filter_name: (True, pa.epp_cluster)}
    # each filter names its pool to the picker
    for f, pool in zip(_hcm(out).http_filters[1:3], ("a", "b"), strict=True):
        cfg = ext_proc_pb2.ExternalProcessor()
        f.typed_config.Unpack(cfg)
        assert [(m.key, m.value) for m in cfg.grpc_service.initial_metadata] == [(POOL_METADATA, pool)]
    assert _hcm(out).HasField("local_reply_config")
    clusters = {c.name: c for c in out.clusters}
    assert sorted(c.name for c in out.clusters) == sorted({pa.epp_cluster, pb.fallback_cluster})  # no twice
    assert (
        clusters[pa.epp_cluster]
        .load_assignment.endpoints[0]
        .lb_endpoints[0]
        .endpoint.address.socket_address.address
        == "epp.ns.svc.cluster.local"
    )
    assert clusters[pb.fallback_cluster].type == cluster_pb2.Cluster.STRICT_DNS
    routes = list(out.routes[0].virtual_hosts[0].routes)
    names = [r.name for r in routes]
    assert routes[0].match.prefix == "/kvfleet/" and routes[0].direct_response.status == 404
    r0 = "httproute/ns/r0/rule/0/match/0/*"
    picked = routes[names.index(r0)]
    assert picked.match.dynamic_metadata[0].filter == "envoy.lb" and _disabled(picked) == {pb.filter_name}
    assert picked.route.cluster == "httproute/ns/r0/rule/0"
    no_pick = routes[names.index(r0 + "/no-pick")]
    assert no_pick.direct_response.status == 503 and not no_pick.match.dynamic_metadata
    assert names.index(r0 + "/refused") < names.index(r0) < names.index(r0 + "/no-pick")
    refused = routes[names.index(r0 + "/refused")]
    assert refused.direct_response.status == 400 and _disabled(refused) == {pa.filter_name, pb.filter_name}
    assert {h.name for h in refused.match.headers} >= {"x-pool"}
    open_no_pick = routes[names.index("httproute/ns/r1/rule/0/match/0/*/no-pick")]
    assert open_no_pick.route.cluster == pb.fallback_cluster
    plain = routes[names.index("httproute/ns/web/rule/0/match/0/*")]
    assert plain.route.cluster == "httproute/ns/web/rule/0" and _disabled(plain) == {
        pa.filter_name,
        pb.filter_name,
    }


def test_the_picker_cluster_reaches_every_replica_when_the_pool_names_them() -> None:
    """``kvfleet.io/epp-replicas`` (a headless Service): the ext_proc cluster resolves it to every replica
    (STRICT_DNS, round robin, each health-checked); without it, the Service's one address."""
    named = inference_pool(annotations={ANN_EPP_REPLICAS: "epp-replicas:9002"})
    out = Extension().post_translate_modify(_translation([named]))
    (c,) = out.clusters
    addr = c.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (addr.address, addr.port_value) == ("epp-replicas.ns.svc.cluster.local", 9002)
    assert c.type == cluster_pb2.Cluster.STRICT_DNS and c.health_checks[0].grpc_health_check.service_name
    assert c.name == "kvfleet-epp/ns/epp-replicas:9002"


def test_translation_is_idempotent_and_leaves_a_pool_less_gateway_alone() -> None:
    ext = Extension()
    once = ext.post_translate_modify(_translation([inference_pool()]))
    req = MESSAGES["PostTranslateModifyRequest"]()
    req.listeners.extend(once.listeners)
    req.clusters.extend(once.clusters)
    twice = ext.post_translate_modify(req)
    assert [f.name for f in _hcm(twice).http_filters] == [f.name for f in _hcm(once).http_filters]
    assert len(twice.clusters) == len(once.clusters)
    bare = _translation([])
    assert ext.post_translate_modify(bare).listeners[0] == bare.listeners[0]


def test_a_malformed_pool_answers_503_naming_it_and_breaks_nothing_else() -> None:
    bad = inference_pool("bad", ref={"group": "x.io", "kind": "Thing", "name": "t", "port": {"number": 1}})
    out = Extension().post_translate_modify(_translation([bad, inference_pool("good")]))
    routes = {r.name: r for r in out.routes[0].virtual_hosts[0].routes}
    r = routes["httproute/ns/r0/rule/0/match/0/*"]
    body = json.loads(r.direct_response.body.inline_string)
    assert r.direct_response.status == 503 and body["error"]["type"] == "invalid_inference_pool"
    assert "ns/bad" in body["error"]["message"] and "core Service" in body["error"]["message"]
    assert routes["httproute/ns/r1/rule/0/match/0/*"].route.cluster == "httproute/ns/r1/rule/0"
    assert [c.name for c in out.clusters] == ["kvfleet-epp/ns/epp:9002"]


def test_the_hooks_answer_over_grpc() -> None:
    server, port = serve(Extension(), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(
                f"/{SERVICE}/PostClusterModify",
                request_serializer=MESSAGES["PostClusterModifyRequest"].SerializeToString,
                response_deserializer=MESSAGES["PostClusterModifyResponse"].FromString,
            )
            req = MESSAGES["PostClusterModifyRequest"](cluster=cluster_pb2.Cluster(name="c"))
            req.post_cluster_context.backend_extension_resources.append(resource(inference_pool()))
            assert call(req, timeout=5).cluster.type == cluster_pb2.Cluster.ORIGINAL_DST
            vh = ch.unary_unary(
                f"/{SERVICE}/PostVirtualHostModify",
                request_serializer=MESSAGES["PostVirtualHostModifyRequest"].SerializeToString,
                response_deserializer=MESSAGES["PostVirtualHostModifyResponse"].FromString,
            )
            got = vh(
                MESSAGES["PostVirtualHostModifyRequest"](
                    virtual_host=route_components_pb2.VirtualHost(name="v")
                ),
                timeout=5,
            )
            assert got.virtual_host.name == "v"
            garbage = ch.unary_unary(f"/{SERVICE}/PostTranslateModify")
            with pytest.raises(grpc.RpcError) as err:
                garbage(b"\xff\xff\xff", timeout=5)
            assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        server.stop(0)
