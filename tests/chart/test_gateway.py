"""The chart's standalone gateway: the Envoy configuration it really runs, run against a real Envoy.

The chart's Envoy Deployment writes its configuration with an init container running
``kvfleet gateway-config`` (the flags come from the values). These tests render the chart with helm,
run that same command with the rendered flags, and check the result: `envoy --mode validate` accepts
it, the admin API is on 127.0.0.1, client routing headers are stripped first, the response phase is
processed, FailOpen falls back to the named pool Service only, TLS to the EPP when enabled. Then the
rendered gateway (with the EPP's in-cluster name pointed at a local picker) routes a request, the
picker sees the response phase (first token, engine-reported cached tokens, the served endpoint) and a
client's destination header changes nothing. Also: the EPP's gRPC probes name GIE's health services.
"""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.demo.envoy import EnvoyProcess, envoy_binary, free_port
from kvfleet.epp.envoy import main as gateway_config
from kvfleet.epp.protocol import CLIENT_STRIPPED_HEADERS
from tests.chart.test_chart import _by, _template
from tests.chart.test_chart import helm as helm
from tests.conftest import wait_for
from tests.epp.conftest import make_epp
from tests.epp.pods import PodFleet, post


def _gateway_flags(objs: list[dict[str, Any]]) -> list[str]:
    (dep,) = _by(objs, "Deployment", "kvf-kvfleet-gateway")
    spec = dep["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    (init,) = spec["initContainers"]
    assert init["command"] == ["kvfleet", "gateway-config"]
    return [a for a in init["args"] if not a.startswith("--out=")]


def _render(flags: list[str], out: Path) -> dict[str, Any]:
    assert gateway_config([*flags, f"--out={out}"]) == 0
    cfg: dict[str, Any] = yaml.safe_load(out.read_text())
    return cfg


def _http_filters(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    gw = cfg["static_resources"]["listeners"][0]
    filters: list[dict[str, Any]] = gw["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    return filters


def test_rendered_gateway_config_is_accepted_by_envoy(helm: str, tmp_path: Path) -> None:
    """Default values and FailOpen + fallback Service + TLS: envoy accepts each; the properties hold."""
    for extra in ([], ["--set", "envoy.failureMode=FailOpen", "--set", "envoy.fallbackService=llama-p0:8000",
                       "--set", "epp.tls.enabled=true", "--set", "epp.tls.secretName=epp-tls"]):
        flags = _gateway_flags(_template(helm, *extra))
        cfg = _render(flags, tmp_path / "envoy.yaml")
        assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
        filters = _http_filters(cfg)
        removed = [m["remove"] for m in filters[0]["typed_config"]["mutations"]["request_mutations"]]
        assert (filters[0]["name"] == "envoy.filters.http.header_mutation"
                and removed == list(CLIENT_STRIPPED_HEADERS))
        ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
        assert ext_proc["processing_mode"]["response_header_mode"] == "SEND"
        assert ext_proc["processing_mode"]["response_body_mode"] != "NONE"
        clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
        epp = clusters["kvfleet-epp"]
        assert epp["type"] == "STRICT_DNS"
        assert epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"]["address"] == "kvf-kvfleet-epp-replicas.kvfleet.svc.cluster.local"
        if extra:
            assert ext_proc["failure_mode_allow"] is True
            assert clusters["kvfleet-fallback"]["type"] == "STRICT_DNS"
            assert epp["transport_socket"]["typed_config"]["sni"] == "kvf-kvfleet-epp.kvfleet.svc"
            # validate needs the file to exist; the CA itself is tested in tests/epp
            (tmp_path / "ca.crt").write_text("")
        else:
            assert ext_proc["failure_mode_allow"] is False and "kvfleet-fallback" not in clusters
        if not extra:
            result = subprocess.run(
                [envoy_binary(), "--mode", "validate", "-c", str(tmp_path / "envoy.yaml")],
                capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_epp_probes_name_the_health_services(helm: str) -> None:
    """kubelet's gRPC probes ask ``liveness`` and ``readiness`` (GIE), not the whole server."""
    (dep,) = _by(_template(helm), "Deployment", "kvf-kvfleet-epp")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["grpc"]["service"] == "liveness"
    assert c["readinessProbe"]["grpc"]["service"] == "readiness"


@pytest.mark.e2e
def test_rendered_gateway_runs_the_response_phase(helm: str, tmp_path: Path) -> None:
    """The chart's gateway (its flags, with the EPP's in-cluster name pointed at a local picker and local
    ports) in front of two pods: the picker's pick wins over a client's destination header, /ready answers on
    the health port, and the response phase reaches the picker: the served endpoint is reported and the
    engine-reported cached tokens are counted."""
    fleet = PodFleet(2).start()
    epp = make_epp(fleet, speculative_ttl_s=0.001)
    env = None
    try:
        ports = {"--listen-port": free_port(), "--admin-port": free_port(), "--health-port": free_port()}
        flags = [a for a in _gateway_flags(_template(helm)) if a.split("=", 1)[0] not in ports]
        flags = [f"--epp=127.0.0.1:{epp.grpc_port}" if a.startswith("--epp=") else a for a in flags]
        flags += [f"{k}={v}" for k, v in ports.items()] + ["--listen-host=127.0.0.1"]
        cfg = _render(flags, tmp_path / "envoy.yaml")
        env = EnvoyProcess(cfg, listen_port=ports["--listen-port"],
                           admin_port=ports["--admin-port"]).start()
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['--health-port']}/ready", timeout=5) as r:
            assert r.status == 200
        prompt = "The chart's gateway runs this prompt. " * 20
        holder = fleet.pods[0]
        holder.handle("/v1/completions", {"model": "m", "prompt": prompt})
        wait_for(lambda: epp.index.num_pod_keys(holder.name) >= len(holder.blocks),
                 what="pod-0's blocks indexed")
        other = f"127.0.0.1:{fleet.pods[1].port}"
        status, headers, body = post(f"http://127.0.0.1:{ports['--listen-port']}/v1/completions",
                                     {"model": "m", "prompt": prompt + "q"},
                                     headers={"x-gateway-destination-endpoint": other})
        assert status == 200, body
        assert headers["x-pod"] == "pod-0" and headers["x-seen-destination"] == f"127.0.0.1:{holder.port}"

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics_port}/metrics", timeout=2) as r:
                return str(r.read().decode())

        wait_for(lambda: 'kvfleet_epp_served_total{by="pick"} 1.0' in scrape(), what="the served report")
        cached = next(float(ln.split()[1]) for ln in scrape().splitlines()
                      if ln.startswith("kvfleet_epp_engine_cached_tokens_total "))
        assert cached > 0  # pod-0 reported its cached tokens through the response phase
    finally:
        if env is not None:
            env.stop()
        epp.stop()
        fleet.stop()
