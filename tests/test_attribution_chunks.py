"""How the attribution job cuts a run into chunks (ingest/attribution_job.py ``_chunk_bounds``): by weight, a request
that logged a block chain (judged on KV evidence in precise mode, which costs more memory) counting
``EVIDENCE_WEIGHT``, one without counting 1, so a chunk of chainless requests holds that many times more of them.
Real chDB; gateway rows inserted into gateway_requests."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import answers, tokens
from test_kv_memo_hostile import B, N, request, serving

from ingest import attribution_job
from ingest.store import Store

_EPOCH = attribution_job._EPOCH


def _rows(store: Store) -> list[tuple[int, int]]:
    """(order_key, weight) of every gateway row, a chained one weighing 5."""
    return [(int(k), 5 if size else 1) for k, size in
            store.query_rows("SELECT order_key, prompt_block_size > 0 FROM gateway_requests ORDER BY order_key")]


def _fleet(store: Store) -> None:
    """8 requests with a chain (scenario 120, one pod) and 20 without (each on its own pod)."""
    prompt = tokens(120, N * B)
    insert_requests(store, [*(request(f"c{i}", 120, 10.0 + i, "cw-a", prompt) for i in range(8)),
                            *(serving(120, f"cw-{i}", t=5.0 + i) for i in range(20))])


def test_chunks_weigh_a_request_with_a_chain_five_times(store: Store) -> None:
    """28 requests, 8 with a chain: 8·5 + 20 = 60 units, so a budget of 10 cuts 6 chunks of about 10 units each
    (within one request's weight: the cuts are weighted quantiles, at requests), and every request lies in one; a
    weight of 1 (fingerprint mode) cuts ceil(28 / 10) = 3."""
    _fleet(store)
    rows = _rows(store)
    upto = attribution_job.server_now(store) + timedelta(seconds=1)
    for weight, chunks in ((5, 6), (1, 3)):
        bounds = attribution_job._chunk_bounds(store, _EPOCH, upto, 10, weight)
        assert bounds[0] == rows[0][0] - 1 and bounds[-1] == rows[-1][0], bounds
        assert len(bounds) - 1 == chunks, (weight, bounds)
        per_chunk = [sum(w if weight == 5 else 1 for k, w in rows if lo < k <= hi)
                     for lo, hi in zip(bounds, bounds[1:], strict=False)]
        assert sum(per_chunk) == (60 if weight == 5 else 28), per_chunk
        assert all(0 < units < 10 + weight for units in per_chunk), (weight, per_chunk)


def test_a_run_without_a_chunk_size_cuts_by_weight_and_answers_the_same(store: Store,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's default chunks (``CHUNK_BUDGET`` units, here 10) are weighted in precise mode only, and the
    answers are those of one chunk."""
    _fleet(store)
    monkeypatch.setattr(attribution_job, "CHUNK_BUDGET", 10)
    for kv_evidence, chunks in ((True, 6), (False, 3)):
        store.command("TRUNCATE TABLE request_attribution")
        store.command("TRUNCATE TABLE attribution_watermark")
        stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, kv_evidence=kv_evidence)
        assert (stats.arrivals, stats.chunks) == (28, chunks), stats
        small = answers(store)
        store.command("TRUNCATE TABLE request_attribution")
        store.command("TRUNCATE TABLE attribution_watermark")
        attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, kv_evidence=kv_evidence,
                                        chunk_size=10**6)
        assert answers(store) == small


def test_a_window_of_more_chunks_than_one_query_can_name_is_cut_in_several_queries(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantile levels are written into the SQL text: 25,000 chunks (chunk_size 1 over a 25,000-request backlog)
    exceeded ClickHouse's max_query_size and every run failed the same way (found by trying to break the job). The
    levels go in several queries (here 7 per query, so the split is exercised on a small window): the bounds are
    the same as from one query."""
    _fleet(store)
    upto = attribution_job.server_now(store) + timedelta(seconds=1)
    whole = attribution_job._chunk_bounds(store, _EPOCH, upto, 1, 5)
    monkeypatch.setattr(attribution_job, "QUANTILE_LEVELS_PER_QUERY", 7)
    assert attribution_job._chunk_bounds(store, _EPOCH, upto, 1, 5) == whole
    assert len(whole) - 1 > 7  # more bounds than one query names
