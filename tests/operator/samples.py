"""KVCachePool and InferencePool objects shared by the operator tests: valid ones, and
invalid ones with the message the API server (and the operator) must give."""

from __future__ import annotations

import copy
from typing import Any


def kvcachepool(name: str = "llama", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}
    body.update(spec)
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


MINIMAL = kvcachepool()

FULL_GPU = kvcachepool(
    blockSize=16,
    hashAlgo="sha256_cbor",
    engine={"kind": "vllm", "args": ["--max-model-len", "32768"]},
    roles={
        "prefill": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
        "decode": {"replicas": 4, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}},
    },
    pools=2,
    tiers=[
        {"name": "gpu", "gpuShare": 0.9, "codec": "fp8_e4m3"},
        {"name": "cpu", "capacity": "64Gi", "watermarks": {"high": 0.95, "low": 0.8}},
        {"name": "ssd", "capacity": "1Ti", "codec": "fp8_e4m3",
         "volume": {"hostPath": {"path": "/mnt/nvme/kv", "type": "DirectoryOrCreate"}}},
        {"name": "remote", "capacity": "10Ti", "codec": "int4",
         "redis": {"urlSecretRef": {"name": "kv-redis"}}},
    ],
    transfer={"backends": ["nixl", "tcp"], "streams": 8, "secretRef": {"name": "kv-transfer"}},
    routing={"weights": {"prefix": 2.0, "load": 1.0, "hotspotDecay": 0.3}, "failureMode": "FailOpen"},
)

SIM_PD = kvcachepool(
    name="sim-pd",
    roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    tiers=[{"name": "gpu", "gpuShare": 0.5}, {"name": "cpu", "capacity": "2Gi", "codec": "fp8_e4m3"},
           {"name": "ssd", "capacity": "8Gi"}],
)

VALID = {"minimal": MINIMAL, "full-gpu": FULL_GPU, "sim-pd": SIM_PD}


def _with(base: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    obj["spec"].update(spec)
    return obj


#: name -> (object, a substring of the expected error message)
INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "tiers-out-of-order": (_with(MINIMAL, tiers=[{"name": "cpu", "capacity": "1Gi"},
                                                 {"name": "gpu", "gpuShare": 0.5}]),
                           "ordered gpu, cpu, ssd, remote"),
    "tier-twice": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                         {"name": "gpu", "gpuShare": 0.5}]), "ordered gpu, cpu, ssd, remote"),
    "gpu-with-capacity": (_with(MINIMAL, tiers=[{"name": "gpu", "capacity": "1Gi"}]),
                          "the gpu tier takes gpuShare"),
    "cpu-without-capacity": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5}, {"name": "cpu"}]),
                             "take capacity"),
    "capacity-zero": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                            {"name": "cpu", "capacity": "0"}]), "greater than 0"),
    "capacity-zero-int": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                                {"name": "ssd", "capacity": 0}]), "greater than 0"),
    "capacity-garbage": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                               {"name": "cpu", "capacity": "lots"}]), "capacity"),
    "capacity-not-a-quantity": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                                      {"name": "cpu", "capacity": "64 GB"}]), "capacity"),
    "no-gpu-tier": (_with(MINIMAL, tiers=[{"name": "cpu", "capacity": "1Gi"}]), "must start with gpu"),
    "no-gpu-tier-ssd-remote": (_with(MINIMAL, tiers=[{"name": "ssd", "capacity": "1Ti"},
                                                     {"name": "remote", "capacity": "1Ti",
                                                      "redis": {"urlSecretRef": {"name": "r"}}}]),
                               "must start with gpu"),
    "model-name-too-long": (_with(MINIMAL, model={"name": "m" * 70_000}), "name"),
    "watermarks-inverted": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5,
                                                   "watermarks": {"high": 0.5, "low": 0.6}}]),
                            "low must be below"),
    "remote-without-redis": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                                   {"name": "remote", "capacity": "1Ti"}]),
                             "redis.urlSecretRef"),
    "volume-on-cpu": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0.5},
                                            {"name": "cpu", "capacity": "1Gi", "volume": {"emptyDir": {}}}]),
                      "only for the ssd tier"),
    "prefill-without-decode": (_with(MINIMAL, roles={"prefill": {"replicas": 1}}),
                               "prefill and decode must be given together"),
    "unified-and-pd": (_with(MINIMAL, roles={"unified": {}, "prefill": {}, "decode": {}}), "not both"),
    "vllm-odd-block-size": (_with(MINIMAL, engine={"kind": "vllm"}, blockSize=12), "vLLM supports blockSize"),
    "pd-shm-only": (_with(SIM_PD, transfer={"backends": ["shm"]}), "network transfer backend"),
    "backends-twice": (_with(MINIMAL, transfer={"backends": ["tcp", "tcp"]}), "unique"),
    "no-model-name": (_with(MINIMAL, model={"tokenizer": "x"}), "name"),
    "unknown-engine": (_with(MINIMAL, engine={"kind": "trtllm"}), "kind"),
    "zero-pools": (_with(MINIMAL, pools=0), "pools"),
    "gpu-share-zero": (_with(MINIMAL, tiers=[{"name": "gpu", "gpuShare": 0}]), "gpuShare"),
}


def inferencepool(name: str = "pool", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "vllm", "kvfleet.io/agent": "true"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "kvfleet-epp", "port": {"number": 9002}},
    }
    body.update(spec)
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}
