"""Codecs: round trips, documented elementwise error bounds, fp8 bytes are real e4m3 (ml_dtypes),
attention outputs on random Q/K/V against the unquantized result, sizes, registry and bad input."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from kvfleet.agent.codecs import (
    CODECS,
    CodecInputError,
    CorruptPayloadError,
    Fp8E4M3Codec,
    UnknownCodecError,
    get_codec,
)

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _block(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...] = (2, 2, 16, 4, 64),
           scale: float = 3.0) -> npt.NDArray[Any]:
    x = rng.standard_normal(shape) * scale
    # a few groups with a very different range, and exact zeros
    flat = x.reshape(-1)
    flat[:64] *= 1e-3
    flat[200:230] = 0.0
    return x.astype(dtype)


def _group_amax(x: npt.NDArray[np.float64], g: int) -> npt.NDArray[np.float64]:
    flat = np.abs(x.reshape(-1))
    pad = (-len(flat)) % g
    flat = np.concatenate([flat, np.zeros(pad)])
    amax = flat.reshape(-1, g).max(axis=1)
    return np.repeat(amax, g)[: x.size].reshape(x.shape)


def _ulp(dtype: Any, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    eps = 2.0**-7 if dtype is ml_dtypes.bfloat16 else float(np.finfo(dtype).eps)
    return np.abs(x) * eps


@pytest.mark.parametrize("dtype", FLOATS)
def test_none_is_lossless(dtype: Any) -> None:
    """``none`` returns the exact bytes, in the block's dtype and shape."""
    x = _block(np.random.default_rng(1), dtype)
    c = get_codec("none")
    y = c.decode(c.encode(x), x.dtype, x.shape)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_error_bound(dtype: Any) -> None:
    """fp8_e4m3: |err| <= 2^-4·|x| + 2^-13·group_amax (+ one ulp of the output dtype)."""
    codec = get_codec("fp8_e4m3")
    assert isinstance(codec, Fp8E4M3Codec)
    x = _block(np.random.default_rng(2), dtype)
    y = codec.decode(codec.encode(x), x.dtype, x.shape)
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    bound = 2.0**-4 * np.abs(xf) + 2.0**-13 * _group_amax(xf, codec.group_size) + _ulp(dtype, xf)
    assert np.all(np.abs(yf - xf) <= bound)
    assert np.all((yf == 0) | (np.sign(yf) == np.sign(xf)))


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_integer_error_bound(name: str, qmax: int, dtype: Any) -> None:
    """int8/int4: |err| <= scale/2 = group_amax/(2·qmax) (+ one ulp of the output dtype)."""
    codec = get_codec(name)
    x = _block(np.random.default_rng(3), dtype)
    y = codec.decode(codec.encode(x), x.dtype, x.shape)
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    amax = _group_amax(xf, codec.group_size)  # type: ignore[attr-defined]
    bound = amax / (2 * qmax) * (1 + 1e-6) + _ulp(dtype, xf) + _ulp(dtype, amax)
    assert np.all(np.abs(yf - xf) <= bound)


def test_fp8_codes_are_ml_dtypes_e4m3() -> None:
    """The code bytes viewed as ml_dtypes.float8_e4m3fn, times the group's power of two, are the decoded
    values."""
    codec = Fp8E4M3Codec(group_size=64)
    x = (np.random.default_rng(4).standard_normal((8, 64)) * 3).astype(np.float16)
    x[x == 0] = 1.0  # fp16 subnormal inputs keep their bit pattern, not an e4m3 value (see codec doc)
    x[np.abs(x) < 2.0**-14] = 2.0**-14
    payload = codec.encode(x)
    ng = x.size // 64
    offsets = payload[: 2 * ng].view(np.int16).astype(np.float64)
    codes = payload[2 * ng :].view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(ng, 64)
    # code exponent e (bias 7) maps to fp16 exponent e + offset (bias 15): value = fp8 · 2^(offset - 8)
    via_ml_dtypes = codes * np.exp2(offsets - 8)[:, None]
    decoded = codec.decode(payload, x.dtype, x.shape).astype(np.float64).reshape(ng, 64)
    np.testing.assert_array_equal(via_ml_dtypes, decoded)
    assert not np.isnan(codes).any()


def _attention(q: npt.NDArray[np.float64], k: npt.NDArray[np.float64],
               v: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    s = q @ k.T / np.sqrt(q.shape[-1])
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = p @ v
    return out


@pytest.mark.parametrize(("name", "min_cosine"), [("fp8_e4m3", 0.999), ("int8", 0.9999), ("int4", 0.99)])
def test_attention_cosine(name: str, min_cosine: float) -> None:
    """Attention over K/V that went through the codec stays close to fp16 attention (cosine of outputs)."""
    codec = get_codec(name)
    rng = np.random.default_rng(5)
    worst = 1.0
    for _ in range(6):
        q, k, v = (rng.standard_normal(shape).astype(np.float16)
                   for shape in ((64, 128), (512, 128), (512, 128)))
        k2 = codec.decode(codec.encode(k), k.dtype, k.shape)
        v2 = codec.decode(codec.encode(v), v.dtype, v.shape)
        ref = _attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
        out = _attention(q.astype(np.float64), k2.astype(np.float64), v2.astype(np.float64))
        cos = float((ref * out).sum() / np.linalg.norm(ref) / np.linalg.norm(out))
        worst = min(worst, cos)
    assert worst >= min_cosine


@pytest.mark.parametrize(("name", "max_ratio"), [("none", 1.0), ("fp8_e4m3", 0.52), ("int8", 0.52),
                                                 ("int4", 0.32)])
def test_encoded_size(name: str, max_ratio: float) -> None:
    """encoded_nbytes is exact, and quantized payloads are smaller than fp16."""
    codec = get_codec(name)
    x = _block(np.random.default_rng(6), np.float16)
    payload = codec.encode(x)
    assert payload.nbytes == codec.encoded_nbytes(x.dtype, x.shape)
    assert payload.nbytes <= max_ratio * x.nbytes


@pytest.mark.parametrize("name", sorted(CODECS))
def test_odd_sizes_round_trip(name: str) -> None:
    """Blocks whose size is not a multiple of the group size are padded and unpadded."""
    codec = get_codec(name)
    x = np.linspace(-2, 2, 3 * 37, dtype=np.float32).reshape(3, 37)
    y = codec.decode(codec.encode(x), x.dtype, x.shape)
    assert y.shape == x.shape
    assert np.abs(y - x).max() <= 2 / 7


def test_unknown_codec_lists_known_names() -> None:
    with pytest.raises(UnknownCodecError, match=r"fp8_e4m3.*int4.*int8.*none"):
        get_codec("fp4")


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "int4"])
def test_bad_input(name: str) -> None:
    """Non-float blocks, non-finite values and short payloads are typed errors."""
    codec = get_codec(name)
    with pytest.raises(CodecInputError):
        codec.encode(np.arange(256, dtype=np.int32))
    x = np.ones(256, dtype=np.float16)
    x[7] = np.inf
    with pytest.raises(CodecInputError):
        codec.encode(x)
    good = codec.encode(np.ones(256, dtype=np.float16))
    with pytest.raises(CorruptPayloadError):
        codec.decode(good[:-1], np.float16, (256,))


@pytest.mark.parametrize("name", ["none", "fp8_e4m3", "int8", "int4"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_encode_into_and_decode_into_match(name: str, dtype: Any) -> None:
    """``encode_into``/``decode_into`` write the same bytes as ``encode``/``decode``, and nothing past
    them."""
    codec = get_codec(name)
    x = _block(np.random.default_rng(8), dtype, shape=(3, 7, 64))
    payload = codec.encode(x)
    room = np.full(payload.nbytes + 16, 0xAB, dtype=np.uint8)
    written = codec.encode_into(x, room)
    assert written.tobytes() == payload.tobytes()
    assert room[payload.nbytes :].tolist() == [0xAB] * 16
    out = np.empty(x.shape, dtype=x.dtype)
    assert codec.decode_into(payload, out) is out
    assert out.tobytes() == codec.decode(payload, x.dtype, x.shape).tobytes()
    with pytest.raises(CodecInputError):
        codec.encode_into(x, np.empty(payload.nbytes - 1, dtype=np.uint8))


def test_fp8_decodes_any_code_like_the_reference() -> None:
    """Every e4m3 code, ±0 included, with plausible group exponents decodes to code_value · 2^(offset-8)
    (subnormal and NaN codes, which encode never writes, are not checked)."""
    codec = Fp8E4M3Codec(group_size=256)
    codes = np.arange(256, dtype=np.uint8)
    for off in (0, 5, 15):
        payload = np.concatenate([np.array([off], dtype=np.int16).view(np.uint8), codes])
        got = codec.decode(payload, np.float16, (256,)).astype(np.float64)
        ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** (off - 8)
        normal = ((codes & 0x78) != 0) & ((codes & 0x7F) != 0x7F)  # exponent > 0, not NaN
        np.testing.assert_array_equal(got[normal], ref[normal])
        zero = (codes & 0x7F) == 0
        assert np.all(got[zero] == 0) and np.signbit(got[zero]).tolist() == [False, True]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_integer_tiny_groups_stay_in_bound(name: str, qmax: int, dtype: Any, kernels: bool) -> None:
    """A group whose amax/qmax is below float32's smallest normal (1/scale would overflow) codes with
    that smallest normal as its step: zeros stay zero, signs stay, |err| <= max(scale/2, tiny/2)."""
    from kvfleet.agent.codecs.integer import Int4Codec, Int8Codec

    codec = (Int8Codec if name == "int8" else Int4Codec)(kernels=kernels)
    tiny = float(np.finfo(np.float32).tiny)
    g = codec.group_size
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.uniform(-1, 1, g) * tiny * 2.0 ** -k for k in (0, 3, 6, 9)]
                       + [np.zeros(g), rng.standard_normal(g)])
    x = x.astype(dtype)
    x[1] = 0.0
    y = codec.decode(codec.encode(x), x.dtype, x.shape)
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    assert np.all(np.isfinite(yf))
    assert yf[1] == 0.0 and np.all(yf[4 * g : 5 * g] == 0.0)
    amax = _group_amax(xf, g)
    bound = np.maximum(amax / (2 * qmax), tiny / 2) * (1 + 1e-6) + _ulp(dtype, xf) + _ulp(dtype, amax)
    assert np.all(np.abs(yf - xf) <= bound)
