# One image for every kvfleet role: `kvfleet operator|epp|agent|engine`.
# Multi-stage: the build stage builds the kvfleet wheel (and its dependencies'
# wheels) and installs them into a virtual environment at /opt/kvfleet; the
# runtime stage gets only that environment (no sources, no wheels, no build
# cache) and runs as the non-root user 10001.
#   docker build -t kvfleet:dev .
#   docker build --build-arg BASE_IMAGE=my-registry/python:3.11-slim -t kvfleet:dev .
# BASE_IMAGE needs Python >= 3.11 as `python3` with the `venv` module (and
# ensurepip), plus `groupadd`/`useradd`: python:3.11-slim, or Debian bookworm
# with python3 python3-venv. A virtual environment keeps Debian's own Python
# untouched (PEP 668), and both stages use the same base so its interpreter
# path matches. Works with the classic builder as well as BuildKit.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/kvfleet
WORKDIR /src
# The dependencies' wheels first, in a layer only pyproject.toml invalidates (an empty package
# stands in for kvfleet): a change of kvfleet's sources rebuilds from the next step on.
COPY pyproject.toml ./
RUN mkdir kvfleet && touch kvfleet/__init__.py README.md \
 && /opt/kvfleet/bin/pip wheel --wheel-dir /wheels '.[kernels]' \
 && rm -rf /wheels/kvfleet-*.whl kvfleet README.md build ./*.egg-info
COPY README.md setup.py ./
COPY kvfleet ./kvfleet
# kvfleet's one compiled part (the EPP index's probe loop, plain C, no Python headers) is built with the
# base image's C compiler, else with zig's (the ziglang wheel from PyPI, in a venv of this stage only),
# for the baseline CPU of the architecture. pip and setuptools leave the environment once kvfleet is in:
# nothing imports them at run time.
RUN if ! command -v cc >/dev/null 2>&1; then \
      python3 -m venv /opt/cc && /opt/cc/bin/pip install --quiet 'ziglang>=0.13,<1' \
      && zig="$(/opt/cc/bin/python -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')/zig" \
      && export CC="$zig cc -mcpu=baseline" LDSHARED="$zig cc -mcpu=baseline -shared"; \
    fi \
 && /opt/kvfleet/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/kvfleet/bin/pip install --no-index --find-links /wheels 'kvfleet[kernels]' \
 && /opt/kvfleet/bin/pip uninstall --yes pip setuptools \
 && /opt/kvfleet/bin/kvfleet --version

FROM ${BASE_IMAGE} AS runtime
# PATH spelled out: an imported base image (docker import) may carry no PATH at all.
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/kvfleet/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid kvfleet --home-dir /home/kvfleet --create-home --shell /usr/sbin/nologin kvfleet
COPY --from=build /opt/kvfleet /opt/kvfleet
RUN kvfleet --version
USER 10001:10001
WORKDIR /home/kvfleet
LABEL org.opencontainers.image.title="kvfleet" \
      org.opencontainers.image.description="kvfleet: operator, EPP, node agent and engine simulator in one image"
# engine HTTP, KV events, transfer, operator liveness, EPP gRPC / health / metrics, agent metrics
EXPOSE 8000 5557 5558 5559 5560 7000 8080 9002 9003 9090 9091
ENTRYPOINT ["kvfleet"]
CMD ["--help"]
