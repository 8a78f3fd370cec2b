"""Precise mode's evidence: where each missed block of a request's chain was at its arrival, by the KV events.

Inputs (sql/migrations/0017, 0018): a request's chain (gateway_requests.prompt_block_hashes, kvscope chain hashes
of each full prompt block, and prompt_block_size); per pod the rows of kv_block_log (one per stored or removed
block; a stored row carries the block's chain hash, a removed row only vLLM's block hash, so removals are paired
with their stores by (pod, engine, medium, vLLM block hash)) and the cache resets of kv_cache_resets
(AllBlocksCleared, vLLM restarts). Output: :class:`ingest.attribution.KvEvidence` per request, which
:func:`ingest.attribution.judge` turns into block-exact routed_away / evicted zones.

Residency follows kv_block_residency (sql/migrations/0017): vLLM does not deduplicate blocks
(``vllm/v1/core/block_pool.py``), so a block hash is resident while its copies (stores − removals since the last reset
of its pod and engine) are above 0; a removal with no copy to remove counts a copy stored before the evidence began; a
reset ends every copy. A request is judged by the events up to its own end (arrival + e2e): the copies stored before the
evidence are those the removals up to then prove, and a block hash is a chain's once a store up to then named it; and
from its own lookback's start (arrival − lookback, rounded up to a step of lookback / 168: :func:`lookback_start`):
the events and resets before it are not its evidence, whatever the chunk read; so its answer does not depend on the
chunk it is judged in. An event at exactly the arrival time has not happened yet (as in the named query
kv_resident_at). A block is resident on a pod when it is on any of its engines or media.

Rules (docs/miss-causes.md, "Precise mode"): a request is judged with KV evidence when its chain's block size
equals the block size used for its pod and its pod has KV events at or before its arrival within the lookback.
Each missed block j ≥ k0 = cached // B (up to the last hittable block) is, in this order of precedence:
resident on the request's pod (``resident_here``; but ``removed_here`` / ``reset_here`` with a time after the
arrival when its last copy left before the request ended: evicted while it waited), gone from it before arrival
(``removed_here`` by a BlockRemoved, ``reset_here`` by a reset, with the time: the pod had the prefix and lost
it, which is what the request met), resident on another pod serving the same model (``resident_elsewhere``, the
holder named: the first in name order when several), else ``nowhere``, which ends the evidence.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
from prometheus_client import Counter

from ingest import block_sizes, kv_tracks
from ingest.attribution import (
    NOWHERE,
    REMOVED_HERE,
    RESET_HERE,
    RESIDENT_ELSEWHERE,
    RESIDENT_HERE,
    BlockStatus,
    KvEvidence,
)
from ingest.attribution_batch import EvidenceFrames
from ingest.dedup import one_per_identity
from ingest.store import Store

_NEVER = -(2**62)
#: (pod, engine, medium, vLLM block hash, chain hash, ts ms, seq, idx, pos, kind 'stored' | 'removed')
BlockRow = tuple[str, str, str, int, int, int, int, int, int, str]
#: (pod, engine, ts ms, seq, idx, kind 'cleared' | 'restart')
ResetRow = tuple[str, str, int, int, int, str]


@dataclass
class _Track:
    """One (pod, engine, medium, block hash)'s residency as change points: ``times[i]`` (ms) → ``resident[i]``
    (copies > 0 after that event) and ``departure[i]`` (the latest (kind, ms) its last copy left, or None)."""

    times: list[int] = field(default_factory=list)
    resident: list[bool] = field(default_factory=list)
    departure: list[tuple[str, int] | None] = field(default_factory=list)

    def at(self, t_ms: int) -> tuple[bool, tuple[str, int] | None]:
        """(resident, last departure) just before ``t_ms`` (events at ``t_ms`` not yet happened)."""
        i = bisect.bisect_left(self.times, t_ms) - 1
        return (False, None) if i < 0 else (self.resident[i], self.departure[i])

    def departure_between(self, t_ms: int, until_ms: int) -> tuple[str, int] | None:
        """The first departure of its last copy at or after ``t_ms`` and at or before ``until_ms``, or None."""
        for i in range(bisect.bisect_left(self.times, t_ms), bisect.bisect_right(self.times, until_ms)):
            dep = self.departure[i]
            if dep is not None and dep[1] >= t_ms:
                return dep
        return None


def _build_track(events: list[tuple[tuple[int, ...], int, int]], resets: list[tuple[tuple[int, ...], int, str]]
                 ) -> _Track:
    """A :class:`_Track` from its block events ((order, ts ms, +1 store / −1 removal)) and its pod and engine's
    resets ((order, ts ms, kind)), orders as kv_block_residency sorts them (a reset before the blocks of its
    own batch). Each stretch between resets starts with the copies stored before the evidence ("unseen": the
    deepest the running count goes below 0)."""
    merged = sorted([(o, ts, d, "") for o, ts, d in events] + [(o, ts, 0, k) for o, ts, k in resets])
    track = _Track()
    departure: tuple[str, int] | None = None
    segment: list[tuple[int, int]] = []
    start = _NEVER

    def flush(end_ts: int | None, end_kind: str) -> None:
        nonlocal departure
        run = low = 0
        for _, d in segment:
            run += d
            low = min(low, run)
        copies = -low
        track.times.append(start)
        track.resident.append(copies > 0)
        track.departure.append(departure)
        for ts, d in segment:
            before, copies = copies, copies + d
            if before > 0 and copies == 0:
                departure = ("removed", ts)
            track.times.append(ts)
            track.resident.append(copies > 0)
            track.departure.append(departure)
        if end_ts is not None and copies > 0:
            departure = (end_kind, end_ts)

    for _, ts, d, kind in merged:
        if kind:
            flush(ts, kind)
            segment, start = [], ts
        else:
            segment.append((ts, d))
    flush(None, "")
    return track


class KvTimeline:
    """Per chain hash and pod, the residency of that block on the pod, from kv_block_log rows and resets.

    ``block_rows``: :data:`BlockRow` tuples (the chain hash of a removed row is ignored: it is paired with its
    stores by vLLM block hash); ``reset_rows``: :data:`ResetRow` tuples. Memory: one entry per row."""

    def __init__(self, block_rows: Iterable[BlockRow], reset_rows: Iterable[ResetRow] = ()) -> None:
        self._resets: dict[tuple[str, str], list[tuple[tuple[int, ...], int, str]]] = defaultdict(list)
        for pod, engine, ts, seq, idx, kind in reset_rows:
            kind = "cleared" if kind == "cleared" else "restart"
            self._resets[(pod, engine)].append(((ts, seq, idx, 0, 0), ts, kind))
        events: dict[tuple[str, str, str, int], list[tuple[tuple[int, ...], int, int]]] = defaultdict(list)
        chains: dict[tuple[str, str, str, int], int] = {}
        named: dict[tuple[str, str, str, int], list[int]] = defaultdict(list)  # the times of stores with a chain
        for pod, engine, medium, block_hash, chain, ts, seq, idx, pos, kind in block_rows:
            key = (pod, engine, medium, block_hash)
            events[key].append(((ts, seq, idx, pos, 1), ts, 1 if kind == "stored" else -1))
            if kind == "stored" and chain:
                chains[key] = chain
                named[key].append(ts)
        #: chain hash → pod → the keys (pod, engine, medium, block hash) of its tracks, with their events and the
        #: times of the stores that named its chain
        self._keys: dict[int, dict[str, list[tuple[tuple[str, str, str, int], list, list[int]]]]] = defaultdict(
            lambda: defaultdict(list))
        for key, evs in events.items():
            if key in chains:
                self._keys[chains[key]][key[0]].append((key, evs, named[key]))
        self._built: dict[tuple[tuple[str, str, str, int], int | None, int | None], _Track] = {}

    def _tracks_of(self, chain: int, end_ms: int | None, since_ms: int | None = None) -> dict[str, list[_Track]]:
        """Per pod, the tracks of block ``chain`` as the events from ``since_ms`` to ``end_ms`` show them (None: no
        bound): the events and resets before ``since_ms`` are not seen (as if the collector had not sent them), the
        copies stored before the evidence are those the removals in the window prove, and a track counts once a
        store in the window named its chain."""
        out: dict[str, list[_Track]] = {}
        lo, hi = _NEVER if since_ms is None else since_ms, -_NEVER if end_ms is None else end_ms
        for pod, keyed in self._keys.get(chain, {}).items():
            tracks = []
            for key, evs, named_at in keyed:
                if not any(lo <= ts <= hi for ts in named_at):
                    continue  # no store in the window named this block
                built = self._built.get((key, end_ms, since_ms))
                if built is None:
                    resets = self._resets.get((key[0], key[1]), [])
                    built = _build_track([e for e in evs if lo <= e[1] <= hi], [r for r in resets if lo <= r[1] <= hi])
                    self._built[(key, end_ms, since_ms)] = built
                tracks.append(built)
            out[pod] = tracks
        return out

    def status(self, chain: int, pod: str, t_ms: int, model_pods: Iterable[str] | None = None,
               end_ms: int | None = None, since_ms: int | None = None, down: Collection[str] = ()) -> BlockStatus:
        """Where block ``chain`` was just before ``t_ms`` (unix ms) for a request served by ``pod``; holders
        elsewhere only among ``model_pods`` (None = any pod). Precedence as in the module docstring.
        ``end_ms``: when the request ended (arrival + e2e): a block resident here at arrival whose last copy left before
        then was evicted while the request waited (``removed_here`` / ``reset_here`` with that time, after the arrival).
        The copies stored before the evidence are those the events up to ``end_ms`` prove, and a block hash is that
        chain's once a store up to then said so (None: all the events): an event after the request ended changes nothing
        of its answer, so the answer does not depend on when, or in which chunk, it is computed. ``since_ms``: the
        start of the request's lookback (arrival − lookback): the events and resets before it are not its evidence
        (None: all of them), whatever else was read with it. ``down``: the pods found down as the request was routed
        (gateway_requests.pods_down): a holder elsewhere is named among the others first, in name order, and among
        them only when no other holds the block (a prefix the router could have reached is not a pod's outage)."""
        by_pod = self._tracks_of(chain, end_ms, since_ms)
        latest: tuple[str, int] | None = None
        here = by_pod.get(pod, [])
        if any(track.at(t_ms)[0] for track in here):
            gone = ([track.departure_between(t_ms, end_ms) for track in here if track.at(t_ms)[0]]
                    if end_ms is not None else [None])
            if not all(gone):
                return BlockStatus(RESIDENT_HERE, pod)
            latest = max((d for d in gone if d is not None), key=lambda d: (d[1], d[0]))
        for track in here if latest is None else ():
            departure = track.at(t_ms)[1]
            if departure is not None and (latest is None or (departure[1], departure[0]) > (latest[1], latest[0])):
                latest = departure
        if latest is not None:
            state = REMOVED_HERE if latest[0] == "removed" else RESET_HERE
            return BlockStatus(state, pod, datetime.fromtimestamp(latest[1] / 1000, UTC))
        allowed = None if model_pods is None else set(model_pods)
        for other in sorted(by_pod, key=lambda p: (p in down, p)):
            if other != pod and (allowed is None or other in allowed) and any(
                    t.at(t_ms)[0] for t in by_pod[other]):
                return BlockStatus(RESIDENT_ELSEWHERE, other)
        return BlockStatus(NOWHERE)


def request_evidence(timeline: KvTimeline, *, pod: str, ts_ms: int, chain: Sequence[int], chain_block_size: int,
                     prompt_tokens: int, cached_tokens: int, model_pods: Iterable[str] | None = None,
                     covered_pods: frozenset[str] = frozenset(), end_ms: int | None = None,
                     since_ms: int | None = None, down: Collection[str] = ()) -> KvEvidence:
    """The :class:`KvEvidence` of one request: the status of its blocks k0 = cached // B … up to the last
    hittable one (L / B, L = floor((P − 1)/B)·B) and within ``chain``, stopping after the first ``nowhere``.
    ``end_ms``: the request's end (arrival + e2e_ms), ``since_ms`` the start of its lookback (arrival − lookback),
    ``down`` the pods found down as it was routed, see :meth:`KvTimeline.status`."""
    b = max(1, chain_block_size)
    last = min(len(chain), max(0, prompt_tokens - 1) // b)
    statuses: list[BlockStatus] = []
    pods = None if model_pods is None else list(model_pods)
    for j in range(max(0, cached_tokens) // b, last):
        status = timeline.status(int(chain[j]), pod, ts_ms, pods, end_ms, since_ms, down)
        statuses.append(status)
        if status.state == NOWHERE:
            break
    return KvEvidence(chain_block_size, tuple(statuses), covered_pods)


def covered(first_event_ms: Mapping[str, int], ts_ms: int) -> frozenset[str]:
    """The pods whose KV events cover an arrival at ``ts_ms``: those whose first event (within the lookback
    the caller read) lies at or before it."""
    return frozenset(pod for pod, first in first_event_ms.items() if first <= ts_ms)


# -- carried from chunk to chunk -----------------------------------------------------------------------------
#: A block hash whose kv_block_log rows before the cut number at least this many is kept by :class:`KvMemo` (as at
#: most 5 stand-in rows per track); one with fewer costs no more to read again.
MEMO_MIN_ROWS = 8
#: At most this many stand-in rows are kept (~0.1 KB each); past it the memo starts again empty.
MEMO_MAX_ROWS = 2_000_000
#: A memo kept across runs (:meth:`KvMemo.new_run`) looks again at the KV events ingested this long before the
#: last run started: an insert stamped (``ingested_at``) before it may have become visible only after it. An
#: insert still invisible this long after its stamp goes unseen by the memo (answers judged meanwhile keep the old
#: stand-ins' view). Events stamped in that span long after their own time (a history just imported) start the
#: memo again at each run for that long.
ACROSS_RUNS_OVERLAP = timedelta(seconds=30)


def epoch_ms(value: object) -> int:
    """Unix ms of an aware datetime (or of a naive one read as UTC)."""
    if not isinstance(value, datetime):
        raise TypeError(f"not a datetime: {value!r}")
    return round((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp() * 1000)


class KvMemo:
    """Precise mode's evidence carried from one chunk of a run's arrivals to the next (each chunk's arrivals are
    at or after the previous chunk's last): per *hot* block hash (one with :data:`MEMO_MIN_ROWS` or more log rows
    before the cut), its tracks' rows before its cut as the stand-ins of :func:`ingest.kv_tracks.summarize` (at
    most 5 rows per track, ``weight`` the copies each stands for). The next chunk then reads that hash's rows
    from its cut only (:func:`fetch_blocks`), so a tenant's system prompt, stored and evicted all day, is read
    once per run instead of its whole history by every chunk; the statuses, and so the answers, are the same
    (tests/test_kv_memo.py runs the job both ways).

    Each hash has its own cut: the last arrival of the latest chunk that read its rows. A hash a chunk did not
    read keeps its cut (its rows since then are read when it is wanted again). A hash is forgotten when the evidence
    start of a chunk's last arrival (:func:`lookback_start`) passes the earliest row it stands for (that request does
    not see those rows: the stand-ins cannot leave them out), and not kept while it has a row before its cut's
    evidence start. That start moves once a step (an hour for a lookback of 7 days), so a hash with events older
    than the lookback (a system prompt used all week) is read whole once a step, by the first chunk after the step
    moved, and from its cut by the chunks and runs in between. The memo starts again empty when a chunk arrives
    before a cut (not the next chunk of the run), or past
    :data:`MEMO_MAX_ROWS`. Only hashes whose stored rows are named by their own vLLM hash (vLLM's default
    hashing) are kept: a pod hashing its own way is read in two passes (:func:`fetch_blocks`). A row stored with
    a time before a cut after the chunk that passed it read the log is not seen by later chunks of the run; such a
    row was ingested after the run started, more than the settle time after its own time, so the next run's late
    KV evidence re-examines what it changes (ingest/attribution_job.py). Memory: the stand-ins, ≤ 5 rows per hot
    track.

    ``across_runs_lag_ms``: keep the memo across runs (the live job's loop): the run's last chunk is summarized at
    its last arrival less this lag (not at all without it), and :meth:`new_run` before each run starts it again
    empty when KV events arrived late."""

    def __init__(self, across_runs_lag_ms: int | None = None) -> None:
        self._stand_ins: pl.DataFrame | None = None  # BLOCK_COLUMNS + weight, names as strings
        #: per kept hash its cut and the earliest log row ts (unix ms) its stand-ins stand for (unix ms)
        self._cuts = pl.DataFrame(schema={"block_hash": pl.UInt64, "cut": pl.Int64, "first": pl.Int64})
        self._last = False  # no chunk follows in this run
        self._lag = across_runs_lag_ms  # None: the memo lives for one run
        self._checked: datetime | None = None  # KV rows ingested up to then were seen (kept across runs)

    def last_chunk(self) -> None:
        """The next chunk is the run's last: :meth:`move` after it summarizes nothing when the memo lives for one run
        (no chunk would read it; a run of one chunk pays nothing for the memo); a memo kept across runs summarizes
        at the last arrival less its lag instead (:meth:`new_run`)."""
        self._last = True

    def new_run(self, store: Store, now: datetime) -> None:
        """Before each run of a memo kept across runs (``across_runs_lag_ms`` set; the live job's loop keeps one):
        start again empty when a KV event ingested since the last run (from :data:`ACROSS_RUNS_OVERLAP` before its
        start: an insert stamped before it may have become visible after) lies before a cut, or a publisher_restart
        gap report was (it may add a restart before a cut): the stand-ins no longer stand for the log (a collector
        outage replayed, a late batch). Its cuts lag the run's last arrival by the
        lag, so the next run's arrivals (requests logged when they end, up to the lag after they arrived) lie after
        them; an arrival before a cut is judged without the memo (ingest/attribution_job.py ``_by_memo``).
        ``now``: the store's clock."""
        self._last = False
        if self._checked is not None and self.holds_any():
            late = store.query_rows(
                "SELECT (SELECT count() FROM kv_block_events WHERE ingested_at > {since:DateTime64(3, 'UTC')} "
                "AND ts < fromUnixTimestamp64Milli({cut:Int64}, 'UTC')) + (SELECT count() FROM kv_event_gaps "
                "WHERE ingested_at > {since:DateTime64(3, 'UTC')} AND reason = 'publisher_restart')",
                {"since": self._checked - ACROSS_RUNS_OVERLAP, "cut": self.latest_cut()})
            if late[0][0]:
                self.clear()
        self._checked = now

    def latest_cut(self) -> int | None:
        """The latest cut (unix ms) of the hashes kept, None when none is kept."""
        return int(self._cuts["cut"].max()) if self.holds_any() else None  # type: ignore[arg-type]

    def holds_any(self) -> bool:
        """True when some hash is kept."""
        return self._stand_ins is not None and not self._cuts.is_empty()

    def parameters(self) -> dict[str, list[int]]:
        """The query parameters of :func:`fetch_blocks`' skip: ``memo`` (hashes) and ``memo_cut`` (unix ms)."""
        return {"memo": self._cuts["block_hash"].to_list(), "memo_cut": self._cuts["cut"].to_list()}

    def stand_ins_like(self, frame: pl.DataFrame) -> pl.DataFrame:
        """The stand-in rows with ``frame``'s column types (names as its strings or categoricals)."""
        assert self._stand_ins is not None
        return self._stand_ins.with_columns(pl.col(c).cast(frame.schema[c]) for c in kv_tracks.BLOCK_COLUMNS)

    def clear(self) -> None:
        """Keep nothing: the next chunk reads every row."""
        self._stand_ins = None
        self._cuts = self._cuts.clear()

    def check(self, start_ms: int, first_arrival_ms: int) -> None:
        """Before a chunk whose first arrival is at ``first_arrival_ms`` and whose last arrival's lookback starts at
        ``start_ms``: start again empty when a cut lies after that arrival, and forget each hash whose stand-ins
        stand for a row before ``start_ms`` (a request of the chunk would see a row its window excludes: the chunk
        reads that hash's rows again)."""
        if not self.holds_any():
            return
        if first_arrival_ms < self._cuts["cut"].max():  # type: ignore[operator]
            self.clear()
            return
        stale = self._cuts.filter(pl.col("first") < start_ms)
        if not stale.is_empty() and self._stand_ins is not None:
            self._cuts = self._cuts.filter(pl.col("first") >= start_ms)
            self._stand_ins = self._stand_ins.join(stale.select("block_hash"), on="block_hash", how="anti")

    def move(self, blocks: pl.DataFrame, resets: pl.DataFrame, cut: int, kept: bool, lookback_ms: int | None = None
             ) -> None:
        """After a chunk: ``blocks`` as :func:`fetch_blocks` returned them (``kept``: with the stand-ins, the skip
        applied; else the memo starts again from these rows), ``resets`` the chunk's, ``cut`` its last arrival
        (unix ms). A hash whose rows this chunk read (every row from its cut, or from the window's start) is
        summarized at ``cut`` when it was kept or has :data:`MEMO_MIN_ROWS` rows before ``cut``, unless it has a row
        before ``lookback_ms`` before the cut (a later arrival's lookback starts after it: :meth:`check` would forget
        it; None: no lookback); a kept hash this chunk read nothing of keeps its stand-ins and cut."""
        ending = self._last and self._lag is None  # a memo for one run ends with it
        if not kept or ending:
            self.clear()
        if blocks.is_empty() or ending:
            return
        if self._last:  # kept for the next run, whose arrivals lie after the last less the lag; cuts only move on
            cut = max(cut - int(self._lag or 0), self.latest_cut() or 0)
        read = pl.col("weight").is_null() if "weight" in blocks.columns else pl.lit(True)
        counts = blocks.group_by("block_hash").agg(
            read.any().alias("read"), (~read).any().alias("kept"), (pl.col("ts") < cut).sum().alias("rows"),
            ((pl.col("kind") == "stored") & (pl.col("chain") != pl.col("block_hash"))).any().alias("own"),
            pl.col("ts").filter(read).min().alias("first"))
        hot = (counts.filter(pl.col("read") & (pl.col("kept") | (pl.col("rows") >= MEMO_MIN_ROWS)) & ~pl.col("own"))
               .join(self._cuts.select("block_hash", pl.col("first").alias("was")), on="block_hash", how="left")
               .with_columns(pl.min_horizontal("first", "was").alias("first"))
               .filter(pl.lit(lookback_ms is None)
                       | (pl.col("first") >= lookback_start(cut, lookback_ms or 0))))
        if hot.is_empty():
            return
        hashes = hot.select("block_hash")
        summary = kv_tracks.summarize(blocks.join(hashes, on="block_hash", how="semi"), resets, cut)
        parts = [summary] if self._stand_ins is None else [
            self._stand_ins.join(hashes, on="block_hash", how="anti"), summary]
        stand_ins = pl.concat(parts, how="diagonal_relaxed")
        if len(stand_ins) > MEMO_MAX_ROWS:
            self.clear()
            return
        self._cuts = pl.concat([self._cuts.join(hashes, on="block_hash", how="anti"),
                                hot.select(pl.col("block_hash").cast(pl.UInt64), pl.lit(cut, pl.Int64).alias("cut"),
                                           pl.col("first").cast(pl.Int64))])
        self._stand_ins = stand_ins


# -- from the store ------------------------------------------------------------------------------------------
#: The evidence window: from the lookback before the chunk's first arrival to the chunk's last request's end.
_FROM = ("ts >= {lo:DateTime64(3, 'UTC')} - toIntervalMillisecond({lookback:Int64}) "
         "AND ts <= {until:DateTime64(3, 'UTC')}")
#: The block events' and resets' window: from the chunk's first block evidence start (``kv_from``:
#: :func:`lookback_start` of its ``lo``; no request of the chunk sees an earlier one) to its last request's end.
_BLOCKS_FROM = "ts >= {kv_from:DateTime64(3, 'UTC')} AND ts <= {until:DateTime64(3, 'UTC')}"

#: A request's block evidence starts at its lookback's start rounded up to a step of lookback / LOOKBACK_STEPS (an
#: hour for the default 7 days), not at its exact arrival − lookback: the window's start then moves once a step, not
#: with every arrival, so a :class:`KvMemo` kept across chunks and runs stays valid for a step (it forgets a hash whose
#: rows precede a chunk's window start, and a block used all week has such rows); see :func:`lookback_start`.
LOOKBACK_STEPS = 168


def lookback_start(t_ms: Any, lookback_ms: int) -> Any:
    """The start of the block evidence of a request arriving at ``t_ms`` (unix ms: an int or a polars Int64
    expression): ``t_ms − lookback_ms`` rounded up to a multiple of ``max(1, lookback_ms // LOOKBACK_STEPS)``, so
    within its lookback (which is what its coverage and holders are judged over). It depends on the arrival alone,
    so a request's answer does not depend on the chunk or run it is judged in."""
    step = max(1, lookback_ms // LOOKBACK_STEPS)
    return -((lookback_ms - t_ms) // step) * step


#: Precise mode's read cost: each chunk reads every kv_block_log row of the blocks its requests missed within the
#: lookback, so a block stored and evicted all day is read again by every chunk that misses it. Divided by the
#: requests judged (``kvscope_attribution_requests_total``) it is the rows read per request; the log's own rows
#: per request are the least a reader that read each row once would need (``make bench`` prints both).
KV_ROWS_READ = Counter("kvscope_attribution_kv_log_rows_read", "kv_block_log rows read as precise-mode evidence")
#: The longest wait for a request's prefill that the evidence window reaches past the chunk's last arrival.
MAX_END_MS = 600_000
_WANTED = """
    wanted AS
    (
        SELECT DISTINCT arrayJoin(arraySlice(prompt_block_hashes,
                   intDiv(ifNull(cached_tokens, 0), prompt_block_size) + 1,
                   greatest(0, intDiv(toInt64(prompt_tokens) - 1, prompt_block_size)
                               - intDiv(ifNull(cached_tokens, 0), prompt_block_size)))) AS h
        FROM gateway_requests
        WHERE {in_set} AND ts >= {{lo:DateTime64(3, 'UTC')}} AND ts <= {{hi:DateTime64(3, 'UTC')}}
          AND prompt_block_size > 0
    )"""


_NAMES_SQL = "pod, engine, medium, block_hash"
_EVENT_SQL = "toUnixTimestamp64Milli(ts) AS ts_ms, seq, idx, pos, kind AS kind_name"
_NAMED_CHAIN_SQL = """multiIf(chain_hash IN (SELECT h FROM wanted), chain_hash,
                               block_hash IN (SELECT h FROM wanted), block_hash, 0)"""
_BLOCK_COLUMNS_SQL = f"""
    {_NAMES_SQL}, if(kind = 'stored', {_NAMED_CHAIN_SQL}, 0) AS chain, {_EVENT_SQL}"""
#: fetch_blocks' columns: a row it reads whose chain hash is 0 or its vLLM hash was read for that hash (it is
#: wanted), so only the other rows (a pod hashing its own way) look their hashes up in the wanted set again
#: (ClickHouse's ``if`` evaluates only the branch it takes).
_WANTED_BLOCK_COLUMNS_SQL = f"""
    {_NAMES_SQL},
    if(kind = 'stored', if(chain_hash = block_hash OR chain_hash = 0, block_hash, {_NAMED_CHAIN_SQL}), 0) AS chain,
    {_EVENT_SQL},
    if(kind != 'stored' OR chain_hash = block_hash OR chain_hash = 0, 1, block_hash IN (SELECT h FROM wanted))
        AS by_block_hash"""
#: Name columns (LowCardinality) come as Arrow dictionaries, polars categoricals, where the store allows it.
_DICTIONARIES = {"output_format_arrow_low_cardinality_as_dictionary": 1}


def in_log_order(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` (block rows) sorted so that each (pod, engine, medium, block hash) is contiguous and its rows
    follow kv_block_log's order (ts, seq, idx, pos, a removal before a store): what :mod:`ingest.kv_tracks`
    needs. Sorted here, by the hash first and the names' category codes, not by the store's ORDER BY (which
    sorts the names as strings and cost about three times as much CPU on 10^7 rows)."""
    def code(c: str) -> pl.Expr:
        return pl.col(c).to_physical() if isinstance(frame.schema[c], (pl.Categorical, pl.Enum)) else pl.col(c)
    return frame.sort(["block_hash", code("pod"), code("engine"), code("medium"), "ts", "seq", "idx", "pos",
                       pl.col("kind") == "stored"])


def own_hashing_pods(store: Store) -> list[str]:
    """The pods that published a stored block under a hash other than kvscope's chain hash of its tokens
    (kv_pod_hashing, sql/migrations/0031: vLLM hashing its own way), sorted."""
    return [str(r[0]) for r in store.query_rows(
        "SELECT pod FROM kv_pod_hashing GROUP BY pod HAVING max(own_hashing) > 0 ORDER BY pod")]


def fetch_blocks(store: Store, params: Mapping[str, object], in_set: str, skip: KvMemo | None = None
                 ) -> tuple[pl.DataFrame, bool]:
    """The kv_block_log rows (:data:`ingest.kv_tracks.BLOCK_COLUMNS`, ts in unix ms) of every block that a missed
    block of the staged requests (``in_set``, a filter on (request_id, ts); ``params`` with set, kv_from and
    until) names, by kvscope chain hash or by vLLM hash (equal on pods with vLLM's default hashing), from
    ``kv_from`` (the chunk's first block evidence start, :func:`lookback_start`) to ``until`` (the chunk's last
    request's end): its stores and its removals (paired by vLLM hash).
    ``chain``: the wanted hash a stored row names (its chain hash, else its vLLM hash), 0 on other rows. No FINAL
    and no join: the log is read only where its hash columns are in the wanted set (PREWHERE), then sorted by
    track and event order (:func:`in_log_order`; a row written twice comes twice, adjacent:
    :mod:`ingest.kv_tracks` counts it once, as FINAL would).

    One pass over the log when every stored block named by its chain hash also carries a wanted vLLM hash (pods
    with vLLM's default hashing: the two hashes are equal): its removals then carry a wanted hash too. Rows of
    blocks that never had a store in the window may come along; :mod:`ingest.kv_tracks` keeps only blocks with
    a store. When some pod hashes its blocks its own way (a stored block named only by its chain hash), its
    removals carry only its vLLM hash, so the log is read again by the vLLM hashes of the blocks the wanted
    chain hashes name (two passes, as in :func:`_fetch_blocks_by_name`). The stored rows named only by their chain
    hash are looked for on the pods that hash their own way (:func:`own_hashing_pods`) only: on the others the two
    hashes are equal, and the lookup read two more columns of the whole log. pod, engine, medium and kind come as
    polars categoricals where the store lets the query read LowCardinality columns as Arrow dictionaries, else
    as strings (:func:`ingest.kv_tracks.block_statuses` takes both).

    ``skip``: a :class:`KvMemo` whose stand-ins replace its hashes' rows before its cut: those rows are not read
    (when no row is read from the cuts on, the stand-ins are all the rows). Returns (rows, whether ``skip`` was
    applied: not when a pod hashes its blocks its own way, whose rows are then all read)."""
    skipped = skip is not None and skip.holds_any()
    extra = ("AND toUnixTimestamp64Milli(ts) >= transform(block_hash, {memo:Array(UInt64)}, {memo_cut:Array(Int64)}, "
             "toInt64(0))" if skipped else "")
    args = {**params, **skip.parameters()} if skipped and skip is not None else dict(params)
    own_pods = own_hashing_pods(store)
    by_chain = ("OR (pod IN {own_pods:Array(String)} AND kind = 'stored' AND chain_hash != block_hash "
                "AND chain_hash IN (SELECT h FROM wanted))" if own_pods else "")
    frame = store.query_df(
        f"""
        WITH {_WANTED.format(in_set=in_set)}
        SELECT {_WANTED_BLOCK_COLUMNS_SQL}
        FROM kv_block_log
        PREWHERE block_hash IN (SELECT h FROM wanted) {by_chain}
        WHERE kind IN ('stored', 'removed') AND {_BLOCKS_FROM} {extra}
        """, {**args, "own_pods": own_pods}, preferred=_DICTIONARIES).rename({"ts_ms": "ts", "kind_name": "kind"})
    if frame.is_empty():  # nothing new since the cuts: the stand-ins are then all the evidence
        return (in_log_order(skip.stand_ins_like(_no_blocks())), True) if skipped and skip is not None else (
            _no_blocks(), False)
    own_hashing = frame.filter((pl.col("kind") == "stored") & (pl.col("chain") != 0) & ~pl.col("by_block_hash")
                               .cast(pl.Boolean))
    if not own_hashing.is_empty():
        return _fetch_blocks_by_name(store, params, in_set), False
    frame = frame.drop("by_block_hash")
    if skipped and skip is not None:
        return in_log_order(pl.concat([frame, skip.stand_ins_like(frame)], how="diagonal_relaxed")), True
    return in_log_order(frame), False


def _fetch_blocks_by_name(store: Store, params: Mapping[str, object], in_set: str) -> pl.DataFrame:
    """:func:`fetch_blocks` in two passes: the vLLM hashes of the blocks whose stores name a wanted hash (by
    chain hash or vLLM hash), then every store and removal of those vLLM hashes."""
    frame = store.query_df(
        f"""
        WITH {_WANTED.format(in_set=in_set)},
        named AS
        (
            SELECT DISTINCT block_hash FROM kv_block_log
            PREWHERE chain_hash IN (SELECT h FROM wanted) OR block_hash IN (SELECT h FROM wanted)
            WHERE kind = 'stored' AND {_BLOCKS_FROM}
        )
        SELECT {_BLOCK_COLUMNS_SQL}
        FROM kv_block_log
        PREWHERE block_hash IN (SELECT block_hash FROM named)
        WHERE kind IN ('stored', 'removed') AND {_BLOCKS_FROM}
        """, dict(params), preferred=_DICTIONARIES).rename({"ts_ms": "ts", "kind_name": "kind"})
    return _no_blocks() if frame.is_empty() else in_log_order(frame)


def _no_blocks() -> pl.DataFrame:
    return pl.DataFrame(schema={"pod": pl.String, "engine": pl.String, "medium": pl.String, "block_hash": pl.UInt64,
                                "chain": pl.UInt64, "ts": pl.Int64, "seq": pl.UInt64, "idx": pl.UInt32,
                                "pos": pl.UInt32, "kind": pl.String})


def fetch_resets(store: Store, params: Mapping[str, object]) -> pl.DataFrame:
    """Every cache reset (kv_cache_resets: AllBlocksCleared, vLLM restarts) from kv_from (:data:`_BLOCKS_FROM`) to until
    (:data:`ingest.kv_tracks.RESET_COLUMNS`, ts in unix ms).

    Two of the view's three sources are restarts read from ``publisher_restart`` gap reports (kv_gaps,
    sql/migrations/0030); planning them costs about half a second even on empty tables. Without such a report in
    kv_event_gaps they hold no row, so the log's own reset rows (the view's first source) are read alone."""
    source = "kv_cache_resets" if store.query_rows(ANY_RESTART_GAP)[0][0] else _LOGGED_RESETS
    return store.query_df(
        "SELECT DISTINCT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, "
        f"toUnixTimestamp64Milli(ts) AS ts_ms, seq, idx, CAST(kind AS String) AS kind_name FROM {source} "
        f"WHERE {_BLOCKS_FROM}", dict(params)
    ).rename({"ts_ms": "ts", "kind_name": "kind"})


#: Whether any gap report could add a restart to kv_cache_resets (its second and third sources, sql/migrations/0030).
ANY_RESTART_GAP = "SELECT count() > 0 FROM kv_event_gaps WHERE reason = 'publisher_restart'"
#: kv_cache_resets' first source: the resets the log holds itself (AllBlocksCleared, a publisher's first batch).
_LOGGED_RESETS = "(SELECT pod, engine, ts, seq, idx, kind FROM kv_block_log WHERE kind IN ('cleared', 'restart'))"


#: The spans of :func:`fetch_first_events` and :func:`fetch_model_pods`: per name and bucket of ``lookback`` ms
#: (at least 1) of the event times, the first and last time in it. Whether a row lies in [t − lookback, b]
#: (b ≥ t) is then exact (:func:`seen_between`): a bucket is never longer than that range.
SPANS = ("toUnixTimestamp64Milli(min(ts)) AS first, toUnixTimestamp64Milli(max(ts)) AS last",
          "intDiv(toUnixTimestamp64Milli(ts), greatest(1, {lookback:Int64}))")


def fetch_first_events(store: Store, params: Mapping[str, object]) -> pl.DataFrame:
    """Per pod (column pod) and bucket of ``lookback`` ms, its first and last kv_block_log row (``first``,
    ``last``, unix ms) from lo − lookback to until: whether the pod's KV events cover an arrival at t (a row in
    [t − lookback, t]: :func:`seen_between`). Read from kv_pod_minutes when the lookback is whole minutes
    (:func:`_from_minutes`), else from the log (:func:`fetch_first_events_from_log`)."""
    if _by_minutes(params):
        return _from_minutes(store, params, "kv_pod_minutes", ["pod"])
    return fetch_first_events_from_log(store, params)


def fetch_first_events_from_log(store: Store, params: Mapping[str, object]) -> pl.DataFrame:
    """:func:`fetch_first_events` read from kv_block_log's rows in the window (any lookback; a scan of the log's
    pod and ts columns over the lookback)."""
    return store.query_df(
        f"SELECT CAST(pod AS String) AS pod, {SPANS[0]} FROM kv_block_log "
        f"WHERE {_FROM} GROUP BY pod, {SPANS[1]}", dict(params))


def fetch_model_pods(store: Store, params: Mapping[str, object]) -> pl.DataFrame:
    """Per model and pod (columns model, pod) and bucket of ``lookback`` ms, the first and last request
    (``first``, ``last``, unix ms) the gateway logged for that model on that pod from lo − lookback to until: a
    holder elsewhere counts only among the pods serving the request's model (a block hash says nothing about the
    model: the same token ids hash alike across models), and a pod counts for a request when it served the model
    within the request's lookback and by its end (:func:`seen_between`). Read from model_pod_minutes when the
    lookback is whole minutes (:func:`_from_minutes`), else from gateway_requests
    (:func:`fetch_model_pods_from_log`)."""
    if _by_minutes(params):
        return _from_minutes(store, params, "model_pod_minutes", ["model", "pod"])
    return fetch_model_pods_from_log(store, params)


def fetch_model_pods_from_log(store: Store, params: Mapping[str, object]) -> pl.DataFrame:
    """:func:`fetch_model_pods` read from gateway_requests' rows in the window (any lookback; a scan of the
    lookback's requests)."""
    return store.query_df(
        f"SELECT CAST(model AS String) AS model, CAST(pod AS String) AS pod, {SPANS[0]} FROM gateway_requests "
        f"WHERE {_FROM} GROUP BY model, pod, {SPANS[1]}", dict(params))


def _by_minutes(params: Mapping[str, object]) -> bool:
    lookback = int(params["lookback"])  # type: ignore[call-overload]
    return lookback > 0 and lookback % 60_000 == 0


def _from_minutes(store: Store, params: Mapping[str, object], table: str, names: list[str]) -> pl.DataFrame:
    """The spans of :data:`SPANS` per ``names`` and bucket of ``lookback`` ms (a whole number of minutes) from
    ``table``, a rollup of the first and last row per name and minute kept by a view as rows arrive
    (sql/migrations/0050: kv_pod_minutes, model_pod_minutes): a few rows per name and minute instead of a scan of
    the lookback. Each minute lies in one bucket, so a bucket's first and last are its minutes' least first and
    greatest last. The minutes at the window's ends may bring rows just outside it (lo − lookback, until); for
    [since, until'] inside the window (since ≥ lo − lookback, until' ≤ until, until' − since ≥ lookback: how the
    job asks) :func:`seen_between` is exact over any rows whose buckets are no longer than the lookback, so it
    answers as over the window's rows alone (tests/test_kv_pod_minutes.py)."""
    cols = ", ".join(f"CAST({n} AS String) AS {n}" for n in names)
    return store.query_df(
        f"SELECT {cols}, toUnixTimestamp64Milli(min(first)) AS first, toUnixTimestamp64Milli(max(last)) AS last "
        f"FROM {table} WHERE minute >= toStartOfMinute({{lo:DateTime64(3, 'UTC')}} "
        "- toIntervalMillisecond({lookback:Int64})) AND minute <= {until:DateTime64(3, 'UTC')} "
        f"GROUP BY {', '.join(names)}, intDiv(toInt64(toUnixTimestamp(minute)) * 1000, {{lookback:Int64}})",
        dict(params))


def seen_between(queries: pl.DataFrame, spans: pl.DataFrame, by: list[str], since: str, until: str) -> pl.Series:
    """Per row of ``queries`` (columns ``by``, ``since`` and ``until``, unix ms; ``since`` may be null: no
    start): whether ``spans`` (columns ``by``, ``first`` and maybe ``last``, unix ms: rows of
    :func:`fetch_first_events` / :func:`fetch_model_pods`, or one row per name with its first time) hold a time in
    [since, until]. The last span of its name starting at or before ``until`` says it: its last time when that
    is at or before ``until``, else its first (the span holds ``until``; exact when no span is longer than
    until − since, as the store's buckets of the lookback are)."""
    spans = spans.select(*by, pl.col("first").cast(pl.Int64),
                         pl.col("last" if "last" in spans.columns else "first").cast(pl.Int64).alias("last"))
    found = (queries.select(*by, pl.col(since).cast(pl.Int64).alias("_since"),
                            pl.col(until).cast(pl.Int64).alias("_until"))
             .with_row_index("_q").sort("_until")
             .join_asof(spans.sort("first"), left_on="_until", right_on="first", by=by, strategy="backward",
                        check_sortedness=False)
             .sort("_q"))
    seen = pl.when(pl.col("last") <= pl.col("_until")).then(pl.col("last")).otherwise(pl.col("first"))
    return found.select((seen.is_not_null() & (pl.col("_since").is_null() | (seen >= pl.col("_since"))))
                        .alias("seen")).to_series()


def fetch_chains(store: Store, params: Mapping[str, object], in_set: str) -> pl.DataFrame:
    """request_id, t (the arrival, unix ms: with request_id a request's identity), chain (prompt_block_hashes),
    chain_block_size (prompt_block_size) of the staged requests that logged a chain, one per identity
    (:func:`ingest.dedup.one_per_identity`: two stored copies of a request are one request)."""
    return one_per_identity(store.query_df(
        "SELECT request_id, toUnixTimestamp64Milli(ts) AS t, prompt_block_hashes AS chain, "
        "toInt64(prompt_block_size) AS chain_block_size "
        f"FROM gateway_requests WHERE {in_set} AND ts >= {{lo:DateTime64(3, 'UTC')}} "
        "AND ts <= {hi:DateTime64(3, 'UTC')} AND prompt_block_size > 0 AND notEmpty(prompt_block_hashes)",
        dict(params)), ("request_id", "t"))


def _end() -> pl.Expr:
    """A request's end (unix ms): its arrival plus e2e_ms, an unknown (null or NaN) or negative e2e read as 0, at
    most :data:`MAX_END_MS`."""
    return pl.col("ts").dt.epoch("ms") + pl.col("e2e_ms").fill_null(0.0).fill_nan(0.0).clip(0, MAX_END_MS).cast(
        pl.Int64)


def chunk_evidence(store: Store, frame: pl.DataFrame, params: Mapping[str, object], in_set: str,
                   memo: KvMemo | None = None, sizes: pl.DataFrame | None = None, default_block_size: int = 0
                   ) -> EvidenceFrames | None:
    """Precise mode's evidence (:class:`ingest.attribution_batch.EvidenceFrames`) for the rows of ``frame``
    (columns request_id, ts, pod, model, prompt_tokens, cached_tokens, status, e2e_ms, block_size: the staged
    requests ``in_set`` selects; ``params``: set, lo, hi and lookback in ms) that are judged with KV evidence: a
    chain whose block size equals ``block_size``, a known cached count below the prompt, status < 400, and KV
    events of their own pod at or before their arrival within the lookback (None when there are none). Events
    are read up to the latest request end (arrival + e2e_ms, at most :data:`MAX_END_MS` after it). The blocks'
    statuses are computed column-wise (:func:`ingest.kv_tracks.block_statuses`), the same as
    :func:`request_evidence` gives. Seven queries per chunk whatever its size (eight when a pod hashes its blocks
    its own way: :func:`fetch_blocks`).

    ``memo``: the job's :class:`KvMemo` when ``frame`` is the next chunk of a run's arrivals (each chunk later
    than the one before): its stand-ins replace the rows before its cut, and it is moved on to this chunk's last
    arrival. The answers are the same with and without it. ``sizes``: the pods' block size changes
    (:func:`ingest.block_sizes.changes`; ``default_block_size`` for a pod without any): see :func:`frame_evidence`."""
    chains = fetch_chains(store, params, in_set)
    if chains.is_empty():
        return None
    end = _end()
    last_end = frame.select(end.max()).item()
    lookback = int(params["lookback"])  # type: ignore[call-overload]
    kv_from = lookback_start(epoch_ms(params["lo"]), lookback)
    params = {**params, "until": datetime.fromtimestamp(last_end / 1000, UTC),
              "kv_from": datetime.fromtimestamp(kv_from / 1000, UTC)}
    if memo is not None:
        memo.check(lookback_start(epoch_ms(frame["ts"].max()), lookback), epoch_ms(frame["ts"].min()))
    blocks, skipped = fetch_blocks(store, params, in_set, memo)
    KV_ROWS_READ.inc(blocks["weight"].null_count() if "weight" in blocks.columns else len(blocks))  # not stand-ins
    resets = fetch_resets(store, params)
    if memo is not None:
        memo.move(blocks, resets, epoch_ms(frame["ts"].max()), kept=skipped, lookback_ms=lookback)
    return frame_evidence(frame, chains, fetch_first_events(store, params), blocks, resets,
                          fetch_model_pods(store, params), lookback, sizes, default_block_size)


def frame_evidence(frame: pl.DataFrame, chains: pl.DataFrame, first: pl.DataFrame, blocks: pl.DataFrame,
                   resets: pl.DataFrame, model_pods: pl.DataFrame, lookback_ms: int | None = None,
                   sizes: pl.DataFrame | None = None, default_block_size: int = 0) -> EvidenceFrames | None:
    """:func:`chunk_evidence` once its rows are read (pure): ``frame`` as there; ``chains``
    (:func:`fetch_chains`), ``first`` (:func:`fetch_first_events`), ``blocks`` (:func:`fetch_blocks`), ``resets``
    (:func:`fetch_resets`), ``model_pods`` (:func:`fetch_model_pods`; without columns first and last every pair
    counts). ``lookback_ms``: a pod covers a request arriving at t when it has a KV event in [t − lookback, t], and
    serves its model when it served it in [t − lookback, end] (None: no start), so neither depends on the other
    requests read with it. When ``frame`` has the predecessor's pod (column p_pod, as the job's frames do), the
    covered pods are looked for among it alone (the only one the judge asks about: a cross product with every pod
    of a large fleet cost memory per request and pod). ``sizes`` (:func:`ingest.block_sizes.changes`,
    ``default_block_size`` for a pod without any; None: every pod): a pod covers a request only when its block size
    at the arrival equals the request's chain block size; a pod with another size hashes other blocks (vLLM hashes
    each full block of its own size), so its events can say nothing about the request's chain, and a prefix it held
    is not proved gone by them. The evidence of each request equals :func:`request_evidence` over a
    :class:`KvTimeline` of the same rows, given those pods."""
    end = _end()
    since = pl.lit(None, pl.Int64) if lookback_ms is None else pl.col("t") - lookback_ms
    kv_since = pl.lit(None, pl.Int64) if lookback_ms is None else lookback_start(pl.col("t"), lookback_ms)
    rows = (frame.filter(pl.col("cached_tokens").is_not_null() & (pl.col("status").fill_null(0) < 400)
                         & (pl.col("prompt_tokens") > pl.col("cached_tokens")))
            .select("request_id", pl.col("ts").dt.epoch("ms").alias("t"), end.alias("end"),
                    pl.col("pod").cast(pl.String), pl.col("model").cast(pl.String),
                    pl.col("prompt_tokens").cast(pl.Int64), pl.col("cached_tokens").cast(pl.Int64),
                    pl.col("block_size").cast(pl.Int64),
                    *([pl.col("p_pod").cast(pl.String)] if "p_pod" in frame.columns else []),
                    *([pl.col("pods_down").cast(pl.List(pl.String))] if "pods_down" in frame.columns else []))
            .with_columns(since.alias("since"), kv_since.alias("kv_since"))
            .join(chains, on=["request_id", "t"] if "t" in chains.columns else "request_id", how="inner")
            .filter(pl.col("chain_block_size") == pl.col("block_size")))
    rows = rows.filter(seen_between(rows, first, ["pod"], "since", "t")).with_row_index("rid")
    if rows.is_empty():
        return None
    b = pl.col("chain_block_size")
    k0 = pl.col("cached_tokens") // b
    last = pl.min_horizontal(pl.col("chain").list.len().cast(pl.Int64), (pl.col("prompt_tokens") - 1).clip(0) // b)
    count = pl.max_horizontal(last - k0, 0)
    asks = (rows.select("rid", "pod", "model", "t", "end", pl.col("kv_since").alias("since"),
                        pl.int_ranges(0, count).alias("i"),
                        pl.col("chain").list.slice(k0, count).alias("chain"))
            .explode("i", "chain").drop_nulls("i")
            .select("rid", "i", "chain", "pod", "model", "t", "end", "since"))
    if "first" in model_pods.columns:
        asks, model_pods = _served_by_then(rows, asks, model_pods)
    statuses = kv_tracks.block_statuses(blocks, resets, asks, model_pods, first_nowhere=True)
    if "pods_down" in rows.columns:
        statuses = _up_holders_first(rows, asks, statuses, blocks, resets, model_pods)
    if "p_pod" in rows.columns:  # only the predecessor's pod is asked about (attribution_batch): rows × 1, not × pods
        pods = rows.select("rid", "t", "since", pl.col("p_pod").alias("covered")).drop_nulls("covered")
    else:
        pods = rows.select("rid", "t", "since").join(first.select(pl.col("pod").alias("covered")).unique(),
                                                     how="cross")
    pods = pods.filter(seen_between(pods.rename({"covered": "pod"}), first, ["pod"], "since", "t"))
    if sizes is not None and not pods.is_empty():
        pods = (pods.with_columns(block_sizes.at_ms(pods.select(pl.col("covered").alias("pod"), "t"), sizes,
                                                    default_block_size).alias("size"))
                .join(rows.select("rid", "chain_block_size"), on="rid")
                .filter(pl.col("size") == pl.col("chain_block_size")))
    pods = pods.group_by("rid").agg(pl.col("covered").sort())
    requests = (rows.select("rid", "request_id", "t", pl.col("chain_block_size").alias("block_size"))
                .join(pods, on="rid", how="left"))
    found = (kv_tracks.until_nowhere(statuses).join(requests.select("rid", "request_id", "t"), on="rid")
             .select("request_id", "t", "i", "state", "pod", "removed_at"))
    return EvidenceFrames(requests.drop("rid"), found)


def _up_holders_first(rows: pl.DataFrame, asks: pl.DataFrame, statuses: pl.DataFrame, blocks: pl.DataFrame,
                      resets: pl.DataFrame, model_pods: pl.DataFrame) -> pl.DataFrame:
    """``statuses`` (:func:`ingest.kv_tracks.block_statuses` of ``asks``) with each block resident elsewhere named by
    a holder the gateway did not find down when the request was routed (``rows``' pods_down), whenever one holds it:
    as :meth:`KvTimeline.status` with ``down``. The asks whose first answer names a down pod are asked again with
    that request's down pods left out of those that count (each such request its own model key, longer than any
    other key so none is shared); a second answer of ``resident_elsewhere`` replaces the holder, any other keeps the
    first (only down pods hold the block). Costs nothing when no request logged a down pod."""
    down = rows.select("rid", "pods_down").filter(pl.col("pods_down").list.len() > 0)
    if down.is_empty():
        return statuses
    again = (statuses.with_row_index("_at").join(down, on="rid", how="inner")
             .filter((pl.col("state") == RESIDENT_ELSEWHERE) & pl.col("pods_down").list.contains(pl.col("pod"))))
    if again.is_empty():
        return statuses
    width = 1 + max(asks["model"].cast(pl.String).str.len_bytes().max() or 0,
                    model_pods["model"].cast(pl.String).str.len_bytes().max() or 0)
    key = pl.lit("\x1e" * width) + pl.col("rid").cast(pl.String)
    asked = (asks.join(again.select("rid", "i", "_at"), on=["rid", "i"], how="inner")
             .with_columns(pl.col("model").cast(pl.String)))
    pairs = (asked.select("rid", "model").unique()
             .join(model_pods.select(pl.col("model").cast(pl.String), pl.col("pod").cast(pl.String)).unique(),
                   on="model", how="inner")
             .join(down, on="rid", how="inner").filter(~pl.col("pods_down").list.contains(pl.col("pod")))
             .select(key.alias("model"), "pod"))
    answers = kv_tracks.block_statuses(blocks, resets, asked.with_columns(key.alias("model")).drop("_at"), pairs)
    up = (answers.with_columns(asked["_at"]).filter(pl.col("state") == RESIDENT_ELSEWHERE)
          .select("_at", pl.col("pod").alias("_up")))
    return (statuses.with_row_index("_at").join(up, on="_at", how="left", maintain_order="left")
            .with_columns(pl.coalesce("_up", "pod").alias("pod")).drop("_at", "_up"))


def _served_by_then(rows: pl.DataFrame, asks: pl.DataFrame, model_pods: pl.DataFrame
                    ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(``asks`` with model replaced by a key of the pods that served the request's model within its lookback and
    by its end, (key, pod) pairs of those pods): :func:`ingest.kv_tracks.block_statuses` then counts a holder
    elsewhere only among them. Requests with the same model and pods share a key (each name length-prefixed, so a
    name holding a separator cannot make two keys one)."""
    pairs = (rows.select("rid", "model", "since", "end")
             .join(model_pods.select("model", "pod").unique(), on="model", how="inner"))
    pairs = pairs.filter(seen_between(pairs, model_pods, ["model", "pod"], "since", "end"))

    def spelled(name: pl.Expr) -> pl.Expr:  # length-prefixed: no name, whatever bytes it holds, runs into the next
        return name.str.len_bytes().cast(pl.String) + ":" + name

    keys = (pairs.group_by("rid").agg(pl.col("model").first(), pl.col("pod").sort())
            .select("rid", (spelled(pl.col("model")) + pl.col("pod").list.eval(spelled(pl.element())).list.join(""))
                    .alias("key"), "pod"))
    asks = (asks.join(keys.select("rid", "key"), on="rid", how="left", maintain_order="left")
            .with_columns(pl.col("key").fill_null("\x1f").alias("model")).drop("key"))
    served = keys.select(pl.col("key").alias("model"), "pod").unique("model").explode("pod")
    return asks, served
