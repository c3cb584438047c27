"""Build the interop venvs: real vLLM and SGLang releases whose own parsers and config classes \
check the operator's flags.

One venv per release in :data:`kvfleet.operator.engines.VLLM_TESTED` and ``SGLANG_TESTED``, made with
``pip install vllm==X`` / ``sglang==X`` (the engine and its whole dependency set, the CUDA build of
torch included: about 10 GB and 4 minutes each on this machine; they run on the CPU here), under
``$KVFLEET_CACHE/interop`` (default ``~/.cache/kvfleet/interop``), outside the repository: built once
per release, reused after (a stamp file marks a complete build).

    python scripts/interop_venvs.py build               # make interop
    python scripts/interop_venvs.py path vllm 0.33.0
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

from kvfleet.operator.engines import SGLANG_TESTED, VLLM_TESTED  # noqa: E402

STAMP = ".kvfleet-interop"


def cache_root() -> Path:
    base = os.environ.get("KVFLEET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfleet")
    return Path(base) / "interop"


def releases() -> list[tuple[str, str]]:
    """(engine, version) of every interop venv."""
    return ([("vllm", ".".join(map(str, v))) for v in VLLM_TESTED]
            + [("sglang", ".".join(map(str, v))) for v in SGLANG_TESTED])


def venv_dir(engine: str, version: str) -> Path:
    return cache_root() / f"{engine}-{version}"


def python(engine: str, version: str) -> Path | None:
    """The interpreter of a complete venv for ``engine`` ``version``, None when it is not built."""
    d = venv_dir(engine, version)
    return d / "bin" / "python" if (d / STAMP).exists() else None


def build(engine: str, version: str) -> Path:
    if (found := python(engine, version)) is not None:
        return found
    final = venv_dir(engine, version)
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"interop: building {engine} {version} into {final} (once; about 4 minutes and 10 GB)", flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
    subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-cache-dir",
                    f"{engine}=={version}"], check=True)
    (tmp / STAMP).write_text(f"{engine}=={version} built in {time.monotonic() - t0:.0f} s\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    print(f"interop: {engine} {version} ready in {time.monotonic() - t0:.0f} s", flush=True)
    return final / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/interop_venvs.py",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("command", choices=["build", "path"])
    p.add_argument("engine", nargs="?", choices=["vllm", "sglang"])
    p.add_argument("version", nargs="?")
    args = p.parse_args(argv)
    wanted = [(e, v) for e, v in releases() if (args.engine in (None, e)) and (args.version in (None, v))]
    if not wanted:
        print(f"no interop release {args.engine} {args.version}; known: {releases()}", file=sys.stderr)
        return 2
    if args.command == "build":
        for engine, version in wanted:
            build(engine, version)
        return 0
    found = python(*wanted[-1])
    if found is None:
        print("not built: python scripts/interop_venvs.py build", file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
