"""kvfleet's compiled parts; everything else is in pyproject.toml.

* The EPP's hot loops (kvfleet/epp/_probe.c, the index's probes; kvfleet/epp/_spec.c, its speculative
  entries; kvfleet/epp/_reuse.c, the per-pod reuse distance) and the block digests (kvfleet/cache/_digest.c,
  xxh3 of every block of a prompt; the vendored native/xxhash/xxhash.h) and the KV-event batch scanner
  (kvfleet/cache/_events.c): plain C loaded with ctypes (no Python headers needed). Any C compiler works:
  ``CC`` and ``LDSHARED`` choose one (the Dockerfile uses ``zig cc`` from PyPI where the base image has none).
* The EPP's gRPC front (native/epp-front, Go: ``kvfleet-epp-front``, kvfleet/epp/front.py), built with ``go``
  from PATH into ``kvfleet/epp/bin/`` (modules from the Go module proxy, ``GOPROXY``). Without ``go`` it is
  skipped with a warning and the EPP serves ext_proc with Python's grpc.aio; ``KVFLEET_REQUIRE_FRONT=1``
  (the Dockerfile) makes its absence an error instead.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FRONT_SRC = Path(__file__).parent / "native" / "epp-front"
FRONT = "kvfleet-epp-front"


class BuildWithFront(build_ext):
    """build_ext, then ``go build`` of the EPP's gRPC front next to the built package."""

    def run(self) -> None:
        super().run()
        out = (Path("kvfleet") if self.inplace else Path(self.build_lib) / "kvfleet") / "epp" / "bin" / FRONT
        go = shutil.which("go")
        if go is None:
            msg = (f"{FRONT}: no `go` on PATH: the EPP will serve ext_proc with grpc.aio "
                   "(≈ 1.6 × the CPU per decision); install Go >= 1.21 (it fetches the toolchain "
                   "native/epp-front/go.mod names) to build it")
            if os.environ.get("KVFLEET_REQUIRE_FRONT") == "1":
                sys.exit(f"error: {msg}")
            print(f"warning: {msg}", file=sys.stderr)
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly"}
        subprocess.run([go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(out.resolve()), "."],
                       cwd=FRONT_SRC, env=env, check=True)


setup(
    cmdclass={"build_ext": BuildWithFront},
    ext_modules=[
        Extension(
            "kvfleet.epp._probe",
            ["kvfleet/epp/_probe.c", "kvfleet/epp/_reuse.c", "kvfleet/epp/_spec.c"],
            # no contraction into FMA: the tier-weighted sums stay what the decision rules define
            extra_compile_args=["-O2", "-std=c11", "-ffp-contract=off"],
        ),
        Extension("kvfleet.cache._events", ["kvfleet/cache/_events.c"], extra_compile_args=["-O3", "-std=c11"]),
        Extension(
            "kvfleet.cache._digest",
            ["kvfleet/cache/_digest.c"],
            include_dirs=["native/xxhash"],  # vendored xxhash.h (native/xxhash/README.md)
            extra_compile_args=["-O2", "-std=c11"],
        ),
    ],
)
