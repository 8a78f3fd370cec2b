"""Sets of facts the attribution job judged with, saved so that a later run can tell what changed under answers
already given (a late row that moves a pod's block size, a late gap report that adds a vLLM restart) and re-answer
exactly what the change reaches.

A saved set is the rows of one ``saved_at`` in its table; it starts with a marker row (first column '') so that
an empty set is told from none saved. Tables: attribution_block_sizes (sql/migrations/0033),
attribution_gap_restarts (sql/migrations/0035).
"""

from __future__ import annotations

from datetime import datetime

import polars as pl

from ingest.store import Store

_MARKER = ""


def saved(store: Store, table: str, schema: dict[str, pl.DataType]) -> pl.DataFrame | None:
    """The last set saved in ``table`` (columns and types ``schema``, its first column a String), sorted by all
    columns, or None when none was ever saved. Raises what :meth:`ingest.store.Store.query_df` raises."""
    columns = ", ".join(schema)
    rows = store.query_df(f"SELECT {columns} FROM {table} WHERE saved_at = (SELECT max(saved_at) FROM {table})")
    if rows.is_empty():
        return None
    first = next(iter(schema))
    rows = rows.filter(pl.col(first) != _MARKER)
    return rows.select(*(pl.col(c).cast(t) for c, t in schema.items())).sort(list(schema))


def save(store: Store, table: str, frame: pl.DataFrame, schema: dict[str, pl.DataType], now: datetime) -> None:
    """Save ``frame`` (columns ``schema``) as the set judged with, at ``now`` (the store clock): a marker row, then
    one row per row of ``frame``, in one insert. Raises what :meth:`ingest.store.Store.insert` raises."""
    marker = tuple(_MARKER if t == pl.String else 0 for t in schema.values())
    rows = [(now, *marker)] + [(now, *row) for row in frame.select(*schema).iter_rows()]
    store.insert(table, rows, ["saved_at", *schema])


def same(a: pl.DataFrame, b: pl.DataFrame, schema: dict[str, pl.DataType]) -> bool:
    """Whether two sets (columns ``schema``) hold the same rows."""
    cols = list(schema)
    return a.select(cols).sort(cols).equals(b.select(cols).sort(cols))
