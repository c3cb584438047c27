"""The CRDs as the API server would apply them: defaults, OpenAPI schema and CEL rules.

Covers: valid KVCachePools admitted with the documented defaults; every invalid
sample rejected with its message, by the CRD (schema + CEL) and by the
operator's own parser alike; CRD defaults equal to kvfleet Settings; the
InferencePool CRD being GIE v1.6.0's (bundle version, endpointPickerRef
optional) with its CEL rules; every InferencePool of GIE v1.6.0's own examples
(tests/operator/data/gie-v1.6.0, see its SOURCES.md) admitted, with and
without endpointPickerRef, and broken variants of them rejected; the chart's
CRD copies byte-identical to crds/.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.config import CacheSettings
from kvfleet.operator.spec import InvalidSpecError, PoolSpec, parse_spec
from tests.operator import samples
from tests.operator.k8s import ROOT, admit, crd_schema, load_crd

KVCP = load_crd("kvcachepool.yaml")
INFP = load_crd("inferencepool.yaml")


@pytest.mark.parametrize("name", sorted(samples.VALID))
def test_valid_objects_are_admitted(name: str) -> None:
    """Each valid sample passes schema and CEL after defaulting."""
    _, errors = admit(KVCP, samples.VALID[name])
    assert errors == []


def test_minimal_object_gets_the_documented_defaults() -> None:
    """Defaulting fills every optional section (one unified replica, one pool, a gpu tier)."""
    obj, _ = admit(KVCP, samples.MINIMAL)
    spec = obj["spec"]
    assert spec["roles"] == {"unified": {"replicas": 1}}
    assert spec["pools"] == 1
    assert spec["tiers"] == [{"name": "gpu", "gpuShare": 0.9, "codec": "none",
                              "watermarks": {"high": 0.9, "low": 0.7}}]
    assert spec["engine"] == {"kind": "sim"}
    assert spec["transfer"] == {"backends": ["shm", "tcp"], "streams": 4}
    assert spec["routing"]["failureMode"] == "FailClose"


def test_crd_defaults_equal_settings() -> None:
    """blockSize and hashAlgo defaults are kvfleet's CacheSettings (one source of truth)."""
    props = crd_schema(KVCP)["properties"]["spec"]["properties"]
    assert props["blockSize"]["default"] == CacheSettings().block_size
    assert props["hashAlgo"]["default"] == CacheSettings().hash_algo


@pytest.mark.parametrize("name", sorted(samples.VALID))
def test_parser_defaults_agree_with_crd_defaults(name: str) -> None:
    """The operator's parse of a raw spec equals its parse of the API-server-defaulted spec."""
    obj = samples.VALID[name]
    defaulted, _ = admit(KVCP, obj)
    assert parse_spec(obj["spec"], obj["metadata"]["name"]) == parse_spec(
        defaulted["spec"], obj["metadata"]["name"])


def test_parser_defaults_equal_dataclass_defaults() -> None:
    """A minimal spec parses to PoolSpec's own defaults (besides the model name)."""
    parsed = parse_spec(samples.MINIMAL["spec"])
    assert parsed.block_size == PoolSpec().block_size == CacheSettings().block_size
    assert parsed.tiers == PoolSpec().tiers
    assert parsed.roles == PoolSpec().roles


@pytest.mark.parametrize("name", sorted(samples.INVALID))
def test_invalid_objects_are_rejected_by_the_crd(name: str) -> None:
    """Schema or CEL rejects each invalid sample, with the expected message."""
    obj, message = samples.INVALID[name]
    _, errors = admit(KVCP, obj)
    assert errors, f"{name} was admitted"
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("name", sorted(samples.INVALID))
def test_invalid_objects_are_rejected_by_the_operator(name: str) -> None:
    """The operator's parser rejects the same objects (a server without CEL cannot slip them through)."""
    obj, message = samples.INVALID[name]
    defaulted, _ = admit(KVCP, obj)
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(defaulted["spec"], obj["metadata"]["name"])
    assert (message in str(info.value) or info.value.field.split(".")[-1] in message
            or message in info.value.field)


def test_long_names_are_invalid_for_the_operator() -> None:
    """Names that would overflow children's 63-character names are refused."""
    with pytest.raises(InvalidSpecError, match="at most"):
        parse_spec(samples.MINIMAL["spec"], "x" * 51)


GIE_BUNDLE = "v1.6.0"
GIE_EXAMPLES = Path(__file__).parent / "data" / f"gie-{GIE_BUNDLE}"


def test_inferencepool_crd_has_upstream_v1_shape() -> None:
    """Group/version/kind, bundle version, required fields and the endpointPickerRef fields of upstream v1
    (GIE v1.6)."""
    assert KVCP["spec"]["scope"] == INFP["spec"]["scope"] == "Namespaced"
    assert INFP["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert INFP["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_BUNDLE
    assert [v["name"] for v in INFP["spec"]["versions"]] == ["v1"]
    spec = crd_schema(INFP)["properties"]["spec"]
    assert sorted(spec["required"]) == ["selector", "targetPorts"]  # endpointPickerRef optional since v1.6
    assert set(spec["properties"]["endpointPickerRef"]["properties"]) == {
        "failureMode", "group", "kind", "name", "port"}
    assert spec["properties"]["appProtocol"]["enum"] == ["http", "kubernetes.io/h2c"]
    status = crd_schema(INFP)["properties"]["status"]["properties"]["parents"]["items"]["properties"]
    assert {"conditions", "controllerName", "parentRef"} <= set(status)


def test_inferencepool_defaults_and_valid_object() -> None:
    """A minimal InferencePool is admitted with failureMode FailClose, kind Service, appProtocol http."""
    obj, errors = admit(INFP, samples.inferencepool())
    assert errors == []
    ref = obj["spec"]["endpointPickerRef"]
    assert (ref["failureMode"], ref["kind"], ref["group"], obj["spec"]["appProtocol"]) == (
        "FailClose", "Service", "", "http")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"endpointPickerRef": {"name": "epp"}}, "port is required"),
        ({"targetPorts": [{"number": 8000}, {"number": 8000}]}, "unique"),
        ({"selector": {"matchLabels": {}}}, "matchLabels"),
        ({"targetPorts": []}, "targetPorts"),
        ({"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Maybe"}},
         "failureMode"),
    ],
)
def test_inferencepool_invalid_objects(change: dict[str, Any], message: str) -> None:
    """The upstream CEL rules and schema constraints reject bad InferencePools."""
    _, errors = admit(INFP, samples.inferencepool(**change))
    assert any(message in e for e in errors), errors


def _gie_examples() -> dict[str, dict[str, Any]]:
    """Every InferencePool in the upstream example files, by ``file:name``."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(GIE_EXAMPLES.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferencePool":
                out[f"{path.relative_to(GIE_EXAMPLES)}:{doc['metadata']['name']}"] = doc
    return out


GIE_POOLS = _gie_examples()


def test_gie_examples_cover_both_shapes() -> None:
    """The upstream examples include pools with and without endpointPickerRef (and several options)."""
    with_ref = [k for k, v in GIE_POOLS.items() if "endpointPickerRef" in v["spec"]]
    without = [k for k, v in GIE_POOLS.items() if "endpointPickerRef" not in v["spec"]]
    assert len(with_ref) >= 5 and len(without) >= 1, sorted(GIE_POOLS)
    assert {v["spec"].get("appProtocol") for v in GIE_POOLS.values()} >= {None, "http", "kubernetes.io/h2c"}
    assert any(len(v["spec"]["targetPorts"]) > 1 for v in GIE_POOLS.values())


@pytest.mark.parametrize("name", sorted(GIE_POOLS))
def test_gie_examples_are_admitted(name: str) -> None:
    """Each upstream v1.6 example InferencePool passes the shipped CRD's schema and CEL rules."""
    obj, errors = admit(INFP, GIE_POOLS[name])
    assert errors == []
    assert obj["spec"]["appProtocol"] in ("http", "kubernetes.io/h2c")
    if "endpointPickerRef" in GIE_POOLS[name]["spec"]:
        assert obj["spec"]["endpointPickerRef"]["kind"] == "Service"
    else:
        assert "endpointPickerRef" not in obj["spec"]  # nothing defaults it in


def test_pool_without_endpoint_picker_was_invalid_before_v1_6() -> None:
    """The same object fails a schema that still requires endpointPickerRef (the v1.5 CRD): what the upgrade
    fixes."""
    (name,) = [k for k, v in GIE_POOLS.items() if "endpointPickerRef" not in v["spec"]]
    old = copy.deepcopy(INFP)
    crd_schema(old)["properties"]["spec"]["required"].append("endpointPickerRef")
    _, errors = admit(old, GIE_POOLS[name])
    assert any("endpointPickerRef" in e for e in errors), errors


def _broken(name: str, change: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GIE_POOLS[name])
    change(obj["spec"])
    return obj


_BASE = "conformance/resources/base.yaml:primary-inference-pool"
_NO_REF = "conformance/tests/inferencepool_missing_epp_ref.yaml:pool-with-missing-epp-ref"


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (_BASE, lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
        (_BASE, lambda s: s["endpointPickerRef"].pop("name"), "spec.endpointPickerRef: 'name'"),
        (_BASE, lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"),
         "spec.endpointPickerRef.failureMode: 'Sometimes'"),
        (_BASE, lambda s: s.update(targetPorts=[{"number": 3000}, {"number": 3000}]),
         "port number must be unique"),
        (_BASE, lambda s: s.update(targetPorts=[{"number": 3000 + i} for i in range(9)]),
         "spec.targetPorts: ["),
        (_NO_REF, lambda s: s.pop("selector"), "spec: 'selector'"),
        (_NO_REF, lambda s: s.pop("targetPorts"), "spec: 'targetPorts'"),
        (_NO_REF, lambda s: s.update(targetPorts=[{"number": 70000}]), "spec.targetPorts.0.number: 70000"),
        (_NO_REF, lambda s: s.update(selector={"matchLabels": {}}), "spec.selector.matchLabels: {}"),
        (_NO_REF, lambda s: s.update(selector={"matchLabels": {"app": "-bad-"}}),
         "spec.selector.matchLabels.app: '-bad-'"),
        (_NO_REF, lambda s: s.update(appProtocol="grpc"), "spec.appProtocol: 'grpc'"),
    ],
)
def test_broken_gie_examples_are_rejected(name: str, change: Any, message: str) -> None:
    """Variants of the upstream examples that break a schema constraint or CEL rule are refused, with the
    reason."""
    _, errors = admit(INFP, _broken(name, change))
    assert any(message in e for e in errors), errors


def test_non_service_endpoint_picker_needs_no_port() -> None:
    """The CEL rule asks for a port only when the picker is a Service."""
    obj = _broken(_BASE, lambda s: s["endpointPickerRef"].pop("port")
                  and s["endpointPickerRef"].update(kind="Backend", group="x.example.com"))
    assert admit(INFP, obj)[1] == []


@pytest.mark.parametrize("name", ["kvcachepool.yaml", "inferencepool.yaml"])
def test_chart_crds_are_copies_of_crds(name: str) -> None:
    """charts/kvfleet carries byte-identical copies (regenerate: python -m kvfleet.operator.chart sync)."""
    chart_dir = "crds" if name == "kvcachepool.yaml" else "files/crds"
    assert (ROOT / "charts/kvfleet" / chart_dir / name).read_bytes() == (ROOT / "crds" / name).read_bytes()


def test_samples_are_not_mutated_by_admission() -> None:
    """Defaulting works on a copy (the samples stay reusable)."""
    before = copy.deepcopy(samples.FULL_GPU)
    admit(KVCP, samples.FULL_GPU)
    assert samples.FULL_GPU == before
