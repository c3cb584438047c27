"""Run by a vLLM interop venv's interpreter (not by kvfleet's): vLLM's own ``vllm serve`` checks on argument
lists.

``python vllm_check.py CASES.json`` reads ``[{"id": ..., "argv": [...]}, ...]`` (``vllm serve`` arguments, the
model given as ``--model DIR`` of a local config) and prints one JSON object per case:
``{"id", "ok", "stage", "error", "kv_transfer", "kv_events", "block_size", "hash_algo"}``. For each case it
runs what ``vllm serve`` runs before it touches a GPU: the real parser
(``make_arg_parser(FlexibleArgumentParser())``), ``validate_parsed_serve_args``,
``AsyncEngineArgs.from_cli_args`` and ``create_engine_config()`` on vLLM's CPU platform
(``VLLM_TARGET_DEVICE=cpu``, installed explicitly where a CUDA build of vLLM ignores it), which builds and
validates every config class (``KVEventsConfig``, ``KVTransferConfig``, ``CacheConfig``, ...). Nothing of
kvfleet is imported here: the interop venvs hold vLLM and its dependencies only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _cpu_platform() -> None:
    """vLLM's CPU platform: 0.33 picks it from ``VLLM_TARGET_DEVICE=cpu``; 0.11 only for a CPU build of vLLM,
    so it is installed explicitly (``vllm.platforms``' lazy ``current_platform`` reads
    ``_current_platform``)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()


def _parser() -> Any:
    _cpu_platform()
    try:  # vLLM >= 0.2x
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM 0.11
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser()), validate_parsed_serve_args


def _plain(obj: Any) -> Any:
    if obj is None:
        return None
    fields = getattr(obj, "__dataclass_fields__", None)
    if fields is not None:
        return {k: _plain(getattr(obj, k)) for k in fields}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, str | int | float | bool) else str(obj)


def check(parser: Any, validate: Any, argv: list[str]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    stage = "parse"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
        stage = "validate"
        validate(args)
        stage = "engine_args"
        engine_args = AsyncEngineArgs.from_cli_args(args)
        stage = "engine_config"
        cfg = engine_args.create_engine_config()
    except SystemExit:
        return {"ok": False, "stage": stage,
                "error": err.getvalue().strip().splitlines()[-1:] or ["argparse exit"]}
    except Exception as exc:  # whatever vLLM raises is the answer
        return {"ok": False, "stage": stage, "error": [f"{type(exc).__name__}: {exc}"[:800]]}
    cache = cfg.cache_config
    return {"ok": True, "stage": "done", "error": [], "kv_transfer": _plain(cfg.kv_transfer_config),
            "kv_events": _plain(cfg.kv_events_config),
            "block_size": cache.block_size, "hash_algo": getattr(cache, "prefix_caching_hash_algo", None),
            "prefix_caching": cache.enable_prefix_caching}


def main(path: str) -> int:
    import vllm

    parser, validate = _parser()
    with open(path) as f:
        cases = json.load(f)
    for case in cases:
        out = {"id": case["id"], "vllm": vllm.__version__, **check(parser, validate, list(case["argv"]))}
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
