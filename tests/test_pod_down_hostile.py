"""routed_away / pod_down and skipped_prompt_tokens under hostile inputs (a hunt of stop 31: each test failed before
its mend): the request page names the pods the gateway found down, also without a predecessor; the reference
gateway never writes a pods_down its reader refuses, and lists the pods it skipped as down with one reading of the
clock; data_quality on a pod whose every request read no prefix cache; the overview's coverage note; an alert rule
on the new sub-cause."""

from __future__ import annotations

import uuid
from typing import Any

import polars as pl
import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import N, answers, frames, gw, stored, tokens, turn
from test_kv_residency import collect, ingest

from dashboard import request_detail
from ingest import attribution_job
from ingest.store import Store

B = 32


@pytest.fixture(scope="module")
def precise_store(chdb_dir: Any) -> Store:
    """Scenario 20: s20's prefix (N blocks) sits on 20-b (the predecessor's pod, down as s20 was routed to 20-a);
    20-c (up, serves m20) holds only the FIRST block of it. Block 0 → 20-c (up: plain routed_away), blocks 1..N-1
    → 20-b only (down: routed_away / pod_down)."""
    store = Store.open(data_dir=chdb_dir, database=f"t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    b = B
    sys_ids = tokens(20, N * b)
    msgs = [frames("20-a", 0, 0.5, stored(tokens(20, b, 9), b, 20_900)),
            frames("20-b", 0, 1, stored(sys_ids, b, 20_000)),
            frames("20-c", 0, 1, stored(sys_ids[:b], b, 20_100))]
    rows = [turn("p20", 20, b, t=0.5, pod="20-b", prompt_ids=None, suffix="q1", suffix_tokens=5),
            gw("p20-c", 20, t=0.6, pod="20-c", prompt_ids=None, b=b, prompt=30, tenant="other", system="y",
               system_tokens=20, suffix_tokens=10)]
    s20 = {**turn("s20", 20, b, t=10, pod="20-a", prompt_ids=sys_ids + tokens(20, 20, 1), suffix="q2",
                  suffix_tokens=20), "pods_down": ["20-b"]}
    # 21: as test_attribution_precise's scenario 1 (no fingerprint predecessor): the prefix sits only on 21-b, which
    # the gateway found down as s21 was routed to 21-a (routed_away / pod_down from the KV events alone).
    sys21 = tokens(21, N * b)
    msgs += [frames("21-a", 0, 0.5, stored(tokens(21, b, 9), b, 21_900)),
             frames("21-b", 0, 1, stored(sys21, b, 21_000))]
    rows += [gw("s21-other", 21, t=0.2, pod="21-b", prompt_ids=None, b=b, prompt=50, tenant="other", system="x",
                system_tokens=40, suffix_tokens=10)]
    s21 = {**gw("s21", 21, t=5, pod="21-a", prompt_ids=sys21 + tokens(21, 10, 1), b=b, prompt=N * b + 10,
                system_tokens=N * b, suffix_tokens=10), "pods_down": ["21-b"]}
    ingest(store, collect(msgs))
    insert_requests(store, rows)
    insert_requests(store, [s20, s21])
    attribution_job.run_attribution(store, default_block_size=b)
    return store


def test_precise_split_is_routed_away_then_pod_down(precise_store: Store) -> None:
    """The verdict has both parts, and evidence_pod is the first block's holder, 20-c (up)."""
    got = answers(precise_store)["s20"]
    assert got[0] == [("routed_away", "", B), ("routed_away", "pod_down", (N - 1) * B), ("unavoidable", "", 20)]
    assert got[1:3] == ("kv_events", "20-c")


def test_request_detail_names_the_down_pod_not_the_up_first_holder(precise_store: Store) -> None:
    """The page names the pods the gateway found down (pods_down: 20-b), not the first missed block's holder
    (evidence_pod: 20-c, up), which it named before."""
    rows = precise_store.named("request_detail", {"request_id": "s20"}).to_dicts()
    text = request_detail.evidence(rows[0], pl.DataFrame(rows))
    assert "found **20-c**" not in text and "**20-c** down" not in text
    assert "The gateway found **20-b** down" in text


def test_gateway_with_many_down_pods_writes_a_line_its_ingester_accepts() -> None:
    """The log contract (collector/gateway_record.MAX_PODS_DOWN, the schema's maxItems 256) refuses a line with more
    than 256 pods_down, the whole request with it; with 260 of 300 pods marked down the reference gateway lists the
    first 256 by name (it listed all 260: the line was dead-lettered)."""
    import json

    from collector.gateway_record import BadRecord, decode_record
    from gateway.routing import RoundRobin

    pods = [f"pod-{i:03d}" for i in range(300)]
    clock = [100.0]
    rr = RoundRobin(pods, down_seconds=30, clock=lambda: clock[0])
    for p in pods[:260]:
        rr.mark_down(p)
    route = rr.choose([], exclude=[])
    assert route.down == tuple(pods[:256])  # what the gateway logs as pods_down
    line = json.dumps({"log_version": 1, "request_id": "r-1", "ts": "2026-11-29T12:00:00.000Z", "tenant_id": "acme",
                       "pod": route.pod, "routing_reason": route.reason, "pods_down": list(route.down),
                       "status": 200, "prompt_tokens": 762, "cached_tokens": 0, "ttft_ms": 41.5, "e2e_ms": 812.0})
    try:
        rec = decode_record(line)
    except BadRecord as exc:
        pytest.fail(f"the gateway's own line is refused: {exc}")
    assert rec.prompt_tokens == 762


def test_data_quality_pod_serving_only_prompt_logprobs_is_not_unexplained(store: Store) -> None:
    """A pod whose every request read no prefix cache (prompt logprobs): neither source has a hit rate (vLLM counts
    such requests in no query; the gateway has no cached count). Nothing disagrees: `no_cache_queries`, with its
    figures (it read `unexplained` with an empty text: concat with a NULL gap)."""
    from tests.fixture_data import at

    store.insert("gateway_requests",
                 [(f"lp-{i}", at(10 + i), "acme", "lp", 200, 300, None, True) for i in range(3)],
                 ["request_id", "ts", "tenant_id", "pod", "status", "prompt_tokens", "cached_tokens",
                  "skip_reading_prefix_cache"])
    label = {"vllm:request_success_total": "stop"}
    store.insert("vllm_metrics", [(at(30), "lp", "0", "tiny", name, label.get(name, ""), 0.0, float(n)) for name, n in {
        "vllm:request_success_total": 3, "vllm:prompt_tokens_total": 900,
        "vllm:prefix_cache_queries_total": 0, "vllm:prefix_cache_hits_total": 0}.items()],
        ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"])
    row = store.named("data_quality", {}).row(0, named=True)
    assert (row["pod"], row["skipped_prompt_tokens"], row["cached_tokens_coverage"]) == ("lp", 900, 0.0)
    assert row["likely_cause"] == "no_cache_queries", (row["likely_cause"], row["evidence"], row["gap_pp"])
    assert "900 of them read no prefix cache" in row["evidence"]
    assert row["evidence"] != "", row


def test_request_detail_explains_pod_down_without_a_predecessor(precise_store: Store) -> None:
    """Precise mode gives s21 routed_away / pod_down from the KV events alone (no fingerprint predecessor): the
    page says which pod was down there too (it returned early, calling the prefix cold)."""
    got = answers(precise_store)["s21"]
    assert got[0] == [("routed_away", "pod_down", N * B), ("unavoidable", "", 10)] and got[2] == "21-b"
    rows = precise_store.named("request_detail", {"request_id": "s21"}).to_dicts()
    text = request_detail.evidence(rows[0], pl.DataFrame(rows))
    assert "The gateway found **21-b** down" in text, text


def test_route_down_is_what_the_choice_skipped_from_one_clock_reading() -> None:
    """A down mark expiring between the router's choice and its Route (pod_down as the reason, pods_down empty
    before): the pods logged as down are those the choice skipped, read from one clock reading."""
    from gateway.routing import PrefixAffinity

    now = {"t": 0.0, "calls": 0, "switch_at": None}

    def clock() -> float:
        now["calls"] += 1
        if now["switch_at"] is not None and now["calls"] >= now["switch_at"]:
            return 105.0  # pod-c's mark (100 + 5 s) has just expired
        return now["t"]

    pa = PrefixAffinity(["pod-a", "pod-b", "pod-c"], down_seconds=5, clock=clock)
    now["t"] = 50.0
    first = pa.choose(["fp"], exclude=["pod-a", "pod-b"])  # pins fp to pod-c
    assert first.pod == "pod-c"
    pa.release("pod-c")
    now["t"] = 100.0
    pa.mark_down("pod-c")  # down until 105
    now["t"] = 104.999
    now["calls"], now["switch_at"] = 0, 4  # candidates() reads the clock 3 times (one per pod), take() after
    route = pa.choose(["fp"])
    assert route.pod != "pod-c" and route.reason == "pod_down"  # pod-c was treated as down
    assert route.down == ("pod-c",), route


def test_overview_coverage_note_does_not_blame_pods_for_prompt_logprobs_requests(store: Store) -> None:
    """Every pod reported every count it had; one request asked for prompt logprobs (1,000 of 8,000 prompt tokens):
    the overview's coverage note does not blame pods for counts they did not report (it did)."""
    from dashboard.views import overview
    from tests.fixture_data import at

    cols = ["request_id", "ts", "tenant_id", "pod", "status", "prompt_tokens", "cached_tokens",
            "skip_reading_prefix_cache"]
    store.insert("gateway_requests", [(f"k{i}", at(10 + i), "acme", "p", 200, 1000, 500, False) for i in range(7)]
                 + [("lp", at(20), "acme", "p", 200, 1000, None, True)], cols)
    gw = {r["source"]: r for r in store.named("hit_rate_total").iter_rows(named=True)}["gateway"]
    assert gw["cached_tokens_coverage"] == pytest.approx(7 / 8)
    dq = store.named("data_quality", {}).row(0, named=True)
    assert dq["skipped_prompt_tokens"] == 1000  # every uncovered token is a skipped one
    assert "did not report" not in overview._coverage_note(gw["cached_tokens_coverage"])


def test_alert_rule_on_routed_away_pod_down_parses() -> None:
    """A cause_share rule on `routed_away/pod_down` parses (the alert rules knew only drift sub-causes and
    evicted_before_next_turn)."""
    from dashboard.alert_rules import parse_rules

    rules = parse_rules('[[rule]]\nname = "outages"\nkind = "cause_share"\nseverity = "warning"\nwindow = "1h"\n'
                        'cause = "routed_away/pod_down"\nshare_percent = 20\n')
    assert len(rules) == 1
