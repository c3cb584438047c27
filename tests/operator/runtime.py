"""The real kopf runtime running kvfleet's handlers, for tests (against the real API server in
tests/cluster/test_operator.py).

kopf runs in its own thread and event loop (as ``kvfleet operator`` runs in its own process):
on stop it cancels every task of its loop that it did not start with, which must not include
the test's own tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import kopf
import pytest

from kvfleet.config import Settings
from kvfleet.operator.handlers import Runtime, build_registry


@contextlib.asynccontextmanager
async def running_operator(settings: Settings, namespace: str) -> AsyncIterator[Runtime]:
    """kvfleet's handlers under the real kopf runtime for the body of the ``async with``; fails loudly if it
    dies.

    It serves ``namespace``, as ``kvfleet operator --namespace`` does. kopf logs in with ``$KUBECONFIG``."""
    rt = Runtime(settings=settings)
    registry = build_registry(rt)
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, namespaces=[namespace], standalone=True,
                                      stop_flag=stop, ready_flag=ready))
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="kopf", daemon=True)
    thread.start()
    if not await asyncio.to_thread(ready.wait, 30):
        stop.set()
        pytest.fail(f"kopf did not become ready: {errors!r}")
    try:
        yield rt
    finally:
        alive_during_test = thread.is_alive()
        stop.set()
        await asyncio.to_thread(thread.join, 15)
    if thread.is_alive():
        pytest.fail("kopf did not stop within 15 s")
    if not alive_during_test or errors:
        pytest.fail(f"kopf died during the test: {errors!r}")

