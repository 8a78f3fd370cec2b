"""One stored identity, one answer: gateway_requests may hold two equal rows of one (request_id, ts) (two ingesters
inserting the same redelivered row at the same instant during a Kafka rebalance, docs/reliability.md, or a row
inserted twice by hand). The attribution job (ingest/attribution_job.py) must still keep exactly one current answer
per identity (its rows' signs sum to 1, one version current), the same answer as with one copy, in any chunking,
with or without the memo, live or from scratch, and when a late predecessor makes it judge the request again.
Real chDB; KV events fed the production way (ZMQ frames → collector → ingester)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from test_attribution_job import gw, insert_requests
from test_attribution_precise import answers
from test_kv_evidence_horizon import attribute
from test_kv_memo_hostile import B, N, frames, remove_event, request, serving, store_event, tokens
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes


def current_answers(store: Store) -> dict[tuple[str, Any], tuple[int, int, int]]:
    """(request_id, ts) → (sum of its rows' signs, how many versions sum above 0, sign-weighted missed tokens)."""
    rows = store.query_rows(
        "SELECT request_id, ts, sum(sign), "
        "uniqExactIf(version, v_sign > 0), sum(toInt64(arraySum(missed_tokens)) * sign) FROM "
        "(SELECT *, sum(sign) OVER (PARTITION BY request_id, ts, version) AS v_sign FROM request_attribution) "
        "GROUP BY request_id, ts")
    return {(r[0], r[1]): (int(r[2]), int(r[3]), int(r[4])) for r in rows}


def assert_one_answer_each(store: Store) -> None:
    """Every identity of gateway_requests holds one current answer whose missed tokens are prompt − cached."""
    want = {(r[0], r[1]): int(r[2]) for r in store.query_rows(
        "SELECT request_id, ts, any(prompt_tokens) - any(ifNull(cached_tokens, 0)) FROM gateway_requests "
        "WHERE status < 400 GROUP BY request_id, ts")}
    got = current_answers(store)
    assert {k: v for k, v in got.items() if k in want} == {k: (1, 1, m) for k, m in want.items()}, got


def test_two_equal_rows_of_one_request_get_one_answer_in_fingerprint_mode(store: Store) -> None:
    """`same` (762 prompt tokens, nothing cached) is stored twice, its predecessor `base` once: before, the job
    wrote two answers for it (signs summing to 2, 1,524 missed tokens counted); now one (47 blocks of 16 evicted, 10
    tokens unavoidable), the same as with one copy,
    also when run again (the copy is not answered a second time)."""
    same = gw("same", at=1)
    insert_requests(store, [gw("base", at=0), same, same])
    attribution_job.run_attribution(store, settle_seconds=0)
    assert_one_answer_each(store)
    one = store.query_rows("SELECT causes, missed_tokens FROM request_attribution WHERE request_id = 'same'")
    assert [(list(c), list(m)) for c, m in one] == [(["evicted", "unavoidable"], [752, 10])]  # blocks of 16
    attribution_job.run_attribution(store, settle_seconds=0)
    assert_one_answer_each(store)


def _evicted_twice_stored(store: Store, scenario: int) -> None:
    """Pod c-a stores the prompt (N blocks) at 1 s and removes it at 4 s; c-b serves the model. `r` (5 s on c-a)
    is stored twice, `s` (6 s on c-a, the same prompt) once."""
    prompt = tokens(scenario, N * B)
    ingest(store, collect([frames("c-a", 1, 1.0, store_event(prompt, chain_hashes(prompt, B))),
                           frames("c-a", 2, 4.0, remove_event(chain_hashes(prompt, B)))]))
    r = request("r", scenario, 5.0, "c-a", prompt)
    insert_requests(store, [serving(scenario, "c-a"), serving(scenario, "c-b", t=0.2), r, r,
                            request("s", scenario, 6.0, "c-a", prompt)])


@pytest.mark.parametrize("chunk_size,memo", [(10**6, False), (1, False), (1, True)], ids=["whole", "1", "1-memo"])
def test_two_equal_rows_of_one_request_get_one_answer_in_precise_mode(
        store: Store, monkeypatch: pytest.MonkeyPatch, chunk_size: int, memo: bool) -> None:
    """Precise mode reads the copies' chains too (kv_evidence.fetch_chains): each copy's blocks were asked twice.
    `r` is evicted (4 s, c-a) once, with N·B missed tokens beside its 20 unavoidable ones."""
    _evicted_twice_stored(store, 93)
    got = attribute(store, monkeypatch, chunk_size, memo=memo)
    assert_one_answer_each(store)
    assert got["r"][:3] == ([("evicted", "", N * B), ("unavoidable", "", 20)], "kv_events", "c-a"), got["r"]


def test_a_request_stored_twice_and_judged_again_by_a_late_predecessor_keeps_one_answer(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """`late` (0.5 s on pod-b) is ingested after `same` (1 s on pod-a, stored twice) was answered `cold`: the job
    judges `same` again. Before, each copy's new verdict cancelled the one current answer (signs −1, −1) and added
    its own (+1, +1). Now it changes once, to what a run from scratch says."""
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    same = gw("same", at=1)
    for rows in ([same, same], [gw("late", at=0.5, pod="pod-b")]):
        now = attribution_job.server_now(store) - timedelta(milliseconds=1)
        insert_requests(store, [{**row, "ingested_at": now} for row in rows])
        attribution_job.run_attribution(store, settle_seconds=0)
        assert_one_answer_each(store)
    live = answers(store)
    assert live["same"][0] == [("routed_away", "", 752), ("unavoidable", "", 10)], live
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    attribution_job.run_attribution(store, settle_seconds=0)
    assert answers(store) == live
    assert_one_answer_each(store)


def test_a_copy_ingested_after_its_request_was_answered_is_not_answered_again(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second copy of `same` lands a run later (a redelivery the dedup check let through): the answer stays
    the one there was."""
    same = gw("same", at=1)
    for rows in ([gw("base", at=0), same], [same]):
        now = attribution_job.server_now(store) - timedelta(milliseconds=1)
        insert_requests(store, [{**row, "ingested_at": now} for row in rows])
        attribution_job.run_attribution(store, settle_seconds=0)
        assert_one_answer_each(store)
