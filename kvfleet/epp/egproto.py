"""Envoy Gateway's extension protocol (``envoygateway.extension``, EG v1.9.1 ``proto/extension``) as
protobuf message classes built at import on the Envoy types ``xds-protos`` registers: no generated code.

Only field numbers and types matter on the wire; they are EG's (Apache-2.0, github.com/envoyproxy/gateway,
``proto/extension/service.proto`` and ``context.proto`` at v1.9.1).
"""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2  # noqa: F401  (registers the types EG's messages use)
from envoy.config.endpoint.v3 import endpoint_pb2  # noqa: F401
from envoy.config.listener.v3 import listener_pb2  # noqa: F401
from envoy.config.route.v3 import route_components_pb2, route_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2  # noqa: F401
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

SERVICE = "envoygateway.extension.EnvoyGatewayExtension"

def messages() -> dict[str, type[Message]]:
    """EG's ``proto/extension`` messages (v1.9.1 field numbers) on the Envoy types xds-protos registered."""
    pool = descriptor_pool.Default()
    name = "kvfleet/envoygateway_extension.proto"
    try:
        pool.FindFileByName(name)
    except KeyError:
        f = descriptor_pb2.FileDescriptorProto(name=name, package="envoygateway.extension", syntax="proto3")
        f.dependency.extend(
            [
                "envoy/config/cluster/v3/cluster.proto",
                "envoy/config/endpoint/v3/endpoint.proto",
                "envoy/config/listener/v3/listener.proto",
                "envoy/config/route/v3/route_components.proto",
                "envoy/config/route/v3/route.proto",
                "envoy/extensions/transport_sockets/tls/v3/secret.proto",
            ]
        )
        T = descriptor_pb2.FieldDescriptorProto
        spec: dict[str, list[tuple[str, int, str, bool]]] = {  # message: (field, number, type, repeated)
            "ExtensionResource": [("unstructured_bytes", 1, "bytes", False)],
            "PostRouteExtensionContext": [
                ("extension_resources", 1, ".envoygateway.extension.ExtensionResource", True),
                ("hostnames", 2, "string", True),
                ("extension_policies", 3, ".envoygateway.extension.ExtensionResource", True),
            ],
            "PostClusterExtensionContext": [
                ("backend_extension_resources", 1, ".envoygateway.extension.ExtensionResource", True)
            ],
            "PostTranslateExtensionContext": [
                ("extension_resources", 1, ".envoygateway.extension.ExtensionResource", True)
            ],
            "PostRouteModifyRequest": [
                ("route", 1, ".envoy.config.route.v3.Route", False),
                ("post_route_context", 2, ".envoygateway.extension.PostRouteExtensionContext", False),
            ],
            "PostRouteModifyResponse": [("route", 1, ".envoy.config.route.v3.Route", False)],
            "PostClusterModifyRequest": [
                ("cluster", 1, ".envoy.config.cluster.v3.Cluster", False),
                ("post_cluster_context", 2, ".envoygateway.extension.PostClusterExtensionContext", False),
            ],
            "PostClusterModifyResponse": [("cluster", 1, ".envoy.config.cluster.v3.Cluster", False)],
            "PostVirtualHostModifyRequest": [
                ("virtual_host", 1, ".envoy.config.route.v3.VirtualHost", False)
            ],
            "PostVirtualHostModifyResponse": [
                ("virtual_host", 1, ".envoy.config.route.v3.VirtualHost", False)
            ],
            "PostHTTPListenerModifyRequest": [("listener", 1, ".envoy.config.listener.v3.Listener", False)],
            "PostHTTPListenerModifyResponse": [("listener", 1, ".envoy.config.listener.v3.Listener", False)],
            "PostEndpointsModifyRequest": [
                ("load_assignment", 1, ".envoy.config.endpoint.v3.ClusterLoadAssignment", False)
            ],
            "PostEndpointsModifyResponse": [
                ("load_assignment", 1, ".envoy.config.endpoint.v3.ClusterLoadAssignment", False)
            ],
            "PostTranslateModifyRequest": [
                ("post_translate_context", 1, ".envoygateway.extension.PostTranslateExtensionContext", False),
                ("clusters", 2, ".envoy.config.cluster.v3.Cluster", True),
                ("secrets", 3, ".envoy.extensions.transport_sockets.tls.v3.Secret", True),
                ("listeners", 4, ".envoy.config.listener.v3.Listener", True),
                ("routes", 5, ".envoy.config.route.v3.RouteConfiguration", True),
            ],
            "PostTranslateModifyResponse": [
                ("clusters", 1, ".envoy.config.cluster.v3.Cluster", True),
                ("secrets", 2, ".envoy.extensions.transport_sockets.tls.v3.Secret", True),
                ("listeners", 3, ".envoy.config.listener.v3.Listener", True),
                ("routes", 4, ".envoy.config.route.v3.RouteConfiguration", True),
            ],
        }
        for msg, fields in spec.items():
            m = f.message_type.add(name=msg)
            for fname, num, ftype, repeated in fields:
                fd = m.field.add(
                    name=fname, number=num, label=T.LABEL_REPEATED if repeated else T.LABEL_OPTIONAL
                )
                if ftype == "bytes":
                    fd.type = T.TYPE_BYTES
                elif ftype == "string":
                    fd.type = T.TYPE_STRING
                else:
                    fd.type, fd.type_name = T.TYPE_MESSAGE, ftype
        pool.Add(f)
    names = (
        "ExtensionResource",
        "PostRouteModifyRequest",
        "PostRouteModifyResponse",
        "PostClusterModifyRequest",
        "PostClusterModifyResponse",
        "PostVirtualHostModifyRequest",
        "PostVirtualHostModifyResponse",
        "PostHTTPListenerModifyRequest",
        "PostHTTPListenerModifyResponse",
        "PostEndpointsModifyRequest",
        "PostEndpointsModifyResponse",
        "PostTranslateModifyRequest",
        "PostTranslateModifyResponse",
    )
    return {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"envoygateway.extension.{n}"))
        for n in names
    }



MESSAGES = messages()
