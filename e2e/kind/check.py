"""Requests through the kind gateway: prefix-aware routing and the P/D path (stdlib only).

1. Prefix reuse: for several shared system prompts, the first request warms a
   pod; every follow-up with the same prefix must report cached prompt tokens
   (``usage.prompt_tokens_details.cached_tokens``) covering most of that prefix —
   which only happens when the EPP sends it to the pod holding the prefix.
2. P/D: a request for the prefill/decode model succeeds, and the decode pod's
   engine reports KV bytes it pulled from the prefill engine (``kvfleet_transfer_bytes_total``).

The same checks run on one machine against the real API server and a node that runs the pods
(tests/cluster/test_serving.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from typing import Any


def complete(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


def cached(resp: dict[str, Any]) -> int:
    return int(((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def check_prefix_routing(url: str) -> None:
    for tenant in range(4):
        system = (f"You are assistant #{tenant} of the kvfleet e2e test. "
                  + "Answer briefly and precisely. " * 40)
        first = complete(url, "llama-3-8b", system + "Question 0?")
        prefix_tokens = int(first["usage"]["prompt_tokens"]) - 8
        for q in range(1, 6):
            resp = complete(url, "llama-3-8b", system + f"Question {q}?")
            hit = cached(resp)
            if hit < prefix_tokens * 0.8:
                sys.exit(f"tenant {tenant} question {q}: {hit} cached tokens of a ~{prefix_tokens}-token "
                         "shared prefix: not routed to its pod")
        print(f"tenant {tenant}: follow-ups reused the cached prefix (>= 80% of {prefix_tokens} tokens)")


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def engine_metrics(namespace: str, deployment: str) -> str:
    """The /metrics of a Deployment's engine container, read inside the pod (``kubectl exec``)."""
    code = ("import urllib.request;"
            "print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())")
    return subprocess.run(["kubectl", "-n", namespace, "exec", f"deploy/{deployment}", "-c", "engine", "--",
                           "python", "-c", code],
                          capture_output=True, text=True, check=True).stdout


def check_pd(url: str, decode_metrics: Callable[[], str], model: str = "llama-3-8b-pd") -> None:
    """A P/D request succeeds and the decode engine pulled its prompt's KV from the prefill engine
    (``kvfleet_transfer_bytes_total{direction="received"}`` on the decode engine's /metrics grew)."""
    before = metric_sum(decode_metrics(), "kvfleet_transfer_bytes_total")
    resp = complete(url, model, "Summarise the kvfleet design in one line. " * 60)
    if not resp.get("choices"):
        sys.exit(f"P/D request returned no choices: {resp}")
    after = metric_sum(decode_metrics(), "kvfleet_transfer_bytes_total")
    if after <= before:
        sys.exit("P/D request moved no KV bytes to the decode pod")
    print(f"P/D: decode pod received {after - before:.0f} KV bytes from the prefill pod")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", default="kvfleet")
    args = parser.parse_args()
    check_prefix_routing(args.url)
    check_pd(args.url, lambda: engine_metrics(args.namespace, "sim-pd-p0-decode"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
