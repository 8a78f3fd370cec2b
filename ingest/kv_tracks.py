"""Precise mode's block statuses computed column-wise (polars as-of joins): the same answers as the readable
reference :class:`ingest.kv_evidence.KvTimeline` / :func:`ingest.kv_evidence.request_evidence` (a test compares
both on generated histories), for a whole chunk of requests at once.

Residency rules: see :mod:`ingest.kv_evidence` (sql/migrations/0017 kv_block_residency). A *track* is one
(pod, engine, medium, vLLM block hash) with a chain hash; its events are cut into *segments* by the resets of
its pod and engine (segment 0 before the first, segment k from the k-th, in (ts, seq, idx, pos) order, a reset
before the blocks of its own batch). In a segment a track holds ``init + running sum`` copies, ``init`` being the
copies stored before the evidence (minus the lowest running sum). A *departure* is the event after which its last
copy is gone: a removal that takes the copies to 0, or a reset that ends a segment with copies > 0.

The state of a track just before ``t`` (events at ``t`` have not happened yet) is then three as-of joins:
its last event before ``t`` (its copies, if in the segment of ``t``), the last reset of its pod and engine before
``t`` (the segment of ``t``, whose ``init`` holds when the track has no event in it before ``t``), its last
departure before ``t``; and, for the evicted-while-waiting rule, its first departure at or after ``t``. Ties of
departures at the same millisecond on several tracks: the latest (ts, kind) wins (as in the reference).

Memory: the rows read for the chunk (events of the blocks its requests missed) plus one row per (request block,
track holding that chain hash).
"""

from __future__ import annotations

import polars as pl

from ingest.attribution import NOWHERE, REMOVED_HERE, RESET_HERE, RESIDENT_ELSEWHERE, RESIDENT_HERE

#: Columns of the block rows (kv_block_log rows, ts in unix ms; ``chain`` 0 on removed rows, ignored there).
BLOCK_COLUMNS = ("pod", "engine", "medium", "block_hash", "chain", "ts", "seq", "idx", "pos", "kind")
#: Columns of the reset rows (kv_cache_resets, ts in unix ms; kind 'cleared' or anything else = a restart).
RESET_COLUMNS = ("pod", "engine", "ts", "seq", "idx", "kind")
_ORDER = ["ts", "seq", "idx", "flag", "pos"]  # a reset (flag 0) sorts before the blocks of its own batch
_KEY = ["pod", "engine", "medium", "block_hash"]


def _tracks(blocks: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(tracks: track, chain, pod, engine; events: track, pod, engine, ts, seq, idx, pos, flag 1, delta ±1).
    A track's chain is that of its last stored row with a chain (row order), as in the reference."""
    rows = blocks.with_row_index("row")
    named = (rows.filter((pl.col("kind") == "stored") & (pl.col("chain") != 0))
             .group_by(_KEY).agg(pl.col("chain").cast(pl.UInt64).sort_by("row").last())
             .sort(_KEY).with_row_index("track"))
    events = (rows.join(named.select(*_KEY, "track"), on=_KEY, how="inner")
              .select("track", "pod", "engine", pl.col("ts").cast(pl.Int64), pl.col("seq").cast(pl.Int64),
                      pl.col("idx").cast(pl.Int64), pl.col("pos").cast(pl.Int64), pl.lit(1, pl.Int8).alias("flag"),
                      pl.when(pl.col("kind") == "stored").then(1).otherwise(-1).cast(pl.Int64).alias("delta")))
    return named.select("track", "chain", "pod", "engine"), events


def _resets(resets: pl.DataFrame) -> pl.DataFrame:
    """Resets numbered per pod and engine: seg (1, 2, ...) in order, with kind 'cleared' / 'restart'."""
    return (resets.select("pod", "engine", pl.col("ts").cast(pl.Int64), pl.col("seq").cast(pl.Int64),
                          pl.col("idx").cast(pl.Int64), pl.lit(0, pl.Int64).alias("pos"),
                          pl.lit(0, pl.Int8).alias("flag"),
                          pl.when(pl.col("kind") == "cleared").then(pl.lit("cleared")).otherwise(pl.lit("restart"))
                          .alias("kind"))
            .sort(["pod", "engine", *_ORDER])
            .with_columns(pl.int_range(1, pl.len() + 1).over(["pod", "engine"]).alias("seg")))


def _segments(events: pl.DataFrame, resets: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(events with seg and copies after each, sorted by track then order; per (track, seg) its init copies;
    departures: track, ts, kind, in order)."""
    both = pl.concat([events.with_columns(pl.lit(None, pl.Int64).alias("seg")),
                      resets.select("pod", "engine", "ts", "seq", "idx", "pos", "flag",
                                    pl.lit(None, pl.UInt32).alias("track"), pl.lit(0, pl.Int64).alias("delta"),
                                    "seg")], how="diagonal_relaxed")
    seg = (both.sort(["pod", "engine", *_ORDER, "delta"])
           .with_columns((1 - pl.col("flag").cast(pl.Int64)).cum_sum().over(["pod", "engine"]).alias("seg"))
           .filter(pl.col("flag") == 1).drop("flag")
           .sort(["track", "seg", "ts", "seq", "idx", "pos", "delta"], maintain_order=True))
    run = pl.col("delta").cum_sum().over(["track", "seg"])
    seg = seg.with_columns(run.alias("run"))
    seg = seg.with_columns((-pl.min_horizontal(pl.col("run").min().over(["track", "seg"]), 0)).alias("init"))
    seg = seg.with_columns((pl.col("run") + pl.col("init")).alias("copies"))
    inits = seg.group_by(["track", "seg"]).agg(pl.col("init").first(), pl.col("copies").last().alias("end"),
                                               pl.col("pod").first(), pl.col("engine").first())
    removed = seg.filter((pl.col("delta") < 0) & (pl.col("copies") == 0)).select(
        "track", "ts", "seq", "idx", "pos", pl.lit(1, pl.Int8).alias("flag"), pl.lit("removed").alias("kind"))
    ended = (inits.filter(pl.col("end") > 0).with_columns((pl.col("seg") + 1).alias("next"))
             .join(resets, left_on=["pod", "engine", "next"], right_on=["pod", "engine", "seg"], how="inner")
             .select("track", "ts", "seq", "idx", "pos", "flag", "kind"))
    departures = (pl.concat([removed, ended], how="vertical_relaxed").sort(["track", *_ORDER])
                  .select("track", "ts", "kind"))
    return seg.select("track", "ts", "seg", "copies"), inits.select("track", "seg", "init"), departures


def _asof(left: pl.DataFrame, right: pl.DataFrame, by: list[str], strategy: str, left_on: str = "before"
          ) -> pl.DataFrame:
    """``left`` with the last (backward) or first (forward) row of ``right`` on ts by ``by``; ``right`` stably
    sorted by ts so ties resolve in event order."""
    out = left.sort(left_on).join_asof(right.sort("ts", maintain_order=True), left_on=left_on, right_on="ts",
                                       by=by, strategy=strategy, check_sortedness=False)
    return out.drop("ts", strict=False) if "ts" not in left.columns else out


def block_statuses(blocks: pl.DataFrame, resets: pl.DataFrame, asks: pl.DataFrame, model_pods: pl.DataFrame
                   ) -> pl.DataFrame:
    """The status of each asked block, as :meth:`ingest.kv_evidence.KvTimeline.status` gives it.

    ``blocks``: :data:`BLOCK_COLUMNS` rows; ``resets``: :data:`RESET_COLUMNS` rows; ``asks``: columns rid
    (request), i (position among its missed blocks), chain, pod, model, t (arrival, unix ms), end (its end, unix
    ms); ``model_pods``: (model, pod) pairs, the pods whose holdings count as elsewhere for that model.
    Returns asks' rid and i with state (:data:`ingest.attribution.BLOCK_STATES`), holder pod and removed_at
    (unix ms or null), every asked block once, sorted by (rid, i)."""
    keys = asks.select("rid", "i")
    tracks, events = _tracks(blocks)
    numbered = _resets(resets)
    seg, inits, departures = _segments(events, numbered)
    cand = (asks.with_columns(pl.col("chain").cast(pl.UInt64)).join(tracks.rename({"pod": "tpod"}), on="chain",
                                                                     how="inner")
            .with_columns((pl.col("t") - 1).alias("before")))
    if cand.is_empty():
        return _finish(keys, pl.DataFrame(schema={"rid": asks.schema["rid"], "i": asks.schema["i"],
                                                  "state": pl.String, "spod": pl.String, "removed_at": pl.Int64}))
    cand = _asof(cand, seg.rename({"ts": "ev_ts"}).with_columns(pl.col("ev_ts").alias("ts")), ["track"], "backward")
    last_reset = numbered.select(pl.col("pod").alias("tpod"), "engine", "ts", pl.col("seg").alias("seg_t"))
    cand = _asof(cand, last_reset, ["tpod", "engine"], "backward").with_columns(pl.col("seg_t").fill_null(0))
    cand = cand.join(inits.rename({"seg": "seg_t"}), on=["track", "seg_t"], how="left")
    resident = pl.when(pl.col("seg") == pl.col("seg_t")).then(pl.col("copies")).otherwise(
        pl.col("init").fill_null(0)) > 0
    cand = cand.with_columns(resident.fill_null(False).alias("resident"))
    cand = _asof(cand, departures.rename({"kind": "dep_kind"}).with_columns(pl.col("ts").alias("dep_ts")),
                 ["track"], "backward")
    own = pl.col("tpod") == pl.col("pod")
    here = cand.filter(own & pl.col("resident"))
    here = _asof(here.drop("dep_ts", "dep_kind"), departures.rename({"kind": "dep_kind"})
                 .with_columns(pl.col("ts").alias("dep_ts")), ["track"], "forward", left_on="t")
    gone = pl.col("dep_ts").is_not_null() & (pl.col("dep_ts") <= pl.col("end"))
    here = here.group_by("rid", "i").agg(gone.all().alias("gone"), *_latest(), pl.col("pod").first())
    # resident here until it ended → resident_here; all its resident copies left before the end → *_here
    resident_here = here.filter(~pl.col("gone")).select("rid", "i", pl.lit(RESIDENT_HERE).alias("state"),
                                                        pl.col("pod").alias("spod"), pl.lit(None, pl.Int64)
                                                        .alias("removed_at"))
    left_here = here.filter(pl.col("gone")).select("rid", "i", pl.col("pod").alias("spod"), "dep_ts", "dep_kind")
    rest = cand.join(here.select("rid", "i"), on=["rid", "i"], how="anti")
    gone_before = (rest.filter(own & pl.col("dep_ts").is_not_null())
                   .group_by("rid", "i").agg(pl.col("pod").first().alias("spod"), *_latest())
                   .select("rid", "i", "spod", "dep_ts", "dep_kind"))
    departed = pl.concat([left_here, gone_before], how="vertical_relaxed").select(
        "rid", "i", pl.when(pl.col("dep_kind") == "removed").then(pl.lit(REMOVED_HERE)).otherwise(
            pl.lit(RESET_HERE)).alias("state"), "spod", pl.col("dep_ts").alias("removed_at"))
    rest = rest.join(departed.select("rid", "i"), on=["rid", "i"], how="anti")
    elsewhere = (rest.filter(~own & pl.col("resident"))
                 .join(model_pods.rename({"pod": "tpod"}), on=["model", "tpod"], how="semi")
                 .group_by("rid", "i").agg(pl.col("tpod").min().alias("spod"))
                 .select("rid", "i", pl.lit(RESIDENT_ELSEWHERE).alias("state"), "spod",
                         pl.lit(None, pl.Int64).alias("removed_at")))
    return _finish(keys, pl.concat([resident_here, departed, elsewhere], how="vertical_relaxed"))


def _latest() -> list[pl.Expr]:
    """The latest departure of a group of tracks: by ts, then kind (a deterministic tie rule)."""
    return [pl.col(c).sort_by(["dep_ts", "dep_kind"]).last() for c in ("dep_ts", "dep_kind")]


def _finish(keys: pl.DataFrame, found: pl.DataFrame) -> pl.DataFrame:
    """Every asked (rid, i) with its found status, else nowhere."""
    return (keys.join(found, on=["rid", "i"], how="left")
            .with_columns(pl.col("state").fill_null(NOWHERE), pl.col("spod").fill_null("").alias("pod"))
            .select("rid", "i", "state", "pod", pl.col("removed_at").cast(pl.Int64)).sort("rid", "i"))


def until_nowhere(statuses: pl.DataFrame) -> pl.DataFrame:
    """``statuses`` (rid, i, ...) cut after each request's first nowhere block (the evidence ends there)."""
    stop = pl.when(pl.col("state") == NOWHERE).then(pl.col("i")).otherwise(None).min().over("rid")
    return statuses.filter(stop.is_null() | (pl.col("i") <= stop))
