"""A vLLM restart read from a ``publisher_restart`` gap report (kv_cache_resets' gap sources, sql/migrations/0030)
that reaches the store after the requests behind it were answered: gap reports travel on their own Kafka topic and
can lag the batches, and no late kv_block_events row comes with them. A replayed batch can later move such a
restart to the log's own (the new process's first batch). Either way the live answers equal a run from scratch,
and only the requests the restart can reach are judged again (ingest/attribution_late.py ``reset_targets``)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import answers, at, tokens
from test_kv_evidence_horizon import attribute
from test_kv_gap_hostile import report
from test_kv_memo_hostile import B, N, frames, request, serving, store_event
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.kv_evidence import MAX_END_MS, KvMemo
from ingest.store import Store
from kvscope.block_hash import chain_hashes

SCENARIO = 74


def _fleet(store: Store) -> list[int]:
    """Pod gr-a's old vLLM process stores the prompt at 1 s (seq 7); the restarted process's batches 0 and 1 are
    lost, its batch 2 at 4 s stores another block. Pod gr-b stores a prompt of its own. Requests: r (the prompt on
    gr-a at 10 s) and control (gr-b's prompt on gr-b at 10 s). Returns the prompt."""
    prompt = tokens(SCENARIO, N * B)
    other = tokens(SCENARIO, B, 9)
    own = tokens(SCENARIO, N * B, 5)
    ingest(store, collect([frames("gr-a", 7, 1.0, store_event(prompt, chain_hashes(prompt, B))),
                           frames("gr-a", 2, 4.0, store_event(other, chain_hashes(other, B))),
                           frames("gr-b", 0, 0.5, store_event(own, chain_hashes(own, B)))]))
    insert_requests(store, [serving(SCENARIO, "gr-a"), serving(SCENARIO, "gr-b"),
                            request("r", SCENARIO, 10.0, "gr-a", prompt),
                            request("control", SCENARIO, 10.0, "gr-b", own)])
    return prompt


def _late_report(store: Store) -> None:
    ingest(store, [report("gr-a", 0, 1, at(1.0).timestamp(), at(4.0).timestamp(), reason="publisher_restart")])


@pytest.mark.parametrize("memo", [False, True], ids=["no-memo", "memo"])
def test_a_late_restart_report_re_answers_the_requests_behind_it(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                                 memo: bool) -> None:
    """Before the report, r's prompt reads resident on gr-a at its arrival (the old process's store, no removal):
    `unknown / resident_at_arrival`. The report says gr-a restarted (its first stored batch, seq 2 at 4 s, starts
    the new process): r met a pod that lost the prompt in a restart, `evicted / cache_reset` at 4 s, as a run from
    scratch says. Only r is judged again: control's chain names no block gr-a stored. With a memo kept across runs
    (the live loop's), a request arriving after the report is judged with the restart too."""
    prompt = _fleet(store)
    # a later request of gr-b: the memo's cuts (its last arrival − MAX_END_MS) then lie after gr-a's restart
    insert_requests(store, [request("tick", SCENARIO, 10.0 + 3 * MAX_END_MS / 1000, "gr-b", tokens(SCENARIO, B, 5))])
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 1 if memo else 10**9)
    kept = KvMemo(across_runs_lag_ms=MAX_END_MS) if memo else None
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, memo=kept)
    assert answers(store)["r"][0][0][:2] == ("unknown", "resident_at_arrival")
    assert not memo or kept.latest_cut() > int(at(4.0).timestamp() * 1000)
    _late_report(store)
    # ingested now (the helpers stamp rows at the test module's import, which a long session leaves behind)
    insert_requests(store, [{**request("after", SCENARIO, 10.0 + 4 * MAX_END_MS / 1000, "gr-a", prompt),
                             "ingested_at": datetime.now(UTC)}])
    stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, memo=kept)
    live = answers(store)
    assert live["r"][0][0] == ("evicted", "cache_reset", N * B)
    assert live["r"][3] == at(4.0)
    assert live["after"][0][0][:2] == ("evicted", "cache_reset")
    assert (stats.arrivals, stats.examined, stats.changed) == (1, 1, 1)
    assert attribute(store, monkeypatch, 10**6, memo=memo) == live


def test_a_restart_moved_by_a_replayed_batch_re_answers_again(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the report, gr-a's lost batches arrive (replayed): its batch 0 at 2 s is the new process's first and
    marks the restart itself; the report's restart (at the batch that revealed the gap) is gone. r now lost its
    prompt at 2 s, as a run from scratch says; and once the set is saved, a run with nothing new judges nothing."""
    _fleet(store)
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    _late_report(store)
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    assert answers(store)["r"][3] == at(4.0)
    filler = tokens(SCENARIO, B, 11)
    ingest(store, collect([frames("gr-a", 0, 2.0, store_event(filler, chain_hashes(filler, B))),
                           frames("gr-a", 1, 3.0, store_event(filler, chain_hashes(filler, B)))]))
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    live = answers(store)
    assert live["r"][0][0] == ("evicted", "cache_reset", N * B)
    assert live["r"][3] == at(2.0)
    again = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    assert again.examined == 0
    assert attribute(store, monkeypatch, 10**6) == live
