"""The CRDs on a real API server: the server's own structural schema, defaulting and CEL.

* every KVCachePool sample (tests/operator/samples.py, e2e/kind/*.yaml) is admitted, and the
  server defaults it exactly as the offline model of admission (tests/operator/k8s.py) does;
* every invalid sample is refused with the message the samples expect;
* each CEL rule of crds/kvcachepool.yaml has a manifest that breaks only it, refused with that
  rule's message (a rule added without one fails :func:`test_every_cel_rule_has_a_failing_manifest`);
* GIE v1.6.0's example InferencePools (tests/operator/data/gie-v1.6.0) are admitted by the shipped
  CRD, and variants breaking its two CEL rules are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import ROOT, Kube
from tests.operator import samples
from tests.operator.k8s import admit, load_crd

KVCP = load_crd("kvcachepool.yaml")
INFP = load_crd("inferencepool.yaml")
GIE = ROOT / "tests" / "operator" / "data" / "gie-v1.6.0"


def _kind_samples() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((ROOT / "e2e" / "kind").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "KVCachePool":
                out[f"{path.name}:{doc['metadata']['name']}"] = doc
    return out


VALID = {**{f"samples.py:{k}": v for k, v in samples.VALID.items()}, **_kind_samples()}


@pytest.fixture(scope="module")
def ns(crds: Kube, namespaces: Any) -> str:
    made: str = namespaces("crds")
    return made


def _named(obj: Mapping[str, Any], ns: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(obj))
    out["metadata"] = {**out["metadata"], "namespace": ns}
    return out


def _server_only(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the offline model does not produce: server-set metadata."""
    out = copy.deepcopy(dict(obj))
    out["metadata"] = {
        k: v for k, v in out["metadata"].items()
        if k not in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")}
    return out


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_kvcachepools_are_admitted_and_defaulted_as_offline(crds: Kube, ns: str, name: str) -> None:
    """Admitted by the server; its defaults are those of the offline admission model used by the unit
    tests."""
    obj = _named(VALID[name], ns)
    status, body = crds.create(obj)
    assert status == 201, body.get("message")
    offline, errors = admit(KVCP, obj)
    assert errors == []
    assert _server_only(body) == offline


@pytest.mark.parametrize("name", sorted(samples.INVALID))
def test_invalid_kvcachepools_are_refused_by_the_server(crds: Kube, ns: str, name: str) -> None:
    """Refused (422) by the server's schema or CEL, with the message tests/operator/samples.py expects."""
    obj, message = samples.INVALID[name]
    status, body = crds.create(_named(obj, ns))
    assert status == 422, body
    assert message in body["message"], body["message"]


def _gpu(**tier: Any) -> list[dict[str, Any]]:
    return [{"name": "gpu", "gpuShare": 0.5}, tier] if tier else [{"name": "gpu", "gpuShare": 0.5}]


#: A manifest breaking each CEL rule of crds/kvcachepool.yaml (by the rule's message), and nothing else.
CEL_BREAKERS: dict[str, dict[str, Any]] = {
    "vLLM supports blockSize 1, 8, 16, 32, 64 or 128": {"engine": {"kind": "vllm"}, "blockSize": 24},
    "prefill/decode roles need a network transfer backend (tcp, nixl or mooncake), not shm alone":
        {"roles": {"prefill": {}, "decode": {}}, "transfer": {"backends": ["shm"]}},
    "prefill and decode must be given together": {"roles": {"unified": {}, "decode": {"replicas": 2}}},
    "give either unified or prefill+decode, not both and not neither": {"roles": {}},
    ("tiers must start with gpu (the engine's own KV memory) and be ordered gpu, cpu, ssd, remote, "
     "each at most once"):
        {"tiers": [{"name": "gpu", "gpuShare": 0.5}, {"name": "ssd", "capacity": "1Ti"},
                   {"name": "cpu", "capacity": "1Gi"}]},
    "the gpu tier takes gpuShare; cpu, ssd and remote tiers take capacity":
        {"tiers": _gpu(name="cpu", gpuShare=0.5)},
    "capacity must be a quantity such as 64Gi, 1Ti or 500M": {"tiers": _gpu(name="ssd", capacity="1TB!")},
    "capacity must be greater than 0": {"tiers": _gpu(name="cpu", capacity="-1Gi")},
    "the remote tier needs redis.urlSecretRef": {"tiers": _gpu(name="remote", capacity="1Ti")},
    "redis is only for the remote tier":
        {"tiers": _gpu(name="ssd", capacity="1Ti", redis={"urlSecretRef": {"name": "r"}})},
    "volume is only for the ssd tier":
        {"tiers": [{"name": "gpu", "gpuShare": 0.5, "volume": {"emptyDir": {}}}]},
    "watermarks.low must be below watermarks.high":
        {"tiers": _gpu(name="cpu", capacity="1Gi", watermarks={"high": 0.7, "low": 0.7})},
    "transfer backends must be unique": {"transfer": {"backends": ["nixl", "tcp", "nixl"]}},
}


def _cel_rules(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, str, str]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path or ".", rule["rule"], rule["message"]
    for key, sub in (schema.get("properties") or {}).items():
        yield from _cel_rules(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), Mapping):
        yield from _cel_rules(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from _cel_rules(schema["additionalProperties"], f"{path}{{}}")


RULES = list(_cel_rules(KVCP["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))


def test_every_cel_rule_has_a_failing_manifest() -> None:
    """One breaker per rule (the table above), none for a rule that no longer exists."""
    assert sorted(m for _, _, m in RULES) == sorted(CEL_BREAKERS)


@pytest.mark.parametrize("message", sorted(CEL_BREAKERS))
def test_each_cel_rule_is_enforced_by_the_server(crds: Kube, ns: str, message: str) -> None:
    """The manifest is refused by the server with exactly that rule's message (and passes every other
    rule)."""
    obj = samples.kvcachepool(name="cel", namespace=ns, **CEL_BREAKERS[message])
    status, body = crds.create(obj)
    assert status == 422, body
    assert message in body["message"], body["message"]
    others = [m for _, _, m in RULES if m != message and m in body["message"]]
    assert others == [], f"the breaker for {message!r} also broke {others}"
    _, offline = admit(KVCP, obj)  # the offline model agrees
    assert any(message in e for e in offline), offline


def test_capacity_limits_are_quantities_on_the_server(crds: Kube, ns: str) -> None:
    """Kubernetes' quantity() sees 1Ti > 0, 500M > 0, 1 > 0 (and an integer capacity)."""
    for capacity in ("1Ti", "500M", "1", 1, "0.5Gi"):
        status, body = crds.create(samples.kvcachepool(name="q", namespace=ns,
                                                       tiers=_gpu(name="cpu", capacity=capacity)))
        assert status == 201, (capacity, body.get("message"))


def _gie_pools() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(GIE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferencePool":
                out[f"{path.relative_to(GIE)}:{doc['metadata']['name']}"] = doc
    return out


GIE_POOLS = _gie_pools()


def test_gie_examples_found() -> None:
    assert len(GIE_POOLS) >= 7, sorted(GIE_POOLS)


@pytest.mark.parametrize("name", sorted(GIE_POOLS))
def test_gie_example_inferencepools_are_admitted(crds: Kube, ns: str, name: str) -> None:
    """Each upstream v1.6.0 example InferencePool is stored by the server with the shipped CRD, defaulted as
    offline."""
    obj = _named(GIE_POOLS[name], ns)
    status, body = crds.create(obj)
    assert status == 201, body.get("message")
    offline, errors = admit(INFP, obj)
    assert errors == [] and _server_only(body) == offline


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["endpointPickerRef"].pop("port"),
         "port is required when kind is 'Service' or unspecified"),
        (lambda s: s.update(targetPorts=[{"number": 3000}, {"number": 3000}]), "port number must be unique"),
        (lambda s: s.update(selector={"matchLabels": {}}), "spec.selector.matchLabels"),
        (lambda s: s.update(appProtocol="grpc"), "spec.appProtocol"),
    ],
)
def test_broken_gie_inferencepools_are_refused(crds: Kube, ns: str, change: Any, message: str) -> None:
    """The InferencePool CRD's CEL rules and schema, enforced by the server."""
    obj = _named(GIE_POOLS["conformance/resources/base.yaml:primary-inference-pool"], ns)
    change(obj["spec"])
    status, body = crds.create(obj)
    assert status == 422, body
    assert message in body["message"], body["message"]


def test_operator_inferencepool_and_kvcachepool_stored(crds: Kube, ns: str) -> None:
    """Objects really stored (not only dry run) read back with generation 1 and the status subresource split
    off."""
    obj = _named(samples.SIM_PD, ns)
    status, body = crds.create(obj, dry_run=False)
    assert status == 201, body.get("message")
    assert body["metadata"]["generation"] == 1 and "status" not in body
    patched = crds.kubectl("patch", "kvcachepool", obj["metadata"]["name"], "-n", ns, "--type=merge", "-p",
                           '{"status": {"pools": 3}, "spec": {"pools": 2}}', "-o", "json").stdout
    assert yaml.safe_load(patched)["spec"]["pools"] == 2
    assert "status" not in yaml.safe_load(patched) or "pools" not in yaml.safe_load(patched)["status"]
