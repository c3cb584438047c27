"""The engine simulator refuses exactly the request bodies vLLM refuses: each body below goes through
vLLM's own ``ChatCompletionRequest`` / ``CompletionRequest`` (tests/interop/vllm_request_check.py, in each
tested release's venv) and through the simulator's :func:`~kvfleet.engine.requests.check_request_fields`;
accepted by one, accepted by the other. (Sampling ranges are vLLM's ``SamplingParams`` checks, later in
its server; the simulator's :func:`~kvfleet.engine.requests.check_sampling` quotes them.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.requests import ApiError, check_request_fields
from kvfleet.operator.engines import VLLM_TESTED
from tests.interop.conftest import engine_python

HERE = Path(__file__).parent
VERSIONS = [".".join(map(str, v)) for v in VLLM_TESTED]
M = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

#: id → (chat?, extra fields of the body)
CASES: dict[str, tuple[bool, dict[str, Any]]] = {
    "chat": (True, {}),
    "chat-logprobs-true": (True, {"logprobs": True}),
    "chat-logprobs-yes": (True, {"logprobs": "yes"}),
    "chat-logprobs-5": (True, {"logprobs": 5}),
    "chat-logprobs-list": (True, {"logprobs": [True]}),
    "chat-top": (True, {"logprobs": True, "top_logprobs": 5}),
    "chat-top-without-logprobs": (True, {"top_logprobs": 5}),
    "chat-top-zero-without-logprobs": (True, {"top_logprobs": 0}),
    "chat-top-negative": (True, {"logprobs": True, "top_logprobs": -2}),
    "chat-top-string": (True, {"logprobs": True, "top_logprobs": "3"}),
    "chat-top-float": (True, {"logprobs": True, "top_logprobs": 2.5}),
    "chat-salt": (True, {"cache_salt": "tenant-1"}),
    "chat-salt-empty": (True, {"cache_salt": ""}),
    "chat-salt-int": (True, {"cache_salt": 5}),
    "chat-bias": (True, {"logit_bias": {"5": 1.5}}),
    "chat-bias-list": (True, {"logit_bias": [1, 2]}),
    "chat-bias-word": (True, {"logit_bias": {"5": "x"}}),
    "chat-tools": (True, {"tools": [FN]}),
    "chat-tools-string": (True, {"tools": "x"}),
    "chat-tools-element-string": (True, {"tools": ["f"]}),
    "chat-tools-no-name": (True, {"tools": [{"type": "function", "function": {}}]}),
    "chat-tools-no-type": (True, {"tools": [{"function": {"name": "f"}}]}),
    "completion": (False, {}),
    "completion-logprobs": (False, {"logprobs": 3}),
    "completion-logprobs-negative": (False, {"logprobs": -2}),
    "completion-logprobs-string": (False, {"logprobs": "x"}),
    "completion-logprobs-true": (False, {"logprobs": True}),
    "completion-salt-empty": (False, {"cache_salt": ""}),
    "completion-bias-list": (False, {"logit_bias": [1]}),
}


def body(chat: bool, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", **({"messages": M} if chat else {"prompt": "hi"}), **extra}


def simulator_accepts(chat: bool, data: dict[str, Any]) -> bool:
    try:
        check_request_fields(data, chat)
    except ApiError:
        return False
    return True


@pytest.mark.parametrize("version", VERSIONS)
def test_the_simulator_refuses_what_vllm_refuses(version: str, tmp_path: Path) -> None:
    import json
    import subprocess

    py = engine_python("vllm", version)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([{"id": k, "chat": c, "body": body(c, x)} for k, (c, x) in CASES.items()]))
    proc = subprocess.run([str(py), str(HERE / "vllm_request_check.py"), str(path)], capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    got = {r["id"]: r for r in (json.loads(line[7:]) for line in proc.stdout.splitlines()
                                if line.startswith("RESULT "))}
    assert set(got) == set(CASES), proc.stderr[-3000:]
    differ = {k: (got[k]["ok"], got[k]["error"]) for k, (c, x) in CASES.items()
              if got[k]["ok"] != simulator_accepts(c, body(c, x))}
    assert not differ, f"vLLM {version} (accepts?, its error) where the simulator answers otherwise: {differ}"
    assert not got["chat-tools-string"]["ok"] and got["chat"]["ok"]  # the check itself can tell both
