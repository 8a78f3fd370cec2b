"""Precise mode's block statuses computed column-wise (polars, numpy): the same answers as the readable
reference :class:`ingest.kv_evidence.KvTimeline` / :func:`ingest.kv_evidence.request_evidence` (a test compares
both on generated histories), for a whole chunk of requests at once.

Residency rules: see :mod:`ingest.kv_evidence` (sql/migrations/0017 kv_block_residency). A *track* is one
(pod, engine, medium, vLLM block hash) with a chain hash; its events are cut into *segments* by the resets of
its pod and engine (segment 0 before the first, segment k from the k-th, in (ts, seq, idx, pos) order, a reset
before the blocks of its own batch). In a segment a track holds ``init + running sum`` copies, ``init`` being the
copies stored before the evidence (minus the lowest running sum). A *departure* is the event after which its last
copy is gone: a removal that takes the copies to 0, or a reset that ends a segment with copies > 0. A request
sees the events up to its own end only: its segment's ``init`` is minus the lowest running sum up to then (fewer
copies when a later removal proved more), with its departures counted from that ``init``
(:func:`_departures_seen_by`), and a track counts for it once a store up to then named its chain. Nor does it see
the events and resets before its lookback's start: a track with events before it has its segment open then read
from there on (:func:`_seen_from`: only those tracks pay for it), and counts once a store from then on named it.

The state of a track just before ``t`` (events at ``t`` have not happened yet) is then three as-of lookups
(binary searches over (track, ts) keys):
its last event before ``t`` (its copies, if in the segment of ``t``), the last reset of its pod and engine before
``t`` (the segment of ``t``, whose ``init`` holds when the track has no event in it before ``t``), its last
departure before ``t``; and, for the evicted-while-waiting rule, its first departure at or after ``t``. Ties of
departures at the same millisecond on several tracks: the latest (ts, kind) wins (as in the reference).

Memory: the rows read for the chunk (events of the blocks its requests missed) plus one row per (request block,
track holding that chain hash).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

from ingest.attribution import NOWHERE, REMOVED_HERE, RESET_HERE, RESIDENT_ELSEWHERE, RESIDENT_HERE

#: Columns of the block rows (kv_block_log rows, ts in unix ms; ``chain`` 0 on removed rows, ignored there). A frame
#: of them may also carry ``weight``: the copies a row stores or removes (a stand-in of :func:`summarize`; a log
#: row, or a null, is 1).
BLOCK_COLUMNS = ("pod", "engine", "medium", "block_hash", "chain", "ts", "seq", "idx", "pos", "kind")


def _delta(frame: pl.DataFrame) -> pl.Expr:
    """+weight for a store, −weight for a removal (weight 1 without the column)."""
    weight = pl.col("weight").fill_null(1).cast(pl.Int64) if "weight" in frame.columns else pl.lit(1, pl.Int64)
    return pl.when(pl.col("kind") == "stored").then(weight).otherwise(-weight).alias("delta")
#: Columns of the reset rows (kv_cache_resets, ts in unix ms; kind 'cleared' or anything else = a restart).
RESET_COLUMNS = ("pod", "engine", "ts", "seq", "idx", "kind")
_ORDER = ["ts", "seq", "idx", "flag", "pos"]  # a reset (flag 0) sorts before the blocks of its own batch
_KEY = ["pod", "engine", "medium", "block_hash"]
_IDENTITY = [*_KEY, "ts", "seq", "idx", "pos", "kind"]


def _changed(columns: list[str]) -> pl.Expr:
    """True on the first row and wherever one of ``columns`` differs from the row before."""
    return pl.any_horizontal(pl.col(c) != pl.col(c).shift(1) for c in columns).fill_null(True)


def _tracks(blocks: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(tracks: track, chain, pod, engine, named_at (unix ms of its first stored row with a chain); events: track, pod,
    engine, ts, seq, idx, pos, delta ±weight, naming (a stored row with a chain), in track then event order).
    ``blocks``: a track's rows contiguous, in kv_block_log's order (:data:`_IDENTITY`: event order, a removal before a
    store of the same position), tracks in any order, names (pod, engine, medium) as integer codes; a row equal to the
    one before (written twice) counts once. A track's chain is that of its last stored row with a chain, as in the
    reference. Column-wise in numpy: rows are compared with the row before, a track's last named row is the last of
    its run."""
    n = len(blocks)
    named_somewhere = (blocks["kind"] == "stored") & (blocks["chain"] != 0)
    if not n or not named_somewhere.any():  # no track is named (only removals): nothing to say
        return (pl.DataFrame(schema={"track": pl.UInt32, "chain": pl.UInt64, "pod": pl.Int64, "engine": pl.Int64,
                                     "named_at": pl.Int64}),
                pl.DataFrame(schema={**{c: pl.UInt32 if c == "track" else pl.Int64 for c in (
                    "track", "pod", "engine", "ts", "seq", "idx", "pos", "delta")}, "naming": pl.Boolean}))
    stored = (blocks["kind"] == "stored").to_numpy()
    weight = (blocks["weight"].fill_null(1).cast(pl.Int64).to_numpy() if "weight" in blocks.columns
              else np.ones(n, dtype=np.int64))
    columns = {c: blocks[c].to_numpy() for c in (*_IDENTITY, "chain") if c != "kind"}
    same_key = np.ones(n - 1, dtype=bool)
    for c in _KEY:
        same_key &= columns[c][1:] == columns[c][:-1]
    track = np.cumsum(np.r_[True, ~same_key]) - 1
    same_row = same_key & (stored[1:] == stored[:-1])
    for c in ("ts", "seq", "idx", "pos"):
        same_row &= columns[c][1:] == columns[c][:-1]
    sel = np.flatnonzero(np.r_[True, ~same_row]) if same_row.any() else None  # None: every row, no copies
    chain = columns["chain"] if sel is None else columns["chain"][sel]
    track, stored, weight = (track, stored, weight) if sel is None else (track[sel], stored[sel], weight[sel])
    naming = stored & (chain != 0)
    has_name = np.zeros(int(track[-1]) + 1, dtype=bool)
    has_name[track[naming]] = True
    if not has_name.all():  # rows of tracks without a named store go
        keep = has_name[track]
        sel = np.flatnonzero(keep) if sel is None else sel[keep]
        track, stored, chain, naming, weight = track[keep], stored[keep], chain[keep], naming[keep], weight[keep]

    def pick(column: np.ndarray) -> np.ndarray:
        return column if sel is None else column[sel]

    named_rows = np.flatnonzero(naming)
    runs = track[named_rows]
    last = named_rows[np.r_[runs[1:] != runs[:-1], True]]
    first = named_rows[np.r_[True, runs[1:] != runs[:-1]]]
    pod, engine = pick(columns["pod"]), pick(columns["engine"])
    named = pl.DataFrame({"track": track[last].astype(np.uint32), "chain": chain[last].astype(np.uint64, copy=False),
                          "pod": pod[last], "engine": engine[last],
                          "named_at": pick(columns["ts"])[first].astype(np.int64, copy=False)})
    events = pl.DataFrame({"track": track.astype(np.uint32), "pod": pod, "engine": engine,
                           **{c: pick(columns[c]).astype(np.int64, copy=False) for c in ("ts", "seq", "idx", "pos")},
                           "delta": np.where(stored, weight, -weight), "naming": naming})
    return named, events


def _resets(resets: pl.DataFrame) -> pl.DataFrame:
    """Resets numbered per pod and engine: seg (1, 2, ...) in order, with kind 'cleared' / 'restart'."""
    return (resets.select("pod", "engine", pl.col("ts").cast(pl.Int64), pl.col("seq").cast(pl.Int64),
                          pl.col("idx").cast(pl.Int64), pl.lit(0, pl.Int64).alias("pos"),
                          pl.lit(0, pl.Int8).alias("flag"),
                          pl.when(pl.col("kind") == "cleared").then(pl.lit("cleared")).otherwise(pl.lit("restart"))
                          .alias("kind"))
            .sort(["pod", "engine", *_ORDER])
            .with_columns(pl.int_range(1, pl.len() + 1).over(["pod", "engine"]).cast(pl.Int64).alias("seg")))


def _segment_numbers(events: pl.DataFrame, resets: pl.DataFrame) -> np.ndarray:
    """Per event, how many resets of its pod and engine come before it in (ts, seq, idx, pos) order (a reset
    before the blocks of its own batch): the last reset at or before its ms (as-of join), less those of that
    same ms that come after it."""
    if resets.is_empty():
        return np.zeros(len(events), dtype=np.int64)
    last = (resets.group_by("pod", "engine", "ts").agg(pl.col("seg").max())
            .rename({"ts": "rts"}).with_columns(pl.col("rts").alias("ts")))
    seg = (_asof(events.select("pod", "engine", "ts", "seq", "idx").with_row_index("n"), last,
                 ["pod", "engine"], "backward", left_on="ts"))
    ties = seg.filter(pl.col("rts") == pl.col("ts"))
    if not ties.is_empty():
        later = (ties.select("n", "pod", "engine", "ts", "seq", "idx")
                 .join(resets.select("pod", "engine", "ts", pl.col("seq").alias("rseq"), pl.col("idx").alias("ridx")),
                       on=["pod", "engine", "ts"])
                 .filter((pl.col("rseq") > pl.col("seq")) | ((pl.col("rseq") == pl.col("seq"))
                                                              & (pl.col("ridx") > pl.col("idx"))))
                 .group_by("n").agg(pl.len().alias("after")))
        seg = seg.join(later, on="n", how="left")
    else:
        seg = seg.with_columns(pl.lit(0).alias("after"))
    seg = seg.sort("n").select(pl.col("seg").fill_null(0) - pl.col("after").fill_null(0))
    return seg.to_series().to_numpy().astype(np.int64)


def _segments(events: pl.DataFrame, resets: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(events with seg, copies after each (with the segment's init from all its events), delta, run (the running sum in
    its segment) and low (the lowest run so far in the segment, ≤ 0), in track then event order; per (track, seg) its
    init copies; departures: track, ts, kind, seg, in order). ``events`` in track then event order (:func:`_tracks`), so
    each (track, seg) is a contiguous run and the running sums are numpy segment sums."""
    seg_no = _segment_numbers(events, resets)
    track = events["track"].to_numpy().astype(np.int64)
    delta = events["delta"].to_numpy()
    n = len(delta)
    starts = np.flatnonzero(np.r_[True, (track[1:] != track[:-1]) | (seg_no[1:] != seg_no[:-1])]) if n else \
        np.zeros(0, dtype=np.int64)
    lengths = np.diff(np.r_[starts, n])
    total = np.cumsum(delta)
    run = total - np.repeat(total[starts] - delta[starts], lengths)
    init = -np.minimum(np.minimum.reduceat(run, starts), 0) if n else np.zeros(0, dtype=np.int64)
    copies = run + np.repeat(init, lengths)
    # the lowest running sum so far in its segment (≤ 0): a segmented running minimum, each segment shifted
    # below every earlier one so the minimum starts again at its first event
    shift = np.repeat(np.arange(len(starts), dtype=np.int64) * (2 * int(np.abs(run).max(initial=0)) + 1), lengths)
    low = np.minimum(np.minimum.accumulate(run - shift) + shift, 0)
    seg = events.select("track", "ts", "seq", "idx", "pos").with_columns(
        pl.Series("seg", seg_no), pl.Series("copies", copies), pl.Series("delta", delta), pl.Series("run", run),
        pl.Series("low", low))
    inits = pl.DataFrame({"track": track[starts].astype(np.uint32), "seg": seg_no[starts], "init": init,
                          "end": copies[np.r_[starts[1:], n] - 1] if n else init,
                          "pod": events["pod"].gather(starts), "engine": events["engine"].gather(starts)})
    removed = seg.filter((pl.col("delta") < 0) & (pl.col("copies") == 0)).select(
        "track", "ts", "seq", "idx", "pos", pl.lit(1, pl.Int8).alias("flag"), pl.lit("removed").alias("kind"), "seg")
    ended = (inits.filter(pl.col("end") > 0).with_columns((pl.col("seg") + 1).alias("next"))
             .join(resets, left_on=["pod", "engine", "next"], right_on=["pod", "engine", "seg"], how="inner")
             .select("track", "ts", "seq", "idx", "pos", "flag", "kind", "seg"))
    departures = removed if ended.is_empty() else (
        pl.concat([removed, ended], how="vertical_relaxed").sort(["track", *_ORDER]))
    return (seg.select("track", "ts", "seg", "copies", "delta", "run", "low"), inits.select("track", "seg", "init"),
            departures.select("track", "ts", "kind", "seg"))


def _asof(left: pl.DataFrame, right: pl.DataFrame, by: list[str], strategy: str, left_on: str = "before"
          ) -> pl.DataFrame:
    """``left`` with the last (backward) or first (forward) row of ``right`` on ts by ``by``; ``right`` stably
    sorted by ts so ties resolve in event order."""
    out = left.sort(left_on).join_asof(right.sort("ts", maintain_order=True), left_on=left_on, right_on="ts",
                                       by=by, strategy=strategy, check_sortedness=False)
    return out.drop("ts", strict=False) if "ts" not in left.columns else out


def _ranks(names: pl.Series, rank: dict[str, int]) -> pl.Series:
    """``names`` (String, Categorical or Enum) as their Int64 ``rank``; a categorical column (kv_block_log's
    LowCardinality columns read as Arrow dictionaries) through its few categories, not row by row."""
    if isinstance(names.dtype, (pl.Categorical, pl.Enum)):
        words = names.unique().drop_nulls()
        physical = words.to_physical().to_numpy().astype(np.int64)
        lut = np.zeros(int(physical.max()) + 1 if len(physical) else 1, dtype=np.int64)
        lut[physical] = [rank[w] for w in words.cast(pl.String).to_list()]
        return pl.Series(names.name, lut[names.to_physical().to_numpy().astype(np.int64)])
    return names.cast(pl.String).cast(pl.Enum(list(rank))).to_physical().cast(pl.Int64)


def _np(frame: pl.DataFrame, column: str) -> np.ndarray:
    return frame[column].to_numpy().astype(np.int64, copy=False)


def _last_at_or_before(keys: np.ndarray, owner: np.ndarray, want_owner: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Index of the last entry of ``keys`` (sorted) ≤ ``want`` whose owner equals ``want_owner``, else −1."""
    k = np.searchsorted(keys, want, side="right") - 1
    ok = k >= 0
    ok[ok] = owner[k[ok]] == want_owner[ok]
    return np.where(ok, k, -1)


def _first_at_or_after(keys: np.ndarray, owner: np.ndarray, want_owner: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Index of the first entry of ``keys`` (sorted) ≥ ``want`` whose owner equals ``want_owner``, else −1."""
    k = np.searchsorted(keys, want, side="left")
    ok = k < len(keys)
    ok[ok] = owner[k[ok]] == want_owner[ok]
    return np.where(ok, k, -1)


def _may_matter(cand: pl.DataFrame, seg: pl.DataFrame, inits: pl.DataFrame) -> pl.DataFrame:
    """``cand`` (ask × track rows with columns track and t) less the rows whose track can say nothing about its
    ask: no event before t and no copies stored before the evidence (init 0 in every segment). Such a track is
    not resident just before t (no event, and the init of the segment of t is 0) and has no departure before t
    (a removal is an event; a reset ends a segment only after its events); a departure after t counts only for a
    track resident at t. So the answer is the same without them; typically they are the blocks the request
    itself stored after its arrival. ``seg``: events in track then event order (:func:`_segments`)."""
    if cand.is_empty() or seg.is_empty():
        return cand
    ev_track, ev_ts = _np(seg, "track"), _np(seg, "ts")
    size = int(max(ev_track.max(), _np(cand, "track").max())) + 1
    starts = np.flatnonzero(np.r_[True, ev_track[1:] != ev_track[:-1]])
    first = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
    first[ev_track[starts]] = ev_ts[starts]  # a track's events are in event order: its first has the least ts
    unseen = np.zeros(size, dtype=bool)
    unseen[_np(inits.filter(pl.col("init") > 0), "track")] = True
    track, t = _np(cand, "track"), _np(cand, "t")
    return cand.filter(pl.Series((first[track] < t) | unseen[track]))


def _before_certain_nowhere(asks: pl.DataFrame, cand: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(asks, cand) without each request's asks after its first ask that has no candidate track left (its
    status is nowhere: nothing can make it resident, departed or held elsewhere), ``cand``'s ask numbers
    renumbered to the asks kept."""
    answerable = np.zeros(len(asks), dtype=bool)
    answerable[_np(cand, "ask")] = True
    stop = pl.when(~pl.col("answerable")).then(pl.col("i")).otherwise(None).min().over("rid")
    keep = (asks.select("rid", "i").with_columns(pl.Series("answerable", answerable))
            .select(stop.is_null() | (pl.col("i") <= stop)).to_series().to_numpy())
    if keep.all():
        return asks, cand
    renumber = np.cumsum(keep) - 1
    ask = _np(cand, "ask")
    cand = cand.filter(pl.Series(keep[ask])).with_columns(pl.Series("ask", renumber[ask[keep[ask]]]))
    return asks.filter(pl.Series(keep)), cand


def _removals_at(seg: pl.DataFrame, track: np.ndarray, seg_no: np.ndarray, level: np.ndarray, at: np.ndarray,
                 strategy: str) -> np.ndarray:
    """Per query (``track``, its segment ``seg_no``, a running sum ``level``, a time ``at``, unix ms): the last
    removal at or before ``at`` (``strategy`` 'backward') or the first at or after it ('forward') of that track and
    segment after which its running sum is ``level``, as a code (ts × len(_KINDS) + the rank of 'removed'), −1 for
    none. ``seg``: :func:`_segments`' events."""
    queries = pl.DataFrame({"q": np.arange(len(track)), "track": track.astype(np.int64),
                            "seg": seg_no.astype(np.int64), "run": level.astype(np.int64), "ts": at.astype(np.int64)})
    by = ["track", "seg", "run"]
    removals = (seg.filter(pl.col("delta") < 0)
                .select(*[pl.col(c).cast(pl.Int64) for c in by], pl.col("ts").cast(pl.Int64).alias("at"))
                .join(queries.select(by).unique(), on=by, how="semi").sort("at"))
    found = (queries.sort("ts").join_asof(removals, left_on="ts", right_on="at", by=by, strategy=strategy,
                                          check_sortedness=False).sort("q")["at"])
    return (found * len(_KINDS) + _KINDS.index("removed")).fill_null(-1).to_numpy().astype(np.int64)


def _departures_seen_by(seg: pl.DataFrame, departures: pl.DataFrame, d_code: np.ndarray, track: np.ndarray,
                        seg_t: np.ndarray, init: np.ndarray, t: np.ndarray, floor: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(last departure before t, first at or after t) as codes (ts × len(_KINDS) + kind rank, −1 for none) of
    each ``track`` whose segment ``seg_t`` (the one of t) holds ``init`` copies stored before the evidence, fewer
    than its events after the request's end prove (:func:`block_statuses`). In that segment a removal is a
    departure when the running sum reaches −init; departures of earlier segments after ``floor`` stand as computed
    (their events all lie before t; those of ``floor`` and before are the window start's, :func:`_seen_from`). The
    segment's reset departure lies after the request's end (else every event of the segment would lie before it,
    proving all its copies), so it is none of these."""
    asks = pl.DataFrame({"q": np.arange(len(track)), "track": track, "seg": seg_t, "floor": floor})
    ints = [pl.col(c).cast(pl.Int64) for c in ("track", "seg")]
    earlier = (departures.with_columns(*ints, pl.Series("code", d_code)).filter(pl.col("code") >= 0)
               .join(asks.select("track", "seg").unique(), on="track", how="semi")
               .group_by("track", "seg").agg(pl.col("code").max()).with_columns(pl.col("seg").alias("dseg"))
               .sort("seg"))
    prev = (asks.sort("seg").join_asof(earlier.with_columns(pl.col("seg") + 1), on="seg", by="track",
                                       strategy="backward", check_sortedness=False)
            .sort("q").select(pl.when(pl.col("dseg") > pl.col("floor")).then(pl.col("code")).fill_null(-1))
            .to_series().to_numpy())
    return (np.maximum(prev, _removals_at(seg, track, seg_t, -init, t - 1, "backward")),
            _removals_at(seg, track, seg_t, -init, t, "forward"))


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, block: int = 64) -> np.ndarray:
    """min(values[lo[i] .. hi[i]]) (inclusive, lo ≤ hi) per i. Ranges within two blocks of ``block`` rows are
    reduced directly; longer ones take the minimum within the block of lo from lo on, within the block of hi up to
    hi, and over the whole blocks between from a sparse table of block minima. Memory: about 2 × len(values)."""
    out = np.empty(len(lo), dtype=values.dtype)
    near = hi // block - lo // block <= 1
    if near.any():
        bounds = np.column_stack([lo[near], hi[near] + 1]).ravel()
        out[near] = np.minimum.reduceat(np.r_[values, values[:1]], bounds)[::2]
    far = np.flatnonzero(~near)
    if len(far):
        top = np.iinfo(values.dtype).max
        rows = np.r_[values, np.full((-len(values)) % block, top, dtype=values.dtype)].reshape(-1, block)
        upto = np.minimum.accumulate(rows, axis=1).ravel()
        onward = np.minimum.accumulate(rows[:, ::-1], axis=1)[:, ::-1].ravel()
        table = [rows.min(axis=1)]
        first, last = lo[far] // block + 1, hi[far] // block - 1
        widths = last - first + 1
        while (1 << len(table)) <= widths.max():
            j = 1 << (len(table) - 1)
            table.append(np.minimum(table[-1][:-j], table[-1][j:]))
        level = np.floor(np.log2(widths)).astype(np.int64)
        between = np.empty(len(far), dtype=values.dtype)
        for j in np.unique(level):
            sel = level == j
            between[sel] = np.minimum(table[j][first[sel]], table[j][last[sel] - (1 << j) + 1])
        out[far] = np.minimum(np.minimum(onward[lo[far]], upto[hi[far]]), between)
    return out


def _seen_from(seg: pl.DataFrame, ev_key: np.ndarray, key: Callable[[np.ndarray, np.ndarray], np.ndarray],
               track: np.ndarray, t: np.ndarray, end: np.ndarray, since: np.ndarray, s0: np.ndarray,
               seg_t: np.ndarray, next_reset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segment ``s0`` (open at ``since``, the start of the request's lookback) of each ``track`` as the request
    sees it: only its events from ``since`` on, so its copies stored before the evidence are minus the lowest running
    sum from there (up to the request's ``end``, or all its events when it closed before ``t``). Returns (copies just
    before ``t``, meaningful when t lies in s0 (``seg_t`` = s0); s0's last departure before ``t`` as a code (−1:
    none), a removal from ``since`` on taking its copies to 0, or the reset ``next_reset`` (its code, −1: none)
    ending it with copies; its first departure at or after ``t``, meaningful when t lies in s0)."""
    ev_track, ev_seg, ev_run, ev_ts = (_np(seg, c) for c in ("track", "seg", "run", "ts"))
    a = _first_at_or_after(ev_key, ev_track, track, key(track, since))
    a0 = np.maximum(a, 0)
    in_s0 = (a >= 0) & (ev_seg[a0] == s0)  # s0 has events from since on
    p = _last_at_or_before(ev_key, ev_track, track, key(track, since - 1))
    r0 = np.where((p >= 0) & (ev_seg[np.maximum(p, 0)] == s0), ev_run[np.maximum(p, 0)], 0)  # the sum not seen
    ends = np.flatnonzero(np.r_[(ev_track[1:] != ev_track[:-1]) | (ev_seg[1:] != ev_seg[:-1]), True])
    last = ends[np.searchsorted(ends, a0)]  # the last event of a's segment
    in_t = seg_t == s0
    k_end = _last_at_or_before(ev_key, ev_track, track, key(track, end))
    b = np.where(in_t, np.minimum(k_end, last), last)
    has = np.flatnonzero(in_s0 & (b >= a))
    init = np.zeros(len(track), dtype=np.int64)
    init[has] = np.maximum(r0[has] - _range_min(ev_run, a[has], b[has]), 0)
    level = r0 - init  # the running sum at which its copies are 0
    k_t = _last_at_or_before(ev_key, ev_track, track, key(track, t - 1))
    copies_t = init + np.where(in_s0 & (k_t >= a), ev_run[np.maximum(k_t, 0)] - r0, 0)
    ended = in_s0 & (init + ev_run[last] - r0 > 0) & (next_reset >= 0)
    upto = np.where(in_t, t - 1, ev_ts[last])
    before = _removals_at(seg, track, s0, level, upto, "backward")
    before = np.where((before >= 0) & (before // len(_KINDS) >= since), before, -1)
    before = np.where(~in_t & ended, next_reset, before)
    after = _removals_at(seg, track, s0, level, t, "forward")
    after = np.where((after < 0) & ended, next_reset, after)
    return copies_t, before, after


def _named_since(cand: pl.DataFrame, events: pl.DataFrame) -> pl.DataFrame:
    """``cand`` (ask × track rows with since and end) less the rows whose track no store named from since to end:
    a naming store before the request's lookback is not its evidence (typically none: its track named after)."""
    early = pl.col("named_at") < pl.col("since")
    if not cand.select(early.any()).item():
        return cand
    naming = events.filter(pl.col("naming")).select("track", pl.col("ts").alias("named_from")).sort("named_from")
    renamed = (cand.filter(early).sort("since")
               .join_asof(naming, left_on="since", right_on="named_from", by="track", strategy="forward",
                          check_sortedness=False)
               .filter(pl.col("named_from") <= pl.col("end")).drop("named_from"))
    return pl.concat([cand.filter(~early), renamed])


#: since of an ask without a lookback start: before every event.
_NO_START = -(2**62)
#: Departure kinds in name order: a tie of departures at the same ms goes to the greater (ts, kind).
_KINDS = ("cleared", "removed", "restart")
_STATES = (NOWHERE, RESIDENT_HERE, REMOVED_HERE, RESET_HERE, RESIDENT_ELSEWHERE)


def block_statuses(blocks: pl.DataFrame, resets: pl.DataFrame, asks: pl.DataFrame, model_pods: pl.DataFrame,
                   first_nowhere: bool = False) -> pl.DataFrame:
    """The status of each asked block, as :meth:`ingest.kv_evidence.KvTimeline.status` gives it.

    ``blocks``: :data:`BLOCK_COLUMNS` rows, each track's contiguous and in kv_block_log's order (:data:`_IDENTITY`
    after the track: its ORDER BY; tracks in any order, e.g. :func:`ingest.kv_evidence.fetch_blocks`);
    ``resets``: :data:`RESET_COLUMNS` rows; ``asks``: columns rid (request), i (position among its missed
    blocks), chain, pod, model, t (arrival, unix ms), end (its end, unix ms), maybe since (the start of its lookback,
    unix ms, null: none: the events and resets before it are not its evidence, :func:`_seen_from`); ``model_pods``:
    (model, pod) pairs, the pods whose holdings count as elsewhere for that model. Returns asks' rid and i with state
    (:data:`ingest.attribution.BLOCK_STATES`), holder pod and removed_at (unix ms or null), one row per ask in
    its order; with ``first_nowhere``, only each request's asks up to its first one that no track can answer
    (a certain nowhere: :func:`until_nowhere` would drop the rest, so they are not computed). Names (pods,
    engines, media, models) are replaced by their rank among all names first (cheaper to
    sort, group and join on; a pod's rank orders holders by name); the as-of lookups are binary searches over
    (track, ts) keys, the per-block answers numpy reductions over its candidate tracks."""
    named = ((blocks, ("pod", "engine", "medium")), (resets, ("pod", "engine")), (asks, ("pod", "model")),
             (model_pods, ("pod", "model")))
    words = sorted(set().union(*(frame[c].unique().cast(pl.String).to_list() for frame, cols in named for c in cols)))
    rank = {w: i for i, w in enumerate(words)}
    blocks, resets, asks, model_pods = (frame.with_columns(_ranks(frame[c], rank) for c in cols)
                                        for frame, cols in named)
    tracks, events = _tracks(blocks)
    numbered = _resets(resets)
    seg, inits, departures = _segments(events, numbered)
    since = (pl.col("since").fill_null(_NO_START) if "since" in asks.columns else pl.lit(_NO_START)).cast(pl.Int64)
    cand = (asks.select(pl.int_range(pl.len(), dtype=pl.Int64).alias("ask"), pl.col("chain").cast(pl.UInt64),
                        "pod", "model", "t", "end", since.alias("since"))
            .join(tracks.rename({"pod": "tpod"}), on="chain", how="inner")
            .filter(pl.col("named_at") <= pl.col("end")))  # a track is that block's once a store said so
    cand = _named_since(cand, events)
    cand = _may_matter(cand, seg, inits)
    if first_nowhere:
        asks, cand = _before_certain_nowhere(asks, cand)
    n = len(asks)
    state = np.zeros(n, dtype=np.int64)  # index into _STATES
    holder = np.full(n, -1, dtype=np.int64)
    removed_at = np.full(n, -1, dtype=np.int64)
    if not cand.is_empty():
        ask, pod, model, t, end, track, tpod, engine, since = (_np(cand, c) for c in (
            "ask", "pod", "model", "t", "end", "track", "tpod", "engine", "since"))
        ev_track = _np(seg, "track")
        first_event = np.full(int(max(ev_track.max(initial=0), track.max())) + 1, np.iinfo(np.int64).max)
        starts = np.flatnonzero(np.r_[True, ev_track[1:] != ev_track[:-1]]) if len(ev_track) else ev_track
        first_event[ev_track[starts]] = _np(seg, "ts")[starts]
        early = first_event[track] < since  # the track has events before the request's lookback: see _seen_from
        times = [_np(seg, "ts"), _np(departures, "ts"), t, end, since[early] - 1]
        if not numbered.is_empty():
            times.append(_np(numbered, "ts"))
        base = min(int(x.min()) for x in times if len(x)) - 1
        span = max(int(x.max()) for x in times if len(x)) - base + 2

        def key(owner: np.ndarray, ts: np.ndarray) -> np.ndarray:
            return owner * span + (ts - base)

        # binary searches run much faster over sorted queries: candidates in (track, t) order
        order = np.argsort(key(track, t), kind="stable")
        ask, pod, model, t, end, track, tpod, engine, since, early = (x[order] for x in (
            ask, pod, model, t, end, track, tpod, engine, since, early))

        # copies just before t: the track's last event before t if in the segment of t, else that segment's init
        ev_key = key(ev_track, _np(seg, "ts"))
        k = _last_at_or_before(ev_key, ev_track, track, key(track, t - 1))
        seg_e = np.where(k >= 0, _np(seg, "seg")[k], -1)
        copies_e = np.where(k >= 0, _np(seg, "copies")[k], 0)
        seg_t = np.zeros(len(cand), dtype=np.int64)
        aff = np.flatnonzero(early)
        s0, next_reset = np.zeros(len(aff), dtype=np.int64), np.full(len(aff), -1, dtype=np.int64)
        if not numbered.is_empty():
            # (pod, engine) pairs numbered densely: a product of name ranks times the span of the times would
            # overflow int64 with many names (every model and pod of the window is a name) over a long window
            engines = len(words) + 1
            pairs_r = _np(numbered, "pod") * engines + _np(numbered, "engine")
            _, dense = np.unique(np.r_[pairs_r, tpod * engines + engine], return_inverse=True)
            r_owner, owner = dense[:len(pairs_r)].astype(np.int64), dense[len(pairs_r):].astype(np.int64)
            order = np.lexsort((_np(numbered, "seg"), _np(numbered, "ts"), r_owner))
            r_owner, r_ts, r_seg = r_owner[order], _np(numbered, "ts")[order], _np(numbered, "seg")[order]
            k = _last_at_or_before(key(r_owner, r_ts), r_owner, owner, key(owner, t - 1))
            seg_t = np.where(k >= 0, r_seg[k], 0)
            if len(aff):  # the segment open at the lookback's start (resets before it unseen), the reset ending it
                k = _last_at_or_before(key(r_owner, r_ts), r_owner, owner[aff], key(owner[aff], since[aff] - 1))
                s0 = np.where(k >= 0, r_seg[k], 0)
                r_code = r_ts * len(_KINDS) + np.where(numbered["kind"].to_numpy()[order] == "cleared",
                                                       _KINDS.index("cleared"), _KINDS.index("restart"))
                pair = r_owner * (int(r_seg.max()) + 2) + r_seg
                want = owner[aff] * (int(r_seg.max()) + 2) + s0 + 1
                k = np.minimum(np.searchsorted(pair, want), len(pair) - 1)
                next_reset = np.where(pair[k] == want, r_code[k], -1)
        i_track, i_seg = _np(inits, "track"), _np(inits, "seg")
        order = np.lexsort((i_seg, i_track))
        i_key = i_track[order] * (1 << 24) + i_seg[order]
        want = track * (1 << 24) + seg_t
        k = np.minimum(np.searchsorted(i_key, want), max(len(i_key) - 1, 0))
        init_t = np.where((len(i_key) > 0) & (i_key[k] == want), _np(inits, "init")[order][k], 0) if len(i_key) \
            else np.zeros(len(cand), dtype=np.int64)
        # the copies stored before the evidence as the events up to the request's end prove them: the segment
        # of t's init from its events up to then (all of them when a later event ≤ end lies past a reset)
        init_end = init_t.copy()
        some = np.flatnonzero(init_t > 0)  # init 0 stays 0 whatever the end
        if len(some):
            k_end = _last_at_or_before(ev_key, ev_track, track[some], key(track[some], end[some]))
            seg_end = np.where(k_end >= 0, _np(seg, "seg")[k_end], -1)
            init_end[some] = np.where(seg_end == seg_t[some], -_np(seg, "low")[np.maximum(k_end, 0)],
                                      np.where(seg_end > seg_t[some], init_t[some], 0))
        resident = np.where(seg_e == seg_t, copies_e - init_t, 0) + init_end > 0
        # departures: the last before t, the first at or after t
        d_track, d_ts = _np(departures, "track"), _np(departures, "ts")
        d_rank = departures["kind"].replace_strict({k: i for i, k in enumerate(_KINDS)}, return_dtype=pl.Int64)
        d_code = d_ts * len(_KINDS) + d_rank.to_numpy() if len(d_ts) else d_ts
        d_key = key(d_track, d_ts)
        before = _last_at_or_before(d_key, d_track, track, key(track, t - 1))
        after = _first_at_or_after(d_key, d_track, track, key(track, t))
        before_code = np.where(before >= 0, d_code[before], -1) if len(d_ts) else np.full(len(cand), -1)
        after_code = np.where(after >= 0, d_code[after], -1) if len(d_ts) else np.full(len(cand), -1)
        floor = np.full(len(cand), -1, dtype=np.int64)  # departures of this segment and before: _seen_from's
        if len(aff):
            floor[aff] = s0
            if len(d_ts):
                later = (before[aff] >= 0) & (_np(departures, "seg")[np.maximum(before[aff], 0)] > s0)
                before_code[aff] = np.where(later, before_code[aff], -1)
        fewer = np.flatnonzero(init_end != init_t)  # fewer copies proved by then: the removals reach 0 elsewhere
        if len(fewer):
            before_code[fewer], after_code[fewer] = _departures_seen_by(
                seg, departures, d_code, track[fewer], seg_t[fewer], init_end[fewer], t[fewer], floor[fewer])
        if len(aff):  # tracks with events before the lookback's start: its segment then, as the request sees it
            copies_s0, before_s0, after_s0 = _seen_from(seg, ev_key, key, track[aff], t[aff], end[aff], since[aff],
                                                        s0, seg_t[aff], next_reset)
            in_s0 = seg_t[aff] == s0
            resident[aff] = np.where(in_s0, copies_s0 > 0, resident[aff])
            before_code[aff] = np.where(in_s0 | (before_code[aff] < 0), before_s0, before_code[aff])
            after_code[aff] = np.where(in_s0, after_s0, after_code[aff])
        own = tpod == pod
        here = own & resident
        gone = (after_code >= 0) & (after_code // len(_KINDS) <= end)
        any_here = np.zeros(n, dtype=bool)
        any_here[ask[here]] = True
        stays = np.zeros(n, dtype=bool)
        stays[ask[here & ~gone]] = True
        latest = np.full(n, -1, dtype=np.int64)
        np.maximum.at(latest, ask[here], np.where(gone[here], after_code[here], -1))
        left_before = np.full(n, -1, dtype=np.int64)
        np.maximum.at(left_before, ask[own], before_code[own])
        latest = np.where(any_here, latest, left_before)
        pairs = np.unique(_np(model_pods, "model") * (len(words) + 1) + _np(model_pods, "pod"))
        other = ~own & resident & np.isin(model * (len(words) + 1) + tpod, pairs)
        first_holder = np.full(n, len(words), dtype=np.int64)
        np.minimum.at(first_holder, ask[other], tpod[other])
        asked_pod = _np(asks, "pod")
        departed = (latest >= 0) & ~(any_here & stays)
        kind = latest % len(_KINDS)
        state = np.select([any_here & stays, departed, first_holder < len(words)],
                          [1, np.where(kind == _KINDS.index("removed"), 2, 3), 4], 0)
        holder = np.where(state == 4, first_holder, np.where(state > 0, asked_pod, -1))
        removed_at = np.where(departed & (state != 1), latest // len(_KINDS), -1)
    names = np.array([*words, ""], dtype=object)
    return pl.DataFrame({
        "rid": asks["rid"], "i": asks["i"], "state": np.array(_STATES, dtype=object)[state],
        "pod": names[holder], "removed_at": removed_at}, schema_overrides={"state": pl.String, "pod": pl.String}
    ).with_columns(pl.when(pl.col("removed_at") >= 0).then(pl.col("removed_at")).alias("removed_at"))


def until_nowhere(statuses: pl.DataFrame) -> pl.DataFrame:
    """``statuses`` (rid, i, ...) cut after each request's first nowhere block (the evidence ends there)."""
    stop = pl.when(pl.col("state") == NOWHERE).then(pl.col("i")).otherwise(None).min().over("rid")
    return statuses.filter(stop.is_null() | (pl.col("i") <= stop))


# -- a track's past before a cut, in a few rows (ingest/kv_evidence.KvMemo) -----------------------------------
def summarize(blocks: pl.DataFrame, resets: pl.DataFrame, cut: int) -> pl.DataFrame:
    """A few stand-in rows per track for all its rows of ``blocks`` before ``cut`` (unix ms), such that
    :func:`block_statuses` over the stand-ins plus the rows at or after ``cut`` (and every reset) gives the same
    status as over all the rows, for every ask arriving at or after ``cut``; :data:`BLOCK_COLUMNS`, sorted like
    kv_block_log, plus ``weight``.

    ``blocks``: :data:`BLOCK_COLUMNS` rows (and maybe ``weight``) in any order (a row written twice counts once;
    rows at or after ``cut`` are ignored); ``resets``: :data:`RESET_COLUMNS` rows (those at or after ``cut`` are
    ignored). Stand-in rows may come from an earlier summary: ``summarize(summarize(rows < c1) + rows in [c1, c2),
    resets, c2)`` stands for the rows before c2 (how :class:`ingest.kv_evidence.KvMemo` moves from chunk to chunk).

    What an ask at t ≥ cut reads of a track's past (see :func:`block_statuses`): in the segment open at the cut
    (after the last reset before it), the running sum S of its events and its lowest point m (≤ 0: the copies
    stored before the evidence are −m, unless later events go lower) and the last removal that reached m (a
    departure); before that segment, only the latest departure (a removal that took the copies to 0, or a reset
    that ended a segment holding copies); and that the track had an event before t. The stand-ins reproduce
    exactly these, at the identities of real events: for a departure D of the open segment, at D's batch a store
    of one copy, then a removal of 1 − m (the walk reaches m at D), then a store of S − m; without one (then
    m = 0 and S > 0), a store of S at the segment's first event; for the latest earlier departure when the open
    segment has none, a store and a removal of one copy at a removal departure, or a store at the segment's last
    event before a reset departure. Stores carry the track's chain hash (its last stored row's), removals 0. At
    most 5 rows per track (``weight``: the copies a row stands for), however many times it was stored and
    removed."""
    columns = [*BLOCK_COLUMNS, "weight"] if "weight" in blocks.columns else list(BLOCK_COLUMNS)
    pre = (blocks.filter(pl.col("ts") < cut).select(columns)
           .with_columns(pl.col(c).cast(pl.String) for c in ("pod", "engine", "medium", "kind")))
    if pre.is_empty():
        return pre
    rows = (pre.sort(_IDENTITY).filter(_changed(_IDENTITY))
            .with_columns((_changed(_KEY).cum_sum() - 1).cast(pl.UInt32).alias("track")))
    keys = rows.filter(_changed(["track"])).select("track", *_KEY)
    chains = (rows.filter((pl.col("kind") == "stored") & (pl.col("chain") != 0)).group_by("track")
              .agg(pl.col("chain").last()))
    keys = keys.join(chains, on="track", how="left").with_columns(pl.col("chain").fill_null(0).cast(pl.UInt64))
    events = rows.select("track", "pod", "engine", pl.col("ts").cast(pl.Int64), pl.col("seq").cast(pl.Int64),
                         pl.col("idx").cast(pl.Int64), pl.col("pos").cast(pl.Int64), _delta(rows))
    numbered = _resets(resets.filter(pl.col("ts") < cut).select(RESET_COLUMNS)
                       .with_columns(pl.col("pod").cast(pl.String), pl.col("engine").cast(pl.String)))
    seg, inits, _ = _segments(events, numbered)
    open_seg = numbered.group_by("pod", "engine").agg(pl.col("seg").max().alias("open"))
    ev = (events.with_columns(seg["seg"], seg["copies"]).with_row_index("n")
          .join(open_seg, on=["pod", "engine"], how="left").sort("n")
          .with_columns(pl.col("open").fill_null(0))
          .join(inits.select("track", "seg", "init"), on=["track", "seg"], how="left").sort("n"))
    is_open = pl.col("seg") == pl.col("open")
    departed = (pl.col("delta") < 0) & (pl.col("copies") == 0)
    ident = ["ts", "seq", "idx"]
    # the open segment: S − m = copies after its last event, 1 − m = 1 + init; its last departure D; first event F
    opened = (ev.filter(is_open).group_by("track", maintain_order=True)
              .agg(pl.col("copies").last().alias("end"), pl.col("init").first(),
                   *[pl.col(c).first().alias(f"f_{c}") for c in ident],
                   *[pl.col(c).filter(departed).last().alias(f"d_{c}") for c in ident]))
    # earlier segments: the latest departure, a removal (in event order) or a reset ending a segment with copies
    removed = (ev.filter(~is_open & departed)
               .select("track", *ident, pl.lit(1, pl.Int8).alias("flag"), "pos", pl.lit(0).alias("a_ts"),
                       pl.lit(0).alias("a_seq"), pl.lit(0).alias("a_idx"), pl.lit("removed").alias("how")))
    last_in_seg = (ev.filter(~is_open).group_by("track", "seg", maintain_order=True)
                   .agg(*[pl.col(c).last().alias(f"a_{c}") for c in ident], pl.col("copies").last().alias("end"),
                        pl.col("pod").first(), pl.col("engine").first()))
    ended = (last_in_seg.filter(pl.col("end") > 0).with_columns((pl.col("seg") + 1).alias("next"))
             .join(numbered.select("pod", "engine", "seg", *ident), left_on=["pod", "engine", "next"],
                   right_on=["pod", "engine", "seg"], how="inner")
             .select("track", *ident, pl.lit(0, pl.Int8).alias("flag"), pl.lit(0, pl.Int64).alias("pos"),
                     "a_ts", "a_seq", "a_idx", pl.lit("ended").alias("how")))
    closed = (pl.concat([removed, ended], how="vertical_relaxed").sort(["track", *ident, "flag", "pos"])
              .group_by("track", maintain_order=True).last()
              .join(opened.filter(pl.col("d_ts").is_not_null()).select("track"), on="track", how="anti"))

    def stand_in(frame: pl.DataFrame, prefix: str, weight: pl.Expr, pos: int, kind: str) -> pl.DataFrame:
        """One ``kind`` row of ``weight`` copies per row of ``frame`` at its ``prefix`` identity and ``pos``."""
        return (frame.select("track", *[pl.col(f"{prefix}{c}").alias(c) for c in ident],
                             pl.lit(pos, pl.Int64).alias("pos"), weight.cast(pl.Int64).alias("weight"))
                .filter(pl.col("weight") > 0).with_columns(pl.lit(kind).alias("kind")))

    with_d = opened.filter(pl.col("d_ts").is_not_null())
    without_d = opened.filter(pl.col("d_ts").is_null())
    one = pl.lit(1, pl.Int64)
    by_removal = closed.filter(pl.col("how") == "removed").rename({"ts": "r_ts", "seq": "r_seq", "idx": "r_idx"})
    parts = [
        stand_in(with_d, "d_", one, 0, "stored"),
        stand_in(with_d, "d_", 1 + pl.col("init"), 1, "removed"),
        stand_in(with_d, "d_", pl.col("end"), 2, "stored"),
        stand_in(without_d, "f_", pl.col("end"), 0, "stored"),
        stand_in(by_removal, "r_", one, 0, "stored"),
        stand_in(by_removal, "r_", one, 1, "removed"),
        stand_in(closed.filter(pl.col("how") == "ended"), "a_", one, 0, "stored"),
    ]
    out = (pl.concat(parts, how="vertical_relaxed").join(keys, on="track", how="inner")
           .with_columns(pl.when(pl.col("kind") == "stored").then(pl.col("chain")).otherwise(0)
                         .cast(pl.UInt64).alias("chain")))
    schema = blocks.schema
    return (out.select(*[pl.col(c).cast(schema[c]) for c in BLOCK_COLUMNS], pl.col("weight").cast(pl.UInt32))
            .sort(_IDENTITY))
