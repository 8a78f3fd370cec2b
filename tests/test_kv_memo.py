"""Precise mode's evidence carried from chunk to chunk (ingest/kv_evidence.py ``KvMemo``) on real chDB, KV events
fed the production way (ZMQ frames → collector → queue → ingester → kv_block_log): a run in many chunks, each
reading a hot block's rows only from the last chunk's cut and the rows before it as stand-ins, gives exactly the
answers of reading every block's whole history for every chunk, and reads fewer rows."""

from __future__ import annotations

import random

import pytest
from prometheus_client import REGISTRY
from test_attribution_job import insert_requests
from test_attribution_precise import _PUBLISHED, HASHING, answers, gw, stored, tokens, vllm_removed
from test_kv_residency import CLEARED, collect, frames, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store

B = 32
N = 8


def _rows_read() -> float:
    return REGISTRY.get_sample_value("kvscope_attribution_kv_log_rows_read_total") or 0.0


def _random_fleet(store: Store, seed: int) -> None:
    """Three pods storing, removing and clearing the blocks of 4 prompt families over 100 s (vLLM's default
    hashing: the blocks' vLLM hashes are their chain hashes); 160 requests over those pods and families with
    partial hits, arriving while the blocks come and go."""
    rnd = random.Random(seed)
    scenario = 60 + seed
    pods = ["mm-a", "mm-b", "mm-c"]
    family = {f: tokens(scenario, N * B, f) for f in range(4)}
    msgs = []
    for p, pod in enumerate(pods):
        events = []
        for _ in range(80):
            f = rnd.randrange(4)
            names = [scenario * 100_000 + p * 10_000 + f * 100 + j for j in range(N)]
            roll = rnd.random()
            if roll < 0.55:
                n = rnd.randint(1, N)
                events.append((rnd.uniform(0, 100), stored(family[f][: n * B], B, names[0])))
            elif roll < 0.96:
                k = rnd.randint(0, N - 1)
                events.append((rnd.uniform(0, 100), ("remove", names[k:])))
            else:
                events.append((rnd.uniform(0, 100), CLEARED))
        events.sort(key=lambda e: e[0])
        for seq, (t, event) in enumerate(events, start=1):
            if isinstance(event, tuple):
                event = vllm_removed([n for n in event[1] if n in _PUBLISHED])
                if not event["block_hashes"]:
                    continue
            msgs.append(frames(pod, seq, t, event))
    ingest(store, collect(msgs))
    rows = []
    for i in range(160):
        f, pod = rnd.randrange(4), rnd.choice(pods)
        rows.append(gw(f"mm{seed}-{i}", scenario, t=rnd.uniform(5, 100), pod=pod,
                       prompt_ids=family[f] + tokens(scenario, 20, 10 + i), b=B, prompt=N * B + 20,
                       cached=rnd.choice([0, 0, B, 3 * B]), tenant=f"t{i % 7}", system=f"fam{f}",
                       system_tokens=N * B, suffix=f"q{i}", suffix_tokens=20))
    insert_requests(store, rows)


def _attribute(store: Store) -> tuple[dict, float]:
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    before = _rows_read()
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, chunk_size=16)
    return answers(store), _rows_read() - before


@pytest.mark.parametrize(("seed", "hot"), [(1, 1), (2, kv_evidence.MEMO_MIN_ROWS), (3, 3)])
def test_a_run_in_chunks_gives_the_answers_of_reading_every_blocks_whole_history(
        store: Store, seed: int, hot: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hash kept from its first row (hot 1), from the default or from its third: the same answers as no
    memo (no hash ever hot), in 10 chunks of 16 arrivals, and fewer kv_block_log rows read."""
    monkeypatch.setitem(HASHING, "mode", "default")
    _random_fleet(store, seed)
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", hot)
    with_memo, read_with = _attribute(store)
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    without, read_without = _attribute(store)
    assert with_memo == without
    assert read_with < read_without * 0.8, (read_with, read_without)
    judged = [v for v in without.values() if v[1] == "kv_events"]
    assert len(judged) > 60
    causes = {c for causes, evidence, *_ in judged for c, _, _ in causes}
    assert {"evicted", "routed_away", "cold"} <= causes, causes


def test_the_memo_starts_again_when_the_lookback_passes_its_rows() -> None:
    """A chunk whose last arrival's lookback starts after the earliest row a hash's stand-ins stand for gets no
    stand-ins for that hash (that request does not see those rows), and one that arrives before a cut none at all;
    a hash with a row before its cut less the lookback is not kept (the next arrivals' lookback starts after it)."""
    import polars as pl

    memo = kv_evidence.KvMemo()
    rows = pl.DataFrame({"pod": ["p"] * 10, "engine": ["e"] * 10, "medium": ["GPU"] * 10, "block_hash": [7] * 10,
                         "chain": [7, 0] * 5, "ts": list(range(1000, 1010)), "seq": list(range(10)),
                         "idx": [0] * 10, "pos": [0] * 10, "kind": ["stored", "removed"] * 5},
                        schema_overrides={"block_hash": pl.UInt64, "chain": pl.UInt64, "seq": pl.UInt64,
                                          "idx": pl.UInt32, "pos": pl.UInt32})
    resets = pl.DataFrame(schema={"pod": pl.String, "engine": pl.String, "ts": pl.Int64, "seq": pl.UInt64,
                                  "idx": pl.UInt32, "kind": pl.String})
    memo.move(rows, resets, 2000, kept=False)
    assert memo.holds_any() and memo.parameters() == {"memo": [7], "memo_cut": [2000]}
    memo.check(start_ms=1000, first_arrival_ms=2000)
    assert memo.holds_any()
    memo.check(start_ms=1001, first_arrival_ms=2000)  # the lookback moved past the row at 1000
    assert not memo.holds_any()
    later = rows.with_columns(pl.lit(8, pl.UInt64).alias("block_hash"), pl.col("ts") + 500,
                              pl.when(pl.col("kind") == "stored").then(8).otherwise(0).cast(pl.UInt64).alias("chain"))
    memo.move(pl.concat([rows, later]), resets, 2000, kept=False)
    memo.check(start_ms=1001, first_arrival_ms=2000)  # hash 7's rows lie before that start, hash 8's after
    assert memo.parameters() == {"memo": [8], "memo_cut": [2000]}
    assert set(memo.stand_ins_like(rows)["block_hash"]) == {8}
    memo.clear()
    memo.move(pl.concat([rows, later]), resets, 2000, kept=False, lookback_ms=700)  # 7 has rows before 2000 − 700
    assert memo.parameters() == {"memo": [8], "memo_cut": [2000]}
    memo.move(rows, resets, 2000, kept=False)
    memo.check(start_ms=0, first_arrival_ms=1999)  # an arrival before the cut
    assert not memo.holds_any()
    memo.move(rows, resets, 2000, kept=False)
    assert memo.holds_any()
    memo.last_chunk()  # no chunk follows the next: it summarizes nothing (a live run of one chunk pays nothing)
    memo.move(rows, resets, 3000, kept=True)
    assert not memo.holds_any()


def test_a_hash_with_events_older_than_the_lookback_is_read_whole_once_a_step(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookback 40 s over the fleet's 100 s of events, so most arrivals' lookback starts inside a hot hash's history.
    A request's block evidence starts at its lookback's start rounded up to a step (kv_evidence.lookback_start):
    with steps of 20 s (LOOKBACK_STEPS 2) the memo forgets a hash only when the step moves; with the exact start
    (steps of 1 ms) every chunk forgets it and reads its rows again. In both, the memo gives the answers of no memo,
    and the steps read fewer rows."""
    monkeypatch.setitem(HASHING, "mode", "default")
    _random_fleet(store, 4)
    job = {"lookback_seconds": 40, "horizon_seconds": 20}

    def run(memo_min_rows: int) -> tuple[dict, float]:
        monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", memo_min_rows)
        for table in ("request_attribution", "attribution_watermark"):
            store.command(f"TRUNCATE TABLE {table}")
        before = _rows_read()
        attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, chunk_size=16, **job)
        return answers(store), _rows_read() - before

    read = {}
    for steps in (2, 10**9):
        monkeypatch.setattr(kv_evidence, "LOOKBACK_STEPS", steps)
        (with_memo, read[steps]), (without, _) = run(3), run(10**9)
        assert with_memo == without, steps
        assert sum(v[1] == "kv_events" for v in without.values()) > 40
    print(f"kv_block_log rows read with the memo: steps of 20 s {read[2]:,.0f}, exact start {read[10**9]:,.0f}")
    assert read[2] < read[10**9] * 0.9, read
