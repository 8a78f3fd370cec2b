"""The shared cause vocabulary (dashboard/causes.py) covers every cause the attribution writes."""

from __future__ import annotations

from dashboard import causes
from ingest import attribution as a


def test_every_cause_has_a_place_and_its_own_colour():
    assert sorted(causes.CAUSE_ORDER) == sorted(a.CAUSES)
    colours = [causes.color(c) for c in a.CAUSES]
    assert causes.FALLBACK_COLOR not in colours
    assert len(set(colours)) == len(colours)


def test_beyond_horizon_has_no_fix_and_sits_with_cold():
    assert not causes.actionable(a.BEYOND_HORIZON)
    order = causes.CAUSE_ORDER
    assert abs(order.index(a.BEYOND_HORIZON) - order.index(a.COLD)) == 1
