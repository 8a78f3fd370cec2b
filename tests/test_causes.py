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


def test_every_drift_sub_cause_has_its_own_colour_fix_and_segment():
    """cache_salt_changed included: a fix of its own (not prefix_drift's generic one), a colour no other drift
    sub-cause has, and a segment name for findings and alerts."""
    from dashboard import findings

    subs = a.DRIFT_SUB_CAUSES
    assert a.CACHE_SALT_CHANGED in subs
    assert len({causes.color(a.PREFIX_DRIFT, s) for s in subs}) == len(subs)
    generic = causes.FIXES[(a.PREFIX_DRIFT, "")]
    assert all(causes.fix_for(a.PREFIX_DRIFT, s) not in (None, generic) for s in subs)
    assert set(findings.SEGMENT_OF) == set(subs) and set(findings.SEGMENT_OF.values()) <= set(findings.SEGMENT_WORDS)
