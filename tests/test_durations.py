"""kvscope.durations: the one parser and formatter of durations (digest, alert rules, dashboard)."""

import pytest

from dashboard.alert_rules import parse_duration as rule_duration
from kvscope.durations import human, parse_seconds


def test_terms_add_up_and_units_are_the_documented_ones() -> None:
    assert parse_seconds("1h30m") == 5400 == parse_seconds("1.5h") == parse_seconds(" 90 m ")
    assert parse_seconds("1w") == 7 * 86400 and parse_seconds("45s") == 45
    for bad in ("", "10", "1y", "h", "-1h", "0s", "1h 2x"):
        with pytest.raises(ValueError):
            parse_seconds(bad)


def test_alert_rules_take_whole_numbers_or_toml_seconds() -> None:
    assert rule_duration("1h30m") == 5400 and rule_duration(600) == 600
    for bad in ("1.5h", True, 0, -5, 1.5):
        with pytest.raises(ValueError):
            rule_duration(bad)


def test_human_uses_the_largest_unit_below_its_limit() -> None:
    cases = {0.85: "850 ms", 2.1: "2.1 s", 45: "45 s", 70: "1.2 min", 600: "10 min", 3600: "1 h",
             12600: "3.5 h", 172800: "2 d", None: "–"}
    assert {k: human(k) for k in cases} == cases
