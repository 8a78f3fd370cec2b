"""What data that arrives late may change among the answered requests (precise mode), for the attribution job
(:mod:`ingest.attribution_job`) to judge again: exact target sets, bounded by what the late rows can reach, so that a
replayed collector outage does not re-examine a lookback (7 days) of a model's requests.

A request arriving at t and ending at e (t + e2e, at most :data:`ingest.kv_evidence.MAX_END_MS` later) is judged by
(docs/miss-causes.md, "Precise mode"): the KV events of the blocks its logged chain names, in [t − lookback, e]; the
pods whose KV events cover it (a kv_block_log row in [t − lookback, t]: its own pod decides whether it is judged with
KV evidence, its predecessor's whether an inferred cause is read as cold); the pods that served its model (a gateway
row in [t − lookback, e]: the holders for routed_away). So a late row at x reaches only the requests with
t ∈ [x − MAX_END_MS, x + lookback], and among them:
- a late block event, only those whose chain names its block (or, for a late cache reset, a block its pod stored
  in the lookback before it) that had not ended before it (a request sees the events up to its own end) and were
  answered before it was ingested;
- a late event of a pod, for its coverage, only those of that pod (or with a predecessor on it) whose window held
  no other event of the pod that had reached the store by their answer;
- a late gateway row of a pod and model, only the requests of that model whose window held no other row of the
  pod and model, and whose chain names a block the pod stored.

A publisher_restart gap report (its own Kafka topic, which can lag the batches) or a replayed batch can add, move or
remove a restart that kv_cache_resets reads from the gap reports (:func:`gap_restarts`), without any late
kv_block_events row; each such restart re-answers what a late reset would (:func:`reset_targets`).

A late row that moves a pod's block size at times already answered (a vllm_cache_config row, or a BlockStored of a
new size, with or without KV evidence) re-answers the pod's requests that arrived where the size now reads otherwise
(:func:`size_targets`, against the change points the job last judged with: :func:`ingest.block_sizes.saved`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl

from ingest.kv_evidence import ANY_RESTART_GAP, MAX_END_MS, SPANS, epoch_ms, own_hashing_pods
from ingest.store import Store

#: A request that arrived this long before a late KV event may still have been waiting for its prefill then.
LATE_KV_SLACK = timedelta(milliseconds=MAX_END_MS)
_KEYS = {"request_id": pl.String, "ts": pl.Datetime("ms", "UTC")}
#: The rows ingested in the run's window (since, upto].
INGESTED_WINDOW = "ingested_at > {since:DateTime64(3, 'UTC')} AND ingested_at <= {upto:DateTime64(3, 'UTC')}"
_LATE = f"{INGESTED_WINDOW} AND dateDiff('millisecond', ts, ingested_at) > {{settle_ms:Int64}}"
#: A gateway row's end (unix ms, rounded up): its arrival plus e2e_ms, an unknown or negative e2e read as 0, at most
#: MAX_END_MS, as the evidence reads it (ingest/kv_evidence.py); the events after it do not change its answer.
_END_SQL = (f"toUnixTimestamp64Milli(ts) + toInt64(ceil(least(greatest(if(isNaN(ifNull(e2e_ms, 0)), 0, "
            f"ifNull(e2e_ms, 0)), 0), {MAX_END_MS})))")
#: The requests judged in precise mode (they logged a block chain).
_CHAINED = "prompt_block_size > 0 AND notEmpty(prompt_block_hashes)"
#: The requests with an answer given before ``arrived`` (the late rows' ingestion): a later one saw them.
_ANSWERED_BEFORE = """(request_id, ts) IN (SELECT request_id, ts FROM request_attribution
    WHERE ts >= {lo:DateTime64(3, 'UTC')} AND ts <= {hi:DateTime64(3, 'UTC')}
    GROUP BY request_id, ts HAVING sum(sign) > 0 AND max(attributed_at) < {arrived:DateTime64(3, 'UTC')})"""


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The closed intervals ``spans`` (unix ms) as sorted, disjoint ones."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _minus(spans: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The times of ``spans`` not in ``cut`` (closed intervals, unix ms), as sorted disjoint intervals."""
    out = []
    cut = _merge(cut)
    for lo, hi in _merge(spans):
        for c_lo, c_hi in cut:
            if c_hi < lo or c_lo > hi:
                continue
            if c_lo > lo:
                out.append((lo, c_lo - 1))
            lo = c_hi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return out


def _cover(frame: pl.DataFrame, before_ms: int, after_ms: int) -> dict[tuple[str, ...], list[tuple[int, int]]]:
    """Per name (the columns before ``first``) of span rows (:data:`SPANS`), the times t whose
    [t − ``after_ms``, t + ``before_ms``] holds one of its times: the union of [first − before, last + after]."""
    names = [c for c in frame.columns if c not in ("first", "last")]
    out: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for row in frame.iter_rows(named=True):
        out.setdefault(tuple(str(row[c]) for c in names), []).append(
            (int(row["first"]) - before_ms, int(row["last"]) + after_ms))
    return out


#: How far before the late rows the pods' latest other row is looked for first (:func:`_old_cover`): live, a pod's
#: rows come seconds apart, so the lookback (days) is read only for a pod idle that long.
PROBE = timedelta(hours=1)


def _old_cover(store: Store, table: str, names: list[str], where: str, params: dict[str, Any], start_ms: int,
               cap_ms: int, lookback_ms: int, expected: int) -> dict[tuple[str, ...], list[tuple[int, int]]]:
    """Per name (``names``: columns of ``table``, cast to String) of the rows of ``table`` that ``where`` selects, the
    times in [``start_ms``, ``cap_ms``] that one of them covers (a row at s covers [s, s + lookback]), as intervals
    (:func:`_cover`). Of the rows before ``start_ms`` only the latest counts: it is looked for within :data:`PROBE`
    first, and within the lookback only when some of the ``expected`` names has none there. Then the spans of the
    rows in (start, cap] (bucketed by :data:`SPANS`): a short range live, where the late rows are recent."""
    cols = ", ".join(f"CAST({c} AS String) AS {c}" for c in names)
    group = ", ".join(names)
    latest = ("SELECT {cols}, toUnixTimestamp64Milli(max(ts)) AS first, first AS last FROM {table} WHERE {where} "
              "AND ts >= {{b_lo:DateTime64(3, 'UTC')}} AND ts <= {{b_hi:DateTime64(3, 'UTC')}} GROUP BY {group}")
    query = latest.format(cols=cols, table=table, where=where, group=group)
    before = store.query_df(query, {**params, "b_lo": _at(start_ms) - PROBE, "b_hi": _at(start_ms)})
    if len(before) < expected and lookback_ms > PROBE.total_seconds() * 1000:
        before = store.query_df(query, {**params, "b_lo": _at(start_ms - lookback_ms), "b_hi": _at(start_ms)})
    after = store.query_df(
        f"SELECT {cols}, {SPANS[0]} FROM {table} WHERE {where} AND ts > {{b_lo:DateTime64(3, 'UTC')}} "
        f"AND ts <= {{b_hi:DateTime64(3, 'UTC')}} GROUP BY {group}, {SPANS[1]}",
        {**params, "b_lo": _at(start_ms), "b_hi": _at(cap_ms)}) if cap_ms > start_ms else before.clear()
    return _cover(pl.concat([before.select(*names, "first", "last"), after.select(*names, "first", "last")],
                            how="vertical_relaxed"), 0, lookback_ms)


def _clip(spans: list[tuple[int, int]], cap_ms: int) -> list[tuple[int, int]]:
    return [(lo, min(hi, cap_ms)) for lo, hi in spans if lo <= cap_ms]


def _ranges(gained: dict[tuple[str, ...], list[tuple[int, int]]]) -> dict[str, list[Any]]:
    """``gained`` (name → intervals) as parallel parameter arrays: names (the first column), lo, hi (unix ms)."""
    flat = [(name[0], lo, hi) for name, spans in gained.items() for lo, hi in spans]
    return {"names": [f[0] for f in flat], "los": [f[1] for f in flat], "his": [f[2] for f in flat]}


def late_kv_targets(store: Store, since: datetime, upto: datetime, settle_seconds: float, lookback_ms: int,
                    answered_through: datetime | None) -> pl.DataFrame:
    """The answered requests (columns request_id, ts) that KV events ingested late may change.

    Late: ingested in (since, upto] more than ``settle_seconds`` after their own ts (a collector outage, a replayed
    gap). One query (by kv_block_events' ``ingested_at`` index) when none is: the common case. Else the requests
    that logged a chain (the others are judged without KV events) with t in [x − LATE_KV_SLACK, x + lookback] for a
    late event at x and (module docstring) a chain naming a late event's block, or a block a late reset's pod stored
    in the lookback before it, with an end (t + e2e) at or after x and an answer given before that event was
    ingested (one given later saw it); or, on a pod the late events first cover at t
    (no other event of it in [t − lookback, t]), that pod as their own or their predecessor's
    (request_attribution.predecessor_pod)."""
    params = {"since": since, "upto": upto, "settle_ms": int(settle_seconds * 1000), "lookback": lookback_ms}
    late = store.query_df(f"SELECT CAST(pod AS String) AS pod, {SPANS[0]}, max(ingested_at) AS arrived "
                          f"FROM kv_block_events WHERE {_LATE} GROUP BY pod, {SPANS[1]}", params)
    if late.is_empty() or answered_through is None:
        return pl.DataFrame(schema=_KEYS)
    lo, hi = int(late["first"].min()), int(late["last"].max())
    cap = min(hi + lookback_ms, epoch_ms(answered_through))  # no answer is later
    params |= {"arrived": late["arrived"].max(), "lo": _at(lo - MAX_END_MS), "hi": _at(cap),
               "pods": late["pod"].unique().to_list(), "from": _at(lo - lookback_ms), "first": _at(lo), "to": _at(hi),
               "own_pods": own_hashing_pods(store)}
    by_block = store.query_df(
        f"""
        WITH
            late AS (SELECT pod, ts, block_hashes, ingested_at FROM kv_block_events WHERE {_LATE}),
            resets AS
            (
                SELECT pod, min(ts) AS first, max(ts) AS last, max(ingested_at) AS arrived FROM late
                WHERE (pod, ts) IN (SELECT pod, ts FROM kv_block_log
                                    WHERE kind IN ('cleared', 'restart') AND pod IN {{pods:Array(String)}}
                                      AND ts >= {{first:DateTime64(3, 'UTC')}} AND ts <= {{to:DateTime64(3, 'UTC')}})
                GROUP BY pod
            ),
            late_blocks AS
            (
                SELECT pod, arrayJoin(block_hashes) AS bh, ts AS x, ingested_at AS arrived FROM late
            ),
            named AS
            (
                SELECT h, x, max(arrived) AS arrived FROM
                (
                    SELECT bh AS h, x, arrived FROM late_blocks
                    UNION ALL
                    SELECT l.chain_hash AS h, b.x AS x, b.arrived AS arrived FROM kv_block_log AS l
                    INNER JOIN late_blocks AS b ON l.pod = b.pod AND l.block_hash = b.bh
                    WHERE l.kind = 'stored' AND l.pod IN {{own_pods:Array(String)}}
                      AND l.ts >= {{from:DateTime64(3, 'UTC')}} AND l.ts <= {{to:DateTime64(3, 'UTC')}}
                    UNION ALL
                    SELECT arrayJoin([l.chain_hash, l.block_hash]) AS h, r.first AS x, r.arrived AS arrived
                    FROM kv_block_log AS l
                    INNER JOIN resets AS r ON l.pod = r.pod
                    WHERE l.kind = 'stored' AND l.pod IN (SELECT pod FROM resets)
                      AND l.ts >= {{from:DateTime64(3, 'UTC')}} AND l.ts <= {{to:DateTime64(3, 'UTC')}}
                      AND l.ts >= r.first - toIntervalMillisecond({{lookback:Int64}}) AND l.ts <= r.last
                )
                GROUP BY h, x
            ),
            answered AS
            (
                SELECT request_id, ts, max(attributed_at) AS answered_at FROM request_attribution
                WHERE ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}}
                GROUP BY request_id, ts HAVING sum(sign) > 0 AND answered_at < {{arrived:DateTime64(3, 'UTC')}}
            )
        SELECT DISTINCT g.request_id AS request_id, g.ts AS ts FROM
        (
            SELECT request_id, ts, {_END_SQL} AS end, h FROM gateway_requests ARRAY JOIN prompt_block_hashes AS h
            WHERE ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}} AND {_CHAINED}
              AND h IN (SELECT h FROM named) AND (request_id, ts) IN (SELECT request_id, ts FROM answered)
        ) AS g
        INNER JOIN named AS n ON g.h = n.h
        INNER JOIN answered AS a ON g.request_id = a.request_id AND g.ts = a.ts
        WHERE g.end >= toUnixTimestamp64Milli(n.x) AND a.answered_at < n.arrived
        """, params)
    # coverage: the times the late events cover that the pods' other events (those ingested in time, or before
    # this window) do not
    old = _old_cover(store, "kv_block_events", ["pod"], "pod IN {pods:Array(String)} AND ingested_at <= "
                     f"{{upto:DateTime64(3, 'UTC')}} AND NOT ({_LATE})", params, lo, cap, lookback_ms,
                     late["pod"].n_unique())
    gained = {pod: _minus(_clip(spans, cap), old.get(pod, []))
              for pod, spans in _cover(late.drop("arrived"), 0, lookback_ms).items()}
    by_pod = pl.DataFrame(schema=_KEYS)
    if any(gained.values()):
        by_pod = _unseen_cover(store, gained, lookback_ms, params, store.query_df(
            f"""
            SELECT request_id, ts, max(attributed_at) AS answered_at,
                   arrayDistinct(arrayConcat(groupUniqArray(CAST(pod AS String)),
                                             groupUniqArray(CAST(predecessor_pod AS String)))) AS pods
            FROM request_attribution
            WHERE ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}}
              AND arrayExists((p, a, b) -> (pod = p OR predecessor_pod = p) AND toUnixTimestamp64Milli(ts) >= a
                                           AND toUnixTimestamp64Milli(ts) <= b,
                              {{names:Array(String)}}, {{los:Array(Int64)}}, {{his:Array(Int64)}})
              AND (request_id, ts) IN (SELECT request_id, ts FROM gateway_requests
                                       WHERE ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}}
                                         AND {_CHAINED})
            GROUP BY request_id, ts HAVING sum(sign) > 0 AND max(attributed_at) < {{arrived:DateTime64(3, 'UTC')}}
            """, {**params, **_ranges(gained)}))
    return _keys(by_block, by_pod)


def _unseen_cover(store: Store, gained: dict[tuple[str, ...], list[tuple[int, int]]], lookback_ms: int,
                  params: dict[str, Any], candidates: pl.DataFrame) -> pl.DataFrame:
    """The ``candidates`` (columns request_id, ts, answered_at, pods: the request's pod and predecessor pods) whose
    answer did not see the coverage the late events give: for some pod p of theirs with ts in ``gained[p]``, no late
    event of p in [t − lookback, t] was ingested by the answer's time. An answer given after such an event saw it
    (a final run at shutdown, settle 0, counts every event of its window late: the answers of its window saw most of
    them). Columns request_id, ts."""
    if candidates.is_empty():
        return candidates.select(*_KEYS)
    pods = sorted({name[0] for name, spans in gained.items() if spans})
    events = store.query_df(
        f"SELECT CAST(pod AS String) AS pod, toUnixTimestamp64Milli(ts) AS e_ts, ingested_at FROM kv_block_events "
        f"WHERE {_LATE} AND pod IN {{gained_pods:Array(String)}} ORDER BY e_ts", {**params, "gained_pods": pods})
    rows = (candidates.explode("pods").rename({"pods": "pod"}).filter(pl.col("pod").is_in(pods))
            .with_columns(pl.col("ts").dt.epoch("ms").alias("t")))
    inside = [any(lo <= t <= hi for lo, hi in gained.get((pod,), [])) for pod, t in zip(rows["pod"], rows["t"],
                                                                                         strict=True)]
    rows = rows.filter(pl.Series(inside, dtype=pl.Boolean))
    unseen = []
    for (answered_at,), part in rows.partition_by("answered_at", as_dict=True).items():
        seen = events.filter(pl.col("ingested_at") <= answered_at).select("pod", "e_ts")
        part = part.sort("t").join_asof(seen.sort("e_ts"), left_on="t", right_on="e_ts", by="pod",
                                        strategy="backward", check_sortedness=False)
        unseen.append(part.filter(pl.col("e_ts").is_null() | (pl.col("e_ts") < pl.col("t") - lookback_ms)))
    if not unseen:
        return candidates.clear().select(*_KEYS)
    return pl.concat(unseen).select(*_KEYS).unique()


def new_holder_targets(store: Store, late: pl.DataFrame, since: datetime, lookback_ms: int,
                       answered_through: datetime, answered_before: datetime) -> pl.DataFrame:
    """The answered requests (columns request_id, ts) whose holders the gateway rows ``late`` (columns ts, model,
    pod: arrivals older than some answered request) may add a pod to: a pod is a holder for a request of its model
    at t when it served the model in [t − lookback, end] (end ≤ t + MAX_END_MS). For each (model, pod) of ``late``,
    the requests of the model that logged a chain with t in [s − MAX_END_MS, s + lookback] for a late row at s, that
    no row of the pair the answers saw covers (in [t − lookback, t]), and whose chain names a block the pod
    stored (in [t − lookback, t + MAX_END_MS]): a pod with no such block is no holder for them; answered before
    ``answered_before`` (a later answer saw the rows), by ``answered_through`` (the latest answer's ts). The rows
    that cover a request already are those ingested by ``since`` or answered before ``answered_before`` (the run's
    start): live, every row of the pair but the run's own arrivals. Two short
    queries when every pair served its model within :data:`PROBE` before (live: nothing to re-examine)."""
    spans = (late.group_by(pl.col("model").cast(pl.String), pl.col("pod").cast(pl.String))
             .agg(pl.col("ts").min().alias("lo"), pl.col("ts").max().alias("hi")))
    if spans.is_empty():
        return pl.DataFrame(schema=_KEYS)
    lo, hi = epoch_ms(spans["lo"].min()), epoch_ms(spans["hi"].max())
    cap = min(hi + lookback_ms, epoch_ms(answered_through))  # no answer is later
    params = {"models": spans["model"].to_list(), "pods": spans["pod"].to_list(), "since": since,
              "lookback": lookback_ms}
    # the rows the answers saw: ingested before the run's window, or answered before this run (one answered since
    # it was visible: either an answer given after it saw it, or it arrived later and, a late row then, re-examined
    # the answers it changed); live, all but the run's own arrivals
    params["answered_before"] = answered_before
    old = _old_cover(store, "gateway_requests", ["model", "pod"], "model IN {models:Array(String)} AND pod IN "
                     "{pods:Array(String)} AND (ingested_at <= {since:DateTime64(3, 'UTC')} OR (request_id, ts) IN "
                     "(SELECT request_id, ts FROM request_attribution WHERE ts >= {b_lo:DateTime64(3, 'UTC')} AND "
                     "ts <= {b_hi:DateTime64(3, 'UTC')} AND attributed_at < {answered_before:DateTime64(3, 'UTC')}))",
                     params, lo - MAX_END_MS, cap, lookback_ms, len(spans))
    t = pl.col("ts").dt.epoch("ms")
    rows = (late.group_by(pl.col("model").cast(pl.String), pl.col("pod").cast(pl.String), t // max(1, lookback_ms))
            .agg(t.min().alias("first"), t.max().alias("last")).drop("ts"))
    gained = {pair: _minus(_clip(s, cap), old.get(pair, []))
              for pair, s in _cover(rows, MAX_END_MS, lookback_ms).items()}
    flat = [(m, p, a, b) for (m, p), s in gained.items() for a, b in s]
    if not flat:
        return pl.DataFrame(schema=_KEYS)
    first, last = min(f[2] for f in flat), max(f[3] for f in flat)
    return _keys(store.query_df(
        f"""
        WITH held AS
        (
            SELECT DISTINCT arrayJoin([chain_hash, block_hash]) AS h FROM kv_block_log
            WHERE kind = 'stored' AND pod IN {{pods:Array(String)}}
              AND ts >= {{from:DateTime64(3, 'UTC')}} AND ts <= {{to:DateTime64(3, 'UTC')}}
        )
        SELECT DISTINCT request_id, ts FROM gateway_requests ARRAY JOIN prompt_block_hashes AS h
        WHERE ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}} AND {_CHAINED}
          AND arrayExists((m, a, b) -> model = m AND toUnixTimestamp64Milli(ts) >= a
                                       AND toUnixTimestamp64Milli(ts) <= b,
                          {{models:Array(String)}}, {{los:Array(Int64)}}, {{his:Array(Int64)}})
          AND h IN (SELECT h FROM held) AND {_ANSWERED_BEFORE}
        """, {"arrived": answered_before, "pods": sorted({f[1] for f in flat}), "from": _at(first - lookback_ms),
              "to": _at(last + MAX_END_MS), "lo": _at(first), "hi": _at(last),
              "models": [f[0] for f in flat], "los": [f[2] for f in flat], "his": [f[3] for f in flat]}))


def _keys(*frames: pl.DataFrame) -> pl.DataFrame:
    """The distinct (request_id, ts) of ``frames``, ts as UTC milliseconds."""
    parts = [f.select(pl.col("request_id").cast(pl.String), pl.col("ts").cast(pl.Datetime("ms", "UTC")))
             for f in frames if not f.is_empty()]
    return pl.concat(parts).unique() if parts else pl.DataFrame(schema=_KEYS)


def size_targets(store: Store, changed: list[tuple[str, int, int]], now: datetime) -> pl.DataFrame:
    """The answered requests (columns request_id, ts) of each (pod, lo, hi) of ``changed``
    (:func:`ingest.block_sizes.differences`: where the pod's block size now reads otherwise than when they were
    answered) that arrived in [lo, hi) (unix ms): a late vllm_cache_config row or a late BlockStored of a new size
    re-answers exactly these. One query; none when nothing changed."""
    if not changed:
        return pl.DataFrame(schema=_KEYS)
    found = store.query_df(
        """
        SELECT request_id, ts FROM request_attribution
        WHERE pod IN {names:Array(String)}
          AND arrayExists((p, a, b) -> pod = p AND toUnixTimestamp64Milli(ts) >= a AND toUnixTimestamp64Milli(ts) < b,
                          {names:Array(String)}, {los:Array(Int64)}, {his:Array(Int64)})
        GROUP BY request_id, ts HAVING sum(sign) > 0 AND max(attributed_at) < {now:DateTime64(3, 'UTC')}
        """, {"names": [c[0] for c in changed], "los": [c[1] for c in changed], "his": [c[2] for c in changed],
              "now": now.replace(microsecond=now.microsecond // 1000 * 1000)})  # answers store whole ms
    return _keys(found)


#: :func:`gap_restarts`' columns (ts: unix ms).
GAP_RESTARTS_SCHEMA: dict[str, pl.DataType] = {"pod": pl.String(), "engine": pl.String(), "ts": pl.Int64(),
                                               "seq": pl.UInt64()}


def gap_restarts(store: Store) -> pl.DataFrame:
    """The vLLM restarts kv_cache_resets reads from ``publisher_restart`` gap reports (its second and third sources,
    sql/migrations/0030: the first batch stored from the new process), not the log's own reset rows
    (:data:`GAP_RESTARTS_SCHEMA`, sorted). One short query when kv_event_gaps holds no such report (the common case);
    else the view once (about half a second to plan). Raises what :meth:`ingest.store.Store.query_df` raises."""
    if not store.query_rows(ANY_RESTART_GAP)[0][0]:
        return pl.DataFrame(schema=GAP_RESTARTS_SCHEMA)
    rows = store.query_df(
        "SELECT DISTINCT pod, engine, toUnixTimestamp64Milli(ts) AS ts_ms, seq FROM kv_cache_resets "
        "WHERE kind = 'restart' AND (pod, engine, ts, seq) NOT IN (SELECT CAST(pod AS String), CAST(engine AS String), "
        "ts, seq FROM kv_block_log WHERE kind = 'restart')").rename({"ts_ms": "ts"})
    return rows.select(*(pl.col(c).cast(t) for c, t in GAP_RESTARTS_SCHEMA.items())).sort(list(GAP_RESTARTS_SCHEMA))


def changed_restarts(old: pl.DataFrame, new: pl.DataFrame) -> pl.DataFrame:
    """The restarts (:data:`GAP_RESTARTS_SCHEMA`) in exactly one of ``old`` and ``new``: added, moved (both its
    times) or removed."""
    cols = list(GAP_RESTARTS_SCHEMA)
    both = pl.concat([old.select(cols).unique(), new.select(cols).unique()])
    return both.group_by(cols).len().filter(pl.col("len") == 1).select(cols).sort(cols)


def reset_targets(store: Store, resets: pl.DataFrame, lookback_ms: int, answered_before: datetime) -> pl.DataFrame:
    """The answered requests (columns request_id, ts) that a cache reset of each row of ``resets`` (columns pod, ts:
    unix ms) can change, whether it was added or taken away: those that logged a chain naming a block (by chain or
    vLLM hash) the pod stored from the reset's ts − lookback − :data:`MAX_END_MS` (the earliest lookback of a
    request still waiting then) up to the reset, that arrived at most the lookback after it and had not ended before
    it (a request sees the events up to its end), answered before ``answered_before``. One query; none when
    ``resets`` is empty."""
    if resets.is_empty():
        return pl.DataFrame(schema=_KEYS)
    pods, xs = resets["pod"].cast(pl.String).to_list(), resets["ts"].cast(pl.Int64).to_list()
    lo, hi = min(xs), max(xs)
    return _keys(store.query_df(
        f"""
        WITH
            resets AS
            (
                SELECT tupleElement(r, 1) AS pod, tupleElement(r, 2) AS x
                FROM (SELECT arrayJoin(arrayZip({{pods:Array(String)}}, {{xs:Array(Int64)}})) AS r)
            ),
            named AS
            (
                SELECT DISTINCT arrayJoin([l.chain_hash, l.block_hash]) AS h, r.x AS x
                FROM kv_block_log AS l INNER JOIN resets AS r ON CAST(l.pod AS String) = r.pod
                WHERE l.kind = 'stored' AND l.pod IN {{pods:Array(String)}}
                  AND l.ts >= {{from:DateTime64(3, 'UTC')}} AND l.ts <= {{to:DateTime64(3, 'UTC')}}
                  AND toUnixTimestamp64Milli(l.ts) >= r.x - {{reach:Int64}} AND toUnixTimestamp64Milli(l.ts) <= r.x
            )
        SELECT DISTINCT request_id, ts FROM
        (
            SELECT request_id, ts, {_END_SQL} AS end, h FROM gateway_requests ARRAY JOIN prompt_block_hashes AS h
            WHERE ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}} AND {_CHAINED}
              AND h IN (SELECT h FROM named) AND {_ANSWERED_BEFORE}
        ) AS g
        INNER JOIN named AS n ON g.h = n.h
        WHERE g.end >= n.x AND toUnixTimestamp64Milli(g.ts) <= n.x + {{lookback:Int64}}
        """, {"pods": pods, "xs": xs, "reach": lookback_ms + MAX_END_MS, "lookback": lookback_ms,
              "from": _at(lo - lookback_ms - MAX_END_MS), "to": _at(hi), "lo": _at(lo - MAX_END_MS),
              "hi": _at(hi + lookback_ms), "arrived": answered_before}))
