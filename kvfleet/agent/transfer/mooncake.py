"""The RDMA-class data path through Mooncake Transfer Engine (optional import).

Same shape as the shm ring: the receiver sends ``MC_ATTACH{slots, slot_bytes}``
over the authenticated control connection; the sender allocates a staging
ring, registers it with its Transfer Engine and answers ``MC_READY{rpc, addr}``;
for each block it copies the block into slot ``n % slots`` and sends a
``SLOT_BLOCK`` header. The receiver reads the slot with
``transfer_sync_read`` into its own registered ring, checks the checksum and
copies the block into its destination. Credits (one per slot) keep the sender
from overwriting a slot before it was read.

The package is ``mooncake-transfer-engine-non-cuda`` (extra ``kvfleet[mooncake]``;
it needs Debian ``libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200``).
The transport is a setting: ``tcp`` here (no RDMA NIC), ``rdma`` on a cluster.
Nothing is imported at module load: :func:`available` says whether it can run.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from kvfleet.agent.transfer.errors import FrameError, StreamError


@functools.cache
def available() -> bool:
    """True when ``mooncake.engine`` imports (package and its system libraries present)."""
    try:
        import mooncake.engine  # noqa: F401
    except Exception:  # ImportError, or OSError from a missing libibverbs
        return False
    return True


class MooncakeEngine:
    """One Transfer Engine per process side (server or client), P2P handshake, no metadata server."""

    def __init__(self, hostname: str, protocol: str = "tcp") -> None:
        if not available():
            raise StreamError("mooncake backend requested but mooncake.engine does not import")
        from mooncake.engine import TransferEngine

        self._te: Any = TransferEngine()
        rc = self._te.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise StreamError(f"mooncake TransferEngine.initialize failed (rc={rc})")
        self.rpc = f"{hostname}:{self._te.get_rpc_port()}"
        self._lock = threading.Lock()

    def register(self, ptr: int, size: int) -> None:
        with self._lock:
            rc = self._te.register_memory(ptr, size)
        if rc != 0:
            raise StreamError(f"mooncake register_memory failed (rc={rc})")

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._te.unregister_memory(ptr)

    def read(self, target: str, local_ptr: int, remote_ptr: int, length: int) -> None:
        rc = self._te.transfer_sync_read(target, local_ptr, remote_ptr, length)
        if rc != 0:
            raise StreamError(f"mooncake read of {length} bytes from {target} failed (rc={rc})")


class RegisteredRing:
    """``slots`` × ``slot_bytes`` of memory registered with a Transfer Engine."""

    def __init__(self, engine: MooncakeEngine, slots: object, slot_bytes: object,
                 max_slot_bytes: int) -> None:
        if not (isinstance(slots, int) and isinstance(slot_bytes, int) and 0 < slots <= 4096
                and 0 < slot_bytes <= max_slot_bytes):
            raise FrameError(f"bad mooncake ring geometry {slots!r} x {slot_bytes!r}")
        self.engine = engine
        self.slots = slots
        self.slot_bytes = slot_bytes
        try:
            self._buf = np.empty(slots * slot_bytes, dtype=np.uint8)
        except MemoryError as exc:
            raise StreamError(f"cannot allocate a {slots} x {slot_bytes} mooncake ring") from exc
        self.addr = int(self._buf.ctypes.data)
        self._view = self._buf.data.cast("B")
        engine.register(self.addr, slots * slot_bytes)
        self._closed = False

    def slot(self, index: int, length: int) -> memoryview:
        if not 0 <= index < self.slots or not 0 <= length <= self.slot_bytes:
            raise FrameError(f"slot {index}/{self.slots} length {length} out of range")
        start = index * self.slot_bytes
        return self._view[start : start + length]

    def slot_addr(self, index: int) -> int:
        return self.addr + index * self.slot_bytes

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.unregister(self.addr)
