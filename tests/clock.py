"""The day the stored test data happens on: 12:00 UTC two days before the run, taken once when the tests import
this module (so a run across midnight keeps one date).

The tables keep raw rows 30 days (sql/migrations: ``TTL toDateTime(ts) + INTERVAL 30 DAY`` on gateway_requests,
request_attribution, vllm_metrics, ...) and ClickHouse drops rows that are already expired when they are
inserted, so data on a fixed date vanishes from the store a month after that date. Data at T0 is 36 to 60 hours
old whenever the suite runs: well inside every retention, never in the future, and always outside a "last 24 h"
window (the dashboard's freshness says "2 d ago" at any hour but the first minutes after midnight).

Assertions that spell a fixture time keep the time of day literal and take the date from here:
``f"{DAY} 12:02:30 UTC"``, ``f"{DAY}T12:01:00.000"``, ``f"{day(1)}T00:00:00Z"``.
"""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

#: 12:00:00 UTC two days ago: the fixture's clock starts here (tests/fixture_data.py's timeline).
T0 = datetime.combine(datetime.now(UTC).date() - timedelta(days=2), time(12), tzinfo=UTC)


def day(offset: int = 0) -> str:
    """T0's date ``offset`` days later (earlier when negative), as ``YYYY-MM-DD``."""
    return (T0 + timedelta(days=offset)).date().isoformat()


#: T0's date, ``YYYY-MM-DD``.
DAY = day()
