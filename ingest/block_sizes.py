"""The block size (tokens per KV block) of a pod at a time: the attribution job judges each request with its pod's
block size at the request's arrival, so an answer does not change when the pod later restarts with another
``--block-size``.

Sources, per pod: the ``block_size`` of its ``vllm:cache_config_info`` rows (table vllm_cache_config, sent on a
collector's first scrape and whenever it changes) from a pod's first such row on; before it (a pod whose metrics
were not scraped at first, or never), the ``block_size`` its ``BlockStored`` KV events declare (vLLM's
``BlockStored.block_size``), read from kv_block_sizes (sql/migrations/0032: each size's first event per pod and
minute). A size holds from the time it is first seen until another is. The first event of a size in
a minute is exact; only a pod that went A → B → A within one minute (two vLLM restarts) has its second A seen from the
next minute on.
"""

from __future__ import annotations

from datetime import datetime

import polars as pl

from ingest import judged_with
from ingest.store import Store

#: :func:`changes`' columns: pod, since (unix ms: the first time the size was seen), block_size (tokens).
CHANGES_SCHEMA = {"pod": pl.String, "since": pl.Int64, "block_size": pl.Int64}

# The BlockStored part keeps only the minutes where a pod's size differs from its size the minute before (in
# ClickHouse), so a run reads a few rows per pod, not one per minute of its events.
_CHANGES_SQL = """
    SELECT CAST(pod AS String) AS pod, toUnixTimestamp64Milli(ts) AS since, toInt64(block_size) AS block_size
    FROM vllm_cache_config WHERE block_size > 0
    UNION ALL
    SELECT pod, toUnixTimestamp64Milli(since) AS since, toInt64(block_size) AS block_size
    FROM
    (
        SELECT pod, since, block_size,
               lagInFrame(block_size, 1, 0) OVER (PARTITION BY pod ORDER BY since, block_size
                                                  ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS before
        FROM
        (
            SELECT CAST(s.pod AS String) AS pod, min(s.since) AS since, s.block_size AS block_size
            FROM kv_block_sizes AS s
            LEFT JOIN
            (
                SELECT CAST(pod AS String) AS pod, min(ts) AS first
                FROM vllm_cache_config WHERE block_size > 0 GROUP BY pod
            ) AS c ON CAST(s.pod AS String) = c.pod
            WHERE coalesce(c.pod, '') = '' OR s.since < c.first
            GROUP BY pod, s.minute, block_size
        )
    )
    WHERE block_size != before"""


def changes(store: Store) -> pl.DataFrame:
    """Each pod's block size change points (:data:`CHANGES_SCHEMA`), sorted by pod and since: one row per time a
    pod's size differs from its size before (the first row of a pod is its first known size). Pods with neither
    source are absent (the caller falls back to its default). Read once per attribution run: sizes change rarely,
    so the frame is a few rows per pod. Raises what :meth:`ingest.store.Store.query_df` raises."""
    rows = store.query_df(_CHANGES_SQL)
    if rows.is_empty():
        return pl.DataFrame(schema=CHANGES_SCHEMA)
    rows = rows.select(*(pl.col(c).cast(t) for c, t in CHANGES_SCHEMA.items())).sort("pod", "since", "block_size")
    return rows.filter(pl.col("block_size").ne_missing(pl.col("block_size").shift(1).over("pod")))


def at(frame: pl.DataFrame, sizes: pl.DataFrame, default: int) -> pl.Series:
    """The block size (Int64, named block_size) of each row of ``frame`` (columns pod, ts: a datetime), in its
    order: its pod's size as of ts in ``sizes`` (:func:`changes`; a change at exactly ts applies), for a time
    before the pod's first known size that size (the pod ran with it before it was seen), ``default`` for a pod
    without sizes. One as-of join per call, whatever the number of rows."""
    return at_ms(frame.select(pl.col("pod").cast(pl.String), pl.col("ts").dt.epoch("ms").alias("t")), sizes, default)


def at_ms(keys: pl.DataFrame, sizes: pl.DataFrame, default: int) -> pl.Series:
    """:func:`at` for ``keys`` (columns pod, t: unix ms, Int64), in its order."""
    keys = keys.with_row_index("_r")
    first = sizes.group_by("pod").agg(pl.col("block_size").sort_by("since").first().alias("_first"))
    found = (keys.sort("t")
             .join_asof(sizes.sort("since"), left_on="t", right_on="since", by="pod", strategy="backward",
                        check_sortedness=False)
             .join(first, on="pod", how="left")
             .sort("_r"))
    return found.select(pl.coalesce("block_size", "_first", pl.lit(default, pl.Int64)).alias("block_size")
                        ).to_series()


def saved(store: Store) -> pl.DataFrame | None:
    """The change points the attribution job last judged with (:data:`CHANGES_SCHEMA`; table attribution_block_sizes,
    sql/migrations/0033), or None when none were ever saved. Raises what :meth:`ingest.store.Store.query_df`
    raises."""
    rows = judged_with.saved(store, "attribution_block_sizes", CHANGES_SCHEMA)
    return None if rows is None else rows.sort("pod", "since", "block_size")


def save(store: Store, sizes: pl.DataFrame, now: datetime) -> None:
    """Save ``sizes`` (:func:`changes`) as the change points judged with, at ``now`` (the store clock): a marker
    row, then one row per change point, in one insert."""
    judged_with.save(store, "attribution_block_sizes", sizes, CHANGES_SCHEMA, now)


def same(a: pl.DataFrame, b: pl.DataFrame) -> bool:
    """Whether two change point frames (:func:`changes`) hold the same rows."""
    return judged_with.same(a, b, CHANGES_SCHEMA)


#: An unbounded end of :func:`differences`' intervals (unix ms).
NEVER_BEFORE, NEVER_AFTER = -(2**62), 2**62


def differences(old: pl.DataFrame, new: pl.DataFrame, default: int) -> list[tuple[str, int, int]]:
    """Where two change point frames (:func:`changes`) give a pod different sizes under :func:`at`'s rule (a pod's
    size as of t; before its first change point, its first size; a pod absent, ``default``): (pod, lo, hi) per
    interval [lo, hi) in unix ms, :data:`NEVER_BEFORE` / :data:`NEVER_AFTER` for an open end, adjacent ones merged.
    Each interval between two change points of either frame has one size per frame, read at its start."""
    points = pl.concat([old.select("pod", "since"), new.select("pod", "since"),
                        pl.concat([old, new]).select("pod", pl.lit(NEVER_BEFORE, pl.Int64).alias("since"))])
    bounds = points.unique().sort("pod", "since").select("pod", pl.col("since").alias("t"))
    bounds = bounds.with_columns(pl.col("t").shift(-1).over("pod").fill_null(NEVER_AFTER).alias("end"),
                                 at_ms(bounds, old, default).alias("a"), at_ms(bounds, new, default).alias("b"))
    out: list[tuple[str, int, int]] = []
    for pod, lo, hi in bounds.filter(pl.col("a") != pl.col("b")).select("pod", "t", "end").iter_rows():
        if out and out[-1][0] == pod and out[-1][2] == lo:
            out[-1] = (pod, out[-1][1], hi)
        else:
            out.append((pod, lo, hi))
    return out
