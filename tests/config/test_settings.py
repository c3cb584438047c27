"""Settings: defaults build, YAML round-trip, unknown keys and wrong types fail with the dotted path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvfleet.config import ConfigError, Settings, load, to_dict


def test_defaults_build_and_round_trip(tmp_path: Path) -> None:
    """Every concern is defaulted; dumping the defaults and loading them back gives the same object."""
    s = Settings()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(to_dict(s)))
    assert load(path) == s


def test_overrides_merge_nested() -> None:
    s = load(overrides={"cache": {"block_size": 32}})
    assert s.cache.block_size == 32
    assert s.cache.hash_algo == Settings().cache.hash_algo


def test_unknown_key_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  blok_size: 16\n")
    with pytest.raises(ConfigError, match=r"cache\.blok_size"):
        load(path)


def test_wrong_type_and_invalid_value() -> None:
    with pytest.raises(ConfigError, match=r"cache\.block_size"):
        load(overrides={"cache": {"block_size": "sixteen"}})
    with pytest.raises(ConfigError, match="block_size must be > 0"):
        load(overrides={"cache": {"block_size": 0}})


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(path)
