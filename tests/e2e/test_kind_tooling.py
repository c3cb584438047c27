"""The kind tooling's own logic, without Docker: the ``docker`` shim's rewrite of ``--privileged``,
the digests that decide what is rebuilt, and the pieces taken from kind's Go module (its entrypoint
and default CNI manifest) that e2e/kind/images.py patches or ships. ``make e2e-kind`` runs them for
real; these tests pin what it relies on."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from e2e.kind import images

SHIM = Path(images.HERE) / "shim" / "docker"


@pytest.fixture()
def fake_docker(tmp_path: Path) -> Path:
    """A ``docker`` that records its arguments, one per line, and knows one local image."""
    d = tmp_path / "bin"
    d.mkdir()
    log = tmp_path / "args"
    (d / "docker").write_text(f"""#!/bin/sh
if [ "$1 $2" = "image inspect" ]; then [ "$3" = local:img ] && exit 0; exit 1; fi
printf '%s\\n' "$@" > {log}
""")
    (d / "docker").chmod(0o755)
    return d


def _shim(fake: Path, *args: str) -> tuple[int, list[str]]:
    env = {**os.environ, "PATH": f"{SHIM.parent}:{fake}:/usr/bin:/bin"}
    r = subprocess.run([str(SHIM), *args], env=env, capture_output=True, text=True)
    log = fake.parent / "args"
    out = log.read_text().splitlines() if log.exists() else []
    if log.exists():
        log.unlink()
    return r.returncode, out


def test_shim_turns_privileged_into_every_capability_but_sys_resource(fake_docker: Path) -> None:
    rc, args = _shim(fake_docker, "run", "--name", "n", "--privileged", "-d", "img")
    assert rc == 0
    assert "--privileged" not in args
    assert args[:3] == ["run", "--name", "n"] and args[-2:] == ["-d", "img"]
    pairs = (["--cap-add", "ALL"], ["--cap-drop", "SYS_RESOURCE"], ["--security-opt", "seccomp=unconfined"],
             ["--security-opt", "systempaths=unconfined"], ["--device", "/dev/kmsg"])
    for pair in pairs:
        assert any(args[j:j + 2] == pair for j in range(len(args) - 1)), pair


def test_shim_passes_everything_else_through(fake_docker: Path) -> None:
    ps = ["ps", "-a", "--format", "{{.Names}}"]
    assert _shim(fake_docker, *ps) == (0, ps)
    # exec --privileged: dropped (the container's capability set applies)
    assert _shim(fake_docker, "exec", "--privileged", "c", "true") == (0, ["exec", "c", "true"])


def test_shim_pull_of_a_local_image_needs_no_registry(fake_docker: Path) -> None:
    assert _shim(fake_docker, "pull", "local:img") == (0, [])  # answered locally, never reached the CLI
    assert _shim(fake_docker, "pull", "remote:img") == (0, ["pull", "remote:img"])


def test_shim_without_a_real_docker_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{SHIM.parent}:{tmp_path}"}
    r = subprocess.run(["/bin/bash", str(SHIM), "ps"], env=env, capture_output=True, text=True)
    assert r.returncode == 127 and "no docker on PATH" in r.stderr


def test_digest_follows_every_input(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"a")
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x").write_text("1")
    base = images.digest("tag", f, d, ("x", 1))
    assert images.digest("tag", f, d, ("x", 1)) == base
    f.write_bytes(b"b")
    assert images.digest("tag", f, d, ("x", 1)) != base
    f.write_bytes(b"a")
    (d / "sub" / "x").write_text("2")
    assert images.digest("tag", f, d, ("x", 1)) != base
    (d / "sub" / "x").write_text("1")
    assert images.digest("tag", f, d, ("x", 2)) != base
    assert images.digest("tag", f, d, ("x", 1)) == base


def _kind_source() -> Path:
    if shutil.which("go") is None:
        pytest.skip("no go: kind's module cannot be read")
    return images.kind_source()


def test_kind_entrypoint_takes_the_unprivileged_node_fix_before_its_cgroup_setup() -> None:
    entry = (_kind_source() / "images/base/files/usr/local/bin/entrypoint").read_text()
    anchor = "\n# validate state\nvalidate_userns\n"
    assert anchor in entry
    assert entry.index(anchor) < entry.index("\nfix_cgroup\n")
    fix = (Path(images.HERE) / "node" / "unprivileged-node.sh").read_text()
    patched = entry.replace(anchor, fix + anchor, 1)
    r = subprocess.run(["bash", "-n"], input=patched, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_default_cni_manifest_runs_the_kindnetd_tag_the_node_image_holds() -> None:
    src = _kind_source() / "pkg/build/nodeimage/const_cni.go"
    manifest = images.default_cni_manifest()
    tag = images._go_const(src, "kindnetdImage")
    assert f"image: {tag}" in manifest and "` +" not in manifest
    assert "kind: DaemonSet" in manifest


def test_node_scripts_parse() -> None:
    for script in ("kindnetd", "kube-proxy", "base-setup.sh"):
        shell = "bash" if script == "kindnetd" else "sh"
        path = Path(images.HERE) / "node" / script
        r = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)


def test_missing_debootstrap_fails_before_the_go_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh machine without debootstrap hears so before the Go builds of the node programs (tens of
    minutes), not after them; with the Debian bases already built, debootstrap is not needed."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(images, "image_inputs", lambda tag: None)
    with pytest.raises(images.BuildError, match=r"debootstrap.*debian-tools"):
        images.check_debootstrap(set())
    with pytest.raises(images.BuildError, match="kvfleet-base"):
        images.check_debootstrap({"kvfleet"})
    monkeypatch.setattr(images, "image_inputs", lambda tag: "built")
    images.check_debootstrap(set())
    monkeypatch.setattr(images, "image_inputs", lambda tag: None)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/sbin/{name}")
    images.check_debootstrap(set())
