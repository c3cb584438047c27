"""Block codecs of the tier transform pipeline: ``none``, ``fp8_e4m3``, ``int8``, ``int4``.

Each tier names a codec; a block is encoded when it is written to that tier
(demotion quantizes) and decoded when read back (promotion dequantizes).
Tier capacity counts *encoded* bytes, so a quantized tier holds more blocks.

>>> codec = get_codec("fp8_e4m3")
>>> codec.name
'fp8_e4m3'

Unknown names raise :class:`UnknownCodecError` listing the registered ones.

The quantizing codecs run compiled kernels (numba, GIL released) when numba
imports, else their numpy implementations (same bytes); the kernels compile on
first use, or ahead of it with :func:`warm_up`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvfleet.agent.codecs.base import (
    Codec,
    CodecError,
    CodecInputError,
    CorruptPayloadError,
    Payload,
    UnknownCodecError,
    as_payload,
    load_kernels,
)
from kvfleet.agent.codecs.fp8 import Fp8E4M3Codec
from kvfleet.agent.codecs.identity import IdentityCodec
from kvfleet.agent.codecs.integer import Int4Codec, Int8Codec

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "CodecInputError",
    "CorruptPayloadError",
    "Fp8E4M3Codec",
    "IdentityCodec",
    "Int4Codec",
    "Int8Codec",
    "Payload",
    "UnknownCodecError",
    "as_payload",
    "get_codec",
    "warm_up",
]

#: name → factory (keyword arguments such as ``group_size`` are passed through).
CODECS: dict[str, Callable[..., Codec]] = {
    IdentityCodec.name: IdentityCodec,
    Fp8E4M3Codec.name: Fp8E4M3Codec,
    Int8Codec.name: Int8Codec,
    Int4Codec.name: Int4Codec,
}

_DEFAULTS: dict[str, Codec] = {}


def get_codec(name: str, **params: Any) -> Codec:
    """The codec registered as ``name`` (a shared default instance when no params are given)."""
    try:
        factory = CODECS[name]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
    if params:
        return factory(**params)
    if name not in _DEFAULTS:
        _DEFAULTS[name] = factory()
    return _DEFAULTS[name]


def warm_up(names: Iterable[str] | None = None) -> bool:
    """Compile the kernels of the codecs ``names`` (default: all) for fp16, bf16 and fp32 blocks now
    (about 0.5 s per codec and dtype, holding the GIL) rather than on a block's first encode/decode;
    cheap once done. ``False`` when the numpy implementations are in use (nothing to compile)."""
    kernels = load_kernels()
    if kernels is None:
        return False
    kernels.warm_up(names)
    return True
