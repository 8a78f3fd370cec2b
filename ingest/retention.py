"""Rows already past their table's retention: ClickHouse drops them at insert, so kvscope sets them aside first.

Most tables carry a TTL (sql/migrations: ``TTL toDateTime(ts) + INTERVAL 30 DAY`` on gateway_requests,
vllm_metrics, workload_labels, ...). ClickHouse applies a TTL to the rows of a part as it writes the part
(https://clickhouse.com/docs/engines/table-engines/mergetree-family/mergetree#table_engine-mergetree-ttl): a row
whose TTL has already passed never becomes visible, and the INSERT still succeeds. Without this module a
backfill of a 40-day-old gateway log, or a replay that lags by more than the retention, would report rows
written that no query ever sees. The writers (:mod:`ingest.ingester`, :mod:`ingest.bulk`, :mod:`ingest.labels`)
ask :class:`Retentions` which rows are expired and count and dead-letter them (reason
:func:`Retentions.reason`) instead.

The retention is read from the store (``system.tables.engine_full``), so a TTL an operator changed with
``ALTER TABLE ... MODIFY TTL`` is the one applied. Only the plain form ``TTL <column> + INTERVAL n UNIT``
(optionally ``toDateTime(<column>)``) is understood; a table with any other TTL is treated as having none.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ingest.store import Store

#: ClickHouse's normalized TTL text, e.g. ``toDateTime(ts) + toIntervalDay(30)`` or ``minute + toIntervalDay(400)``.
_TTL = re.compile(r"^(?:toDateTime\((\w+)\)|(\w+)) \+ toInterval(Second|Minute|Hour|Day|Week|Month|Quarter|Year)"
                  r"\((\d+)\)$")
_ENGINE_TTL = re.compile(r" TTL (.+?)(?: SETTINGS |$)")


@dataclass(frozen=True)
class Retention:
    """One table's TTL: rows whose ``column`` (a DateTime/DateTime64, UTC) lies before ``cutoff`` are dropped.
    ``text``: the TTL as ClickHouse shows it, e.g. ``toDateTime(ts) + toIntervalDay(30)``."""

    table: str
    column: str
    text: str
    cutoff: datetime

    def expired(self, ts: datetime) -> bool:
        """Whether a row stamped ``ts`` (timezone-aware, or naive UTC) would be dropped at insert: its TTL
        (``toDateTime(ts)``, whole seconds, plus the interval) is at or before now. At the boundary second it
        says expired (set aside and kept as a dead letter) rather than risk a silent drop."""
        ts = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
        return ts.replace(microsecond=0) <= self.cutoff

    def reason(self, ts: datetime) -> str:
        """The dead-letter reason for a row stamped ``ts``."""
        return (f"older than the retention of {self.table} (TTL {self.text}): {self.column} {ts.isoformat()} is "
                f"at or before {self.cutoff.isoformat()}; ClickHouse would drop the row at insert, so it is kept "
                "here instead")

    def reason_for_many(self, count: int) -> str:
        """The dead-letter reason for ``count`` rows set aside together."""
        return (f"{count} rows older than the retention of {self.table} (TTL {self.text}): {self.column} at or "
                f"before {self.cutoff.isoformat()}; ClickHouse would drop them at insert, so they were not loaded")


class Retentions:
    """The TTLs of the store's tables (:class:`Retention` per table), read from ``system.tables`` and re-read
    after ``refresh_seconds`` (cutoffs move with the clock; an ALTER changes the TTL). Raises what
    :meth:`Store.query_rows` raises."""

    def __init__(self, store: Store, refresh_seconds: float = 60.0) -> None:
        self.store = store
        self.refresh_seconds = refresh_seconds
        self._read_at = float("-inf")
        self._by_table: dict[str, Retention] = {}

    def get(self, table: str) -> Retention | None:
        """The retention of ``table``, or None when it has no plain TTL."""
        if time.monotonic() - self._read_at > self.refresh_seconds:
            self._by_table = read_retentions(self.store)
            self._read_at = time.monotonic()
        return self._by_table.get(table)

    def split(self, table: str, rows: list[Any], ts_of: Any) -> tuple[list[int], list[int]]:
        """(indexes of rows to insert, indexes of expired rows) of ``rows``; ``ts_of(row)`` gives a row's
        stamp in the TTL's column (None: kept)."""
        retention = self.get(table)
        if retention is None:
            return list(range(len(rows))), []
        keep: list[int] = []
        expired: list[int] = []
        for i, row in enumerate(rows):
            ts = ts_of(row)
            (expired if ts is not None and retention.expired(ts) else keep).append(i)
        return keep, expired


def read_retentions(store: Store) -> dict[str, Retention]:
    """{table: :class:`Retention`} for every table of the store's database with a plain TTL, cutoffs computed
    by ClickHouse itself (``now() - INTERVAL``, so months and years follow its calendar)."""
    rows = store.query_rows("SELECT name, engine_full FROM system.tables WHERE database = currentDatabase() "
                            "AND engine_full LIKE '% TTL %'")
    parsed: dict[str, tuple[str, str, str, int]] = {}
    for name, engine in rows:
        found = _ENGINE_TTL.search(str(engine))
        match = _TTL.match(found.group(1).strip()) if found else None
        if match:
            parsed[str(name)] = (match.group(1) or match.group(2), found.group(1).strip(), match.group(3),
                                 int(match.group(4)))
    if not parsed:
        return {}
    exprs = ", ".join(f"toDateTime(now(), 'UTC') - toInterval{unit}({n})" for _, _, unit, n in parsed.values())
    cutoffs = store.query_rows(f"SELECT {exprs}")[0]
    out: dict[str, Retention] = {}
    for (table, (column, text, _, _)), cutoff in zip(parsed.items(), cutoffs, strict=True):
        cutoff = cutoff if cutoff.tzinfo else cutoff.replace(tzinfo=UTC)
        out[table] = Retention(table, column, text, cutoff.astimezone(UTC))
    return out
