"""The one compiled part of kvfleet: the EPP's hot loops (kvfleet/epp/_probe.c, the index's probes;
kvfleet/epp/_reuse.c, the per-pod reuse distance), plain C loaded with
ctypes (no Python headers needed). Everything else is in pyproject.toml. Any C compiler works: ``CC`` and
``LDSHARED`` choose one (the Dockerfile uses ``zig cc`` from PyPI where the base image has none)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvfleet.epp._probe",
            ["kvfleet/epp/_probe.c", "kvfleet/epp/_reuse.c"],
            # no contraction into FMA: the tier-weighted sums stay what the decision rules define
            extra_compile_args=["-O2", "-std=c11", "-ffp-contract=off"],
        )
    ]
)
