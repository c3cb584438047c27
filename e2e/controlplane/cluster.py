"""Build and run a real Kubernetes control plane on loopback, the way envtest does.

* :func:`build` compiles ``etcd`` (a small main on etcd's ``embed`` package, ``etcd/main.go``),
  ``kube-apiserver`` and ``kube-controller-manager`` from the Go module in this folder, which
  pins one Kubernetes release (``go.mod``). Binaries, the Go module cache and the Go build
  cache live outside the repository, under :func:`cache_root` (``~/.cache/kvfleet/controlplane``
  unless ``KVFLEET_CACHE`` or ``XDG_CACHE_HOME`` say otherwise), in a folder keyed by the pin
  and a digest of the Go inputs: a build happens once per pin, a changed pin builds afresh and
  removes the old binaries. Builds take a file lock, so concurrent test runs build once.
* :class:`ControlPlane` starts the three on 127.0.0.1 with fresh credentials made by the
  ``openssl`` CLI: a CA, the API server's serving certificate, client certificates for an
  admin (``system:masters``) and for the controller manager, and the service-account signing
  key. Authorization is ``Node,RBAC``; admission is the default set (``ServiceAccount``,
  ``PodSecurity``, ``NamespaceLifecycle``, ``LimitRanger``, ``ResourceQuota``, ...) plus
  ``NodeRestriction`` and ``OwnerReferencesPermissionEnforcement``. The controller manager runs
  every default controller with a service account per controller (garbage collection,
  Deployments → ReplicaSets → Pods, service accounts and their root CA ConfigMap, namespaces).
  No scheduler and no kubelet: Pods stay Pending. :attr:`ControlPlane.kubeconfig` is an admin
  kubeconfig for kubectl, helm, kopf and the kubernetes client. :meth:`ControlPlane.stop` ends
  each process group (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
#: Everything a build depends on: change one and the binaries are rebuilt.
GO_INPUTS = ("go.mod", "go.sum", "etcd/main.go")
PACKAGES = ("./etcd", "k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes/cmd/kube-controller-manager")
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
SERVICE_CIDR = "10.96.0.0/16"
#: The ``kubernetes`` Service's address for Pods run by :mod:`e2e.controlplane.node` (a loopback
#: forwarder to the API server stands for its ClusterIP); named in the serving certificate.
API_SERVICE_ADDRESS = "127.0.10.1"
ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMISSION = (
    "NamespaceLifecycle,LimitRanger,ServiceAccount,NodeRestriction,PodSecurity,Priority,"
    "DefaultTolerationSeconds,DefaultStorageClass,StorageObjectInUseProtection,RuntimeClass,ResourceQuota,"
    "OwnerReferencesPermissionEnforcement,"
    "MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook"
)


class Unavailable(RuntimeError):
    """The control plane cannot be built or started on this machine (the message says why)."""


def _require(go_mod: str, module: str) -> str:
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", go_mod, re.MULTILINE)
    if not m:
        raise Unavailable(f"{HERE / 'go.mod'} does not require {module}")
    return m.group(1)


def pins() -> dict[str, str]:
    """The pinned versions, read from go.mod: ``{"kubernetes": "v1.34.12", "etcd": "v3.6.4"}``."""
    text = (HERE / "go.mod").read_text()
    return {"kubernetes": _require(text, "k8s.io/kubernetes"),
            "etcd": _require(text, "go.etcd.io/etcd/server/v3")}


def _ldflags(version: str) -> str:
    """Stamp the release into the binaries as Kubernetes' own build does (``kubectl version``,
    ``.Capabilities.KubeVersion`` in helm and discovery all read it)."""
    m = re.match(r"v(\d+)\.(\d+)\.", version)
    if not m:
        raise Unavailable(f"cannot read a Kubernetes version from {version!r}")
    major, minor = m.groups()
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.gitVersion={version}", f"-X {pkg}.gitMajor={major}",
                  f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean",
                  f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return " ".join(flags)


def cache_root() -> Path:
    base = os.environ.get("KVFLEET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfleet")
    return Path(base) / "controlplane"


def build_key() -> str:
    """``<kubernetes version>-<digest of the Go inputs and build flags>``: the binaries' folder name."""
    version = pins()["kubernetes"]
    h = hashlib.sha256(_ldflags(version).encode())
    for name in GO_INPUTS:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    return f"{version}-{h.hexdigest()[:12]}"


@dataclass(frozen=True)
class Binaries:
    dir: Path

    def __getitem__(self, name: str) -> str:
        return str(self.dir / name)

    def present(self) -> bool:
        return all(os.access(self.dir / b, os.X_OK) for b in BINARIES) and (self.dir / "build.json").exists()

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = json.loads((self.dir / "build.json").read_text())
        return info


def binaries() -> Binaries:
    return Binaries(cache_root() / build_key() / "bin")


def go_env() -> dict[str, str]:
    """The environment of every go command: caches under :func:`cache_root`, no toolchain download, no cgo."""
    root = cache_root() / "go"
    return {**os.environ, "GOMODCACHE": str(root / "mod"), "GOCACHE": str(root / "build"),
            "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(log: Callable[[str], None] = print) -> Binaries:
    """The pinned binaries, built first when this pin has none yet (minutes cold; instant after)."""
    out = binaries()
    if out.present():
        return out
    go = shutil.which("go")
    if go is None:
        raise Unavailable("no `go` on PATH: the control plane is built from Kubernetes' Go modules "
                          "(Go >= 1.25 and the Go module proxy)")
    with _locked(cache_root() / "build.lock"):
        if out.present():  # built by a concurrent run while this one waited
            return out
        version = pins()["kubernetes"]
        tmp = out.dir.parent / f"bin.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        log(f"building etcd, kube-apiserver, kube-controller-manager {version} into {out.dir} "
            "(once per pin; minutes on a cold cache)")
        t0 = time.monotonic()
        cmd = [go, "build", "-trimpath", "-ldflags", _ldflags(version), "-o", str(tmp) + "/", *PACKAGES]
        result = subprocess.run(cmd, cwd=HERE, env=go_env(), capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Unavailable(f"go build of the control plane failed (exit {result.returncode}):\n"
                              f"{result.stderr[-4000:]}")
        go_version = subprocess.run([go, "env", "GOVERSION"], env=go_env(), capture_output=True,
                                    text=True).stdout.strip()
        (tmp / "build.json").write_text(json.dumps({
            **pins(), "go": go_version, "seconds": round(time.monotonic() - t0, 1),
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")
        shutil.rmtree(out.dir, ignore_errors=True)
        tmp.rename(out.dir)
        for old in out.dir.parent.parent.iterdir():  # binaries of other pins: replaced by this one
            if old.is_dir() and old != out.dir.parent and old.name.startswith("v"):
                shutil.rmtree(old, ignore_errors=True)
        log(f"built in {time.monotonic() - t0:.0f} s")
    return out


# -- credentials ---------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise Unavailable(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _cert(pki: Path, name: str, subject: str, ext: str) -> None:
    """An EC P-256 key and a certificate for it signed by pki/ca.{crt,key}."""
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
    (pki / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "30", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki)


def make_pki(pki: Path) -> None:
    """CA, serving certificate (127.0.0.1, localhost, the in-cluster names), admin and controller-manager
    client certificates, and the RSA service-account signing key pair."""
    if shutil.which("openssl") is None:
        raise Unavailable("no `openssl` on PATH (it makes the control plane's certificates)")
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "30", "-subj", "/CN=kvfleet-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=pki)
    client = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"
    _cert(pki, "apiserver", "/CN=kube-apiserver",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
          "extendedKeyUsage=serverAuth\n"
          f"subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:{API_SERVICE_ADDRESS},DNS:localhost,DNS:kubernetes,"
          "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n")
    _cert(pki, "admin", "/O=system:masters/CN=kvfleet-admin", client)
    _cert(pki, "controller-manager", "/CN=system:kube-controller-manager", client)
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict[str, str],
                     name: str = "kvfleet-test") -> Path:
    """A kubeconfig naming its certificate files by path (``user``: client-certificate/client-key, or token).

    Paths rather than ``*-data``: every client reads them alike (kubectl, helm, the kubernetes
    client, kopf and the operator's own API client, which takes kopf's ``ca_path``/``certificate_path``)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": name, "preferences": {},
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": "default"}}],
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the control plane ----------------------------------------------------------------------------


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    logfile: IO[bytes]


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager in ``workdir`` (certificates, data, logs)."""

    workdir: Path
    bins: Binaries = field(default_factory=build)
    server: str = ""
    kubeconfig: Path = field(init=False)
    startup_s: dict[str, float] = field(default_factory=dict)
    _procs: list[_Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.pki = self.workdir / "pki"

    # processes

    def _spawn(self, name: str, args: list[str]) -> _Proc:
        log = self.workdir / f"{name}.log"
        logfile = log.open("ab")
        popen = subprocess.Popen([self.bins[name], *args], stdin=subprocess.DEVNULL, stdout=logfile,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd=self.workdir)
        proc = _Proc(name, popen, log, logfile)
        self._procs.append(proc)
        return proc

    def _tail(self, proc: _Proc, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(proc.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def check(self) -> None:
        """Raise when a component has exited (with the end of its log)."""
        for p in self._procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; end of {p.log}:\n"
                                   f"{self._tail(p)}")

    def _wait(self, what: str, probe: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                if probe():
                    return
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name} ({p.log})\n{self._tail(p, 15)}" for p in self._procs)
                raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s\n{logs}")
            time.sleep(0.2)

    # API access as the admin (for readiness checks; tests use kubectl/helm/clients with the kubeconfig)

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def request(self, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> Any:
        """One JSON request as the admin; raises urllib.error.HTTPError on >= 400."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self._ssl(), timeout=timeout_s) as resp:
            raw = resp.read()
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()

    def _exists(self, path: str) -> bool:
        try:
            self.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403, 404):
                return False
            raise
        return True

    # lifecycle

    def start(self, timeout_s: float = 180.0) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        make_pki(self.pki)
        self.startup_s["pki"] = time.monotonic() - t0
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s["total"] = time.monotonic() - t0
        return self

    def _start(self, timeout_s: float) -> None:
        pki = self.pki
        etcd_port, peer_port, api_port, kcm_port = (_free_port() for _ in range(4))
        t = time.monotonic()
        self._spawn("etcd", [f"--data-dir={self.workdir / 'etcd'}",
                             f"--listen-client-url=http://127.0.0.1:{etcd_port}",
                             f"--listen-peer-url=http://127.0.0.1:{peer_port}"])

        def etcd_healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2) as r:
                return bool(json.loads(r.read()).get("health") == "true")

        self._wait("etcd", etcd_healthy, timeout_s)
        self.startup_s["etcd"] = time.monotonic() - t

        t = time.monotonic()
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-issuer={ISSUER}", f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", f"--enable-admission-plugins={ADMISSION}",
            "--allow-privileged=false", "--profiling=false", "--v=1",
        ])
        write_kubeconfig(self.kubeconfig, self.server, pki / "ca.crt",
                         {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")})
        self._wait("kube-apiserver", lambda: self.request("GET", "/readyz") == "ok", timeout_s)
        self.startup_s["kube-apiserver"] = time.monotonic() - t

        t = time.monotonic()
        kcm_kubeconfig = write_kubeconfig(self.workdir / "controller-manager.kubeconfig", self.server,
                                          pki / "ca.crt",
                                          {"client-certificate": str(pki / "controller-manager.crt"),
                                           "client-key": str(pki / "controller-manager.key")})
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={kcm_kubeconfig}", f"--authentication-kubeconfig={kcm_kubeconfig}",
            f"--authorization-kubeconfig={kcm_kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--cluster-name=kvfleet-test", "--profiling=false", "--v=1",
        ])
        # Ready for tests once the service-account controllers run: Pods can only be admitted
        # (ServiceAccount admission) in a namespace whose "default" ServiceAccount exists.
        self._wait("kube-controller-manager",
                   lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default")
                   and self._exists("/api/v1/namespaces/default/configmaps/kube-root-ca.crt"), timeout_s)
        self.startup_s["kube-controller-manager"] = time.monotonic() - t

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM each process group (controller manager, API server, etcd), SIGKILL what outlives
        ``grace_s``."""
        for p in reversed(self._procs):
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
                try:
                    p.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait(5)
            p.logfile.close()
        self._procs.clear()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # credentials for other identities

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path,
                                   expiration_s: int = 3600) -> Path:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` (a TokenRequest token)."""
        review = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                              {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                               "spec": {"expirationSeconds": expiration_s}})
        return write_kubeconfig(path, self.server, self.pki / "ca.crt", {"token": review["status"]["token"]},
                                name=f"{namespace}-{name}")


def du(path: Path) -> int:
    """Bytes on disk under ``path`` (0 when absent)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


@contextlib.contextmanager
def running(workdir: Path | None = None) -> Iterator[ControlPlane]:
    """Build if needed, start, yield, stop (and remove a temporary workdir)."""
    bins = build()
    with contextlib.ExitStack() as stack:
        wd = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfleet-cp-")))
        cp = stack.enter_context(ControlPlane(wd, bins))
        yield cp
