#!/usr/bin/env bash
# kind end-to-end: create a cluster, build and load the image, install the chart
# with values-kind.yaml, apply two sample KVCachePools (sim engines), wait for
# Ready, send requests through the Envoy gateway, assert prefix-aware routing
# and the P/D path, tear down. Needs docker, kind, kubectl, helm on PATH (or in
# .tools/bin: python scripts/fetch_tools.py provides helm and kubectl).
#   e2e/kind/run.sh            # KEEP=1 keeps the cluster afterwards
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.tools/bin:$PATH"
CLUSTER=${CLUSTER:-kvfleet-e2e}
NS=${NS:-kvfleet}
IMAGE=kvfleet:dev
PYTHON=${PYTHON:-python3}
PF_PID=""

for tool in docker kind kubectl helm "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: '$tool' not found on PATH" >&2; exit 2; }
done

teardown() {
  [[ -n "$PF_PID" ]] && kill "$PF_PID" 2>/dev/null || true
  if [[ "${KEEP:-0}" != "1" ]]; then kind delete cluster --name "$CLUSTER" || true; fi
}
trap teardown EXIT

step() { echo; echo "== $*"; }

step "cluster"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --config e2e/kind/cluster.yaml --wait 120s

step "image"
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

step "chart"
helm upgrade --install kvfleet charts/kvfleet --namespace "$NS" --create-namespace \
  -f charts/kvfleet/values-kind.yaml --wait --timeout 5m

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
