#!/usr/bin/env bash
# Build the kvfleet image and start every role in a container; check each one.
#
#   e2e/docker/smoke.sh BASE_IMAGE [TAG]
#
# BASE_IMAGE: a local image with python3 (>= 3.11) and its venv module, e.g.
# python:3.11-slim, or a Debian bookworm root filesystem made with debootstrap
# and `docker import` (see docs/operator.md, "Image"). TAG defaults to kvfleet:dev.
# Checks: `kvfleet --version`, `kvfleet operator --help`, the image's user is
# 10001 (non-root); the codec kernels (numba) compile and run on the read-only root;
# `kvfleet epp` (static pods file) answers gRPC health SERVING;
# `kvfleet engine` answers GET /health; `kvfleet agent` with
# KVFLEET_TRANSFER_SECRET serves /metrics and accepts TCP on its transfer port,
# and without the secret exits non-zero; `kvfleet operator` against the kmock
# API emulator (e2e/docker/operator_kmock.py) reconciles a KVCachePool.
# Containers run read-only, with every capability dropped and no new privileges
# (as the chart's securityContext asks); ports are published on 127.0.0.1 only. Host side: PYTHON (default
# .venv/bin/python) with grpcio (and kmock for the operator check). Every container started here is
# removed on exit.
set -euo pipefail

base=${1:?usage: e2e/docker/smoke.sh BASE_IMAGE [TAG]}
tag=${2:-kvfleet:dev}
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
prefix="kvfleet-smoke-$$"
work=$(mktemp -d)
containers=()

cleanup() {
    for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1 || true; done
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    for c in "${containers[@]}"; do
        echo "--- logs of $c" >&2
        docker logs --tail 40 "$c" >&2 || true
    done
    exit 1
}
ok() { echo "ok: $*"; }

# Chart-like hardening for every container started below.
hardened=(--read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges)

start() {  # start NAME PORT... -- DOCKER_RUN_ARGS... ; publishes each PORT on 127.0.0.1
    local name="$prefix-$1"; shift
    local publish=()
    while [[ $1 != -- ]]; do publish+=(-p "127.0.0.1::$1"); shift; done
    shift
    containers+=("$name")
    docker run -d --name "$name" "${hardened[@]}" "${publish[@]}" "$@" >/dev/null
}

host_port() {  # host_port NAME CONTAINER_PORT
    docker port "$prefix-$1" "$2/tcp" | head -n1 | sed 's/.*://'
}

wait_for() {  # wait_for NAME WHAT CHECK_KIND PORT [PATH]: poll up to 60 s, fail if the container died
    local name="$1" what="$2" kind="$3" port="$4" path="${5:-/}"
    for _ in $(seq 1 120); do
        if [[ $(docker inspect -f '{{.State.Running}}' "$prefix-$name") != true ]]; then
            fail "$what: container exited ($(docker inspect -f '{{.State.ExitCode}}' "$prefix-$name"))"
        fi
        if "$python" - "$kind" "$port" "$path" <<'EOF'
import socket
import sys
import urllib.request

kind, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    if kind == "tcp":
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    elif kind == "http":
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            body = r.read()
            assert r.status == 200 and body, r.status
            if path == "/metrics":
                assert b"# TYPE" in body, "not a Prometheus exposition"
    elif kind == "grpc-health":
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            # HealthCheckResponse{status: SERVING} is the two bytes 08 01.
            assert check(b"", timeout=2) == b"\x08\x01"
except Exception:
    sys.exit(1)
EOF
        then
            ok "$what"
            return 0
        fi
        sleep 0.5
    done
    fail "$what: no answer on 127.0.0.1:$port within 60 s"
}

echo "== build $tag from BASE_IMAGE=$base"
docker build --build-arg BASE_IMAGE="$base" -t "$tag" "$root"
size=$(docker image inspect -f '{{.Size}}' "$tag")
echo "image $tag: $((size / 1000000)) MB"

echo "== one-shot commands"
docker run --rm "${hardened[@]}" "$tag" --version | grep -q '^kvfleet ' || fail "kvfleet --version"
ok "kvfleet --version: $(docker run --rm "$tag" --version)"
docker run --rm "${hardened[@]}" "$tag" operator --help | grep -q -- '--' || fail "kvfleet operator --help"
ok "kvfleet operator --help"
for role in epp agent engine; do
    docker run --rm "${hardened[@]}" "$tag" "$role" --help >/dev/null || fail "kvfleet $role --help"
done
ok "kvfleet epp|agent|engine --help"
[[ $(docker image inspect -f '{{.Config.User}}' "$tag") == 10001:10001 ]] \
    || fail "image USER is not 10001:10001"
[[ $(docker run --rm --entrypoint id "$tag" -u) == 10001 ]] || fail "container does not run as uid 10001"
ok "runs as uid 10001 ($(docker run --rm --entrypoint id "$tag"))"
kernel_check='from kvfleet.agent.codecs import get_codec, warm_up
import numpy as np
assert warm_up(["fp8_e4m3", "int8", "int4"]), "numba kernels did not load"
x = np.random.default_rng(0).standard_normal(4096).astype(np.float16)
for name in ("fp8_e4m3", "int8", "int4"):
    c = get_codec(name)
    assert c.kernels and c.decode(c.encode(x), x.dtype, x.shape).shape == x.shape
print("ok")'
[[ $(docker run --rm "${hardened[@]}" --entrypoint /opt/kvfleet/bin/python "$tag" -c "$kernel_check") \
    == ok ]] \
    || fail "codec kernels do not compile on the read-only root"
ok "codec kernels (numba) compile and run on the read-only root"

echo "== epp"
mkdir -p "$work/epp"
cat >"$work/epp/config.yaml" <<'EOF'
epp:
  datastore: static
  pods_file: /etc/kvfleet/pods.yaml
EOF
cat >"$work/epp/pods.yaml" <<'EOF'
pools:
  - name: pool-a
    models: [llama-3-8b]
    pods:
      - {name: pod-0, address: 10.0.0.10, port: 8000, role: both}
      - {name: pod-1, address: 10.0.0.11, port: 8000, role: both}
EOF
chmod -R a+rX "$work/epp"
start epp 9002 9003 9090 -- -v "$work/epp:/etc/kvfleet:ro" "$tag" epp --config /etc/kvfleet/config.yaml
wait_for epp "epp gRPC health SERVING (:9003)" grpc-health "$(host_port epp 9003)"
wait_for epp "epp ext_proc port accepts TCP (:9002)" tcp "$(host_port epp 9002)"
wait_for epp "epp /metrics (:9090)" http "$(host_port epp 9090)" /metrics

echo "== engine"
start engine 8000 5557 -- "$tag" engine --host 0.0.0.0 --port 8000 --pod-name smoke-engine
wait_for engine "engine GET /health (:8000)" http "$(host_port engine 8000)" /health
wait_for engine "engine /metrics (:8000)" http "$(host_port engine 8000)" /metrics

echo "== agent"
start agent 7000 9091 -- -e KVFLEET_TRANSFER_SECRET=smoke-secret "$tag" agent
wait_for agent "agent /metrics (:9091)" http "$(host_port agent 9091)" /metrics
wait_for agent "agent transfer port accepts TCP (:7000)" tcp "$(host_port agent 7000)"
if docker run --rm "${hardened[@]}" "$tag" agent >"$work/nosecret.log" 2>&1; then
    fail "agent without KVFLEET_TRANSFER_SECRET should exit non-zero"
fi
ok "agent without a transfer secret exits non-zero: $(tail -n1 "$work/nosecret.log")"

echo "== operator (kopf) against the kmock API emulator"
if "$python" -c "import kmock" 2>/dev/null; then
    (cd "$root" && "$python" -m e2e.docker.operator_kmock "$tag") || fail "operator against kmock"
else
    echo "skip: operator against kmock (no kmock in $python; pip install -e '.[dev]')"
fi

for c in "${containers[@]}"; do
    [[ $(docker exec "$c" id -u) == 10001 ]] || fail "$c does not run as uid 10001"
done
ok "every role container runs as uid 10001"
echo "PASS: $tag ($((size / 1000000)) MB) built from $base; operator, epp, engine, agent checked"
