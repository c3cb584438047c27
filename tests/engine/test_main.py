"""``kvfleet engine`` command line: a taken port or a bad setting is a one-line error and exit code 2."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvfleet.engine.main import main
from tests.engine.conftest import free_port


def test_taken_http_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["--port", str(port), "--kv-events-port", str(free_port()), "--kv-events-replay-port", "0"])
    assert rc == 2
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_taken_event_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["--port", str(free_port()), "--kv-events-port", str(port)])
    assert rc == 2
    assert "KV-event endpoint" in capsys.readouterr().err


def test_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  role: sideways\n")
    assert main(["--config", str(cfg)]) == 2
    assert "role must be one of" in capsys.readouterr().err
    cfg.write_text("engine:\n  prot: 1\n")
    assert main(["--config", str(cfg)]) == 2
    assert "engine.prot" in capsys.readouterr().err
