"""Compiled (numba) kernels of the quantizing codecs: two fused passes per chunk of groups to encode
and one to decode, where numpy makes about ten.

Every kernel reproduces the numpy implementation of its codec bit for bit (tested on every input
format, padding, ±0, flushed values, binade edges and the other path's payloads):

- ``fp8_e4m3`` works on the integer bit patterns exactly like :mod:`.fp8` (per group: the largest
  magnitude's exponent sets the offset, then add-then-shift rounding, flush below e4m3's normal
  range, the sign from the top bit; decode in the format's modular integer arithmetic);
- ``int8``/``int4`` do :mod:`.integer`'s float32 arithmetic in the same order (``scale = amax/qmax``,
  ``x * (1/scale)``, round half to even, clip), with a nonzero scale raised to at least float32's
  smallest normal so that ``1/scale`` stays finite.

fp16 and bf16 have no numba type: their bit patterns are converted to and from float32 in the
kernel (exact widening; round to nearest even on narrowing, subnormals included), like numpy's
and ml_dtypes' casts.

The kernels release the GIL (``nogil``) so that migration threads encoding blocks do not stall the
engine's step loop, run on one thread (the agent has its own threads), and compile on first use
(``cache=False``: the image's root is read-only); :func:`warm_up` compiles them ahead of time.
Group offsets and scales are read and written as little-endian bytes, so payload buffers need no
alignment. :func:`encode` returns ``-1``, or the index of a group holding inf/nan (the codec
raises :class:`~kvfleet.agent.codecs.base.CodecInputError`).

This module imports numba; the codecs import it only through
:func:`kvfleet.agent.codecs.base.load_kernels`, which falls back to numpy without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_JIT: dict[str, Any] = {"nogil": True, "cache": False, "error_model": "numpy"}
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _jit(fn: _Fn) -> _Fn:
    """``numba.njit`` with the options above (typed for the checker: a dispatcher calls like ``fn``)."""
    return cast(_Fn, numba.njit(**_JIT)(fn))


_TOP = 14  # must equal fp8._TOP (checked by the tests)


# ---------------------------------------------------------------------------------------------
# scalar bit casts (LLVM bitcast: free, and the loops around them still vectorise)


def _f32_from_bits_typer(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


def _bits_from_f32_typer(typingctx: Any, value: Any) -> Any:
    """The bit pattern of the float32 ``value`` as a uint32."""
    if value != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen


_f32_from_bits = cast(Callable[[Any], Any], intrinsic(_f32_from_bits_typer))
_bits_from_f32 = cast(Callable[[Any], Any], intrinsic(_bits_from_f32_typer))


# Scalar types the kernels keep their arithmetic in (numba widens small integers to 64 bits; the
# casts let LLVM pack more lanes per vector instruction).
_U8, _U16, _U32, _I32, _F32 = np.uint8, np.uint16, np.uint32, np.int32, np.float32
#: smallest nonzero int8/int4 group scale: float32's smallest normal (1/scale stays finite).
_MIN_SCALE = np.float32(np.finfo(np.float32).tiny)
_UI = np.uint64  # indices
_CHUNK = 4096

# ---------------------------------------------------------------------------------------------
# float16 / bfloat16 / float32 <-> float32 values


@_jit
def _f16_to_f32(h: Any) -> Any:
    """Exact widening of the fp16 bit pattern ``h`` (inf/nan are rejected before this is used)."""
    em = _U32(h) & _U32(0x7FFF)
    if em < _U32(0x400):  # zero or subnormal: em · 2^-24 is exact in float32
        f = _F32(_I32(em)) * _F32(5.9604644775390625e-08)
    else:
        f = _f32_from_bits(_U32(em << _U32(13)) + _U32(112 << 23))
    return -f if _U32(h) & _U32(0x8000) else f


@_jit
def _f32_to_f16(f: Any) -> Any:
    """The fp16 bit pattern of ``f`` as numpy casts it: nearest even, subnormals, overflow to inf."""
    u = _bits_from_f32(f)
    sign = _U32(u >> _U32(16)) & _U32(0x8000)
    x = u & _U32(0x7FFFFFFF)
    if x > _U32(0x7F800000):  # nan: numpy keeps the top payload bits (and never makes it inf)
        o = _U32(0x7C00) + max(_U32(_U32(x & _U32(0x7FFFFF)) >> _U32(13)), _U32(1))
    elif x >= _U32(0x47800000):  # >= 2^16
        o = _U32(0x7C00)
    elif x < _U32(0x38800000):  # below 2^-14: fp16 subnormal or zero; the float32 add rounds it
        o = _U32(_bits_from_f32(_f32_from_bits(x) + _F32(0.5)) - _U32(0x3F000000))
    else:
        o = _U32(_U32(x + _U32(((15 - 127) << 23) + 0xFFF)) + _U32(_U32(x >> _U32(13)) & _U32(1))) >> _U32(13)
    return _U16(o | sign)


@_jit
def _f32_to_bf16(f: Any) -> Any:
    """The bfloat16 bit pattern of ``f``, rounded to nearest even like ml_dtypes (nan: quiet nan)."""
    u = _bits_from_f32(f)
    if u & _U32(0x7FFFFFFF) > _U32(0x7F800000):
        return _U16(_U32(_U32(u >> _U32(16)) & _U32(0x8000)) | _U32(0x7FC0))
    return _U16(_U32(u + _U32(_U32(0x7FFF) + _U32(_U32(u >> _U32(16)) & _U32(1)))) >> _U32(16))


# Per element representation of the integer codecs' inputs: ``key`` (magnitude bits, ordered like
# the values), ``key_f32`` (a key's value), ``inf_key`` (keys at or above it are inf/nan),
# ``load`` (value as float32) and ``store`` (float32 back to the element).


@_jit
def _key16(e: Any) -> Any:
    return _U32(e) & _U32(0x7FFF)


@_jit
def _bf16_to_f32(e: Any) -> Any:
    return _f32_from_bits(_U32(e) << _U32(16))


@_jit
def _key32(e: Any) -> Any:
    return _U32(e) & _U32(0x7FFFFFFF)


@_jit
def _f32_bits_to_f32(e: Any) -> Any:
    return _f32_from_bits(e)


@_jit
def _f32_to_f32_bits(f: Any) -> Any:
    return _bits_from_f32(f)


@_jit
def _key64(e: Any) -> Any:
    return _bits_from_f32(_F32(e)) & _U32(0x7FFFFFFF)


@_jit
def _f64_to_f32(e: Any) -> Any:
    return _F32(e)


@_jit
def _f32_to_f64(f: Any) -> Any:
    return np.float64(f)


# element dtype, key, key_f32, inf_key, load, store
_REPS: dict[str, tuple[type[np.generic], Any, Any, int, Any, Any]] = {
    "float16": (np.uint16, _key16, _f16_to_f32, 0x7C00, _f16_to_f32, _f32_to_f16),
    "bfloat16": (np.uint16, _key16, _bf16_to_f32, 0x7F80, _bf16_to_f32, _f32_to_bf16),
    "float32": (np.uint32, _key32, _f32_bits_to_f32, 0x7F800000, _f32_bits_to_f32, _f32_to_f32_bits),
    "float64": (np.float64, _key64, _f32_bits_to_f32, 0x7F800000, _f64_to_f32, _f32_to_f64),
}


# ---------------------------------------------------------------------------------------------
# fp8_e4m3
#
# Every kernel takes whole groups only (``values.size`` a multiple of ``g``): the group headers
# (``heads``: bytes) and the codes are separate arguments, so :func:`encode`/:func:`decode` run the
# zero-padded last group as a second call without the loops carrying a tail case. Indices are
# unsigned (no negative-index wraparound, so the inner loops are plain vector loads and stores)
# and no per-group slices are made (each would cost reference-count calls): 1.5x faster. Encoders
# run two passes per chunk of about _CHUNK values (L1-resident) rather than per group: every group's
# maximum first, then the codes, so the loads of the first pass stream from memory without
# waiting on each group's scale (1.7-2.3x faster for groups of 32 on blocks beyond the L2 cache).


def _fp8_pair(uint: type[np.unsignedinteger[Any]], mant: int, sign_shift: int, inf: int) -> tuple[Any, Any]:
    """Encode/decode kernels for one input bit layout (its constants compiled in)."""
    U = uint
    mag = (1 << sign_shift) - 1
    sh = mant - 3
    half = 1 << (sh - 1)
    sign_bit = 1 << sign_shift

    @_jit
    def encode(bits: Any, g: int, heads: Any, codes: Any) -> int:
        """Bit patterns → int16 offsets (little-endian bytes) and codes; -1, or the first inf/nan group."""
        ug = _UI(g)
        ng = bits.size // g
        per = max(1, _CHUNK // g)
        subs = np.empty(per, dtype=np.int32)
        for k0 in range(0, ng, per):
            k1 = min(k0 + per, ng)
            for k in range(k0, k1):
                s = _UI(k) * ug
                amax = U(0)
                for i in range(ug):
                    amax = max(amax, U(bits[s + i] & U(mag)))
                if amax >= U(inf):
                    return k
                off = _I32(amax >> U(mant)) - _I32(_TOP)
                heads[2 * k] = _U8(off & _I32(0xFF))
                heads[2 * k + 1] = _U8((off >> _I32(8)) & _I32(0xFF))
                # ((a + half) >> sh) - (off << 3) == (a - ((off << mant) - half)) >> sh
                subs[k - k0] = _I32(_I32(off << _I32(mant)) - _I32(half))
            for k in range(k0, k1):
                s = _UI(k) * ug
                sub = subs[k - k0]
                for i in range(ug):
                    v = bits[s + i]
                    a = _I32(_I32(v & U(mag)) - sub) >> _I32(sh)
                    sign = _I32(_I32(v >> U(sign_shift)) << _I32(7))
                    # below e4m3's normal range: 0
                    codes[s + i] = _U8((a if a >= _I32(8) else _I32(0)) | sign)
        return -1

    @_jit
    def decode(heads: Any, codes: Any, g: int, out: Any) -> None:
        """Offsets and codes → bit patterns, in the format's wrapping integer arithmetic (like numpy)."""
        ug = _UI(g)
        for k in range(out.size // g):
            off = _I32(np.int16(_U16(_U16(heads[2 * k]) | _U16(_U16(heads[2 * k + 1]) << _U16(8)))))
            offw = U(_U32(off) << _U32(mant))  # wraps, like numpy's shift in the format's width
            s = _UI(k) * ug
            for i in range(ug):
                q = U(codes[s + i])
                m = U(q & U(0x7F))
                w = U(U(U(q >> U(7)) << U(sign_shift)) | U(m << U(sh)))
                w = U(w + offw)
                out[s + i] = U(w & U(sign_bit)) if m == U(0) else w  # zero codes: the bare sign

    return encode, decode


_FP8_LAYOUTS: dict[str, tuple[type[np.unsignedinteger[Any]], int, int, int]] = {
    "float16": (np.uint16, 10, 15, 0x7C00),
    "bfloat16": (np.uint16, 7, 15, 0x7F80),
    "float32": (np.uint32, 23, 31, 0x7F800000),
}


# ---------------------------------------------------------------------------------------------
# int8 / int4


@_jit
def _quantize(x: Any, inv: Any, qmax: Any, nan_code: Any) -> Any:
    """numpy's ``clip(rint(x * inv), -qmax, qmax)`` as an int32; ``nan_code`` where that is NaN.

    NaN comes only from 0 · inf (see the module doc); numpy casts it to the integer 0, which is
    the value 0 for int8 and the code 0 (value -8) for int4.
    """
    r = np.rint(x * inv)
    if r > qmax:
        r = qmax
    elif r < -qmax:
        r = -qmax
    return nan_code if r != r else _I32(r)


def _int_pair(qmax: int, nibbles: bool, rep: str) -> tuple[Any, Any]:
    """Encode/decode kernels of int8 (``nibbles`` False) or int4 for blocks of the dtype ``rep``."""
    _, key, key_f32, inf_key, load, store = _REPS[rep]
    q_f = _F32(qmax)
    nan_code = _I32(-8 if nibbles else 0)

    @_jit
    def encode(src: Any, g: int, heads: Any, codes: Any) -> int:
        """Values → float32 scales (little-endian bytes) and codes; -1, or the first inf/nan group."""
        ug = _UI(g)
        gb = _UI(g // 2 if nibbles else g)
        ng = src.size // g
        per = max(1, _CHUNK // g)
        invs = np.empty(per, dtype=np.float32)
        for k0 in range(0, ng, per):
            k1 = min(k0 + per, ng)
            for k in range(k0, k1):
                s = _UI(k) * ug
                amax = _U32(0)
                for i in range(ug):
                    amax = max(amax, _U32(key(src[s + i])))
                if amax >= _U32(inf_key):
                    return k
                scale = _F32(key_f32(amax) / q_f)
                if scale > _F32(0.0) and scale < _MIN_SCALE:
                    scale = _MIN_SCALE
                invs[k - k0] = _F32(_F32(1.0) / scale) if scale > _F32(0.0) else _F32(0.0)
                u = _bits_from_f32(scale)
                heads[4 * k] = _U8(u & _U32(0xFF))
                heads[4 * k + 1] = _U8((u >> _U32(8)) & _U32(0xFF))
                heads[4 * k + 2] = _U8((u >> _U32(16)) & _U32(0xFF))
                heads[4 * k + 3] = _U8(u >> _U32(24))
            for k in range(k0, k1):
                s = _UI(k) * ug
                cs = _UI(k) * gb
                inv = invs[k - k0]
                if nibbles:
                    for j in range(gb):
                        lo = _quantize(load(src[s + _UI(2) * j]), inv, q_f, nan_code) + _I32(8)
                        hi = _quantize(load(src[s + _UI(2) * j + _UI(1)]), inv, q_f, nan_code) + _I32(8)
                        codes[cs + j] = _U8(lo | (hi << _I32(4)))
                else:
                    for i in range(ug):
                        codes[cs + i] = _U8(_quantize(load(src[s + i]), inv, q_f, nan_code) & _I32(0xFF))
        return -1

    @_jit
    def decode(heads: Any, codes: Any, g: int, out: Any) -> None:
        """Scales and codes → values: ``code · scale`` in float32, then cast like numpy's assignment."""
        ug = _UI(g)
        gb = _UI(g // 2 if nibbles else g)
        for k in range(out.size // g):
            p = 4 * k
            u = (_U32(heads[p]) | _U32(_U32(heads[p + 1]) << _U32(8))
                 | _U32(_U32(heads[p + 2]) << _U32(16)) | _U32(_U32(heads[p + 3]) << _U32(24)))
            scale = _f32_from_bits(u)
            s = _UI(k) * ug
            cs = _UI(k) * gb
            if nibbles:
                for j in range(gb):
                    b = _I32(codes[cs + j])
                    out[s + _UI(2) * j] = store(_F32(_F32(b & _I32(0x0F)) - _F32(8.0)) * scale)
                    out[s + _UI(2) * j + _UI(1)] = store(_F32(_F32(b >> _I32(4)) - _F32(8.0)) * scale)
            else:
                for i in range(ug):
                    out[s + i] = store(_F32(np.int8(codes[cs + i])) * scale)

    return encode, decode


_INT_QMAX = {"int8": (127, False), "int4": (7, True)}
#: bytes of group header (offset or scale) and the number of values per code byte
_LAYOUT = {"fp8_e4m3": (2, 1), "int8": (4, 1), "int4": (4, 2)}


def element_dtype(codec: str, dtype: np.dtype[Any]) -> np.dtype[Any] | None:
    """The dtype ``codec``'s kernels take blocks of ``dtype`` as (fp16/bf16/fp32 as their bit
    patterns, fp64 as it is), or ``None``: no kernel for it."""
    if codec == "fp8_e4m3" and dtype.name not in _FP8_LAYOUTS:
        return None
    rep = _REPS.get(dtype.name)
    return None if rep is None else np.dtype(rep[0])


_lock = threading.Lock()
_ready: dict[tuple[str, str], tuple[Any, Any]] = {}


def kernels(codec: str, dtype: np.dtype[Any]) -> tuple[Any, Any]:
    """``(encode, decode)`` kernels of ``codec`` for blocks of ``dtype``, compiled on first request.

    Each is compiled once, for the most general argument types (read-only, unaligned, contiguous),
    and then closed to further specialisation: read-only payloads, writable blocks and unaligned
    views all run that machine code. Raises :class:`KeyError` for a dtype without kernels.
    """
    key = (codec, dtype.name)
    pair = _ready.get(key)
    if pair is not None:
        return pair
    el = element_dtype(codec, dtype)
    if el is None:
        raise KeyError(key)
    with _lock:
        pair = _ready.get(key)
        if pair is None:
            if codec == "fp8_e4m3":
                enc, dec = _fp8_pair(*_FP8_LAYOUTS[dtype.name])
            else:
                enc, dec = _int_pair(*_INT_QMAX[codec], dtype.name)
            values = types.Array(numba.from_dtype(el), 1, "C", readonly=True, aligned=False)
            dest = types.Array(numba.from_dtype(el), 1, "C", aligned=False)
            bytes_in = types.Array(types.uint8, 1, "C", readonly=True)
            bytes_out = types.Array(types.uint8, 1, "C")
            enc.compile((values, types.intp, bytes_out, bytes_out))
            dec.compile((bytes_in, bytes_in, types.intp, dest))
            enc.disable_compile()
            dec.disable_compile()
            pair = _ready[key] = (enc, dec)
    return pair


def encode(codec: str, dtype: np.dtype[Any], values: np.ndarray[Any, Any], g: int,
           out: np.ndarray[Any, Any]) -> int:
    """Encode the flat ``values`` (``dtype``'s blocks as :func:`element_dtype` views them) into the
    payload ``out`` (exactly its encoded size). Returns -1, or the index of a group holding inf/nan."""
    enc = kernels(codec, dtype)[0]
    hdr, per_byte = _LAYOUT[codec]
    n = values.size
    full, ng = n // g, -(-n // g)
    cb = hdr * ng
    if full:
        bad = int(enc(values[: full * g], g, out[: hdr * full], out[cb : cb + full * g // per_byte]))
        if bad >= 0:
            return bad
    if full < ng:  # the last group, zero-padded
        tail = np.zeros(g, dtype=values.dtype)
        tail[: n - full * g] = values[full * g :]
        if int(enc(tail, g, out[hdr * full : cb], out[cb + full * g // per_byte :])) >= 0:
            return full
    return -1


def decode(codec: str, dtype: np.dtype[Any], payload: np.ndarray[Any, Any], g: int,
           out: np.ndarray[Any, Any]) -> None:
    """Decode ``payload`` (checked length) into the flat ``out`` (``dtype``'s blocks as
    :func:`element_dtype` views them; the padding of the last group is dropped)."""
    dec = kernels(codec, dtype)[1]
    hdr, per_byte = _LAYOUT[codec]
    n = out.size
    full, ng = n // g, -(-n // g)
    cb = hdr * ng
    if full:
        dec(payload[: hdr * full], payload[cb : cb + full * g // per_byte], g, out[: full * g])
    if full < ng:
        tail = np.empty(g, dtype=out.dtype)
        dec(payload[hdr * full : cb], payload[cb + full * g // per_byte :], g, tail)
        out[full * g :] = tail[: n - full * g]


def warm_up(names: Iterable[str] | None = None) -> None:
    """Compile the kernels of ``names`` (default: every codec) for fp16, bf16 and fp32 blocks
    (about 0.5 s per codec and dtype, once; then free)."""
    for codec in _LAYOUT if names is None else [n for n in names if n in _LAYOUT]:
        for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
            kernels(codec, np.dtype(dtype))
