"""The gpu tier on a torch device (backend ``torch``), and how ``device`` picks the gpu tier's store.

The torch tests drive the real torch code path on torch's ``cpu`` device (``device: cpu``); the
CUDA tests run the same checks on ``cuda`` and skip on machines without CUDA.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client import generate_latest

from kvfleet.agent.tiers import BlockNotFoundError, BlockTooLargeError, TierFullError, open_store
from kvfleet.agent.tiers.record import BlockMeta
from kvfleet.cache.events import BlockRemoved, BlockStored, EventBuffer
from kvfleet.cache.tiers import Tier
from kvfleet.config._loader import ConfigError, from_dict
from kvfleet.config.tiers import MemoryTierSpec, SsdTierSpec, TierSettings

from .conftest import BLOCK_NBYTES, Factory, make_block, small_settings

if TYPE_CHECKING:
    from kvfleet.agent.tiers.device import TorchDeviceStore


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs torch with CUDA")
no_cuda = pytest.mark.skipif(_cuda(), reason="checks behaviour on a machine without CUDA")


def _store(device: str = "cpu", blocks: int = 4, slab_bytes: int = 64 << 20) -> TorchDeviceStore:
    pytest.importorskip("torch")
    from kvfleet.agent.tiers.device import TorchDeviceStore

    store = open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=blocks * BLOCK_NBYTES, device=device,
                                                slab_bytes=slab_bytes))
    assert isinstance(store, TorchDeviceStore)
    return store


def _meta(h: int, nbytes: int = BLOCK_NBYTES) -> BlockMeta:
    return BlockMeta(hash=h, codec="none", dtype="uint8", shape=(nbytes,), raw_nbytes=nbytes)


def _random(seed: int, nbytes: int = BLOCK_NBYTES) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _round_trip(device: str) -> None:
    """Random blocks (various sizes, read-only sources too) come back byte for byte, as host copies."""
    store = _store(device, blocks=8, slab_bytes=3 * BLOCK_NBYTES)
    sizes = [BLOCK_NBYTES, 1, 64, 4095, BLOCK_NBYTES - 1, 777, 4096, 12]
    blocks = {h: _random(h, n) for h, n in enumerate(sizes)}
    blocks[5] = np.frombuffer(blocks[5].tobytes(), dtype=np.uint8)  # read-only, like np.frombuffer(bytes)
    assert not blocks[5].flags.writeable
    for h, data in blocks.items():
        assert store.write(_meta(h, data.nbytes), data) == BLOCK_NBYTES
    assert store.used_bytes == 8 * BLOCK_NBYTES
    for h, data in blocks.items():
        meta, out = store.read(h)
        assert meta.shape == (data.nbytes,)
        assert isinstance(out, np.ndarray) and out.dtype == np.uint8
        np.testing.assert_array_equal(out, data)
        t = store.tensor(h)
        assert t.device == store.device and t.numel() == data.nbytes
        if device == "cpu":
            assert not np.shares_memory(out, t.numpy())  # a copy, not the slot
    fp16 = make_block(3)
    # any dtype: its bytes; an earlier copy's slot is freed
    store.write(_meta(3), fp16.reshape(-1).view(np.uint8))
    np.testing.assert_array_equal(store.read(3)[1].view(np.float16).reshape(fp16.shape), fp16)
    assert store.used_bytes == 8 * BLOCK_NBYTES


def test_torch_round_trip_cpu_device() -> None:
    _round_trip("cpu")


def test_torch_reserve_commit_abort() -> None:
    """reserve() hands out a host buffer; commit copies it into the device slot; abort frees the slot."""
    store = _store(blocks=2)
    data = _random(1)
    slot, buf = store.reserve(BLOCK_NBYTES)
    assert buf.flags.writeable and buf.nbytes == BLOCK_NBYTES
    buf[:] = data
    assert not store.contains(1)
    assert store.commit(slot, _meta(1), BLOCK_NBYTES) == BLOCK_NBYTES
    np.testing.assert_array_equal(store.read(1)[1], data)
    slot2, _ = store.reserve(BLOCK_NBYTES)
    with pytest.raises(TierFullError):
        store.reserve(BLOCK_NBYTES)
    store.abort(slot2)
    slot3, buf3 = store.reserve(100)
    assert slot3 == slot2  # the aborted slot is free again
    buf3[:] = data[:100]
    store.commit(slot3, _meta(2, 100), 100)
    np.testing.assert_array_equal(store.read(2)[1], data[:100])
    np.testing.assert_array_equal(store.read(1)[1], data)


def test_torch_lease_defers_slot_reuse() -> None:
    """A slot deleted while leased is not reused until released; the lease's copy stays intact."""
    store = _store(blocks=1)
    a, b = _random(1), _random(2)
    store.write(_meta(1), a)
    meta, out, slot = store.lease(1)
    assert meta.hash == 1
    store.delete(1)
    assert not store.contains(1)
    with pytest.raises(TierFullError):
        store.write(_meta(2), b)
    np.testing.assert_array_equal(out, a)
    store.release(slot)
    store.write(_meta(2), b)
    np.testing.assert_array_equal(store.read(2)[1], b)


def test_torch_tensor_is_a_view_of_device_memory() -> None:
    """tensor() is a zero-copy view: writing through it changes reads; after delete the slot is reused."""
    torch = pytest.importorskip("torch")
    store = _store(blocks=2)
    data = _random(1)
    store.write(_meta(1), data)
    t = store.tensor(1)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.numel() == BLOCK_NBYTES
    assert t._base is not None  # a view into a slab, not its own storage
    ptr = t.data_ptr()
    assert store.tensor(1).data_ptr() == ptr
    t[:16] = 0
    t[16] ^= 0xFF
    out = store.read(1)[1]
    assert not out[:16].any()
    assert out[16] == data[16] ^ 0xFF
    np.testing.assert_array_equal(out[17:], data[17:])
    store.write(_meta(2), _random(2))
    store.delete(1)
    with pytest.raises(BlockNotFoundError):
        store.tensor(1)
    store.write(_meta(3), _random(3))
    assert store.tensor(3).data_ptr() == ptr  # the freed slot holds the next block
    np.testing.assert_array_equal(t.numpy(), _random(3))


def test_torch_capacity_and_too_large() -> None:
    store = _store(blocks=3)
    for h in range(3):
        store.write(_meta(h), _random(h))
    with pytest.raises(TierFullError):
        store.write(_meta(3), _random(3))
    with pytest.raises(BlockTooLargeError):
        store.write(_meta(4, BLOCK_NBYTES + 1), _random(4, BLOCK_NBYTES + 1))
    with pytest.raises(BlockNotFoundError):
        store.read(99)
    store.delete(0)
    store.write(_meta(3), _random(3))
    assert sorted(store.keys()) == [1, 2, 3]
    store.close()
    assert not store.contains(1)


def test_torch_stand_in_label_and_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvfleet.agent.tiers.device"):
        store = _store()
    assert store.stand_in and store.backend == "torch"
    assert "torch cpu device standing in for HBM" in store.describe()
    assert "gpu tier: torch cpu device standing in for HBM" in caplog.text


def test_torch_probe_measures_copies() -> None:
    read_bps, write_bps, latency = _store().probe(1 << 20)
    assert read_bps > 1e6 and write_bps > 1e6 and 0 < latency < 1.0


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_manager_gpu_tier_on_torch(tmp_path: Path, manager_factory: Factory, events: EventBuffer,
                                   codec: str) -> None:
    """gpu on the torch backend: demotion to cpu and promotion back keep the bytes; events say GPU."""
    pytest.importorskip("torch")
    s = small_settings(
        tmp_path,
        gpu=MemoryTierSpec(capacity_bytes=6 * BLOCK_NBYTES, device="cpu", codec=codec, high_watermark=0.9,
                           low_watermark=0.5),
        cpu=MemoryTierSpec(capacity_bytes=16 * BLOCK_NBYTES, high_watermark=0.9, low_watermark=0.5),
        ssd=SsdTierSpec(enabled=False),
        calibrate=True,
        calibrate_bytes=1 << 16,
    )
    m = manager_factory(s)
    assert m.stores[Tier.GPU].backend == "torch"
    text = generate_latest(m.metrics.registry).decode()
    assert 'kvfleet_tier_info{backend="torch",stand_in="true",tier="gpu"} 1.0' in text
    n = 12  # int8 slots are about half a block: 11 fit
    for h in range(n):
        assert m.put(h, make_block(h), token_ids=range(16)) is Tier.GPU
        assert m.drain(10)
    demoted = [h for h in range(n) if m.locate(h) is Tier.CPU]
    assert demoted and m.usage(Tier.GPU) <= 0.9
    batch = events.drain()
    assert batch is not None
    seen = {(type(e).__name__, h, e.medium) for e in batch.events if isinstance(e, BlockStored | BlockRemoved)
            for h in e.block_hashes}
    assert ("BlockStored", n - 1, "GPU") in seen
    for h in demoted:
        assert ("BlockStored", h, "CPU") in seen and ("BlockRemoved", h, "GPU") in seen
    tol = 0 if codec == "none" else 0.05
    for h in range(n):
        np.testing.assert_allclose(m.get(h), make_block(h), atol=tol)  # type: ignore[arg-type]
    assert m.drain(10)
    back = next(h for h in demoted if m.locate(h) is Tier.CPU)
    assert m.discard([h for h in range(n) if m.locate(h) is Tier.GPU]) > 0  # room for the promotion
    events.drain()
    assert m.prefetch([back]) == 1
    assert m.drain(10)
    assert m.locate(back) is Tier.GPU
    np.testing.assert_allclose(m.get(back), make_block(back), atol=tol)  # type: ignore[arg-type]
    batch = events.drain()
    assert batch is not None
    moves = {(type(e).__name__, e.medium) for e in batch.events
             if isinstance(e, BlockStored | BlockRemoved) and back in e.block_hashes}
    assert moves == {("BlockStored", "GPU"), ("BlockRemoved", "CPU")}


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda_fails_at_start(tmp_path: Path, manager_factory: Factory,
                                                 device: str) -> None:
    pytest.importorskip("torch")
    from kvfleet.agent.tiers.device import DeviceError

    with pytest.raises(DeviceError, match=r"torch\.cuda\.is_available\(\) is false"):
        manager_factory(small_settings(tmp_path,
                                       gpu=MemoryTierSpec(capacity_bytes=BLOCK_NBYTES, device=device)))


@no_cuda
def test_torch_backend_with_auto_device_needs_cuda() -> None:
    from kvfleet.agent.tiers.device import DeviceError

    with pytest.raises(DeviceError, match="device: cpu"):
        open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=BLOCK_NBYTES, backend="torch"))


@no_cuda
def test_auto_device_without_cuda_is_the_arena_stand_in(tmp_path: Path, manager_factory: Factory,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """No torch needed: auto without CUDA (or without torch) is the host arena, labelled as a stand-in."""
    with caplog.at_level(logging.WARNING):
        m = manager_factory(small_settings(tmp_path, ssd=SsdTierSpec(enabled=False)))
    store = m.stores[Tier.GPU]
    assert store.backend == "arena" and store.stand_in
    assert "host arena standing in for HBM" in caplog.text
    assert ('kvfleet_tier_info{backend="arena",stand_in="true",tier="gpu"} 1.0'
            in generate_latest(m.metrics.registry).decode())


def test_host_device_never_imports_torch(tmp_path: Path) -> None:
    """``import kvfleet``, the manager module and the arena path (device host; auto without a GPU driver)
    leave torch unimported."""
    code = (
        "import sys, kvfleet, kvfleet.agent.tiers.manager\n"
        "from kvfleet.agent.tiers import open_store\n"
        "from kvfleet.cache.tiers import Tier\n"
        "from kvfleet.config.tiers import MemoryTierSpec\n"
        "from kvfleet.agent.tiers.device import gpu_driver_present\n"
        "s = open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=4096, device='host'))\n"
        "assert s.backend == 'arena' and s.stand_in\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "if not gpu_driver_present():  # auto on a machine without a GPU driver does not import torch"
        " either\n"
        "    assert open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=4096)).backend == 'arena'\n"
        "    assert 'torch' not in sys.modules, 'torch was imported by device auto'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=60)


#: run first in a subprocess: imports of torch fail as on an install without torch.
NO_TORCH = (
    "import sys\n"
    "class NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.partition('.')[0] == 'torch':\n"
    "            raise ModuleNotFoundError(\"No module named 'torch'\", name=name)\n"
    "sys.meta_path.insert(0, NoTorch())\n"
)


def test_without_torch(tmp_path: Path) -> None:
    """Without torch: auto is the arena stand-in; device cpu and backend torch fail clearly."""
    code = NO_TORCH + (
        "from kvfleet.agent.tiers import open_store\n"
        "from kvfleet.agent.tiers.device import DeviceError\n"
        "from kvfleet.cache.tiers import Tier\n"
        "from kvfleet.config.tiers import MemoryTierSpec\n"
        "s = open_store(Tier.GPU, MemoryTierSpec(capacity_bytes=4096))\n"
        "assert s.backend == 'arena' and s.stand_in\n"
        "for spec, msg in [(MemoryTierSpec(device='cpu'), 'needs torch'),"
        " (MemoryTierSpec(backend='torch'), 'torch does not import')]:\n"
        "    try:\n"
        "        open_store(Tier.GPU, spec)\n"
        "    except DeviceError as exc:\n"
        "        assert msg in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(spec)\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=60)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"device": "tpu"}, "device must be one of auto, cuda, cpu, host or cuda:N"),
        ({"device": "cuda:x"}, "device must be one of"),
        ({"device": "cuda:"}, "device must be one of"),
        ({"backend": "torch", "device": "host"}, "backend 'torch' needs a torch device"),
        ({"backend": "arena", "device": "cpu"}, "needs backend 'torch'"),
    ],
)
def test_device_setting_is_validated(kw: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryTierSpec(**kw)  # type: ignore[arg-type]


def test_device_setting_from_yaml() -> None:
    s = from_dict(TierSettings, {"gpu": {"device": "cuda:1", "backend": "torch"}, "cpu": {"device": "host"}})
    assert s.gpu.device == "cuda:1" and s.cpu.device == "host"
    assert TierSettings().gpu.device == "auto"
    with pytest.raises(ConfigError, match="device applies to the gpu tier only"):
        from_dict(TierSettings, {"cpu": {"device": "cpu"}})


# ---------------------------------------------------------------- CUDA (skipped without it)


@needs_cuda
def test_cuda_round_trip() -> None:
    _round_trip("cuda")


@needs_cuda
def test_cuda_store_is_hbm_with_device_views() -> None:
    store = _store("cuda")
    assert not store.stand_in and store.cuda
    assert "HBM" in store.describe() and "standing in" not in store.describe()
    data = _random(1)
    slot, buf = store.reserve(BLOCK_NBYTES)
    buf[:] = data
    store.commit(slot, _meta(1), BLOCK_NBYTES)
    t = store.tensor(1)
    assert t.is_cuda
    np.testing.assert_array_equal(t.cpu().numpy(), data)
    t[0] ^= 0xFF
    assert store.read(1)[1][0] == data[0] ^ 0xFF
    read_bps, write_bps, _ = store.probe(1 << 22)
    assert read_bps > 1e8 and write_bps > 1e8


@needs_cuda
def test_cuda_auto_picks_torch(tmp_path: Path, manager_factory: Factory) -> None:
    m = manager_factory(small_settings(tmp_path, ssd=SsdTierSpec(enabled=False)))
    assert m.stores[Tier.GPU].backend == "torch" and not m.stores[Tier.GPU].stand_in
    for h in range(10):
        m.put(h, make_block(h))
        assert m.drain(10)
    for h in range(10):
        np.testing.assert_array_equal(m.get(h), make_block(h))
