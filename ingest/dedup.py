"""Exactly-once writes (ingester → here → store): before each insert, drop the rows the store already holds.

Delivery is at least once everywhere upstream: Kafka redelivers after a crash or a rebalance, a collector
re-sends from its last acknowledged checkpoint, an insert that timed out may have landed, a log can be
imported twice. Instead of collapsing the copies later (ReplacingMergeTree + FINAL on every read, and
materialized rollups that would count them twice), the ingester asks the store which identities of a batch
it holds and inserts only the others. One query per table and batch, bounded by the batch's time range so
ClickHouse reads only those days' partitions and the granules of that time (and a second one, for the stored
rows, only when the batch holds identities the store has and the table compares content).

Identity per table (:data:`IDENTITY`): gateway requests by (request_id, ts); vLLM scrapes by (pod, ts) (a
scrape's rows land or are skipped together); workload labels by request_id (one label per request, whatever
its ts); the rest by the envelope's ``event_id``. KV events are also checked block by block
(:mod:`ingest.kv_pieces`): a batch sent again in parts cut elsewhere carries other event ids.
The identity's first column is matched with ``IN``; the rest are compared here.

A copy is not always a redelivery. For gateway requests and vLLM scrapes (:attr:`Identity.content`) the stored
rows are read too and compared, column by column, with the incoming ones (every column the writer sets, as
stored: the values :mod:`ingest.rows` computes); so is an envelope against an earlier envelope of the batch
with the same identity. Equal: a redelivery, dropped silently. Different (two gateways reusing request ids, a
corrupted replay, a gateway whose clock stepped back, a second collector scraping a pod under the same name):
a *conflict*, returned with the columns that differ, never inserted (the stored rows, or the batch's first,
stay as they are); the caller dead-letters it (docs/reliability.md, "Conflicting copies").

Not covered: two ingesters inserting the same identity at the same instant (only during a Kafka rebalance,
when a revoked member finishes a batch its successor already re-polled); docs/reliability.md. Both copies are
then stored; the attribution job reads them as one request (:func:`one_per_identity`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import polars as pl

from ingest.store import Store


@dataclass(frozen=True)
class Identity:
    """How rows of one table are told apart: ``columns`` (the identity; ``columns[0]`` is a String looked up
    with IN), ``ts_column`` (a DateTime64 column that bounds the lookup; None = not bounded) and ``content``
    (True: the rows of an identity are compared with the stored ones to tell a redelivery from a conflict;
    such an identity is (String, DateTime64))."""

    columns: tuple[str, ...]
    ts_column: str | None
    content: bool = False


@dataclass(frozen=True)
class Verdict:
    """What :func:`check_rows` decided for a batch: ``keep``, the indexes of the rows to insert (in order), and
    ``conflicts``, index → the columns (names, in the caller's column order) in which that row's envelope
    differs from the stored rows with its identity, or from the batch's earlier envelope with it. Rows in
    neither are copies (redeliveries)."""

    keep: list[int]
    conflicts: dict[int, tuple[str, ...]]


IDENTITY: dict[str, Identity] = {
    "gateway_requests": Identity(("request_id", "ts"), "ts", content=True),
    "vllm_metrics": Identity(("pod", "ts"), "ts", content=True),
    "vllm_cache_config": Identity(("pod", "ts"), "ts", content=True),
    "kv_block_events": Identity(("event_id",), "ts"),
    "kv_event_gaps": Identity(("event_id",), None),
    "dead_letters": Identity(("event_id",), None),
    # a labelled request is (request_id, ts), as gateway_requests': two labelled runs may reuse ids
    "workload_labels": Identity(("request_id", "ts"), "ts"),
}


def _normal(value: Any) -> Any:
    """Values as comparable, hashable keys: datetimes as naive UTC with millisecond precision (what a
    DateTime64(3, 'UTC') column holds, whichever way the client hands it back), arrays and maps as tuples."""
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value.replace(microsecond=value.microsecond // 1000 * 1000)
    if isinstance(value, list | tuple):
        return tuple(_normal(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _normal(v)) for k, v in value.items()))
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
    is the envelope's event id or a scrape's (pod, ts): a scrape's 447 samples). When a batch carries one
    identity in several envelopes (a message delivered twice), only the first envelope's rows are kept. Default:
    every row its own envelope. Tables without an :data:`IDENTITY` entry keep every row. For a table whose
    identity has ``content``, an envelope's rows whose identity is stored (or taken by an earlier envelope of
    the batch) are a redelivery when each of them is among the stored rows (or the earlier envelope's) with
    that identity, equal in every one of ``columns``; otherwise they are all a conflict (:class:`Verdict`).
    Raises what :meth:`Store.query_rows` raises (StoreUnavailable: retry the batch).
    """
    ident = IDENTITY.get(table)
    if ident is None or not rows:
        return Verdict(list(range(len(rows))), {})
    groups = groups if groups is not None else range(len(rows))
    pos = [columns.index(c) for c in ident.columns]
    keys = [tuple(_normal(row[p]) for p in pos) for row in rows]
    members: dict[tuple[tuple[Any, ...], int], list[int]] = {}  # (identity, envelope) → its rows, in order
    for i, (key, group) in enumerate(zip(keys, groups, strict=True)):
        members.setdefault((key, group), []).append(i)
    present = _present(store, table, ident, rows, columns, keys)
    if ident.content and present:
        present = _stored_rows(store, table, ident, columns, present)
    keep: list[int] = []
    conflicts: dict[int, tuple[str, ...]] = {}
    owner: dict[tuple[Any, ...], int] = {}  # identity → the batch's first envelope with it
    for (key, group), mine in members.items():
        first = owner.setdefault(key, group)
        if key not in present and first == group:
            keep.extend(mine)
        elif ident.content:
            earlier = present.get(key) or [rows[i] for i in members[(key, first)]]
            differ = _differ(columns, [rows[i] for i in mine], earlier, ident.columns)
            conflicts.update(dict.fromkeys(mine, differ) if differ else {})
    return Verdict(sorted(keep), conflicts)


def _differ(columns: Sequence[str], mine: list[tuple[Any, ...]], earlier: list[tuple[Any, ...]],
            identity: Sequence[str]) -> tuple[str, ...]:
    """() when every row of ``mine`` is among ``earlier`` (rows in ``columns`` order; a multiset), else the
    columns in which the rows that are not hold a value no row of ``earlier`` holds (all but the identity's when
    each value is found but not together)."""
    theirs = Counter(tuple(_normal(v) for v in r) for r in earlier)
    extra = list((Counter(tuple(_normal(v) for v in r) for r in mine) - theirs).elements())
    if not extra:
        return ()
    differ = tuple(c for j, c in enumerate(columns) if {r[j] for r in extra} - {r[j] for r in theirs})
    return differ or tuple(c for c in columns if c not in identity)


def _present(store: Store, table: str, ident: Identity, rows: Sequence[tuple[Any, ...]], columns: Sequence[str],
             keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], list[tuple[Any, ...]]]:
    """The identities of ``keys`` that ``table`` holds (→ [], filled by :func:`_stored_rows`)."""
    first = sorted({k[0] for k in keys})
    where = f"{ident.columns[0]} IN {{ids:Array(String)}}"
    params: dict[str, Any] = {"ids": first}
    if ident.ts_column is not None:
        ts_pos = columns.index(ident.ts_column)
        stamps = [row[ts_pos] for row in rows]
        where += (f" AND {ident.ts_column} >= {{lo:DateTime64(3, 'UTC')}}"
                  f" AND {ident.ts_column} <= {{hi:DateTime64(3, 'UTC')}}")
        params.update(lo=min(stamps), hi=max(stamps))
    cols = ", ".join(ident.columns)
    found = store.query_rows(f"SELECT DISTINCT {cols} FROM {table} WHERE {where}", params)
    wanted = set(keys)
    return {k: [] for k in (tuple(_normal(v) for v in r) for r in found) if k in wanted}


def _stored_rows(store: Store, table: str, ident: Identity, columns: Sequence[str],
                 present: dict[tuple[Any, ...], list[tuple[Any, ...]]]) -> dict[tuple[Any, ...], list[tuple[Any, ...]]]:
    """``present`` with the stored rows (in ``columns`` order) of each identity: one more query, read only when a
    batch holds identities the table has (a redelivery or a conflict). Identities of (String, DateTime64) only."""
    first, second = ident.columns
    found = store.query_rows(
        f"SELECT {first}, {second}, {', '.join(columns)} FROM {table} WHERE {first} IN {{ids:Array(String)}} "
        f"AND {second} IN {{stamps:Array(DateTime64(3, 'UTC'))}}",
        {"ids": sorted({k[0] for k in present}), "stamps": sorted({k[1] for k in present})})
    out: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {k: [] for k in present}
    for r in found:
        key = (_normal(r[0]), _normal(r[1]))
        if key in out:
            out[key].append(tuple(r[2:]))
    return out


def conflict_reason(table: str, differ: Sequence[str]) -> str:
    """A conflict's dead-letter reason: the table, its identity's columns and the columns that differ. The
    identity's values are left to the dead letter's ``raw`` (the line or rows), so that the ``dead_letters``
    query, which counts by reason, counts the conflicts of one kind together."""
    return (f"conflicts with what {table} holds for its ({', '.join(IDENTITY[table].columns)}): "
            f"{', '.join(differ)} differ (the stored one is kept)")


def stage_keys(store: Store, name: str, keys: pl.DataFrame) -> dict[str, Any]:
    """Put the distinct (request_id, ts) of ``keys`` in table key_stage as set ``name``, replacing the set;
    returns the query parameters that select it: ``set`` (use ``(request_id, ts) IN (SELECT request_id, ts
    FROM key_stage WHERE set = {set:String})``), and ``lo``/``hi``, the ts range (to bound the other side).
    Set names must be unique per writer (two writers sharing a name would see each other's keys)."""
    return _replace_set(store, name, keys, keys.select(
        "request_id", pl.col("ts").dt.cast_time_unit("ms").dt.convert_time_zone("UTC")).unique())


def _replace_set(store: Store, name: str, keys: pl.DataFrame, staged: pl.DataFrame) -> dict[str, Any]:
    """Replace key_stage's set ``name`` with the rows ``staged`` (some of its columns; the others take their
    defaults); returns the parameters ``set``, ``lo`` and ``hi`` (the ts range of ``keys``)."""
    store.command("ALTER TABLE key_stage DELETE WHERE set = {set:String}", {"set": name})
    store.insert_arrow("key_stage", staged.select(pl.lit(name).alias("set"), pl.all()).to_arrow())
    return {"set": name, "lo": keys["ts"].min(), "hi": keys["ts"].max()}


IN_STAGE = "(request_id, ts) IN (SELECT request_id, ts FROM key_stage WHERE set = {set:String})"


def stage_order_keys(store: Store, name: str, keys: pl.DataFrame) -> dict[str, Any]:
    """Put the distinct order_key of ``keys`` (columns order_key, ts) in table key_stage as set ``name``,
    replacing the set (sql/migrations/0034); returns the query parameters that select it: ``set`` (use
    :data:`IN_ORDER_STAGE`) and ``lo``/``hi``, the ts range (to bound the other side)."""
    return _replace_set(store, name, keys, keys.select(pl.col("order_key").cast(pl.UInt64)).unique())


IN_ORDER_STAGE = "order_key IN (SELECT order_key FROM key_stage WHERE set = {set:String})"


def one_per_identity(rows: pl.DataFrame, by: Sequence[str] = ("request_id", "ts")) -> pl.DataFrame:
    """``rows`` with one row per identity ``by``: gateway_requests holds two rows of one (request_id, ts) when two
    ingesters insert the same redelivered row at the same instant (docs/reliability.md), and each read row would
    otherwise be answered, its missed tokens counted twice. Equal copies are one request; of copies that differ
    (only that race with a conflicting row), the one whose content hashes least (polars ``hash_rows``, fixed
    seed: the same choice in every chunk and run). Rows keep their order. Cost without copies: one count of
    distinct values of the first column that tells identities apart (order_key when read, else request_id)."""
    if len(rows) < 2:
        return rows
    first = "order_key" if "order_key" in rows.columns else by[0]
    if rows[first].n_unique() == len(rows):  # distinct order_keys (or ids): distinct identities
        return rows
    copies = rows.select(pl.struct(list(by)).is_duplicated()).to_series()
    if not copies.any():
        return rows
    at = np.flatnonzero(copies.to_numpy())
    least = (pl.DataFrame({"_n": at, "_h": rows[at].hash_rows(seed=0)}).hstack(rows[at].select(list(by)).get_columns())
             .sort("_h", "_n").unique(list(by), keep="first")["_n"].to_numpy())
    keep = ~copies.to_numpy()
    keep[least] = True
    return rows.filter(pl.Series(keep))
