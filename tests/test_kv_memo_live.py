"""Precise mode's memo kept across the live job's runs (ingest/kv_evidence.py ``KvMemo(across_runs_lag_ms=...)``,
``attribution_loop``): a run reads its hot blocks' rows since the last run's cut instead of their whole history,
and the answers are those of one run from scratch without any memo. Real chDB, KV events fed the production way
(ZMQ frames → collector → queue → ingester → kv_block_log), requests inserted as a gateway logs them (when they
end, so some arrive before the last run's cut), with KV events arriving late between runs."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import pytest
import test_kv_memo_hostile as hostile
from test_attribution_job import insert_requests
from test_attribution_precise import answers, tokens
from test_kv_memo_hostile import B, N, _rows_read, frames, remove_event, request, serving, store_event
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes

LAG_MS = 2_000


def from_scratch(store: Store, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The answers of one run over everything, no memo."""
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, chunk_size=10**6)
    return answers(store)


def live(store: Store, monkeypatch: pytest.MonkeyPatch, batches: list[list[dict[str, Any]]],
         between: dict[int, list[list[bytes]]] | None = None, lag: int = LAG_MS
         ) -> tuple[dict, list[bool], list[float]]:
    """Insert each batch of requests and run the job (chunks of 8, every hash hot from its first row) with one memo
    kept across the runs (cuts ``lag`` ms before each run's last arrival); ``between``: KV messages ingested before
    batch i. Returns (answers, whether the memo held
    rows after each run, log rows read by each run)."""
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 1)
    # the events are stamped long before they are ingested (a history): with the default overlap every run would
    # count those ingested in the 5 minutes before the last run as late, and start the memo again
    monkeypatch.setattr(kv_evidence, "ACROSS_RUNS_OVERLAP", timedelta(0))
    memo = kv_evidence.KvMemo(across_runs_lag_ms=lag)
    held, read = [], []
    for i, batch in enumerate(batches):
        for msgs in (between or {}).get(i, []):
            ingest(store, collect(msgs))
        stamp = attribution_job.server_now(store)  # as ingested now (the rows' import-time stamp may be minutes old)
        insert_requests(store, [{**r, "ingested_at": stamp} for r in batch])
        before = _rows_read()
        attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, chunk_size=8, memo=memo)
        held.append(memo.holds_any())
        read.append(_rows_read() - before)
    return answers(store), held, read


@pytest.mark.parametrize(("seed", "mixed", "busy", "batch", "lag"), [(31, False, 0.3, 8, LAG_MS),
                                                                     (33, True, 0.4, 24, 15_000)])
def test_live_runs_with_a_memo_kept_across_them_answer_as_one_run_from_scratch(
        store: Store, monkeypatch: pytest.MonkeyPatch, seed: int, mixed: bool, busy: float, batch: int,
        lag: int) -> None:
    """A generated hostile fleet (tests/test_kv_memo_hostile.py: resets, restarts, removals of blocks never
    stored, two engines and media, rows written twice; with ``mixed`` a pod hashing its own way) whose requests
    are logged when they end (arrival + e2e, up to 900 s: some arrive long before the last run's cut), 8 at a
    time (a run of one chunk, cuts 2 s before the last arrival), or 24 (three chunks; cuts 15 s before: before the
    cut of the chunk before the last), a run after each: the same answers as one run from scratch, and the memo
    held rows between runs."""
    rows: list[dict[str, Any]] = []
    monkeypatch.setattr(hostile, "insert_requests", lambda _store, batch: rows.extend(batch))
    hostile._hostile_fleet(store, seed, mixed=mixed, busy=busy)
    rows.sort(key=lambda r: r["ts"].timestamp() + (r.get("e2e_ms") or 0) / 1000)
    got, held, _ = live(store, monkeypatch, [rows[i:i + batch] for i in range(0, len(rows), batch)], lag=lag)
    assert any(held), held
    want = from_scratch(store, monkeypatch)
    judged = [v for v in want.values() if v[1] == "kv_events"]
    assert len(judged) > 80 and {"evicted", "routed_away"} <= {c for cs, *_ in judged for c, _, _ in cs}
    assert got == want


def test_kv_events_arriving_late_between_runs_start_the_memo_again(store: Store,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod l-a stored and evicted a prompt's blocks from 1 s to 3.25 s and stored them again at 3.5 s (hot); pod l-b
    logs KV events of its own. Run 1 judges requests on l-b at 10–11 s (routed_away: l-a held the prompt) and
    keeps the prompt's rows before its cut (~9 s). Then l-a's collector replays a batch it had lost: a removal at
    8 s, before the cut. Run 2 judges requests on l-b at 12 s: l-a no longer held the prompt, so they are cold,
    not routed_away (a memo that did not start again would still hold the prompt's old stand-ins), and its late
    KV pass answers run 1's requests again (cold too); run 3 (13 s) as well. The same answers as one run from
    scratch."""
    scenario = 86
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    other = tokens(scenario, B, 9)
    ingest(store, collect([frames("l-b", 1, 0.5, store_event(other, chain_hashes(other, B))),
                           *hostile._churn("l-a", prompt, names, 1, 5)]))
    first = [serving(scenario, "l-a"), *(request(f"a{i}", scenario, 10 + i * 0.1, "l-b", prompt) for i in range(10))]
    second = [request(f"b{i}", scenario, 12 + i * 0.01, "l-b", prompt) for i in range(4)]
    third = [request(f"c{i}", scenario, 13 + i * 0.01, "l-b", prompt) for i in range(4)]
    late = [[frames("l-a", 12, 8.0, remove_event(names))]]
    got, held, _ = live(store, monkeypatch, [first, second, third], between={1: late})
    assert held[0], "run 1 kept nothing: the case does not test the memo"
    want = from_scratch(store, monkeypatch)
    assert {want[f"{p}{i}"][0][0][0] for p in "abc" for i in range(4)} == {"cold"}
    assert got == want


def test_a_kept_memo_reads_a_churned_prompt_once_and_the_loop_keeps_one(store: Store,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod k-a stored and evicted a prompt 8 times before the requests (17 rows per block); requests on k-b in
    six runs a second apart. The first run reads the prompt's history; the later ones read none of it again (a memo
    per run would read it all every run), with the answers of one run from scratch. ``attribution_loop`` passes
    one memo kept across runs (lagging by MAX_END_MS) to every run (the real job, watched)."""
    scenario = 87
    rnd = random.Random(5)
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    other = tokens(scenario, B, 9)
    ingest(store, collect([frames("k-b", 1, 0.5, store_event(other, chain_hashes(other, B))),
                           *hostile._churn("k-a", prompt, names, 1, 8)]))
    batches = [[serving(scenario, "k-a"), request("k-first", scenario, 9.0, "k-b", prompt)]] + [
        [request(f"k{j}-{i}", scenario, 10 + 3 * j + rnd.random() * 0.5, "k-b", prompt) for i in range(3)]
        for j in range(6)]
    got, held, read = live(store, monkeypatch, batches)
    assert all(held), held
    assert read[0] >= N * 17 and all(r < N for r in read[1:]), read
    assert got == from_scratch(store, monkeypatch)

    memos: list[Any] = []
    real = attribution_job.run_attribution
    stop = threading.Event()

    def watched(*args: Any, **kwargs: Any) -> Any:
        memos.append(kwargs.get("memo"))
        if len(memos) == 2:
            stop.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(attribution_job, "run_attribution", watched)
    attribution_job.attribution_loop(store, stop, interval_seconds=0.01, default_block_size=B)
    assert len(memos) == 2 and memos[0] is memos[1] and isinstance(memos[0], kv_evidence.KvMemo)
    assert memos[0]._lag == kv_evidence.MAX_END_MS
