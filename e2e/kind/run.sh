#!/usr/bin/env bash
# kind end-to-end: create a cluster, build and load the image, install the chart
# with values-kind.yaml, apply two sample KVCachePools (sim engines), wait for
# Ready, send requests through the Envoy gateway, assert prefix-aware routing
# and the P/D path, tear down. Needs docker, kind, kubectl, helm on PATH (or in
# .tools/bin: python scripts/fetch_tools.py provides helm and kubectl).
#   e2e/kind/run.sh            # KEEP=1 keeps the cluster afterwards
# The node image is pinned (NODE_IMAGE, Kubernetes 1.34 like the test control plane;
# the chart needs >= 1.29); each run builds its own image tag, so a rerun on a kept
# cluster rolls every pod onto the new build; on failure the cluster's state and
# logs are saved under e2e-logs/ (LOGS=DIR to choose).
# The same checks run without kind against a real API server and a node that runs
# the pods on this machine: make test-cluster (tests/cluster/test_serving.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.tools/bin:$PATH"
CLUSTER=${CLUSTER:-kvfleet-e2e}
NS=${NS:-kvfleet}
NODE_IMAGE=${NODE_IMAGE:-kindest/node:v1.34.0}
TAG=${TAG:-e2e-$(git rev-parse --short HEAD 2>/dev/null || echo local)-$(date +%s)}
IMAGE=kvfleet:$TAG
LOGS=${LOGS:-e2e-logs/$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python3}
PF_PID=""

for tool in docker kind kubectl helm "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: '$tool' not found on PATH" >&2; exit 2; }
done

teardown() {
  local rc=$?
  [[ -n "$PF_PID" ]] && kill "$PF_PID" 2>/dev/null || true
  if [[ $rc -ne 0 ]] && kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    echo "e2e-kind failed ($rc): saving the cluster's state and logs to $LOGS" >&2
    mkdir -p "$LOGS"
    kubectl -n "$NS" get all,kvcachepools,inferencepools,events -o wide > "$LOGS/objects.txt" 2>&1 || true
    kubectl cluster-info dump --namespaces "$NS" --output-directory "$LOGS/dump" > /dev/null 2>&1 || true
    kind export logs "$LOGS/kind" --name "$CLUSTER" > /dev/null 2>&1 || true
  fi
  if [[ "${KEEP:-0}" != "1" ]]; then kind delete cluster --name "$CLUSTER" || true; fi
  exit $rc
}
trap teardown EXIT

step() { echo; echo "== $*"; }

step "cluster"
kind get clusters | grep -qx "$CLUSTER" \
  || kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config e2e/kind/cluster.yaml --wait 120s

step "image"
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

step "chart"
helm upgrade --install kvfleet charts/kvfleet --namespace "$NS" --create-namespace \
  -f charts/kvfleet/values-kind.yaml --set image.tag="$TAG" --wait --timeout 5m

step "KVCachePools"
kubectl -n "$NS" apply -f e2e/kind/kvcachepool.yaml
kubectl -n "$NS" wait --for=condition=Ready kvcachepool/sim-unified kvcachepool/sim-pd --timeout=300s
kubectl -n "$NS" get kvcachepools,inferencepools,deployments,pods -o wide

step "traffic through the Envoy gateway"
kubectl -n "$NS" port-forward svc/kvfleet-gateway 18080:80 >/tmp/kvfleet-pf.log 2>&1 &
PF_PID=$!
for _ in $(seq 1 50); do (echo > /dev/tcp/127.0.0.1/18080) 2>/dev/null && break; sleep 0.2; done
"$PYTHON" e2e/kind/check.py --url http://127.0.0.1:18080 --namespace "$NS"

step "passed"
