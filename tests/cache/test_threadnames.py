"""OS thread names (kvfleet/cache/threadnames.py): a thread started after configure() carries its Python
name in the kernel, where top -H, ps -L and the benches' per-thread CPU read it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvfleet.cache import threadnames

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")


def test_os_name_keeps_what_the_kernel_keeps() -> None:
    assert threadnames.os_name("epp-gossip") == b"epp-gossip"
    assert threadnames.os_name("kvfleet-xfer-accept-12345") == b"kvfleet-xfer-ac"
    # a multi-byte character cut at the 15th byte is dropped whole, not split
    assert threadnames.os_name("abcdefghijklmn\u00e9") == b"abcdefghijklmn"


@linux
def test_threads_started_after_configure_carry_their_names() -> None:
    # a child process: the hook is process-wide, and the test runner's own threads must not be renamed
    code = textwrap.dedent("""
        import threading, sys
        from kvfleet.cache import threadnames
        assert threadnames.configure()
        seen = {}
        def run(key):
            seen[key] = open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()
            seen[key + "-traced"] = sys.getprofile() is not None
        names = ("epp-gossip", "kvfleet-xfer-accept-9")
        ts = [threading.Thread(target=run, args=(n,), name=n) for n in names]
        for t in ts:
            t.start(); t.join()
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1, thread_name_prefix="epp-route") as ex:
            ex.submit(run, "pool").result()
        print(seen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    seen = eval(out.stdout)  # a dict literal printed by the child
    assert seen["epp-gossip"] == "epp-gossip"
    assert seen["kvfleet-xfer-accept-9"] == "kvfleet-xfer-ac"
    assert seen["pool"] == "epp-route_0"
    assert not any(v for k, v in seen.items() if k.endswith("-traced"))  # the hook removed itself


@linux
def test_the_kvfleet_command_installs_the_hook() -> None:
    # the real entry point: a role (its --help: it stops before serving) runs after the hook is in place,
    # so the threads it would start carry their names
    code = textwrap.dedent("""
        import contextlib, io, threading
        from kvfleet import cli
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli.main(["epp", "--help"])
        t = threading.Thread(target=lambda: print(open(
            f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()), name="ext-proc-loop")
        t.start(); t.join()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ext-proc-loop"
