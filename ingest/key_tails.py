"""The predecessor search of a backlog's chunks, carried from chunk to chunk (ingest/attribution_job.py).

A request's predecessor on a key is the key's latest ``request_keys`` row of an earlier millisecond, within the
horizon (an ASOF JOIN, docs/miss-causes.md). Searched chunk by chunk in ClickHouse, every chunk read its keys'
rows over the whole horizon: a tenant's system prompt, tools and retrieval set are keys of nearly every request,
so at 10^7 requests of generated history (an hour's horizon, chunks of 5·10^5 spanning ~17 minutes) each chunk's
right side held ~6·10^6 rows for its 1.5·10^6 keys, and the search cost grew with the horizon, not the chunk.

For a chunk whose order_key range of ``request_keys`` holds exactly its requests' keys (``_whole_range``), the
latest row before the chunk is known from the chunks before it: :class:`KeyTails` keeps each key's latest row
(``tails``), so a chunk reads only its own range (and the rows between the previous chunk and it), and the ASOF
join runs over the chunk's rows plus the tails. Rows older than the first chunk carried are looked up once per key
per chunk (the latest of each of the chunk's keys before it) until the horizon has passed them.

The join is one stable sort by key of rows already ascending by order_key (numpy over the sorted arrays): a row's
predecessor is then the row just before its run of (key, millisecond). polars' ``join_asof`` by key over the same
rows cost ~0.3 CPU-s more per chunk of 5·10^5 requests (1.3·10^6 keys, 8·10^5 carried).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import polars as pl

from ingest.attribution import MESSAGE_FOUND_KINDS, MESSAGE_LOOKUPS
from ingest.store import Store

#: A request's id as an integer (ClickHouse ``cityHash64``): with its order_key it names a predecessor in the job
#: (joins on integers, not strings; two ids with equal order_key and hash: one pair in ~2^84 within a millisecond).
ID_HASH = "id_hash"
ID_HASH_SQL = f"cityHash64(request_id) AS {ID_HASH}"
#: The id hash of a group's latest request: greatest order_key, then greatest id hash (two requests sharing an
#: order_key: the same millisecond and 20 bits of their ids' MD5), the order the carried search sorts them in.
LATEST_ID_HASH_SQL = "argMax(cityHash64(request_id), (order_key, cityHash64(request_id)))"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: order_key = ts in unix ms << 20 | 20 bits of the request id's MD5 (sql/migrations/0008).
_MS = 1 << 20
#: ``request_keys``' rows of an order_key range, read as its materialized view makes them (sql/migrations/0008
#: ``request_keys_mv``: gateway_requests' predecessor_keys of the served requests with a prompt). request_keys is
#: sorted by (key, order_key), so a range of order_keys is found only by scanning each day's partition whole: a
#: backlog's chunks then cost the day's rows each (at 10^7 requests of generated history, 3·10^7 rows per chunk
#: of 1.5·10^6). gateway_requests is sorted by (tenant_id, ts), with a minmax index on order_key, so the chunk's
#: time range skips the rest (0.61 → 0.40 CPU-s per chunk there, and the same rows). Format with the columns
#: (``key`` and ``kind`` are the key's, every other a gateway_requests column or expression) and a condition.
KEYS_OF_RANGE = ("SELECT {columns} FROM gateway_requests ARRAY JOIN predecessor_keys AS k "
                 "WHERE status < 400 AND prompt_tokens > 0 AND {where}")
#: A chunk's range: order_key in {first, last} and ts in {lo, hi} (``attribution_job._whole_range``'s parameters).
CHUNK_RANGE = ("order_key >= {first:UInt64} AND order_key <= {last:UInt64} "
          "AND ts >= {lo:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}")


def keys_of_range(columns: Sequence[str], where: str) -> str:
    """:data:`KEYS_OF_RANGE` selecting ``columns`` (SQL expressions; ``key`` and ``kind`` are the key's fields)
    where ``where`` (a condition on gateway_requests' columns)."""
    columns = ", ".join({"key": "k.key AS key", "kind": "k.kind AS kind"}.get(c, c) for c in columns)
    return KEYS_OF_RANGE.format(columns=columns, where=where)


_TAIL = ["key", "order_key", "ts", ID_HASH, "kind"]
#: Kinds looked up, never found (a request's previous messages: ingest.attribution.MESSAGE_LOOKUPS), and found, never
#: looked up (its own messages); every other kind is both. SQL: the condition on request_keys' candidate rows.
LOOKUP_KINDS, FOUND_KINDS = tuple(MESSAGE_LOOKUPS), MESSAGE_FOUND_KINDS


def candidate_rows(kind: str = "kind") -> str:
    """SQL: the rows of ``request_keys`` (``kind``: the column or expression of a row's key kind) that can be a
    candidate, not a request's previous messages (:data:`LOOKUP_KINDS`)."""
    return f"{kind} NOT IN ({', '.join(map(str, LOOKUP_KINDS))})"


def looked_up(kind: str = "kind") -> str:
    """SQL: the key rows a target looks up, not its own messages (:data:`FOUND_KINDS`)."""
    return f"{kind} NOT IN ({', '.join(map(str, FOUND_KINDS))})"


CANDIDATE_ROWS = candidate_rows()


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
        named = list(dict.fromkeys([*by, "key", "kind", "order_key", "ts"]))
        first, last, lo, hi = whole["first"], whole["last"], whole["lo"], whole["hi"]
        carried = (self.tails is not None and self.through < first
                   and (_ms_of(first) - _ms_of(self.through)).total_seconds() * 1000 <= horizon_ms)
        # rows read: order_key in (since, last]; a first chunk from the start of its first millisecond (a key's
        # latest row before it must be of an earlier millisecond than every target: a row of the same one is none's
        # predecessor, and would hide that key's earlier rows)
        since = self.through if carried else first // _MS * _MS - 1
        rows = store.query_df(
            keys_of_range([*named, ID_HASH_SQL],
                          "order_key > {since:UInt64} AND order_key <= {last:UInt64} "
                          "AND ts >= {from_ts:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}"),
            {"since": since, "last": last, "from_ts": _ms_of(since + 1), "hi": hi})
        start = self.start if carried else since
        parts = [self.tails] if carried and self.tails is not None else []
        reach = lo - timedelta(milliseconds=horizon_ms)
        if _ms_of(start) >= reach:  # rows up to start may lie within the horizon: each key's latest of them
            parts.append(store.query_df(
                f"""
                SELECT key, max(order_key) AS last_key, argMax(ts, order_key) AS last_ts,
                       {LATEST_ID_HASH_SQL} AS {ID_HASH}
                FROM request_keys
                WHERE key IN ({keys_of_range(["key"], CHUNK_RANGE)}) AND {CANDIDATE_ROWS}
                  AND order_key <= {{start:UInt64}} AND ts >= {{reach:DateTime64(3, 'UTC')}}
                  AND ts <= {{start_ts:DateTime64(3, 'UTC')}}
                GROUP BY key
                """, {"first": first, "last": last, "lo": lo, "hi": hi, "start": start, "reach": reach,
                      "start_ts": _ms_of(start)}).rename({"last_key": "order_key", "last_ts": "ts"}))
        ts_type = rows.schema["ts"]
        earlier = [p.select(pl.col("key").cast(pl.UInt64), pl.col("order_key").cast(pl.UInt64),
                            pl.col("ts").cast(ts_type), pl.col(ID_HASH).cast(pl.UInt64),
                            (pl.col("kind") if "kind" in p.columns else pl.lit(0)).cast(pl.UInt8).alias("kind"))
                   for p in parts if len(p)]
        # every row before the chunk's range ascends by order_key (the tails, then the rows up to start sorted),
        # and so do the range's rows once sorted: a stable sort by key then orders all by (key, order_key)
        in_order = rows["order_key"].arg_sort().to_numpy()
        if len(earlier) > 1:  # the rows up to start interleave with the tails (each sorted)
            earlier = [pl.concat(earlier).sort("order_key")]
        right = pl.concat([*earlier,
                           rows.select(_TAIL)[pl.Series(in_order)]], how="vertical_relaxed", rechunk=True)
        before = len(right) - len(rows)
        order = right.select(pl.arg_sort_by("key", maintain_order=True)).to_series().to_numpy().astype(np.int64)
        key, okey = right["key"].to_numpy()[order], right["order_key"].to_numpy()[order]
        hashes = right[ID_HASH].to_numpy()
        if ((key[1:] == key[:-1]) & (okey[1:] == okey[:-1]) & (hashes[order[1:]] != hashes[order[:-1]])).any():
            # two requests of one order_key on a key (a row read twice is the same row): the greater id_hash last
            order = np.lexsort((hashes, right["order_key"].to_numpy(), right["key"].to_numpy()))
            key, okey = right["key"].to_numpy()[order], right["order_key"].to_numpy()[order]
        # per row: its key's latest row of an earlier millisecond is the row before its (key, millisecond) run
        n = len(key)
        new_key = np.ones(n, dtype=bool)
        new_key[1:] = key[1:] != key[:-1]
        new_run = new_key.copy()
        new_run[1:] |= (okey[1:] // _MS) != (okey[:-1] // _MS)
        run_start = np.maximum.accumulate(np.where(new_run, np.arange(n), 0))
        ts_ms = right["ts"].dt.epoch("ms").to_numpy()[order]
        kind = right["kind"].to_numpy()[order]
        # a candidate is a row of a kind that is found (not a request's previous messages, which are only looked
        # up): the latest such row of the key before the target's run; a row of a kind only found is no target
        is_candidate = ~np.isin(kind, LOOKUP_KINDS)
        key_start = np.maximum.accumulate(np.where(new_key, np.arange(n), 0))
        last_candidate = np.maximum.accumulate(np.where(is_candidate, np.arange(n), -1))
        target = np.flatnonzero((order >= before) & (okey >= first) & ~np.isin(kind, FOUND_KINDS))
        candidate = np.where(run_start[target] > 0, last_candidate[np.maximum(run_start[target] - 1, 0)], -1)
        has = candidate >= key_start[target]
        target, candidate = target[has], candidate[has]
        within = ts_ms[target] - ts_ms[candidate] <= horizon_ms
        target, candidate = target[within], candidate[within]
        found = rows[pl.Series(in_order[order[target] - before])].select(*by, "kind").with_columns(
            right["ts"].gather(pl.Series(order[candidate])).alias("p_ts"),
            pl.Series("p_order_key", okey[candidate]),
            pl.Series(f"p_{ID_HASH}", hashes[order[candidate]]))
        # kept for the next chunk, of the candidate rows: each key's latest row before the last millisecond read,
        # and every row of that millisecond (the next chunk's targets may share it: those rows are no
        # predecessors of them), within the horizon
        cut = last // _MS * _MS
        rows_kept = np.flatnonzero(is_candidate)
        c_key, c_okey = key[rows_kept], okey[rows_kept]
        last_of_key = np.ones(len(rows_kept), dtype=bool)
        last_of_key[:-1] = c_key[1:] != c_key[:-1]
        late = c_okey >= cut
        last_before = np.zeros(len(rows_kept), dtype=bool)
        last_before[:-1] = ~late[:-1] & late[1:] & ~last_of_key[:-1]
        keep = (last_of_key | late | last_before) & (ts_ms[rows_kept] >= int(reach.timestamp() * 1000))
        self.tails = right[pl.Series(np.sort(order[rows_kept[keep]]))]
        self.start, self.through = start, last
        return found
