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
# The EPP's gRPC front (native/epp-front, Go) needs a Go toolchain: the base image's `go` when it has one,
# else golang.org/toolchain from the Go module proxy (GOPROXY), checked against the Go checksum database
# (native/fetch_go.py, standard library only). Its modules come from the proxy too, and are compiled, in a
# layer only native/epp-front/go.mod and go.sum invalidate. KVFLEET_REQUIRE_FRONT=1: no image without it.
ARG GO_VERSION=1.26.8
ARG GOPROXY=https://proxy.golang.org,direct
ENV GOPROXY=${GOPROXY} GOTOOLCHAIN=local GOPATH=/tmp/go GOCACHE=/tmp/go-build CGO_ENABLED=0 \
    KVFLEET_REQUIRE_FRONT=1
COPY native/fetch_go.py ./native/
COPY native/epp-front/go.mod native/epp-front/go.sum ./native/epp-front/
RUN if ! command -v go >/dev/null 2>&1; then python3 native/fetch_go.py /opt/go "${GO_VERSION}" \
      && ln -s /opt/go/bin/go /usr/local/bin/go; fi \
 && cd native/epp-front && go build -trimpath -o /dev/null google.golang.org/grpc google.golang.org/grpc/credentials \
      google.golang.org/grpc/metadata google.golang.org/grpc/status && go version
COPY native ./native
COPY README.md setup.py ./
COPY kvfleet ./kvfleet
# kvfleet's compiled C part (the EPP index's probe loop, plain C, no Python headers) is built with the
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
 && /opt/kvfleet/bin/kvfleet --version \
 && cd / && /opt/kvfleet/bin/python -c "import sys; from kvfleet.epp.front import front_program; sys.exit(front_program() is None)"

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
