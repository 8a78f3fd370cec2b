"""Unknown is not zero, and usage conventions are declared (issue 7, failures 1 and 2): small gateway logs, each
value computed by hand, through the real store on both ingest paths (the live ingester and the bulk import)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from conftest_vllm import fleet_fixture
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_proxy import chat_body

from collector.gateway_log import line_event
from collector.gateway_record import BadRecord, decode_record
from demo.fleet import VllmFleet
from gateway.log import SCHEMA_PATH
from gateway.proxy import GatewayServer, make_app
from ingest.attribution_job import run_attribution
from ingest.bulk import load_gateway_log
from ingest.store import Store
from kvscope.importer import import_events
from tests.clock import DAY

H = "0123456789abcdef"


def line(rid: str, second: int, pod: str, prompt: int, cached: int | None, *, system_tokens: int,
         suffix_tokens: int, error: str = "", **usage: Any) -> dict[str, Any]:
    """A complete, schema-valid log record (conversation "c" of tenant acme, all one minute)."""
    return {
        "log_version": 1, "request_id": rid, "ts": f"{DAY}T12:00:{second:02d}.000Z", "tenant_id": "acme",
        "conversation_id": "", "agent_run_id": "", "model": "tiny", "pod": pod, "endpoint": "chat.completions",
        "stream": True, "routing_policy": "round_robin", "routing_reason": "round_robin", "status": 200,
        "error": error, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 4,
        "ttft_ms": 10.0, "e2e_ms": 20.0, "queue_wait_ms": None, "tool_latency_ms": None,
        "system_hash": H, "system_norm_hash": H, "system_tokens": system_tokens, "tools_hash": "",
        "tools_canonical_hash": "", "tools_tokens": 0, "retrieval_pack_hash": "", "retrieval_set_hash": "",
        "retrieval_tokens": 0, "history_prefix_hash": "", "prev_history_hash": "", "history_tokens": 0,
        "suffix_hash": H, "suffix_tokens": suffix_tokens, "prompt_fingerprint": H,
        "token_count_method": "estimate", **usage,
    }


#: Ten requests. pod-a reports cached tokens: Σ prompt 6,000, Σ cached 0+500+900+600+0+700 = 2,700 (45 %).
#: pod-b runs without --enable-prompt-tokens-details: 1,000 + 2,000 + 1,000 prompt tokens, cached null; r10's
#: stream was cut before its usage chunk: the gateway logged the fingerprint's 300 + 100 = 400 tokens.
#: All prompt tokens 6,000 + 4,000 + 400 = 10,400; known 6,000; coverage 6,000 / 10,400.
FLEET = [
    *(line(f"r{i}", i, "pod-a", 1000, c, system_tokens=900, suffix_tokens=100)
      for i, c in enumerate([0, 500, 900, 600, 0, 700], start=1)),
    line("r7", 7, "pod-b", 1000, None, system_tokens=900, suffix_tokens=100),
    line("r8", 8, "pod-b", 2000, None, system_tokens=1900, suffix_tokens=100),
    line("r9", 9, "pod-b", 1000, None, system_tokens=900, suffix_tokens=100),
    line("r10", 10, "pod-b", 400, None, system_tokens=300, suffix_tokens=100,
         error="stream not completed: client disconnected"),
]

#: Anthropic-style usage (prompt_tokens = uncached input). True counts (prompt, cached): e1 200 + 800 created =
#: (1000, 0); e2 500 + 500 read = (1000, 500); e3 1,400 + 2,600 read = (4000, 2600), the heaviest, more read
#: than input; e4 1,000 + 500 read (given as cached_tokens) + 500 created = (2000, 500). Σ 3,600 / 8,000 = 45 %.
EXCLUSIVE = [
    line("e1", 1, "pod-a", 200, 0, system_tokens=900, suffix_tokens=100, usage_convention="exclusive",
         cache_read_input_tokens=0, cache_creation_input_tokens=800),
    line("e2", 2, "pod-a", 500, 500, system_tokens=900, suffix_tokens=100, usage_convention="exclusive",
         cache_read_input_tokens=500),
    line("e3", 3, "pod-a", 1400, 2600, system_tokens=3900, suffix_tokens=100, usage_convention="exclusive",
         cache_read_input_tokens=2600, cache_creation_input_tokens=0),
    line("e4", 4, "pod-a", 1000, 500, system_tokens=1900, suffix_tokens=100, usage_convention="exclusive",
         cache_creation_input_tokens=500),
]


def validate(record: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(record)


def load(store: Store, records: list[dict[str, Any]], path_kind: str, tmp_path: Path) -> None:
    """Write the records as a log file and load it the live way (collector events → ingester) or in bulk."""
    log = tmp_path / "gateway.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in records)
    log.write_text(text)
    if path_kind == "bulk":
        stats = load_gateway_log(store, log)
        assert (stats.rows, stats.dead_letters) == (len(records), 0)
        return
    events, offset = [], 0
    for raw in text.encode().splitlines(keepends=True):
        events.append(line_event(raw.rstrip(b"\n"), pod="gateway", source_file=str(log), offset=offset))
        offset += len(raw)
    written = import_events(store, events)
    assert written.get("gateway_requests") == len(records) and not written.get("dead_letters")


PATHS = pytest.mark.parametrize("path_kind", ["live", "bulk"])


def test_the_records_are_schema_valid_and_decode() -> None:
    for r in FLEET + EXCLUSIVE:
        validate(r)
        decode_record(json.dumps(r))


@PATHS
def test_unknown_cached_tokens_are_null_and_the_hit_rate_is_over_known_tokens(store: Store, tmp_path: Path,
                                                                              path_kind: str) -> None:
    load(store, FLEET, path_kind, tmp_path)
    rows = dict(store.query_rows("SELECT request_id, cached_tokens FROM gateway_requests"))
    assert [rows[f"r{i}"] for i in range(7, 11)] == [None] * 4 and rows["r2"] == 500
    by = {r["source"]: r for r in store.named("hit_rate_total").iter_rows(named=True)}
    gw = by["gateway"]
    assert (gw["hit_tokens"], gw["query_tokens"], gw["requests"]) == (2700, 6000, 10)
    assert gw["token_weighted_hit_rate"] == pytest.approx(0.45)
    assert gw["cached_tokens_coverage"] == pytest.approx(6000 / 10400)
    # request-weighted over the six known: (0 + .5 + .9 + .6 + 0 + .7) / 6
    assert gw["request_weighted_hit_rate"] == pytest.approx(2.7 / 6)
    pods = {r["pod"]: r for r in store.named("pods").iter_rows(named=True)}
    assert (pods["pod-a"]["token_weighted_hit_rate"], pods["pod-a"]["cached_tokens_coverage"]) == (0.45, 1.0)
    assert pods["pod-b"]["token_weighted_hit_rate"] is None and pods["pod-b"]["cached_tokens_coverage"] == 0.0
    assert (pods["pod-b"]["requests"], pods["pod-b"]["prompt_tokens"]) == (4, 4400)  # the cut stream is served
    tokens = store.named("tokens").row(0, named=True)
    assert (tokens["prompt_tokens"], tokens["cached_tokens"], tokens["prefill_computed_tokens"]) == (
        10400, 2700, 3300)
    tenant = store.named("tenant_affinity").row(0, named=True)
    assert tenant["token_weighted_hit_rate"] == pytest.approx(0.45)
    assert tenant["cached_tokens_coverage"] == pytest.approx(6000 / 10400)
    matrix = {r["pod"]: r for r in store.named("tenant_pod_matrix").iter_rows(named=True)}
    assert matrix["pod-b"]["cached_tokens_coverage"] == 0.0 and matrix["pod-a"]["token_weighted_hit_rate"] == 0.45


@PATHS
def test_unknown_requests_are_attributed_not_reported(store: Store, tmp_path: Path, path_kind: str) -> None:
    """r7..r10: one cause, not_reported, for all their prompt tokens (1,000 + 2,000 + 1,000 + 400 = 4,400); the
    known requests keep their own causes (they sum to Σ(prompt − cached) = 6,000 − 2,700 = 3,300)."""
    load(store, FLEET, path_kind, tmp_path)
    run_attribution(store, settle_seconds=-60)
    causes = dict(store.query_rows(
        "SELECT cause, sum(toInt64(n) * sign) FROM request_attribution ARRAY JOIN causes AS cause, "
        "missed_tokens AS n GROUP BY cause"))
    assert causes.pop("not_reported") == 4400
    assert sum(causes.values()) == 3300
    per_request = dict(store.query_rows(
        "SELECT request_id, causes FROM request_attribution WHERE request_id IN ('r7', 'r8', 'r9', 'r10')"))
    assert per_request == {"r7": ["not_reported"], "r8": ["not_reported"], "r9": ["not_reported"],
                           "r10": ["not_reported"]}
    by_cause = {r["cause"]: r for r in store.named("miss_causes").iter_rows(named=True)}
    assert (by_cause["not_reported"]["missed_tokens"], by_cause["not_reported"]["requests"]) == (4400, 4)
    assert store.query_rows("SELECT cached_tokens FROM request_attribution WHERE request_id = 'r8'") == [(None,)]


#: FLEET's first six and a request that asked for prompt logprobs (vLLM read no prefix cache for it, cached 0,
#: counted in neither vllm:prefix_cache_queries nor hits): the hit rate stays 2,700 / 6,000 over the six.
SKIPPED = [*FLEET[:6], line("s7", 7, "pod-a", 1000, 0, system_tokens=900, suffix_tokens=100,
                            skip_reading_prefix_cache=True),
           # a hit reported beside the flag: vLLM read the cache, the count stays (2,700 + 480 / 6,000 + 1,000)
           line("s8", 8, "pod-a", 1000, 480, system_tokens=900, suffix_tokens=100, skip_reading_prefix_cache=True)]


@PATHS
def test_a_request_that_read_no_prefix_cache_is_no_cache_query(store: Store, tmp_path: Path, path_kind: str) -> None:
    """s7 read no prefix cache (prompt logprobs): its cached count is stored NULL, not the 0 vLLM reported, so
    the gateway's hit rate is over the six lookups as vLLM's counters are (2,700 / 6,000, not / 7,000); its
    1,000 prompt tokens are one cause, `not_reported / skip_reading_prefix_cache`. s8 carries the flag and a
    reported hit (480), which proves vLLM read the cache (hunt: the flag discarded it): its count is kept."""
    validate(SKIPPED[-1])
    load(store, SKIPPED, path_kind, tmp_path)
    assert store.query_rows("SELECT request_id, cached_tokens, skip_reading_prefix_cache FROM gateway_requests "
                            "WHERE request_id IN ('s7', 's8') ORDER BY request_id") == [("s7", None, True),
                                                                                        ("s8", 480, True)]
    gw = {r["source"]: r for r in store.named("hit_rate_total").iter_rows(named=True)}["gateway"]
    assert (gw["hit_tokens"], gw["query_tokens"], gw["requests"]) == (3180, 7000, 8)
    # the pod computed every one of s7's 1,000 prompt tokens: (7,000 − 3,180) + 1,000
    tokens = store.named("tokens").row(0, named=True)
    assert (tokens["prompt_tokens"], tokens["cached_tokens"], tokens["prefill_computed_tokens"]) == (8000, 3180, 4820)
    dq = store.named("data_quality").row(0, named=True)
    assert (dq["skipped_prompt_tokens"], dq["cached_tokens_coverage"]) == (1000, 7000 / 8000)
    run_attribution(store, settle_seconds=-60)
    assert store.query_rows("SELECT causes, sub_causes, missed_tokens FROM request_attribution "
                            "WHERE request_id = 's7'") == [(["not_reported"], ["skip_reading_prefix_cache"], [1000])]


#: FLEET's first six and two requests vLLM ran as several engine requests, as a gateway other than the reference one
#: may log them: with the pod's cached count (n = 2 on a new prompt: 992 "cached", the second sample's hit on the
#: first's blocks; a list of three prompts: the last prompt's 300). Neither is the prompt's hit count: both are
#: stored NULL, so the hit rate stays 2,700 / 6,000 and vLLM's 2 + 3 extra finished requests are no bypass.
FANNED = [*FLEET[:6], line("n2", 7, "pod-a", 1000, 992, system_tokens=900, suffix_tokens=100, engine_requests=2),
          line("list3", 8, "pod-a", 1200, 300, system_tokens=1100, suffix_tokens=100, engine_requests=3)]


@PATHS
def test_a_request_vllm_ran_as_several_engine_requests_has_no_hit_count(store: Store, tmp_path: Path,
                                                                        path_kind: str) -> None:
    """A line with engine_requests > 1 is stored with its cached count NULL whatever it says, its prompt tokens are
    `not_reported / several_engine_requests`, and data_quality counts its engine requests against vLLM's finished
    requests (live and bulk paths)."""
    validate(FANNED[-1])
    load(store, FANNED, path_kind, tmp_path)
    assert store.query_rows("SELECT request_id, cached_tokens, engine_requests FROM gateway_requests "
                            "WHERE request_id IN ('n2', 'list3') ORDER BY request_id") == [("list3", None, 3),
                                                                                           ("n2", None, 2)]
    gw = {r["source"]: r for r in store.named("hit_rate_total").iter_rows(named=True)}["gateway"]
    assert (gw["hit_tokens"], gw["query_tokens"]) == (2700, 6000)
    store.insert("vllm_metrics", [(datetime.fromisoformat(f"{DAY}T12:00:30+00:00"), "pod-a", "0", "tiny",
                                   "vllm:request_success_total", "stop", 0.0, 11.0)],
                 ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"])
    dq = store.named("data_quality").row(0, named=True)
    assert (dq["gateway_requests"], dq["gateway_engine_requests"], dq["vllm_requests"]) == (8, 11, 11)
    assert dq["fan_out_prompt_tokens"] == 2200
    run_attribution(store, settle_seconds=-60)
    assert store.query_rows("SELECT request_id, causes, sub_causes, missed_tokens FROM request_attribution "
                            "WHERE request_id IN ('n2', 'list3') ORDER BY request_id") == [
        ("list3", ["not_reported"], ["several_engine_requests"], [1200]),
        ("n2", ["not_reported"], ["several_engine_requests"], [1000])]


@PATHS
def test_exclusive_usage_is_normalized_to_inclusive_counts(store: Store, tmp_path: Path, path_kind: str) -> None:
    load(store, EXCLUSIVE, path_kind, tmp_path)
    rows = {r[0]: r[1:] for r in store.query_rows("SELECT request_id, prompt_tokens, cached_tokens "
                                                   "FROM gateway_requests")}
    assert rows == {"e1": (1000, 0), "e2": (1000, 500), "e3": (4000, 2600), "e4": (2000, 500)}
    gw = {r["source"]: r for r in store.named("hit_rate_total").iter_rows(named=True)}["gateway"]
    assert (gw["hit_tokens"], gw["query_tokens"]) == (3600, 8000)
    assert gw["token_weighted_hit_rate"] == pytest.approx(0.45)
    assert gw["cached_tokens_coverage"] == 1.0


def test_exclusive_usage_contract() -> None:
    """Cached > prompt is refused under the OpenAI convention only; an exclusive line whose two cache-read
    fields disagree is refused; an exclusive line with its cache read unknown keeps it unknown."""
    heavy = EXCLUSIVE[2]
    decode_record(json.dumps(heavy))
    with pytest.raises(BadRecord, match="cached_tokens 2600 exceeds prompt_tokens 1400"):
        decode_record(json.dumps({**heavy, "usage_convention": None}))
    with pytest.raises(BadRecord, match="differs from cache_read_input_tokens"):
        decode_record(json.dumps({**heavy, "cached_tokens": 2500}))
    with pytest.raises(BadRecord, match="usage_convention"):
        decode_record(json.dumps({**heavy, "usage_convention": "anthropic"}))
    from collector.gateway_record import record_usage

    unknown = decode_record(json.dumps({**heavy, "cached_tokens": None, "cache_read_input_tokens": None}))
    assert record_usage(unknown) == (1400, None)
    assert record_usage(decode_record(json.dumps(EXCLUSIVE[3]))) == (2000, 500)
    assert record_usage(decode_record(json.dumps(FLEET[1]))) == (1000, 500)
    with pytest.raises(BadRecord, match="exceeds prompt_tokens"):
        decode_record(json.dumps({**FLEET[1], "cached_tokens": 1001}))
    assert decode_record(json.dumps(FLEET[7])).cached_tokens is None


def test_the_overview_shows_the_coverage_beside_the_hit_rate(store: Store, tmp_path: Path) -> None:
    """The fleet on the dashboard: gateway hit rate 2,700 / 6,000 = 45.00 %, coverage 6,000 / 10,400 = 57.69 %."""
    from dashboard import data
    from tests.test_dashboard_pages import app, assert_clean, metrics

    load(store, FLEET, "live", tmp_path)
    try:
        at = app(store)
        assert_clean(at)
        m = metrics(at)
    finally:
        data.register_store(None)
    assert m["Token-weighted hit rate (gateway)"] == "45.00%"
    assert m["Cached-count coverage (gateway)"] == "57.69%"
    assert m["Prefill tokens saved"] == "2,700" and m["Missed tokens"] == "3,300"


@pytest.fixture(scope="module")
def pod_without_details(tiny_model_dir: Path) -> Iterator[VllmFleet]:
    """One real vLLM CPU server started without --enable-prompt-tokens-details (prefix caching on): what a pod of
    a fleet that never turned the flag on answers."""
    yield from fleet_fixture(tiny_model_dir, "no-details", num_pods=1, prompt_tokens_details=False)


@pytest.mark.vllm
def test_a_real_pod_without_token_details_is_attributed_not_reported(
        pod_without_details: VllmFleet, store: Store, tmp_path: Path) -> None:
    """The same 300-word system prompt sent twice (once streamed) through the gateway to a real vLLM server without
    --enable-prompt-tokens-details. vLLM's prefix cache hits on the second request (its
    vllm:prefix_cache_hits_total grows), but its usage has no cached count (``prompt_tokens_details`` null): the
    gateway logs cached_tokens null, the hit rate has 0 % coverage, and attribution gives both requests one cause,
    not_reported, for all their prompt tokens, never `cold`."""
    pod = pod_without_details.pods[0]
    log = tmp_path / "gateway.jsonl"
    server = GatewayServer(make_app([(pod.name, pod.base_url)], log)).start()
    hits = []
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for rid, extra in (("nd-1", {}), ("nd-2", {"stream": True, "stream_options": {"include_usage": True}})):
                hits.append(_prefix_cache_hits(pod.base_url))
                body = chat_body("no-details", **extra)
                r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
                assert r.status_code == 200, r.text
                usage = (r.json() if not extra else
                         [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")][-1])["usage"]
                assert usage.get("prompt_tokens_details") is None and usage["prompt_tokens"] > 300, usage
        hits.append(_prefix_cache_hits(pod.base_url))
    finally:
        server.stop()
    assert hits[0] == hits[1] == 0 < hits[2], hits  # the second request hit vLLM's prefix cache
    records = {r["request_id"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert [records[r]["cached_tokens"] for r in ("nd-1", "nd-2")] == [None, None], records
    assert load_gateway_log(store, log).rows == 2
    run_attribution(store, settle_seconds=-60)
    got = dict((r[0], (list(r[1]), [int(x) for x in r[2]])) for r in store.query_rows(
        "SELECT request_id, causes, missed_tokens FROM request_attribution FINAL"))
    assert got == {rid: (["not_reported"], [records[rid]["prompt_tokens"]]) for rid in ("nd-1", "nd-2")}, got
    tenant = store.named("tenant_affinity").row(0, named=True)
    assert tenant["cached_tokens_coverage"] == 0.0


def _prefix_cache_hits(base_url: str) -> float:
    """vllm:prefix_cache_hits_total of a pod's /metrics (tokens; summed over its engines), by prometheus_client's
    parser."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:prefix_cache_hits_total")
