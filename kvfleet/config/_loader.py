"""Build nested settings dataclasses from plain mappings (YAML/JSON), strictly.

Types are converted and checked by msgspec (``msgspec.convert``, strict): nested
dataclasses, unions of several types, lists and tuples, dict keys and values,
``Literal`` choices; each class's ``__post_init__`` checks run as part of it. Every
error names the dotted path of the offending field (``epp.plugins[1].weight``).
Unknown keys are an error that names their full dotted path and the known ones,
so a typo in a config file never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
_AT = re.compile(r" - at `\$([^`]*)`$")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted path."""


def from_dict(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``, recursing into nested dataclasses."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if data is None:
        data = {}
    _check_keys(cls, data, path)
    try:
        out: T = msgspec.convert(data, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_located(str(exc), path)) from exc
    return out


def _located(message: str, path: str) -> str:
    """msgspec's ``... - at `$.a[0].b``` as ``a[0].b: ...``, under ``path``."""
    m = _AT.search(message)
    where = (m.group(1) if m else "").lstrip(".")
    if path:
        where = f"{path}.{where}" if where and not where.startswith("[") else f"{path}{where}"
    text = _AT.sub("", message)
    return f"{where or '<root>'}: {text}"


def _check_keys(tp: Any, value: Any, path: str) -> None:
    """Unknown keys anywhere below ``tp``: msgspec ignores them in dataclasses, a config file must not."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - fields)
        if unknown:
            where = f"{path}." if path else ""
            raise ConfigError(f"unknown setting(s): {', '.join(where + str(k) for k in unknown)}; known: "
                              f"{', '.join(sorted(fields))}")
        hints = typing.get_type_hints(tp)
        for name, v in value.items():
            _check_keys(hints[name], v, f"{path}.{name}" if path else name)
        return
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(tp) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if len(classes) == 1 and isinstance(value, Mapping):
            _check_keys(classes[0], value, path)
    elif origin in (list, tuple) and isinstance(value, list | tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(args) == 1:
            for i, v in enumerate(value):
                _check_keys(args[0], v, f"{path}[{i}]")
    elif origin is dict and isinstance(value, Mapping):
        kv = typing.get_args(tp)
        if len(kv) == 2:
            for k, v in value.items():
                _check_keys(kv[1], v, f"{path}.{k}")


def to_dict(obj: Any) -> Any:
    """The inverse of :func:`from_dict`: plain mappings/lists, ready for YAML."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
