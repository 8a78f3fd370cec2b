"""The attribution job on real chDB (ingest/attribution_job.py): gateway_requests in, miss_attribution and
the watermark out; reruns write nothing new, a crash before the watermark rewrites identical rows.
Uses the ``store`` fixture of tests/conftest.py (one chDB directory per process, a database per test)."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from test_attribution import random_structure

import sql
from ingest import attribution, attribution_job, block_sizes
from ingest.store import Store
from tests.clock import T0

#: Stamped before the job's clock (the store's now64) minus its settle time, so every run picks rows up. Reset
#: before each test (:func:`_fresh_ingested`): a stamp taken at import falls behind the job's 300 s overlap
#: window when the tests before take longer than that, and the job then never picks later batches up.
INGESTED = datetime.now(UTC) - timedelta(minutes=1)


@pytest.fixture(autouse=True)
def _fresh_ingested(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "INGESTED", datetime.now(UTC) - timedelta(minutes=1))


def h(text: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_OID, text).hex[:16] if text else ""


def gw(rid: str, *, at: float, ingested: datetime | None = None, conv: str = "", pod: str = "pod-a",
       prompt: int = 762, cached: int = 0, status: int = 200, history: str = "", prev_history: str = "",
       history_tokens: int = 0, suffix: str = "q1", suffix_tokens: int = 22) -> dict[str, Any]:
    system = h("You are the support agent of Acme.")
    return {
        "request_id": rid, "ts": T0 + timedelta(seconds=at), "tenant_id": "acme",
        "conversation_id": conv, "agent_run_id": "", "model": "tiny", "pod": pod, "status": status,
        "prompt_tokens": prompt, "cached_tokens": cached, "e2e_ms": 400.0,
        "system_hash": system, "system_norm_hash": system, "system_tokens": 720,
        "tools_hash": "", "tools_canonical_hash": "", "tools_tokens": 0,
        "retrieval_pack_hash": "", "retrieval_set_hash": "", "retrieval_tokens": 0,
        "history_prefix_hash": h(history), "prev_history_hash": h(prev_history),
        "history_tokens": history_tokens,
        "suffix_hash": h(suffix), "suffix_tokens": suffix_tokens,
        "prompt_fingerprint": h(system + h(history)), "ingested_at": ingested or INGESTED,
    }


def insert_requests(store: Store, rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    store.insert("gateway_requests", [tuple(r[c] for c in cols) for r in rows], cols)


def ms(at: datetime) -> int:
    """``at`` in unix ms (as :func:`ingest.block_sizes.changes` gives times)."""
    return int(at.timestamp() * 1000)


def insert_block_size(store: Store, pod: str, size: int, at: datetime) -> None:
    store.insert("vllm_cache_config", [(at, pod, "0", {"block_size": str(size), "engine": "0"})],
                 ["ts", "pod", "engine", "labels"])


def attributed(store: Store) -> list[tuple[Any, ...]]:
    """The current answers, one row per (request, cause), through the miss_attribution view."""
    return store.query_rows(
        "SELECT request_id, cause, sub_cause, tokens, predecessor_request_id, predecessor_pod, gap_ms, "
        "block_size FROM miss_attribution ORDER BY ts, request_id, cause, sub_cause"
    )


def weighted(store: Store) -> dict[tuple[str, str, str], int]:
    """(request, cause, sub_cause) → Σ tokens × sign over every row ever written, without FINAL: what a
    rollup fed from request_attribution sums. Exact only if no answer is counted twice."""
    rows = store.query_rows(
        "SELECT request_id, cause, sub_cause, sum(toInt64(tokens) * sign) FROM request_attribution "
        "ARRAY JOIN causes AS cause, sub_causes AS sub_cause, missed_tokens AS tokens "
        "GROUP BY request_id, cause, sub_cause")
    return {(r[0], r[1], r[2]): r[3] for r in rows if r[3] != 0}


def as_weighted(rows: list[tuple[Any, ...]]) -> dict[tuple[str, str, str], int]:
    return {(r[0], r[1], r[2]): r[3] for r in rows}


def run(store: Store, **kw: Any) -> attribution_job.RunStats:
    kw.setdefault("default_block_size", 32)
    return attribution_job.run_attribution(store, **kw)


def traffic() -> list[dict[str, Any]]:
    """Turn 1 cold on pod-a, turn 2 on pod-b (routed away), a warm repeat, a failed request."""
    return [
        gw("t1", at=0, conv="c1"),
        gw("t2", at=3, conv="c1", pod="pod-b", prompt=830, history="q1|reply1", history_tokens=50,
           suffix="q2", suffix_tokens=20),
        gw("warm", at=5, cached=736),
        gw("failed", at=6, status=502, prompt=0),
    ]


EXPECTED = [
    ("t1", "cold", "", 736, "", "", None, 32),
    ("t1", "unavoidable", "", 26, "", "", None, 32),
    ("t2", "routed_away", "", 736, "t1", "pod-a", 2600.0, 32),
    ("t2", "unavoidable", "", 94, "t1", "pod-a", 2600.0, 32),
    ("warm", "unavoidable", "", 26, "t1", "pod-a", 4600.0, 32),
]


def test_job_answers_every_request_once_and_advances_the_watermark(store):
    insert_block_size(store, "pod-a", 16, T0 - timedelta(hours=1))  # older sample: the latest one wins
    insert_block_size(store, "pod-a", 32, T0)
    insert_block_size(store, "pod-b", 32, T0)
    insert_requests(store, traffic())
    assert block_sizes.changes(store).rows() == [("pod-a", ms(T0 - timedelta(hours=1)), 16), ("pod-a", ms(T0), 32),
                                                 ("pod-b", ms(T0), 32)]

    assert run(store, default_block_size=16).arrivals == 4  # every request gets an answer, the failed one too
    assert attributed(store) == EXPECTED
    assert store.query_rows("SELECT count() FROM request_attribution")[0][0] == 4
    mark = attribution_job.read_watermark(store)
    assert mark > INGESTED

    assert run(store).arrivals == 0  # nothing new: nothing written
    assert attributed(store) == EXPECTED
    assert store.query_rows("SELECT count() FROM request_attribution")[0][0] == 4
    assert attribution_job.read_watermark(store) >= mark
    assert weighted(store) == as_weighted(EXPECTED)


def test_rows_sum_to_missed_tokens_per_request(store):
    insert_requests(store, traffic())
    run(store)
    rows = store.query_rows(
        "SELECT g.request_id, g.prompt_tokens - g.cached_tokens, sum(m.tokens) "
        "FROM gateway_requests AS g INNER JOIN miss_attribution AS m ON m.request_id = g.request_id "
        "GROUP BY g.request_id, g.prompt_tokens, g.cached_tokens ORDER BY g.request_id"
    )
    assert rows and all(missed == total for _, missed, total in rows)


def test_a_late_predecessor_corrects_its_successor(store):
    """Turn 2 arrives first (lines of different pods travel on different partitions) and reads cold; turn 1
    arrives two minutes later: turn 2 is re-answered routed_away, exactly once."""
    t1, t2 = traffic()[:2]
    insert_requests(store, [t2])
    run(store)
    assert [r[1:4] for r in attributed(store)] == [("cold", "", 800), ("unavoidable", "", 30)]
    insert_requests(store, [{**t1, "ingested_at": INGESTED + timedelta(seconds=30)}])
    stats = run(store)
    assert (stats.arrivals, stats.examined, stats.changed) == (1, 1, 1)
    assert attributed(store) == EXPECTED[:4]
    assert weighted(store) == as_weighted(EXPECTED[:4])  # the cold answer is cancelled, not added to
    assert run(store).arrivals == 0
    assert weighted(store) == as_weighted(EXPECTED[:4])


def test_rerunning_everything_changes_nothing(store):
    """A crash before the watermark (or a reset) makes the next run look at everything again: only
    unanswered requests are picked, and an unchanged answer writes nothing."""
    insert_requests(store, traffic())
    run(store)
    before = store.query_rows("SELECT count() FROM request_attribution")[0][0]
    store.command("TRUNCATE TABLE attribution_watermark")
    assert run(store).arrivals == 0
    assert store.query_rows("SELECT count() FROM request_attribution")[0][0] == before
    assert attributed(store) == EXPECTED


def test_a_row_stamped_before_the_watermark_but_visible_after_is_answered(store):
    insert_requests(store, traffic()[:1])
    run(store)
    mark = attribution_job.read_watermark(store)
    # an insert that was in flight during the last run: stamped before its watermark, visible only now
    late = gw("t2", at=3, conv="c1", pod="pod-b", prompt=830, history="q1|reply1", history_tokens=50, suffix="q2",
              suffix_tokens=20, ingested=mark - timedelta(seconds=5))
    insert_requests(store, [late])
    assert run(store).arrivals == 1
    assert attributed(store) == EXPECTED[:4]


def test_later_requests_find_predecessors_already_attributed(store):
    insert_requests(store, traffic())
    run(store)
    insert_requests(store, [gw("t3", at=70, conv="c1", pod="pod-b", prompt=900, cached=0,
                               history="q1|reply1|q2|reply2", prev_history="q1|reply1", history_tokens=120,
                               suffix="q3", suffix_tokens=20, ingested=INGESTED + timedelta(seconds=20))])
    # Turn 3 continues turn 2 (830 tokens, pod-b) on pod-b after 66.6 s, but nothing was left in its cache.
    assert run(store).arrivals == 1
    t3 = [r for r in attributed(store) if r[0] == "t3"]
    assert t3 == [("t3", "evicted", "evicted_before_next_turn", 800, "t2", "pod-b", 66600.0, 32),
                  ("t3", "unavoidable", "", 100, "t2", "pod-b", 66600.0, 32)]
    assert attributed(store)[:5] == EXPECTED


def test_settle_leaves_the_newest_requests_for_the_next_run(store):
    insert_requests(store, [{**r, "ingested_at": datetime.now(UTC) + timedelta(seconds=30)} for r in traffic()])
    assert run(store, settle_seconds=2.0).arrivals == 0
    assert run(store, settle_seconds=-60.0).arrivals == 4


def structure_columns(drawn: dict[str, Any]) -> dict[str, Any]:
    """tests/test_attribution.py random_structure's lines and chunks as gateway_requests stores them (UInt64)."""
    return {attribution.LINE_HASHES: [int(h(x), 16) for x in drawn["lines"]],
            attribution.LINE_TOKENS: drawn["line_tokens"],
            attribution.CHUNK_HASHES: [int(h(x), 16) for x in drawn["chunks"]],
            attribution.CHUNK_TOKENS: drawn["chunk_tokens"]}


def random_traffic(n: int, seed: int) -> list[dict[str, Any]]:
    """Conversations, agent runs, shared fingerprints and variants, several pods, some failures, a third of the
    cached counts not reported; system lines and message chunks (banded keys, structural drifts)."""
    rnd = random.Random(seed)
    structure = random.Random(seed + 1000)  # a stream of its own: the other fields stay as they were drawn
    salts = random.Random(seed + 2000)  # vLLM cache_salt: a previous turn under another salt is a drift
    outages = random.Random(seed + 3000)  # the pods the gateway found down: routed_away / pod_down
    threads = random.Random(seed + 4000)  # first messages: the thread keys (9 with a run id, 10 with a conversation)
    out = []
    for i in range(n):
        conv = rnd.choice(["", "c1", "c2", "c3"])
        hist = rnd.choice(["", "h1", "h2"])
        out.append({**gw(f"r{i:04d}", at=rnd.uniform(0, 600), conv=conv, pod=rnd.choice(["pod-a", "pod-b"]),
                         prompt=rnd.randint(1, 2000), status=rnd.choice([200, 200, 200, 503]),
                         history=hist, prev_history=rnd.choice(["", "h1"]), history_tokens=rnd.randint(0, 300),
                         suffix=rnd.choice(["q", "r"]), suffix_tokens=rnd.randint(1, 50)),
                    "cached_tokens": rnd.choice([0, 0, None]), "tenant_id": rnd.choice(["acme", "globex"]),
                    "agent_run_id": rnd.choice(["", "", "run1"]),
                    "system_hash": h(rnd.choice(["s1", "s2", "s3"])), "system_norm_hash": h(rnd.choice(["n1", "n2"])),
                    "tools_canonical_hash": h(rnd.choice(["", "t1"])),
                    "prompt_fingerprint": h(rnd.choice(["f1", "f2", "f3", "f4"])),
                    **structure_columns(random_structure(structure)),
                    "cache_salt_hash": salts.choice(["", "", "", h("salt-1"), h("salt-2")]),
                    "pods_down": outages.choice([[], [], [], ["pod-a"], ["pod-b"]]),
                    "first_message_hash": h(threads.choice(["", "m1", "m2", "m3"]))})
        if rnd.random() < 0.3:  # same millisecond as another request: the tie-break must agree too
            out[-1]["ts"] = out[rnd.randrange(len(out))]["ts"]
    return out


@pytest.mark.parametrize("horizon", [3600.0, 45.0])
def test_the_store_job_agrees_with_the_in_memory_reference_whatever_the_arrival_order(store, horizon):
    """Requests arrive in random order over several runs, in chunks smaller than a run: the answers equal
    the in-memory reference (ingest/attribution.py) computed over all requests at once. 30 % share a
    millisecond with another request (the tie-break must agree); a 45 s horizon cuts some predecessors."""
    reqs = random_traffic(300, seed=3)
    expected = sorted((r.request_id, r.cause, r.sub_cause, r.tokens, r.predecessor_request_id, r.predecessor_pod)
                      for r in attribution.attribute(reqs, block_size_by_pod={}, default_block_size=32,
                                                     horizon_seconds=horizon))
    shuffled = reqs[:]
    random.Random(5).shuffle(shuffled)
    for i in range(0, len(shuffled), 60):
        insert_requests(store, [{**r, "ingested_at": INGESTED + timedelta(milliseconds=i)} for r in shuffled[i:i + 60]])
        run(store, chunk_size=25, horizon_seconds=horizon)
    got = sorted(r[:6] for r in attributed(store))
    assert got == expected
    assert weighted(store) == {(r[0], r[1], r[2]): r[3] for r in expected}
    assert store.query_rows("SELECT count() FROM (SELECT request_id FROM request_attribution "
                            "GROUP BY request_id HAVING sum(sign) != 1)")[0][0] == 0


def test_concurrent_runs_in_one_process_answer_each_request_once(store):
    """The loop's run and the final run at shutdown may overlap in one process: they must not both answer the
    same chunk (a kill test over 10^6 lines found one chunk answered twice)."""
    reqs = random_traffic(400, seed=9)
    insert_requests(store, [{**r, "ingested_at": INGESTED} for r in reqs])
    threads = [threading.Thread(target=run, args=(store,), kwargs={"chunk_size": 50}) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert store.query_rows("SELECT count(), countIf(s = 1) FROM (SELECT request_id, sum(sign) AS s "
                            "FROM request_attribution GROUP BY request_id)")[0] == (400, 400)


def test_loop_runs_until_stopped(store):
    insert_requests(store, traffic())
    stop = threading.Event()
    thread = threading.Thread(target=attribution_job.attribution_loop, args=(store, stop, 0.05),
                              kwargs={"default_block_size": 32}, daemon=True)
    thread.start()
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while datetime.now(UTC) < deadline:
            if store.query_rows("SELECT count() FROM request_attribution")[0][0]:
                break
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert attributed(store) == EXPECTED


def sparse_traffic(n: int, seed: int) -> list[dict[str, Any]]:
    """:func:`random_traffic` spread over 4 hours with many more keys, so requests often find no predecessor
    within a 5-minute horizon and some find one within a 1-hour lookback."""
    rnd = random.Random(seed)
    out = random_traffic(n, seed)
    for r in out:
        r.update(ts=T0 + timedelta(milliseconds=rnd.randrange(0, 4 * 3600 * 1000)),
                 prompt_fingerprint=h(f"f{rnd.randrange(30)}"), system_norm_hash=h(f"n{rnd.randrange(30)}"),
                 conversation_id=rnd.choice(["", f"c{rnd.randrange(20)}"]),
                 agent_run_id=rnd.choice(["", "", f"run{rnd.randrange(10)}"]))
    return out


@pytest.mark.parametrize("lookback", [3600.0, 0.0])
def test_predecessors_beyond_the_horizon_agree_with_the_reference(store, lookback):
    """With a 5-minute horizon and a 1-hour lookback (or none), requests arriving in random order over several
    runs: the store job's answers, predecessor kinds included, equal the in-memory reference. Late arrivals
    become predecessors beyond the horizon of requests answered before them (the successor search reaches as
    far as the lookback)."""
    reqs = sparse_traffic(300, seed=4)
    kw = dict(horizon_seconds=300.0, lookback_seconds=lookback)
    reference = attribution.PredecessorIndex(reqs, **kw)
    expected_kinds = {r["request_id"]: (p.stored_kind if (p := reference.find(r)) else "") for r in reqs
                      if r["status"] < 400}
    expected = sorted((r.request_id, r.cause, r.sub_cause, r.tokens, r.predecessor_request_id, r.predecessor_pod)
                      for r in attribution.attribute(reqs, block_size_by_pod={}, default_block_size=32, **kw))
    causes = {e[1] for e in expected}
    assert ("beyond_horizon" in causes) == (lookback > 0) and "cold" in causes
    shuffled = reqs[:]
    random.Random(6).shuffle(shuffled)
    for i in range(0, len(shuffled), 75):
        # stamped now, not at import: a module-level stamp falls behind the job's overlap window (300 s) when the
        # tests before this one take longer than that, and the job then never picks the rows up
        stamp = datetime.now(UTC) - timedelta(minutes=1)
        insert_requests(store, [{**r, "ingested_at": stamp} for r in shuffled[i:i + 75]])
        run(store, chunk_size=40, **kw)
    assert sorted(r[:6] for r in attributed(store)) == expected
    kinds = dict(store.query_rows("SELECT request_id, predecessor_kind FROM request_attribution FINAL"))
    assert {k: v for k, v in kinds.items() if k in expected_kinds} == expected_kinds
    assert weighted(store) == {(r[0], r[1], r[2]): r[3] for r in expected}


def test_a_predecessor_beyond_the_horizon_is_named_and_shown(store):
    """Another tenant sent the same prompt prefix two hours earlier (a fingerprint predecessor, beyond the 1 h
    horizon): the answer is beyond_horizon 736 + unavoidable 26 (B = 32), the kind fingerprint_beyond_horizon;
    request_detail finds that predecessor across tenants and compares its segments; the page's evidence says so.
    Affinity does not count it (it reads the plain kinds)."""
    from dashboard import request_detail

    insert_requests(store, [{**gw("old", at=0), "tenant_id": "globex"}, gw("r2", at=7200, suffix="q2")])
    run(store)
    assert [r[:6] for r in attributed(store) if r[0] == "r2"] == [
        ("r2", "beyond_horizon", "", 736, "old", "pod-a"), ("r2", "unavoidable", "", 26, "old", "pod-a")]
    detail = store.named("request_detail", {"request_id": "r2"}).to_dicts()
    head = detail[0]
    assert (head["predecessor_kind"], head["gap_ms"], head["changed_segment"]) == (
        "fingerprint_beyond_horizon", 7_200_000.0 - 400, "suffix")
    assert head["predecessor_ts"] == T0
    assert [x["hash_matched"] for x in detail] == [1, 1, 1, 1, 0]
    text = request_detail.evidence(head, pl.DataFrame(detail))
    assert "the latest earlier request with the same prompt fingerprint" in text
    assert "1 h 59 min old" in text and "**beyond_horizon**" in text
    affinity = store.query_rows("SELECT sum(with_predecessor) FROM affinity_1m")[0][0]
    assert affinity == 0


def test_chat_shapes_through_the_store_and_request_detail(store):
    """The store's job and request_detail read the gateway's previous-turn fields as the reference does: c2 was
    sent with no reply before it (c1's next_history_hash is its history): routed_away, and its history segment
    continues c1's (variant_matched 1); e2 edited the message e1 sent (history_changed, variant_matched 0); g2
    follows a turn logged without segments (continued, 1); s2 read no prefix cache (`not_reported /
    skip_reading_prefix_cache`); t2 carries t1's assistant prefill completed (routed_away, continued, 1); b2 goes
    back a turn after r3 (r2 re-sent: a regenerate; routed_away, its history matched, 1)."""
    from test_attribution import prefill_turns, req, rewind_turns

    rows = [
        req("c1", conv="c", prompt=1234, system_tokens=360, history="U0|A0", history_tokens=400, suffix="U1",
            suffix_tokens=460, next_history="U0|A0|U1"),
        req("c2", at=10, conv="c", pod="pod-b", prompt=1262, system_tokens=360, history="U0|A0|U1",
            history_tokens=860, prev_suffix="U0", suffix="U2", suffix_tokens=28),
        req("e1", at=1, conv="e", prompt=1234, system_tokens=360, suffix="U1", suffix_tokens=860),
        req("e2", at=11, conv="e", prompt=1262, cached=384, system_tokens=360, history="U1 edited|A1",
            history_tokens=870, prev_suffix="U1 edited", suffix="U2", suffix_tokens=6),
        req("g1", at=2, conv="g", prompt=900, system="", system_tokens=0, suffix="", suffix_tokens=0),
        req("g2", at=12, conv="g", prompt=1000, system="", system_tokens=0, history="U1|A1", history_tokens=900,
            prev_suffix="U1", suffix="U2", suffix_tokens=60),
        req("s1", at=3, conv="s"),
        {**req("s2", at=13, conv="s", cached=None), "skip_reading_prefix_cache": True},
        *prefill_turns(),
        *({**r, "request_id": "r" + r["request_id"][1:], "conversation_id": "r"} for r in rewind_turns()),
        req("b2", at=30, conv="r", pod="pod-b", prompt=765, history="U1|A1", history_tokens=300, prev_suffix="U1",
            suffix="U2", suffix_tokens=50, system="sys", system_tokens=400),
    ]
    for r in rows:
        r["system_line_hashes"] = r["suffix_chunk_hashes"] = []
    insert_requests(store, [{"skip_reading_prefix_cache": False, **r, "ingested_at": INGESTED} for r in rows])
    run(store)
    got = {}
    for r in attributed(store):
        got.setdefault(r[0], []).append(r[1:4])
    assert got["c2"] == [("routed_away", "", 1216), ("unavoidable", "", 46)]
    assert got["e2"] == [("prefix_drift", "history_changed", 832), ("unavoidable", "", 46)]
    assert got["s2"] == [("not_reported", "skip_reading_prefix_cache", 762)]
    assert got["t2"] == [("routed_away", "", 1216), ("unavoidable", "", 74)]
    assert got["b2"] == [("routed_away", "", 736), ("unavoidable", "", 29)]
    history = {rid: [x for x in store.named("request_detail", {"request_id": rid}).to_dicts()
                     if x["segment"] == "history"][0]["variant_matched"] for rid in ("c2", "e2", "g2", "t2", "b2")}
    assert history == {"c2": 1, "e2": 0, "g2": 1, "t2": 1, "b2": 1}


@pytest.mark.parametrize("conv", ["", "session-1"])
def test_parallel_subagents_through_the_store(store, conv):
    """The store's key search (predecessor key 9, sql/migrations/0039) finds a sub-agent's previous turn on its
    thread as the reference does, before the conversation and run keys: A2 after A1, not after B1 (the run's and
    the session's latest); answered alike."""
    from test_attribution import subagent_turns

    rows = subagent_turns(conv=conv)
    for r in rows:
        r["system_line_hashes"] = r["suffix_chunk_hashes"] = []
    insert_requests(store, [{**r, "ingested_at": INGESTED} for r in rows])
    run(store)
    got = [r[:5] for r in attributed(store) if r[0] == "A2"]
    assert got == [("A2", "routed_away", "", 672, "A1"), ("A2", "unavoidable", "", 328, "A1")]
    assert store.query_rows("SELECT predecessor_kind FROM request_attribution FINAL WHERE request_id = 'A2'") == [
        ("previous_turn",)]


def test_only_served_requests_look_beyond_the_horizon(store, monkeypatch):
    """A failed request names no predecessor (nothing was prefilled to reuse), so the search beyond the horizon
    leaves it out: at 10^7 requests of generated history its ~2% failed requests (none has a candidate within the
    horizon when the keys are read by range: request_keys leaves them out) sent ~10^4 targets per chunk to that
    search, 9.3–29.9 CPU-s against 0.5. The served request two hours after its fingerprint predecessor is still
    searched and answered beyond_horizon."""
    searched: list[list[str]] = []
    search = attribution_job._beyond_horizon

    def spy(store_, targets, *args, **kwargs):
        searched.append(sorted(targets["request_id"]))
        return search(store_, targets, *args, **kwargs)

    monkeypatch.setattr(attribution_job, "_beyond_horizon", spy)
    insert_requests(store, [{**gw("old", at=0), "tenant_id": "globex"}, gw("r2", at=7200, suffix="q2"),
                            gw("failed", at=7201, suffix="q3", status=503, cached=0)])
    run(store)
    assert searched == [["old", "r2"]]  # all but the failed one (none has a predecessor within the horizon)
    causes = {(r[0], r[1]) for r in attributed(store)}
    assert ("r2", "beyond_horizon") in causes and not any(r == "failed" for r, _ in causes)
    assert store.query_rows("SELECT predecessor_request_id, causes FROM request_attribution "
                            "WHERE request_id = 'failed'") == [("", [])]


def test_a_pod_without_cache_config_takes_the_block_size_its_kv_events_declare(store):
    """vLLM's BlockStored carries block_size: a pod whose /metrics were never scraped (or lack
    cache_config_info) is attributed at its real block size, not the default 16; cache_config_info wins. Each
    change is kept (pod-c: 16, 64, then 16 again), from its first event; repeats (a re-sent batch) change
    nothing."""
    insert_block_size(store, "pod-a", 32, T0)
    now = datetime.now(UTC)
    events = (("pod-c", 16, 0), ("pod-c", 16, 0.2), ("pod-c", 64, 1), ("pod-c", 64, 1.5), ("pod-c", 16, 3),
              ("pod-a", 128, 4))
    rows = [(f"e{i}", now - timedelta(minutes=5 - m), pod, "0", i + 1, 0, "BlockStored", [i + 1], None, size, size,
             "GPU") for i, (pod, size, m) in enumerate(events)]
    columns = ["event_id", "ts", "pod", "engine", "seq", "idx", "event_type", "block_hashes", "parent_block_hash",
               "token_count", "block_size", "medium"]
    store.insert("kv_block_events", rows, columns)
    store.insert("kv_block_events", rows[:1], columns)
    assert block_sizes.changes(store).rows() == [("pod-a", ms(T0), 32), ("pod-c", ms(now - timedelta(minutes=5)), 16),
                                                 ("pod-c", ms(now - timedelta(minutes=4)), 64),
                                                 ("pod-c", ms(now - timedelta(minutes=2)), 16)]


def test_a_pod_restarted_with_another_block_size_keeps_its_earlier_answers_without_kv_evidence(store):
    """Fingerprint mode. pod-a runs with blocks of 32 tokens: t1 (0 s) is answered live in blocks of 32. At 60 s
    pod-a restarts with blocks of 1024 (a prompt of 762 tokens is then below one block): `after` (120 s) is
    judged with 1024, and t0 (−1 s, logged late) makes t1 its successor, judged again: still with 32, the size of
    its time. A run from scratch gives the same answers."""
    insert_block_size(store, "pod-a", 32, T0 - timedelta(hours=1))
    insert_requests(store, [gw("t1", at=0, conv="c1")])
    run(store, settle_seconds=0, kv_evidence=False)
    assert attributed(store) == [("t1", "cold", "", 736, "", "", None, 32),
                                 ("t1", "unavoidable", "", 26, "", "", None, 32)]
    insert_block_size(store, "pod-a", 1024, T0 + timedelta(seconds=60))
    fresh = attribution_job.server_now(store) - timedelta(milliseconds=1)
    insert_requests(store, [gw("t0", at=-1, conv="c1", ingested=fresh),
                            gw("after", at=120, conv="c2", ingested=fresh)])
    assert run(store, settle_seconds=0, kv_evidence=False).examined == 1
    live = attributed(store)
    assert live == [("t0", "cold", "", 736, "", "", None, 32), ("t0", "unavoidable", "", 26, "", "", None, 32),
                    ("t1", "evicted", "evicted_before_next_turn", 736, "t0", "pod-a", 600.0, 32),
                    ("t1", "unavoidable", "", 26, "t0", "pod-a", 600.0, 32),
                    ("after", "below_block", "", 761, "t1", "pod-a", 119_600.0, 1024),
                    ("after", "unavoidable", "", 1, "t1", "pod-a", 119_600.0, 1024)], live
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    run(store, settle_seconds=0, kv_evidence=False)
    assert attributed(store) == live


def test_a_late_cache_config_row_re_answers_the_requests_it_resizes_without_kv_evidence(store):
    """Fingerprint mode. pod-a runs with blocks of 32: t1 (0 s) and `after` (120 s) are answered in blocks of 32.
    pod-a's restart with blocks of 1024 at 60 s reaches the store late (its vllm_cache_config row, no new request):
    the next run re-answers `after` alone (below one block of 1024: the same answer as when the row came in time),
    t1 keeps 32; a run from scratch agrees; a further run examines nothing."""
    insert_block_size(store, "pod-a", 32, T0 - timedelta(hours=1))
    insert_requests(store, [gw("t1", at=0, conv="c1"), gw("after", at=120, conv="c2")])
    run(store, settle_seconds=0, kv_evidence=False)
    assert {r[0]: r[7] for r in attributed(store)} == {"t1": 32, "after": 32}
    insert_block_size(store, "pod-a", 1024, T0 + timedelta(seconds=60))
    assert run(store, settle_seconds=0, kv_evidence=False).examined == 1
    live = attributed(store)
    assert live == [("t1", "cold", "", 736, "", "", None, 32), ("t1", "unavoidable", "", 26, "", "", None, 32),
                    ("after", "below_block", "", 761, "t1", "pod-a", 119_600.0, 1024),
                    ("after", "unavoidable", "", 1, "t1", "pod-a", 119_600.0, 1024)], live
    assert run(store, settle_seconds=0, kv_evidence=False).examined == 0
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    run(store, settle_seconds=0, kv_evidence=False)
    assert attributed(store) == live


def test_where_two_sets_of_block_size_changes_differ():
    """:func:`ingest.block_sizes.differences`, by hand: a new change at 9 s (pod a, from then on); a pod whose sizes
    are gone (b: the default everywhere instead of 32); a pod seen at the default size (c: no difference); a size
    seen earlier than before (d: 32 from 0.5 s where 16 held from the start: up to 1 s, merged)."""
    old = pl.DataFrame({"pod": ["a", "a", "b", "d"], "since": [1_000, 5_000, 3_000, 1_000],
                        "block_size": [16, 64, 32, 16]})
    new = pl.DataFrame({"pod": ["a", "a", "a", "c", "d", "d"], "since": [1_000, 5_000, 9_000, 2_000, 500, 1_000],
                        "block_size": [16, 64, 16, 8, 32, 16]})
    lo, hi = block_sizes.NEVER_BEFORE, block_sizes.NEVER_AFTER
    assert block_sizes.differences(old, new, 8) == [("a", 9_000, hi), ("b", lo, hi), ("d", lo, 1_000)]
    assert block_sizes.differences(new, new, 8) == []
    assert block_sizes.same(new, new.reverse()) and not block_sizes.same(old, new)


def test_the_block_size_of_a_request_is_its_pods_at_its_arrival():
    """:func:`ingest.block_sizes.at`: the size in force at each row's time (a change at exactly that time
    applies), the pod's first known size before it was first seen, the default for a pod never seen; rows keep
    their order."""
    sizes = pl.DataFrame({"pod": ["a", "a", "a", "b"], "since": [1_000, 5_000, 9_000, 3_000],
                          "block_size": [16, 64, 16, 32]})
    rows = pl.DataFrame({"pod": ["a", "a", "a", "a", "b", "c", "a"],
                         "ts": [0, 1_000, 4_999, 5_000, 0, 7_000, 20_000]}).with_columns(
        pl.from_epoch("ts", "ms").dt.replace_time_zone("UTC"))
    assert block_sizes.at(rows, sizes, 8).to_list() == [16, 16, 16, 64, 32, 8, 16]
    assert block_sizes.at(rows.clear(), sizes, 8).to_list() == []
    assert block_sizes.at(rows, sizes.clear(), 8).to_list() == [8] * 7


def fingerprinted(rid: str, body: dict[str, Any], *, at: float, conv: str = "", cached: int = 0) -> dict[str, Any]:
    """A gateway_requests row of ``body`` as the reference gateway fingerprints and salts it (its cache_salt),
    served on pod-a; prompt_tokens = the segments' tokens + 12 template tokens."""
    from gateway.fingerprint import TokenCounter, fingerprint_request

    fp = fingerprint_request(body, "chat.completions", TokenCounter()).to_log_fields()
    for key in (attribution.LINE_HASHES, attribution.CHUNK_HASHES):
        fp[key] = [int(x, 16) for x in fp[key]]
    del fp["token_count_method"]
    prompt = sum(fp[k] for k in ("system_tokens", "tools_tokens", "retrieval_tokens", "history_tokens",
                                 "suffix_tokens")) + 12
    return {"request_id": rid, "ts": T0 + timedelta(seconds=at), "tenant_id": "acme", "conversation_id": conv,
            "agent_run_id": "", "model": "tiny", "pod": "pod-a", "status": 200, "prompt_tokens": prompt,
            "cached_tokens": cached, "e2e_ms": 400.0, "ingested_at": INGESTED, **fp}


def test_a_cache_salt_isolates_prefixes_in_attribution(store):
    """vLLM's cache_salt, as the gateway logs it, through the job on real chDB and the in-memory reference: the same
    prompt under another salt has no predecessor (cold: it could reuse nothing, although the same tokens were just
    served on this pod), under the same salt it is evicted; a conversation's next turn under another salt is
    prefix_drift / cache_salt_changed over what it would have reused, not evicted_before_next_turn."""
    system = {"role": "system", "content": "You are the billing agent of Acme.\nBe brief.\nCite the policy. " * 20}
    tools = [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": [system, {"role": "user", "content": "where is my refund?"}], "tools": tools}
    turn_2 = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "which order?"},
                                   {"role": "user", "content": "order 42"}]}
    rows = [
        fingerprinted("a1", {**body, "cache_salt": "A"}, at=0),
        fingerprinted("a2", {**body, "cache_salt": "A"}, at=5),
        fingerprinted("b1", {**body, "cache_salt": "B"}, at=10),
        fingerprinted("c1", {**body, "cache_salt": "A"}, at=20, conv="c9"),
        fingerprinted("c2", {**turn_2, "cache_salt": "B"}, at=30, conv="c9"),
        fingerprinted("d1", body, at=40, conv="c8"),
        fingerprinted("d2", turn_2, at=50, conv="c8"),
    ]
    insert_requests(store, rows)
    run(store)
    got = attributed(store)
    reference = [(r.request_id, r.cause, r.sub_cause, r.tokens, r.predecessor_request_id)
                 for r in attribution.attribute(rows, default_block_size=32)]
    assert sorted(r[:5] for r in got) == sorted(reference)
    causes: dict[str, dict[tuple[str, str], int]] = {}
    for rid, cause, sub, tokens, pred, *_ in got:
        causes.setdefault(rid, {})[(cause, sub)] = tokens
        assert rid != "b1" or pred == ""
    prompt = {r["request_id"]: r["prompt_tokens"] for r in rows}
    assert causes["a2"][("evicted", "")] > 0  # same salt: the fingerprint predecessor a1
    assert set(causes["b1"]) == {("cold", ""), ("unavoidable", "")}  # another salt: nothing to reuse
    assert set(causes["c2"]) == {("prefix_drift", "cache_salt_changed"), ("unavoidable", "")}
    assert causes["c2"][("prefix_drift", "cache_salt_changed")] == prompt["c1"] // 32 * 32  # c1's whole prompt
    assert set(causes["d2"]) == {("evicted", "evicted_before_next_turn"), ("unavoidable", "")}  # no salt: as before
    stored = dict(store.query_rows("SELECT request_id, cache_salt_hash FROM gateway_requests"))
    assert stored["a1"] == stored["c1"] != stored["b1"] != "" and stored["d1"] == ""


def test_first_answers_skip_the_collapsing_pass_at_insert_and_still_collapse_at_merge(store):
    """First answers are inserted with FIRST_ANSWER_SETTINGS (no collapsing pass at insert: it cost most of the
    INSERT's CPU and has nothing to collapse in rows of sign +1). Shown with a +1/-1 pair: kept as written at
    insert under those settings, cancelled by the default, and cancelled by a merge either way."""
    rows = [("r1", T0, "acme", "pod-a", "tiny", 100, 0, "", "", "", None, 16, [], [], [], "fingerprints", "",
             None, T0, sign, 1) for sign in (1, -1)]
    pair = pa.Table.from_pylist([dict(zip(attribution_job.WRITE_COLUMNS, r, strict=True)) for r in rows],
                                schema=attribution_job._ARROW)

    def stored() -> int:
        return store.query_rows("SELECT count() FROM request_attribution")[0][0]

    store.insert_arrow("request_attribution", pair, attribution_job.FIRST_ANSWER_SETTINGS)
    assert stored() == 2
    store.command("OPTIMIZE TABLE request_attribution FINAL")
    assert stored() == 0
    store.insert_arrow("request_attribution", pair)
    assert stored() == 0


def colliding_ids() -> tuple[str, str]:
    """Two request ids whose order_keys (sql/migrations/0008: 20 bits of the id's MD5 below the millisecond)
    are equal when they share a millisecond."""
    seen: dict[int, str] = {}
    for i in itertools.count():
        rid = f"k{i}"
        bits = int.from_bytes(hashlib.md5(rid.encode()).digest()[:4], "little") >> 12
        if bits in seen:
            return seen[bits], rid
        seen[bits] = rid
    raise AssertionError("unreachable")


@pytest.mark.parametrize("chunk_size", [2, 100])
def test_predecessors_sharing_an_order_key_are_told_apart(store, monkeypatch, chunk_size):
    """The job names targets and matches predecessors on their order_key when that is exact: two requests of one
    millisecond whose order_keys collide must each find their own predecessor and give their own fields to
    their successors (in the chunk, or in a chunk before). A chunk holding both is still searched from its range
    (ingest/key_tails.py), its targets named by (request_id, ts)."""
    from ingest.key_tails import KeyTails

    real, names = KeyTails.found, []

    def spy(self: KeyTails, *args: Any) -> pl.DataFrame:
        names.append(args[-1])
        return real(self, *args)

    monkeypatch.setattr(KeyTails, "found", spy)
    a, b = colliding_ids()
    reqs = [gw("a0", at=-2, conv="c1", prompt=700, suffix="p"), gw("b0", at=-1, conv="c2", pod="pod-b", suffix="o"),
            gw(a, at=0, conv="c1"), gw(b, at=0, conv="c2", pod="pod-b", prompt=900, suffix="other"),
            gw("a2", at=3, conv="c1", pod="pod-b", prompt=830, history="q1|reply1", history_tokens=50, suffix="q2",
               suffix_tokens=20),
            gw("b2", at=4, conv="c2", pod="pod-b", prompt=960, history="other|reply", history_tokens=40,
               suffix="q3", suffix_tokens=30)]
    insert_requests(store, reqs)
    keys = store.query_rows(f"SELECT DISTINCT order_key FROM gateway_requests WHERE request_id IN ('{a}', '{b}')")
    assert len(keys) == 1  # the two predecessors share an order_key
    run(store, chunk_size=chunk_size)
    expected = sorted((r.request_id, r.cause, r.sub_cause, r.tokens, r.predecessor_request_id, r.predecessor_pod)
                      for r in attribution.attribute(reqs, block_size_by_pod={}, default_block_size=32))
    assert {(e[0], e[4]) for e in expected} >= {(a, "a0"), (b, "b0"), ("a2", a), ("b2", b)}
    assert sorted(r[:6] for r in attributed(store)) == expected
    assert ["request_id", "ts"] in names  # the chunk holding a and b


def test_a_chunk_reads_its_targets_keys_by_range_only_when_the_range_holds_exactly_them(store):
    """A chunk's predecessor keys are read from request_keys by its order_key range (``_whole_range``) only when that
    range holds exactly its targets' keys: not when a request of the range is no target (answered before), nor when
    a served target has no prompt (request_keys leaves it out, so its keys would be missed). A failed request
    needs no predecessor and does not prevent it."""
    insert_requests(store, traffic())  # t1, t2, warm, and a failed request without a prompt
    far = datetime(2100, 1, 1, tzinfo=UTC)

    def whole(targets: pl.DataFrame) -> bool:
        return attribution_job._whole_range(store, targets, ["order_key"]) is not None

    arrivals = attribution_job._arrivals(store, attribution_job._EPOCH, far, 0, 2**64 - 1)
    assert len(arrivals) == 4 and whole(arrivals)
    assert not whole(arrivals.filter(pl.col("request_id") != "t2"))  # t2 lies between t1 and warm
    assert whole(arrivals.filter(pl.col("request_id") != "warm"))  # the range then ends at t2
    insert_requests(store, [gw("no-prompt", at=4, prompt=0)])
    assert not whole(attribution_job._arrivals(store, attribution_job._EPOCH, far, 0, 2**64 - 1))


@pytest.mark.parametrize("horizon_seconds", [attribution.DEFAULT_HORIZON_SECONDS, 0.5])
def test_backlog_chunks_answer_the_same_with_their_keys_read_by_range_or_by_ids(store, monkeypatch, horizon_seconds):
    """Generated traffic (bench/history.py: 750 conversations over pods, failed requests; 6 s) in chunks of 700:
    every chunk reads its targets' keys by range (and is searched by the tails carried from the chunk before,
    ingest/key_tails.py), and the answers (causes, tokens, predecessors) are those of the chunks that look their
    ids up in gateway_requests and search in ClickHouse; with a horizon of 0.5 s, most predecessors lie beyond it
    (the lookback's second search looks the keys of the requests without one up by id)."""
    from bench.history import gateway_table

    store.insert_arrow("gateway_requests", gateway_table(3000, seed=5, tenants=1000, pods=3, end=T0))
    real, used = attribution_job._whole_range, []

    def spy(*args: Any) -> dict[str, Any] | None:
        params = real(*args)
        used.append(params is not None)
        return params

    monkeypatch.setattr(attribution_job, "_whole_range", spy)
    reach = {"horizon_seconds": horizon_seconds, "lookback_seconds": 3600.0}
    assert run(store, settle_seconds=-60, chunk_size=700, **reach).chunks == 5
    assert used == [True] * 5
    by_range = (attributed(store), weighted(store))
    assert len({r[0] for r in by_range[0]}) > 2000
    beyond = store.query_rows("SELECT countIf(endsWith(predecessor_kind, '_beyond_horizon')), count() "
                              "FROM request_attribution")[0]
    assert (beyond[0] > 500) == (horizon_seconds < 1), beyond
    store.command("TRUNCATE TABLE request_attribution")
    store.command("TRUNCATE TABLE attribution_watermark")
    monkeypatch.setattr(attribution_job, "_whole_range", lambda *args: None)
    run(store, settle_seconds=-60, chunk_size=700, **reach)
    assert (attributed(store), weighted(store)) == by_range


@pytest.mark.parametrize("bad", [{"horizon_seconds": math.nan}, {"horizon_seconds": -5.0},
                                 {"lookback_seconds": math.inf}, {"overlap_seconds": -1.0},
                                 {"settle_seconds": math.nan}, {"chunk_size": 0}, {"chunk_size": -1},
                                 {"default_block_size": 0}])
def test_parameters_out_of_range_are_refused_before_the_store_is_touched(store, bad):
    """A NaN or negative horizon, a chunk of 0 requests, a block size of 0 tokens: a ValueError naming the
    parameter, and no answer and no watermark written (before: a NaN horizon raised "cannot convert float NaN",
    a chunk size of 0 divided by zero, a negative horizon answered every request cold)."""
    insert_requests(store, [gw("a", at=0), gw("b", at=1, cached=736)])
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"attribution {name}="):
        run(store, settle_seconds=0, **bad) if name != "settle_seconds" else run(store, **bad)
    assert store.query_rows("SELECT (SELECT count() FROM request_attribution), "
                            "(SELECT count() FROM attribution_watermark)")[0] == (0, 0)
    assert run(store, settle_seconds=-1.0).arrivals == 2  # a negative settle is allowed: stamped ahead of the clock


@pytest.mark.parametrize("inserted", ["k8 first", "k602 first"])
def test_two_predecessors_sharing_an_order_key_the_greater_id_hash_wins_on_every_path(store, inserted):
    """k8 and k602 arrive in the same millisecond with the same keys and the same 20 bits of their ids' MD5, so
    their order_keys are equal; succ (the next millisecond) has both as candidates. The tie goes to the greater
    cityHash64 of the id (k602) on every path, whatever order the store holds them in: one run over everything,
    the pair answered in a run before succ's (the lookup of each key's latest row before the run), and the pair
    ingested after succ was answered (succ judged again by the ASOF JOIN in ClickHouse)."""
    a, b = "k8", "k602"

    def low(rid: str) -> int:
        return int.from_bytes(hashlib.md5(rid.encode()).digest()[:4], "little") >> 12

    assert low(a) == low(b)
    winner = max((a, b), key=lambda rid: store.query_rows(f"SELECT cityHash64('{rid}')")[0][0])
    assert winner == b
    order = (a, b) if inserted == "k8 first" else (b, a)

    def pair(at: datetime) -> list[dict[str, Any]]:
        rows = {a: gw(a, at=1, pod="pod-a", ingested=at), b: gw(b, at=1, pod="pod-b", ingested=at)}
        return [rows[rid] for rid in order]

    def succ_predecessor() -> str:
        rows = store.query_rows("SELECT predecessor_request_id FROM request_attribution WHERE request_id = 'succ' "
                                "GROUP BY request_id, ts, version, predecessor_request_id HAVING sum(sign) > 0")
        assert len(rows) == 1
        return rows[0][0]

    def now() -> datetime:
        return attribution_job.server_now(store) - timedelta(milliseconds=1)

    results = {}
    insert_requests(store, [gw("first", at=0, ingested=now()), *pair(now())])
    run(store, settle_seconds=0)
    insert_requests(store, [gw("succ", at=2, pod="pod-b", ingested=now())])
    run(store, settle_seconds=0)
    results["pair answered in an earlier run"] = succ_predecessor()
    store.command("TRUNCATE TABLE request_attribution")
    store.command("TRUNCATE TABLE attribution_watermark")
    run(store, settle_seconds=0)
    results["one run"] = succ_predecessor()
    store.command("TRUNCATE TABLE gateway_requests")
    store.command("TRUNCATE TABLE request_keys")
    store.command("TRUNCATE TABLE request_attribution")
    store.command("TRUNCATE TABLE attribution_watermark")
    insert_requests(store, [gw("first", at=0, ingested=now()), gw("succ", at=2, pod="pod-b", ingested=now())])
    run(store, settle_seconds=0)
    insert_requests(store, pair(now()))
    run(store, settle_seconds=0)
    results["pair ingested after succ was answered"] = succ_predecessor()
    assert results == dict.fromkeys(results, winner)


def test_keys_read_by_range_from_gateway_requests_are_request_keys_rows(store):
    """A chunk's keys by range are read from gateway_requests as request_keys' materialized view makes them
    (ingest/key_tails.py KEYS_OF_RANGE: request_keys is sorted by key, so a range of it scans whole days): the
    same rows as request_keys holds, whole and for a sub-range, on generated traffic with failed requests plus
    a request without a prompt, a failed one and one with no key at all."""
    from bench.history import gateway_table
    from ingest.key_tails import keys_of_range

    store.insert_arrow("gateway_requests", gateway_table(2000, seed=7, tenants=30, pods=3, end=T0))
    insert_requests(store, [gw("no-prompt", at=1, prompt=0, conv="c9"), gw("failed", at=2, status=503, conv="c9"),
                            {**gw("keyless", at=3), "system_hash": "", "system_norm_hash": "", "system_tokens": 0,
                             "prompt_fingerprint": "", "suffix_hash": "", "prev_suffix_hash": ""}])
    columns = ["key", "kind", "order_key", "ts", "request_id"]
    lo, hi = store.query_rows("SELECT quantileExact(0.3)(order_key), quantileExact(0.7)(order_key) "
                              "FROM gateway_requests")[0]
    for where in ("1", f"order_key >= {lo} AND order_key <= {hi}"):
        stored = store.query_rows(f"SELECT {', '.join(columns)} FROM request_keys WHERE {where} "
                                  f"ORDER BY {', '.join(columns)}")
        read = store.query_rows(f"SELECT * FROM ({keys_of_range(columns, where)}) ORDER BY {', '.join(columns)}")
        assert read == stored and len(stored) > 1000
    assert store.query_rows("SELECT countIf(request_id IN ('no-prompt', 'failed', 'keyless')), "
                            "countIf(status >= 400) FROM request_keys AS k "
                            "JOIN gateway_requests AS g USING (request_id, ts)")[0] == (0, 0)
    assert store.query_rows("SELECT countIf(status >= 400) FROM gateway_requests")[0][0] > 10


def test_the_carried_search_finds_what_clickhouse_finds_for_every_chunk(store, monkeypatch):
    """The predecessor search carried from chunk to chunk (ingest/key_tails.py) against the ASOF JOIN in
    ClickHouse, chunk by chunk, on generated traffic in two runs: the second run's requests share conversations and
    tenants with the first's (answered: the latest row of many keys lies before the run), and half of them
    interleave with the first's in time (their chunks' ranges hold answered rows: searched in ClickHouse, the
    tails dropped). Every chunk searched by the tails finds exactly the candidates ClickHouse finds; chunks are
    carried, and look rows before the first carried chunk up."""
    from bench.history import gateway_table
    from ingest.key_tails import KeyTails

    real, calls = KeyTails.found, []

    def checked(self: KeyTails, store_: Store, whole: dict[str, Any], horizon_ms: int, by: list[str]
                ) -> pl.DataFrame:
        carried = self.tails is not None
        got = real(self, store_, whole, horizon_ms, by)
        want = attribution_job._searched(store_, pl.DataFrame(), by, whole, horizon_ms)
        cols = [*by, "kind", "p_order_key", f"p_{attribution_job.ID_HASH}"]
        assert got.select(*cols, pl.col("p_ts").dt.epoch("ms")).sort(cols).rows() == \
            want.select(*cols, pl.col("p_ts").dt.epoch("ms")).sort(cols).rows()
        calls.append((carried, self.start < whole["first"] - 1, len(got)))
        return got

    def two_runs() -> tuple[list[tuple[Any, ...]], dict[tuple[str, str, str], int]]:
        for table in ("gateway_requests", "request_keys", "request_attribution", "attribution_watermark"):
            store.command(f"TRUNCATE TABLE {table}")
        store.insert_arrow("gateway_requests", gateway_table(3000, seed=5, tenants=40, pods=3,
                                                             end=T0 - timedelta(seconds=3), id_prefix="a"))
        assert run(store, settle_seconds=0, chunk_size=500).arrivals == 3000
        store.insert_arrow("gateway_requests", gateway_table(3000, seed=6, tenants=40, pods=3, end=T0,
                                                             id_prefix="b"))
        assert run(store, settle_seconds=0, chunk_size=500).arrivals == 3000
        return attributed(store), weighted(store)

    monkeypatch.setattr(KeyTails, "found", checked)
    answers = two_runs()
    assert any(c for c, _, _ in calls) and any(not c for c, _, _ in calls)
    assert any(c and older for c, older, _ in calls)  # carried, and rows before the first carried chunk looked up
    assert sum(n for _, _, n in calls) > 5000
    assert len({r[0] for r in answers[0]}) > 5000
    monkeypatch.setattr(attribution_job, "_whole_range", lambda *args: None)  # every chunk searched in ClickHouse
    assert two_runs() == answers


def test_the_carried_search_keeps_a_keys_requests_of_one_millisecond_apart(store):
    """A request's predecessor is of an earlier millisecond: a key's rows of the millisecond where a chunk starts
    are no candidates of its requests there and must not hide the key's earlier rows, whether they were carried
    from the chunk before (two requests of one millisecond split between two chunks) or lie before the run (a
    request answered by an earlier run, of the millisecond of this run's first)."""
    def bits(rid: str) -> int:  # order_key's low 20 bits (sql/migrations/0008): which of one ms sorts first
        return int.from_bytes(hashlib.md5(rid.encode()).digest()[:4], "little") >> 12

    a, b = sorted(("a1", "a2"), key=bits)
    x, y = sorted(("x1", "x2"), key=bits)
    early = INGESTED - timedelta(minutes=10)  # out of the next run's overlap window
    insert_requests(store, [gw("p", at=0, conv="c", ingested=early), gw(a, at=1, conv="c", ingested=early),
                            gw(b, at=1, conv="c", ingested=early), gw("q", at=3, conv="d", ingested=early),
                            gw(x, at=5, conv="d", ingested=early)])
    assert run(store, chunk_size=2).chunks == 3  # (p, a), (b, q), (x)
    insert_requests(store, [gw(y, at=5, conv="d", ingested=INGESTED + timedelta(seconds=1))])
    assert run(store).arrivals == 1
    assert store.query_rows("SELECT request_id, predecessor_request_id FROM request_attribution FINAL "
                            "WHERE sign = 1 ORDER BY ts, request_id") == sorted(
        [("p", ""), (a, "p"), (b, "p"), ("q", b), (x, "q"), (y, "q")], key=lambda r: (r[0][0] != "p", r))
    # (q: a new conversation of the tenant: its system prompt's latest request)


def test_the_carried_search_reads_the_rows_between_two_chunks(store, monkeypatch):
    """A request answered by an earlier run (out of this run's window) that lies between two of its chunks in time
    is the next chunk's predecessor: the carried search reads the rows between the last chunk and this one, not
    only this chunk's range."""
    from ingest.key_tails import KeyTails

    real, carried = KeyTails.found, []

    def spy(self: KeyTails, *args: Any) -> pl.DataFrame:
        carried.append(self.tails is not None)
        return real(self, *args)

    monkeypatch.setattr(KeyTails, "found", spy)
    insert_requests(store, [gw("mid", at=10, conv="c", ingested=INGESTED - timedelta(minutes=10))])
    assert run(store).arrivals == 1
    later = INGESTED + timedelta(seconds=1)
    insert_requests(store, [gw(r, at=a, conv="c", ingested=later) for r, a in
                            (("e1", 5), ("e2", 6), ("l1", 15), ("l2", 16))])
    assert run(store, chunk_size=2).chunks == 2
    assert carried == [False, False, True]
    assert store.query_rows("SELECT request_id, predecessor_request_id FROM request_attribution FINAL "
                            "WHERE sign = 1 ORDER BY ts") == [
        ("e1", ""), ("e2", "e1"), ("mid", "e2"), ("l1", "mid"), ("l2", "l1")]


def test_kept_requests_are_found_by_name_and_bounded():
    """The run's recent arrivals (ingest/known_requests.py) are found by (order_key, id_hash), also among rows
    sharing an order_key, and a name not kept is not found; the oldest parts are dropped past the row cap or the
    horizon (the newest part always kept), and a chunk not after the last one starts the parts again."""
    from ingest.known_requests import KnownRequests

    def chunk(names: list[tuple[int, int]], ts_ms: int) -> pl.DataFrame:
        return pl.DataFrame({"order_key": [k for k, _ in names], "id_hash": [i for _, i in names],
                             "ts": [datetime.fromtimestamp(ts_ms / 1000, UTC)] * len(names),
                             "request_id": [f"r{k}.{i}" for k, i in names]},
                            schema_overrides={"order_key": pl.UInt64, "id_hash": pl.UInt64})

    def ids(known: KnownRequests, names: list[tuple[int, int]]) -> list[str | None]:
        found = known.find(np.array([k for k, _ in names], dtype=np.uint64),
                           np.array([i for _, i in names], dtype=np.uint64))
        return known.gather(found)["request_id"].to_list()

    known = KnownRequests(["order_key", "id_hash", "ts", "request_id"], max_rows=9)
    known.add(chunk([(5, 9), (3, 1), (5, 2), (5, 7), (4, 4)], 1_000))
    assert ids(known, [(5, 7), (5, 2), (5, 9), (3, 1), (5, 3), (6, 9), (4, 4)]) == [
        "r5.7", "r5.2", "r5.9", "r3.1", None, None, "r4.4"]
    known.add(chunk([(8, 1), (7, 1), (6, 2), (6, 1), (9, 1)], 2_000))  # 10 rows: the first part goes
    assert ids(known, [(3, 1), (7, 1), (6, 1), (6, 2)]) == [None, "r7.1", "r6.1", "r6.2"]
    known.add(chunk([(10, 1)], 3_000), horizon_start_ms=2_500)  # the part before is older than the horizon
    assert ids(known, [(7, 1), (10, 1)]) == [None, "r10.1"]
    known.add(chunk([(20, 1), (21, 1)], 4_000))  # within the cap: both kept
    assert len(known) == 3 and ids(known, [(10, 1), (21, 1)]) == ["r10.1", "r21.1"]
    known.add(chunk([(2, 1)], 5_000))  # not after the last chunk: the parts start again
    assert len(known) == 1 and ids(known, [(21, 1), (2, 1)]) == [None, "r2.1"]
    known.add(chunk([(40 + i, 1) for i in range(12)], 6_000))  # over the cap alone: kept
    assert len(known) == 12 and ids(known, [(2, 1), (51, 1)]) == [None, "r51.1"]


def test_a_run_reads_back_only_the_predecessors_it_did_not_keep(store, monkeypatch):
    """Generated traffic (bench/history.py, 3000 requests) in chunks of 700: with the default row cap every
    predecessor is found among the run's arrivals kept, none read back from gateway_requests; kept to one chunk,
    the older ones are read back, and the answers are the same."""
    from bench.history import gateway_table

    store.insert_arrow("gateway_requests", gateway_table(3000, seed=7, tenants=50, pods=3, end=T0))
    real, read = attribution_job._by_order_keys, []

    def spy(store: Store, keys: pl.DataFrame, fields: tuple[str, ...]) -> pl.DataFrame:
        if fields == attribution_job._KNOWN:
            read.append(len(keys))
        return real(store, keys, fields)

    monkeypatch.setattr(attribution_job, "_by_order_keys", spy)
    assert run(store, settle_seconds=-60, chunk_size=700).chunks == 5
    assert read == []
    kept = (attributed(store), weighted(store))
    assert sum(1 for r in kept[0] if r[4]) > 2000  # most requests have a predecessor
    store.command("TRUNCATE TABLE request_attribution")
    store.command("TRUNCATE TABLE attribution_watermark")
    monkeypatch.setattr(attribution_job, "KNOWN_ROWS", 700)
    run(store, settle_seconds=-60, chunk_size=700)
    assert sum(read) > 100
    assert (attributed(store), weighted(store)) == kept


def test_a_chunk_sharing_the_latest_answers_millisecond_leaves_them_out(store):
    """A chunk is read without the anti-join against request_attribution only when all its milliseconds are
    later than every answer: a new request of the same millisecond as the latest answered one is answered,
    the answered one is not answered twice."""
    first = gw("x", at=5, conv="c1")
    insert_requests(store, [first])
    assert run(store).arrivals == 1
    insert_requests(store, [{**gw("y", at=5, conv="c2"), "ingested_at": INGESTED + timedelta(seconds=1)}])
    assert run(store).arrivals == 1
    assert store.query_rows("SELECT request_id, sum(sign) FROM request_attribution GROUP BY request_id "
                            "ORDER BY request_id") == [("x", 1), ("y", 1)]


def test_the_block_sizes_of_kv_events_stored_before_the_migration_are_read(store):
    """sql/migrations/0032 fills kv_block_sizes from the BlockStored events already stored, once."""
    now = datetime.now(UTC)
    store.command("DROP VIEW kv_block_sizes_mv")
    store.insert("kv_block_events", [("e1", now, "pod-c", "0", 1, 0, "BlockStored", [1], None, 64, 64, "GPU")],
                 ["event_id", "ts", "pod", "engine", "seq", "idx", "event_type", "block_hashes",
                  "parent_block_hash", "token_count", "block_size", "medium"])
    assert block_sizes.changes(store).is_empty()
    text = dict(sql.migrations())["0032_kv_block_sizes"]
    store.run_migration(text)
    assert block_sizes.changes(store).rows() == [("pod-c", ms(now), 64)]
    store.run_migration(text)  # rerun (a crash before its record): the guard skips the copy
    assert store.query_rows("SELECT count() FROM kv_block_sizes")[0][0] == 1


@pytest.mark.parametrize("order", ["late_predecessor", "in_order"])
def test_a_request_of_0_prompt_tokens_names_no_predecessor_live_or_from_scratch(store, order):
    """`zero` (1 s, a served request of 0 prompt tokens, same tenant and fingerprints as `pred` at 0 s): it missed
    nothing and cannot be a predecessor (request_keys holds no row of it), so no late row can make the job judge it
    again. Before, it named `pred` when judged after it and nothing when judged before `pred` arrived: a run from
    scratch and the live runs disagreed. It now names none either way, as a failed request."""
    rows = {"pred": gw("pred", at=0, cached=64), "zero": gw("zero", at=1, prompt=0, cached=0, suffix_tokens=0)}
    for rid in (["zero", "pred"] if order == "late_predecessor" else ["pred", "zero"]):
        now = attribution_job.server_now(store) - timedelta(milliseconds=1)
        insert_requests(store, [{**rows[rid], "ingested_at": now}])
        attribution_job.run_attribution(store, settle_seconds=0)

    def zero() -> tuple:
        [row] = store.query_rows("SELECT predecessor_request_id, predecessor_kind, gap_ms, causes "
                                 "FROM request_attribution FINAL WHERE request_id = 'zero'")
        return row
    live = zero()
    for table in ("request_attribution", "attribution_watermark"):
        store.command(f"TRUNCATE TABLE {table}")
    attribution_job.run_attribution(store, settle_seconds=0)
    assert live == zero() == ("", "", None, [])
