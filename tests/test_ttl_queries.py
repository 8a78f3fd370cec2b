"""The agent-TTL named queries (ttl_survival, ttl_hold_time, ttl_runs) on the hand-built scenario of
tests/ttl_data.py; every expected figure is derived by hand in the comments from that scenario."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from ingest.store import Store
from tests import ttl_data
from tests.ttl_data import POD_A_SECONDS_PER_TOKEN as RATE_A
from tests.ttl_data import POD_B_SECONDS_PER_TOKEN as RATE_B


@pytest.fixture(scope="module")
def ttl(chdb_dir: Path) -> Store:
    s = Store.open(data_dir=chdb_dir, database=f"ttl_{uuid.uuid4().hex[:12]}")
    s.migrate()
    ttl_data.load(s)
    return s


def rows(store: Store, name: str, **params: Any) -> list[dict[str, Any]]:
    return store.named(name, {k: str(v) for k, v in params.items()}).to_dicts()


def test_survival_by_gap_bucket(ttl: Store) -> None:
    """Same-pod next turns with a known cached count: agentco r1-t1 (0.5 s), r1-t2 (3 s) survived, r2-t1 (10 s,
    960 evicted on pod-b), r1-t3 (2 min, 736 evicted on pod-a); chatco c1-t1 (20 s) survived (its cancelled older
    answer said evicted). r2-t2 (not_reported) and c1-t2 (another pod) are left out."""
    got = {(r["tenant_id"], r["gap_bucket"]): r for r in rows(ttl, "ttl_survival")}
    assert set(got) == {("agentco", "<1s"), ("agentco", "1-5s"), ("agentco", "5-15s"), ("agentco", "1-5m"),
                        ("chatco", "15-60s")}
    short = (got[("agentco", "<1s")], got[("agentco", "1-5s")], got[("chatco", "15-60s")])
    assert [(r["turns"], r["survived_turns"], r["survival_share"], r["evicted_missed_tokens"]) for r in short] == [
        (1, 1, 1.0, 0)] * 3
    ten, two_min = got[("agentco", "5-15s")], got[("agentco", "1-5m")]
    assert (ten["turns"], ten["survived_turns"], ten["survival_share"]) == (1, 0, 0.0)
    assert ten["evicted_missed_tokens"] == 960
    assert (two_min["bucket_index"], two_min["bucket_start_ms"], two_min["evicted_missed_tokens"]) == (4, 60000.0, 736)
    assert ten["gpu_seconds"] == pytest.approx(960 * RATE_B)  # pod-b's own rate: 0.2 s / (4000 − 2000) tokens
    assert two_min["gpu_seconds"] == pytest.approx(736 * RATE_A)
    assert [r["gap_bucket"] for r in rows(ttl, "ttl_survival", tenant="agentco")] == ["<1s", "1-5s", "5-15s", "1-5m"]
    assert [r["gap_bucket"] for r in rows(ttl, "ttl_survival", pod="pod-b")] == ["5-15s"]


def test_hold_time_quantiles_bytes_and_blocks(ttl: Store) -> None:
    """Six same-pod next turns (c1-t2 ran on another pod), gaps 500, 3000, 10000, 12000, 20000, 120000 ms.
    Nearest rank: p50 = the ⌈3⌉rd = 10 s (3 warm), p90 = p99 = the 6th = 2 min. Previous prompts 640, 700, 760,
    960, 1000, 320: mean 730 tokens, full blocks 20, 21, 23, 30, 31, 10: mean 22.5."""
    got = {r["percent"]: r for r in rows(ttl, "ttl_hold_time")}
    assert sorted(got) == [50, 90, 99]
    assert [(got[p]["next_turns"], got[p]["hold_ms"], got[p]["warm_turns"]) for p in (50, 90, 99)] == [
        (6, 10000.0, 3), (6, 120000.0, 6), (6, 120000.0, 6)]
    p50 = got[50]
    assert (p50["held_tokens"], p50["held_blocks"]) == (pytest.approx(730), pytest.approx(22.5))
    # Without the setting only pod-a's four turns have bytes per token (1024): (640+700+760+320) × 1024 / 4.
    assert (p50["bytes_per_token"], p50["retained_bytes"]) == (pytest.approx(1024), pytest.approx(605 * 1024))
    # Blocks × min(gap, hold): p50 20·0.5 + 21·3 + 23·10 + 30·10 + 31·10 + 10·10 = 1013 block-seconds;
    # p90 20·0.5 + 21·3 + 23·120 + 30·10 + 31·12 + 10·20 = 3705.
    assert (p50["held_block_seconds"], got[90]["held_block_seconds"]) == (pytest.approx(1013), pytest.approx(3705))


def test_hold_time_bytes_from_the_setting_and_other_percents(ttl: Store) -> None:
    """pod-b's cache_config_info lacks the KV size: 2048 bytes per token from the parameter for its two turns
    (960 and 1000 tokens held), pod-a's stay 1024: (2420·1024 + 1960·2048) / 6 bytes per waiting run."""
    got = {r["percent"]: r for r in rows(ttl, "ttl_hold_time", kv_bytes_per_token=2048, percents="[10, 100]")}
    assert sorted(got) == [10, 100]
    assert (got[10]["hold_ms"], got[10]["warm_turns"]) == (500.0, 1)  # ⌈0.6⌉ = the 1st gap
    assert got[100]["hold_ms"] == 120000.0
    assert got[10]["retained_bytes"] == pytest.approx((2420 * 1024 + 1960 * 2048) / 6)
    assert got[10]["bytes_per_token"] == pytest.approx((4 * 1024 + 2 * 2048) / 6)
    assert rows(ttl, "ttl_hold_time", tenant="nobody") == []


def test_runs_wait_evicted_recompute_and_retained(ttl: Store) -> None:
    """Per run, every previous-turn next turn (any pod): run-2 waits 10 + 12 s and lost 960 tokens on pod-b
    (96 GPU-ms at 1e-4 s/token); run-1 waits 0.5 + 3 + 120 s and lost 736 on pod-a (36.8 GPU-ms); conv-1 waits
    20 + 20 s and lost nothing. Retained: the largest previous prompt × bytes per token."""
    got = rows(ttl, "ttl_runs")
    assert [(r["tenant_id"], r["run_kind"], r["run_id"]) for r in got] == [
        ("agentco", "agent_run", "run-2"), ("agentco", "agent_run", "run-1"), ("chatco", "conversation", "conv-1")]
    run2, run1, conv1 = got
    assert [(r["next_turns"], r["tool_latency_ms"], r["tool_latency_max_ms"], r["evicted_before_next_turn"])
            for r in got] == [(2, 22000.0, 12000.0, 960), (3, 123500.0, 120000.0, 736), (2, 40000.0, 20000.0, 0)]
    assert run2["recompute_prefill_ms"] == pytest.approx(960 * RATE_B * 1000)
    assert run1["recompute_prefill_ms"] == pytest.approx(736 * RATE_A * 1000)
    assert conv1["recompute_prefill_ms"] == 0.0
    assert (run1["cache_retained_bytes"], run2["cache_retained_bytes"]) == (760 * 1024, None)  # pod-b: unknown
    assert conv1["cache_retained_bytes"] == 320 * 1024  # c1-t2 ran on pod-b, whose bytes per token are unknown
    with_setting = {r["run_id"]: r for r in rows(ttl, "ttl_runs", kv_bytes_per_token=2048)}
    assert with_setting["run-2"]["cache_retained_bytes"] == 1000 * 2048
    assert with_setting["conv-1"]["cache_retained_bytes"] == 400 * 2048  # c1-t2 holds c1-t1's 400 on pod-b
    assert len(rows(ttl, "ttl_runs", limit=1)) == 1


def test_no_prefill_measurement_means_no_cost(chdb_dir: Path) -> None:
    """Without vllm:request_prefill_time_seconds the cost is unknown (NULL), not 0."""
    s = Store.open(data_dir=chdb_dir, database=f"ttl_nocost_{uuid.uuid4().hex[:8]}")
    s.migrate()
    ttl_data.load(s)
    s.command("TRUNCATE TABLE vllm_1m")
    s.command("TRUNCATE TABLE vllm_1h")
    assert {r["gpu_seconds"] for r in rows(s, "ttl_survival")} == {None}
    assert {r["recompute_prefill_ms"] for r in rows(s, "ttl_runs")} == {None}
