"""bench.transfer — KV block transfer prefill → decode over tcp and shm, against a raw socket pair.

A sender child process (the "prefill pod") holds N blocks of 2 MiB (one
Llama-3-8B 16-token block: 32 layers × 2 (K,V) × 8 KV heads × 128 dims × 16
tokens × fp16) in a kvfleet TransferServer and in a raw sender. This process
(the "decode pod") pulls them into one preallocated arena:

* raw: one TCP connection, plain ``sendall`` / ``recv_into`` of the same
  blocks, no framing, auth or checksums — the baseline, measured in this run;
* kvfleet tcp at 1/2/4 streams (every block's payload under the keyed MAC, the default), and one
  stream with ``payload_mac=False`` (the tag covers the header only, the payload the unkeyed xxh3
  checksum): ``tcp_mac_vs_unkeyed`` is what the payload MAC costs, measured in the same run, next
  to the single-core rate of the receiver's per-block tag (``gmac_gbps``: GMAC-AES-256, protocol 3)
  and of the SHA-256 pass that protocol 2 made it pay (``sha256_gbps``), and
  ``first_block_unkeyed_ms`` the first block without it;
* kvfleet shm (same host), shm also against a memcpy of the same
  bytes into the same arena (``shm_vs_memcpy``: on one host the data is copied once, so memcpy is the
  baseline, not a socket);
* first-block latency (``pull`` → block 0 handed to the consumer, one warm
  stream, the whole batch requested), delivered in the receiving I/O thread
  (``deliver="thread"``, the ratio the aim is about) and through the event
  loop (``async for``, ``first_block_ratio_loop``: how the engine simulator's P/D path
  receives blocks, so the figure users see), against one block's raw transfer time measured the
  same way: the raw receiver asks for the whole batch and times request →
  first byte → last byte of block 0 on a socket with the same options
  (``TCP_NODELAY``, ``TCP_QUICKACK`` re-armed before the block), then drains
  the rest; and against the whole batch;
* Mooncake Transfer Engine's own TCP transport (one batched read of the
  registered batch) and kvfleet's ``mooncake`` backend, when ``mooncake``
  imports (``kvfleet[mooncake]``); else ``mooncake_gbps`` is null.

Each figure is the best of ``--reps`` runs (the machine is shared and noisy);
medians are printed too. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvfleet.agent.transfer import MemoryBlockStore, TransferClient, TransferServer, mooncake
from kvfleet.agent.transfer.auth import FrameSeal
from kvfleet.config.transfer import TransferSettings

BLOCK = 2 << 20
SECRET = b"bench-transfer-secret"
HOST = "127.0.0.1"
BACKENDS = ("shm", "mooncake", "tcp") if mooncake.available() else ("shm", "tcp")


def _blocks(n: int) -> list[bytes]:
    rng = np.random.default_rng(7)
    return [rng.bytes(BLOCK) for _ in range(n)]


# ---------------------------------------------------------------------------
# sender child
# ---------------------------------------------------------------------------


def _raw_serve(conn: socket.socket, blocks: list[memoryview]) -> None:
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            (count,) = struct.unpack("!Q", head)
            for i in range(count):
                conn.sendall(blocks[i % len(blocks)])


def _raw_accept(lsock: socket.socket, blocks: list[memoryview]) -> None:
    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_raw_serve, args=(conn, blocks), daemon=True).start()


async def _sender(n: int, shm_dir: str) -> None:
    blocks = _blocks(n)
    store = MemoryBlockStore()
    for i, b in enumerate(blocks):
        store.put(i + 1, b)
    lsock = socket.socket()
    lsock.bind((HOST, 0))
    lsock.listen(16)
    threading.Thread(target=_raw_accept, args=(lsock, [memoryview(b) for b in blocks]), daemon=True).start()
    settings = TransferSettings(host_id="bench-host", shm_dir=shm_dir, window_blocks=8, backends=BACKENDS)
    info: dict[str, Any] = {"raw_port": lsock.getsockname()[1]}
    te_keep: list[Any] = []
    if mooncake.available():  # the same blocks in one registered buffer, for Mooncake TE's own TCP transport
        engine = mooncake.MooncakeEngine(HOST)
        flat = np.frombuffer(b"".join(blocks), dtype=np.uint8)
        engine.register(int(flat.ctypes.data), flat.nbytes)
        te_keep += [engine, flat]
        info.update(mc_rpc=engine.rpc, mc_addr=int(flat.ctypes.data))
    async with TransferServer(store, SECRET, settings=settings) as srv:
        print(json.dumps({"port": srv.port, **info}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    lsock.close()


# ---------------------------------------------------------------------------
# receiver (this process)
# ---------------------------------------------------------------------------


def _raw_batch(sock: socket.socket, arena: memoryview, n: int) -> float:
    t = time.perf_counter()
    sock.sendall(struct.pack("!Q", n))
    for i in range(n):
        view = arena[i * BLOCK : (i + 1) * BLOCK]
        got = 0
        while got < BLOCK:
            got += sock.recv_into(view[got:], BLOCK - got, socket.MSG_WAITALL)
    return time.perf_counter() - t


_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def _raw_first_block(sock: socket.socket, arena: memoryview, n: int) -> tuple[float, float]:
    """Request the whole batch; (first byte, last byte) of block 0 after the request; drain the rest
    untimed."""
    view = arena[:BLOCK]
    if _QUICKACK is not None:  # what kvfleet's receiver does before each block
        sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
    t = time.perf_counter()
    sock.sendall(struct.pack("!Q", n))
    got = sock.recv_into(view, BLOCK)  # returns at the first bytes
    t_first = time.perf_counter() - t
    while got < BLOCK:
        got += sock.recv_into(view[got:], BLOCK - got, socket.MSG_WAITALL)
    t_last = time.perf_counter() - t
    for i in range(1, n):
        rest, got = arena[i * BLOCK : (i + 1) * BLOCK], 0
        while got < BLOCK:
            got += sock.recv_into(rest[got:], BLOCK - got, socket.MSG_WAITALL)
    return t_first, t_last


def _mooncake_batch(engine: mooncake.MooncakeEngine, info: dict[str, Any], arena_addr: int,
                    n: int) -> float:
    """Mooncake TE's own TCP transport: one batched read of the whole batch, no kvfleet in the path."""
    t = time.perf_counter()
    rc = engine._te.batch_transfer_sync_read(
        info["mc_rpc"], [arena_addr + i * BLOCK for i in range(n)],
        [info["mc_addr"] + i * BLOCK for i in range(n)], [BLOCK] * n
    )
    if rc != 0:
        raise RuntimeError(f"mooncake batch read failed (rc={rc})")
    return time.perf_counter() - t


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    n, reps = int(args.blocks), int(args.reps)
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.transfer", "--role", "sender", "--blocks", str(n),
         "--shm-dir", shm_dir],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"sender child died (rc={child.wait()})")
        ports = json.loads(line)
        arena_buf = bytearray(b"\x01") * (n * BLOCK)  # prefaulted destination slots
        arena = memoryview(arena_buf)
        hashes = list(range(1, n + 1))
        gb = float(n * BLOCK / 1e9)

        raw = socket.create_connection((HOST, ports["raw_port"]))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _raw_batch(raw, arena, n)  # warm-up

        def alloc(seq: int, _h: object, length: int) -> memoryview:
            return arena[seq * BLOCK : seq * BLOCK + length]

        settings = TransferSettings(host_id="bench-host", shm_dir=shm_dir, window_blocks=8, streams=4,
                                    backends=BACKENDS)
        client = TransferClient(SECRET, settings=settings)
        unkeyed = TransferClient(SECRET, settings=replace(settings, payload_mac=False))
        peer = (HOST, ports["port"])

        async def run(backend: str, streams: int, keyed: bool = True) -> tuple[float, float]:
            t = time.perf_counter()
            handle = (client if keyed else unkeyed).pull(peer, hashes, alloc=alloc, backends=[backend],
                                                         streams=streams)
            count = 0
            async for _b in handle:
                count += 1
            assert count == n, handle.exception()
            if handle.stats.retries:
                print(f"note: {backend} x{streams} needed {handle.stats.retries} retries", file=sys.stderr)
            return time.perf_counter() - t, handle.stats.first_block_s or 0.0

        configs: tuple[tuple[str, int], ...] = (("tcp", 1), ("tcp", 2), ("tcp", 4), ("shm", 1))
        if "mc_rpc" in ports:
            configs += (("mooncake", 1),)
        for backend, streams in configs:
            await run(backend, streams)  # warm-up: connections, shm ring
        await run("tcp", 1, keyed=False)
        # interleaved, so that the baseline and kvfleet see the same load on a shared machine
        raw_s: list[float] = []
        results: dict[str, list[float]] = {f"{b}{s}" if b == "tcp" else b: [] for b, s in configs}
        results["tcp1_unkeyed"] = []
        sha_s: list[float] = []
        gmac_s: list[float] = []
        seal = FrameSeal(b"k" * 32)
        for _ in range(reps):
            raw_s.append(_raw_batch(raw, arena, n))
            for backend, streams in configs:
                results[f"{backend}{streams}" if backend == "tcp" else backend].append(
                    (await run(backend, streams))[0])
            results["tcp1_unkeyed"].append((await run("tcp", 1, keyed=False))[0])
            t = time.perf_counter()
            for i in range(n):  # the receiver's per-block SHA-256, alone on one core
                hashlib.sha256(arena[i * BLOCK : (i + 1) * BLOCK]).digest()
            sha_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(n):  # the receiver's per-block tag (protocol 3), alone on one core
                seal.tag(b"h" * 64, arena[i * BLOCK : (i + 1) * BLOCK])
            gmac_s.append(time.perf_counter() - t)
        async def run_in_thread(keyed: bool = True) -> float:
            """on_block in the receiving I/O thread: block 0 reaches the consumer without an event-loop
            hop."""
            count = 0

            def on_block(_b: object) -> None:
                nonlocal count
                count += 1

            handle = (client if keyed else unkeyed).pull(
                peer, hashes, on_block=on_block, alloc=alloc, backends=["tcp"], streams=1, deliver="thread"
            )
            await handle.wait()
            assert count == n, handle.exception()
            return handle.stats.first_block_s or 0.0

        # first block: one stream, warm connection, the whole batch requested; next to raw block 0 of a
        # whole batch
        await run_in_thread()  # warm-up
        await run_in_thread(keyed=False)
        one_block_s: list[float] = []
        raw_first_byte_s: list[float] = []
        first: list[float] = []
        first_loop: list[float] = []
        first_unkeyed: list[float] = []
        for _ in range(max(9, reps)):
            fb_byte, fb_last = _raw_first_block(raw, arena, n)
            raw_first_byte_s.append(fb_byte)
            one_block_s.append(fb_last)
            first.append(await run_in_thread())
            first_unkeyed.append(await run_in_thread(keyed=False))
            first_loop.append((await run("tcp", 1))[1])
        whole_tcp1 = statistics.median(results["tcp1"])
        raw.close()
        client.close()
        unkeyed.close()
        mc_s: list[float] = []
        if "mc_rpc" in ports:
            engine = mooncake.MooncakeEngine(HOST)
            arena_addr = int(np.frombuffer(arena_buf, dtype=np.uint8).ctypes.data)
            engine.register(arena_addr, n * BLOCK)
            _mooncake_batch(engine, ports, arena_addr, n)  # warm-up: handshake
            mc_s = [_mooncake_batch(engine, ports, arena_addr, n) for _ in range(reps)]
            engine.unregister(arena_addr)
        assert bytes(arena[:BLOCK]) == _blocks(1)[0]
        # memcpy baseline for shm (same host: the data is copied once, out of the shared segment into the
        # arena): the same bytes copied from one process-local buffer into the same arena
        src = np.frombuffer(bytes(arena_buf), dtype=np.uint8).copy()
        dst = np.frombuffer(arena_buf, dtype=np.uint8)
        memcpy_s: list[float] = []
        for _ in range(max(3, reps)):
            t = time.perf_counter()
            np.copyto(dst, src)
            memcpy_s.append(time.perf_counter() - t)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

    def gbps(ts: list[float]) -> float:
        return gb / min(ts)

    raw_gbps = gbps(raw_s)
    tcp = {s: gbps(results[f"tcp{s}"]) for s in (1, 2, 4)}
    best = max(tcp, key=lambda s: tcp[s])
    one = statistics.median(one_block_s)
    fb = statistics.median(first)
    fb_loop = statistics.median(first_loop)
    fb_unkeyed = statistics.median(first_unkeyed)
    fb_byte = statistics.median(raw_first_byte_s)
    print(f"batch: {n} blocks × {BLOCK >> 20} MiB = {n * BLOCK >> 20} MiB, best of {reps}")
    print(f"raw socket pair     {raw_gbps:6.2f} GB/s (median {gb / statistics.median(raw_s):.2f})")
    for s in (1, 2, 4):
        print(f"kvfleet tcp x{s}      {tcp[s]:6.2f} GB/s "
              f"(median {gb / statistics.median(results[f'tcp{s}']):.2f})  "
              f"ratio {tcp[s] / raw_gbps:.2f}")
    unkeyed_gbps = gbps(results["tcp1_unkeyed"])
    print(f"kvfleet tcp x1, payload_mac off {unkeyed_gbps:6.2f} GB/s "
          f"(median {gb / statistics.median(results['tcp1_unkeyed']):.2f})  "
          f"MAC'd / unkeyed {tcp[1] / unkeyed_gbps:.2f}; on one core: GMAC {gbps(gmac_s):.2f} GB/s, "
          f"SHA-256 {gbps(sha_s):.2f} GB/s")
    print(f"kvfleet shm         {gbps(results['shm']):6.2f} GB/s "
          f"(median {gb / statistics.median(results['shm']):.2f})  "
          f"vs memcpy {gbps(memcpy_s):.2f} GB/s: ratio {gbps(results['shm']) / gbps(memcpy_s):.2f}")
    mc_gbps = round(gbps(mc_s), 3) if mc_s else None
    kv_mc = round(gbps(results["mooncake"]), 3) if "mooncake" in results else None
    if mc_s:
        print(f"mooncake TE tcp     {gbps(mc_s):6.2f} GB/s (its own batched read); "
              f"kvfleet over mooncake {kv_mc:.2f} GB/s")
    else:
        print("mooncake TE         not importable here")
    print(f"raw block 0: first byte {fb_byte * 1e3:.2f} ms, last byte {one * 1e3:.2f} ms "
          f"(median of {len(first)})")
    print(f"first block in I/O thread {fb * 1e3:.2f} ms (x{fb / one:.2f}); "
          f"via event loop {fb_loop * 1e3:.2f} ms (x{fb_loop / one:.2f}); "
          f"whole batch {whole_tcp1 * 1e3:.1f} ms (first/whole {fb / whole_tcp1:.3f})")
    print(f"first block in I/O thread, payload_mac off {fb_unkeyed * 1e3:.2f} ms (x{fb_unkeyed / one:.2f})")
    return {
        "bench": "transfer",
        "blocks": n,
        "block_bytes": BLOCK,
        "batch_mib": n * BLOCK >> 20,
        "reps": reps,
        "raw_gbps": round(raw_gbps, 3),
        "tcp_gbps": round(tcp[best], 3),
        "tcp_streams": best,
        "tcp_gbps_by_streams": {str(s): round(v, 3) for s, v in tcp.items()},
        "tcp_ratio": round(tcp[best] / raw_gbps, 3),
        "tcp_unkeyed_gbps": round(unkeyed_gbps, 3),
        "tcp_mac_vs_unkeyed": round(tcp[1] / unkeyed_gbps, 3),
        "tcp_unkeyed_ratio": round(unkeyed_gbps / raw_gbps, 3),
        "gmac_gbps": round(gbps(gmac_s), 3),
        "sha256_gbps": round(gbps(sha_s), 3),
        "shm_gbps": round(gbps(results["shm"]), 3),
        "shm_ratio": round(gbps(results["shm"]) / raw_gbps, 3),
        "memcpy_gbps": round(gbps(memcpy_s), 3),
        "shm_vs_memcpy": round(gbps(results["shm"]) / gbps(memcpy_s), 3),
        "first_block_ms": round(fb * 1e3, 3),
        "raw_one_block_ms": round(one * 1e3, 3),
        "raw_first_byte_ms": round(fb_byte * 1e3, 3),
        "first_block_ratio": round(fb / one, 3),
        "first_block_unkeyed_ms": round(fb_unkeyed * 1e3, 3),
        "first_block_unkeyed_ratio": round(fb_unkeyed / one, 3),
        "first_block_loop_ms": round(fb_loop * 1e3, 3),
        "first_block_loop_ratio": round(fb_loop / one, 3),
        # through the event loop, as engine/pd.py delivers blocks: the figure users see
        "first_block_ratio_loop": round(fb_loop / one, 3),
        "whole_batch_ms": round(whole_tcp1 * 1e3, 2),
        "first_to_whole_ratio": round(fb / whole_tcp1, 4),
        "mooncake_gbps": mc_gbps,
        "kvfleet_mooncake_gbps": kv_mc,
        "nixl_gbps": None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (finishes well within 60 s)")
    p.add_argument("--blocks", type=int, default=128, help="blocks per batch (128 × 2 MiB = 256 MiB)")
    p.add_argument("--reps", type=int, default=0,
                   help="timed runs per configuration (default 3 quick, 7 full)")
    p.add_argument("--role", choices=["receiver", "sender"], default="receiver", help=argparse.SUPPRESS)
    p.add_argument("--shm-dir", default="/dev/shm", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.blocks < 1:
        p.error("--blocks must be >= 1")
    if args.role == "sender":
        asyncio.run(_sender(args.blocks, args.shm_dir))
        return
    args.reps = args.reps or (3 if args.quick else 7)
    print(json.dumps(asyncio.run(_measure(args))))


if __name__ == "__main__":
    main()
