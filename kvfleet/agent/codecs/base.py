"""The codec interface: a KV block (ndarray) ↔ an encoded byte payload.

A codec turns a float block into a flat ``uint8`` payload and back. The
payload alone does not say what it decodes to: the block's ``dtype`` and
``shape`` travel in the record header next to the codec name (see
:mod:`kvfleet.agent.tiers.record`), and :meth:`Codec.decode` takes them back.

Quantizing codecs work on *groups* of ``group_size`` consecutive values of
the flattened block (the last axis is ``head_dim`` in the usual KV layout, so
a group size dividing ``head_dim`` gives per-head scales). A block whose size
is not a multiple of the group size is zero-padded; the padding is dropped
again on decode.
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

Payload = npt.NDArray[np.uint8]

log = logging.getLogger(__name__)

#: ``numpy`` forces the numpy implementations even where the compiled kernels are available.
KERNELS_ENV = "KVFLEET_CODEC_KERNELS"


class CodecError(ValueError):
    """Base of codec errors."""


class UnknownCodecError(CodecError):
    """A codec name is not registered; the message lists the known names."""


class CodecInputError(CodecError):
    """A block cannot be encoded by this codec (wrong dtype, non-finite values)."""


class CorruptPayloadError(CodecError):
    """A payload has the wrong length for the dtype/shape it claims to decode to."""


class Codec(ABC):
    """Encode a block to bytes and back. Implementations are stateless and thread-safe."""

    name: ClassVar[str]
    #: ``True`` when decode(encode(x)) == x bit for bit.
    lossless: ClassVar[bool] = False

    @abstractmethod
    def encode(self, block: npt.NDArray[Any]) -> Payload:
        """The encoded bytes of ``block`` as a contiguous ``uint8`` array.

        It may share memory with ``block`` (``none`` does): callers that keep it
        beyond the block's lifetime copy it, as every store does on write.
        """

    @abstractmethod
    def decode(self, payload: Payload | bytes | memoryview, dtype: npt.DTypeLike,
               shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """The block back, with ``dtype`` and ``shape`` (raises :class:`CorruptPayloadError`)."""

    @abstractmethod
    def encoded_nbytes(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> int:
        """Exactly how many bytes :meth:`encode` produces for such a block."""

    def encode_into(self, block: npt.NDArray[Any], out: Payload) -> Payload:
        """:meth:`encode` into ``out`` (at least :meth:`encoded_nbytes` bytes, e.g. a store's slot).

        Returns the written prefix of ``out``. This default encodes then copies; codecs that can
        write in place override it (``fp8_e4m3``).
        """
        payload = self.encode(block)
        dest = as_payload(out)[: payload.nbytes]
        if dest.nbytes != payload.nbytes:
            raise CodecInputError(f"output of {out.nbytes} bytes cannot hold {payload.nbytes} encoded bytes")
        np.copyto(dest, payload.reshape(-1).view(np.uint8))
        return dest

    def decode_into(self, payload: Payload | bytes | memoryview, out: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """:meth:`decode` into ``out``, whose dtype and shape say what to decode to; returns ``out``.

        This default decodes then copies; codecs that can write in place override it.
        """
        np.copyto(out, self.decode(payload, out.dtype, out.shape))
        return out



class GroupedCodec(Codec):
    """A quantizing codec over groups of ``group_size`` values, processed in chunks of whole groups."""

    group_size: int
    _chunk: int
    #: the compiled kernels (:mod:`._kernels`), or ``None``: the numpy implementation.
    _kern: ModuleType | None = None

    @property
    def kernels(self) -> bool:
        """Whether this instance runs the compiled kernels (else the numpy implementation)."""
        return self._kern is not None

    def _set_groups(self, group_size: int, chunk_values: int) -> None:
        """Use groups of ``group_size`` (checked by the caller) and chunks of about ``chunk_values``
        values."""
        self.group_size = group_size
        self._chunk = max(group_size, (chunk_values // group_size) * group_size)

    def _layout(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(values, groups, padded values)`` of a block of ``shape`` (the last group zero-padded)."""
        n = num_values(shape)
        ng = -(-n // self.group_size)
        return n, ng, ng * self.group_size


_kernels_failed = False


def load_kernels(kernels: bool | None = None) -> ModuleType | None:
    """The compiled kernels module, or ``None`` for the numpy implementations.

    ``kernels``: ``None`` picks the kernels when numba imports and ``KVFLEET_CODEC_KERNELS`` is not
    ``numpy``; ``False`` always numpy; ``True`` the kernels or :class:`ImportError`.
    """
    global _kernels_failed
    if kernels is False or (kernels is None and os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy"):
        return None
    if sys.byteorder != "little":  # the kernels read and write group headers as little-endian bytes
        if kernels:
            raise ImportError("the codec kernels need a little-endian machine")
        return None
    try:
        from kvfleet.agent.codecs import _kernels
    except Exception as exc:  # numba missing, or unusable with this numpy/llvm
        if kernels:
            raise ImportError(f"codec kernels unavailable: {exc}") from exc
        if not _kernels_failed:
            _kernels_failed = True
            log.warning("codec kernels unavailable (%s): using the numpy implementations (pip install "
                        "'kvfleet[kernels]')", exc)
        return None
    return _kernels


def as_payload(buf: Payload | bytes | memoryview | bytearray) -> Payload:
    """A read-only ``uint8`` view of ``buf`` (no copy)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def num_values(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_float(block: npt.NDArray[Any], codec: str) -> None:
    if block.dtype.kind != "f" and block.dtype.name not in ("bfloat16",):
        raise CodecInputError(f"codec {codec!r} encodes float blocks, got dtype {block.dtype}")
