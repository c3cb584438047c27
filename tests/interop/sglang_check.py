"""Run by an SGLang interop venv's interpreter (not by kvfleet's): SGLang's own ``launch_server`` checks on
argument lists.

``python sglang_check.py CASES.json`` reads ``[{"id": ..., "argv": [...]}, ...]`` (``sglang.launch_server``
arguments, the model given as ``--model-path DIR`` of a local config, ``--device cpu``) and prints one
``RESULT {json}`` line per case: ``{"id", "ok", "stage", "error", "hicache", "page_size", "disaggregation"}``.
It runs what ``launch_server`` runs before it loads a model: ``prepare_server_args(argv)`` (SGLang's parser
and ``ServerArgs.from_cli_args``, whose ``__post_init__`` validates in 0.5.3) and, where it exists,
``resolve_once()`` (0.5.23's validation and resolution pipeline). Nothing of kvfleet is imported here.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any


def check(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.server_args import prepare_server_args

    stage = "parse"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = prepare_server_args(argv)
        stage = "resolve"
        if hasattr(args, "resolve_once"):
            args.resolve_once()
    except SystemExit:
        return {"ok": False, "stage": stage,
                "error": err.getvalue().strip().splitlines()[-1:] or ["argparse exit"]}
    except Exception as exc:  # whatever SGLang raises is the answer
        return {"ok": False, "stage": stage, "error": [f"{type(exc).__name__}: {exc}"[:800]]}
    return {"ok": True, "stage": "done", "error": [], "page_size": getattr(args, "page_size", None),
            "hicache": bool(getattr(args, "enable_hierarchical_cache", False)),
            "hicache_size": getattr(args, "hicache_size", None),
            "hicache_storage_backend": getattr(args, "hicache_storage_backend", None),
            "disaggregation": [getattr(args, "disaggregation_mode", None),
                               getattr(args, "disaggregation_transfer_backend", None)],
            "kv_events_config": getattr(args, "kv_events_config", None)}


def main(path: str) -> int:
    import sglang

    with open(path) as f:
        cases = json.load(f)
    for case in cases:
        out = {"id": case["id"], "sglang": getattr(sglang, "__version__", "?"), **check(list(case["argv"]))}
        print("RESULT " + json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
