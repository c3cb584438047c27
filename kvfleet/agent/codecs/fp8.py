"""``fp8_e4m3``: FP8 (E4M3, OCP ``float8_e4m3fn``) codes with one power-of-two scale per group.

The scheme is the one of OCP MX formats (MXFP8): every group of ``group_size``
values (32 by default) shares a power-of-two scale chosen so that the group's
largest magnitude lands in e4m3's top binades, and each value is rounded to
3 mantissa bits. Because the scale is a power of two, scaling is an exponent
shift, and the whole conversion runs on the integer bit patterns of the
input (``float16``, ``bfloat16`` or ``float32``; ``float64`` goes through
``float32``), in cache-sized chunks — no float arithmetic and no per-element
Python. The code bytes are genuine ``float8_e4m3fn`` values: viewed with
:mod:`ml_dtypes` and multiplied by ``2**shift`` they give the decoded block
(tested). The one exception: inputs that are subnormal in their own format
(below 2**-14 for fp16) keep their truncated bit pattern instead, which
decodes within the same bound.

Payload: ``[int16 exponent offset per group][one e4m3 byte per value]``.

Error bound (documented in docs/tiers.md, tested): for every value ``x`` of a
group whose largest magnitude is ``amax``::

    |decode(encode(x)) - x| <= 2**-4 * |x| + 2**-13 * amax   (+ one ulp of the output dtype)

The first term is rounding to 3 mantissa bits (half an ulp, round half away
from zero); the second covers values more than 13 binades below ``amax``,
which are flushed to zero (e4m3 subnormals are not produced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvfleet.agent.codecs.base import (
    Codec,
    CodecInputError,
    CorruptPayloadError,
    Payload,
    as_payload,
    check_float,
    num_values,
)

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_CHUNK_VALUES = 1 << 16
#: e4m3 biased exponent given to the group maximum's binade (unbiased 7: values up to 2**8).
_TOP = 14


@dataclass(frozen=True)
class _Bits:
    """How a float format's bit pattern is laid out."""

    uint: type[np.unsignedinteger[Any]]
    sint: type[np.signedinteger[Any]]
    mant: int
    sign_shift: int
    inf: int

    @property
    def mag_mask(self) -> int:
        return (1 << self.sign_shift) - 1


_FORMATS: dict[str, _Bits] = {
    "float16": _Bits(np.uint16, np.int16, 10, 15, 0x7C00),
    "bfloat16": _Bits(np.uint16, np.int16, 7, 15, 0x7F80),
    "float32": _Bits(np.uint32, np.int32, 23, 31, 0x7F800000),
}


class Fp8E4M3Codec(Codec):
    """FP8 e4m3 with per-group power-of-two scales (MXFP8-style); about half the bytes of fp16."""

    name: ClassVar[str] = "fp8_e4m3"

    def __init__(self, group_size: int = 128) -> None:
        if group_size <= 0:
            raise ValueError(f"group_size must be > 0, got {group_size}")
        self.group_size = group_size
        self._chunk = max(group_size, (_CHUNK_VALUES // group_size) * group_size)

    def _layout(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        n = num_values(shape)
        ng = -(-n // self.group_size)
        return n, ng, ng * self.group_size

    def encoded_nbytes(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> int:
        _, ng, n_pad = self._layout(shape)
        return 2 * ng + n_pad

    def encode(self, block: npt.NDArray[Any]) -> Payload:
        check_float(block, self.name)
        src = block if block.dtype.name in _FORMATS else block.astype(np.float32)
        fmt = _FORMATS[src.dtype.name]
        n, ng, n_pad = self._layout(block.shape)
        bits = np.ascontiguousarray(src).reshape(-1).view(fmt.uint)
        if n_pad != n:
            bits = np.concatenate([bits, np.zeros(n_pad - n, dtype=fmt.uint)])
        out = np.empty(2 * ng + n_pad, dtype=np.uint8)
        offsets = out[: 2 * ng].view(np.int16)
        codes = out[2 * ng :]
        g = self.group_size
        sh = fmt.mant - 3
        half = 1 << (sh - 1)
        for start in range(0, n_pad, self._chunk):
            c = bits[start : start + self._chunk]
            a = (c & fmt.mag_mask).view(fmt.sint)
            amax = a.reshape(-1, g).max(axis=1)
            if int(amax.max()) >= fmt.inf:
                raise CodecInputError(f"codec {self.name!r} cannot encode inf/nan values")
            off = (amax >> fmt.mant).astype(fmt.sint) - _TOP
            g0 = start // g
            offsets[g0 : g0 + len(off)] = off
            a += half
            a >>= sh
            r8 = a.reshape(-1, g)
            r8 -= (off << 3)[:, None]
            np.multiply(a, a >= 8, out=a)
            sign = c >> (fmt.sign_shift - 7)
            sign &= 0x80
            sign |= a.view(fmt.uint)
            np.copyto(codes[start : start + len(c)], sign, casting="unsafe")
        return out

    def decode(self, payload: Payload | bytes | memoryview, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        work = dt if dt.name in _FORMATS else np.dtype(np.float32)
        fmt = _FORMATS[work.name]
        n, ng, n_pad = self._layout(shape)
        buf = as_payload(payload)
        if buf.size != 2 * ng + n_pad:
            raise CorruptPayloadError(f"fp8 payload of {buf.size} bytes cannot hold {shape} {dt}")
        offsets = buf[: 2 * ng].view(np.int16)
        codes = buf[2 * ng :]
        out = np.empty(n_pad, dtype=fmt.uint)
        g = self.group_size
        sh = fmt.mant - 3
        for start in range(0, n_pad, self._chunk):
            q = codes[start : start + self._chunk]
            w = out[start : start + len(q)].view(fmt.sint)
            np.copyto(w, q, casting="unsafe")
            sign = w & 0x80
            w &= 0x7F
            nz = w != 0
            w <<= sh
            g0 = start // g
            w.reshape(-1, g)[...] += (offsets[g0 : g0 + len(q) // g].astype(fmt.sint) << fmt.mant)[:, None]
            w *= nz
            sign <<= fmt.sign_shift - 7
            w |= sign
        block = out[:n].view(work).reshape(shape)
        return block if work == dt else block.astype(dt)
