"""Hostile inputs for precise mode's attribution job (ingest/attribution_job.py ``run_attribution``,
ingest/kv_evidence.py, ingest/kv_tracks.py): a request's answer must not depend on how the job is run (one chunk
or small ones, the memo on or off, live as data arrives or once at the end), and no input may stop a run. Real
chDB; KV events fed the production way (ZMQ frames → collector → queue → ingester → kv_block_log), gateway rows
inserted into gateway_requests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import answers, at, tokens
from test_kv_evidence_horizon import attribute
from test_kv_memo_hostile import CLEARED, B, N, frames, remove_event, request, serving, store_event
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes


def live_then_whole(store: Store, monkeypatch: pytest.MonkeyPatch, batches: list[list[dict[str, Any]]],
                    **job: Any) -> tuple[dict, dict]:
    """(the answers of a live job: ``batches`` of gateway rows inserted one after the other, each stamped as
    ingested just then, the job run after each, settle 0; the answers of one run from scratch over all of them in
    one chunk)."""
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    for rows in batches:
        now = attribution_job.server_now(store) - timedelta(milliseconds=1)
        insert_requests(store, [{**row, "ingested_at": now} for row in rows])
        attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, **job)
    live = answers(store)
    return live, attribute(store, monkeypatch, 10**6, **job)


def holder_and_own_pod(store: Store, scenario: int, holder: tuple[str, float], own: tuple[str, float]
                       ) -> list[int]:
    """Ingest a store of the scenario's prompt (N blocks) on pod ``holder`` and of another block on pod ``own`` (so
    that it logs KV events), each at its time in s; returns the prompt's token ids."""
    prompt, other = tokens(scenario, N * B), tokens(scenario, B, 9)
    ingest(store, collect([frames(holder[0], 1, holder[1], store_event(prompt, chain_hashes(prompt, B))),
                           frames(own[0], 1, own[1], store_event(other, chain_hashes(other, B)))]))
    return prompt


def test_a_pod_that_serves_the_model_only_after_a_request_ended_is_not_a_holder_for_it(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod mp-b stored the prompt's blocks at 1 s; the first gateway row showing that it serves the model comes at
    20 s. Request r1 (5 s, 100 ms, on mp-a, which logs KV events of its own) missed the prompt. Whether mp-b counted
    as a pod of the model depended on the chunk: with the 20 s row in r1's chunk the evidence window reached it and
    r1 was routed_away to mp-b, alone in its chunk it was cold. The pods of a model are those that served it by the
    request's end: r1 is cold in every chunking."""
    scenario = 86
    prompt = holder_and_own_pod(store, scenario, ("mp-b", 1.0), ("mp-a", 0.5))
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "mp-a"), request("r1", scenario, 5.0, "mp-a", prompt, e2e_ms=100.0)],
        [serving(scenario, "mp-b", t=20.0)]])
    for got in (live["r1"], whole["r1"]):
        assert (got[0][0][0], got[1]) == ("cold", "kv_events"), (live, whole)
    assert live == whole


def test_a_block_stored_before_the_requests_own_lookback_is_read_the_same_in_any_chunk(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookback 20 s. Pod lb-b stored the prompt's blocks at 1 s; lb-a (the request's pod) logs an event at 15 s.
    r2 arrives at 30 s on lb-a; r1 at 10 s only opens the chunk earlier. The evidence window of a chunk starts a
    lookback before its first arrival: with r1 in the chunk (from −10 s) the store at 1 s was read and r2 was
    routed_away to lb-b; alone (from 10 s) it was not and r2 was cold. Each request is judged by the events from its
    own lookback's start: r2 is cold in every chunking."""
    scenario = 87
    prompt = holder_and_own_pod(store, scenario, ("lb-b", 1.0), ("lb-a", 15.0))
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "lb-b", t=12.0), serving(scenario, "lb-a", t=12.5),
         request("r1", scenario, 10.0, "lb-a", prompt)],
        [request("r2", scenario, 30.0, "lb-a", prompt)]], lookback_seconds=20, horizon_seconds=20)
    for got in (live["r2"], whole["r2"]):
        assert (got[0][0][0], got[1]) == ("cold", "kv_events"), (live, whole)
    assert live == whole


def test_a_pod_whose_only_events_precede_the_requests_lookback_covers_it_the_same_in_any_chunk(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookback 20 s. Pod lc-a's only KV event is at 1 s. r2 arrives at 30 s on lc-a; r1 (10 s, on lc-a) opens the
    chunk earlier. In one chunk lc-a's event lies in the window and r2 is judged with KV evidence; alone its window
    starts at 10 s and r2 falls back to the fingerprints."""
    scenario = 88
    prompt = tokens(scenario, N * B)
    other = tokens(scenario, B, 9)
    ingest(store, collect([frames("lc-a", 1, 1.0, store_event(other, chain_hashes(other, B)))]))
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "lc-a", t=12.0), request("r1", scenario, 10.0, "lc-a", prompt)],
        [request("r2", scenario, 30.0, "lc-a", prompt)]], lookback_seconds=20, horizon_seconds=20)
    assert live == whole


def test_a_request_whose_e2e_is_nan_does_not_stop_the_job(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway row with e2e_ms NaN (the column is Float64; the record contract refuses NaN, a row written by
    another producer does not) on a pod with KV events: its end is read as its arrival (as a null e2e), the job
    answers it and the requests after it. Before, casting the NaN end to an integer raised in every run, so the
    watermark never moved again."""
    scenario = 89
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("nan-a", 1, 1.0, store_event(prompt, names)),
                           frames("nan-a", 2, 4.0, remove_event(names))]))
    insert_requests(store, [serving(scenario, "nan-a"),
                            request("nan", scenario, 5.0, "nan-a", prompt, e2e_ms=float("nan")),
                            request("zero", scenario, 5.0, "nan-a", prompt, e2e_ms=0.0),
                            request("after", scenario, 6.0, "nan-a", prompt)])
    runs = [attribute(store, monkeypatch, size, memo) for size, memo in ((10**6, False), (1, True))]
    for got in runs:
        for rid in ("nan", "zero", "after"):
            (cause, _sub, missed), *_rest = got[rid][0]
            assert (cause, missed, got[rid][1:]) == ("evicted", N * B, ("kv_events", "nan-a", at(4.0))), (rid, got)
    assert runs[0] == runs[1]


def test_late_kv_events_of_a_pod_that_served_the_model_long_before_re_answer_its_requests(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod la-b served the model once, at 0.1 s, and stored the prompt's blocks at 700 s; its KV events reach the
    store late, after the job answered r (800 s, on la-a, whose own events came in time and lie before the next
    run's window: no overlap): r was cold. The late
    events make r routed_away to la-b (la-b served the model within r's lookback), as a run over the whole history
    says; before, the late events re-examined only the requests of the models la-b served from 10 minutes before
    them on, so r kept its stale answer."""
    scenario = 91
    prompt = tokens(scenario, N * B)
    other = tokens(scenario, B, 9)
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    ingest(store, collect([frames("la-a", 1, 650.0, store_event(other, chain_hashes(other, B)))]))
    insert_requests(store, [serving(scenario, "la-b"), serving(scenario, "la-a", t=640.0),
                            request("r", scenario, 800.0, "la-a", prompt)])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    assert answers(store)["r"][0][0][0] == "cold"
    ingest(store, collect([frames("la-b", 1, 700.0, store_event(prompt, chain_hashes(prompt, B)))]))
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    live = answers(store)
    whole = attribute(store, monkeypatch, 10**6)
    assert whole["r"][0][0][0] == "routed_away", whole
    assert live == whole


def test_two_requests_under_one_request_id_are_judged_each_by_its_own_chain(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gateway rows share request_id `dup` (a client retrying under its own id): at 5 s on d-a with prompt p1
    (stored on d-a at 1 s, evicted at 4 s) and at 20 s on d-a with prompt p2 (held by d-b). The job counts them as
    two requests ((request_id, ts)); precise mode matched its evidence by request_id alone, so each row got the
    blocks of both chains: 3,092 missed tokens of a 212-token prompt, and answers that changed with the chunk.
    Each is now judged by its own chain: evicted (4 s) and routed_away (d-b), in one chunk and request by
    request."""
    scenario = 92
    p1, p2 = tokens(scenario, N * B), tokens(scenario, N * B, 3)
    ingest(store, collect([frames("d-a", 1, 1.0, store_event(p1, chain_hashes(p1, B))),
                           frames("d-b", 1, 1.0, store_event(p2, chain_hashes(p2, B))),
                           frames("d-a", 2, 4.0, remove_event(chain_hashes(p1, B)))]))
    insert_requests(store, [serving(scenario, "d-a"), serving(scenario, "d-b", t=0.2),
                            request("dup", scenario, 5.0, "d-a", p1), request("dup", scenario, 20.0, "d-a", p2)])

    def dup_answers(size: int) -> list[tuple]:
        attribute(store, monkeypatch, size)
        return store.query_rows("SELECT ts, causes, missed_tokens, evidence, evidence_pod FROM request_attribution "
                                "FINAL WHERE request_id = 'dup' ORDER BY ts")
    runs = [dup_answers(size) for size in (10**6, 1)]
    for got in runs:
        assert [(r[1], list(r[2]), r[3], r[4]) for r in got] == [
            (["evicted", "unavoidable"], [N * B, 20], "kv_events", "d-a"),
            (["routed_away", "unavoidable"], [N * B, 20], "kv_events", "d-b")], got
    assert runs[0] == runs[1]


def evicted_live(store: Store, monkeypatch: pytest.MonkeyPatch, scenario: int, pod: str) -> dict:
    """Pod ``pod`` (blocks of B tokens) stores the scenario's prompt at 1 s and evicts it at 3 s; request r (5 s on
    it) is answered live (settle 0, the memo off): evicted. Returns the answers."""
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames(pod, 1, 1.0, store_event(prompt, names)), frames(pod, 2, 3.0, remove_event(names))]))
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    insert_requests(store, [serving(scenario, pod), request("r", scenario, 5.0, pod, prompt)])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    live = answers(store)
    assert live["r"][0][0][0] == "evicted", live
    return live


def test_a_pod_that_changes_its_block_size_later_keeps_its_earlier_answers(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod bs-a runs with blocks of B tokens, stores the prompt at 1 s and evicts it at 3 s; r (5 s) logged its
    chain with B and is judged with KV evidence live: evicted. At 30 s bs-a restarts with blocks of B/2 (a
    BlockStored of that size). A run over the whole history used to read B/2 for bs-a (its latest size), so r's
    chain no longer matched and r fell back to the fingerprints; r is judged with B, its pod's size at its
    arrival, in every run."""
    scenario = 94
    live = evicted_live(store, monkeypatch, scenario, "bs-a")
    half = tokens(scenario, B, 9)
    ingest(store, collect([frames("bs-a", 0, 30.0, {**store_event(half, [9_000_001, 9_000_002]),
                                                    "block_size": B // 2})]))
    assert attribute(store, monkeypatch, 10**6)["r"] == live["r"]



def test_a_memo_kept_hash_stored_before_a_later_requests_lookback_is_read_the_same_with_the_memo(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookback 20 s, chunks of 3 arrivals. Pod mk-a stored the prompt's blocks at 6 s and at 9 s and removed one
    copy at 10 s. The first chunk (a row showing mk-a serves the model, r1 at 7 s and r1b at 11 s) keeps them in the
    memo, summarized at 11 s (one copy, stood for by a store at 6 s). The second chunk, r2 (25 s) and r3 (28 s),
    reads the log from 5 s: the memo's rows lie in that window, but r3's lookback starts at 8 s: the store at 6 s is
    not its evidence, the removal at 10 s takes the copy stored at 9 s: r3 is evicted (removed at 10 s), with the memo
    as without it (the memo forgets a hash whose rows precede a request's lookback start)."""
    scenario = 92
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    other = tokens(scenario, B, 9)
    ingest(store, collect([frames("mk-a", 1, 0.5, store_event(other, chain_hashes(other, B))),
                           frames("mk-a", 2, 6.0, store_event(prompt, names)),
                           frames("mk-a", 3, 9.0, store_event(prompt, names)),
                           frames("mk-a", 4, 10.0, remove_event(names))]))
    insert_requests(store, [serving(scenario, "mk-a")] + [
        request(rid, scenario, t, "mk-a", prompt)
        for rid, t in (("r1", 7.0), ("r1b", 11.0), ("r2", 25.0), ("r3", 28.0))])
    job = {"lookback_seconds": 20, "horizon_seconds": 20}
    with_memo, without = (attribute(store, monkeypatch, 3, memo, **job) for memo in (True, False))
    (cause, _sub, _missed), *_rest = without["r3"][0]
    assert (cause, without["r3"][1:]) == ("evicted", ("kv_events", "mk-a", at(10.0))), without
    assert with_memo == without


def _answer_then_ingest_late(store: Store, monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]],
                             late: list[list[bytes]]) -> tuple[dict, dict, dict]:
    """(the live answers of ``rows`` before the KV messages ``late`` arrive, after one more run once they did, and
    of a run from scratch over everything)."""
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    insert_requests(store, rows)
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    before = answers(store)
    ingest(store, collect(late))
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    live = answers(store)
    return before, live, attribute(store, monkeypatch, 10**6)


def test_late_kv_events_re_answer_a_request_beyond_the_horizon_whose_chain_names_their_blocks(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod lh-b (serving the model since 0.1 s) stored the prompt's blocks at 60 s; its KV events reach the store
    late, after the job answered r (7,200 s on lh-a, which logs events of its own: cold). The blocks are resident on
    lh-b at r's arrival, within its lookback (7 days) but two hours after them, beyond the horizon (1 h): r is
    routed_away to lh-b, as a run over the whole history says. Before, late events re-examined only the requests
    up to a horizon after them."""
    scenario = 95
    prompt, other = tokens(scenario, N * B), tokens(scenario, B, 9)
    ingest(store, collect([frames("lh-a", 1, 7000.0, store_event(other, chain_hashes(other, B)))]))
    before, live, whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "lh-b"), serving(scenario, "lh-a", t=6990.0),
                             request("r", scenario, 7200.0, "lh-a", prompt)],
        [frames("lh-b", 1, 60.0, store_event(prompt, chain_hashes(prompt, B)))])
    assert before["r"][0][0][0] == "cold", before
    assert (whole["r"][0][0][0], whole["r"][2]) == ("routed_away", "lh-b"), whole
    assert live == whole


def test_late_kv_events_that_first_cover_a_pod_re_answer_its_requests_beyond_the_horizon(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod lv-a had no KV events when the job answered r (7,200 s on lv-a): r was judged by its fingerprints. Its one
    event (a block r does not name, at 60 s) reaches the store late: it covers r's arrival (within the lookback, two
    hours before, beyond the horizon), so r is judged with KV evidence, as a run over the whole history says."""
    scenario = 96
    prompt, other = tokens(scenario, N * B), tokens(scenario, B, 9)
    before, live, whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "lv-a", t=6990.0), request("r", scenario, 7200.0, "lv-a", prompt)],
        [frames("lv-a", 1, 60.0, store_event(other, chain_hashes(other, B)))])
    assert before["r"][1] != "kv_events", before
    assert whole["r"][1] == "kv_events", whole
    assert live == whole


def test_a_late_gateway_row_that_first_shows_a_pod_serving_the_model_re_answers_its_earlier_requests(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod ls-b stored the prompt's blocks at 1 s; the only gateway row showing that it serves the model (3 s)
    reaches the store after the job answered r1 (5 s on ls-a, which logs KV events): r1 was cold, with no other pod
    of the model. The late row makes ls-b a holder for r1 (it served the model within r1's lookback, before r1
    ended): r1 is routed_away to ls-b live as in a run over the whole history. It shares no key with r1, so it is
    no predecessor of it: before, nothing re-answered r1."""
    scenario = 97
    prompt = holder_and_own_pod(store, scenario, ("ls-b", 1.0), ("ls-a", 0.5))
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "ls-a"), request("r1", scenario, 5.0, "ls-a", prompt, e2e_ms=100.0)],
        [serving(scenario, "ls-b", t=3.0)]])
    assert (whole["r1"][0][0][0], whole["r1"][2]) == ("routed_away", "ls-b"), whole
    assert live == whole


def test_a_late_cache_reset_re_answers_a_request_beyond_the_horizon_whose_blocks_it_ended(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod lr-a stored the prompt's blocks at 60 s (in time); r (7,200 s on lr-a) missed them and was answered
    with them resident at its arrival. lr-a's cache reset at 100 s (an AllBlocksCleared) reaches the store late: the
    blocks were gone at r's arrival (evicted by the reset), two hours later, beyond the horizon. The reset names no
    block: r is found by the blocks lr-a stored within a lookback before it."""
    scenario = 98
    prompt = tokens(scenario, N * B)
    ingest(store, collect([frames("lr-a", 1, 60.0, store_event(prompt, chain_hashes(prompt, B)))]))
    before, live, whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "lr-a"), request("r", scenario, 7200.0, "lr-a", prompt)],
        [frames("lr-a", 2, 100.0, CLEARED)])
    assert before["r"][0][0][0] != "evicted", before
    assert (whole["r"][0][0][0], whole["r"][2]) == ("evicted", "lr-a"), whole
    assert live == whole


@pytest.mark.parametrize("overlap", [0.0, 300.0])
def test_late_kv_events_that_change_nothing_re_examine_nothing(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                               overlap: float) -> None:
    """Pod lx-a logs KV events in time (50 s); r1–r3 (100–300 s on lx-a) missed a prompt stored nowhere. An event of
    lx-a at 60 s storing a block none of them names reaches the store late: it changes no block of theirs, and lx-a
    covered them already, so the run that reads it re-examines none of them (before, every answered request of the
    pod's models from 10 minutes before it to an hour after). With the default overlap (5 minutes) the run re-reads
    lx-a's first event too, which also counts as late (its ts is long before its ingestion, as every event's is in a
    final run at shutdown, settle 0): r1–r3 were answered after it arrived, so they saw lx-a cover them. Before, a
    pod with no event ingested before the window (its first 5 minutes) had every request re-examined
    (``make demo``'s final run: 772)."""
    scenario = 99
    prompt, other, more = tokens(scenario, N * B), tokens(scenario, B, 9), tokens(scenario, B, 8)
    ingest(store, collect([frames("lx-a", 1, 50.0, store_event(other, chain_hashes(other, B)))]))
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    insert_requests(store, [serving(scenario, "lx-a"),
                            *(request(f"r{k}", scenario, 100.0 * k, "lx-a", prompt) for k in (1, 2, 3))])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    ingest(store, collect([frames("lx-a", 2, 60.0, store_event(more, chain_hashes(more, B)))]))
    stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=overlap)
    assert (stats.arrivals, stats.examined) == (0, 0), stats
    assert answers(store) == attribute(store, monkeypatch, 10**6)


def test_late_kv_events_that_first_cover_a_predecessors_pod_re_answer_its_successor(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """r (7,200 s on lp-a, which logs KV events in time) missed the prompt of its predecessor p (7,000 s on lp-b, the
    same fingerprint); the prompt's blocks are on no pod. lp-b had no KV events when r was answered, so r's miss was
    inferred from p's pod (routed_away). lp-b's one event (60 s, a block neither names) reaches the store late: it
    covers lp-b for r, whose blocks were then resident nowhere (cold), as a run over the whole history says."""
    scenario = 100
    prompt, other = tokens(scenario, N * B), tokens(scenario, B, 9)
    ingest(store, collect([frames("lp-a", 1, 6900.0, store_event(other, chain_hashes(other, B)))]))
    before, live, whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "lp-a", t=6800.0), request("p", scenario, 7000.0, "lp-b", prompt),
                             request("r", scenario, 7200.0, "lp-a", prompt)],
        [frames("lp-b", 1, 60.0, store_event(tokens(scenario, B, 8), chain_hashes(tokens(scenario, B, 8), B)))])
    assert (before["r"][0][0][0], whole["r"][0][0][0]) == ("routed_away", "cold"), (before, whole)
    assert live == whole


def test_a_late_kv_event_re_examines_only_the_requests_it_can_reach(store: Store,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod le-a stored the prompt's blocks at 50 s (in time); r1–r3 (100–300 s, 100 ms each) ended long before
    le-a's removal of those blocks at 400 s, which reaches the store late; r4 (390 s, e2e 20 s) was still running
    then and r5 (450 s) arrived after it. A request is judged by the events up to its own end, so the late removal
    can change r4 and r5 only: the run that reads it re-examines exactly those two. Before, it re-examined every
    answered request naming a removed block from 10 minutes before the event on (live, a system prompt's blocks
    are named by nearly every request: ~10 minutes of a fleet's traffic in each run)."""
    scenario = 101
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("le-a", 1, 50.0, store_event(prompt, names))]))
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    insert_requests(store, [serving(scenario, "le-a"),
                            *(request(f"r{k}", scenario, 100.0 * k, "le-a", prompt, e2e_ms=100.0) for k in (1, 2, 3)),
                            request("r4", scenario, 390.0, "le-a", prompt, e2e_ms=20_000.0),
                            request("r5", scenario, 450.0, "le-a", prompt, e2e_ms=100.0)])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    before = answers(store)
    ingest(store, collect([frames("le-a", 2, 400.0, remove_event(names))]))
    stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    assert (stats.arrivals, stats.examined) == (0, 2), stats
    live = answers(store)
    assert {rid: live[rid] for rid in ("r1", "r2", "r3")} == {rid: before[rid] for rid in ("r1", "r2", "r3")}
    assert live == attribute(store, monkeypatch, 10**6)


def test_a_late_gateway_row_of_a_pod_already_serving_the_model_re_examines_nothing(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pods ha-a and ha-b serve the model (rows at 1 s, answered by the first run); ha-b stored the prompt's blocks.
    r1–r3 (5–7 s on ha-a) named them and were answered with ha-b a holder. A later row of ha-b (4 s) reaches the
    store after them, as live requests are logged when they end: ha-b already served the model in their windows,
    so it changes none of their holders and the run re-examines none of them. Before, the rows the answers had
    seen counted only when ingested before the run's overlap window (5 minutes), so live every late row re-examined
    every answered request of its model naming a block its pod stored (``make demo``: 20 → 768 per run)."""
    scenario = 102
    prompt = holder_and_own_pod(store, scenario, ("ha-b", 0.5), ("ha-a", 0.5))
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    first = [serving(scenario, "ha-a", t=1.0), serving(scenario, "ha-b", t=1.0),
             *(request(f"r{k}", scenario, 4.0 + k, "ha-a", prompt, e2e_ms=100.0) for k in (1, 2, 3))]
    for rows in (first, [{**serving(scenario, "ha-b", t=4.0), "request_id": "late-ha-b"}]):
        now = attribution_job.server_now(store) - timedelta(milliseconds=1)
        insert_requests(store, [{**row, "ingested_at": now} for row in rows])
        stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    assert (stats.arrivals, stats.examined) == (1, 0), stats
    live = answers(store)
    assert all((live[f"r{k}"][0][0][0], live[f"r{k}"][2]) == ("routed_away", "ha-b") for k in (1, 2, 3)), live
    assert live == attribute(store, monkeypatch, 10**6)


def test_a_late_kv_event_re_examines_only_the_requests_answered_before_it_arrived(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod pe-a stored the prompt's blocks at 50 s while r1 (40 s, e2e 20 s) ran; both reached the store before the
    first run answered r1. A second event of pe-a (55 s, a block r1 does not name) reaches the store later. In the
    next run both events count as late (ingested long after their ts; a final run at shutdown has settle 0, so live
    every event of the overlap window does), but r1's answer saw the first one: the run re-examines nothing. Before,
    every request answered before the newest late event arrived was re-examined for all of them (``make demo``'s
    final run: all 774 answered requests)."""
    scenario = 103
    prompt, other = tokens(scenario, N * B), tokens(scenario, B, 9)
    monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", 10**9)
    ingest(store, collect([frames("pe-a", 1, 50.0, store_event(prompt, chain_hashes(prompt, B)))]))
    insert_requests(store, [serving(scenario, "pe-a"), request("r1", scenario, 40.0, "pe-a", prompt, e2e_ms=20_000.0)])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    ingest(store, collect([frames("pe-a", 2, 55.0, store_event(other, chain_hashes(other, B)))]))
    stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    assert (stats.arrivals, stats.examined) == (0, 0), stats
    assert answers(store) == attribute(store, monkeypatch, 10**6)

