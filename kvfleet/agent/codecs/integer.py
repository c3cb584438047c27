"""``int8`` and ``int4``: symmetric integer codes with one float32 scale per group.

For a group of ``group_size`` values with largest magnitude ``amax``:
``scale = amax / qmax`` (``qmax`` = 127 for int8, 7 for int4), ``q = round(x / scale)``.
int4 stores ``q + 8`` (1..15) two values per byte, low nibble first.

Payload: ``[float32 scale per group][codes]`` (int8: one byte per value; int4:
half a byte per value).

Error bound (tested, docs/tiers.md): ``|decode(encode(x)) - x| <= scale / 2``,
i.e. ``amax / 254`` for int8 and ``amax / 14`` for int4, plus one ulp of the
output dtype.
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
)

_CHUNK_VALUES = 1 << 15


class _GroupIntCodec(GroupedCodec):
    """Shared layout and chunked loop of the integer codecs."""

    bits: ClassVar[int]
    qmax: ClassVar[int]

    def __init__(self, group_size: int) -> None:
        if group_size <= 0 or group_size % 2:
            raise ValueError(f"group_size must be a positive even number, got {group_size}")
        self._set_groups(group_size, _CHUNK_VALUES)

    def encoded_nbytes(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> int:
        _, ng, n_pad = self._layout(shape)
        return 4 * ng + n_pad * self.bits // 8

    def encode(self, block: npt.NDArray[Any]) -> Payload:
        check_float(block, self.name)
        n, ng, n_pad = self._layout(block.shape)
        flat = np.ascontiguousarray(block).reshape(-1)
        if n_pad != n:
            flat = np.concatenate([flat, np.zeros(n_pad - n, dtype=flat.dtype)])
        out = np.empty(self.encoded_nbytes(block.dtype, block.shape), dtype=np.uint8)
        scales = out[: 4 * ng].view(np.float32)
        codes = out[4 * ng :]
        g = self.group_size
        for start in range(0, n_pad, self._chunk):
            x = flat[start : start + self._chunk].astype(np.float32).reshape(-1, g)
            amax = np.abs(x).max(axis=1)
            if not np.isfinite(amax).all():
                raise CodecInputError(f"codec {self.name!r} cannot encode inf/nan values")
            scale = amax / self.qmax
            inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
            g0 = start // g
            scales[g0 : g0 + len(scale)] = scale
            x *= inv[:, None]
            np.rint(x, out=x)
            np.clip(x, -self.qmax, self.qmax, out=x)
            self._store(x.reshape(-1), codes, start)
        return out

    def decode(self, payload: Payload | bytes | memoryview, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        n, ng, n_pad = self._layout(shape)
        buf = as_payload(payload)
        if buf.size != self.encoded_nbytes(dt, shape):
            raise CorruptPayloadError(f"{self.name} payload of {buf.size} bytes cannot hold {shape} {dt}")
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

    def __init__(self, group_size: int = 128) -> None:
        super().__init__(group_size)

    def _store(self, q: npt.NDArray[np.float32], codes: Payload, start: int) -> None:
        np.copyto(codes[start : start + len(q)].view(np.int8), q, casting="unsafe")

    def _load(self, codes: Payload, start: int, stop: int) -> npt.NDArray[np.float32]:
        return codes[start:stop].view(np.int8).astype(np.float32)


class Int4Codec(_GroupIntCodec):
    """Symmetric int4 (codes 1..15 around 8), two per byte, per-group float32 scale (default 32)."""

    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4
    qmax: ClassVar[int] = 7

    def __init__(self, group_size: int = 32) -> None:
        super().__init__(group_size)

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

