"""What the API server would do with an object, offline: structural defaulting,
OpenAPI schema validation (jsonschema) and CEL ``x-kubernetes-validations``
(cel-python, with the Kubernetes ``quantity`` library functions the CRDs use).

No API server can run here; this reproduces the three admission steps for
custom resources so the CRDs' defaults and rules are exercised on real objects.
Built-in kinds are validated with kubernetes-validate instead (:func:`validate_builtin`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import yaml
from celpy import celtypes

from kvfleet.operator.quantity import parse_quantity

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
K8S_VERSION = "1.33.0"


def load_crd(name: str) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((CRDS / name).read_text())
    return crd


def crd_schema(crd: Mapping[str, Any], version: str | None = None) -> dict[str, Any]:
    versions = crd["spec"]["versions"]
    v = next(v for v in versions if version is None or v["name"] == version)
    schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
    return schema


def apply_defaults(schema: Mapping[str, Any], obj: Any) -> Any:
    """Structural defaulting: absent fields with a ``default`` get it, recursively (defaults included)."""
    obj = copy.deepcopy(obj)
    return _default(schema, obj)


def _default(schema: Mapping[str, Any], obj: Any) -> Any:
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = _default(sub, obj[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            known = set(schema.get("properties") or {})
            for key in list(obj):
                if key not in known:
                    obj[key] = _default(extra, obj[key])
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        obj = [_default(schema["items"], item) for item in obj]
    return obj


class _Quantity:
    def __init__(self, value: Any) -> None:
        self.value = parse_quantity(str(value))


def _quantity(value: Any) -> _Quantity:
    return _Quantity(value)


def _is_greater_than(a: _Quantity, b: _Quantity) -> celtypes.BoolType:
    return celtypes.BoolType(a.value > b.value)


def _is_less_than(a: _Quantity, b: _Quantity) -> celtypes.BoolType:
    return celtypes.BoolType(a.value < b.value)


def _is_quantity(value: Any) -> celtypes.BoolType:
    try:
        parse_quantity(str(value))
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


CEL_FUNCTIONS: dict[str, Any] = {"quantity": _quantity, "isQuantity": _is_quantity,
                                 "isGreaterThan": _is_greater_than, "isLessThan": _is_less_than}
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule), functions=CEL_FUNCTIONS)
    return _PROGRAMS[rule]


def cel_errors(schema: Mapping[str, Any], obj: Any, path: str = "") -> list[str]:
    """Messages of every failing ``x-kubernetes-validations`` rule, depth first."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        activation = {"self": celpy.json_to_cel(obj)}  # type: ignore[attr-defined]
        result = _program(rule["rule"]).evaluate(activation)
        if isinstance(result, Exception) or not bool(result):
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                errors += cel_errors(sub, obj[key], f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(obj):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def _strip_k8s(schema: Any) -> Any:
    """The OpenAPI schema as plain JSON Schema draft 4 (int-or-string, preserve-unknown)."""
    if isinstance(schema, dict):
        out = {k: _strip_k8s(v) for k, v in schema.items()
               if not k.startswith("x-kubernetes-") and k != "format"}
        if schema.get("x-kubernetes-int-or-string"):
            out["type"] = ["integer", "string"]
        return out
    if isinstance(schema, list):
        return [_strip_k8s(v) for v in schema]
    return schema


def admit(crd: Mapping[str, Any], obj: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default, then validate (schema + CEL) like the API server; returns (defaulted object, errors)."""
    schema = crd_schema(crd, obj["apiVersion"].split("/")[-1])
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft4Validator(_strip_k8s(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in validator.iter_errors(defaulted)]
    if not errors:
        errors = cel_errors(schema, defaulted)
    return defaulted, errors


def validate_builtin(objs: Iterable[Mapping[str, Any]]) -> list[str]:
    """kubernetes-validate (strict) over built-in kinds; custom kinds are skipped (use :func:`admit`)."""
    errors = []
    for obj in objs:
        if "." in obj["apiVersion"].split("/")[0] and obj["apiVersion"].split("/")[0] not in (
                "rbac.authorization.k8s.io", "networking.k8s.io", "policy", "monitoring.coreos.com"):
            continue
        if obj["apiVersion"].startswith(("monitoring.coreos.com", "gateway.networking.k8s.io")):
            continue
        try:
            kubernetes_validate.validate(dict(obj), K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata'].get('name')}: {exc.message}")
    return errors
