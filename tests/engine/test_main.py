"""``kvfleet engine`` command line: a taken port, a bad setting or an unusable SSD directory is a one-line
error and exit code 2."""

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


def test_an_ssd_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "ssd"
    afile.write_bytes(b"")
    rc = main(["--port", str(free_port()), "--kv-events-port", str(free_port()),
               "--kv-events-replay-port", "0", "--ssd-dir", str(afile)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "engine.tiers.ssd_dir" in err and "is not a directory" in err and "Traceback" not in err
