"""The settings table: every setting documented, env and flags applied, unknown KVSCOPE_ variables refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.config import SETTINGS, ConfigError, build_config


def test_every_setting_has_help_and_is_in_the_readme() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for s in SETTINGS:
        assert s.help and len(s.help) > 10, s.name
        assert f"`{s.env}`" in readme, f"{s.env} is not documented in README.md"


def test_precedence_flags_over_env_over_default() -> None:
    cfg = build_config({"dashboard_port": 9000}, environ={"KVSCOPE_DASHBOARD_PORT": "8000",
                                                          "KVSCOPE_SCRAPE_INTERVAL_SECONDS": "2.5"})
    assert cfg.dashboard_port == 9000
    assert cfg.scrape_interval_seconds == 2.5
    assert build_config({}, environ={}).database == "kvscope"


def test_unknown_variable_stops_startup() -> None:
    with pytest.raises(ConfigError, match="KVSCOPE_DATADIR"):
        build_config({}, environ={"KVSCOPE_DATADIR": "/tmp/x"})


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match="KVSCOPE_DASHBOARD_PORT"):
        build_config({}, environ={"KVSCOPE_DASHBOARD_PORT": "eighty"})
