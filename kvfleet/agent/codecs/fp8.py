"""``fp8_e4m3``: FP8 (E4M3, OCP ``float8_e4m3fn``) codes with one power-of-two scale per group.

The scheme is the one of OCP MX formats (MXFP8): every group of ``group_size``
values (32 by default) shares a power-of-two scale chosen so that the group's
largest magnitude lands in e4m3's top binades, and each value is rounded to
3 mantissa bits. Because the scale is a power of two, scaling is an exponent
shift, and the whole conversion runs on the integer bit patterns of the
input (``float16``, ``bfloat16`` or ``float32``; ``float64`` goes through
``float32``) — no float arithmetic. Two implementations give the same bytes:
compiled kernels (:mod:`._kernels`, numba: two fused passes per chunk of groups,
the GIL released), and numpy in cache-sized chunks, used when numba is missing or
``KVFLEET_CODEC_KERNELS=numpy`` (the choice is made when the codec is built;
``kernels=`` overrides it). The code bytes are genuine ``float8_e4m3fn`` values: viewed with
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
    CodecInputError,
    CorruptPayloadError,
    GroupedCodec,
    Payload,
    as_payload,
    check_float,
    load_kernels,
)

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_CHUNK_VALUES = 1 << 17
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


class Fp8E4M3Codec(GroupedCodec):
    """FP8 e4m3 with per-group power-of-two scales (MXFP8-style); about half the bytes of fp16."""

    name: ClassVar[str] = "fp8_e4m3"

    def __init__(self, group_size: int = 128, *, kernels: bool | None = None) -> None:
        """``kernels``: ``None`` (default) the compiled kernels when available, ``False`` numpy,
        ``True`` the kernels or :class:`ImportError` (see :func:`~kvfleet.agent.codecs.base.load_kernels`)."""
        if group_size <= 0:
            raise ValueError(f"group_size must be > 0, got {group_size}")
        self._set_groups(group_size, _CHUNK_VALUES)
        self._kern = load_kernels(kernels)

    def encoded_nbytes(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> int:
        _, ng, n_pad = self._layout(shape)
        return 2 * ng + n_pad

    def encode(self, block: npt.NDArray[Any]) -> Payload:
        check_float(block, self.name)
        _, ng, n_pad = self._layout(block.shape)
        return self._encode(block, np.empty(2 * ng + n_pad, dtype=np.uint8))

    def encode_into(self, block: npt.NDArray[Any], out: Payload) -> Payload:
        """Encode straight into ``out`` (no temporary payload)."""
        check_float(block, self.name)
        size = self.encoded_nbytes(block.dtype, block.shape)
        dest = as_payload(out)[:size]
        if dest.nbytes != size:
            raise CodecInputError(f"output of {out.nbytes} bytes cannot hold {size} encoded bytes")
        return self._encode(block, dest)

    def _encode(self, block: npt.NDArray[Any], out: Payload) -> Payload:
        native = block.dtype.isnative and block.dtype.name in _FORMATS
        src = block if native else block.astype(_work_dtype(block.dtype))
        fmt = _FORMATS[src.dtype.name]
        n, ng, n_pad = self._layout(block.shape)
        bits = np.ascontiguousarray(src).reshape(-1).view(fmt.uint)
        if self._kern is not None:
            if self._kern.encode(self.name, src.dtype, bits, self.group_size, out) >= 0:
                raise CodecInputError(f"codec {self.name!r} cannot encode inf/nan values")
            return out
        if n_pad == 0:
            return out
        if n_pad != n:
            bits = np.concatenate([bits, np.zeros(n_pad - n, dtype=fmt.uint)])
        offsets = out[: 2 * ng].view(np.int16)
        codes = out[2 * ng :]
        g = self.group_size
        sh = fmt.mant - 3
        half = 1 << (sh - 1)
        size = bits.dtype.itemsize
        # Scratch reused across chunks: every pass below writes in place (no per-chunk temporaries),
        # and every ufunc works on one dtype (a casting ufunc runs buffered, several times slower).
        chunk = min(self._chunk, n_pad)
        a_buf = np.empty(chunk, dtype=fmt.uint)
        s_buf = np.empty(chunk, dtype=fmt.uint)
        keep_buf = np.empty(chunk, dtype=np.bool_)
        sign_buf = np.empty(chunk, dtype=np.uint8)
        sign_shift = 8 * size - 8
        for start in range(0, n_pad, chunk):
            c = bits[start : start + chunk]
            m = len(c)
            au = np.bitwise_and(c, fmt.mag_mask, out=a_buf[:m])
            amax = au.reshape(-1, g).max(axis=1)
            if int(amax.max()) >= fmt.inf:
                raise CodecInputError(f"codec {self.name!r} cannot encode inf/nan values")
            off = (amax >> fmt.mant).astype(fmt.sint) - _TOP
            g0 = start // g
            offsets[g0 : g0 + len(off)] = off
            a = au.view(fmt.sint)
            # ((a + half) >> sh) - (off << 3) == (a - ((off << mant) - half)) >> sh: one pass fewer.
            a2 = a.reshape(-1, g)
            a2 -= ((off << fmt.mant) - half)[:, None]
            a >>= sh
            np.greater_equal(a, 8, out=keep_buf[:m])  # below e4m3's normal range: flushed to zero
            a *= keep_buf[:m]
            code = codes[start : start + m]
            np.copyto(code, a, casting="unsafe")
            # the sign: the top bit of the most significant byte
            hi = np.right_shift(c, sign_shift, out=s_buf[:m])
            sign = sign_buf[:m]
            np.copyto(sign, hi, casting="unsafe")
            sign &= 0x80
            code |= sign
        return out

    def decode(self, payload: Payload | bytes | memoryview, dtype: npt.DTypeLike,
               shape: tuple[int, ...]) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        work = _work_dtype(dt)
        fmt = _FORMATS[work.name]
        n, ng, n_pad = self._layout(shape)
        buf = as_payload(payload)
        if buf.size != 2 * ng + n_pad:
            raise CorruptPayloadError(f"fp8 payload of {buf.size} bytes cannot hold {shape} {dt}")
        if self._kern is not None:
            out = np.empty(n, dtype=fmt.uint)
            self._kern.decode(self.name, work, buf, self.group_size, out)
        else:
            out = np.empty(n_pad, dtype=fmt.uint)
            self._decode(buf, fmt, out)
        block = out[:n].view(work).reshape(shape)
        return block if work == dt else block.astype(dt)

    def decode_into(self, payload: Payload | bytes | memoryview, out: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Decode straight into ``out`` when it is contiguous and of an input format (and, for numpy,
        unpadded)."""
        n, ng, n_pad = self._layout(out.shape)
        buf = as_payload(payload)
        direct = out.dtype == _work_dtype(out.dtype) and out.flags.c_contiguous and out.flags.writeable
        if not direct or (self._kern is None and n != n_pad):
            return super().decode_into(payload, out)
        if buf.size != 2 * ng + n_pad:
            raise CorruptPayloadError(f"fp8 payload of {buf.size} bytes cannot hold {out.shape} {out.dtype}")
        fmt = _FORMATS[out.dtype.name]
        bits = out.reshape(-1).view(fmt.uint)
        if self._kern is not None:
            self._kern.decode(self.name, out.dtype, buf, self.group_size, bits)
        else:
            self._decode(buf, fmt, bits)
        return out

    def _decode(self, buf: Payload, fmt: _Bits, out: npt.NDArray[Any]) -> None:
        """Decode ``buf`` (checked length) into the bit patterns ``out`` (``fmt.uint``, padded length)."""
        n_pad = out.size
        if n_pad == 0:
            return
        ng = n_pad // self.group_size
        offsets = buf[: 2 * ng].view(np.int16)
        codes = buf[2 * ng :].view(np.int8)
        g = self.group_size
        sh = fmt.mant - 3
        sign_bit = 1 << fmt.sign_shift
        # int8 codes sign-extend to -128 + magnitude; shifted left, the sign lands in the top bit and in
        # the bits between it and the magnitude, which ``keep`` clears.
        keep = _signed(sign_bit | (0x7F << sh), fmt)
        sign_only = _signed(sign_bit, fmt)
        chunk = min(self._chunk, n_pad)
        zero_buf = np.empty(chunk, dtype=np.bool_)
        mag_buf = np.empty(chunk, dtype=np.uint8)
        for start in range(0, n_pad, chunk):
            q = codes[start : start + chunk]
            m = len(q)
            w = out[start : start + m].view(fmt.sint)
            np.copyto(w, q, casting="unsafe")
            w <<= sh
            w &= keep
            g0 = start // g
            w.reshape(-1, g)[...] += (offsets[g0 : g0 + m // g].astype(fmt.sint) << fmt.mant)[:, None]
            # zero codes (±0) got the group offset too: put back the bare sign
            mag = np.bitwise_and(q.view(np.uint8), 0x7F, out=mag_buf[:m])
            zero = np.equal(mag, 0, out=zero_buf[:m])
            np.bitwise_and(w, sign_only, out=w, where=zero)


def _work_dtype(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype whose bit patterns fp8 works on for blocks of ``dt``: ``dt`` in native byte order
    when it is an input format, else float32."""
    return dt.newbyteorder("=") if dt.name in _FORMATS else np.dtype(np.float32)


def _signed(mask: int, fmt: _Bits) -> int:
    """``mask`` as the signed integer of the format's width (for in-place ops on signed views)."""
    bits = 8 * np.dtype(fmt.sint).itemsize
    return mask - (1 << bits) if mask >= 1 << (bits - 1) else mask
