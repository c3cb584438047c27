"""Run in a vLLM release's venv: does vLLM's own OpenAI request model accept each request body?

Reads a JSON file of ``{"id", "chat", "body"}`` cases; prints ``RESULT {"id", "ok", "error"}`` per case:
``ok`` is whether ``ChatCompletionRequest`` / ``CompletionRequest.model_validate`` (what vLLM's server runs
before anything else; a failure is its 400) accepts the body, ``error`` the first line of its message."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any


def _models() -> tuple[Any, Any]:
    for chat_mod, cmpl_mod in (("vllm.entrypoints.openai.chat_completion.protocol",
                                "vllm.entrypoints.openai.completion.protocol"),
                               ("vllm.entrypoints.openai.protocol", "vllm.entrypoints.openai.protocol")):
        try:
            return (importlib.import_module(chat_mod).ChatCompletionRequest,
                    importlib.import_module(cmpl_mod).CompletionRequest)
        except (ImportError, AttributeError):
            continue
    raise SystemExit("no ChatCompletionRequest/CompletionRequest in this vLLM")


def main() -> None:
    chat, completion = _models()
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    for case in cases:
        model = chat if case["chat"] else completion
        try:
            model.model_validate(case["body"])
            out = {"id": case["id"], "ok": True, "error": ""}
        except Exception as exc:  # any refusal is vLLM's 400
            out = {"id": case["id"], "ok": False, "error": str(exc).splitlines()[0][:300]}
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
