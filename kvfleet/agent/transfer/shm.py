"""The same-host data path: a shared-memory ring the receiver owns.

The receiver creates ``slots`` × ``slot_bytes`` in a file under ``shm_dir``
(``/dev/shm``: RAM, never disk) and sends its name over the authenticated
control connection; the sender maps it, copies each block into slot
``n % slots`` and sends only a 64-byte ``SLOT_BLOCK`` header (hash, length,
checksum, slot). The receiver checks the checksum and copies the slot into the
block's destination. Credits (one per slot) keep the sender from overwriting a
slot before it was read. No socket copy of payload bytes; one memcpy per side.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref
from pathlib import Path

from kvfleet.agent.transfer.errors import FrameError, StreamError


def _unlink_quietly(path: Path) -> None:
    path.unlink(missing_ok=True)


_NAME = re.compile(r"^kvfleet-xfer-[0-9a-f]{32}$")


class ShmRing:
    """A mapped ring of equally sized slots, created (``create``) or attached (``attach``)."""

    def __init__(self, path: Path, slots: int, slot_bytes: int, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._mm = mm
        self._view = memoryview(mm)
        self.owner = owner
        # the name only matters until the peer has mapped it; never leave it behind, even on a crash
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if owner else None

    def unlink(self) -> None:
        """Drop the name (both sides keep their mappings); the creator calls it once the peer attached."""
        if self._unlink is not None:
            self._unlink()

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, shm_dir: str, slots: int, slot_bytes: int) -> ShmRing:
        path = Path(shm_dir) / f"kvfleet-xfer-{secrets.token_hex(16)}"
        size = slots * slot_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StreamError(f"cannot create shared memory in {shm_dir}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise StreamError(f"cannot map shared memory {path}: {exc}") from exc
        finally:
            os.close(fd)
        return cls(path, slots, slot_bytes, mm, owner=True)

    @classmethod
    def attach(cls, shm_dir: str, name: object, slots: object, slot_bytes: object) -> ShmRing:
        """Map a ring a peer created; the name is checked so it cannot leave ``shm_dir``."""
        if not (isinstance(name, str) and _NAME.match(name)):
            raise FrameError(f"bad shared-memory ring name {name!r}")
        if not (isinstance(slots, int) and isinstance(slot_bytes, int) and 0 < slots <= 4096
                and slot_bytes > 0):
            raise FrameError(f"bad shared-memory ring geometry {slots!r} x {slot_bytes!r}")
        path = Path(shm_dir) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise StreamError(f"cannot open shared memory {path}: {exc}") from exc
        try:
            if os.fstat(fd).st_size != slots * slot_bytes:
                raise FrameError(f"shared-memory ring {name} size does not match its geometry")
            mm = mmap.mmap(fd, slots * slot_bytes)
        finally:
            os.close(fd)
        return cls(path, slots, slot_bytes, mm, owner=False)

    def slot(self, index: int, length: int) -> memoryview:
        if not 0 <= index < self.slots or not 0 <= length <= self.slot_bytes:
            raise FrameError(f"slot {index}/{self.slots} length {length} out of range")
        start = index * self.slot_bytes
        return self._view[start : start + length]

    def close(self) -> None:
        try:
            self._view.release()
            self._mm.close()
        except (BufferError, ValueError):
            pass
        self.unlink()
