"""Run by an interop venv's interpreter (vLLM or SGLang, not kvfleet): the prompt token ids the engine's own
OpenAI serving code computes for chat and completion requests.

``python chat_tokens.py ENGINE MODEL_DIR CASES.json`` reads ``[{"id": ..., "body": {...}}, ...]`` (OpenAI
request bodies; ``messages`` makes it a chat request) and prints one ``RESULT {"id", "ids"}`` line per case
(``{"id", "error"}`` when the engine refuses it). ``MODEL_DIR`` holds a small model config (no weights) and
the tokenizer files under test.

* vLLM 0.33: its GPU-less render server (``vllm launch render MODEL_DIR --enable-auto-tool-choice
  --tool-call-parser hermes``), the code its OpenAI server delegates chat and completion preprocessing to,
  queried over HTTP (``/v1/chat/completions/render``, ``/v1/completions/render``).
* vLLM 0.11 (no render server): ``OpenAIServingChat.create_chat_completion`` and
  ``OpenAIServingCompletion.create_completion`` in process, with an engine client whose ``generate`` records
  the prompt it is handed (everything before it is vLLM's code).
* SGLang: ``OpenAIServingChat._convert_to_internal_request`` with SGLang's own ``ModelConfig``,
  ``get_tokenizer`` and ``TemplateManager`` (what its tokenizer manager holds), the prompt ids of the
  ``GenerateReqInput`` it builds; completions through ``OpenAIServingCompletion`` the same way, then
  SGLang's tokenizer on the text (``TokenizerManager`` encodes a text prompt with the tokenizer's defaults).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def emit(case_id: str, ids: Any = None, error: str | None = None) -> None:
    out = {"id": case_id, "ids": ids} if error is None else {"id": case_id, "error": error[:400]}
    print("RESULT " + json.dumps(out), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_render(model: str, cases: list[dict[str, Any]], parser: str) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "launch", "render", model,
                             "--port", str(port), "--served-model-name", "m", "--enable-auto-tool-choice",
                             "--tool-call-parser", parser], stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("vllm render server did not start") from None
                time.sleep(1)
        for case in cases:
            body = case["body"]
            path = "/v1/chat/completions/render" if "messages" in body else "/v1/completions/render"
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    data = json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                emit(case["id"], error=exc.read().decode(errors="replace"))
                continue
            first = data[0] if isinstance(data, list) else data
            emit(case["id"], first["token_ids"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def vllm_inprocess(model: str, cases: list[dict[str, Any]], parser: str) -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from vllm.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels
    from vllm.transformers_utils.tokenizer import get_tokenizer

    mc = ModelConfig(model=model)
    tok = get_tokenizer(model)

    class Handed(Exception):
        pass

    class Engine:  # what the serving classes read of an engine client before generate()
        errored = False
        dead_error = None
        model_config = mc
        processor = None
        io_processor = None

        async def get_tokenizer(self, lora_request: Any = None) -> Any:
            return tok

        async def is_tracing_enabled(self) -> bool:
            return False

        def generate(self, prompt: Any, *args: Any, **kwargs: Any) -> Any:
            raise Handed(json.dumps(list(prompt["prompt_token_ids"])))

    eng: Any = Engine()
    models = OpenAIServingModels(eng, mc, [BaseModelPath(name="m", model_path=model)])
    chat = OpenAIServingChat(eng, mc, models, "assistant", request_logger=None, chat_template=None,
                             chat_template_content_format="auto", enable_auto_tools=True, tool_parser=parser)
    cmpl = OpenAIServingCompletion(eng, mc, models, request_logger=None)

    async def run(body: dict[str, Any]) -> tuple[Any, str | None]:
        try:
            if "messages" in body:
                r = await chat.create_chat_completion(ChatCompletionRequest(**body), None)
            else:
                r = await cmpl.create_completion(CompletionRequest(**body), None)
        except Handed as h:
            return json.loads(str(h)), None
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return None, str(r)

    async def run_all() -> None:  # one loop: vLLM's tokenizer executor is bound to the first it sees
        for case in cases:
            ids, err = await run(case["body"])
            emit(case["id"], ids, err)

    asyncio.run(run_all())


def sglang(model: str, cases: list[dict[str, Any]], parser: str) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
    from sglang.srt.server_args import ServerArgs

    try:
        from sglang.srt.parser.template_manager import TemplateManager
    except ImportError:  # 0.5.3
        from sglang.srt.managers.template_manager import TemplateManager
    try:
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    except ImportError:  # 0.5.3
        from sglang.srt.hf_transformers_utils import get_tokenizer

    sa = ServerArgs(model_path=model, device="cpu", tool_call_parser=parser, served_model_name="m")
    try:
        from sglang.srt.runtime_context import publish

        publish(sa, role="tokenizer")
    except ImportError:  # 0.5.3 reads server_args directly
        pass
    mc = ModelConfig.from_server_args(sa)
    tok = get_tokenizer(model)

    class Manager:  # the attributes of a TokenizerManager the OpenAI layer reads when preprocessing
        server_args = sa
        model_config = mc
        tokenizer = tok
        processor = None
        model_path = model
        served_model_name = "m"

        def config_value(self, key: str) -> Any:
            return getattr(sa, key, None)

    tm: Any = Manager()
    templates = TemplateManager()
    templates.initialize_templates(tokenizer_manager=tm, model_path=model)
    chat = OpenAIServingChat(tm, templates)
    cmpl = OpenAIServingCompletion(tm, templates)
    for case in cases:
        body = case["body"]
        try:
            if "messages" in body:
                req = chat._convert_to_internal_request(ChatCompletionRequest(**body), None)[0]
            else:
                req = cmpl._convert_to_internal_request(CompletionRequest(**body), None)[0]
        except Exception as exc:
            emit(case["id"], error=f"{type(exc).__name__}: {exc}")
            continue
        ids = req.input_ids
        if ids is None:  # a text prompt: the tokenizer manager encodes it with the tokenizer's defaults
            text = req.text[0] if isinstance(req.text, list) else req.text
            ids = tok.encode(text)
        emit(case["id"], list(ids[0] if ids and isinstance(ids[0], list) else ids))


def main(engine: str, model: str, path: str, parser: str) -> int:
    with open(path) as f:
        cases = json.load(f)
    if engine == "sglang":
        sglang(model, cases, parser)
        return 0
    try:
        import vllm.entrypoints.scale_out.render.serving  # noqa: F401
    except ImportError:
        vllm_inprocess(model, cases, parser)
    else:
        vllm_render(model, cases, parser)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:5]))
