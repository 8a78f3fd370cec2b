"""End to end on real vLLM: two vLLM CPU servers, the reference gateway, a real Kafka-protocol broker (tansu),
the collector, the ingester into chDB, and the attribution job; then the store's numbers are checked against
numbers read straight from the servers and from the gateway's responses."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

from demo.workload import run_workload
from gateway.proxy import GatewayServer, make_app
from ingest.attribution_job import run_attribution
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from tests.kill_harness import wait_until as wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.broker]

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
RUNNING = "vllm:num_requests_running"  # a gauge: sent with every scrape


def read_counters(metrics_url: str) -> dict[str, float]:
    """Σ over engines of the prefix-cache counters, read straight from one server's /metrics."""
    body = httpx.get(metrics_url, timeout=10).text
    out = {HITS: 0.0, QUERIES: 0.0}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


@pytest.fixture(scope="module")
def e2e(vllm_fleet, tiny_model_dir, kafka_bootstrap, chdb_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Runs the whole pipeline once for the module and returns what the tests check."""
    from ingest.store import Store

    work = tmp_path_factory.mktemp("e2e")
    gw_log = work / "gateway.jsonl"
    pods = vllm_fleet.pods
    app = make_app([(p.name, p.base_url) for p in pods], gw_log, policy="round_robin",
                   tokenizer_path=Path(tiny_model_dir) / "tokenizer.json")
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    cfg = replace(build_config({}, environ={}), kafka_bootstrap=kafka_bootstrap, topic_namespace=ns,
                  state_dir=str(work / "state"),
                  consumer_group=f"{ns}-ingest", database=f"e2e_{ns}", data_dir=str(chdb_dir),
                  vllm=",".join(f"{p.name}={p.base_url}" for p in pods), gateway_log=str(gw_log),
                  kv_events_endpoint=vllm_fleet.kv_events_endpoint, scrape_interval_seconds=1.0,
                  kv_events_replay=",".join(f"{p.kv_events_topic}={p.kv_replay_endpoint}" for p in pods),
                  attribution_interval_seconds=3600.0)
    store = Store.open(data_dir=chdb_dir, database=cfg.database)
    store.migrate()
    pipe = Pipeline(cfg, store=store)
    with GatewayServer(app) as gw:
        pipe.start()
        try:
            def scraped_all() -> bool:
                rows = store.query_rows(f"SELECT uniqExact(pod) FROM vllm_metrics WHERE name = '{RUNNING}'")
                return rows[0][0] == len(pods)
            wait_for(scraped_all, 60, "a first scrape of every pod")
            before = {p.name: read_counters(p.metrics_url) for p in pods}
            labels = run_workload(gw.url, seed=7, scale=0.5, concurrency=2, labels_path=work / "labels.jsonl",
                                  wait_scale=0.5)
            after = {p.name: read_counters(p.metrics_url) for p in pods}
            t_done = time.time()

            def scraped_after() -> bool:
                rows = store.query_rows(
                    f"SELECT pod, max(ts) FROM vllm_metrics WHERE name = '{RUNNING}' GROUP BY pod")
                return len(rows) == len(pods) and all(r[1].timestamp() > t_done + 0.5 for r in rows)
            wait_for(scraped_after, 60, "a scrape of every pod after the workload")
            n_lines = sum(1 for line in gw_log.read_text().splitlines() if line.strip())
            wait_for(lambda: store.query_rows("SELECT count() FROM gateway_requests")[0][0] == n_lines,
                     60, "every gateway log line in the store")
        finally:
            pipe.close()
    run_attribution(store, settle_seconds=0.0)
    records = [json.loads(line) for line in gw_log.read_text().splitlines() if line.strip()]
    yield {"store": store, "before": before, "after": after, "labels": labels, "records": records,
           "cfg": cfg, "pods": pods, "tokenizer": Path(tiny_model_dir) / "tokenizer.json"}


def test_every_request_succeeded_and_was_logged(e2e) -> None:  # type: ignore[no-untyped-def]
    ok = [lab for lab in e2e["labels"] if lab["status"] == "ok"]
    assert len(ok) == len(e2e["labels"]) > 20
    logged = {r["request_id"] for r in e2e["records"]}
    assert {lab["request_id"] for lab in ok} <= logged


def test_hit_rate_matches_vllm_counters_and_gateway(e2e) -> None:  # type: ignore[no-untyped-def]
    store = e2e["store"]
    d_hits = sum(e2e["after"][p][HITS] - e2e["before"][p][HITS] for p in e2e["after"])
    d_queries = sum(e2e["after"][p][QUERIES] - e2e["before"][p][QUERIES] for p in e2e["after"])
    direct_vllm = d_hits / d_queries
    gw = e2e["records"]
    direct_gateway = sum(r["cached_tokens"] for r in gw) / sum(r["prompt_tokens"] for r in gw)
    df = store.named("hit_rate_total")
    by_source = {row["source"]: row for row in df.iter_rows(named=True)}
    print(f"\nE2E hit rates: vLLM direct {direct_vllm:.4f} ({d_hits:.0f}/{d_queries:.0f}), "
          f"gateway direct {direct_gateway:.4f}, store vllm {by_source['vllm']['token_weighted_hit_rate']:.4f} "
          f"({by_source['vllm']['hit_tokens']}/{by_source['vllm']['query_tokens']}), "
          f"store gateway {by_source['gateway']['token_weighted_hit_rate']:.4f} "
          f"({by_source['gateway']['hit_tokens']}/{by_source['gateway']['query_tokens']})")
    assert d_queries > 10_000
    # Exact token counts, not only ratios: the store's counter deltas between its first scrape (before the
    # workload, on an idle fleet) and its last (after) are the servers' own before/after difference.
    assert (by_source["vllm"]["hit_tokens"], by_source["vllm"]["query_tokens"]) == (round(d_hits), round(d_queries))
    assert (by_source["gateway"]["hit_tokens"], by_source["gateway"]["query_tokens"]) == (
        sum(r["cached_tokens"] for r in gw), sum(r["prompt_tokens"] for r in gw))
    # The two sources measure the same tokens here (no other clients), so they agree exactly too.
    direct = (sum(r["cached_tokens"] for r in gw), sum(r["prompt_tokens"] for r in gw))
    assert (round(d_hits), round(d_queries)) == direct


def test_timestamp_first_tenant_is_volatile_system(e2e) -> None:  # type: ignore[no-untyped-def]
    store = e2e["store"]
    ids = [lab["request_id"] for lab in e2e["labels"] if lab["pathology"] == "volatile_system"]
    assert len(ids) >= 3
    rows = store.query_rows(
        "SELECT cause, sub_cause, sum(tokens) FROM miss_attribution WHERE request_id IN {ids:Array(String)} "
        "GROUP BY cause, sub_cause", {"ids": ids})
    by = {(c, s): t for c, s, t in rows}
    drift = by.get(("prefix_drift", "volatile_system"), 0)
    avoidable = sum(t for (c, _), t in by.items() if c != "unavoidable")
    print(f"\nvolatile_system tenant: {by}")
    assert drift > 0
    # all but the tenant's first request find a predecessor; their prefix misses are volatile_system
    assert drift >= 0.6 * avoidable


def test_second_turn_on_other_pod_is_routed_away(e2e) -> None:  # type: ignore[no-untyped-def]
    store = e2e["store"]
    moved = second_turns(e2e, moved=True)
    assert moved, "round robin sent no second turn to the other pod"
    rows = store.query_rows(
        "SELECT request_id, sum(tokens) FROM miss_attribution WHERE request_id IN {ids:Array(String)} "
        "AND cause = 'routed_away' GROUP BY request_id", {"ids": moved})
    print(f"\nsecond turns moved to another pod: {len(moved)}; attributed routed_away: {len(rows)}")
    assert {r[0] for r in rows} == set(moved)
    assert all(r[1] > 0 for r in rows)


def second_turns(e2e, *, moved: bool) -> list[str]:  # type: ignore[no-untyped-def]
    """Request ids of healthy chat second turns whose first turn the gateway log shows on another pod
    (``moved``) or on the same pod: ground truth from the log, not from the attribution."""
    by_id = {r["request_id"]: r for r in e2e["records"]}
    out = []
    for lab in e2e["labels"]:
        if lab["turn"] == 2 and lab["pathology"] == "none" and not lab.get("agent_run_id"):
            first = by_id.get(lab["request_id"][: -len("-t2")] + "-t1")
            second = by_id.get(lab["request_id"])
            if first and second and (first["pod"] != second["pod"]) == moved:
                out.append(second["request_id"])
    return out


def later_turns_that_stayed(e2e) -> list[str]:  # type: ignore[no-untyped-def]
    """Request ids of every later turn (2, 3, ...; any pathology, chats and agent runs) that the gateway log shows
    on the pod of the turn before it: its predecessor's pod, so never ``routed_away``. (Round robin with two
    concurrent clients places turns at random: healthy second turns alone stayed on their pod in too few runs.)"""
    by_id = {r["request_id"]: r for r in e2e["records"]}
    out = []
    for lab in e2e["labels"]:
        stem, sep, turn = lab["request_id"].rpartition("-t")
        if not sep or not turn.isdigit() or int(turn) < 2:
            continue
        before, this = by_id.get(f"{stem}-t{int(turn) - 1}"), by_id.get(lab["request_id"])
        if before and this and before["pod"] == this["pod"]:
            out.append(this["request_id"])
    return out


def test_later_turns_that_stayed_on_their_pod_are_never_routed_away(e2e) -> None:  # type: ignore[no-untyped-def]
    """Negative control for the test above: turns served by their previous turn's pod."""
    stayed = later_turns_that_stayed(e2e)
    rows = e2e["store"].query_rows(
        "SELECT request_id, cause FROM miss_attribution WHERE request_id IN {ids:Array(String)}", {"ids": stayed})
    print(f"\nsecond turns that stayed on their pod: {len(stayed)}; their causes: {sorted({c for _, c in rows})}")
    assert stayed, "round robin kept no later turn on its pod"
    assert [r for r in rows if r[1] == "routed_away"] == []


def test_kv_events_arrived_from_both_pods(e2e) -> None:  # type: ignore[no-untyped-def]
    rows = e2e["store"].query_rows(
        "SELECT pod, countIf(event_type = 'BlockStored') FROM kv_block_events GROUP BY pod ORDER BY pod")
    assert [r[0] for r in rows] == sorted(p.name for p in e2e["pods"])
    assert all(r[1] > 0 for r in rows)


def test_offsets_committed_nothing_redelivered(e2e) -> None:  # type: ignore[no-untyped-def]
    """A new member of the ingest group gets nothing: every message was committed after its insert."""
    from ingest.source import KafkaSource

    cfg = e2e["cfg"]
    src = KafkaSource(cfg.kafka_bootstrap, cfg.consumer_group, namespace=cfg.topic_namespace)
    try:
        got = []
        deadline = time.time() + 20
        while time.time() < deadline and not src.assignment():
            got += src.poll(500)
        for _ in range(4):
            got += src.poll(500)
        assert src.assignment(), "consumer never joined the group"
        assert got == []
    finally:
        src.close()


@pytest.mark.browser
def test_dashboard_in_headless_chromium_shows_numbers(e2e, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`kvscope up` over the same fleet and gateway log, in its own process (its own chDB directory), viewed
    in Debian's Chromium through Playwright; the screenshot is saved to tests/artifacts/dashboard.png."""
    import os
    import re
    import subprocess
    import sys

    from playwright.sync_api import sync_playwright

    port = free_port()
    cfg = e2e["cfg"]
    artifacts = Path(__file__).parent / "artifacts"
    artifacts.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    cmd = [sys.executable, "-m", "kvscope.cli", "up", "--data-dir", str(tmp_path / "data"), "--port", str(port),
           "--gateway-log", cfg.gateway_log, *[a for t in cfg.list("vllm") for a in ("--vllm", t)]]
    with open(artifacts / "kvscope-up.log", "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_for(lambda: _http_ok(url) or proc.poll() is not None, 90, "the dashboard to listen")
            assert proc.poll() is None, (artifacts / "kvscope-up.log").read_text()[-3000:]
            time.sleep(3)  # its first scrape, so the live traffic below moves the vLLM counters it watches
            app = make_app([(p.name, p.base_url) for p in e2e["pods"]], Path(cfg.gateway_log),
                           policy="prefix_affinity", tokenizer_path=e2e["tokenizer"])
            with GatewayServer(app) as gw:
                run_workload(gw.url, seed=23, scale=0.2, concurrency=2, wait_scale=0.2)  # seed 11: test_workload
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=[
                    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync"])
                page = browser.new_page(viewport={"width": 1400, "height": 2200})
                deadline = time.time() + 120
                values: list[str] = []
                while time.time() < deadline:
                    page.goto(url, wait_until="networkidle")
                    page.wait_for_selector("[data-testid='stMetricValue']", timeout=60_000)
                    page.wait_for_timeout(1500)
                    values = page.locator("[data-testid='stMetricValue']").all_inner_texts()
                    if all(re.fullmatch(r"\d+(\.\d+)?%", v) for v in values[:3]):
                        break
                    time.sleep(3)
                page.wait_for_selector(".js-plotly-plot", timeout=30_000)
                page.wait_for_timeout(2000)
                page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
                browser.close()
            print(f"\ndashboard metric values: {values}")
            # the first three are the token-weighted hit rate from vLLM and from the gateway, request-weighted
            assert all(re.fullmatch(r"\d+(\.\d+)?%", v) for v in values[:3]), values
            assert (artifacts / "dashboard.png").stat().st_size > 20_000
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
