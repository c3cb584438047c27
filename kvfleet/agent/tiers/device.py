"""The gpu tier on a torch device: slots in torch ``uint8`` tensors (CUDA HBM when there is CUDA).

:class:`TorchDeviceStore` (backend ``torch``) uses the slot scheme of
:class:`~.memory.SlotStore` (fixed slots, slabs allocated on first need, slot
leases, one lock), with its slabs on ``spec.device``. The manager and the
codecs speak numpy, so the store does too:

- ``write(meta, payload)`` copies host → device into a slot;
- ``read`` / ``lease`` return a host copy of the slot (device → host, synchronized);
- ``reserve(nbytes)`` hands out a host buffer (pinned with CUDA) that ``commit``
  copies into the reserved device slot (``abort`` drops it).

An engine uses :meth:`TorchDeviceStore.tensor`: a zero-copy ``uint8`` view of a
block's slot on the device, valid until the block is deleted.

With CUDA, host ↔ device copies go through one pinned staging buffer per store
(grown to the largest copy), then the stream is synchronized. On the torch
``cpu`` device (``device: cpu``, used by the tests) the same code runs on host
memory and the store reports itself as a stand-in for HBM.

torch is imported on first use, never by ``import kvfleet`` nor by the arena
path; see :func:`resolve_device` for how ``device`` is read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvfleet.agent.codecs import Payload
from kvfleet.agent.tiers.errors import TierError, TierFullError
from kvfleet.agent.tiers.memory import SlotStore, memory_spec
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import TierSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class DeviceError(TierError, ValueError):
    """The torch device a tier asks for cannot be used here (no torch, no CUDA, no such device)."""


#: Paths that exist when a GPU driver torch could use is loaded (NVIDIA, ROCm, WSL2); without any of
#: them device ``auto`` does not import torch (about 1 s and 250 MB of RSS) just to learn there is no CUDA.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    return any(os.path.exists(p) for p in GPU_DRIVER_PATHS)


def torch_missing() -> str | None:
    """Why torch cannot be imported here (not installed, broken install), or ``None`` when it can."""
    try:
        import torch  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_device(device: str, *, required: bool = False) -> str | None:
    """The torch device named by a ``MemoryTierSpec.device`` value, or ``None`` for the host arena.

    ``auto`` → ``cuda:<current>`` when a GPU driver is present (:data:`GPU_DRIVER_PATHS`), torch
    imports and CUDA is available, else ``None``
    (``required``: the torch backend was asked for explicitly, so this is a :class:`DeviceError`);
    ``cuda`` / ``cuda:N`` → that device, :class:`DeviceError` when there is no torch, no CUDA or no
    such device; ``cpu`` → ``cpu`` (:class:`DeviceError` without torch); ``host`` → ``None``.
    """
    if device == "host":
        if required:
            raise DeviceError("the torch backend needs a torch device; device 'host' is the host arena")
        return None
    if device == "auto" and not required and not gpu_driver_present():
        return None
    missing = torch_missing()
    if device == "auto":
        if missing is None:
            import torch

            if torch.cuda.is_available():
                return f"cuda:{torch.cuda.current_device()}"
        elif "No module named 'torch'" not in missing:
            log.warning("gpu tier: torch does not import (%s); using the host arena", missing)
        if required:
            why = ("torch.cuda.is_available() is false" if missing is None
                   else f"torch does not import ({missing})")
            raise DeviceError(
                f"gpu tier: backend 'torch' with device 'auto' needs CUDA, and {why}; "
                "set device: cpu to run the torch code path on host memory"
            )
        return None
    if missing is not None:
        raise DeviceError(f"gpu tier: device {device!r} needs torch (pip install 'kvfleet[gpu]'): {missing}")
    import torch

    if device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise DeviceError(f"gpu tier: device {device!r} asks for CUDA, and torch.cuda.is_available() is "
                          "false on this machine")
    index = torch.cuda.current_device() if device == "cuda" else int(device.partition(":")[2])
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"gpu tier: device {device!r}: this machine has {count} CUDA device(s)")
    return f"cuda:{index}"


class TorchDeviceStore(SlotStore["torch.Tensor"]):
    """Fixed block slots in torch ``uint8`` tensors on a torch device (see the module doc)."""

    backend = "torch"

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        if tier is not Tier.GPU:
            raise DeviceError(f"the torch backend serves the gpu tier only, not {tier}")
        name = resolve_device(memory_spec(spec).device, required=True) or "cpu"
        import torch

        super().__init__(tier, spec)
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"
        self.stand_in = not self.cuda
        #: pinned host buffer for CUDA copies (grown on need); unused on the cpu device.
        self._staging: torch.Tensor | None = None
        #: host buffers handed out by reserve(), by slot, until commit/abort.
        self._reserved: dict[int, Payload] = {}
        if self.stand_in:
            log.warning(
                "gpu tier: torch %s device standing in for HBM (no CUDA device driven), capacity %d bytes",
                self.device, self.capacity_bytes)
        else:
            log.info("gpu tier: %s, capacity %d bytes", self._where(), self.capacity_bytes)

    def _where(self) -> str:
        if self.cuda:
            import torch

            return f"{self.device} HBM ({torch.cuda.get_device_name(self.device)})"
        return f"torch {self.device} device standing in for HBM"

    def describe(self) -> str:
        return (f"{self.tier} tier: {self._where()}, capacity {self.capacity_bytes} bytes, "
                f"slot {self.slot_bytes or 'auto'}")

    # ------------------------------------------------------------ copies

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.current_stream(self.device).synchronize()

    def _stage(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the pinned staging buffer (caller holds the lock)."""
        import torch

        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(max(nbytes, self.slot_bytes), dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes]

    def _to_device(self, dst: torch.Tensor, src: Payload, pinned: bool = False) -> None:
        """Copy host bytes ``src`` into ``dst`` on the device; returns once they are there.

        Host-side copies use numpy (one thread, GIL released): torch's CPU copy of a large tensor
        runs on its intra-op thread pool, which stalls whenever another process holds a core.
        """
        if not self.cuda:
            np.copyto(dst.numpy(), src)
            return
        import torch

        if pinned:  # a buffer from _buffer(): DMA straight from it
            host = torch.from_numpy(src)
        else:
            host = self._stage(src.nbytes)
            np.copyto(host.numpy(), src)
        dst.copy_(host, non_blocking=True)
        self._sync()

    def _to_host(self, src: torch.Tensor) -> Payload:
        """A new host array holding ``src``'s bytes (device → host, synchronized)."""
        out = np.empty(src.numel(), dtype=np.uint8)
        if not self.cuda:
            np.copyto(out, src.numpy())
            return out
        stage = self._stage(src.numel())
        stage.copy_(src, non_blocking=True)
        self._sync()
        np.copyto(out, stage.numpy())
        return out

    # ------------------------------------------------------------ SlotStore hooks

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        import torch

        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise TierFullError(
                f"{self.tier}: {self.device} has no room for another {nbytes}-byte slab ({exc})") from None

    def _slot(self, slot: int, nbytes: int) -> torch.Tensor:
        slab, start = self._place(slot)
        return slab[start : start + nbytes]

    def _put(self, slot: int, data: Payload) -> None:
        self._to_device(self._slot(slot, data.nbytes), data)

    def _get(self, slot: int, nbytes: int) -> Payload:
        return self._to_host(self._slot(slot, nbytes))

    def _buffer(self, slot: int, nbytes: int) -> Payload:
        if self.cuda:
            import torch

            buf: Payload = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            buf = np.empty(nbytes, dtype=np.uint8)
        self._reserved[slot] = buf
        return buf

    def _land(self, slot: int, nbytes: int) -> None:
        buf = self._reserved.pop(slot)
        self._to_device(self._slot(slot, nbytes), buf[:nbytes], pinned=True)

    def _unbuffer(self, slot: int) -> None:
        self._reserved.pop(slot, None)

    # ------------------------------------------------------------ device-native API

    def tensor(self, block_hash: BlockHash) -> torch.Tensor:
        """The block's bytes as a zero-copy ``uint8`` tensor on the device, valid until the block is deleted.

        Writing through it changes the stored block. Raises BlockNotFoundError.
        """
        with self._lock:
            slot, nbytes, _ = self._lookup(block_hash)
            return self._slot(slot, nbytes)

    def close(self) -> None:
        super().close()
        with self._lock:
            self._reserved.clear()
            self._staging = None

    def probe(self, nbytes: int) -> tuple[float, float, float]:
        """Time the store's own host → device and device → host copies of ``nbytes`` (no slot is used).

        Latency is the faster of a 64-byte copy each way; each bandwidth takes the best of three
        copies, less that latency.
        """
        import torch

        nbytes = max(4096, nbytes)
        host = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        small = dev[:64]
        with self._lock:
            self._to_device(dev, host)  # warm up: first touch, staging buffer
            self._to_host(dev)
            lat = min(_timed(lambda: self._to_device(small, host[:64])), _timed(lambda: self._to_host(small)))
            write = min(_timed(lambda: self._to_device(dev, host)) for _ in range(3))
            read = min(_timed(lambda: self._to_host(dev)) for _ in range(3))
        latency = max(1e-7, lat)
        return nbytes / max(1e-9, read - lat), nbytes / max(1e-9, write - lat), latency


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

