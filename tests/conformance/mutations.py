"""Break kvfleet's EPP one protocol rule at a time and show the suite catches each.

``python -m tests.conformance.mutations`` (from the repository root, with ``.venv``): for each rule, one
edit to kvfleet's picker that violates it, the suite's tests for that rule run against the broken picker,
and the edit is reverted (``git checkout`` of the file). Every line must say ``caught``. Not part of
``make test`` (it restarts the picker for each mutation; about 2 minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
P = "kvfleet/epp/"
#: (rule, file, text, broken text, the tests that must fail: a pytest -k expression)
MUTATIONS: list[tuple[str, str, str, str, str]] = [
    ("1 header and metadata carry the same list", P + "protocol.py",
     "meta = destination_metadata(dict(headers)[DEST_HEADER])",
     "meta = destination_metadata(dict(headers)[DEST_HEADER].split(',')[0])", "test_pick_is_set"),
    ("2 subset hint honoured", P + "server.py",
     "st.subset = protocol.subset_hint(msg.metadata_context)", "st.subset = None", "test_subset_hint"),
    ("3/4 no eligible or ready endpoint: 503", P + "errors.py",
     'status = 503\n    kind = "no_ready_endpoint"', 'status = 500\n    kind = "no_ready_endpoint"',
     "test_subset_without or test_no_ready"),
    ("5 shedding: 429", P + "errors.py", "status = 429", "status = 503", "test_a_saturated"),
    ("6 request body streamed back whole", P + "protocol.py",
     "streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=i == len(chunks) - 1))",
     "streamed_response=pb.StreamedBodyResponse(body=chunk[1:], end_of_stream=i == len(chunks) - 1))",
     "test_streamed"),
    ("6 destination set before the body", P + "server.py",
     "            return [protocol.pick_headers_response(headers), *protocol.streamed_body_responses(body)]\n"
     "        return [protocol.pick_headers_response(headers, as_body=True)]\n\n    def _route_other",
     "            return [*protocol.streamed_body_responses(body), protocol.pick_headers_response(headers)]\n"
     "        return [protocol.pick_headers_response(headers, as_body=True)]\n\n    def _route_other",
     "test_streamed"),
    ("6 BUFFERED picks with the body answer", P + "server.py",
     "        return [protocol.pick_headers_response(headers, as_body=True)]\n\n    def _route_other",
     "        return [protocol.buffered_body_ack(request=True)]\n\n    def _route_other", "test_buffered"),
    ("6 response body streamed back whole", P + "protocol.py",
     "streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream))",
     "streamed_response=pb.StreamedBodyResponse(body=chunk[:-1], end_of_stream=end_of_stream))",
     "test_response_phase"),
    ("7 served endpoint read", P + "protocol.py",
     "            return str(v.string_value)\n    attrs", "            return None\n    attrs",
     "test_response_phase"),
    ("8 unknown health service: NOT_FOUND", P + "server.py",
     "        else:\n            return None\n        return int(",
     "        else:\n            ok = True\n        return int(",
     "test_an_unknown"),
    ("8 ext_proc service name", P + "server.py", 'elif service in (READINESS, EXT_PROC_SERVICE, ""):',
     'elif service in (READINESS, ""):', "test_health"),
]


def main() -> int:
    results = []
    for rule, path, text, broken, tests in MUTATIONS:
        f = ROOT / path
        src = f.read_text()
        if src.count(text) != 1:
            print(f"{rule}: the text to break is not in {path} once; update this list", file=sys.stderr)
            return 2
        f.write_text(src.replace(text, broken))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "tests/conformance/test_protocol.py", "-k", tests],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
        finally:
            f.write_text(src)
        summary = (r.stdout.strip().splitlines() or ["?"])[-1]
        caught = r.returncode != 0
        results.append({"rule": rule, "caught": caught, "pytest": summary})
        print(f"{'caught' if caught else 'MISSED'}  {rule:45s} {summary}", flush=True)
    missed = [x["rule"] for x in results if not x["caught"]]
    print(json.dumps({"mutations": len(results), "caught": len(results) - len(missed), "missed": missed}))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
