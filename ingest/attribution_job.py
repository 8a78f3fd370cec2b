"""The miss-cause attribution job (gateway_requests → ingest.attribution_batch → request_attribution): attributes
the requests that arrived since its last run and re-attributes those whose predecessor the arrivals changed.

One answer per request, exact through crashes, reruns and late data (docs/reliability.md):
- **What to do** is read from the store each run, never remembered: the *arrivals* are the requests ingested
  (server clock, ``ingested_at``) since the watermark minus ``overlap_seconds`` that have no answer yet;
  their *successors* are, for each arrival and each of its predecessor keys, the requests of the next later
  millisecond on that key within the lookback (the only ones the arrival may have become the predecessor of),
  if they have an answer. So a predecessor line that arrives late, by seconds or by the whole lookback,
  corrects its successors. In precise mode, late KV events and late gateway rows also re-answer the requests whose
  evidence they change (:mod:`ingest.attribution_late`: chains naming their blocks, pods they first cover or show
  serving a model).
- **Predecessors** are found in ClickHouse (ASOF JOIN on ``request_keys``, sorted by key and arrival order),
  within the horizon, then, for the requests that found none, beyond it up to the lookback; the verdicts are
  computed column-wise (:mod:`ingest.attribution_batch`), chunk by chunk: memory is bounded by ``chunk_size``,
  never by the horizon, the lookback or the history (docs/decisions.md: why ClickHouse for the join).
- **Writes** are diffs: an arrival's first answer; for a successor, nothing when its answer is unchanged, else
  its old row again with sign −1 and the new row with sign +1 and the next version, in one INSERT
  (request_attribution is a VersionedCollapsingMergeTree). Successors are written before arrivals, so a crash
  between the two leaves the arrivals unanswered and the next run redoes both; redoing is a no-op.
- The watermark (``attribution_watermark``) moves to the run's upper bound once every chunk is written. The
  job must have one writer per database (the embedded process, or one ``kvscope attribute`` service).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from prometheus_client import Counter, Gauge

from ingest import attribution, block_sizes, judged_with
from ingest.attribution import (
    BAND_KEYS,
    ID_TURN_KEYS,
    KEY_FINGERPRINT,
    LINE_HASHES,
    LINE_TOKENS,
    MESSAGE_TURN_KEYS,
    SAME_SYSTEM_KEYS,
    SHARED_TURN_KEYS,
    THREAD_KEYS,
    THREAD_OF_SAME_SYSTEM,
    VERDICT_COLUMNS,
)
from ingest.attribution_batch import (
    CHAIN_COVERS,
    CHAIN_SHARED,
    PREDECESSOR_FIELDS,
    TARGET_FIELDS,
    chain_columns,
    continuation,
    judge_frame,
)
from ingest.attribution_late import (
    GAP_RESTARTS_SCHEMA,
    INGESTED_WINDOW,
    changed_restarts,
    gap_restarts,
    late_kv_targets,
    new_holder_targets,
    reset_targets,
    size_targets,
)
from ingest.attribution_structure import lines_match as structure_lines_match
from ingest.dedup import IN_ORDER_STAGE, IN_STAGE, one_per_identity, stage_keys, stage_order_keys
from ingest.errors import KvscopeError, RetryableError
from ingest.key_tails import (
    CANDIDATE_ROWS,
    CHUNK_RANGE,
    ID_HASH,
    ID_HASH_SQL,
    LATEST_ID_HASH_SQL,
    KeyTails,
    candidate_rows,
    keys_of_range,
    looked_up,
)
from ingest.known_requests import KnownRequests, gather, names, positions
from ingest.kv_evidence import MAX_END_MS, KvMemo, chunk_evidence
from ingest.store import Store

log = logging.getLogger("kvscope.attribution")

JOB_NAME = "miss_causes"
#: What the job reads of a request it judges (the columns judge_frame and precise mode read; prompt_block_size:
#: a chunk where it is 0 throughout logged no block chain, so precise mode has no evidence to read for it).
_FIELDS = (*TARGET_FIELDS, "prompt_block_size", "first_message_hash")  # the last for _confirm_threads
#: How many predecessor keys a request has (its rows of request_keys when it is served with a prompt).
KEY_COUNT = "key_count"
_SELECT = ", ".join([*_FIELDS, "order_key", ID_HASH_SQL, f"length(predecessor_keys) AS {KEY_COUNT}"])
#: A request's identity (its row of gateway_requests).
_ID = ["request_id", "ts"]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_BETWEEN = "ts >= {lo:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}"
#: The rows of a staged set (ingest.dedup.stage_keys): binding 10^5 ids as a parameter costs seconds of Python.
_IN_SET = IN_STAGE
WRITE_COLUMNS = (*VERDICT_COLUMNS, "attributed_at", "sign", "version")
#: The INSERT of first answers: rows of sign +1 and version 1 only, so there is nothing to collapse and the
#: VersionedCollapsingMergeTree's collapsing pass at insert (``optimize_on_insert``, on by default) would only
#: sort and copy the block again: it cost ~70% of the insert's CPU (0.21 of 0.30 s per 10^5 rows). Merges still
#: collapse as before (https://clickhouse.com/docs/operations/settings/settings#optimize_on_insert).
FIRST_ANSWER_SETTINGS = {"optimize_on_insert": 0}
_KIND_NAMES = {**dict.fromkeys(attribution.TURN_KEYS, attribution.PREVIOUS_TURN),
               KEY_FINGERPRINT: attribution.FINGERPRINT}
#: A key kind's rank among a target's candidates (lowest wins; ingest.attribution.choose_predecessor's order):
#: the turn keys, then the fingerprint, then any variant.
_RANKS = {kind: rank for rank, kind in enumerate((*attribution.TURN_KEYS, KEY_FINGERPRINT), start=1)}
_VARIANT_RANK = len(_RANKS) + 1
#: :data:`_RANKS` with the variants' ranks: the system prompt's head (key 20) after every other variant
#: (ingest.attribution.choose_predecessor).
_ALL_RANKS = {**_RANKS, attribution.KEY_SYSTEM_HEAD: _VARIANT_RANK + 1}

ATTRIBUTED = Counter("kvscope_attribution_requests", "Requests the attribution job wrote an answer for, by why "
                     "(new = first answer, changed = a late or corrected input changed it, "
                     "late_kv_evidence = KV events ingested late changed it, "
                     "gap_restart = a gap report added, moved or removed a vLLM restart under it, "
                     "block_size_changed = a late row "
                     "moved its pod's block size)", ["why"])
UNCHANGED = Counter("kvscope_attribution_unchanged", "Successors re-examined whose answer stayed the same")
#: Serialises runs in this process: the job is the only writer of request_attribution (see the docstring).
_WRITER = threading.Lock()
WATERMARK_LAG = Gauge("kvscope_attribution_lag_seconds", "Store time minus the attribution watermark")


@dataclass(frozen=True)
class RunStats:
    """What one run did: ``arrivals`` answered for the first time, ``changed`` successors whose answer changed,
    ``examined`` successors re-examined in all, ``chunks`` processed."""

    arrivals: int = 0
    changed: int = 0
    examined: int = 0
    chunks: int = 0


def _utc(value: datetime) -> datetime:
    """A datetime as aware UTC (clickhouse-connect may return naive UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def server_now(store: Store) -> datetime:
    """The store's clock (the one ``ingested_at`` is stamped with), aware UTC."""
    return _utc(store.query_rows("SELECT now64(3, 'UTC')")[0][0])


def read_watermark(store: Store, job: str = JOB_NAME) -> datetime:
    """The highest ``ingested_through`` recorded for ``job`` (aware UTC); the epoch when there is none."""
    rows = store.query_rows(
        "SELECT max(ingested_through), count() FROM attribution_watermark WHERE job = {job:String}", {"job": job})
    if not rows or not rows[0][1]:
        return _EPOCH
    return _utc(rows[0][0])


# -- reads ---------------------------------------------------------------------------------------------------
def _span(frame: pl.DataFrame, column: str = "ts") -> dict[str, Any]:
    return {"lo": frame[column].min(), "hi": frame[column].max()}


def _stage(store: Store, name: str, keys: pl.DataFrame) -> dict[str, Any]:
    return stage_keys(store, f"attribution:{name}", keys)


def _answered_through(store: Store) -> datetime | None:
    """The latest ts with an answer (None when nothing is answered yet)."""
    rows = store.query_rows("SELECT max(ts), count() FROM request_attribution")
    return _utc(rows[0][0]) if rows and rows[0][1] else None


def _chunk_bounds(store: Store, since: datetime, upto: datetime, budget: int, evidence_weight: int = 1) -> list[int]:
    """order_key boundaries splitting the requests ingested in (since, upto] into chunks of about ``budget``
    units, a request counting 1, or ``evidence_weight`` when it logged a block size (a chain: judged on KV evidence
    in precise mode, which costs that many times the memory): [b0, b1, ...] with chunk i = (b_i, b_i+1] (b0 = the
    lowest key − 1; every other bound is a key of the window, so a chunk's rows lie in the milliseconds
    [(b_i + 1) >> 20, b_i+1 >> 20]). One query, whatever the window: the chunks are then read by key range, not
    by sorting the window again for each (weighted quantiles: https://clickhouse.com/docs/sql-reference/
    aggregate-functions/reference/quantileexactweighted)."""
    window = {"since": since, "upto": upto}
    weight = f"toUInt64(if(prompt_block_size > 0, {int(evidence_weight)}, 1))"  # CHAINED without reading the chains
    n, rows, bottom, top = store.query_rows(
        f"SELECT sum({weight}), count(), min(order_key), max(order_key) FROM gateway_requests "
        f"WHERE {INGESTED_WINDOW}", window)[0]
    if not n:
        return []
    k = max(1, -(-int(n) // budget))
    inner: list[int] = []
    for first in range(1, k, QUANTILE_LEVELS_PER_QUERY):  # the levels are in the SQL text: a bounded number per query
        levels = ", ".join(f"{i / k:.9f}" for i in range(first, min(k, first + QUANTILE_LEVELS_PER_QUERY)))
        quantiles = f"quantilesExactWeighted({levels})(order_key, {weight})" if n != rows else \
            f"quantilesExactLow({levels})(order_key)"
        inner += store.query_rows(f"SELECT {quantiles} FROM gateway_requests WHERE {INGESTED_WINDOW}", window)[0][0]
    return [int(bottom) - 1, *sorted(set(int(b) for b in inner)), int(top)]


#: Quantile levels per query of :func:`_chunk_bounds` (each ~12 bytes of SQL text; ClickHouse refuses a query over
#: max_query_size, 262,144 bytes by default): a window of more chunks is split in several queries.
QUANTILE_LEVELS_PER_QUERY = 5_000


#: A chunk's rows (:func:`_chunk_bounds`): ingested in (since, upto], order_key in (lo, hi].
_CHUNK = f"{INGESTED_WINDOW} AND order_key > {{lo:Int64}} AND order_key <= {{hi:UInt64}}"
#: The milliseconds a chunk's rows lie in (order_key = ts in ms << 20 | 20 bits of the request id's MD5,
#: sql/migrations/0008): bounds request_attribution's side of the anti-join to the chunk's partitions.
_CHUNK_TS = ("ts >= fromUnixTimestamp64Milli(intDiv({lo:Int64} + 1, 1048576), 'UTC') "
             "AND ts <= fromUnixTimestamp64Milli(toInt64(intDiv({hi:UInt64}, 1048576)), 'UTC')")


def _arrivals(store: Store, since: datetime, upto: datetime, lo: int, hi: int,
              answered_through: datetime | None = None) -> pl.DataFrame:
    """The requests ingested in (since, upto] with order_key in (lo, hi] that have no answer yet (no row of
    request_attribution with their (request_id, ts), whatever its sign), in no particular order, with their
    order_key, :data:`ID_HASH` and :data:`KEY_COUNT`. The answered ones are left out in the store: the overlap
    window re-reads mostly answered requests, and only their keys are read for that, not their fields.
    ``answered_through``: a ts no answer is later than (None: no answer); a chunk whose every millisecond is later
    has none answered, and is read without that anti-join (a backlog's chunks, after the overlap window)."""
    params = {"since": since, "upto": upto, "lo": lo, "hi": hi}
    first = _EPOCH + timedelta(milliseconds=(lo + 1) // 1048576)
    if answered_through is None or first > answered_through:
        return one_per_identity(store.query_df(f"SELECT {_SELECT} FROM gateway_requests WHERE {_CHUNK}", params))
    return one_per_identity(store.query_df(
        f"SELECT {_SELECT} FROM gateway_requests WHERE {_CHUNK} AND (request_id, ts) NOT IN "
        f"(SELECT request_id, ts FROM request_attribution WHERE {_CHUNK_TS} "
        f"AND (request_id, ts) IN (SELECT request_id, ts FROM gateway_requests WHERE {_CHUNK}))", params))


def _columns(fields: Sequence[str]) -> str:
    """The SELECT list of gateway_requests columns ``fields`` (:data:`ID_HASH` computed from the request_id)."""
    return ", ".join(ID_HASH_SQL if f == ID_HASH else f for f in fields)


def _requests(store: Store, keys: pl.DataFrame, fields: tuple[str, ...] = _FIELDS) -> pl.DataFrame:
    """The gateway_requests rows of ``keys`` (columns request_id, ts), their columns ``fields``."""
    if keys.is_empty():
        return pl.DataFrame()
    return one_per_identity(store.query_df(
        f"SELECT {_columns(fields)} FROM gateway_requests WHERE {_IN_SET} AND {_BETWEEN}",
        _stage(store, "requests", keys)))


def _successors(store: Store, arrivals: pl.DataFrame, reach_ms: int) -> pl.DataFrame:
    """(request_id, ts) of the requests the arrivals may have become the predecessor of: on each key of an
    arrival, every request of the first later millisecond that has one (a predecessor lies in an earlier
    millisecond, so all requests of that millisecond look back past the same ones), at most ``reach_ms`` later
    (the lookback, when longer than the horizon: a late arrival may become a predecessor beyond the horizon).

    Memory stays bounded by the arrivals' time span, not by the reach: the ASOF JOIN's right side holds the
    keys' requests within that span plus, per key, only its first request after it.

    On a key of a request's own messages (:data:`ingest.key_tails.FOUND_KINDS`) the requests that look it up (its
    previous messages, :data:`ingest.key_tails.LOOKUP_KINDS`) are no candidates: every one of them after the lo
    of the arrivals and within the reach is taken (a superset: they are few, a conversation's next turns)."""
    return store.query_df(
        f"""
        WITH
            arrival_keys AS
            (
                SELECT ts, intDiv(order_key, 1048576) * 1048576 + 1048575 AS last_of_ms, k.key AS key
                FROM gateway_requests ARRAY JOIN predecessor_keys AS k
                WHERE {_IN_SET} AND {_BETWEEN} AND status < 400 AND prompt_tokens > 0
                  AND {candidate_rows("k.kind")}
            ),
            later AS
            (
                SELECT key, order_key, ts FROM request_keys
                WHERE key IN (SELECT key FROM arrival_keys) AND {CANDIDATE_ROWS}
                  AND ts > {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}}
                UNION ALL
                SELECT key, first_key AS order_key, first_ts AS ts FROM
                (
                    SELECT key, min(order_key) AS first_key, argMin(ts, order_key) AS first_ts FROM request_keys
                    WHERE key IN (SELECT key FROM arrival_keys) AND {CANDIDATE_ROWS}
                      AND ts > {{hi:DateTime64(3, 'UTC')}}
                      AND ts <= {{hi:DateTime64(3, 'UTC')}} + toIntervalMillisecond({{reach:Int64}})
                    GROUP BY key
                )
            ),
            nexts AS
            (
                SELECT a.key AS key, n.ts AS next_ts
                FROM arrival_keys AS a
                ASOF INNER JOIN later AS n ON a.key = n.key AND a.last_of_ms < n.order_key
                WHERE toUnixTimestamp64Milli(n.ts) - toUnixTimestamp64Milli(a.ts) <= {{reach:Int64}}
            )
        SELECT DISTINCT request_id, ts FROM
        (
            SELECT request_id, ts FROM request_keys
            WHERE key IN (SELECT key FROM nexts) AND (key, ts) IN (SELECT key, next_ts FROM nexts)
              AND ts > {{lo:DateTime64(3, 'UTC')}} AND ts <= (SELECT max(next_ts) FROM nexts)
            UNION ALL
            SELECT request_id, ts FROM request_keys
            WHERE key IN (SELECT key FROM arrival_keys) AND NOT {CANDIDATE_ROWS}
              AND ts > {{lo:DateTime64(3, 'UTC')}}
              AND ts <= {{hi:DateTime64(3, 'UTC')}} + toIntervalMillisecond({{reach:Int64}})
        )
        """, {**_stage(store, "arrivals", arrivals), "reach": reach_ms})


#: The ASOF JOINs' ordering of candidates on a key: (order_key, cityHash64(request_id)) as one UInt128, so that of
#: two requests sharing an order_key (the same millisecond and 20 bits of their ids' MD5) the one with the greater
#: id hash is the latest, whatever the order the store holds them in (as ingest/key_tails.py and
#: ingest.attribution.choose_predecessor order them); ClickHouse's ASOF JOIN keeps one row per asof value.
_RANKED = f"bitShiftLeft(toUInt128(order_key), 64) + {ID_HASH} AS ranked"
#: A target's side: its first millisecond's least order_key, shifted alike (a candidate's ranked is below it
#: exactly when its order_key is below that millisecond: the id hash fills only the low 64 bits).
_FIRST_OF_MS = "bitShiftLeft(toUInt128(intDiv(order_key, 1048576) * 1048576), 64) AS first_of_ms"


def _target_keys(by: list[str], whole: bool = False) -> str:
    """The CTE of the targets' predecessor keys, each target named by the columns ``by`` (:func:`_identity`):
    read from their gateway_requests rows (a staged set, :func:`_stage`), or, when ``whole``, the rows of
    request_keys in their order_key range {first, last} (:func:`_whole_range`; read from gateway_requests as
    request_keys_mv makes them, :data:`ingest.key_tails.KEYS_OF_RANGE`: by range, not a set of ids looked up; on
    10^6 requests of generated history, three runs each on a quiet machine, 9.9–11.6 CPU-s against 11.3–12.6 for
    the whole job). Keys of a kind only found (a request's own messages, :data:`ingest.key_tails.FOUND_KINDS`)
    are not looked up."""
    if whole:
        return f"""
    target_keys AS
    (
        {keys_of_range([*dict.fromkeys([*by, "order_key", "ts"]), _FIRST_OF_MS, "kind", "key"],
                       f"{CHUNK_RANGE} AND {looked_up('k.kind')}")}
    )"""
    return f"""
    target_keys AS
    (
        SELECT {", ".join(dict.fromkeys([*by, "ts"]))}, {_FIRST_OF_MS}, k.kind AS kind, k.key AS key
        FROM gateway_requests ARRAY JOIN predecessor_keys AS k
        WHERE {_IN_SET} AND {_BETWEEN} AND {looked_up('k.kind')}
    )"""


#: The targets that can have a predecessor: served (status < 400, or none logged). ingest/attribution_batch.py names
#: none for the others, so the predecessor search leaves them out where that saves work.
_SERVED = pl.col("status").is_null() | (pl.col("status") < 400)


def _whole_range(store: Store, targets: pl.DataFrame, by: list[str]) -> dict[str, Any] | None:
    """The parameters of :func:`_target_keys` ``whole`` (first, last, lo, hi) when the rows of request_keys in the
    targets' order_key range (counted from gateway_requests, :data:`ingest.key_tails.KEYS_OF_RANGE`) are exactly
    the targets' keys, else None. True when every target that can have a
    predecessor (served: status < 400 or none) has its rows there (served with a prompt, as request_keys' view
    keeps them), and the range holds as many rows as those targets have keys (:data:`KEY_COUNT`): no other request
    in it (a backlog's chunk, not the overlap window of a live run, whose answered requests are no targets).
    Targets not served need no predecessor (ingest/attribution_batch.py names none), so they are left out. Targets
    named by (request_id, ts) (two sharing an order_key, :func:`_identity`) are read with their request_id."""
    if "order_key" not in targets.columns or KEY_COUNT not in targets.columns:
        return None
    keyed = _SERVED & (pl.col(KEY_COUNT) > 0)
    unkept = pl.col("status").is_null() | pl.col("prompt_tokens").is_null() | (pl.col("prompt_tokens") <= 0)
    first, last, lo, hi, keys, bad = targets.select(  # one pass over the chunk
        *(getattr(pl.col(c).filter(keyed), f)().alias(f + c) for c in ("order_key", "ts") for f in ("min", "max")),
        pl.col(KEY_COUNT).filter(keyed).sum(), (keyed & unkept).any().alias("bad")).row(0)
    if bad or not keys:
        return None
    params = {"first": first, "last": last, "lo": lo, "hi": hi}
    rows = store.query_rows(keys_of_range(["count()"], CHUNK_RANGE), params)[0][0]
    return params if rows == keys else None


def _found(by: list[str], source: str = "target_keys") -> str:
    """The candidates' columns: the target (``by``), the key's kind, the candidate's ts, order_key and
    :data:`ID_HASH`, which name it (not its request_id: strings cost the ASOF JOIN a third of its CPU; the
    request_id comes with its fields, :func:`_with_predecessors`). ``source``: the CTE of the targets' keys."""
    return f"""
    SELECT {", ".join(f"t.{c} AS {c}" for c in by)}, t.kind AS kind, p.ts AS p_ts, p.order_key AS p_order_key,
           p.{ID_HASH} AS p_{ID_HASH}
    FROM {source} AS t"""


def _identity(targets: pl.DataFrame) -> list[str]:
    """The columns that name a target in the predecessor queries: its order_key alone when every target has a
    distinct one (one integer to read back, group and join on, not a string), else (request_id, ts). Equal
    ids give equal order_keys, so distinct order_keys name the same targets as the ids."""
    if "order_key" in targets.columns:
        keys = targets["order_key"]
        if keys.null_count() == 0 and keys.n_unique() == len(keys):
            return ["order_key"]
    return _ID


def _predecessors(store: Store, targets: pl.DataFrame, horizon_ms: int, lookback_ms: int = 0,
                  tails: KeyTails | None = None) -> pl.DataFrame:
    """Per target (named by :func:`_identity`: its order_key, or its request_id and ts): the chosen
    predecessor's key kind, ts, order_key and :data:`ID_HASH`, and whether it lies beyond the horizon. On each key
    the latest request of an earlier millisecond within the horizon (ASOF JOIN); then by priority:
    agent-run thread, conversation thread, conversation, agent run, fingerprint, else the latest of the variant
    matches (ingest.attribution.choose_predecessor). Targets with none look again up to ``lookback_ms`` back
    (:func:`_beyond_horizon`), as ingest.attribution.PredecessorIndex.find does. ``tails``: the run's
    :class:`~ingest.key_tails.KeyTails` when ``targets`` are its next chunk of arrivals: a chunk whose range holds
    exactly its keys is searched from its own rows and the keys' latest rows before it (carried from the chunks
    before), not from its keys' rows over the whole horizon."""
    by = _identity(targets)
    whole = _whole_range(store, targets, by)
    if tails is not None and whole is not None:
        found = tails.found(store, whole, horizon_ms, by)
    else:
        if tails is not None:
            tails.reset()
        found = _searched(store, targets, by, whole, horizon_ms)
    found = _retries_as_turns(found, by)
    ts_type = targets.schema["ts"]
    chosen = _choose(_confirm_bands(store, _same_system_turns(store, _confirm_threads(store, found, targets, by),
                                                              targets, by), targets, by), False, ts_type, by)
    if lookback_ms > horizon_ms:
        # only served targets: a failed request names no predecessor, and with its keys read by range (which
        # leaves it out) it has no candidate within the horizon (at 10^7 requests of generated history, 2% failed:
        # ~10^4 per chunk, 9.3 CPU-s of the search against 0.5)
        rest = (targets.filter(_SERVED).select(*dict.fromkeys([*_ID, *by]))
                .join(chosen.select(by), on=by, how="anti"))
        if not rest.is_empty():
            beyond = _retries_as_turns(_beyond_horizon(store, rest, horizon_ms, lookback_ms, by), by)
            beyond = _same_system_turns(store, _confirm_threads(store, beyond, targets, by), targets, by)
            beyond = _choose(_confirm_bands(store, beyond, targets, by), True, ts_type, by)
            chosen = pl.concat([chosen, beyond], how="vertical_relaxed")
    return chosen


def _retries_as_turns(found: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """``found`` with a target's fingerprint candidate put under its first message key that found one
    (:data:`ingest.attribution.MESSAGE_TURN_KEYS`), as ingest.attribution.PredecessorIndex.candidates does: when it
    is the later of the two (the same prompt sent after the previous turn: a retry or regenerate), :func:`_choose`
    then takes it as the previous turn."""
    turns = found.filter(pl.col("kind").is_in(MESSAGE_TURN_KEYS))
    if turns.is_empty() or not (found["kind"] == KEY_FINGERPRINT).any():
        return found
    first = (turns.with_columns(pl.col("kind").replace_strict(_RANKS, return_dtype=pl.Int64).alias("_rank"))
             .sort([*by, "_rank"]).unique(by, keep="first").select(*by, pl.col("kind").alias("_turn")))
    return (found.join(first, on=by, how="left")
            .with_columns(pl.when((pl.col("kind") == KEY_FINGERPRINT) & pl.col("_turn").is_not_null())
                          .then(pl.col("_turn")).otherwise(pl.col("kind")).cast(found.schema["kind"]).alias("kind"))
            .drop("_turn"))


def _searched(store: Store, targets: pl.DataFrame, by: list[str], whole: dict[str, Any] | None,
              horizon_ms: int) -> pl.DataFrame:
    """:func:`_predecessors`' candidates found in ClickHouse: an ASOF JOIN of the targets' keys (by range when
    ``whole``, :func:`_whole_range`) against their keys' rows of request_keys over the horizon."""
    return store.query_df(
        f"""
        WITH {_target_keys(by, whole is not None)}
        {_found(by)}
        ASOF INNER JOIN
        (
            SELECT key, order_key, ts, {ID_HASH_SQL}, {_RANKED} FROM request_keys
            WHERE key IN (SELECT key FROM target_keys) AND {CANDIDATE_ROWS}
              AND ts >= {{lo:DateTime64(3, 'UTC')}} - toIntervalMillisecond({{horizon:Int64}})
              AND ts <= {{hi:DateTime64(3, 'UTC')}}
        ) AS p ON t.key = p.key AND t.first_of_ms > p.ranked
        WHERE toUnixTimestamp64Milli(t.ts) - toUnixTimestamp64Milli(p.ts) <= {{horizon:Int64}}
        """, {**(whole or _stage(store, "targets", targets)), "horizon": horizon_ms})


def _beyond_horizon(store: Store, targets: pl.DataFrame, horizon_ms: int, lookback_ms: int,
                    by: list[str] = _ID) -> pl.DataFrame:
    """Candidates beyond the horizon, for targets with none chosen within it: on each key the latest request more
    than ``horizon_ms`` (of an earlier millisecond than its arrival − horizon) and at most ``lookback_ms`` before
    the target, as ingest.attribution.PredecessorIndex.find looks (the requests within the horizon were all
    considered, and those left were dropped by the rules). That latest request lies in [lo − horizon, hi − horizon)
    or is the key's latest before lo − horizon; the ASOF JOIN's right side holds only those rows (one per key for
    the second part), so memory follows the targets' time span, not the lookback, and each target's as-of value is
    its first millisecond less the horizon (a target's own horizon holds rows of the right side when the chunk
    spans more than one millisecond). ``by``: the columns naming a target (:func:`_identity`). Their keys are
    looked up by id, not read from the chunk's range of request_keys (:func:`_whole_range`): they are few."""
    return store.query_df(
        f"""
        WITH {_target_keys(by)},
        beyond_keys AS
        (
            SELECT *, first_of_ms - bitShiftLeft(toUInt128({{horizon:Int64}} * 1048576), 64) AS beyond_of_ms
            FROM target_keys
        )
        {_found(by, "beyond_keys")}
        ASOF INNER JOIN
        (
            SELECT key, order_key, ts, {ID_HASH}, {_RANKED} FROM
            (
                SELECT key, order_key, ts, {ID_HASH_SQL} FROM request_keys
                WHERE key IN (SELECT key FROM target_keys) AND {CANDIDATE_ROWS}
                  AND ts >= {{lo:DateTime64(3, 'UTC')}} - toIntervalMillisecond({{horizon:Int64}})
                  AND ts < {{hi:DateTime64(3, 'UTC')}} - toIntervalMillisecond({{horizon:Int64}})
                UNION ALL
                SELECT key, last_key AS order_key, last_ts AS ts, last_hash AS {ID_HASH} FROM
                (
                    SELECT key, max(order_key) AS last_key, argMax(ts, order_key) AS last_ts,
                           {LATEST_ID_HASH_SQL} AS last_hash
                    FROM request_keys
                    WHERE key IN (SELECT key FROM target_keys) AND {CANDIDATE_ROWS}
                      AND ts >= {{lo:DateTime64(3, 'UTC')}} - toIntervalMillisecond({{lookback:Int64}})
                      AND ts < {{lo:DateTime64(3, 'UTC')}} - toIntervalMillisecond({{horizon:Int64}})
                    GROUP BY key
                )
            )
        ) AS p ON t.key = p.key AND t.beyond_of_ms > p.ranked
        WHERE toUnixTimestamp64Milli(t.ts) - toUnixTimestamp64Milli(p.ts) <= {{lookback:Int64}}
        """, {**_stage(store, "beyond", targets), "horizon": horizon_ms, "lookback": lookback_ms})


def _confirm_bands(store: Store, found: pl.DataFrame, targets: pl.DataFrame, by: list[str] = _ID
                   ) -> pl.DataFrame:
    """``found`` without the candidates on a banded system-lines key (kinds 7, 8) that their lines do not confirm
    (ingest.attribution.lines_match, as PredecessorIndex.candidates drops them). A target that has a candidate
    of a higher rank (conversation, agent run, fingerprint) never picks a banded one, so only the others are
    checked; the candidates' lines are read from gateway_requests. ``by``: the columns naming a target."""
    band = found.filter(pl.col("kind").is_in(BAND_KEYS))
    if band.is_empty():
        return found
    ranked = found.filter(pl.col("kind").is_in(list(_RANKS))).select(by).unique()
    band = band.join(ranked, on=by, how="anti")
    if band.is_empty():
        return found.filter(~pl.col("kind").is_in(BAND_KEYS))
    confirmed = _lines_confirm(store, band, targets, by).select(found.columns)
    return pl.concat([found.filter(~pl.col("kind").is_in(BAND_KEYS)), confirmed], how="vertical_relaxed")


def _confirm_threads(store: Store, found: pl.DataFrame, targets: pl.DataFrame, by: list[str] = _ID
                     ) -> pl.DataFrame:
    """``found`` as ingest.attribution.PredecessorIndex.candidates leaves it for the turn keys of targets that logged a
    first message (the only ones with thread keys, 9 and 10, or another thread on the shared keys, 1 and 2):
    without a candidate on those keys that is another thread's request (``other_thread``: the target has no history,
    and the candidate's first message and system prompt both differ, or its normalized system prompt does and the
    lines do not confirm it, :func:`_lines_confirm`), and without the thread-key candidates when a later shared-key
    candidate remains and the target does not continue the thread's but not the later one (``thread_first``, with
    ``continues`` read by ingest.attribution_batch.continuation, as the judge reads it). The candidates' fields are
    read from gateway_requests. ``by``: the columns naming a target."""
    turn = found.filter(pl.col("kind").is_in([*SHARED_TURN_KEYS, *THREAD_KEYS]))
    if turn.is_empty() or "first_message_hash" not in targets.columns:
        return found
    mine = ("first_message_hash", "system_hash", "system_norm_hash", "history_prefix_hash", "prev_history_hash",
            "prev_suffix_hash", "prefill_history_hash")
    checked = turn.join(_target_fields(targets.filter(pl.col("first_message_hash") != ""), turn, by, mine), on=by,
                        how="inner")
    if checked.is_empty():
        return found
    both = checked.join(_candidate_fields(store, checked, (
        "first_message_hash", "system_hash", "system_norm_hash", "history_prefix_hash", "suffix_hash",
        "next_history_hash", "continue_final_message")), on=["p_order_key", f"p_{ID_HASH}"], how="inner")
    first_call = (pl.col("history_prefix_hash") == "") & (pl.col("p_first_message_hash") != "")
    new_task = (pl.col("p_first_message_hash") != pl.col("first_message_hash")) & (
        pl.col("p_system_hash") != pl.col("system_hash"))
    other = both.filter(first_call & (new_task | (pl.col("p_system_norm_hash") != pl.col("system_norm_hash"))))
    unsure = other.filter(~new_task)  # another system prompt: unless the lines confirm it as one
    if not unsure.is_empty():
        other = other.join(_lines_confirm(store, unsure, targets, by).select(*by, "kind"), on=[*by, "kind"],
                           how="anti")
    others = other.select(*by, "kind")
    rows = both.join(others, on=[*by, "kind"], how="anti")
    rank = pl.col("kind").replace_strict({k: i for i, k in enumerate((*THREAD_KEYS, *SHARED_TURN_KEYS))},
                                         return_dtype=pl.Int64)
    continues = continuation(rows, np.ones(len(rows), dtype=bool))[0]
    first = (rows.with_columns(pl.Series("_continues", continues),
                               pl.col("kind").is_in(THREAD_KEYS).alias("_thread"), rank.alias("_rank"))
             .sort([*by, "_rank"]).group_by([*by, "_thread"], maintain_order=True).first())
    thread = first.filter(pl.col("_thread")).select(*by, pl.col("p_order_key").alias("t_key"),
                                                   pl.col("_continues").alias("t_continues"))
    latest = first.filter(~pl.col("_thread")).select(*by, pl.col("p_order_key").alias("l_key"),
                                                    pl.col("_continues").alias("l_continues"))
    skip = (thread.join(latest, on=by, how="inner")
            .filter((pl.col("l_key") > pl.col("t_key")) & ~(pl.col("t_continues") & ~pl.col("l_continues")))
            .select(by))
    dropped = pl.concat([others, skip.join(rows.filter(pl.col("kind").is_in(THREAD_KEYS)).select(*by, "kind"), on=by)],
                        how="vertical_relaxed")
    return found.join(dropped, on=[*by, "kind"], how="anti") if not dropped.is_empty() else found


def _same_system_turns(store: Store, found: pl.DataFrame, targets: pl.DataFrame, by: list[str] = _ID
                       ) -> pl.DataFrame:
    """``found`` (after :func:`_confirm_threads`) without the candidates on the same-system keys (17, 18), each
    target's latest of them earlier than its turn on the id keys (the lowest-ranked of 9, 10, 1, 2) first put in
    that turn's place when the turn was sent under another normalized system prompt than the target's, as
    ingest.attribution.same_system_turn does; a target left with no id-key candidate (all another thread's) takes
    its latest one as its thread's previous turn (kind 9 or 10), as PredecessorIndex.candidates does. Only the
    system prompts of turns with an earlier same-system candidate are read from gateway_requests (a turn under the
    target's own system prompt is also the latest on key 17 or 18, so none is earlier: nearly every turn).
    ``by``: the columns naming a target."""
    same = found.filter(pl.col("kind").is_in(SAME_SYSTEM_KEYS))
    if same.is_empty():
        return found
    rest = found.filter(~pl.col("kind").is_in(SAME_SYSTEM_KEYS))
    rank = pl.col("kind").replace_strict({k: i for i, k in enumerate(ID_TURN_KEYS)}, return_dtype=pl.Int64)
    turn = (rest.filter(pl.col("kind").is_in(ID_TURN_KEYS)).sort([*by, rank])
            .unique(by, keep="first", maintain_order=True))
    # a target whose id-key candidates were all another thread's (_confirm_threads): its thread's own, if any
    alone = (same.join(turn.select(by), on=by, how="anti")
             .sort([*by, "p_order_key", f"p_{ID_HASH}", pl.col("kind") == SAME_SYSTEM_KEYS[0]])
             .unique(by, keep="last", maintain_order=True)
             .with_columns(pl.col("kind").replace_strict(THREAD_OF_SAME_SYSTEM, return_dtype=same.schema["kind"])))
    rest = pl.concat([rest, alone.select(rest.columns)], how="vertical_relaxed") if not alone.is_empty() else rest
    pairs = (turn.join(same.select(*by, *(pl.col(c).alias(f"s_{c}") for c in _P)), on=by, how="inner")
             .filter(pl.col("s_p_order_key") < pl.col("p_order_key"))
             .sort([*by, "s_p_order_key", f"s_p_{ID_HASH}"]).unique(by, keep="last", maintain_order=True))
    if pairs.is_empty():
        return rest
    moved = (pairs.join(_target_fields(targets, pairs, by, ("system_norm_hash",)), on=by, how="inner")
             .join(_candidate_fields(store, pairs, ("system_norm_hash",)), on=["p_order_key", f"p_{ID_HASH}"],
                   how="inner")
             .filter(pl.col("p_system_norm_hash") != pl.col("system_norm_hash")))
    if moved.is_empty():
        return rest
    put = moved.select(*by, "kind", *(pl.col(f"s_{c}").alias(c) for c in _P))
    return pl.concat([rest.join(put.select(*by, "kind"), on=[*by, "kind"], how="anti"),
                      put.select(rest.columns)], how="vertical_relaxed")


#: A candidate's columns in ``found`` besides its target and key kind.
_P = ("p_ts", "p_order_key", f"p_{ID_HASH}")


def _choose(found: pl.DataFrame, beyond_horizon: bool, ts_type: pl.DataType, by: list[str] = _ID) -> pl.DataFrame:
    """One predecessor per target among ``found`` (a row per key with a candidate; a target named by the columns
    ``by``): the lowest key rank (agent-run thread, conversation thread, conversation, agent run, fingerprint, then
    any variant; see :data:`_RANKS`), the latest on a tie.
    Columns ``by``, predecessor_kind, beyond_horizon, p_ts (timestamps of ``ts_type``), p_order_key,
    p_id_hash.

    One sort of all candidates by target, rank and recency, then each target's first row: measured 0.19 CPU-s
    against 0.43 for a sort within each group (group_by) on a chunk's 1.3·10^6 candidates."""
    ids = [pl.col(c).cast(ts_type) if c == "ts" else pl.col(c) for c in by]
    if found.is_empty():
        schema = {"request_id": pl.String, "ts": ts_type, "order_key": pl.UInt64}
        return pl.DataFrame(schema={**{c: schema[c] for c in by}, "predecessor_kind": pl.String,
                                    "beyond_horizon": pl.Boolean, "p_ts": ts_type,
                                    "p_order_key": pl.UInt64, f"p_{ID_HASH}": pl.UInt64})
    rank = pl.col("kind").replace_strict(_ALL_RANKS, default=_VARIANT_RANK, return_dtype=pl.Int64)
    best = (found.with_columns(rank.alias("_rank"))
            .sort([*by, "_rank", "p_order_key", f"p_{ID_HASH}"], descending=[*(False for _ in by), False, True, True])
            .unique(by, keep="first"))
    return best.select(
        *ids,
        pl.col("kind").replace_strict(_KIND_NAMES, default=attribution.VARIANT, return_dtype=pl.String)
        .alias("predecessor_kind"),
        pl.lit(beyond_horizon).alias("beyond_horizon"), pl.col("p_ts").cast(ts_type),
        pl.col("p_order_key").cast(pl.UInt64), pl.col(f"p_{ID_HASH}").cast(pl.UInt64))


def _current(store: Store, keys: pl.DataFrame) -> dict[tuple[str, datetime], tuple[int, tuple[Any, ...]]]:
    """(request_id, ts) → (version, verdict values) of the current answer (the version whose rows sum to +1)."""
    if keys.is_empty():
        return {}
    cols = ", ".join(f"any({c})" for c in VERDICT_COLUMNS if c not in ("request_id", "ts"))
    rows = store.query_rows(
        f"SELECT request_id, ts, version, {cols} FROM request_attribution WHERE {_IN_SET} AND {_BETWEEN} "
        "GROUP BY request_id, ts, version HAVING sum(sign) > 0", _stage(store, "current", keys))
    return {(str(r[0]), _utc(r[1])): (int(r[2]), (r[0], _utc(r[1]), *r[3:])) for r in rows}


#: What the job keeps of a request that may be a predecessor: the fields judge_frame reads of one, its
#: order_key (ts in ms << 20 | 20 bits of the id's MD5: one integer that (request_id, ts) determine) and
#: :data:`ID_HASH`, which together name it.
_KNOWN = (*PREDECESSOR_FIELDS, "order_key", ID_HASH)
_NAME = ["order_key", ID_HASH]


def _target_fields(targets: pl.DataFrame, found: pl.DataFrame, by: list[str], fields: Sequence[str]
                   ) -> pl.DataFrame:
    """The targets' ``fields`` beside the columns ``by`` that name them, ts cast to ``found``'s p_ts type (the
    store's), to join on ``by``."""
    ts_type = found.schema["p_ts"]
    return targets.select(*(pl.col(c).cast(ts_type) if c == "ts" else c for c in by), *fields)


def _candidate_fields(store: Store, found: pl.DataFrame, fields: Sequence[str]) -> pl.DataFrame:
    """The gateway_requests ``fields`` of the candidates in ``found`` (rows with p_ts, p_order_key and p_id_hash, not
    empty), as ``p_`` columns beside p_order_key and p_id_hash, to join on those two (:func:`_by_order_keys`)."""
    keys = found.select(pl.col("p_order_key").alias("order_key"), pl.col("p_ts").alias("ts")).unique()
    return _by_order_keys(store, keys, ("order_key", ID_HASH, *fields)).select(
        pl.col("order_key").alias("p_order_key"), pl.col(ID_HASH).alias(f"p_{ID_HASH}"),
        *(pl.col(f).alias(f"p_{f}") for f in fields))


def _lines_confirm(store: Store, found: pl.DataFrame, targets: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """The rows of ``found`` (not empty) whose candidate's system lines confirm it as the target's system prompt
    with at most a few lines changed (ingest.attribution.lines_match; the candidates' lines read from
    gateway_requests), with the lines' columns added."""
    frame = (found.join(_target_fields(targets, found, by, (LINE_HASHES, LINE_TOKENS)), on=by, how="left")
             .join(_candidate_fields(store, found, (LINE_HASHES,)), on=["p_order_key", f"p_{ID_HASH}"], how="left"))
    return frame.filter(pl.Series(structure_lines_match(frame), dtype=pl.Boolean))


def _by_order_keys(store: Store, keys: pl.DataFrame, fields: tuple[str, ...]) -> pl.DataFrame:
    """The gateway_requests rows whose order_key is one of ``keys`` (columns order_key, ts), their columns
    ``fields`` (:data:`ID_HASH` computed), one row per (order_key, id_hash) when ``fields`` hold both: of two
    requests that share both (one pair in ~2^84 within a millisecond), the least request_id."""
    if keys.is_empty():
        return pl.DataFrame()
    rows = store.query_df(
        f"SELECT {_columns(dict.fromkeys([*fields, 'request_id']))} FROM gateway_requests "
        f"WHERE {_BETWEEN} AND {IN_ORDER_STAGE}", stage_order_keys(store, "attribution:order_keys", keys))
    return _one_per_name(rows).select(fields)


def _one_per_name(rows: pl.DataFrame) -> pl.DataFrame:
    """``rows`` with one row per (order_key, id_hash): the least request_id (a row read twice, or a collision)."""
    if (rows.is_empty() or ID_HASH not in rows.columns
            or rows["order_key"].n_unique() == len(rows)):  # one integer column is enough to check
        return rows
    return rows.sort("request_id").unique(_NAME, keep="first", maintain_order=True)


def _with_predecessors(store: Store, frame: pl.DataFrame, known: KnownRequests) -> pl.DataFrame:
    """``frame`` (its chosen predecessor's p_ts, p_order_key and p_id_hash per row) with the predecessor's
    :data:`PREDECESSOR_FIELDS` (request_id among them; not ts, which p_ts is) as ``p_`` columns (null when the
    store has no such row). Each predecessor is looked for first in ``known`` (the run's recent arrivals, this
    chunk's among them), then read from the store (those fields only, :func:`_by_order_keys`). Matched on the
    order_key and :data:`ID_HASH`: integers, where the ids are strings."""
    named = frame["p_order_key"].is_not_null().to_numpy()
    want_keys = frame["p_order_key"].fill_null(0).cast(pl.UInt64).to_numpy()
    want_hashes = frame[f"p_{ID_HASH}"].fill_null(0).cast(pl.UInt64).to_numpy()
    rows = np.where(named, known.find(want_keys, want_hashes), -1)
    parts = list(known.parts)
    missing = named & (rows < 0)
    if missing.any():
        wanted = frame.filter(pl.Series(missing)).select(
            pl.col("p_order_key").alias("order_key"), pl.col("p_ts").alias("ts")).unique()
        extra = _by_order_keys(store, wanted, _KNOWN).rechunk()
        if not extra.is_empty():
            keys, hashes, extra_rows = names(extra)
            at = positions(keys, hashes, want_keys, want_hashes)
            rows = np.where(missing & (at >= 0), len(known) + extra_rows[np.maximum(at, 0)], rows)
            parts.append(extra)
    fields = [c for c in PREDECESSOR_FIELDS if c != "ts"]
    preds = gather([p.select(fields) for p in parts], rows)
    return frame.hstack(preds.rename({c: f"p_{c}" for c in fields}).get_columns())


def _chain_pairs(store: Store, frame: pl.DataFrame, claimed: np.ndarray) -> pl.DataFrame:
    """The columns :func:`ingest.attribution_batch.chain_columns` computes, for every row of ``frame`` (targets with
    their predecessors' p_order_key and p_id_hash): what a target's logged block chain and its predecessor's prove
    they share, which bounds a drift the segment hashes claim (judge_frame's ``chains``). Read from the store for
    the ``claimed`` rows (those whose segments claim a drift) whose target logged a chain: one read of both sides'
    chains, by order_key; the other rows read unknown (−1), which leaves their verdict as the segments give it."""
    sel = frame.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("_row"), "order_key", "ts", ID_HASH,
                       "p_order_key", "p_ts", f"p_{ID_HASH}", "prompt_block_size").filter(
        (pl.col("prompt_block_size") > 0) & pl.col("p_order_key").is_not_null() & pl.Series(claimed))
    if sel.is_empty():
        return pl.DataFrame({CHAIN_SHARED: np.full(len(frame), -1, dtype=np.int64),
                             CHAIN_COVERS: np.zeros(len(frame), dtype=bool)})
    keys = pl.concat([sel.select("order_key", "ts"),
                      sel.select(pl.col("p_order_key").alias("order_key"), pl.col("p_ts").alias("ts"))],
                     how="vertical_relaxed").unique()
    chains = _by_order_keys(store, keys, ("order_key", ID_HASH, "prompt_block_hashes", "prompt_block_size"))
    mine = chains.select("order_key", ID_HASH, "prompt_block_hashes")
    theirs = chains.select(pl.col("order_key").alias("p_order_key"), pl.col(ID_HASH).alias(f"p_{ID_HASH}"),
                           pl.col("prompt_block_hashes").alias("p_prompt_block_hashes"),
                           pl.col("prompt_block_size").alias("p_prompt_block_size"))
    pairs = chain_columns(sel.join(mine, on=["order_key", ID_HASH], how="left", maintain_order="left")
                          .join(theirs, on=["p_order_key", f"p_{ID_HASH}"], how="left", maintain_order="left"))
    shared = np.full(len(frame), -1, dtype=np.int64)
    covers = np.zeros(len(frame), dtype=bool)
    rows = pairs["_row"].to_numpy()
    shared[rows], covers[rows] = pairs[CHAIN_SHARED].to_numpy(), pairs[CHAIN_COVERS].to_numpy()
    return pl.DataFrame({CHAIN_SHARED: shared, CHAIN_COVERS: covers})


#: A chunk's size when the caller gives none, in units: a request judged by its fingerprints counts 1, one judged
#: on KV evidence (precise mode, a logged block chain) :data:`EVIDENCE_WEIGHT`. Measured on 10^6 requests of generated
#: history without chains (fingerprint mode, CPU-s of the whole run, two runs each, interleaved): chunks of 10^5 took
#: 19.2 and 21.7, of 2.5·10^5 16.4 and 17.3, of 5·10^5 14.0 and 14.9, peak RSS 1.4, 1.9 and 2.3 GB. Each chunk reads
#: its keys' rows of the whole horizon (the predecessor ASOF JOIN's right side) and every granule of
#: gateway_requests that holds one of its rows (sorted by tenant, so nearly all of them): fewer chunks, less of both.
CHUNK_BUDGET = 500_000
#: What a request judged on KV evidence counts in :data:`CHUNK_BUDGET`: its evidence (the KV events of its blocks)
#: costs memory a chainless request does not. On 3·10^5 requests with chains and KV events, chunks of 10^5 peaked at
#: 3.6 GB RSS and 56.7 CPU-s, of 3·10^5 at 5.4 GB and 63.8 CPU-s: precise chunks stay at 10^5 (5·10^5 / 5).
EVIDENCE_WEIGHT = 5


#: How many rows of the run's recent arrivals the job keeps the predecessor fields of at most
#: (:class:`~ingest.known_requests.KnownRequests`; those older than the horizon are dropped first), so that a
#: predecessor among them is not read from the store again. A kept row costs its predecessor fields: ~0.15–0.5 KB
#: (more with long system-line or chunk hash lists). On 10^7 requests of generated history (an hour's horizon
#: holds ~1.8·10^6 requests) the job then read no predecessor back from the store.
KNOWN_ROWS = 3_000_000


# -- compute and write ---------------------------------------------------------------------------------------
def _verdicts(store: Store, targets: pl.DataFrame, reach: tuple[int, int], sizes: pl.DataFrame,
              default_block_size: int, known: KnownRequests | None = None, kv_evidence: bool = True,
              memo: KvMemo | None = None, tails: KeyTails | None = None) -> dict[str, Any]:
    """Verdict columns (:data:`VERDICT_COLUMNS`) for every row of ``targets``; ``reach``: (horizon, lookback)
    in ms; ``sizes``: the pods' block size changes (:func:`ingest.block_sizes.changes`), each target judged with
    its pod's size at its arrival (``default_block_size`` for a pod without any). ``known``: the run's recent
    arrivals, ``targets`` among them (:class:`~ingest.known_requests.KnownRequests`: most predecessors are recent),
    so only the others are fetched (None: only ``targets``). ``kv_evidence``: judge the requests that logged a
    block chain against the pods' KV events (precise mode, :func:`ingest.kv_evidence.chunk_evidence`, events read
    back to the lookback). ``memo``: the run's
    :class:`~ingest.kv_evidence.KvMemo` when ``targets`` are its next chunk of arrivals (the KV evidence before the
    last chunk's arrivals, kept). ``tails``: the run's :class:`~ingest.key_tails.KeyTails` when ``targets`` are
    its next chunk of arrivals (:func:`_predecessors`)."""
    chosen = _predecessors(store, targets, *reach, tails=tails)
    frame = targets.with_columns(block_sizes.at(targets, sizes, default_block_size))
    if chosen.is_empty():
        frame = frame.with_columns(pl.lit("").alias("predecessor_kind"), pl.lit(False).alias("beyond_horizon"),
                                   *[pl.lit(None).alias(f"p_{c}") for c in PREDECESSOR_FIELDS])
    else:
        if known is None:
            known = KnownRequests(_KNOWN, len(targets))
            known.add(targets)
        by = _ID if "request_id" in chosen.columns else ["order_key"]
        frame = _with_predecessors(store, frame.join(chosen, on=by, how="left"), known)
    evidence = None
    chained = targets.select((pl.col("prompt_block_size") > 0).any()).item()
    chains = (lambda claimed: _chain_pairs(store, frame, claimed)) if chained and not chosen.is_empty() else None
    if kv_evidence and chained:
        params = {**_stage(store, "evidence", targets), "lookback": max(reach)}
        evidence = chunk_evidence(store, frame, params, _IN_SET, memo, sizes, default_block_size)
    return judge_frame(frame, evidence, chains)


#: request_attribution's columns as Arrow types (nested lists built by pyarrow in C, not row by row).
_ARROW = pa.schema([
    ("request_id", pa.string()), ("ts", pa.timestamp("ms", tz="UTC")), ("tenant_id", pa.string()),
    ("pod", pa.string()), ("model", pa.string()), ("prompt_tokens", pa.uint32()), ("cached_tokens", pa.uint32()),
    ("predecessor_request_id", pa.string()), ("predecessor_pod", pa.string()), ("predecessor_kind", pa.string()),
    ("gap_ms", pa.float64()), ("block_size", pa.uint32()), ("causes", pa.list_(pa.string())),
    ("sub_causes", pa.list_(pa.string())), ("missed_tokens", pa.list_(pa.uint32())),
    ("evidence", pa.string()), ("evidence_pod", pa.string()), ("evidence_removed_at", pa.timestamp("ms", tz="UTC")),
    ("attributed_at", pa.timestamp("ms", tz="UTC")), ("sign", pa.int8()), ("version", pa.uint32()),
])


def _table(verdicts: dict[str, Any], attributed_at: datetime) -> pa.Table:
    """First answers (sign +1, version 1) as an Arrow table in request_attribution's column order."""
    n = len(verdicts["request_id"])
    columns = [verdicts[c] for c in VERDICT_COLUMNS]
    columns[VERDICT_COLUMNS.index("ts")] = verdicts["ts"].to_arrow()
    arrays = [col.cast(field.type) if isinstance(col, pa.Array | pa.ChunkedArray) else pa.array(col, type=field.type)
              for col, field in zip(columns, _ARROW, strict=False)]
    at_ms = int(attributed_at.timestamp() * 1000)
    arrays += [pa.array(np.full(n, at_ms, dtype=np.int64), type=pa.int64()).cast(_ARROW.field("attributed_at").type),
               pa.array(np.ones(n, dtype=np.int8)), pa.array(np.ones(n, dtype=np.uint32))]
    return pa.Table.from_arrays(arrays, schema=_ARROW)


def _write_changes(store: Store, verdicts: dict[str, Any], current: dict[tuple[str, datetime], tuple[int, tuple]],
                   attributed_at: datetime) -> int:
    """Write the successors' verdicts that differ from their current answers; returns how many changed."""
    rows: list[tuple[Any, ...]] = []
    verdicts = {c: v.to_pylist() if hasattr(v, "to_pylist") else v for c, v in verdicts.items()}
    for k in range(len(verdicts["request_id"])):
        new = tuple(verdicts[c][k] for c in VERDICT_COLUMNS)
        new = tuple(_utc(v) if isinstance(v, datetime) else v for v in new)
        old = current.get((new[0], new[1]))
        if old is None:
            continue
        if _comparable(old[1]) == _comparable(new):
            continue
        rows.append((*old[1], attributed_at, -1, old[0]))
        rows.append((*new, attributed_at, 1, old[0] + 1))
    store.insert("request_attribution", rows, WRITE_COLUMNS)
    return len(rows) // 2


def _comparable(values: tuple) -> tuple:
    out = []
    for v in values:
        if isinstance(v, list | tuple):
            v = tuple(int(x) if hasattr(x, "__int__") and not isinstance(x, str) else x for x in v)
        elif isinstance(v, datetime):
            v = _utc(v)
        elif hasattr(v, "item"):
            v = v.item()
        out.append(v)
    return tuple(out)


#: glibc mallopt(3) parameters: M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD (malloc.h).
_MALLOPT = ((-1, 1 << 30), (-2, 256 << 20), (-3, 32 << 20))


@functools.cache
def _reuse_freed_memory() -> None:
    """Let glibc's malloc keep and reuse the memory a chunk frees instead of handing it back to the kernel and
    faulting it in again for the next chunk (mallopt(3): trim threshold 1 GiB, top pad 256 MiB, mmap threshold
    32 MiB, its largest; numpy's arrays of a chunk are mostly 1–80 MB). Measured on 3·10^5 requests with KV
    evidence: ~10% less CPU, kernel time 8–9 → 6 s. Once per process; a no-op where the C library has no
    mallopt (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return
    for param, value in _MALLOPT:
        mallopt(ctypes.c_int(param), ctypes.c_int(value))


def run_attribution(store: Store, *, settle_seconds: float = 1.0, overlap_seconds: float = 300.0,
                    stop: threading.Event | None = None,
                    horizon_seconds: float = attribution.DEFAULT_HORIZON_SECONDS,
                    lookback_seconds: float = attribution.DEFAULT_LOOKBACK_SECONDS,
                    default_block_size: int = attribution.DEFAULT_BLOCK_SIZE,
                    chunk_size: int | None = None, kv_evidence: bool = True, memo: KvMemo | None = None) -> RunStats:
    """One run: answer every request ingested up to (store clock − ``settle_seconds``) that has no answer,
    and re-answer their successors; then advance the watermark. Returns what it did.

    ``overlap_seconds``: how far before the watermark arrivals are looked for again (an insert stamped before
    the last run but visible only after it); only unanswered ones are picked, so the overlap costs a query,
    not work. ``horizon_seconds``: the furthest back a predecessor may lie; ``lookback_seconds``: the
    furthest back a request with none looks for one beyond the horizon (its reusable part is then
    ``beyond_horizon``; ≤ ``horizon_seconds`` turns the lookback off). ``chunk_size``: arrivals per
    chunk (bounds memory); None: :data:`CHUNK_BUDGET` units, a request judged on KV evidence counting
    :data:`EVIDENCE_WEIGHT` (5·10^5 requests judged by fingerprints, 10^5 on KV evidence). ``kv_evidence``:
    precise mode, judge the requests that logged a block chain against the pods' KV events (docs/miss-causes.md
    "Precise mode"); False attributes from fingerprints alone (``evidence`` inferred / fingerprints), to compare. Raises
    :class:`~ingest.errors.StoreUnavailable` (retry later) or other :class:`~ingest.errors.KvscopeError`; a
    failed run leaves the watermark and is safe to repeat. ``stop``: checked between chunks (a run over a big
    backlog stops early, leaving the watermark). Runs in one process are serialised (one writer). ``memo``: a
    :class:`~ingest.kv_evidence.KvMemo` kept across runs (made with ``across_runs_lag_ms``; :func:`attribution_loop`
    keeps one), so that a live run reads its hot blocks' rows since the last run's cut instead of their whole
    history; None: a memo for this run only. Raises ValueError, before touching the store, for a parameter out of
    range: a time that is not a finite number of seconds ≥ 0 (settle may be negative: it then takes requests
    stamped up to that far ahead of the store's clock), a ``chunk_size`` below 1, a ``default_block_size`` below 1.
    """
    _check_parameters(settle_seconds=settle_seconds, overlap_seconds=overlap_seconds,
                      horizon_seconds=horizon_seconds, lookback_seconds=lookback_seconds,
                      default_block_size=default_block_size, chunk_size=chunk_size)
    _reuse_freed_memory()
    with _WRITER:  # one writer: a final run at shutdown waits for the loop's run, never races it
        reach = (int(horizon_seconds * 1000), int(lookback_seconds * 1000))
        return _run(store, settle_seconds, overlap_seconds, stop, reach, default_block_size, chunk_size,
                    kv_evidence, memo)


def _check_parameters(**given: Any) -> None:
    """:func:`run_attribution`'s parameter check (ValueError naming the parameter and its value)."""
    for name, value in given.items():
        if name.endswith("_seconds"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"attribution {name}={value!r}: expected a finite number of seconds")
            if value < 0 and name != "settle_seconds":
                raise ValueError(f"attribution {name}={value!r}: expected a number of seconds >= 0")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"attribution {name}={value!r}: expected a whole number >= 1")


def _reexamine(store: Store, keys: pl.DataFrame, reach: tuple[int, int], sizes: pl.DataFrame,
               default_block_size: int, kv_evidence: bool, now: datetime) -> tuple[int, int]:
    """Judge the answered requests ``keys`` (request_id, ts) again; write those whose answer changed.
    Returns (examined, changed)."""
    current = _current(store, keys)
    answered = pl.DataFrame({"request_id": [i for i, _ in current], "ts": [t for _, t in current]},
                            schema={"request_id": pl.String, "ts": keys.schema["ts"]})
    requests = _requests(store, keys.join(answered, on=["request_id", "ts"], how="semi"),
                         (*_FIELDS, "order_key", ID_HASH))
    if requests.is_empty():
        return 0, 0
    verdicts = _verdicts(store, requests, reach, sizes, default_block_size, kv_evidence=kv_evidence)
    return len(requests), _write_changes(store, verdicts, current, now)


def _by_memo(arrivals: pl.DataFrame, memo: KvMemo | None, across_runs: bool
             ) -> list[tuple[pl.DataFrame, KvMemo | None]]:
    """The chunk's arrivals with the memo to judge them with. A memo kept across runs stands for the log before its
    cuts, so an arrival before its latest cut (a request logged longer after it arrived than the cuts lag) is
    judged on its own without it (its blocks' whole history read) instead of starting it again empty; the others
    with it. A memo for one run needs no split: each chunk's arrivals lie after the chunk before."""
    cut = memo.latest_cut() if memo is not None and across_runs else None
    if cut is None:
        return [(arrivals, memo)]
    early = pl.col("ts").dt.epoch("ms") < cut
    parts = [(arrivals.filter(early), None), (arrivals.filter(~early), memo)]
    return [(part, m) for part, m in parts if not part.is_empty()]


def _run(store: Store, settle_seconds: float, overlap_seconds: float, stop: threading.Event | None,
         reach: tuple[int, int], default_block_size: int, chunk_size: int | None, kv_evidence: bool = True,
         kept: KvMemo | None = None) -> RunStats:
    now = server_now(store)
    upto = now - timedelta(seconds=settle_seconds)
    since = read_watermark(store) - timedelta(seconds=overlap_seconds)
    sizes = block_sizes.changes(store)
    # read before any answer of this run: a restart a gap report adds later is a change for the next run
    restarts = gap_restarts(store) if kv_evidence else None
    answered_through = _answered_through(store)
    # Every answer of a request of a later chunk predates this run: a chunk's arrivals are answered only by
    # their own chunk, and a successor re-answered already had an answer.
    answered_before = answered_through
    stats = RunStats()
    if chunk_size is None:  # re-examined targets (few, precise) by the precise chunk's size
        budget, weight = CHUNK_BUDGET, EVIDENCE_WEIGHT if kv_evidence else 1
        chunk_size = CHUNK_BUDGET // EVIDENCE_WEIGHT
    else:
        budget, weight = chunk_size, 1
    bounds = _chunk_bounds(store, since, upto, budget, weight) if upto > since else []
    known = KnownRequests(_KNOWN, KNOWN_ROWS)  # the predecessor fields of the last chunks' arrivals
    memo = (kept or KvMemo()) if kv_evidence else None  # the KV evidence before the last chunk's arrivals, summarized
    if memo is not None and kept is not None:
        memo.new_run(store, now)
    tails = KeyTails()  # each key's latest row up to the last chunk searched by range
    for n, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if memo is not None and n == len(bounds) - 2:
            memo.last_chunk()
        arrivals = _arrivals(store, since, upto, lo, hi, answered_before)
        if arrivals.is_empty():
            continue
        # Only an arrival older than some answered request can have an answered successor (its successors
        # lie later): in-order traffic and bulk loads skip the successor query altogether.
        late = arrivals.filter(pl.col("ts") < answered_through) if answered_through else arrivals.clear()
        later = pl.DataFrame(schema={"request_id": pl.String, "ts": arrivals.schema["ts"]})
        if not late.is_empty():
            later = _successors(store, late, max(reach))
            if kv_evidence:  # a late row may show a pod serving the model: a holder for earlier requests
                later = pl.concat([later.select(_ID),
                                   new_holder_targets(store, late, since, max(reach), answered_through, now)],
                                  how="vertical_relaxed").unique()
            later = later.join(arrivals.select("request_id", "ts"), on=["request_id", "ts"], how="anti")
        examined, changed = _reexamine(store, later, reach, sizes, default_block_size, kv_evidence, now)
        known.add(arrivals, arrivals.select(pl.col("ts").min().dt.epoch("ms")).item() - reach[0])
        for part, part_memo in _by_memo(arrivals, memo, kept is not None):
            verdicts = _verdicts(store, part, reach, sizes, default_block_size, known, kv_evidence, part_memo,
                                 tails)
            store.insert_arrow("request_attribution", _table(verdicts, now), FIRST_ANSWER_SETTINGS)
        latest = arrivals["ts"].max()
        answered_through = latest if answered_through is None else max(answered_through, latest)
        ATTRIBUTED.labels("new").inc(len(arrivals))
        ATTRIBUTED.labels("changed").inc(changed)
        UNCHANGED.inc(examined - changed)
        stats = RunStats(stats.arrivals + len(arrivals), stats.changed + changed,
                         stats.examined + examined, stats.chunks + 1)
        if stop is not None and stop.is_set():  # between chunks: the watermark stays, the next run resumes
            return stats
    if kv_evidence and upto > since:
        # KV events that arrived late re-answer what they change (after the arrivals: those already saw them).
        targets = late_kv_targets(store, since, upto, settle_seconds, max(reach), answered_through)
        stats = _reexamine_all(store, targets, "late_kv_evidence", reach, sizes, default_block_size, kv_evidence,
                               now, chunk_size, stats)
    if restarts is not None:
        stats = _restarted(store, restarts, sizes, reach, default_block_size, now, chunk_size, stats)
    stats = _resize(store, sizes, reach, default_block_size, kv_evidence, now, chunk_size, stats)
    store.insert("attribution_watermark", [(JOB_NAME, upto, now)], ["job", "ingested_through", "updated_at"])
    WATERMARK_LAG.set((now - upto).total_seconds())
    if stats.arrivals:
        log.info("miss attribution run. arrivals=%d successors_examined=%d changed=%d chunks=%d through=%s",
                 stats.arrivals, stats.examined, stats.changed, stats.chunks, upto.isoformat())
    return stats


def _reexamine_all(store: Store, targets: pl.DataFrame, why: str, reach: tuple[int, int], sizes: pl.DataFrame,
                   default_block_size: int, kv_evidence: bool, now: datetime, chunk_size: int,
                   stats: RunStats) -> RunStats:
    """:func:`_reexamine` ``targets`` (request_id, ts) in chunks of ``chunk_size``, counting the answers changed
    under ``why`` (:data:`ATTRIBUTED`); returns ``stats`` with them added."""
    for start in range(0, len(targets), chunk_size):
        examined, changed = _reexamine(store, targets.slice(start, chunk_size), reach, sizes, default_block_size,
                                       kv_evidence, now)
        ATTRIBUTED.labels(why).inc(changed)
        UNCHANGED.inc(examined - changed)
        stats = RunStats(stats.arrivals, stats.changed + changed, stats.examined + examined, stats.chunks)
    return stats


def _restarted(store: Store, restarts: pl.DataFrame, sizes: pl.DataFrame, reach: tuple[int, int],
               default_block_size: int, now: datetime, chunk_size: int, stats: RunStats) -> RunStats:
    """Re-answer the requests that each vLLM restart read from the gap reports (``restarts``:
    :func:`ingest.attribution_late.gap_restarts`, read at the run's start) and not among those the job last judged
    with (table attribution_gap_restarts), or among those and gone, can change
    (:func:`ingest.attribution_late.reset_targets`), then save ``restarts`` when they differ. The first run (none
    saved) only saves. Saved after the answers: a crash in between re-answers again."""
    table = "attribution_gap_restarts"
    before = judged_with.saved(store, table, GAP_RESTARTS_SCHEMA)
    if before is not None and judged_with.same(before, restarts, GAP_RESTARTS_SCHEMA):
        return stats
    if before is not None:
        targets = reset_targets(store, changed_restarts(before, restarts), max(reach), now)
        stats = _reexamine_all(store, targets, "gap_restart", reach, sizes, default_block_size, True, now,
                               chunk_size, stats)
    judged_with.save(store, table, restarts, GAP_RESTARTS_SCHEMA, now)
    return stats


def _resize(store: Store, sizes: pl.DataFrame, reach: tuple[int, int], default_block_size: int, kv_evidence: bool,
            now: datetime, chunk_size: int, stats: RunStats) -> RunStats:
    """Re-answer the requests whose pod's block size at arrival reads otherwise in ``sizes`` (this run's change
    points) than in those the job last judged with (:func:`ingest.block_sizes.saved`), then save ``sizes`` when they
    differ. The first run (none saved) only saves. Saved after the answers: a crash in between re-answers again."""
    before = block_sizes.saved(store)
    if before is not None and block_sizes.same(before, sizes):
        return stats
    if before is not None:
        targets = size_targets(store, block_sizes.differences(before, sizes, default_block_size), now)
        stats = _reexamine_all(store, targets, "block_size_changed", reach, sizes, default_block_size, kv_evidence,
                               now, chunk_size, stats)
    block_sizes.save(store, sizes, now)
    return stats


def attribution_loop(store: Store, stop_event: threading.Event, interval_seconds: float = 5.0,
                     **job_kwargs: Any) -> None:
    """Run :func:`run_attribution` (with ``stop=stop_event``) every ``interval_seconds`` until ``stop_event`` is
    set (a background thread in the embedded mode). ``job_kwargs`` are passed on. With KV evidence the loop keeps
    one :class:`~ingest.kv_evidence.KvMemo` across its runs (cuts lagging each run's last arrival by
    :data:`ingest.kv_evidence.MAX_END_MS`), so each run reads its hot blocks' rows since then, not their history.

    A store outage is logged as a warning and retried next interval; any other error is logged (ERROR: an
    operator must act) and the loop keeps going, so the thread never dies silently.
    """
    if job_kwargs.get("kv_evidence", True) and "memo" not in job_kwargs:
        job_kwargs = {**job_kwargs, "memo": KvMemo(across_runs_lag_ms=MAX_END_MS)}
    while not stop_event.is_set():
        try:
            run_attribution(store, stop=stop_event, **job_kwargs)
        except RetryableError as exc:
            log.warning("miss attribution: store unavailable, retrying in %.1f s: %s", interval_seconds, exc)
        except KvscopeError as exc:
            log.error("miss attribution failed: %s", exc)
        except Exception:  # keep the thread alive; the traceback is the evidence
            log.exception("miss attribution failed unexpectedly")
        stop_event.wait(interval_seconds)
