"""Compiled codec kernels vs the numpy implementations: the same bytes for every input format, block
size, special value and payload; the same errors; path selection (default, env var, ``kernels=``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba")

from kvfleet.agent.codecs import (
    CodecInputError,
    Fp8E4M3Codec,
    Int4Codec,
    Int8Codec,
    get_codec,
    warm_up,
)
from kvfleet.agent.codecs import _kernels as kernels_mod
from kvfleet.agent.codecs import fp8 as fp8_mod
from kvfleet.agent.codecs.base import KERNELS_ENV, GroupedCodec, load_kernels

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
FACTORIES: dict[str, Callable[..., GroupedCodec]] = {"fp8_e4m3": Fp8E4M3Codec, "int8": Int8Codec,
                                                     "int4": Int4Codec}
NAMES = sorted(FACTORIES)


def _pair(name: str, group_size: int | None = None) -> tuple[GroupedCodec, GroupedCodec]:
    """(kernel path, numpy path) instances of codec ``name``."""
    kw: dict[str, Any] = {} if group_size is None else {"group_size": group_size}
    kern, ref = FACTORIES[name](kernels=True, **kw), FACTORIES[name](kernels=False, **kw)
    assert kern.kernels and not ref.kernels
    return kern, ref


def _same(name: str, x: npt.NDArray[Any], group_size: int | None = None) -> None:
    """Both paths encode ``x`` to the same bytes, decode either payload to the same bits, and the
    ``*_into`` variants agree."""
    kern, ref = _pair(name, group_size)
    pk, pr = kern.encode(x), ref.encode(x)
    assert pk.dtype == np.uint8 and pk.size == kern.encoded_nbytes(x.dtype, x.shape)
    assert pk.tobytes() == pr.tobytes()
    dk = kern.decode(pr, x.dtype, x.shape)  # each path decodes the other's payload
    dr = ref.decode(pk, x.dtype, x.shape)
    assert dk.dtype == x.dtype and dk.shape == x.shape
    assert dk.tobytes() == dr.tobytes()
    room = np.full(pk.size + 8, 0xAB, dtype=np.uint8)
    assert kern.encode_into(x, room).tobytes() == pk.tobytes()
    assert room[pk.size :].tolist() == [0xAB] * 8
    out = np.empty(x.shape, dtype=x.dtype)
    assert kern.decode_into(pr, out) is out
    assert out.tobytes() == dr.tobytes()


def _with_group_scales(rng: np.random.Generator, n: int, g: int, lo: float,
                       hi: float) -> npt.NDArray[np.float64]:
    """Normal values times a power of two per group (exponent uniform in [lo, hi]), with zeros,
    negative zeros and exact powers of two sprinkled in."""
    x = rng.standard_normal(n)
    x *= np.repeat(np.exp2(np.round(rng.uniform(lo, hi, -(-n // g)))), g)[:n]
    idx = rng.integers(0, n, size=(3, max(1, n // 20)))
    x[idx[0]] = 0.0
    x[idx[1]] = -0.0
    x[idx[2]] = np.exp2(np.round(rng.uniform(lo, hi, idx.shape[1])))
    return x


_RANGES = {"float16": (-26.0, 14.0), "bfloat16": (-135.0, 120.0), "float32": (-150.0, 120.0),
           "float64": (-160.0, 120.0)}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", NAMES)
def test_random_blocks_bit_identical(name: str, dtype: np.dtype[Any]) -> None:
    """Random blocks of every input format, group sizes that do and do not divide the block."""
    rng = np.random.default_rng(11)
    lo, hi = _RANGES[dtype.name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's 0·inf in int groups of tiny scale
        for shape, g in (((4, 8, 128), None), ((3, 37), None), ((5, 7, 33), 32), ((1000,), 6), ((129,), 128)):
            x = _with_group_scales(rng, int(np.prod(shape)), g or 128, lo, hi).astype(dtype).reshape(shape)
            _same(name, x, g)


def _specials(dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Zeros, subnormals, normal-range edges, binade edges (powers of two and their neighbours),
    e4m3 rounding ties, the largest finite values; both signs."""
    info = np.finfo(np.float32) if dtype == np.float64 else ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    tiny, smallest, big = float(info.tiny), float(info.smallest_subnormal), float(info.max)
    one = np.array(1.0, dtype=dtype)
    below_one = float(np.nextafter(one, np.array(0.0, dtype=dtype))) if dtype != BF16 else 1 - 2.0**-8
    vals = [0.0, smallest, 2 * smallest, tiny / 2, tiny - smallest, tiny, 2 * tiny, 1.0, below_one, 2.0,
            1.0625, 1.1875, 0.96875, 1.03125, 3.0, 2.0**-13, 2.0**-14, 2.0**-15, 2.0**-6, 2.0**-7, 2.0**-9,
            2.0**-10, 2.0**8, 255.0, 240.0, 448.0, big / 2, big]
    v = np.array(vals, dtype=np.float64)
    return np.concatenate([v, -v]).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", NAMES)
def test_special_values_bit_identical(name: str, dtype: np.dtype[Any]) -> None:
    """Every ordered pair of special values as a group of two (the pair's maximum sets the scale), and
    the specials scaled by powers of two under a group maximum; an odd count leaves a padded group."""
    s = _specials(dtype)
    pairs = np.stack(np.meshgrid(s, s, indexing="ij"), axis=-1).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _same(name, pairs, 2)
        _same(name, pairs[:-1], 2)
        scaled = (s.astype(np.float64)[:, None]
                  * np.exp2(np.arange(-16, 1))[None, :]).reshape(-1).astype(dtype)
        _same(name, scaled, 32)
        _same(name, np.concatenate([scaled, s])[:-3], 128)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("name", NAMES)
def test_every_16bit_value(name: str, dtype: np.dtype[Any]) -> None:
    """All finite fp16/bf16 bit patterns: shuffled into groups, and each one beside fixed group maxima."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vals = bits.view(dtype)
    vals = vals[np.isfinite(vals.astype(np.float32))]
    rng = np.random.default_rng(12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _same(name, rng.permutation(vals), 32)
        for m in (1.0, 2.0**-14, float(np.array(vals.astype(np.float32)).max())):
            pairs = np.stack([vals, np.full(vals.size, m, dtype=dtype)], axis=-1).reshape(-1)
            _same(name, pairs, 2)


@pytest.mark.parametrize("name", NAMES)
def test_random_float32_bit_patterns(name: str) -> None:
    """Uniformly random finite fp32 bit patterns: every exponent, subnormals included."""
    rng = np.random.default_rng(13)
    bits = rng.integers(0, 1 << 32, size=1 << 15, dtype=np.uint64).astype(np.uint32)
    bits = bits[(bits & 0x7F800000) != 0x7F800000]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _same(name, bits.view(np.float32), 16)
        _same(name, np.sort(bits).view(np.float32)[:-5], 128)  # neighbouring exponents share groups


_F16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
_F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(NAMES),
    st.sampled_from(["float16", "bfloat16", "float32", "float64"]),
    st.data(),
    st.sampled_from([2, 4, 16, 128]),
)
def test_hypothesis_bit_identical(name: str, dtype_name: str, data: st.DataObject, g: int) -> None:
    """Arbitrary finite blocks (any shape up to 3-d, any group size) encode and decode identically."""
    base = np.float16 if dtype_name == "float16" else np.float32
    x = data.draw(hnp.arrays(base, hnp.array_shapes(min_dims=1, max_dims=3, max_side=40),
                             elements=_F16 if base is np.float16 else _F32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = x.astype(np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else dtype_name)
        y[~np.isfinite(y.astype(np.float64))] = 0  # bf16 rounding of fp32's largest values overflows
        _same(name, y, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", NAMES)
def test_random_payloads_decode_identically(name: str, dtype: np.dtype[Any]) -> None:
    """Payloads neither path wrote (random codes and group headers: any int16 offset; finite fp32
    scales of every exponent) decode to the same bits, padded shapes included."""
    rng = np.random.default_rng(14)
    kern, ref = _pair(name)
    for shape in ((4, 256), (3, 37)):
        raw = rng.integers(0, 256, size=kern.encoded_nbytes(dtype, shape), dtype=np.uint8)
        if name != "fp8_e4m3":
            ng = -(-int(np.prod(shape)) // kern.group_size)
            scales = raw[: 4 * ng].view(np.uint32)
            scales[(scales & 0x7F800000) == 0x7F800000] &= 0xBFFFFFFF  # finite
            scales[::2] &= 0xFFFF0000  # short mantissas: products fall exactly halfway (rounding ties)
        payload = raw.tobytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert kern.decode(payload, dtype, shape).tobytes() == ref.decode(payload, dtype, shape).tobytes()
            out = np.empty(shape, dtype=dtype)
            assert (kern.decode_into(memoryview(payload), out).tobytes()
                    == ref.decode(payload, dtype, shape).tobytes())


def test_float_conversions_match_numpy() -> None:
    """The kernels' fp32 → fp16/bf16 casts (nearest even, subnormals, overflow, nan payloads) and
    fp16 → fp32 widening against numpy's and ml_dtypes' casts: random fp32 bit patterns, every
    pattern just around an fp16/bf16 rounding tie, and every fp16."""
    import numba

    @numba.njit
    def narrow(u: Any, o16: Any, ob: Any) -> None:
        for i in range(u.size):
            f = kernels_mod._f32_from_bits(u[i])
            o16[i] = kernels_mod._f32_to_f16(f)
            ob[i] = kernels_mod._f32_to_bf16(f)

    @numba.njit
    def widen(h: Any, o: Any) -> None:
        for i in range(h.size):
            o[i] = kernels_mod._bits_from_f32(kernels_mod._f16_to_f32(h[i]))

    rng = np.random.default_rng(16)
    hi = rng.integers(0, 1 << 19, size=1 << 14, dtype=np.uint64) << 13
    ties = (hi[:, None]
            + np.array([0xFFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x3001], dtype=np.uint64)).reshape(-1)
    hi = rng.integers(0, 1 << 16, size=1 << 14, dtype=np.uint64) << 16
    bties = (hi[:, None]
             + np.array([0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x18000, 0x18001], dtype=np.uint64)).reshape(-1)
    u = np.concatenate([rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64), ties,
                        bties]).astype(np.uint32)
    o16, ob = np.empty(u.size, np.uint16), np.empty(u.size, np.uint16)
    narrow(u, o16, ob)
    f = u.view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        np.testing.assert_array_equal(o16, f.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(ob, f.astype(ml_dtypes.bfloat16).view(np.uint16))
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    h = h[(h & 0x7C00) != 0x7C00]
    o32 = np.empty(h.size, np.uint32)
    widen(h, o32)
    np.testing.assert_array_equal(o32, h.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_raises_on_both_paths(name: str, dtype: np.dtype[Any], bad: float) -> None:
    """inf/nan in the first group, a middle group or the padded last group: CodecInputError."""
    for path in _pair(name):
        for pos in (0, 300, 999):
            x = np.ones(1001, dtype=dtype)
            x[pos] = bad
            with pytest.raises(CodecInputError, match="inf/nan"):
                path.encode(x)
            with pytest.raises(CodecInputError, match="inf/nan"):
                path.encode_into(x, np.empty(path.encoded_nbytes(x.dtype, x.shape), dtype=np.uint8))


@pytest.mark.parametrize("name", NAMES)
def test_float64_beyond_float32_raises_on_both_paths(name: str) -> None:
    """fp64 values past fp32's range turn inf on the way through fp32: an error, not a wrong code."""
    for path in _pair(name):
        with pytest.raises(CodecInputError), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy: overflow in cast
            path.encode(np.array([1.0, 1e39], dtype=np.float64))


@pytest.mark.parametrize("name", NAMES)
def test_read_only_unaligned_and_empty(name: str) -> None:
    """Read-only blocks and payloads, unaligned blocks and outputs, and empty blocks: same bytes."""
    kern, ref = _pair(name)
    x = (np.random.default_rng(15).standard_normal((5, 99)) * 3).astype(np.float16)
    want = ref.encode(x)
    ro = np.frombuffer(x.tobytes(), dtype=np.float16).reshape(x.shape)
    assert not ro.flags.writeable
    raw = np.zeros(x.nbytes + 1, dtype=np.uint8)
    unaligned = raw[1:].view(np.float16).reshape(x.shape)
    unaligned[...] = x
    assert not unaligned.flags.aligned
    for block in (ro, unaligned):
        assert kern.encode(block).tobytes() == want.tobytes()
    out_raw = np.zeros(x.nbytes + 1, dtype=np.uint8)
    out = out_raw[1:].view(np.float16).reshape(x.shape)
    kern.decode_into(want.tobytes(), out)
    assert out.tobytes() == ref.decode(want, x.dtype, x.shape).tobytes()
    for shape in ((0,), (3, 0, 64)):
        empty = np.zeros(shape, dtype=np.float16)
        for path in (kern, ref):
            payload = path.encode(empty)
            assert payload.size == path.encoded_nbytes(empty.dtype, shape) == 0
            assert path.decode(payload, empty.dtype, shape).shape == shape


@pytest.mark.parametrize("name", NAMES)
def test_non_native_byte_order(name: str) -> None:
    """Big-endian blocks encode like their native-order values, on both paths, and decode back to
    big-endian blocks of the same values."""
    x = np.linspace(-3, 3, 300).astype(">f4")
    _same(name, x, 32)
    native = x.astype(np.float32)
    for path in _pair(name, 32):
        payload = path.encode(x)
        assert payload.tobytes() == path.encode(native).tobytes()
        y = path.decode(payload, x.dtype, x.shape)
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(y.astype(np.float32), path.decode(payload, native.dtype, x.shape))


def test_path_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default: the kernels; KVFLEET_CODEC_KERNELS=numpy forces numpy at construction; get_codec passes
    ``kernels=`` through; the shared default instances run the kernels unless the env var said numpy."""
    forced = os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy"  # as the process started
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert all(f().kernels for f in FACTORIES.values())
    monkeypatch.setenv(KERNELS_ENV, "numpy")
    assert not any(f().kernels for f in FACTORIES.values())
    assert Fp8E4M3Codec(kernels=True).kernels
    monkeypatch.delenv(KERNELS_ENV)
    int8 = get_codec("int8", kernels=False)
    assert isinstance(int8, Int8Codec) and not int8.kernels
    for name in NAMES:  # the instances the error-bound and attention tests use
        codec = get_codec(name)
        assert isinstance(codec, GroupedCodec) and codec.kernels is not forced


def test_without_numba_the_numpy_path_runs() -> None:
    """Where numba cannot be imported the codecs fall back to numpy (one warning); ``kernels=True``
    raises ImportError."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import numpy as np, pytest\n"
        "from kvfleet.agent.codecs import Fp8E4M3Codec, get_codec, warm_up\n"
        "c = get_codec('fp8_e4m3'); x = np.linspace(-2, 2, 300, dtype=np.float16)\n"
        "assert not c.kernels and warm_up() is False\n"
        "assert np.abs(c.decode(c.encode(x), x.dtype, x.shape) - x).max() < 0.2\n"
        "with pytest.raises(ImportError): Fp8E4M3Codec(kernels=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != KERNELS_ENV}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("codec kernels unavailable") == 1


def test_kernels_release_the_gil_and_match_fp8_constants() -> None:
    """Every kernel is compiled nogil, once (no per-call specialisation); the fp8 offset base matches."""
    assert kernels_mod._TOP == fp8_mod._TOP
    for name in NAMES:
        for dtype in DTYPES[:3]:
            for kernel in kernels_mod.kernels(name, dtype):
                assert kernel.targetoptions["nogil"] is True
                assert len(kernel.signatures) == 1


def test_warm_up_twice_is_cheap() -> None:
    """warm_up compiles once; it reports False where the numpy implementations are forced."""
    kernels_mod.warm_up()
    t0 = time.perf_counter()
    kernels_mod.warm_up()
    assert time.perf_counter() - t0 < 0.05
    assert warm_up() is (load_kernels() is not None)
