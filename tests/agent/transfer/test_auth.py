"""The HMAC challenge: right secret passes both ways, wrong secret is rejected, logged and counted; secret
loading."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvfleet.agent.transfer import AuthError, TransferClient, TransferServer, auth
from kvfleet.config.transfer import TransferSettings
from tests.agent.transfer.conftest import SECRET, peer


def test_macs_depend_on_secret_role_and_both_nonces() -> None:
    ns, nc = auth.new_nonce(), auth.new_nonce()
    m = auth.mac(SECRET, b"c", ns, nc)
    auth.verify(SECRET, b"c", ns, nc, m)
    for args in [(b"other", b"c", ns, nc), (SECRET, b"s", ns, nc), (SECRET, b"c", nc, ns)]:
        with pytest.raises(AuthError):
            auth.verify(*args, m)
    with pytest.raises(AuthError):
        auth.verify(SECRET, b"c", ns, nc, "not-bytes")


async def test_wrong_secret_is_rejected_logged_and_counted(
    server: TransferServer, settings: TransferSettings, hashes: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    intruder = TransferClient(b"wrong-secret", settings=settings)
    with caplog.at_level(logging.WARNING, logger="kvfleet.agent.transfer.server"):
        handle = intruder.pull(peer(server), hashes)
        with pytest.raises(AuthError):
            await handle.wait()
    assert handle.stats.retries == 0  # permanent: never retried
    assert server.metrics.auth_rejections._value.get() == 1
    assert server.metrics.errors.labels("auth")._value.get() == 1
    assert any("rejected peer" in r.message for r in caplog.records)
    # the server still serves a peer that holds the secret
    good = TransferClient(SECRET, settings=settings)
    assert len(await good.pull(peer(server), hashes[:2]).collect()) == 2


async def test_client_rejects_a_server_without_the_secret(settings: TransferSettings, store: object,
                                                          hashes: list[int]) -> None:
    """Mutual: a server that does not know the secret cannot pass as the peer."""
    from kvfleet.agent.transfer import MemoryBlockStore

    assert isinstance(store, MemoryBlockStore)
    async with TransferServer(store, b"impostor", settings=settings) as srv:
        handle = TransferClient(SECRET, settings=settings).pull(peer(srv), hashes)
        with pytest.raises(AuthError):
            await handle.wait()


def test_empty_secrets_are_refused(store: object) -> None:
    with pytest.raises(AuthError):
        TransferClient(b"")
    with pytest.raises(AuthError):
        TransferServer(store, b"")  # type: ignore[arg-type]


def test_load_secret_from_file_then_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"from-file\n")
    assert auth.load_secret(str(f)) == b"from-file"
    monkeypatch.setenv("KVFLEET_TRANSFER_SECRET", "from-env")
    assert auth.load_secret("") == b"from-env"
    monkeypatch.delenv("KVFLEET_TRANSFER_SECRET")
    with pytest.raises(AuthError, match="KVFLEET_TRANSFER_SECRET"):
        auth.load_secret("")
