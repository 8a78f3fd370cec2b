"""The attribution job on real chDB (ingest/attribution_job.py): gateway_requests in, miss_attribution and
the watermark out; reruns write nothing new, a crash before the watermark rewrites identical rows.
Uses the ``store`` fixture of tests/conftest.py (one chDB directory per process, a database per test)."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from ingest import attribution, attribution_job
from ingest.store import Store

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
INGESTED = T0 + timedelta(minutes=5)
NOW = INGESTED + timedelta(seconds=10)


def h(text: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_OID, text).hex[:16] if text else ""


def gw(rid: str, *, at: float, ingested: datetime = INGESTED, conv: str = "", pod: str = "pod-a",
       prompt: int = 762, cached: int = 0, status: int = 200, history: str = "", prev_history: str = "",
       history_tokens: int = 0, suffix: str = "q1", suffix_tokens: int = 22) -> dict[str, Any]:
    system = h("You are the support agent of Acme.")
    return {
        "event_id": f"ev-{rid}", "request_id": rid, "ts": T0 + timedelta(seconds=at), "tenant_id": "acme",
        "conversation_id": conv, "agent_run_id": "", "model": "tiny", "pod": pod, "status": status,
        "prompt_tokens": prompt, "cached_tokens": cached, "e2e_ms": 400.0,
        "system_hash": system, "system_norm_hash": system, "system_tokens": 720,
        "tools_hash": "", "tools_canonical_hash": "", "tools_tokens": 0,
        "retrieval_pack_hash": "", "retrieval_set_hash": "", "retrieval_tokens": 0,
        "history_prefix_hash": h(history), "prev_history_hash": h(prev_history),
        "history_tokens": history_tokens,
        "suffix_hash": h(suffix), "suffix_tokens": suffix_tokens,
        "prompt_fingerprint": h(system + h(history)), "ingested_at": ingested,
    }


def insert_requests(store: Store, rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    store.insert("gateway_requests", [tuple(r[c] for c in cols) for r in rows], cols)


def insert_block_size(store: Store, pod: str, size: int, at: datetime) -> None:
    store.insert("vllm_metric_samples",
                 [(f"cfg-{pod}-{size}", at, pod, "0", "", "vllm:cache_config_info",
                   {"block_size": str(size), "engine": "0"}, 1.0)],
                 ["event_id", "ts", "pod", "engine", "model_name", "name", "labels", "value"])


def attributed(store: Store) -> list[tuple[Any, ...]]:
    return store.query_rows(
        "SELECT request_id, cause, sub_cause, tokens, predecessor_request_id, predecessor_pod, gap_ms, "
        "block_size FROM miss_attribution FINAL ORDER BY ts, request_id, cause, sub_cause"
    )


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


def test_job_writes_once_and_advances_the_watermark(store):
    insert_block_size(store, "pod-a", 16, T0 - timedelta(hours=1))  # older sample: the latest one wins
    insert_block_size(store, "pod-a", 32, T0)
    insert_block_size(store, "pod-b", 32, T0)
    insert_requests(store, traffic())
    assert attribution_job.block_sizes(store) == {"pod-a": 32, "pod-b": 32}

    assert attribution_job.run_attribution(store, now=NOW) == 5
    assert attributed(store) == EXPECTED
    assert attribution_job.read_watermark(store) == INGESTED

    assert attribution_job.run_attribution(store, now=NOW + timedelta(seconds=30)) == 0
    assert attributed(store) == EXPECTED
    assert store.query_rows("SELECT count() FROM miss_attribution")[0][0] == 5
    assert attribution_job.read_watermark(store) == INGESTED


def test_rows_sum_to_missed_tokens_per_request(store):
    insert_requests(store, traffic())
    attribution_job.run_attribution(store, now=NOW)
    rows = store.query_rows(
        "SELECT g.request_id, g.prompt_tokens - g.cached_tokens, sum(m.tokens) "
        "FROM gateway_requests AS g FINAL INNER JOIN (SELECT * FROM miss_attribution FINAL) AS m "
        "ON m.request_id = g.request_id "
        "GROUP BY g.request_id, g.prompt_tokens, g.cached_tokens ORDER BY g.request_id"
    )
    assert rows and all(missed == total for _, missed, total in rows)


def test_crash_before_the_watermark_rewrites_identical_rows(store):
    insert_requests(store, traffic())
    # The crash: rows written with an earlier attributed_at, the watermark never advanced.
    picked = [{k: v for k, v in r.items()} for r in traffic()]
    rows = attribution.attribute(picked, block_size_by_pod={}, default_block_size=32)
    store.insert("miss_attribution", [(*r.as_tuple(), NOW - timedelta(seconds=5)) for r in rows],
                 attribution_job.OUTPUT_COLUMNS)
    assert attribution_job.run_attribution(store, now=NOW, default_block_size=32) == 5
    assert attributed(store) == EXPECTED


def test_later_requests_find_predecessors_already_attributed(store):
    insert_requests(store, traffic())
    assert attribution_job.run_attribution(store, now=NOW, default_block_size=32) == 5
    later = INGESTED + timedelta(minutes=1)
    insert_requests(store, [gw("t3", at=70, conv="c1", pod="pod-b", prompt=900, cached=0,
                               history="q1|reply1|q2|reply2", prev_history="q1|reply1", history_tokens=120,
                               suffix="q3", suffix_tokens=20, ingested=later)])
    # Turn 3 continues turn 2 (830 tokens, pod-b) on pod-b after 66.6 s, but nothing was left in its cache.
    n = attribution_job.run_attribution(store, now=later + timedelta(seconds=10), default_block_size=32)
    assert n == 2
    t3 = [r for r in attributed(store) if r[0] == "t3"]
    assert t3 == [("t3", "evicted", "evicted_before_next_turn", 800, "t2", "pod-b", 66600.0, 32),
                  ("t3", "unavoidable", "", 100, "t2", "pod-b", 66600.0, 32)]
    assert attributed(store)[:5] == EXPECTED
    assert attribution_job.read_watermark(store) == later


def test_settle_leaves_the_newest_requests_for_the_next_run(store):
    insert_requests(store, traffic())
    assert attribution_job.run_attribution(store, now=INGESTED + timedelta(seconds=1), settle_seconds=2.0,
                                           default_block_size=32) == 0
    assert attribution_job.read_watermark(store) == datetime(1970, 1, 1, tzinfo=UTC)
    assert attribution_job.run_attribution(store, now=INGESTED + timedelta(seconds=2), settle_seconds=2.0,
                                           default_block_size=32) == 5


def test_loop_runs_until_stopped(store):
    real_past = datetime.now(UTC) - timedelta(minutes=1)  # the loop uses the clock: ingested before it
    insert_requests(store, [{**r, "ingested_at": real_past} for r in traffic()])
    stop = threading.Event()
    thread = threading.Thread(target=attribution_job.attribution_loop, args=(store, stop, 0.05),
                              kwargs={"default_block_size": 32}, daemon=True)
    thread.start()
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while datetime.now(UTC) < deadline:
            if store.query_rows("SELECT count() FROM miss_attribution")[0][0]:
                break
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert attributed(store) == EXPECTED
