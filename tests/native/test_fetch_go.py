"""native/fetch_go.py, the Dockerfile's Go toolchain download: its module hash is Go's own (``go mod
download`` is the oracle), and a zip that does not hash to the checksum database's record is refused."""

from __future__ import annotations

import importlib.util
import io
import json
import platform
import shutil
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[2]


def _fetch_go() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_go", ROOT / "native" / "fetch_go.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain")
def test_the_module_hash_is_go_s() -> None:
    out = subprocess.run(["go", "mod", "download", "-json", "google.golang.org/grpc"],
                         cwd=ROOT / "native" / "epp-front", capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    with zipfile.ZipFile(info["Zip"]) as zf:
        assert _fetch_go().dirhash(zf) == info["Sum"]


@pytest.fixture
def proxy() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A module proxy serving whatever ``files`` holds (path → body)."""
    files: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", files
    srv.shutdown()


def test_a_zip_the_checksum_database_does_not_vouch_for_is_refused(
        proxy: tuple[str, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, files = proxy
    fg = _fetch_go()
    mod = f"golang.org/toolchain@v0.0.1-go9.9.9.linux-{fg._ARCH[platform.machine().lower()]}"
    path, ver = mod.split("@")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(f"{mod}/bin/go", b"#!/bin/sh\necho tampered\n")
    files[f"/{path}/@v/{ver}.zip"] = buf.getvalue()
    good = "h1:" + "A" * 43 + "="  # what the database holds for the genuine zip
    record = f"1\n{path} {ver} {good}\n\ngo.sum database tree\n"
    files[f"/sumdb/sum.golang.org/lookup/{mod}"] = record.encode()
    monkeypatch.setenv("GOPROXY", url)
    monkeypatch.delenv("GOSUMDB", raising=False)
    with pytest.raises(SystemExit, match="is not the checksum database's"):
        fg.main([str(tmp_path / "go"), "9.9.9"])
    assert not (tmp_path / "go" / "bin" / "go").exists()
    # the same zip with the database's record of it installs
    with zipfile.ZipFile(io.BytesIO(files[f"/{path}/@v/{ver}.zip"])) as zf:
        real = fg.dirhash(zf)
    files[f"/sumdb/sum.golang.org/lookup/{mod}"] = f"1\n{path} {ver} {real}\n".encode()
    assert fg.main([str(tmp_path / "go"), "9.9.9"]) == 0
    assert (tmp_path / "go" / "bin" / "go").read_bytes().endswith(b"tampered\n")
