# One image for every kvfleet role: `kvfleet operator|epp|agent|engine`.
# Multi-stage: build wheels (kvfleet and its dependencies) in a full stage,
# install them into a slim stage that runs as a non-root user.
#   docker build -t kvfleet:dev .
#   docker build --build-arg BASE_IMAGE=my-registry/python:3.11-slim -t kvfleet:dev .
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvfleet ./kvfleet
RUN python -m pip wheel --wheel-dir /wheels .

FROM ${BASE_IMAGE} AS runtime
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 kvfleet \
 && useradd --system --uid 10001 --gid kvfleet --home-dir /home/kvfleet --create-home --shell /usr/sbin/nologin kvfleet
COPY --from=build /wheels /tmp/wheels
RUN python -m pip install --no-index --find-links /tmp/wheels kvfleet \
 && rm -rf /tmp/wheels \
 && kvfleet --version
USER 10001:10001
WORKDIR /home/kvfleet
# engine HTTP, KV events, transfer, operator liveness, EPP gRPC / health / metrics, agent metrics
EXPOSE 8000 5557 7000 8080 9002 9003 9090 9091
ENTRYPOINT ["kvfleet"]
CMD ["--help"]
