"""Build the interop venvs: real vLLM releases whose own parser and config classes check the operator's flags.

One venv per release in :data:`kvfleet.operator.engines.VLLM_TESTED`, made with
``pip install vllm==X`` (vLLM and its whole dependency set, the CUDA build of torch included:
about 9-10 GB and 4 minutes each on this machine; vLLM runs on its CPU platform here), under
``$KVFLEET_CACHE/interop`` (default ``~/.cache/kvfleet/interop``), outside the repository:
built once per release, reused after (a stamp file marks a complete build).

    python scripts/interop_venvs.py build      # make interop
    python scripts/interop_venvs.py path 0.33.0
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvfleet.operator.engines import VLLM_TESTED  # noqa: E402

STAMP = ".kvfleet-interop"


def cache_root() -> Path:
    base = os.environ.get("KVFLEET_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfleet")
    return Path(base) / "interop"


def versions() -> list[str]:
    return [".".join(map(str, v)) for v in VLLM_TESTED]


def venv_dir(version: str) -> Path:
    return cache_root() / f"vllm-{version}"


def python(version: str) -> Path | None:
    """The interpreter of a complete venv for vLLM ``version``, None when it is not built."""
    d = venv_dir(version)
    return d / "bin" / "python" if (d / STAMP).exists() else None


def build(version: str) -> Path:
    if (found := python(version)) is not None:
        return found
    final, tmp = venv_dir(version), venv_dir(version).with_name(f"vllm-{version}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"interop: building vLLM {version} into {final} (once; about 4 minutes and 10 GB)", flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
    subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "--quiet", f"vllm=={version}"], check=True)
    (tmp / STAMP).write_text(f"vllm=={version} built in {time.monotonic() - t0:.0f} s\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    print(f"interop: vLLM {version} ready in {time.monotonic() - t0:.0f} s", flush=True)
    return final / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/interop_venvs.py", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("command", choices=["build", "path"])
    p.add_argument("version", nargs="?")
    args = p.parse_args(argv)
    if args.command == "build":
        for v in [args.version] if args.version else versions():
            build(v)
        return 0
    found = python(args.version or versions()[-1])
    if found is None:
        print("not built: python scripts/interop_venvs.py build", file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
