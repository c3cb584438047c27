"""Settings: defaults build, YAML round-trip, unknown keys and wrong types fail with the dotted path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.config import ConfigError, Settings, load, to_dict
from kvfleet.config.operator import OperatorSettings


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
    with pytest.raises(ConfigError, match="inline_route_bytes must be >= 0"):
        load(overrides={"epp": {"inline_route_bytes": -1}})


def test_nested_lists_dict_values_and_unknown_keys_name_the_path() -> None:
    """Types are checked everywhere, not only at the top of a class: a list element's field, a dict's values
    (a scorer's params once passed through unchecked) and an unknown key inside a list element."""
    with pytest.raises(ConfigError, match=r"^epp\.plugins\[1\]\.weight: Expected `float`, got `str`"):
        load(overrides={"epp": {"plugins": [{"type": "queue-scorer"},
                                            {"type": "prefix-cache-scorer", "weight": "high"}]}})
    with pytest.raises(ConfigError, match=r"^epp\.plugins\[0\]\.params.*Expected `float`, got `str`"):
        load(overrides={"epp": {"plugins": [{"type": "prefix-cache-scorer",
                                             "params": {"load_gain": "high"}}]}})
    with pytest.raises(ConfigError,
                       match=r"unknown setting\(s\): epp\.plugins\[0\]\.wieght; known: params, type, weight"):
        load(overrides={"epp": {"plugins": [{"type": "queue-scorer", "wieght": 1}]}})
    assert load(overrides={"epp": {"plugins": [
        {"type": "queue-scorer", "weight": 2}]}}).epp.plugins[0].weight == 2.0


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(path)


@pytest.mark.parametrize("clash", [{"agent_transfer_port": 7000}, {"agent_kv_events_port": 5557},
                                   {"agent_kv_events_port": 5556}, {"agent_metrics_port": 8000},
                                   {"agent_transfer_port": 0}])
def test_engine_pod_ports_must_differ(clash: dict[str, Any]) -> None:
    """The engine and the agent sidecar share a pod's network namespace: a port both would bind (the agent's
    KV-event replay port is its events port + 1) is refused when the settings load, not found as a crash loop
    in the pod."""
    with pytest.raises(ValueError, match=r"must differ|port number"):
        OperatorSettings(**clash)
