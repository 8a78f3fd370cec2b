"""Precise mode judges each request by the KV events up to its own end (ingest/kv_evidence.py, ingest/kv_tracks.py):
a removal after a request ended proves nothing about it, so its answer is the same whether the job reads the log
in one chunk, in chunks of 8 or request by request, live or on a backlog. Real chDB, KV events fed the production
way (ZMQ frames → collector → queue → ingester → kv_block_log).

Before, a chunk read events up to its last request's end, and a removal there of a copy stored before the
evidence (a removal with no store in the log) raised the copies that every earlier request of the chunk saw: a
request's answer changed with the chunk it fell in."""

from __future__ import annotations

from typing import Any

import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import answers, at, tokens
from test_kv_memo_hostile import B, N, _hostile_fleet, frames, remove_event, request, serving, store_event
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes


def attribute(store: Store, monkeypatch: pytest.MonkeyPatch, chunk_size: int, memo: bool = False, **job: Any
              ) -> dict:
    """The answers of a run from scratch in chunks of ``chunk_size`` (with the memo from every hash's first row,
    or without it)."""
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 1 if memo else 10**9)
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, chunk_size=chunk_size, **job)
    return answers(store)


def test_a_removal_after_a_request_ended_does_not_prove_a_copy_for_it(store: Store,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod e-a stored the prompt's blocks once (1 s) and removed them twice (10 s, 10.5 s): the second removal
    proves a copy stored before the events began. Requests on e-a: `short` arrives at 10.2 s and ends at 10.3 s;
    by then the blocks' one copy was gone (removed at 10 s: evicted), and the removal that proves a second copy
    came after it ended. `waiting` arrives at 10.21 s and ends at 11 s: the second removal lies within its wait,
    so a copy was there at its arrival and left while it waited (evicted, removed at 10.5 s); `late` arrives at
    12 s (evicted, removed at 10.5 s). The same answers in one chunk (where `short` used to count the second
    copy, resident at its arrival), request by request and in pairs."""
    scenario = 84
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("e-a", 1, 1.0, store_event(prompt, names)),
                           frames("e-a", 2, 10.0, remove_event(names)),
                           frames("e-a", 3, 10.5, remove_event(names))]))
    insert_requests(store, [serving(scenario, "e-a"),
                            request("short", scenario, 10.2, "e-a", prompt, e2e_ms=100.0),
                            request("waiting", scenario, 10.21, "e-a", prompt, e2e_ms=790.0),
                            request("late", scenario, 12.0, "e-a", prompt, e2e_ms=100.0)])
    runs = [attribute(store, monkeypatch, size) for size in (10**6, 1, 2)]
    for got in runs:
        for rid, removed in (("short", 10.0), ("waiting", 10.5), ("late", 10.5)):
            (cause, _sub, missed), *_rest = got[rid][0]
            assert (cause, missed, got[rid][1:]) == ("evicted", N * B, ("kv_events", "e-a", at(removed))), (rid, got)
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize(("seed", "mixed", "busy"), [(21, True, 0.4), (23, False, 0.3)])
def test_hostile_fleets_get_the_same_answers_in_any_chunks(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                            seed: int, mixed: bool, busy: float) -> None:
    """Generated hostile histories (tests/test_kv_memo_hostile.py: stores, removals of blocks never stored,
    clears and restarts on several engines and media, requests sharing milliseconds with events, e2e up to 900 s,
    rows written twice): the run in one chunk, in chunks of 8 and of 1 (with and without the memo) gives the same
    answers, among them evictions, requests routed away and cold ones."""
    _hostile_fleet(store, seed, mixed=mixed, busy=busy)
    whole = attribute(store, monkeypatch, 10**6)
    judged = [v for v in whole.values() if v[1] == "kv_events"]
    assert len(judged) > 80
    assert {"evicted", "routed_away", "cold"} <= {c for causes, *_ in judged for c, _, _ in causes}
    for size, memo in ((8, False), (8, True), (1, False)):
        assert attribute(store, monkeypatch, size, memo) == whole, (size, memo)


def test_a_log_holding_only_removals_of_the_missed_blocks_is_no_evidence(store: Store,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod r-a's log holds only removals of the prompt's blocks (stored before the collector started; a removal
    names no chain, so nothing says which prompt they held): the job answers (before, reading only such rows
    stopped every run with an IndexError), and the blocks are nowhere, so the miss is cold."""
    scenario = 85
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    other = tokens(scenario, B, 9)
    ingest(store, collect([frames("r-a", 1, 1.0, store_event(other, chain_hashes(other, B))),
                           frames("r-a", 2, 3.0, remove_event(names))]))
    insert_requests(store, [serving(scenario, "r-a"), request("r1", scenario, 5.0, "r-a", prompt)])
    got = attribute(store, monkeypatch, 10**6)["r1"]
    assert (got[0][0][0], sum(n for *_, n in got[0]), got[1]) == ("cold", N * B + 20, "kv_events"), got
