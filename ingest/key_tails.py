"""The predecessor search of a backlog's chunks, carried from chunk to chunk (ingest/attribution_job.py).

A request's predecessor on a key is the key's latest ``request_keys`` row of an earlier millisecond, within the
horizon (an ASOF JOIN, docs/miss-causes.md). Searched chunk by chunk in ClickHouse, every chunk read its keys'
rows over the whole horizon: a tenant's system prompt, tools and retrieval set are keys of nearly every request,
so at 10^7 requests of generated history (an hour's horizon, chunks of 5·10^5 spanning ~17 minutes) each chunk's
right side held ~6·10^6 rows for its 1.5·10^6 keys, and the search cost grew with the horizon, not the chunk.

For a chunk whose order_key range of ``request_keys`` holds exactly its requests' keys (``_whole_range``), the
latest row before the chunk is known from the chunks before it: :class:`KeyTails` keeps each key's latest row
(``tails``), so a chunk reads only its own range (and the rows between the previous chunk and it), and the ASOF
join runs in polars over the chunk's rows plus the tails. Rows older than the first chunk carried are looked up
once per key per chunk (the latest of each of the chunk's keys before it) until the horizon has passed them.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl

from ingest.store import Store

#: A request's id as an integer (ClickHouse ``cityHash64``): with its order_key it names a predecessor in the job
#: (joins on integers, not strings; two ids with equal order_key and hash: one pair in ~2^84 within a millisecond).
ID_HASH = "id_hash"
ID_HASH_SQL = f"cityHash64(request_id) AS {ID_HASH}"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: order_key = ts in unix ms << 20 | 20 bits of the request id's MD5 (sql/migrations/0008).
_MS = 1 << 20
_TAIL = ["key", "order_key", "ts", ID_HASH]


def _ms_of(order_key: int) -> datetime:
    """The millisecond (aware UTC) of an order_key."""
    return _EPOCH + timedelta(milliseconds=order_key // _MS)


class KeyTails:
    """Each key's latest ``request_keys`` row up to the last chunk searched through :meth:`found`, for one run's
    chunks in ascending order_key order. Rows of (``start``, ``through``] are all reflected in ``tails`` (key,
    order_key, ts, id_hash; each key's latest row before ``through``'s millisecond and every row of that
    millisecond; pruned to the horizon of the last chunk); rows up to ``start`` (the end of a millisecond) only for
    the keys looked up. :meth:`reset` when a chunk is searched otherwise (its rows are not read here)."""

    def __init__(self) -> None:
        self.tails: pl.DataFrame | None = None
        self.start = 0
        self.through = 0

    def reset(self) -> None:
        """Forget the tails: the next :meth:`found` starts again from the store."""
        self.tails = None

    def found(self, store: Store, whole: dict[str, Any], horizon_ms: int, by: list[str] | None = None
              ) -> pl.DataFrame:
        """The candidates of a chunk whose order_key range {first, last} of request_keys holds exactly its
        requests' keys (ts within {lo, hi}: ``_whole_range``'s parameters): per target row (order_key, kind) the
        key's latest row of an earlier millisecond within ``horizon_ms`` (ms) as p_ts, p_order_key and
        p_id_hash; the columns and rows of ``attribution_job._predecessors``' ASOF JOIN. ``by``: the columns that
        name a target (``["order_key"]``, the default, or ``["request_id", "ts"]`` when two share an order_key).
        Chunks must come in ascending order_key order; the tails then move to this chunk's last row."""
        by = by or ["order_key"]
        named = ", ".join(dict.fromkeys([*by, "key", "kind", "order_key", "ts"]))
        first, last, lo, hi = whole["first"], whole["last"], whole["lo"], whole["hi"]
        carried = (self.tails is not None and self.through < first
                   and (_ms_of(first) - _ms_of(self.through)).total_seconds() * 1000 <= horizon_ms)
        # rows read: order_key in (since, last]; a first chunk from the start of its first millisecond (a key's
        # latest row before it must be of an earlier millisecond than every target: a row of the same one is none's
        # predecessor, and would hide that key's earlier rows)
        since = self.through if carried else first // _MS * _MS - 1
        rows = store.query_df(
            f"SELECT {named}, {ID_HASH_SQL} FROM request_keys "
            "WHERE order_key > {since:UInt64} AND order_key <= {last:UInt64} "
            "AND ts >= {from_ts:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}",
            {"since": since, "last": last, "from_ts": _ms_of(since + 1), "hi": hi})
        start = self.start if carried else since
        parts, kept = [], None
        if carried and self.tails is not None:  # only the tails of this chunk's keys take part in the join
            keys = rows.select(pl.col("key").unique())
            parts.append(self.tails.join(keys, on="key", how="semi"))
            kept = self.tails.join(keys, on="key", how="anti")
        reach = lo - timedelta(milliseconds=horizon_ms)
        if _ms_of(start) >= reach:  # rows up to start may lie within the horizon: each key's latest of them
            parts.append(store.query_df(
                f"""
                SELECT key, max(order_key) AS last_key, argMax(ts, order_key) AS last_ts,
                       cityHash64(argMax(request_id, order_key)) AS {ID_HASH}
                FROM request_keys
                WHERE key IN (SELECT key FROM request_keys WHERE order_key >= {{first:UInt64}}
                              AND order_key <= {{last:UInt64}} AND ts >= {{lo:DateTime64(3, 'UTC')}}
                              AND ts <= {{hi:DateTime64(3, 'UTC')}})
                  AND order_key <= {{start:UInt64}} AND ts >= {{reach:DateTime64(3, 'UTC')}}
                  AND ts <= {{start_ts:DateTime64(3, 'UTC')}}
                GROUP BY key
                """, {"first": first, "last": last, "lo": lo, "hi": hi, "start": start, "reach": reach,
                      "start_ts": _ms_of(start)}).rename({"last_key": "order_key", "last_ts": "ts"}))
        parts.append(rows.select(_TAIL))
        right = pl.concat([p.select(_TAIL) for p in parts if not p.is_empty()], how="vertical_relaxed")
        ts_type = rows.schema["ts"]
        right = right.with_columns(pl.col("ts").cast(ts_type)).sort("order_key")
        left = (rows.filter(pl.col("order_key") >= first)
                .select(*dict.fromkeys([*by, "order_key", "kind", "key", "ts"]),
                        (pl.col("order_key") // _MS * _MS - 1).alias("probe"))
                .sort("probe"))
        found = (left.join_asof(right.rename({"order_key": "p_order_key", "ts": "p_ts", ID_HASH: f"p_{ID_HASH}"}),
                                left_on="probe", right_on="p_order_key", by="key", strategy="backward",
                                check_sortedness=False)
                 .filter(pl.col("p_order_key").is_not_null()
                         & (pl.col("ts").dt.epoch("ms") - pl.col("p_ts").dt.epoch("ms") <= horizon_ms))
                 .select(*by, "kind", "p_ts", "p_order_key", f"p_{ID_HASH}"))
        # each key's latest row before the last millisecond read, and every row of that millisecond (the next
        # chunk's targets may share it: those rows are no predecessors of them)
        cut = last // _MS * _MS
        held = [right.filter(pl.col("order_key") < cut).unique(subset="key", keep="last"),
                right.filter(pl.col("order_key") >= cut)]
        self.tails = pl.concat([*held, *([kept] if kept is not None else [])]).filter(pl.col("ts") >= reach)
        self.start, self.through = start, last
        return found
