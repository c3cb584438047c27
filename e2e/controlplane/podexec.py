"""Start one container of a Pod for :mod:`e2e.controlplane.node`: mount its volumes, drop to its user, exec.

Run as ``unshare --mount --propagation private -- python -m e2e.controlplane.podexec SPEC.json``
(root, a private mount namespace of its own), where SPEC is what :class:`~e2e.controlplane.node.Node`
wrote: ``mounts`` (``{"target", "source"}`` bind mounts of prepared files and folders, or
``{"target", "tmpfs": size}``), ``keep`` (folders the container's programs live in, bound back
over any volume that hides them), ``uid``/``gid`` (the Pod's runAsUser/runAsGroup), ``env``, ``argv``
and ``cwd``. A target that does not exist is made: a missing folder is created on the host (empty;
the mount hides it from nobody else, as the mount is private), and a file target's folder is first
covered by a tmpfs, so that the host's folder is never written into.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path


def _mount(*args: str, fds: tuple[int, ...] = ()) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, pass_fds=fds)
    if result.returncode != 0:
        raise SystemExit(f"podexec: mount {' '.join(args)}: {result.stderr.strip()}")


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    covered: set[str] = set()
    targets = {m["target"] for m in spec["mounts"]}
    # Sources are opened before anything is mounted: a mount at /tmp (say) must not hide the
    # sources of the mounts after it. They are mounted from their descriptors.
    fds = {m["source"]: os.open(m["source"], os.O_PATH) for m in spec["mounts"] if "source" in m}
    # The programs the container runs (this checkout, its interpreter) stay where they are even
    # when a volume covers a folder above them (an emptyDir at /tmp over a checkout in /tmp).
    keep = {path: os.open(path, os.O_PATH) for path in spec.get("keep") or [] if os.path.isdir(path)}
    for m in sorted(spec["mounts"], key=lambda m: m["target"].count("/")):
        target = Path(m["target"])
        is_file = "source" in m and stat.S_ISREG(os.fstat(fds[m["source"]]).st_mode)
        if is_file:
            parent = str(target.parent)
            if not target.exists() and parent not in covered and parent not in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
                _mount("-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", parent)
                covered.add(parent)
            target.touch(exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
        if "tmpfs" in m:
            _mount("-t", "tmpfs", "-o", f"mode=1777,size={m['tmpfs']}", "tmpfs", str(target))
        else:
            fd = fds[m["source"]]
            _mount("--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", str(target), fds=(fd,))
            if m.get("readOnly"):
                _mount("-o", "remount,bind,ro", str(target))
    for path, fd in sorted(keep.items()):  # parents first
        try:
            visible = os.path.samestat(os.stat(path), os.fstat(fd))
        except OSError:
            visible = False
        if not visible:
            os.makedirs(path, exist_ok=True)
            _mount("--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", path, fds=(fd,))
    for fd in [*fds.values(), *keep.values()]:
        os.close(fd)
    os.chdir(spec.get("cwd") or "/")
    if spec.get("gid") is not None:
        os.setgroups([])
        os.setgid(int(spec["gid"]))
    if spec.get("uid") is not None:
        os.setuid(int(spec["uid"]))
    argv_ = list(spec["argv"])
    try:
        os.execvpe(argv_[0], argv_, dict(spec["env"]))
    except OSError as exc:
        print(f"podexec: cannot run {argv_[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
