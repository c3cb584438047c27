"""``kvfleet engine``: run one simulated model server.

Settings come from ``--config FILE`` (the ``engine:`` and ``cache:`` sections of
kvfleet's settings) with flags on top. Exits 2 with a one-line message when a
port is taken, the configuration is invalid or the SSD tier's directory cannot be
used; SIGTERM/SIGINT stop it cleanly (requests in flight are failed with 503,
blocks queued for the SSD tier written, sockets closed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from aiohttp import web

from kvfleet.agent.publisher import PortInUseError
from kvfleet.agent.tiers import TierError
from kvfleet.config import ConfigError, Settings, load
from kvfleet.engine.server import EngineServer

log = logging.getLogger("kvfleet.engine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet engine",
        description="CPU-fallback engine simulator (OpenAI API, vLLM metrics and KV events).")
    p.add_argument("--config", help="YAML settings file (sections engine:, cache:)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--kv-events-port", type=int, help="ZMQ PUB port for KV events (default 5557)")
    p.add_argument("--kv-events-replay-port", type=int,
                   help="ZMQ ROUTER replay port (default 5558; 0 disables)")
    p.add_argument("--model", help="served model name (default llama-3-8b)")
    p.add_argument("--pod-name", help="pod name reported in headers and logs")
    p.add_argument("--pool", help="pool this engine belongs to")
    p.add_argument("--role", choices=["both", "prefill", "decode"], help="serving role")
    p.add_argument("--time-factor", type=float, help="wall seconds per modelled second (0.1 = 10x faster)")
    p.add_argument("--num-gpu-blocks", type=int, help="blocks in the GPU stand-in")
    p.add_argument("--cpu-blocks", type=int, help="blocks in the host tier (0 = none)")
    p.add_argument("--ssd-dir", help="directory of the SSD tier (empty = none)")
    p.add_argument("--log-level", default="INFO")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    engine: dict[str, Any] = {}
    for flag, key in [
        ("host", "host"), ("port", "port"), ("kv_events_port", "kv_events_port"),
        ("kv_events_replay_port", "kv_events_replay_port"), ("model", "model"), ("pod_name", "pod_name"),
        ("pool", "pool"), ("role", "role"), ("time_factor", "time_factor"),
        ("num_gpu_blocks", "num_gpu_blocks"),
    ]:
        value = getattr(args, flag)
        if value is not None:
            engine[key] = value
    tiers: dict[str, Any] = {}
    if args.cpu_blocks is not None:
        tiers["cpu_blocks"] = args.cpu_blocks
    if args.ssd_dir is not None:
        tiers["ssd_dir"] = args.ssd_dir
    if tiers:
        engine["tiers"] = tiers
    return load(args.config, {"engine": engine} if engine else None)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the server until ``stop`` is set."""
    server = EngineServer(settings)
    server.start_publisher()
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.engine.host, settings.engine.port)
        await site.start()
        log.info(
            "engine %s (%s, pool %s) serving %s on http://%s:%d, KV events on tcp://%s:%d",
            settings.engine.pod_name, settings.engine.role, settings.engine.pool, settings.engine.model,
            settings.engine.host, settings.engine.port, settings.engine.host, settings.engine.kv_events_port,
        )
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        settings = settings_from_args(args)
    except (ConfigError, OSError) as exc:
        print(f"kvfleet engine: invalid configuration: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    try:
        asyncio.run(run())
    except (PortInUseError, TierError) as exc:
        print(f"kvfleet engine: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvfleet engine: cannot listen on {settings.engine.host}:{settings.engine.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
