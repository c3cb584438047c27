"""The ``none`` codec: the block's own bytes, unchanged (lossless)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvfleet.agent.codecs.base import Codec, CorruptPayloadError, Payload, as_payload, num_values


class IdentityCodec(Codec):
    """Stores the raw bytes; decode is a zero-copy view when the payload allows it."""

    name: ClassVar[str] = "none"
    lossless: ClassVar[bool] = True

    def encode(self, block: npt.NDArray[Any]) -> Payload:
        """A byte view of ``block`` (a copy only when it is not contiguous)."""
        return np.asarray(block).ravel().view(np.uint8)  # ravel copies only what is not C-contiguous

    def decode(self, payload: Payload | bytes | memoryview, dtype: npt.DTypeLike,
               shape: tuple[int, ...]) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        buf = as_payload(payload)
        if buf.size != num_values(shape) * dt.itemsize:
            raise CorruptPayloadError(f"payload of {buf.size} bytes cannot hold {shape} {dt}")
        return buf.view(dt).reshape(shape)

    def encoded_nbytes(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> int:
        return num_values(shape) * np.dtype(dtype).itemsize
