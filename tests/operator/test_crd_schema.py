"""The CRDs as the API server would apply them: defaults, OpenAPI schema and CEL rules.

Covers: valid KVCachePools admitted with the documented defaults; every invalid
sample rejected with its message, by the CRD (schema + CEL) and by the
operator's own parser alike; CRD defaults equal to kvfleet Settings; the
InferencePool CRD matching the upstream v1 shape and its CEL rules; the
chart's CRD copies byte-identical to crds/.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

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
    assert spec["tiers"] == [{"name": "gpu", "gpuShare": 0.9, "codec": "none", "watermarks": {"high": 0.9, "low": 0.7}}]
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
    assert parse_spec(obj["spec"], obj["metadata"]["name"]) == parse_spec(defaulted["spec"], obj["metadata"]["name"])


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
    assert message in str(info.value) or info.value.field.split(".")[-1] in message or message in info.value.field


def test_long_names_are_invalid_for_the_operator() -> None:
    """Names that would overflow children's 63-character names are refused."""
    with pytest.raises(InvalidSpecError, match="at most"):
        parse_spec(samples.MINIMAL["spec"], "x" * 51)


def test_inferencepool_crd_has_upstream_v1_shape() -> None:
    """Group/version/kind, required fields and the endpointPickerRef fields of upstream v1."""
    assert KVCP["spec"]["scope"] == INFP["spec"]["scope"] == "Namespaced"
    assert INFP["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert [v["name"] for v in INFP["spec"]["versions"]] == ["v1"]
    spec = crd_schema(INFP)["properties"]["spec"]
    assert sorted(spec["required"]) == ["endpointPickerRef", "selector", "targetPorts"]
    assert set(spec["properties"]["endpointPickerRef"]["properties"]) == {"failureMode", "group", "kind", "name", "port"}
    assert spec["properties"]["appProtocol"]["enum"] == ["http", "kubernetes.io/h2c"]
    status = crd_schema(INFP)["properties"]["status"]["properties"]["parents"]["items"]["properties"]
    assert {"conditions", "controllerName", "parentRef"} <= set(status)


def test_inferencepool_defaults_and_valid_object() -> None:
    """A minimal InferencePool is admitted with failureMode FailClose, kind Service, appProtocol http."""
    obj, errors = admit(INFP, samples.inferencepool())
    assert errors == []
    ref = obj["spec"]["endpointPickerRef"]
    assert (ref["failureMode"], ref["kind"], ref["group"], obj["spec"]["appProtocol"]) == ("FailClose", "Service", "", "http")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"endpointPickerRef": {"name": "epp"}}, "port is required"),
        ({"targetPorts": [{"number": 8000}, {"number": 8000}]}, "unique"),
        ({"selector": {"matchLabels": {}}}, "matchLabels"),
        ({"targetPorts": []}, "targetPorts"),
        ({"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Maybe"}}, "failureMode"),
    ],
)
def test_inferencepool_invalid_objects(change: dict[str, Any], message: str) -> None:
    """The upstream CEL rules and schema constraints reject bad InferencePools."""
    _, errors = admit(INFP, samples.inferencepool(**change))
    assert any(message in e for e in errors), errors


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
