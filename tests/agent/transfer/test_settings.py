"""TransferSettings: defaults, validation, and its place in the nested Settings."""

from __future__ import annotations

import pytest

from kvfleet.config import ConfigError, Settings, load
from kvfleet.config.transfer import TransferSettings


def test_defaults_nest_in_settings() -> None:
    assert Settings().transfer == TransferSettings()
    assert TransferSettings().backends == ("shm", "tcp")


def test_overrides_load() -> None:
    s = load(overrides={"transfer": {"streams": 2, "backends": ["tcp"]}})
    assert s.transfer.streams == 2 and s.transfer.backends == ("tcp",)


@pytest.mark.parametrize(
    "bad",
    [{"streams": 0}, {"window_blocks": 0}, {"max_retries": -1}, {"backends": ["carrier-pigeon"]},
     {"port": 70000}, {"stall_timeout_s": 0}, {"handshake_timeout_s": 0}, {"max_connections": 0},
     {"max_handshakes": 0}, {"strems": 2}],
)
def test_bad_values_are_clear_errors(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        load(overrides={"transfer": bad})
