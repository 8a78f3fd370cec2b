"""The miss-cause attribution job (gateway_requests → ingest.attribution → request_attribution): attributes the
requests that arrived since its last run and re-attributes those whose predecessor the arrivals changed.

One answer per request, exact through crashes, reruns and late data (docs/reliability.md):
- **What to do** is read from the store each run, never remembered: the *arrivals* are the requests ingested
  (server clock, ``ingested_at``) since the watermark minus ``overlap_seconds`` that have no answer yet;
  their *successors* are, for each arrival and each of its predecessor keys, the next request on that key
  within the horizon (the one request the arrival may have become the predecessor of), if it has an answer.
  So a predecessor line that arrives late, by seconds or by the whole horizon, corrects its successors.
- **Predecessors** are found in ClickHouse (ASOF JOIN on ``request_keys``, sorted by key and arrival order),
  chunk by chunk: memory is bounded by ``chunk_size``, never by the horizon or the history.
- **Writes** are diffs against the current answers: a request whose answer is unchanged gets nothing; a
  changed one gets its old row again with sign −1 and the new row with sign +1 and the next version, in one
  INSERT (request_attribution is a VersionedCollapsingMergeTree). Successors are written before arrivals, so a
  crash between the two leaves the arrivals unanswered and the next run redoes both; redoing is a no-op.
- The watermark (``attribution_watermark``) moves to the run's upper bound once every chunk is written. The
  job must have one writer per database (the embedded process, or one ``kvscope attribute`` service).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import Counter, Gauge

from ingest import attribution
from ingest.attribution import VERDICT_COLUMNS, Verdict
from ingest.errors import KvscopeError, RetryableError
from ingest.store import Store

log = logging.getLogger("kvscope.attribution")

JOB_NAME = "miss_causes"
_FIELDS = (*attribution.REQUEST_FIELDS, "order_key")
_SELECT = ", ".join(_FIELDS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_BETWEEN = "ts >= {lo:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}"
WRITE_COLUMNS = (*VERDICT_COLUMNS, "attributed_at", "sign", "version")

ATTRIBUTED = Counter("kvscope_attribution_requests", "Requests the attribution job wrote an answer for, by why "
                     "(new = first answer, changed = a late or corrected input changed it)", ["why"])
UNCHANGED = Counter("kvscope_attribution_unchanged", "Successors re-examined whose answer stayed the same")
#: Serialises runs in this process: the job is the only writer of request_attribution (see the docstring).
_WRITER = threading.Lock()
WATERMARK_LAG = Gauge("kvscope_attribution_lag_seconds", "Server time minus the attribution watermark")


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


def block_sizes(store: Store) -> dict[str, int]:
    """Tokens per KV block for each pod: the latest ``block_size`` label of ``vllm:cache_config_info``
    (vLLM's CacheConfig). Pods whose label is missing or not a positive integer are left out (the caller
    falls back to its default)."""
    rows = store.query_rows(
        "SELECT pod, argMax(labels['block_size'], ts) FROM vllm_metric_samples "
        "WHERE name = 'vllm:cache_config_info' AND labels['block_size'] != '' GROUP BY pod ORDER BY pod")
    out: dict[str, int] = {}
    for pod, value in rows:
        try:
            size = int(str(value))
        except ValueError:
            continue
        if size > 0:
            out[str(pod)] = size
    return out


# -- reads ---------------------------------------------------------------------------------------------------
def _arrivals(store: Store, since: datetime, upto: datetime, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` requests ingested in (since, upto] that have no answer yet, oldest first."""
    df = store.query_df(
        f"""
        WITH arrived AS
        (
            SELECT request_id, ts FROM gateway_requests
            WHERE ingested_at > {{since:DateTime64(3, 'UTC')}} AND ingested_at <= {{upto:DateTime64(3, 'UTC')}}
        )
        SELECT {_SELECT}
        FROM gateway_requests
        WHERE ingested_at > {{since:DateTime64(3, 'UTC')}} AND ingested_at <= {{upto:DateTime64(3, 'UTC')}}
          AND (request_id, ts) NOT IN
              (SELECT request_id, ts FROM request_attribution
               WHERE ts >= (SELECT min(ts) FROM arrived) AND ts <= (SELECT max(ts) FROM arrived)
                 AND request_id IN (SELECT request_id FROM arrived))
        ORDER BY order_key
        LIMIT {{limit:UInt32}}
        """, {"since": since, "upto": upto, "limit": limit})
    return df.to_dicts()


def _requests_by_id(store: Store, ids: list[str], lo: datetime, hi: datetime) -> list[dict[str, Any]]:
    if not ids:
        return []
    return store.query_df(
        f"SELECT {_SELECT} FROM gateway_requests WHERE request_id IN {{ids:Array(String)}} AND {_BETWEEN}",
        {"ids": ids, "lo": lo, "hi": hi}).to_dicts()


def _successors(store: Store, arrivals: list[dict[str, Any]], horizon: timedelta) -> list[tuple[str, datetime]]:
    """(request_id, ts) of the requests an arrival may have become the predecessor of: on each of its keys,
    every request of the first later millisecond that has one (a predecessor lies in an earlier millisecond,
    so all requests of that millisecond look back past the same ones), within the horizon."""
    ids = [r["request_id"] for r in arrivals if attribution.can_be_predecessor(r)]
    if not ids:
        return []
    lo = min(_utc(r["ts"]) for r in arrivals)
    hi = max(_utc(r["ts"]) for r in arrivals)
    rows = store.query_rows(
        f"""
        WITH
            arrival_keys AS
            (
                SELECT ts, intDiv(order_key, 1048576) * 1048576 + 1048575 AS last_of_ms, k.key AS key
                FROM gateway_requests ARRAY JOIN predecessor_keys AS k
                WHERE request_id IN {{ids:Array(String)}} AND {_BETWEEN}
            ),
            later AS
            (
                SELECT key, order_key, ts FROM request_keys
                WHERE key IN (SELECT key FROM arrival_keys)
                  AND ts > {{lo:DateTime64(3, 'UTC')}}
                  AND ts <= {{hi:DateTime64(3, 'UTC')}} + toIntervalMillisecond({{horizon:Int64}})
            ),
            nexts AS
            (
                SELECT a.key AS key, n.ts AS next_ts
                FROM arrival_keys AS a
                ASOF INNER JOIN later AS n ON a.key = n.key AND a.last_of_ms < n.order_key
                WHERE toUnixTimestamp64Milli(n.ts) - toUnixTimestamp64Milli(a.ts) <= {{horizon:Int64}}
            )
        SELECT DISTINCT request_id, ts FROM request_keys
        WHERE key IN (SELECT key FROM nexts) AND (key, ts) IN (SELECT key, next_ts FROM nexts)
          AND ts > {{lo:DateTime64(3, 'UTC')}}
          AND ts <= {{hi:DateTime64(3, 'UTC')}} + toIntervalMillisecond({{horizon:Int64}})
        """, {"ids": ids, "lo": lo, "hi": hi, "horizon": int(horizon.total_seconds() * 1000)})
    return [(str(r[0]), _utc(r[1])) for r in rows]


def _candidates(store: Store, targets: list[dict[str, Any]], horizon: timedelta) -> dict[str, dict[int, tuple]]:
    """Per target request_id: key kind → (request_id, ts) of the latest earlier request on that key (an
    earlier millisecond, within the horizon)."""
    ids = [r["request_id"] for r in targets]
    lo = min(_utc(r["ts"]) for r in targets)
    hi = max(_utc(r["ts"]) for r in targets)
    rows = store.query_rows(
        f"""
        WITH target_keys AS
        (
            SELECT request_id, ts, intDiv(order_key, 1048576) * 1048576 AS first_of_ms, k.kind AS kind,
                   k.key AS key
            FROM gateway_requests ARRAY JOIN predecessor_keys AS k
            WHERE request_id IN {{ids:Array(String)}} AND {_BETWEEN}
        )
        SELECT t.request_id, t.kind, p.request_id, p.ts
        FROM target_keys AS t
        ASOF INNER JOIN
        (
            SELECT key, order_key, request_id, ts FROM request_keys
            WHERE key IN (SELECT key FROM target_keys)
              AND ts >= {{lo:DateTime64(3, 'UTC')}} - toIntervalMillisecond({{horizon:Int64}})
              AND ts <= {{hi:DateTime64(3, 'UTC')}}
        ) AS p ON t.key = p.key AND t.first_of_ms > p.order_key
        WHERE toUnixTimestamp64Milli(t.ts) - toUnixTimestamp64Milli(p.ts) <= {{horizon:Int64}}
        """, {"ids": ids, "lo": lo, "hi": hi, "horizon": int(horizon.total_seconds() * 1000)})
    out: dict[str, dict[int, tuple]] = defaultdict(dict)
    for rid, kind, pid, pts in rows:
        out[str(rid)][int(kind)] = (str(pid), _utc(pts))
    return out


def _current(store: Store, ids: list[str], lo: datetime, hi: datetime) -> dict[str, tuple[int, tuple]]:
    """request_id → (version, verdict values) of the current answer (the version whose rows sum to sign +1)."""
    if not ids:
        return {}
    cols = ", ".join(f"any({c})" for c in VERDICT_COLUMNS if c not in ("request_id", "ts"))
    rows = store.query_rows(
        f"SELECT request_id, ts, version, {cols} FROM request_attribution "
        f"WHERE request_id IN {{ids:Array(String)}} AND {_BETWEEN} "
        "GROUP BY request_id, ts, version HAVING sum(sign) > 0", {"ids": ids, "lo": lo, "hi": hi})
    return {str(r[0]): (int(r[2]), (r[0], _utc(r[1]), *r[3:])) for r in rows}


# -- compute and write ---------------------------------------------------------------------------------------
def _judge_all(store: Store, targets: list[dict[str, Any]], horizon: timedelta, sizes: dict[str, int],
               default_block_size: int) -> list[Verdict]:
    cands = _candidates(store, targets, horizon)
    pred_keys = {v for c in cands.values() for v in c.values()}
    preds: dict[tuple[str, datetime], dict[str, Any]] = {}
    if pred_keys:
        lo = min(t for _, t in pred_keys)
        hi = max(t for _, t in pred_keys)
        for r in _requests_by_id(store, sorted({i for i, _ in pred_keys}), lo, hi):
            preds[(r["request_id"], _utc(r["ts"]))] = r
    out = []
    for req in targets:
        found = {kind: preds[key] for kind, key in cands.get(req["request_id"], {}).items() if key in preds}
        size = attribution.block_size_for(req, sizes, default_block_size)
        out.append(attribution.judge(req, attribution.choose_predecessor(found), size))
    return out


def _comparable(values: tuple) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else (_utc(v) if isinstance(v, datetime) else v) for v in values)


def _write(store: Store, verdicts: list[Verdict], attributed_at: datetime) -> int:
    """Write the verdicts that differ from the current answers (one INSERT); returns how many changed."""
    if not verdicts:
        return 0
    lo = min(_utc(v.ts) for v in verdicts)
    hi = max(_utc(v.ts) for v in verdicts)
    current = _current(store, [v.request_id for v in verdicts], lo, hi)
    rows: list[tuple[Any, ...]] = []
    for v in verdicts:
        new = v.values()
        old = current.get(v.request_id)
        if old is not None and _comparable(old[1]) == _comparable(new):
            continue
        version = 1
        if old is not None:
            rows.append((*old[1], attributed_at, -1, old[0]))
            version = old[0] + 1
        rows.append((*new, attributed_at, 1, version))
    store.insert("request_attribution", rows, WRITE_COLUMNS)
    return sum(1 for r in rows if r[-2] == 1)


def run_attribution(store: Store, *, settle_seconds: float = 1.0, overlap_seconds: float = 300.0,
                    stop: threading.Event | None = None,
                    horizon_seconds: float = attribution.DEFAULT_HORIZON_SECONDS,
                    default_block_size: int = attribution.DEFAULT_BLOCK_SIZE, chunk_size: int = 20_000) -> RunStats:
    """One run: answer every request ingested up to (store clock − ``settle_seconds``) that has no answer,
    and re-answer their successors; then advance the watermark. Returns what it did.

    ``overlap_seconds``: how far before the watermark arrivals are looked for again (an insert stamped before
    the last run but visible only after it); only unanswered ones are picked, so the overlap costs a query,
    not work. ``horizon_seconds``: the furthest back a predecessor may lie. ``chunk_size``: arrivals per
    chunk (memory bound). Raises :class:`~ingest.errors.StoreUnavailable` (retry later) or other
    :class:`~ingest.errors.KvscopeError`; a failed run leaves the watermark and is safe to repeat. ``stop``:
    checked between chunks (a run over a big backlog stops early, leaving the watermark). Runs in one process
    are serialised (one writer).
    """
    with _WRITER:  # one writer: a final run at shutdown waits for the loop's run, never races it
        return _run(store, settle_seconds, overlap_seconds, stop, horizon_seconds, default_block_size, chunk_size)


def _run(store: Store, settle_seconds: float, overlap_seconds: float, stop: threading.Event | None,
         horizon_seconds: float, default_block_size: int, chunk_size: int) -> RunStats:
    now = server_now(store)
    upto = now - timedelta(seconds=settle_seconds)
    since = read_watermark(store) - timedelta(seconds=overlap_seconds)
    horizon = timedelta(seconds=horizon_seconds)
    sizes = block_sizes(store)
    stats = RunStats()
    while upto > since:
        arrivals = _arrivals(store, since, upto, chunk_size)
        if not arrivals:
            break
        arrived = {(r["request_id"], _utc(r["ts"])) for r in arrivals}
        later = {k for k in _successors(store, arrivals, horizon) if k not in arrived}
        successors = []
        if later:
            lo, hi = min(t for _, t in later), max(t for _, t in later)
            ids = sorted({i for i, _ in later})
            answered = _current(store, ids, lo, hi)
            successors = [r for r in _requests_by_id(store, ids, lo, hi)
                          if (r["request_id"], _utc(r["ts"])) in later and r["request_id"] in answered]
        changed = _write(store, _judge_all(store, successors, horizon, sizes, default_block_size), now) \
            if successors else 0
        _write(store, _judge_all(store, arrivals, horizon, sizes, default_block_size), now)
        ATTRIBUTED.labels("new").inc(len(arrivals))
        ATTRIBUTED.labels("changed").inc(changed)
        UNCHANGED.inc(len(successors) - changed)
        stats = RunStats(stats.arrivals + len(arrivals), stats.changed + changed,
                         stats.examined + len(successors), stats.chunks + 1)
        if len(arrivals) < chunk_size:
            break
        if stop is not None and stop.is_set():  # between chunks: the watermark stays, the next run resumes
            return stats
    store.insert("attribution_watermark", [(JOB_NAME, upto, now)], ["job", "ingested_through", "updated_at"])
    WATERMARK_LAG.set((now - upto).total_seconds())
    if stats.arrivals:
        log.info("miss attribution run. arrivals=%d successors_examined=%d changed=%d chunks=%d through=%s",
                 stats.arrivals, stats.examined, stats.changed, stats.chunks, upto.isoformat())
    return stats


def attribution_loop(store: Store, stop_event: threading.Event, interval_seconds: float = 5.0,
                     **job_kwargs: Any) -> None:
    """Run :func:`run_attribution` (with ``stop=stop_event``) every ``interval_seconds`` until ``stop_event`` is
    set (a background thread in the embedded mode). ``job_kwargs`` are passed on.

    A store outage is logged as a warning and retried next interval; any other error is logged (ERROR: an
    operator must act) and the loop keeps going, so the thread never dies silently.
    """
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
