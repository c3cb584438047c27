"""Build the interop venvs: real vLLM and SGLang releases whose own parsers and config classes \
check the operator's flags.

One venv per release in :data:`kvfleet.operator.engines.VLLM_TESTED` and ``SGLANG_TESTED``, holding
``vllm==X`` / ``sglang==X`` and its dependencies (the CUDA build of torch included; they run on the CPU
here), under ``$KVFLEET_CACHE/interop`` (default ``~/.cache/kvfleet/interop``), outside the repository:
built once per release, reused after (a stamp file marks a complete build, a partial one is rebuilt; a
lock file keeps two builds from writing the folder at once).

They are made with uv (the ``dev`` extra installs it) from one package cache, ``interop/.uv-cache``, whose
files are hard-linked into the venvs: a wheel that two releases share (vLLM 0.11.0 and SGLang 0.5.3 the
same torch 2.8.0 and CUDA 12 libraries, vLLM 0.33.0 and SGLang 0.5.23 the same CUDA 13 libraries and
triton, most small dependencies) is on disk once. What the checks never load on the CPU is left out: the
GPU kernel and JIT packages in :data:`EXCLUDE` are not installed, and some files of the wheels that are
(:func:`prunable`: static libraries, cuDNN's sub-libraries, vLLM's FlashAttention kernels) are deleted
from the venvs and the cache. torch's CUDA build does not import without the nvidia-* libraries it links
(cuBLAS, cuDNN's ``libcudnn.so.9``, NCCL, ...): those stay.
Measured on this machine (2 cores, the package index on a fast mirror): the four take 13.2 GiB on disk
(``du -s`` of the folder, cache included; 43 GB as four full pip installs) and a cold build of all four
takes about 1½ minutes (uv downloads in parallel and links; pip took 4–21 minutes a release).

Without uv they are made with pip as before: every dependency, no shared files (about 10 GB and 4 minutes
each).

    python scripts/interop_venvs.py build               # make interop
    python scripts/interop_venvs.py path vllm 0.33.0
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvfleet.operator.engines import SGLANG_TESTED, VLLM_TESTED  # noqa: E402

STAMP = ".kvfleet-interop"

# Requirements added to a release's own: pip takes a yanked version that a dependency pins with ``==``, uv
# only one that is asked for directly.
EXTRA: dict[tuple[str, str], list[str]] = {
    ("sglang", "0.5.3"): ["transformers==4.57.0"],  # yanked; sglang 0.5.3 pins it
    # vLLM 0.11.0 asks for transformers>=4.56 with no upper bound, but its tokenizer cache reads attributes
    # transformers 5 removed (``all_special_tokens_extended``): it cannot load a tokenizer under 5.x
    ("vllm", "0.11.0"): ["transformers>=4.56,<5"],
}

# Dependencies not installed (with uv): GPU kernels, JIT compilers and CUDA libraries that the interop checks
# never load on the CPU (no file of theirs was opened in a traced ``make test-interop``; without them every
# check gives the same result and the suite passes). torch's CUDA build links most nvidia-* libraries and does
# not import without them: those stay.
_GPU_ONLY = ["tilelang", "z3-solver", "nvidia-nvvm", "nvidia-cuda-nvcc", "nccl-extensions", "numba",
             "llvmlite", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cusolver-cu12", "nvidia-cuda-nvrtc-cu12"]
EXCLUDE: dict[str, list[str]] = {
    "vllm": [*_GPU_ONLY, "xformers", "cupy-cuda12x", "flashinfer-python", "tokenspeed-triton",
             "nvidia-cutlass-dsl-libs-cu13", "pynvvideocodec", "nvidia-cudnn-frontend"],
    "sglang": [*_GPU_ONLY, "sgl-kernel", "sglang-kernel", "flashinfer-python", "nvidia-cutlass-dsl",
               "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13",
               "nvidia-mathdx", "nvshmem4py-cu13", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
               "deepseek-recipe", "pyarrow", "pandas"],
}


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


def requirements_of(engine: str, version: str) -> list[str]:
    return [f"{engine}=={version}", *EXTRA.get((engine, version), [])]


def python(engine: str, version: str) -> Path | None:
    """The interpreter of a complete venv for ``engine`` ``version``, None when it is not built (or was
    built for other requirements: its stamp's first words are the requirements it was built with)."""
    d = venv_dir(engine, version)
    try:
        stamp = (d / STAMP).read_text()
    except OSError:
        return None
    return d / "bin" / "python" if stamp.startswith(f"{' '.join(requirements_of(engine, version))} built") \
        else None


def uv_cache() -> Path:
    """uv's package cache, shared by the interop venvs: on their filesystem, as hard links need."""
    return cache_root() / ".uv-cache"


def uv_bin() -> str | None:
    """The uv executable: the ``uv`` package of this interpreter (the ``dev`` extra), else one on PATH."""
    try:
        import uv  # type: ignore[import-not-found,unused-ignore]

        found: str = uv.find_uv_bin()
        return found
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One build at a time over the whole interop folder (the venvs and the shared cache)."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with (cache_root() / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prunable(dirpath: str, name: str) -> bool:
    """Whether an installed file is one the checks never load: a static library (only builds link one),
    one of cuDNN's sub-libraries, which ``libcudnn.so.9`` (linked by torch; it stays) opens when a GPU runs
    cuDNN, or vLLM's FlashAttention kernels (``vllm/vllm_flash_attn/*.so``, 0.5–0.8 GB a release), which
    only its FlashAttention backend loads, on a GPU."""
    return (name.endswith(".a")
            or (name.startswith("libcudnn_") and dirpath.endswith(os.sep + "cudnn/lib"))
            or (name.endswith(".so") and dirpath.endswith(os.sep + os.path.join("vllm", "vllm_flash_attn"))))


def prune(*roots: Path) -> int:
    """Deletes the :func:`prunable` files under ``roots`` (a venv and the shared cache, where their other hard
    link is); how many."""
    n = 0
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                if prunable(dirpath, name) and not os.path.islink(path := os.path.join(dirpath, name)):
                    os.unlink(path)
                    n += 1
    return n


def install_uv(uv: str, venv: Path, engine: str, requirements: list[str]) -> None:
    """``requirements`` but :data:`EXCLUDE` into ``venv``, hard-linked from the shared cache. Resolved first
    into ``interop-lock.txt``, which also pins the build dependencies of any source distribution (a build
    environment of other versions would fill the cache with files no venv uses)."""
    cache = str(uv_cache())
    subprocess.run([uv, "venv", "--quiet", "--relocatable", "--python", sys.executable, str(venv)],
                   check=True)
    (venv / "interop-requirements.in").write_text("\n".join(requirements) + "\n")
    (venv / "interop-excludes.txt").write_text("\n".join(EXCLUDE.get(engine, [])) + "\n")
    py = ["--python", str(venv / "bin" / "python"), "--cache-dir", cache]
    subprocess.run([uv, "pip", "compile", "--quiet", *py, "--excludes", str(venv / "interop-excludes.txt"),
                    str(venv / "interop-requirements.in"), "-o", str(venv / "interop-lock.txt")], check=True)
    subprocess.run([uv, "pip", "sync", "--quiet", *py, "--link-mode", "hardlink",
                    "--build-constraints", str(venv / "interop-lock.txt"), str(venv / "interop-lock.txt")],
                   check=True)


def install_pip(venv: Path, requirements: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-cache-dir",
                    *requirements], check=True)


def build(engine: str, version: str) -> Path:
    if (found := python(engine, version)) is not None:
        return found
    with locked():
        if (found := python(engine, version)) is not None:  # built by another build while this one waited
            return found
        final = venv_dir(engine, version)
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        requirements = requirements_of(engine, version)
        uv = uv_bin()
        if uv is not None:
            print(f"interop: building {engine} {version} into {final} with uv (once; under a minute and up "
                  "to 7 GB, less where it shares files with the other interop venvs)", flush=True)
        else:
            print(f"interop: uv not found (pip install uv, or make venv): building {engine} {version} into "
                  f"{final} with pip, every dependency and no shared files (once; about 4 minutes and 9 GB)",
                  flush=True)
        t0 = time.monotonic()
        if uv is not None:
            install_uv(uv, tmp, engine, requirements)
        else:
            install_pip(tmp, requirements)
        prune(tmp, uv_cache())  # both hard links of a file: the venv's and the cache's
        (tmp / STAMP).write_text(f"{' '.join(requirements)} built in {time.monotonic() - t0:.0f} s"
                                 f" with {'uv' if uv else 'pip'}\n")
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
