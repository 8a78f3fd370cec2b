"""kv_pod_minutes (sql/migrations/0050): per pod and minute the first and last kv_block_log row, kept by a view as KV
events arrive (real chDB, events fed the production way: ZMQ frames → collector → queue → ingester). Precise mode
reads whether a pod's KV events cover an arrival from it (ingest/kv_evidence.py ``fetch_first_events``) instead of
scanning the log's lookback: the answers must be those the log's own rows give, at every arrival, bucket and
window edge."""

from __future__ import annotations

import random
from datetime import timedelta

import polars as pl
import pytest
from test_kv_residency import CLEARED, at, collect, frames, ingest, stored

from ingest.kv_evidence import (
    fetch_first_events,
    fetch_first_events_from_log,
    fetch_model_pods,
    fetch_model_pods_from_log,
    seen_between,
)
from ingest.store import Store

PODS = ["pm-a", "pm-b", "pm-c"]


def _events(store: Store, seed: int, span_s: float = 600.0) -> None:
    """Each pod sends 40 KV batches at random times over ``span_s`` seconds (minutes apart and in bursts: a pod
    silent for minutes, two batches in one millisecond's neighbourhood), stores and clears."""
    rnd = random.Random(seed)
    msgs = []
    for p, pod in enumerate(PODS):
        times = sorted(rnd.uniform(0, span_s) if rnd.random() < 0.7 else rnd.uniform(0, span_s / 6) for _ in range(40))
        for seq, t in enumerate(times, start=1):
            event = CLEARED if rnd.random() < 0.1 else stored([seed * 10_000 + p * 1_000 + seq], seq * 32)
            msgs.append(frames(pod, seq, t, event))
    ingest(store, collect(msgs))


def _covered(first: pl.DataFrame, queries: pl.DataFrame) -> list[bool]:
    return seen_between(queries, first, ["pod"], "since", "t").to_list()


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("lookback_s", [60, 120, 300])
def test_coverage_from_the_minutes_equals_coverage_from_the_log(store: Store, seed: int, lookback_s: int) -> None:
    """Windows (lo, until) anywhere over the events, arrivals t in each (at whole minutes, bucket edges, next to
    each event's ms and at random): per pod, whether a log row lies in [t − lookback, t] is the same from
    kv_pod_minutes as from the log, and the rollup's spans hold each minute's first and last row exactly."""
    _events(store, seed)
    lookback = lookback_s * 1000
    log_ms = [r[0] for r in store.query_rows("SELECT DISTINCT toUnixTimestamp64Milli(ts) FROM kv_block_log")]
    assert len(log_ms) > 50
    rnd = random.Random(seed)
    start, end = min(log_ms), max(log_ms)
    checked = 0
    for _ in range(12):
        lo = rnd.randint(start - 90_000, end)
        until = lo + rnd.randint(0, 240_000)
        params = {"lo": at(0) + timedelta(milliseconds=lo - int(at(0).timestamp() * 1000)),
                  "until": at(0) + timedelta(milliseconds=until - int(at(0).timestamp() * 1000)), "lookback": lookback}
        rollup, log = fetch_first_events(store, params), fetch_first_events_from_log(store, params)
        near = [x + d for x in log_ms if lo - lookback <= x <= until + lookback for d in (-1, 0, 1)]
        edges = [m - m % 60_000 + d for m in range(lo, until + 1, 60_000) for d in (-1, 0, 1)]
        ts = sorted({t for t in [*near, *edges, *(rnd.randint(lo, until) for _ in range(50))] if lo <= t <= until})
        for t_end in (0, 30_000):  # until = the arrival, or a request's end after it, within the window
            within = [t for t in ts if t + t_end <= until]
            if not within:
                continue
            queries = pl.DataFrame({"pod": [p for p in PODS for _ in within],
                                    "since": [t - lookback for _ in PODS for t in within],
                                    "t": [t + t_end for _ in PODS for t in within]})
            assert _covered(rollup, queries) == _covered(log, queries)
            checked += len(queries)
    assert checked > 500
    # and the rows themselves: per pod and minute, the log's first and last row
    assert store.query_rows(
        "SELECT pod, minute, toUnixTimestamp64Milli(min(first)), toUnixTimestamp64Milli(max(last)) FROM kv_pod_minutes "
        "GROUP BY pod, minute ORDER BY pod, minute") == store.query_rows(
        "SELECT pod, toStartOfMinute(ts) AS minute, toUnixTimestamp64Milli(min(ts)), toUnixTimestamp64Milli(max(ts)) "
        "FROM kv_block_log GROUP BY pod, minute ORDER BY pod, minute")


def test_a_lookback_of_no_whole_minutes_reads_the_log(store: Store) -> None:
    """A lookback of 90.5 s does not nest minutes in its buckets: the spans come from the log's rows in the window,
    exactly (the first row of a pod's bucket is its first row in the window, not of its minute)."""
    _events(store, 3)
    lo_ms = store.query_rows("SELECT toUnixTimestamp64Milli(quantileExact(0.5)(ts)) FROM kv_block_log")[0][0]
    base = int(at(0).timestamp() * 1000)
    params = {"lo": at(0) + timedelta(milliseconds=lo_ms - base), "until": at(0) + timedelta(seconds=900),
              "lookback": 90_500}
    assert fetch_first_events(store, params).sort("pod", "first").equals(
        fetch_first_events_from_log(store, params).sort("pod", "first"))
    first = store.query_rows(
        "SELECT toUnixTimestamp64Milli(min(ts)) FROM kv_block_log "
        "WHERE ts >= fromUnixTimestamp64Milli({x:Int64}, 'UTC')",
        {"x": lo_ms - 90_500})[0][0]
    assert fetch_first_events(store, params)["first"].min() == first


def test_events_stored_before_the_migration_are_rolled_up_once(store: Store) -> None:
    """A store whose log was filled before migration 0050: the migration fills kv_pod_minutes from the log once,
    and the view keeps it up to date after."""
    _events(store, 4, span_s=300)
    expected = store.query_rows("SELECT pod, minute, min(first), max(last) FROM kv_pod_minutes GROUP BY pod, minute "
                                "ORDER BY pod, minute")
    assert expected
    store.command("TRUNCATE TABLE kv_pod_minutes")
    version = [v for (v,) in store.query_rows("SELECT version FROM schema_migrations") if v.startswith("0050")]
    assert version
    store.command(f"DELETE FROM schema_migrations WHERE version = '{version[0]}'")
    assert store.migrate() == version
    assert store.query_rows("SELECT pod, minute, min(first), max(last) FROM kv_pod_minutes GROUP BY pod, minute "
                            "ORDER BY pod, minute") == expected
    assert store.migrate() == []
    _events(store, 5, span_s=300)  # more events: the view adds their minutes
    assert store.query_rows("SELECT count() FROM (SELECT pod, minute FROM kv_pod_minutes GROUP BY pod, minute)") \
        == store.query_rows("SELECT count() FROM (SELECT pod, toStartOfMinute(ts) FROM kv_block_log GROUP BY 1, 2)")


@pytest.mark.parametrize("lookback_s", [60, 180])
def test_served_pods_from_the_minutes_equal_those_from_the_requests(store: Store, lookback_s: int) -> None:
    """model_pod_minutes: per (model, pod), whether the gateway logged a request in [since, end] (a pod counts as a
    holder elsewhere only when it served the request's model in its lookback and by its end) is the same from the
    rollup as from gateway_requests, and a lookback of no whole minutes reads the requests."""
    rnd = random.Random(lookback_s)
    models, base = ["m-1", "m-2"], int(at(0).timestamp() * 1000)
    rows = [(f"q{i}", at(0) + timedelta(milliseconds=ms), rnd.choice(models), rnd.choice(PODS))
            for i, ms in enumerate(sorted(rnd.randint(0, 600_000) for _ in range(300)))]
    store.insert("gateway_requests", rows, ["request_id", "ts", "model", "pod"])
    lookback = lookback_s * 1000
    pairs = [(m, p) for m in models for p in PODS]
    for _ in range(10):
        lo = rnd.randint(-60_000, 600_000)
        until = lo + rnd.randint(0, 200_000)
        params = {"lo": at(0) + timedelta(milliseconds=lo), "until": at(0) + timedelta(milliseconds=until),
                  "lookback": lookback}
        rollup, log = fetch_model_pods(store, params), fetch_model_pods_from_log(store, params)
        times = sorted({t for t in [*(int((r[1] - at(0)).total_seconds() * 1000) + d for r in rows for d in (-1, 0, 1)),
                                    *(m - m % 60_000 + d for m in range(lo, until + 1, 60_000) for d in (-1, 0, 1))]
                        if lo <= t <= until})
        for t_end in (0, 45_000):
            within = [t for t in times if t + t_end <= until]
            if not within:
                continue
            queries = pl.DataFrame({"model": [m for m, _ in pairs for _ in within],
                                    "pod": [p for _, p in pairs for _ in within],
                                    "since": [base + t - lookback for _ in pairs for t in within],
                                    "end": [base + t + t_end for _ in pairs for t in within]})
            assert (seen_between(queries, rollup, ["model", "pod"], "since", "end").to_list()
                    == seen_between(queries, log, ["model", "pod"], "since", "end").to_list())
    odd = {"lo": at(0) + timedelta(seconds=200), "until": at(0) + timedelta(seconds=500), "lookback": 61_500}
    assert fetch_model_pods(store, odd).sort("model", "pod", "first").equals(
        fetch_model_pods_from_log(store, odd).sort("model", "pod", "first"))
