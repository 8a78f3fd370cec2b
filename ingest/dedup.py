"""Exactly-once writes (ingester → here → store): before each insert, drop the rows the store already holds.

Delivery is at least once everywhere upstream: Kafka redelivers after a crash or a rebalance, a collector
re-sends from its last acknowledged checkpoint, an insert that timed out may have landed, a log can be
imported twice. Instead of collapsing the copies later (ReplacingMergeTree + FINAL on every read, and
materialized rollups that would count them twice), the ingester asks the store which identities of a batch
it holds and inserts only the others. One query per table and batch, bounded by the batch's time range so
ClickHouse reads only those days' partitions and the granules of that time.

Identity per table (:data:`IDENTITY`): gateway requests by (request_id, ts); vLLM scrapes by (pod, ts) (a
scrape's rows land or are skipped together); workload labels by request_id (one label per request, whatever
its ts); the rest by the envelope's ``event_id``.
The identity's first column is matched with ``IN``; the rest are compared here.

A copy is not always a redelivery. For gateway requests (:attr:`Identity.content`) the store's row is read too
and compared column by column with the incoming one (every column the writer sets, as stored: the values
:func:`ingest.rows.gateway_row` computes); so is a row against an earlier row of the same batch. Equal: a
redelivery, dropped silently. Different (two gateways reusing request ids, a corrupted replay, a gateway whose
clock stepped back): a *conflict*, returned with the columns that differ, never inserted (the stored row, or the
batch's first, stays as it is); the caller dead-letters it (docs/reliability.md, "Conflicting copies").

Not covered: two ingesters inserting the same identity at the same instant (only during a Kafka rebalance,
when a revoked member finishes a batch its successor already re-polled); docs/reliability.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import polars as pl

from ingest.store import Store


@dataclass(frozen=True)
class Identity:
    """How rows of one table are told apart: ``columns`` (the identity; ``columns[0]`` is a String looked up
    with IN), ``ts_column`` (a DateTime64 column that bounds the lookup; None = not bounded) and ``content``
    (True: one row per identity, whose other columns are compared with the stored row's to tell a redelivery
    from a conflict)."""

    columns: tuple[str, ...]
    ts_column: str | None
    content: bool = False


@dataclass(frozen=True)
class Verdict:
    """What :func:`check_rows` decided for a batch: ``keep``, the indexes of the rows to insert (in order), and
    ``conflicts``, index → the columns (names, in the caller's column order) in which that row differs from
    the stored row with its identity, or from the batch's earlier row with it. Rows in neither are copies of
    what is stored (redeliveries)."""

    keep: list[int]
    conflicts: dict[int, tuple[str, ...]]


IDENTITY: dict[str, Identity] = {
    "gateway_requests": Identity(("request_id", "ts"), "ts", content=True),
    "vllm_metrics": Identity(("pod", "ts"), "ts"),
    "vllm_cache_config": Identity(("pod", "ts"), "ts"),
    "kv_block_events": Identity(("event_id",), "ts"),
    "kv_event_gaps": Identity(("event_id",), None),
    "dead_letters": Identity(("event_id",), None),
    "workload_labels": Identity(("request_id",), None),
}


def _normal(value: Any) -> Any:
    """Identity values as comparable keys: datetimes as naive UTC with millisecond precision (what a
    DateTime64(3, 'UTC') column holds, whichever way the client hands it back)."""
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value.replace(microsecond=value.microsecond // 1000 * 1000)
    return value


def absent_rows(store: Store, table: str, rows: Sequence[tuple[Any, ...]], columns: Sequence[str],
                groups: Sequence[int] | None = None) -> list[int]:
    """Indexes of the ``rows`` (tuples in ``columns`` order) to insert, in order: :func:`check_rows`'s ``keep``
    (a conflicting row is not among them). Raises what :func:`check_rows` raises."""
    return check_rows(store, table, rows, columns, groups).keep


def check_rows(store: Store, table: str, rows: Sequence[tuple[Any, ...]], columns: Sequence[str],
               groups: Sequence[int] | None = None) -> Verdict:
    """Which of ``rows`` (tuples in ``columns`` order) ``table`` does not hold yet, and which conflict with it.

    ``groups``: the envelope each row came from (rows of one envelope share its identity when the identity
    is the envelope's event id: a scrape's 447 samples). When a batch carries one identity in several
    envelopes (a message delivered twice), only the first envelope's rows are kept. Default: every row its
    own envelope. Tables without an :data:`IDENTITY` entry keep every row. For a table whose identity has
    ``content``, a row whose identity is stored (or taken by an earlier envelope of the batch) with other
    values in any of ``columns`` is a conflict (:class:`Verdict`); equal to any stored row with its identity,
    it is a redelivery. Raises what :meth:`Store.query_rows` raises (StoreUnavailable: retry the batch).
    """
    ident = IDENTITY.get(table)
    if ident is None or not rows:
        return Verdict(list(range(len(rows))), {})
    groups = groups if groups is not None else range(len(rows))
    pos = [columns.index(c) for c in ident.columns]
    keys = [tuple(_normal(row[p]) for p in pos) for row in rows]
    present = _present(store, table, ident, rows, columns, keys)
    keep: list[int] = []
    conflicts: dict[int, tuple[str, ...]] = {}
    owner: dict[tuple[Any, ...], tuple[int, int]] = {}  # identity → (group, index) of the batch's first row
    for i, (key, group) in enumerate(zip(keys, groups, strict=True)):
        first = owner.setdefault(key, (group, i))
        if key in present:
            earlier = present[key]
        elif first[0] == group:
            keep.append(i)
            continue
        else:
            earlier = [rows[first[1]]]
        if ident.content:
            differ = _differ(columns, rows[i], earlier)
            if differ:
                conflicts[i] = differ
    return Verdict(keep, conflicts)


def _differ(columns: Sequence[str], row: tuple[Any, ...], earlier: list[tuple[Any, ...]]) -> tuple[str, ...]:
    """() when ``row`` equals one of ``earlier`` (rows in ``columns`` order) in every column, else the columns in
    which it differs from the first of them."""
    mine = [_normal(v) for v in row]
    found = ()
    for other in earlier:
        differ = tuple(c for c, a, b in zip(columns, mine, other, strict=True) if a != _normal(b))
        if not differ:
            return ()
        found = found or differ
    return found


def _present(store: Store, table: str, ident: Identity, rows: Sequence[tuple[Any, ...]], columns: Sequence[str],
             keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], list[tuple[Any, ...]]]:
    """The identities of ``keys`` that ``table`` holds → their stored rows in ``columns`` order (when the
    identity has ``content``; else [])."""
    first = sorted({k[0] for k in keys})
    where = f"{ident.columns[0]} IN {{ids:Array(String)}}"
    params: dict[str, Any] = {"ids": first}
    if ident.ts_column is not None:
        ts_pos = columns.index(ident.ts_column)
        stamps = [row[ts_pos] for row in rows]
        where += (f" AND {ident.ts_column} >= {{lo:DateTime64(3, 'UTC')}}"
                  f" AND {ident.ts_column} <= {{hi:DateTime64(3, 'UTC')}}")
        params.update(lo=min(stamps), hi=max(stamps))
    n = len(ident.columns)
    if not ident.content:
        found = store.query_rows(f"SELECT DISTINCT {', '.join(ident.columns)} FROM {table} WHERE {where}", params)
        return {tuple(_normal(v) for v in r): [] for r in found}
    out: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for r in store.query_rows(f"SELECT {', '.join((*ident.columns, *columns))} FROM {table} WHERE {where}", params):
        out.setdefault(tuple(_normal(v) for v in r[:n]), []).append(tuple(r[n:]))
    return out


def conflict_reason(table: str, identity: Sequence[Any], differ: Sequence[str]) -> str:
    """A conflict's dead-letter reason: its ``identity`` (values of ``IDENTITY[table].columns``; times as ISO 8601
    UTC with milliseconds) and the columns that differ."""
    def text(v: Any) -> str:
        if isinstance(v, datetime):
            return _normal(v).isoformat(timespec="milliseconds") + "Z"
        return str(v)

    key = ", ".join(f"{c}={text(v)}" for c, v in zip(IDENTITY[table].columns, identity, strict=True))
    return f"conflicts with the row {table} holds for {key}: {', '.join(differ)} differ (the stored row is kept)"


def stage_keys(store: Store, name: str, keys: pl.DataFrame) -> dict[str, Any]:
    """Put the distinct (request_id, ts) of ``keys`` in table key_stage as set ``name``, replacing the set;
    returns the query parameters that select it: ``set`` (use ``(request_id, ts) IN (SELECT request_id, ts
    FROM key_stage WHERE set = {set:String})``), and ``lo``/``hi``, the ts range (to bound the other side).
    Set names must be unique per writer (two writers sharing a name would see each other's keys)."""
    store.command("ALTER TABLE key_stage DELETE WHERE set = {set:String}", {"set": name})
    staged = keys.select("request_id", pl.col("ts").dt.cast_time_unit("ms").dt.convert_time_zone("UTC")).unique()
    store.insert_arrow("key_stage", staged.with_columns(pl.lit(name).alias("set")).select("set", "request_id", "ts")
                       .to_arrow())
    return {"set": name, "lo": keys["ts"].min(), "hi": keys["ts"].max()}


IN_STAGE = "(request_id, ts) IN (SELECT request_id, ts FROM key_stage WHERE set = {set:String})"
