"""bench.wake — what one wake-up costs on this host: a bare ZMQ receiver thread, slow messages against fast.

An EPP replica's KV-event and gossip threads sleep in ``poll`` and wake for each message (a KV-event batch,
a peer's gossip). Woken rarely, a thread runs from cold caches and the host pays the wake-up itself; woken
often, little of that shows. This measures it apart from any kvfleet code: another process publishes
200-byte messages on a ZMQ PUB socket at ``--slow`` per second (about what an idle replica of
``bench.replicas`` receives per thread) and then at ``--fast`` per second (the baseline, same run); one
thread here receives them with ``zmq.Poller`` and ``recv``, nothing else. Printed: CPU µs per message of
the receiving thread and of the whole process (ZMQ's I/O thread included) at each rate, and
``slow_vs_fast_thread_cpu_per_message``. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time

import zmq


def _send(port: int, n: int, rate: float) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    s.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the subscription reaches the publisher
    for _ in range(n):
        s.send(b"x" * 200)
        time.sleep(1.0 / rate)
    s.send(b"end")
    time.sleep(0.2)
    s.close(0)
    ctx.term()


def measure(rate: float, seconds: float) -> tuple[int, float, float]:
    """(messages, receiving thread's CPU µs per message, the process's CPU µs per message) at ``rate``."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sender = mp.get_context("spawn").Process(target=_send, args=(port, max(1, int(rate * seconds)), rate))
    sender.start()
    got: dict[str, float] = {}

    def receive() -> None:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        n, c0, p0 = 0, 0.0, 0.0
        while True:
            if not poller.poll(5000):
                break  # the sender died: report what came
            msg = sub.recv()
            if msg == b"end":
                break
            if n == 0:  # both clocks from the first message: the start-up is not a wake-up
                c0, p0 = time.thread_time(), time.process_time()
            n += 1
        got["n"], got["thread"], got["process"] = n, time.thread_time() - c0, time.process_time() - p0

    th = threading.Thread(target=receive, name="receiver")
    th.start()
    th.join()
    sender.join(10)
    sub.close(0)
    ctx.term()
    n = int(got["n"])
    if n < 2:
        raise SystemExit(f"bench.wake: only {n} message(s) arrived at {rate}/s")
    return n, got["thread"] / n * 1e6, got["process"] / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wake", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 s per rate instead of 8")
    ap.add_argument("--slow", type=float, default=75.0, help="messages per second of the slow phase")
    ap.add_argument("--fast", type=float, default=1000.0, help="messages per second of the baseline")
    args = ap.parse_args(argv)
    seconds = 3.0 if args.quick else 8.0
    out: dict[str, object] = {"bench": "wake", "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    per_thread: dict[str, float] = {}
    for tag, rate in (("slow", args.slow), ("fast", args.fast)):
        n, thread_us, process_us = measure(rate, seconds)
        print(f"{rate:7.0f} messages/s: {n} messages; CPU per message: receiving thread {thread_us:.0f} µs, "
              f"whole process {process_us:.0f} µs", flush=True)
        per_thread[tag] = thread_us
        out |= {f"{tag}_rate": rate, f"{tag}_thread_cpu_us_per_message": round(thread_us, 1),
                f"{tag}_process_cpu_us_per_message": round(process_us, 1)}
    out["slow_vs_fast_thread_cpu_per_message"] = round(per_thread["slow"] / max(1e-9, per_thread["fast"]), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
