"""More hostile inputs for precise mode's attribution job, aimed at the per-arrival block size
(ingest/block_sizes.py), the per-request lookback start (ingest/kv_evidence.py ``lookback_start``) and late rows
(ingest/attribution_late.py). Same rules as tests/test_attribution_hostile_inputs.py: real chDB, KV events fed the
production way, a request's answer must not depend on how the job ran, and no input may stop a run."""

from __future__ import annotations

import pytest
from test_attribution_hostile_inputs import _answer_then_ingest_late, evicted_live, live_then_whole
from test_attribution_precise import answers, at, tokens
from test_kv_evidence_horizon import attribute
from test_kv_memo_hostile import B, N, frames, remove_event, request, serving, store_event
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes


def cache_config(store: Store, pod: str, t: float, block_size: str) -> None:
    """A vllm_cache_config row of ``pod`` (engine 0) at ``t`` s whose block_size label is ``block_size``."""
    store.command(f"INSERT INTO vllm_cache_config (ts, pod, engine, labels) VALUES (toDateTime64("
                  f"{at(t).timestamp():.3f}, 3, 'UTC'), '{pod}', '0', map('block_size', '{block_size}'))")
    assert store.query_rows(f"SELECT count() FROM vllm_cache_config WHERE pod = '{pod}'")[0][0] >= 1


def test_a_late_block_size_change_re_answers_the_requests_after_it(store: Store, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Pod ls-a (blocks of B) stored the prompt at 1 s and evicted it at 3 s; r (40 s on ls-a, chain of B) is
    answered live: evicted. ls-a's restart with blocks of B/2 (a BlockStored of that size at 30 s) reaches the store
    late: a run from scratch judges r with B/2 (its pod's size at its arrival), so its chain of B is no evidence."""
    scenario = 120
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("ls-a", 1, 1.0, store_event(prompt, names)),
                           frames("ls-a", 2, 3.0, remove_event(names))]))
    half = tokens(scenario, B, 9)
    before, live, whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "ls-a"), request("r", scenario, 40.0, "ls-a", prompt)],
        [frames("ls-a", 3, 30.0, {**store_event(half, [9_100_001, 9_100_002]), "block_size": B // 2})])
    assert before["r"][0][0][0] == "evicted", before
    assert whole["r"][1] != "kv_events", whole
    assert live == whole


@pytest.mark.parametrize("size", [0, 2**31, 2**32 - 1])
def test_a_block_stored_with_a_hostile_block_size_stops_no_run(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                              size: int) -> None:
    """A BlockStored declaring block_size 0 or a huge one (another producer's bug) on the request's pod, before it:
    the ingester stores it and the job answers the request the same in one chunk and live."""
    scenario = 121
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("hb-a", 1, 1.0, store_event(prompt, names)),
                           frames("hb-a", 2, 2.0, {**store_event(tokens(scenario, B, 9), [9_200_001]),
                                                   "block_size": size}),
                           frames("hb-a", 3, 3.0, remove_event(names))]))
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "hb-a"), request("r", scenario, 5.0, "hb-a", prompt)]])
    assert live == whole


@pytest.mark.parametrize("size", ["0", "-16", "99999999999", "abc"])
def test_a_cache_config_with_a_hostile_block_size_stops_no_run(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                              size: str) -> None:
    """A pod whose only size source is a vllm_cache_config row with a hostile block_size label: no crash, the
    answers do not depend on chunking."""
    scenario = 122
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("hc-a", 1, 1.0, store_event(prompt, names)),
                           frames("hc-a", 2, 3.0, remove_event(names))]))
    cache_config(store, "hc-a", 2.0, size)
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "hc-a"), request("r", scenario, 5.0, "hc-a", prompt)]])
    assert live == whole
    assert attribute(store, monkeypatch, 1) == whole


@pytest.mark.parametrize("lookback", [1, 1.001, 0.005, 20.5])
def test_tiny_or_odd_lookbacks_answer_the_same_in_any_chunking(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                               lookback: float) -> None:
    """Lookbacks of 1 s, 1.001 s, 5 ms (≤ the step count in ms) and 20.5 s (not a multiple of 168 ms), horizon
    below them; requests at step boundaries and around them: one chunk, chunks of one, memo on and off, live."""
    scenario = 123
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("tl-a", 1, 1.0, store_event(prompt, names)),
                           frames("tl-a", 2, 1.5, remove_event(names)),
                           frames("tl-a", 3, 2.0, store_event(prompt, names)),
                           frames("tl-b", 1, 2.0, store_event(prompt, names))]))
    job = {"lookback_seconds": lookback, "horizon_seconds": min(0.004, lookback / 2)}
    step = max(1, int(lookback * 1000) // kv_evidence.LOOKBACK_STEPS) / 1000
    times = sorted({2.0 + lookback, 2.0 + lookback + step, 2.0 + lookback - step, 2.5, 3.0, 1.0 + lookback})
    rows = [serving(scenario, "tl-a"), serving(scenario, "tl-b", t=0.2)]
    batches = [rows] + [[request(f"r{k}", scenario, t, "tl-a", prompt)] for k, t in enumerate(times)]
    live, whole = live_then_whole(store, monkeypatch, batches, **job)
    assert live == whole
    for size, memo in ((1, True), (1, False), (2, True)):
        assert attribute(store, monkeypatch, size, memo, **job) == whole, (size, memo)


def test_a_late_reset_with_no_stores_and_late_rows_of_an_unseen_model_stop_no_run(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AllBlocksCleared of a pod that never stored a block, and a gateway row of a model no request used, both
    late: the run reads them, answers nothing new, and stops nothing."""
    scenario = 124
    prompt = tokens(scenario, N * B)
    before, live, whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "lz-a"), request("r", scenario, 40.0, "lz-a", prompt)],
        [frames("lz-z", 1, 30.0, {"type": "AllBlocksCleared"})])
    assert live == whole
    from test_attribution_job import insert_requests
    insert_requests(store, [serving(125, "lz-q", t=30.0)])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)


def test_an_empty_store_stops_no_run(store: Store) -> None:
    """No rows at all: a run answers nothing and raises nothing, with a lookback below the horizon too."""
    for job in ({}, {"lookback_seconds": 1, "horizon_seconds": 20}):
        stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, **job)
        assert stats.examined == 0


def test_a_cache_config_first_seen_after_a_request_keeps_the_block_size_its_events_declared(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod cf-a's collector could not scrape its metrics at first: its size came from its BlockStored events (B).
    It stored the prompt at 1 s and evicted it at 3 s; r (5 s on cf-a) is answered live: evicted. At 30 s cf-a
    restarts with blocks of B/2 and its first vllm:cache_config_info row (30 s) arrives, in time. A run from scratch
    read only the cache config for a pod that has one and back-dated its first size to r: r (judged with B/2) lost
    its KV evidence (fell back to the fingerprints) while the live answer stayed evicted. The cache config rules from
    its first row on; before it, the pod's BlockStored sizes do."""
    live = evicted_live(store, monkeypatch, 126, "cf-a")
    cache_config(store, "cf-a", 30.0, str(B // 2))
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B)
    assert answers(store)["r"] == live["r"]
    assert attribute(store, monkeypatch, 10**6)["r"] == live["r"]


def test_a_size_change_exactly_at_an_arrival_and_between_a_request_and_its_predecessor(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod sc-a (blocks of B) stored the prompt at 1 s and evicted it at 3 s; p (5 s) and r (10 s, the same
    prompt: p is r's predecessor) ran on it; a BlockStored of size B/2 at exactly 10 s (a restart) makes r's size
    B/2 (a change at exactly the arrival applies): r's chain of B is no evidence, p keeps B. Answers are the same in
    one chunk, in chunks of one with the memo on and off, and live."""
    scenario = 127
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("sc-a", 1, 1.0, store_event(prompt, names)),
                           frames("sc-a", 2, 3.0, remove_event(names)),
                           frames("sc-a", 3, 10.0, {**store_event(tokens(scenario, B, 9), [9_300_001, 9_300_002]),
                                                    "block_size": B // 2})]))
    live, whole = live_then_whole(store, monkeypatch, [
        [serving(scenario, "sc-a"), request("p", scenario, 5.0, "sc-a", prompt)],
        [request("r", scenario, 10.0, "sc-a", prompt)]])
    assert live == whole
    assert whole["p"][0][0][0] == "evicted", whole
    assert whole["r"][1] != "kv_events", whole
    for size, memo in ((1, True), (1, False)):
        assert attribute(store, monkeypatch, size, memo) == whole, (size, memo)


def test_a_late_cache_config_row_re_answers_the_requests_after_it(store: Store, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Pod lc-a's events declare blocks of B; it stored the prompt at 1 s and evicted it at 3 s; r (5 s) is answered
    live: evicted. Its vllm:cache_config_info row of 2 s (blocks of B/2) reaches the store late: a run from scratch
    judges r with B/2, so its chain of B is no evidence."""
    scenario = 128
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    ingest(store, collect([frames("lcc-a", 1, 1.0, store_event(prompt, names)),
                           frames("lcc-a", 2, 3.0, remove_event(names))]))
    before, _live, _whole = _answer_then_ingest_late(
        store, monkeypatch, [serving(scenario, "lcc-a"), request("r", scenario, 5.0, "lcc-a", prompt)], [])
    assert before["r"][0][0][0] == "evicted", before
    cache_config(store, "lcc-a", 2.0, str(B // 2))
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, overlap_seconds=0)
    live = answers(store)
    whole = attribute(store, monkeypatch, 10**6)
    assert whole["r"][1] != "kv_events", whole
    assert live == whole
