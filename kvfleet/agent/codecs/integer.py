"""``int8`` and ``int4``: symmetric integer codes with one float32 scale per group.

For a group of ``group_size`` values with largest magnitude ``amax``:
``scale = amax / qmax`` (``qmax`` = 127 for int8, 7 for int4), ``q = round(x / scale)``.
int4 stores ``q + 8`` (1..15) two values per byte, low nibble first.

Payload: ``[float32 scale per group][codes]`` (int8: one byte per value; int4:
half a byte per value).

Two implementations give the same bytes: compiled kernels (:mod:`._kernels`,
numba: two fused passes per chunk of groups, the GIL released) for fp16, bf16, fp32 and
fp64 blocks, and numpy in chunks, used for other dtypes, when numba is missing
or when ``KVFLEET_CODEC_KERNELS=numpy`` (chosen when the codec is built;
``kernels=`` overrides it).

Error bound (tested, docs/tiers.md): ``|decode(encode(x)) - x| <= scale / 2``,
i.e. ``amax / 254`` for int8 and ``amax / 14`` for int4, plus one ulp of the
output dtype. A nonzero scale is at least float32's smallest normal
(1.18e-38), so in a group whose ``amax`` is below ``qmax`` times that the step
is 1.18e-38 (the error stays below 5.9e-39).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

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

_CHUNK_VALUES = 1 << 15
#: smallest nonzero group scale: float32's smallest normal (1/scale must not overflow to inf).
_MIN_SCALE = np.float32(np.finfo(np.float32).tiny)


class _GroupIntCodec(GroupedCodec):
    """Shared layout and chunked loop of the integer codecs."""

    bits: ClassVar[int]
    qmax: ClassVar[int]

    def __init__(self, group_size: int, kernels: bool | None) -> None:
        if group_size <= 0 or group_size % 2:
            raise ValueError(f"group_size must be a positive even number, got {group_size}")
        self._set_groups(group_size, _CHUNK_VALUES)
        self._kern = load_kernels(kernels)

    def _kernel_view(self, dtype: np.dtype[Any]) -> np.dtype[Any] | None:
        """The dtype the kernels view blocks of ``dtype`` as, or ``None``: the numpy implementation."""
        if self._kern is None or not dtype.isnative:  # the kernels read native-order values
            return None
        view: np.dtype[Any] | None = self._kern.element_dtype(self.name, dtype)
        return view

    def encoded_nbytes(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> int:
        _, ng, n_pad = self._layout(shape)
        return 4 * ng + n_pad * self.bits // 8

    def encode(self, block: npt.NDArray[Any]) -> Payload:
        check_float(block, self.name)
        out = np.empty(self.encoded_nbytes(block.dtype, block.shape), dtype=np.uint8)
        view = self._kernel_view(block.dtype)
        if view is not None:
            return self._encode_kernel(block, view, out)
        n, ng, n_pad = self._layout(block.shape)
        flat = np.ascontiguousarray(block).reshape(-1)
        if n_pad != n:
            flat = np.concatenate([flat, np.zeros(n_pad - n, dtype=flat.dtype)])
        scales = out[: 4 * ng].view(np.float32)
        codes = out[4 * ng :]
        g = self.group_size
        for start in range(0, n_pad, self._chunk):
            x = flat[start : start + self._chunk].astype(np.float32).reshape(-1, g)
            amax = np.abs(x).max(axis=1)
            if not np.isfinite(amax).all():
                raise CodecInputError(f"codec {self.name!r} cannot encode inf/nan values")
            scale = amax / self.qmax
            # a nonzero scale is at least float32's smallest normal, so 1/scale stays finite
            np.maximum(scale, _MIN_SCALE, out=scale, where=scale > 0)
            inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
            g0 = start // g
            scales[g0 : g0 + len(scale)] = scale
            x *= inv[:, None]
            np.rint(x, out=x)
            np.clip(x, -self.qmax, self.qmax, out=x)
            self._store(x.reshape(-1), codes, start)
        return out

    def encode_into(self, block: npt.NDArray[Any], out: Payload) -> Payload:
        """Encode straight into ``out`` with the kernels (numpy: encode, then copy)."""
        check_float(block, self.name)
        view = self._kernel_view(block.dtype)
        if view is None:
            return super().encode_into(block, out)
        size = self.encoded_nbytes(block.dtype, block.shape)
        dest = as_payload(out)[:size]
        if dest.nbytes != size:
            raise CodecInputError(f"output of {out.nbytes} bytes cannot hold {size} encoded bytes")
        return self._encode_kernel(block, view, dest)

    def _encode_kernel(self, block: npt.NDArray[Any], view: np.dtype[Any], out: Payload) -> Payload:
        assert self._kern is not None
        values = np.ascontiguousarray(block).reshape(-1).view(view)
        if self._kern.encode(self.name, block.dtype, values, self.group_size, out) >= 0:
            raise CodecInputError(f"codec {self.name!r} cannot encode inf/nan values")
        return out

    def decode(self, payload: Payload | bytes | memoryview, dtype: npt.DTypeLike,
               shape: tuple[int, ...]) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        n, ng, n_pad = self._layout(shape)
        buf = as_payload(payload)
        if buf.size != self.encoded_nbytes(dt, shape):
            raise CorruptPayloadError(f"{self.name} payload of {buf.size} bytes cannot hold {shape} {dt}")
        view = self._kernel_view(dt)
        if view is not None:
            assert self._kern is not None
            block = np.empty(shape, dtype=dt)
            self._kern.decode(self.name, dt, buf, self.group_size, block.reshape(-1).view(view))
            return block
        scales = buf[: 4 * ng].view(np.float32)
        codes = buf[4 * ng :]
        out = np.empty(n_pad, dtype=dt)
        g = self.group_size
        for start in range(0, n_pad, self._chunk):
            stop = min(start + self._chunk, n_pad)
            q = self._load(codes, start, stop).reshape(-1, g)
            g0 = start // g
            q *= scales[g0 : g0 + q.shape[0], None]
            out[start:stop] = q.reshape(-1)
        return out[:n].reshape(shape)

    def decode_into(self, payload: Payload | bytes | memoryview, out: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Decode straight into ``out`` with the kernels when it is contiguous (else decode, then copy)."""
        view = self._kernel_view(out.dtype)
        if view is None or not out.flags.c_contiguous or not out.flags.writeable:
            return super().decode_into(payload, out)
        assert self._kern is not None
        buf = as_payload(payload)
        if buf.size != self.encoded_nbytes(out.dtype, out.shape):
            raise CorruptPayloadError(
                f"{self.name} payload of {buf.size} bytes cannot hold {out.shape} {out.dtype}")
        self._kern.decode(self.name, out.dtype, buf, self.group_size, out.reshape(-1).view(view))
        return out

    @abstractmethod
    def _store(self, q: npt.NDArray[np.float32], codes: Payload, start: int) -> None:
        """Write the rounded values ``q`` (already in [-qmax, qmax]) as codes from value ``start``."""

    @abstractmethod
    def _load(self, codes: Payload, start: int, stop: int) -> npt.NDArray[np.float32]:
        """The signed integer values of codes ``start:stop`` as float32."""


class Int8Codec(_GroupIntCodec):
    """Symmetric int8, per-group float32 scale (default groups of 128)."""

    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8
    qmax: ClassVar[int] = 127

    def __init__(self, group_size: int = 128, *, kernels: bool | None = None) -> None:
        """``kernels``: ``None`` (default) the compiled kernels when available, ``False`` numpy,
        ``True`` the kernels or :class:`ImportError`."""
        super().__init__(group_size, kernels)

    def _store(self, q: npt.NDArray[np.float32], codes: Payload, start: int) -> None:
        np.copyto(codes[start : start + len(q)].view(np.int8), q, casting="unsafe")

    def _load(self, codes: Payload, start: int, stop: int) -> npt.NDArray[np.float32]:
        return codes[start:stop].view(np.int8).astype(np.float32)


class Int4Codec(_GroupIntCodec):
    """Symmetric int4 (codes 1..15 around 8), two per byte, per-group float32 scale (default 32)."""

    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4
    qmax: ClassVar[int] = 7

    def __init__(self, group_size: int = 32, *, kernels: bool | None = None) -> None:
        """``kernels``: as for :class:`Int8Codec`."""
        super().__init__(group_size, kernels)

    def _store(self, q: npt.NDArray[np.float32], codes: Payload, start: int) -> None:
        u = (q + 8).astype(np.uint8)
        packed = u[0::2] | (u[1::2] << 4)
        codes[start // 2 : start // 2 + len(packed)] = packed

    def _load(self, codes: Payload, start: int, stop: int) -> npt.NDArray[np.float32]:
        packed = codes[start // 2 : stop // 2]
        q = np.empty(stop - start, dtype=np.float32)
        q[0::2] = packed & 0x0F
        q[1::2] = packed >> 4
        q -= 8
        return q

