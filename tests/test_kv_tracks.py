"""Precise mode column-wise (ingest/kv_tracks.py, ingest/kv_evidence.frame_evidence, ingest/attribution_batch)
gives exactly what the readable reference gives (ingest/kv_evidence.KvTimeline + request_evidence, then
ingest/attribution.judge per request), on generated histories: stores and removals (also of copies stored before
the evidence), cache resets and restarts (some at the same millisecond as block events), several pods, engines
and media, a pod whose vLLM hashes differ from kvscope's chain hashes, holders of another model, partial hits,
chains at another block size, and requests whose blocks leave while they wait."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import polars as pl
import pytest
from test_attribution import random_requests
from test_attribution_batch import check_equal

from ingest import attribution as a
from ingest import kv_evidence, kv_tracks
from ingest.attribution_batch import EvidenceFrames

PODS = ("pod-a", "pod-b", "pod-c", "pod-x")  # pod-x serves another model
SIZES = {"pod-a": 32, "pod-b": 16, "pod-c": 16, "pod-x": 16}
MODEL_PODS = {"tiny": ("pod-a", "pod-b", "pod-c"), "other": ("pod-x",)}
T0 = 1_800_000_000_000  # unix ms of the traffic's start


def chain_of(prefix: int, n: int) -> list[int]:
    """n chain hashes of a prefix family (requests of one family share their leading blocks)."""
    return [prefix * 1000 + j + 1 for j in range(n)]


def history(seed: int, reqs: list[dict[str, Any]]) -> tuple[list[kv_evidence.BlockRow], list[kv_evidence.ResetRow],
                                                              dict[str, tuple[list[int], int]]]:
    """(block rows, reset rows, request_id → (chain, chain block size)) around ``reqs``: each request logs the
    chain of one of 5 prefix families at its pod's block size (1 in 10 at twice it), and the pods store, remove and
    reset those blocks at random times, many near the requests' arrivals and ends."""
    rnd = random.Random(seed)
    chains: dict[str, tuple[list[int], int]] = {}
    for r in reqs:
        size = SIZES[r["pod"]] * (2 if rnd.random() < 0.1 else 1)
        if rnd.random() < 0.9:
            chains[r["request_id"]] = (chain_of(rnd.randrange(5), max(1, r["prompt_tokens"] // size)), size)
    times = [round(r["ts"].timestamp() * 1000) for r in reqs]
    rows: list[kv_evidence.BlockRow] = []
    seq = {p: 0 for p in PODS}

    def when() -> int:
        t = rnd.choice(times)
        return rnd.choice([t, t - 1, t + 1, t + rnd.randint(-3000, 3000), t + rnd.randint(1, 400),
                           T0 + rnd.randint(-2000, 5_100_000)])

    for _ in range(rnd.randint(300, 1500)):
        pod, engine, medium = rnd.choice(PODS), rnd.choice(["0", "0", "1"]), rnd.choice(["GPU", "GPU", "CPU"])
        family, first = rnd.randrange(5), rnd.randrange(0, 100)
        hashes = chain_of(family, first + rnd.randint(1, 8))[first:]
        ts, kind = when(), rnd.choice(["stored", "stored", "removed"])
        seq[pod] += 1
        for pos, h in enumerate(hashes):
            vh = h ^ 0x5A5A if pod == "pod-c" else h  # pod-c hashes blocks its own way: paired by vLLM hash
            rows.append((pod, engine, medium, vh, h if kind == "stored" else 0, ts, seq[pod], rnd.randint(0, 1),
                         pos, kind))
    for r in rnd.sample(reqs, len(reqs) // 4):  # blocks a request missed, stored before it, removed near its end
        if r["request_id"] not in chains or r["pod"] == "pod-c":
            continue
        chain, size = chains[r["request_id"]]
        k0 = (r["cached_tokens"] or 0) // size
        t = round(r["ts"].timestamp() * 1000)
        for ts, kind in ((t - rnd.randint(1, 5000), "stored"), (t + rnd.randint(0, int(r["e2e_ms"]) + 200), "removed")):
            seq[r["pod"]] += 1
            rows.extend((r["pod"], "0", "GPU", h, h if kind == "stored" else 0, ts, seq[r["pod"]], 0, pos, kind)
                        for pos, h in enumerate(chain[k0:k0 + 3]))
    rows = sorted(set(rows), key=lambda row: (*row[:4], *row[5:]))  # kv_block_log's order (fetch_blocks)
    stamps = [row[5] for row in rows]  # resets at block events' milliseconds too
    resets = [(pod, rnd.choice(["0", "1"]), rnd.choice([rnd.choice(stamps), when()]), rnd.randint(0, 5000), 0,
               rnd.choice(["cleared", "restart"])) for pod in PODS for _ in range(rnd.randint(0, 4))]
    return rows, resets, chains


def traffic(seed: int) -> list[dict[str, Any]]:
    """random_requests on PODS' first three, a fifth of them of model 'other' on pod-x, waits up to 5 s."""
    rnd = random.Random(seed + 100)
    reqs = random_requests(300, seed)
    for r in reqs:
        r["e2e_ms"] = rnd.choice([0.0, 400.0, float(rnd.randint(0, 5000))])
        r["ts"] = datetime.fromtimestamp(T0 / 1000 + r["ts"].timestamp() % 100000, UTC)
        if rnd.random() < 0.2:
            r["model"], r["pod"] = "other", "pod-x"
    return reqs


def reference(reqs: list[dict[str, Any]], rows: list[kv_evidence.BlockRow], resets: list[kv_evidence.ResetRow],
              chains: dict[str, tuple[list[int], int]], sizes: dict[str, int], lookback: int | None = None
              ) -> dict[str, a.KvEvidence]:
    """The reference evidence, request by request, with chunk_evidence's selection rules; ``lookback`` (ms): each
    request sees the block events from its evidence start on (kv_evidence.lookback_start: its arrival less it,
    rounded up to a step), and a pod covers it with an event in [t − lookback, t]."""
    stamps: dict[str, list[int]] = {}
    for pod, *_rest in rows:
        stamps.setdefault(pod, []).append(_rest[4])
    for pod, _e, ts, *_ in resets:
        stamps.setdefault(pod, []).append(ts)
    timeline = kv_evidence.KvTimeline(rows, resets)
    out = {}
    for r in reqs:
        t = round(r["ts"].timestamp() * 1000)
        since = None if lookback is None else t - lookback
        first = {pod: min(s for s in times if since is None or s >= since) for pod, times in stamps.items()
                 if any(since is None or s >= since for s in times)}
        if (r["request_id"] not in chains or r["cached_tokens"] is None or r["status"] >= 400
                or r["prompt_tokens"] <= r["cached_tokens"] or first.get(r["pod"], 2**62) > t):
            continue
        chain, size = chains[r["request_id"]]
        if size != sizes[r["pod"]]:
            continue
        out[r["request_id"]] = kv_evidence.request_evidence(
            timeline, pod=r["pod"], ts_ms=t, chain=chain, chain_block_size=size, prompt_tokens=r["prompt_tokens"],
            cached_tokens=r["cached_tokens"], model_pods=MODEL_PODS[r["model"]],
            covered_pods=kv_evidence.covered(first, t), end_ms=t + int(min(max(r["e2e_ms"] or 0, 0), 600_000)),
            since_ms=None if lookback is None else kv_evidence.lookback_start(t, lookback),
            down=r.get("pods_down") or ())
    return out


def columnwise(reqs: list[dict[str, Any]], rows: list[kv_evidence.BlockRow], resets: list[kv_evidence.ResetRow],
               chains: dict[str, tuple[list[int], int]], sizes: dict[str, int], names: pl.DataType = pl.String,
               lookback: int | None = None) -> EvidenceFrames:
    """frame_evidence over the same rows, as chunk_evidence would read them (the block rows' names as ``names``:
    strings, or categoricals as the store's LowCardinality columns read as Arrow dictionaries); ``lookback`` (ms):
    each request's window starts that long before its arrival (a pod's every event time is a span of its own)."""
    frame = pl.DataFrame([{**r, "block_size": sizes[r["pod"]]} for r in reqs], infer_schema_length=None).with_columns(
        pl.col("ts").dt.cast_time_unit("ms"))
    blocks = pl.DataFrame(rows, schema=list(zip(
        ("pod", "engine", "medium", "block_hash", "chain", "ts", "seq", "idx", "pos", "kind"),
        (pl.String, pl.String, pl.String, pl.UInt64, pl.UInt64, pl.Int64, pl.UInt64, pl.UInt32, pl.UInt32, pl.String),
        strict=True)), orient="row").with_columns(pl.col("pod", "engine", "medium", "kind").cast(names))
    blocks = kv_evidence.in_log_order(blocks)  # by block hash first, as fetch_blocks sorts them
    reset_frame = pl.DataFrame(resets, schema=list(zip(("pod", "engine", "ts", "seq", "idx", "kind"), (
        pl.String, pl.String, pl.Int64, pl.UInt64, pl.UInt32, pl.String), strict=True)), orient="row")
    stamps = pl.concat([blocks.select(pl.col("pod").cast(pl.String), "ts"), reset_frame.select("pod", "ts")])
    first = (stamps.group_by("pod").agg(pl.col("ts").min().alias("first")) if lookback is None
             else stamps.unique().rename({"ts": "first"}))
    chain_frame = pl.DataFrame([(rid, c, s) for rid, (c, s) in chains.items()], orient="row", schema={
        "request_id": pl.String, "chain": pl.List(pl.UInt64), "chain_block_size": pl.Int64})
    model_pods = pl.DataFrame([(m, p) for m, pods in MODEL_PODS.items() for p in pods], orient="row",
                              schema={"model": pl.String, "pod": pl.String})
    frames = kv_evidence.frame_evidence(frame, chain_frame, first, blocks, reset_frame, model_pods, lookback)
    assert frames is not None
    return frames


@pytest.mark.parametrize(("seed", "names"), [(seed, pl.String) for seed in range(6)]
                         + [(seed, pl.Categorical) for seed in range(2)])
def test_column_wise_evidence_and_verdicts_equal_the_reference(seed: int, names: pl.DataType) -> None:
    reqs = traffic(seed)
    rows, resets, chains = history(seed, reqs)
    sizes = SIZES
    want = reference(reqs, rows, resets, chains, sizes)
    twice = sorted(rows + rows[::97], key=lambda row: (*row[:4], *row[5:]))  # rows written twice count once
    frames = columnwise(reqs, twice, resets, chains, sizes, names)
    got = frames.to_mapping()
    assert set(got) == set(want)
    for rid, evidence in want.items():
        assert got[rid] == evidence, rid
    states = {b.state for e in want.values() for b in e.blocks}
    assert states == set(a.BLOCK_STATES), states  # the histories reach every state
    assert any(b.state in (a.REMOVED_HERE, a.RESET_HERE) and b.removed_at and b.removed_at.timestamp() * 1000 >= t
               for r in reqs if (e := want.get(r["request_id"]))
               for b, t in ((b, r["ts"].timestamp() * 1000) for b in e.blocks))  # left while it waited
    # the verdicts: the column-wise judge over the column-wise evidence, the reference judge over its own
    check_equal(reqs, sizes, want, frames=frames)


@pytest.mark.parametrize(("seed", "lookback"), [(seed, lookback) for seed in range(4)
                                                 for lookback in (1500, 4000, 60_000, 1_500_000)])
def test_each_request_sees_the_events_from_its_own_lookback_start_as_the_reference(seed: int, lookback: int) -> None:
    """Windows that start inside the history (each request's arrival − lookback, the rows read reaching further
    back, as a chunk's do): the events and resets before a request's start are not its evidence (a copy stored
    before it is inferred from the removals in its window; a store before it names nothing), in the column-wise
    code as in the reference."""
    reqs = traffic(seed)
    rows, resets, chains = history(seed, reqs)
    want = reference(reqs, rows, resets, chains, SIZES, lookback)
    frames = columnwise(reqs, rows, resets, chains, SIZES, lookback=lookback)
    got = frames.to_mapping()
    assert set(got) == set(want)
    for rid, evidence in want.items():
        assert got[rid] == evidence, rid
    assert len(want) > 20
    if lookback:  # the start changes answers: with no start the same requests get others
        whole = reference(reqs, rows, resets, chains, SIZES)
        assert any(whole.get(rid) != evidence for rid, evidence in want.items())


def _frames(reqs: list[dict[str, Any]], blocks: pl.DataFrame, resets: pl.DataFrame, first: pl.DataFrame,
            chains: dict[str, tuple[list[int], int]]) -> dict[str, a.KvEvidence]:
    """frame_evidence's per-request evidence over these block rows (any order: sorted here as fetch_blocks
    sorts them) and ``first``."""
    frame = pl.DataFrame([{**r, "block_size": SIZES[r["pod"]]} for r in reqs], infer_schema_length=None).with_columns(
        pl.col("ts").dt.cast_time_unit("ms"))
    chain_frame = pl.DataFrame([(rid, c, s) for rid, (c, s) in chains.items()], orient="row", schema={
        "request_id": pl.String, "chain": pl.List(pl.UInt64), "chain_block_size": pl.Int64})
    model_pods = pl.DataFrame([(m, p) for m, pods in MODEL_PODS.items() for p in pods], orient="row",
                              schema={"model": pl.String, "pod": pl.String})
    frames = kv_evidence.frame_evidence(frame, chain_frame, first, kv_evidence.in_log_order(blocks), resets,
                                        model_pods)
    return {} if frames is None else frames.to_mapping()


def _as_frames(rows: list[kv_evidence.BlockRow], resets: list[kv_evidence.ResetRow], names: pl.DataType = pl.String
               ) -> tuple[pl.DataFrame, ...]:
    blocks = pl.DataFrame(rows, schema=list(zip(kv_tracks.BLOCK_COLUMNS, (
        pl.String, pl.String, pl.String, pl.UInt64, pl.UInt64, pl.Int64, pl.UInt64, pl.UInt32, pl.UInt32, pl.String),
        strict=True)), orient="row").with_columns(pl.col("pod", "engine", "medium", "kind").cast(names))
    reset_frame = pl.DataFrame(resets, schema=list(zip(kv_tracks.RESET_COLUMNS, (
        pl.String, pl.String, pl.Int64, pl.UInt64, pl.UInt32, pl.String), strict=True)), orient="row")
    first = (pl.concat([blocks.select(pl.col("pod").cast(pl.String), "ts"), reset_frame.select("pod", "ts")])
             .group_by("pod").agg(pl.col("ts").min().alias("first")))
    return blocks, reset_frame, first


@pytest.mark.parametrize(("seed", "names"), [(seed, pl.String) for seed in range(8)]
                         + [(seed, pl.Categorical) for seed in range(2)])
def test_a_summary_of_the_rows_before_a_cut_gives_every_later_arrival_the_same_evidence(seed: int,
                                                                                        names: pl.DataType) -> None:
    """kv_tracks.summarize: stand-in rows for everything before a cut, then the real rows after it, give every
    request arriving at or after the cut exactly the evidence of the whole log; and so does a summary of a
    summary plus the rows between two cuts (how kv_evidence.KvMemo moves from chunk to chunk), and a summary of
    rows written twice. Names as strings or as categoricals (the store's LowCardinality columns)."""
    reqs = traffic(seed)
    rows, resets, chains = history(seed, reqs)
    blocks, reset_frame, first = _as_frames(rows + rows[::53], resets, names)
    times = sorted(round(r["ts"].timestamp() * 1000) for r in reqs)
    rnd = random.Random(seed)
    c1 = times[len(times) // 4] - rnd.choice([0, 1, 700])
    c2 = times[len(times) // 2] - rnd.choice([0, 1, 2500])
    late = [r for r in reqs if round(r["ts"].timestamp() * 1000) >= c2]
    want = _frames(late, blocks, reset_frame, first, chains)
    assert len(want) > 20
    states = {b.state for e in want.values() for b in e.blocks}
    assert {a.RESIDENT_HERE, a.REMOVED_HERE, a.RESET_HERE, a.RESIDENT_ELSEWHERE} <= states, states

    after = blocks.filter(pl.col("ts") >= c2)
    once = kv_tracks.summarize(blocks, reset_frame, c2)
    assert once.group_by(kv_tracks._KEY).len()["len"].max() <= 5  # however many copies a block had
    got = _frames(late, pl.concat([once, after], how="diagonal_relaxed"), reset_frame, first, chains)
    assert got == want

    first_cut = kv_tracks.summarize(blocks, reset_frame, c1)
    between = blocks.filter((pl.col("ts") >= c1) & (pl.col("ts") < c2))
    twice = kv_tracks.summarize(pl.concat([first_cut, between], how="diagonal_relaxed"), reset_frame, c2)
    got = _frames(late, pl.concat([twice, after], how="diagonal_relaxed"), reset_frame, first, chains)
    assert got == want


@pytest.mark.parametrize("seed", range(3))
def test_holders_the_gateway_found_down_are_named_last(seed: int) -> None:
    """A block resident elsewhere is named by a holder that was up as the request was routed whenever one holds it
    (gateway_requests.pods_down), column-wise as in the reference; the traffic reaches both cases: a block only down
    pods held (routed_away / pod_down) and one whose first holder by name was down while another held it too."""
    reqs = traffic(seed)
    rows, resets, chains = history(seed, reqs)
    want = reference(reqs, rows, resets, chains, SIZES)
    by_name = reference([{**r, "pods_down": []} for r in reqs], rows, resets, chains, SIZES)
    got = columnwise(reqs, rows, resets, chains, SIZES).to_mapping()
    assert got == want
    down = {r["request_id"]: set(r["pods_down"]) for r in reqs}
    held_by_down = moved_up = 0
    for rid, evidence in want.items():
        for block, plain in zip(evidence.blocks, by_name[rid].blocks, strict=True):
            if block.state == a.RESIDENT_ELSEWHERE:
                held_by_down += block.pod in down[rid]
                moved_up += block.pod != plain.pod
                assert block.pod not in down[rid] or plain.pod in down[rid]
    assert held_by_down > 0 and moved_up > 0, (held_by_down, moved_up)
