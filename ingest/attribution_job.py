"""The miss-cause attribution job (gateway_requests → ingest.attribution → miss_attribution): picks up the
requests ingested since its watermark, attributes their missed tokens, writes the rows, advances the mark.

Exactly-once in effect, at-least-once in fact (STYLE.md §4): the rows are written before the watermark, and
attribution is deterministic, so a crash between the two makes the next run rewrite identical rows, which
``miss_attribution``'s ReplacingMergeTree collapses (queries read it with FINAL).
Limitation: a request is attributed against the predecessors in the store when it is picked up; a
predecessor whose log line arrives later (ingested after its successor was attributed) is not seen.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from ingest import attribution
from ingest.errors import KvscopeError, RetryableError
from ingest.store import Store

log = logging.getLogger(__name__)

JOB_NAME = "miss_causes"
#: miss_attribution columns written, in order (sql/migrations/0005_create_miss_attribution.sql).
OUTPUT_COLUMNS = (*attribution.MISS_ROW_COLUMNS, "attributed_at")
_SELECT = ", ".join(attribution.REQUEST_FIELDS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _utc(value: datetime) -> datetime:
    """A datetime as aware UTC (clickhouse-connect returns naive UTC from query_rows)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def read_watermark(store: Store, job: str = JOB_NAME) -> datetime:
    """The highest ``ingested_through`` recorded for ``job`` (aware UTC); the epoch when there is none."""
    rows = store.query_rows(
        "SELECT max(ingested_through), count() FROM attribution_watermark FINAL WHERE job = {job:String}",
        {"job": job},
    )
    if not rows or not rows[0][1]:
        return _EPOCH
    return _utc(rows[0][0])


def block_sizes(store: Store) -> dict[str, int]:
    """Tokens per KV block for each pod: the latest ``block_size`` label of ``vllm:cache_config_info``
    (vLLM's CacheConfig, ../shared/reference/vllm.md §1.2). Pods whose label is missing or not an integer are
    left out (the caller falls back to its default)."""
    rows = store.query_rows(
        "SELECT pod, argMax(labels['block_size'], ts) FROM vllm_metric_samples FINAL "
        "WHERE name = 'vllm:cache_config_info' AND labels['block_size'] != '' GROUP BY pod ORDER BY pod"
    )
    out: dict[str, int] = {}
    for pod, value in rows:
        try:
            size = int(str(value))
        except ValueError:
            continue
        if size > 0:
            out[str(pod)] = size
    return out


def _requests(store: Store, where: str, params: dict[str, Any], extra: str = "") -> list[dict[str, Any]]:
    df = store.query_df(
        f"SELECT {_SELECT}{extra} FROM gateway_requests FINAL WHERE {where} ORDER BY ts, request_id", params
    )
    return df.to_dicts()


def run_attribution(store: Store, *, now: datetime | None = None, settle_seconds: float = 2.0,
                    horizon_seconds: float = attribution.DEFAULT_HORIZON_SECONDS,
                    default_block_size: int = attribution.DEFAULT_BLOCK_SIZE) -> int:
    """Attribute the requests ingested in (watermark, now − settle_seconds]; returns the rows written.

    ``now`` (default: the current UTC time) is also the rows' ``attributed_at``. ``settle_seconds`` leaves
    the last moments alone so that inserts still in flight are not skipped past. Predecessors are looked up
    among requests with ts in [earliest picked ts − ``horizon_seconds``, latest picked ts]. Block sizes come
    from :func:`block_sizes`, else ``default_block_size``. The watermark advances to the highest
    ``ingested_at`` picked up, after the rows are written.
    Raises :class:`~ingest.errors.StoreUnavailable` (retry later) or
    :class:`~ingest.errors.RejectedRows`/:class:`~ingest.errors.QueryError`.
    """
    now = _utc(now) if now is not None else datetime.now(UTC)
    upto = now - timedelta(seconds=settle_seconds)
    since = read_watermark(store)
    if upto <= since:
        return 0
    picked = _requests(
        store,
        "ingested_at > {since:DateTime64(3, 'UTC')} AND ingested_at <= {upto:DateTime64(3, 'UTC')}",
        {"since": since, "upto": upto},
        extra=", ingested_at",
    )
    if not picked:
        return 0
    first = min(_utc(r["ts"]) for r in picked)
    last = max(_utc(r["ts"]) for r in picked)
    window = _requests(
        store,
        "ts >= {lo:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}",
        {"lo": first - timedelta(seconds=horizon_seconds), "hi": last},
    )
    rows = attribution.attribute(
        picked, window, block_size_by_pod=block_sizes(store), default_block_size=default_block_size,
        horizon_seconds=horizon_seconds,
    )
    store.insert("miss_attribution", [(*r.as_tuple(), now) for r in rows], OUTPUT_COLUMNS)
    through = max(_utc(r["ingested_at"]) for r in picked)
    store.insert("attribution_watermark", [(JOB_NAME, through, now)],
                 ["job", "ingested_through", "updated_at"])
    log.info("miss attribution: %d requests, %d rows written, through %s", len(picked), len(rows),
             through.isoformat())
    return len(rows)


def attribution_loop(store: Store, stop_event: threading.Event, interval_seconds: float = 5.0,
                     **job_kwargs: Any) -> None:
    """Run :func:`run_attribution` every ``interval_seconds`` until ``stop_event`` is set (a background thread
    in the embedded mode). ``job_kwargs`` are passed on (settle_seconds, horizon_seconds, default_block_size).

    A store outage is logged as a warning and retried next interval; any other error is logged (ERROR: an
    operator must act) and the loop keeps going, so the thread never dies silently.
    """
    while not stop_event.is_set():
        try:
            run_attribution(store, **job_kwargs)
        except RetryableError as exc:
            log.warning("miss attribution: store unavailable, retrying in %.1f s: %s", interval_seconds, exc)
        except KvscopeError as exc:
            log.error("miss attribution failed: %s", exc)
        except Exception:  # keep the thread alive; the traceback is the evidence
            log.exception("miss attribution failed unexpectedly")
        stop_event.wait(interval_seconds)
