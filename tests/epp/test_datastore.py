"""Where pods come from: the static YAML (validation, reload, listeners), Kubernetes objects → pools,
and model-server metrics (parsing vLLM names, staleness)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.epp.datastore import Pod, StaticDatastore
from kvfleet.epp.errors import DatastoreError
from kvfleet.epp.kube import pools_from_objects
from kvfleet.epp.podmetrics import MetricsStore, PodMetrics, parse_metrics

POOLS = {"pools": [{"name": "a", "models": ["m"],
                    "pods": [{"name": "p0", "address": "10.0.0.1", "port": 8000}]}]}


class TestStatic:
    def test_reload_notifies_listeners(self, tmp_path: Path) -> None:
        """Editing the file adds and removes pods; listeners hear of both; a bad edit keeps the old pools."""
        f = tmp_path / "pods.yaml"
        f.write_text(yaml.safe_dump(POOLS))
        ds = StaticDatastore(f)
        seen: list[tuple[list[str], list[str]]] = []
        ds.subscribe(lambda add, gone: seen.append(([p.name for p in add], [p.name for p in gone])))
        assert seen == [(["p0"], [])]
        data: dict[str, Any] = yaml.safe_load(f.read_text())
        data["pools"][0]["pods"] = [{"name": "p1", "address": "10.0.0.2", "port": 8000}]
        f.write_text(yaml.safe_dump(data))
        assert ds.reload(force=True)
        assert seen[-1] == (["p1"], ["p0"])
        f.write_text("pools: [{name: a, pods: [{name: x}]}]")
        with pytest.raises(DatastoreError):
            ds.reload(force=True)
        assert [p.name for p in ds.pools()[0].pods] == ["p1"]

    @pytest.mark.parametrize(
        "data",
        [
            {},
            {"pools": [{"models": ["m"]}]},
            {"pools": [{"name": "a", "pods": [{"name": "x", "address": "h", "port": "eighty"}]}]},
            {"pools": [{"name": "a", "pods": [{"name": "x", "address": "h", "port": 1, "role": "chef"}]}]},
            {"pools": [{"name": "a", "pods": [{"name": "x", "address": "h", "port": 1, "typo": 1}]}]},
            {"pools": [{"name": "a", "weight": 0}]},
            {"pools": [{"name": "a", "pods": [{"name": "x", "address": "h", "port": 1},
                                              {"name": "x", "address": "h", "port": 2}]}]},
        ],
    )
    def test_invalid_configs_name_the_entry(self, data: Any) -> None:
        with pytest.raises(DatastoreError) as ei:
            StaticDatastore(data=data)
        assert "pools" in str(ei.value) or "mapping" in str(ei.value)


def _pod(
    name: str, labels: dict[str, str], ready: bool = True, ip: str = "10.1.0.1",
    ann: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels, "annotations": ann or {}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class TestKubernetesMapping:
    def test_inference_pool_selects_pods(self) -> None:
        """matchLabels select pods; targetPorts give the port; annotations give models, weight and event
        ports."""
        ip = {
            "metadata": {"name": "pool", "namespace": "ns",
                         "annotations": {"kvfleet.io/models": "llama, qwen", "kvfleet.io/weight": "2"}},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]},
        }
        pods = [
            _pod("a", {"app": "vllm", "kvfleet.io/role": "prefill"},
                 ann={"kvfleet.io/kv-replay-port": "5558"}),
            _pod("b", {"app": "vllm"}, ready=False, ip="10.1.0.2"),
            _pod("c", {"app": "other"}),
        ]
        (pool,) = pools_from_objects([ip], pods)
        assert pool.models == ("llama", "qwen") and pool.weight == 2.0
        assert [p.name for p in pool.pods] == ["a", "b"]
        a, b = pool.pods
        assert a == Pod(name="a", address="10.1.0.1", port=8000, pool="pool", role="prefill", events="tcp://10.1.0.1:5557",
                        replay="tcp://10.1.0.1:5558", metrics="http://10.1.0.1:8000/metrics", ready=True)
        assert not b.ready

    def test_pool_without_models_annotation_serves_every_model(self) -> None:
        ip = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"selector": {"matchLabels": {"x": "y"}}}}
        assert pools_from_objects([ip], [])[0].models == ("*",)


class TestPodMetrics:
    TEXT = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 3\n'
        'vllm:num_requests_running{model_name="m"} 5\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.42\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"} 1\n'
    )

    def test_parse_vllm_names(self) -> None:
        m = parse_metrics(self.TEXT, now=1.0)
        assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_gpu_blocks) == (3, 5, 0.42, 16, 2048)

    def test_only_the_families_read_are_parsed(self) -> None:
        """Around the families read: a histogram, names that start like theirs, a malformed line of another
        family, HELP text, CRLF. The gauges read the same as alone; the names that merely start alike are
        not summed in; the malformed line does not spoil the scrape. A malformed line of a family read
        still does."""
        noise = (
            "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.\n"
            "# TYPE vllm:e2e_request_latency_seconds histogram\n"
            + "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{b}",model_name="m"}} {i}\n'
                      for i, b in enumerate(("0.3", "0.5", "+Inf")))
            + "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 40\r\n"
            "vllm:num_requests_running_total 9\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting (gauge).\n"
            "some_other_family{broken 1 2 3\n"
        )
        m = parse_metrics(noise + self.TEXT + noise, now=1.0)
        assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_gpu_blocks) == (3, 5, 0.42, 16, 2048)
        assert parse_metrics(noise, now=1.0) == PodMetrics(scraped_at=1.0)
        with pytest.raises(ValueError):
            parse_metrics(self.TEXT + 'vllm:num_requests_running{model_name="m" 5\n', now=1.0)

    def test_stale_metrics_are_not_used(self) -> None:
        """Old data neither pins a pod as idle nor as saturated: past the threshold it reads as unknown."""
        now = [10.0]
        store = MetricsStore(staleness_s=5.0, clock=lambda: now[0])
        store.put("p", PodMetrics(waiting=50, scraped_at=9.0))
        assert store.get("p") is not None
        now[0] = 20.0
        assert store.get("p") is None
