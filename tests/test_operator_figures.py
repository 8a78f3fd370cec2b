"""Operator-facing figures over populations a reviewer found mixed up, on real chDB: gateway-log lines loaded with
``kvscope import gateway-log`` (which runs the attribution job), then the named queries, the digest, the alerts.

* Requests whose cached count is unknown (cached_tokens null: cause not_reported, all their prompt tokens): their
  tokens are unknown hits, never missed tokens, never recoverable, no cost, out of every share's denominator.
* Gateway TTFT / e2e percentiles are over the served requests (status < 400, prompt_tokens > 0), the population
  their `samples` / `requests` count (migration 0048).
* Digest periods are whole minutes: --since/--until inside a minute are cut to its start, so consecutive periods
  never share a minute (the rollups hold whole minutes).
* Two requests that share a request_id (ids reused across runs): the store's identity is (request_id, ts), so
  one request's replaced answer never hides the other's current one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from streamlit.testing.v1 import AppTest

from dashboard import alerts, data, digest, digest_render, findings, request_detail
from dashboard.alert_rules import BUILTIN_RULES_TOML, AlertRulesError, parse_rules
from ingest.store import Store
from kvscope.cli import main
from tests.fixture_data import LABEL_COLUMNS

T0 = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"


def line(rid: str, sec: float, tenant: str, prompt: int, cached: int | None, pod: str = "pod-a", status: int = 200,
         ttft: float = 50.0, **kw: Any) -> dict[str, Any]:
    """One gateway-log line (log_version 1) of a request arriving ``sec`` seconds after T0."""
    ts = T0 + timedelta(seconds=sec)
    d = {"log_version": 1, "request_id": rid, "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
         "tenant_id": tenant, "status": status, "prompt_tokens": prompt, "cached_tokens": cached,
         "ttft_ms": ttft, "e2e_ms": ttft + 100, "pod": pod, "model": "tiny"}
    d.update(kw)
    return d


def turn(rid: str, sec: float, tenant: str, conv: str, n: int, cached: int | None, system: str = "a" * 16,
         **kw: Any) -> dict[str, Any]:
    """Turn ``n`` of a chat: a 512-token system prompt, 64 tokens of history per earlier turn, a 64-token message."""
    hist = 64 * (n - 1)
    return line(rid, sec, tenant, 512 + hist + 64, cached, conversation_id=conv, system_hash=system,
                system_norm_hash=system, system_tokens=512,
                history_prefix_hash=f"{n - 1:016x}" if n > 1 else "",
                prev_history_hash=f"{n - 2:016x}" if n > 2 else "", history_tokens=hist,
                suffix_hash=f"{1000 + n:016x}", suffix_tokens=64, prompt_fingerprint=f"{5000 + n:016x}", **kw)


def cli(store: Store, *args: str) -> str:
    """Run ``kvscope ARGS`` against ``store``'s database; its output (exit code 0 asserted)."""
    result = CliRunner().invoke(main, [*args, "--data-dir", store.dsn.removeprefix("chdb://"), "--database",
                                       store.database], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def load(store: Store, tmp_path: Path, *batches: list[dict[str, Any]]) -> None:
    """Import each batch as its own gateway-log file, in order (a later batch can change earlier answers)."""
    for i, batch in enumerate(batches):
        path = tmp_path / f"gateway-{i}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in batch))
        assert "0 dead letters" in cli(store, "import", "gateway-log", str(path))


def rows(store: Store, name: str, **params: Any) -> list[dict[str, Any]]:
    return store.named(name, {k: str(v) for k, v in params.items()}).to_dicts()


def hms(ts: datetime) -> str:
    return f"{ts:%H:%M:%S}"


# -- request identity: (request_id, ts) ---------------------------------------------------------------------
def load_reused_ids(store: Store, tmp_path: Path) -> list[dict[str, Any]]:
    """Two runs reusing the ids r-1, r-2 an hour apart, run 1's first turn imported last; returns each request's
    current answer, read independently of the queries (the version whose signs sum above 0)."""
    run1 = [turn("r-1", 0, "acme", "run1-c1", 1, 0), turn("r-2", 30, "acme", "run1-c1", 2, 0)]
    run2 = [turn("r-1", 3600, "acme", "run2-c1", 1, 0), turn("r-2", 3630, "acme", "run2-c1", 2, 0)]
    load(store, tmp_path, [run1[1], *run2], [run1[0]])
    raw = store.query_df("SELECT request_id, ts, version, sign, causes, sub_causes, missed_tokens, predecessor_kind,"
                         " predecessor_pod, pod, gap_ms FROM request_attribution").to_dicts()
    acc: dict[tuple, int] = defaultdict(int)
    last: dict[tuple, dict[str, Any]] = {}
    for r in raw:
        k = (r["request_id"], r["ts"], r["version"])
        acc[k] += r["sign"]
        last[k] = r
    return [last[k] for k, s in acc.items() if s > 0]


def test_a_reused_request_id_does_not_hide_the_other_requests_answer(store: Store, tmp_path: Path) -> None:
    # Two runs reuse the ids r-1, r-2 an hour apart. Run 1's first turn arrives late: run 1's r-2 gets a new
    # answer (version 2, the version-1 row cancelled by sign -1), and so does run 2's r-1 (a predecessor r-1
    # appeared). Run 2's r-2 and run 1's r-1 keep their version-1 answers.
    current = load_reused_ids(store, tmp_path)
    assert {(r["request_id"], hms(r["ts"]), r["version"]) for r in current} == {
        ("r-1", "10:00:00", 1), ("r-2", "10:00:30", 2), ("r-1", "11:00:00", 2), ("r-2", "11:00:30", 1)}
    want_missed = sum(sum(r["missed_tokens"]) for r in current)

    assert sum(r["missed_tokens"] for r in rows(store, "miss_causes")) == want_missed
    mr = rows(store, "miss_requests")
    assert sum(r["missed_tokens"] for r in mr) == want_missed
    assert sorted({(r["request_id"], hms(r["ts"])) for r in mr}) == [
        ("r-1", "10:00:00"), ("r-1", "11:00:00"), ("r-2", "10:00:30"), ("r-2", "11:00:30")]
    # each listed request carries its own log row (run 2's r-2 is turn 2 of run2-c1, not run 1's)
    assert {(r["request_id"], hms(r["ts"])): r["conversation_id"] for r in mr if r["request_id"] == "r-2"} == {
        ("r-2", "10:00:30"): "run1-c1", ("r-2", "11:00:30"): "run2-c1"}

    examples = rows(store, "miss_examples", since="2026-12-06 10:30:00")
    assert sum(r["missed_tokens"] for r in examples) > 0
    assert {hms(r["ts"]) for r in examples} <= {"11:00:00", "11:00:30"}

    # both next turns (r-2 of each run, same pod as its previous turn) reach the TTL queries
    same_pod_next = [r for r in current if r["predecessor_kind"] == "previous_turn"
                     and r["predecessor_pod"] == r["pod"] and r["gap_ms"] is not None]
    assert len(same_pod_next) == 2
    assert rows(store, "turn_gaps")[0]["next_turns"] == 2

    # run 2's r-2 is found in its own window, its version-1 answer not hidden by run 1's cancelled one
    detail = rows(store, "request_detail", request_id="r-2", since="2026-12-06 10:30:00")
    assert {hms(r["ts"]) for r in detail} == {"11:00:30"}
    assert {r["predecessor_request_id"] for r in detail} == {"r-1"}


def test_attribution_agreement_reads_the_labelled_requests_own_answer(store: Store, tmp_path: Path) -> None:
    # run 2's r-2 is labelled with its own answer's split: the agreement must read that answer alone, not run 1's
    # r-2's added to it
    current = load_reused_ids(store, tmp_path)
    (own,) = [r for r in current if r["request_id"] == "r-2" and r["ts"] == T0 + timedelta(seconds=3630)]
    entries = sorted(zip(own["causes"], own["sub_causes"], own["missed_tokens"], strict=True))
    cause, sub = max(((c, s) for c, s, _ in entries if c != "unavoidable"),
                     key=lambda k: sum(n for c, s, n in entries if (c, s) == k))
    store.insert("workload_labels", [("r-2", own["ts"], "acme", "run2", "reused_ids", cause, sub,
                                      [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries],
                                      "labels.jsonl:1")], LABEL_COLUMNS)
    (row,) = [r for r in rows(store, "attribution_agreement") if r["intended_cause"] == cause]
    assert (row["labelled"], row["attributed"], row["requests"]) == (1, 1, 1)
    assert (row["tokens_checked"], row["tokens_exact"]) == (1, 1)


def test_attribution_agreement_keeps_a_label_per_labelled_request(store: Store, tmp_path: Path) -> None:
    # two labelled runs reusing the id r-2 (demo/workload.py ids are deterministic): a label each, keyed by
    # (request_id, ts), each evaluated against its own request's answer
    current = load_reused_ids(store, tmp_path)
    labels = []
    for run, own in enumerate(sorted((r for r in current if r["request_id"] == "r-2"), key=lambda r: r["ts"]), 1):
        entries = sorted(zip(own["causes"], own["sub_causes"], own["missed_tokens"], strict=True))
        cause, sub = max(((c, s) for c, s, _ in entries if c != "unavoidable"),
                         key=lambda k: sum(n for c, s, n in entries if (c, s) == k))
        labels.append(("r-2", own["ts"], "acme", f"run{run}", "reused_ids", cause, sub, [e[0] for e in entries],
                       [e[1] for e in entries], [e[2] for e in entries], f"labels.jsonl:{run}"))
    store.insert("workload_labels", labels, LABEL_COLUMNS)
    total = next(r for r in rows(store, "attribution_agreement") if r["intended_cause"] == "all")
    assert (total["labelled"], total["attributed"], total["requests"]) == (2, 2, 2)
    assert (total["tokens_checked"], total["tokens_exact"]) == (2, 2)
    one_run = next(r for r in rows(store, "attribution_agreement", run_id="run2") if r["intended_cause"] == "all")
    assert (one_run["labelled"], one_run["tokens_exact"]) == (1, 1)


def test_ttl_queries_read_a_reused_predecessor_ids_own_log_line(store: Store, tmp_path: Path) -> None:
    # run 1 (10:00) and run 2 (11:00) reuse r-1, r-2; run 2's system prompt is 2,048 tokens, so its r-1's prompt
    # is 2,112 tokens, run 1's 576: each r-2's predecessor is its own run's r-1 (the latest r-1 at or before it)
    run1 = [turn("r-1", 0, "acme", "run1-c1", 1, 0), turn("r-2", 30, "acme", "run1-c1", 2, 0)]
    run2 = [turn("r-1", 3600, "acme", "run2-c1", 1, 0, system="b" * 16),
            turn("r-2", 3630, "acme", "run2-c1", 2, 0, system="b" * 16)]
    for x in run2:
        x["prompt_tokens"] += 2048 - 512
        x["system_tokens"] = 2048
    load(store, tmp_path, run1 + run2)
    want = {"run1-c1": run1[0]["prompt_tokens"], "run2-c1": run2[0]["prompt_tokens"]}
    assert want == {"run1-c1": 576, "run2-c1": 2112}
    hold = rows(store, "ttl_hold_time", since="2026-12-06 10:30:00", kv_bytes_per_token=1)  # run 2 only
    assert hold and all(r["held_tokens"] == 2112 and r["retained_bytes"] == 2112 for r in hold)
    hold = rows(store, "ttl_hold_time", until="2026-12-06 10:30:00", kv_bytes_per_token=1)  # run 1 only
    assert hold and all(r["held_tokens"] == 576 for r in hold)
    runs = rows(store, "ttl_runs", kv_bytes_per_token=1)
    assert {r["run_id"]: r["cache_retained_bytes"] for r in runs} == {k: float(v) for k, v in want.items()}


def test_the_picked_request_of_a_reused_id_opens_its_own_detail(store: Store, tmp_path: Path) -> None:
    # "dup" twice: 10:01:40 cached count unknown, 10:21:40 300 cached. Picking the second (miss_requests row,
    # URL request_id + ts, a finding's link) opens its detail, not the other's
    load(store, tmp_path, [line("dup", 100, "beta", 800, None), line("dup", 1300, "beta", 800, 300)])
    picked = next(r for r in rows(store, "miss_requests") if r["cached_tokens"] is not None)
    assert hms(picked["ts"]) == "10:21:40"
    data.register_store(store)
    try:
        f = data.Filters(time_range="All")
        detail, in_window = request_detail.fetch("dup", f, picked["ts"])
        assert in_window and {(hms(r["ts"]), r["cached_tokens"]) for r in detail.to_dicts()} == {("10:21:40", 300)}
        detail, _ = request_detail.fetch("dup", f, T0 + timedelta(seconds=100))
        assert {(hms(r["ts"]), r["cached_tokens"]) for r in detail.to_dicts()} == {("10:01:40", None)}
        at = AppTest.from_file(str(APP), default_timeout=60)
        at.query_params.update({"range": "all"})
        at.run()
        at.switch_page("views/miss_causes.py")
        at.query_params.update({"range": "all", "request_id": "dup", "ts": findings.ts_param(picked["ts"])})
        at.run()
        assert not at.exception, at.exception
        arrival = [c.value for c in at.caption if "arrived" in c.value]
        assert arrival and "arrived 2026-12-06 10:21:40 UTC" in arrival[0] and "300 cached" in arrival[0]
        assert at.query_params["ts"] == "2026-12-06T10:21:40.000Z"
    finally:
        data.register_store(None)
    assert findings.parse_ts_param("2026-12-06T10:21:40.000Z") == picked["ts"]
    assert findings.parse_ts_param("soon") is None
    ev = findings.Evidence(request_id="dup", ts=picked["ts"], pod="pod-a", predecessor_request_id="",
                           predecessor_pod="", gap_ms=None, changed_segment="", missed_tokens=1)
    url = findings.Finding(tenant_id="beta", cause="cold", sub_cause="", missed_tokens=1, requests=1,
                           gpu_seconds=None, money=None, share_of_tenant_missed=1.0, share_of_missed=1.0, stage=1,
                           fix="", evidence=ev).url("http://x", T0, T0)
    assert "request_id=dup&ts=2026-12-06T10%3A21%3A40.000Z" in url


# -- not_reported: unknown hits, not missed tokens --------------------------------------------------------------
def unknown_counts_fleet() -> list[dict[str, Any]]:
    """acme, 10:00-10:21: 20 first turns whose system prompt changes every turn (prefix_drift / system_changed
    from the second on), cached 0, known; and 20 requests of 1,000 prompt tokens whose cached count is unknown."""
    lines = [turn(f"a{i}", 60 * i, "acme", "c1", 1, 0, system=f"{0xabc000 + i:016x}") for i in range(1, 21)]
    lines += [line(f"u{i}", 60 * i + 5, "acme", 1000, None, conversation_id="c2", stream=True) for i in range(1, 21)]
    return lines


def test_not_reported_tokens_are_unknown_not_missed(store: Store, tmp_path: Path) -> None:
    lines = unknown_counts_fleet()
    load(store, tmp_path, lines)
    known_missed = sum(x["prompt_tokens"] - x["cached_tokens"] for x in lines if x["cached_tokens"] is not None)
    unknown = sum(x["prompt_tokens"] for x in lines if x["cached_tokens"] is None)
    assert (known_missed, unknown) == (20 * 576, 20_000)
    since, until = T0, T0 + timedelta(hours=1)

    # the Overview's missed tokens: prompt - cached over the known counts
    ht = next(r for r in rows(store, "hit_rate_total") if r["source"] == "gateway")
    assert ht["query_tokens"] - ht["hit_tokens"] == known_missed

    # miss_causes: shares over the known misses; not_reported apart (last, share 0, no cost)
    mc = rows(store, "miss_causes")
    known_rows = [r for r in mc if r["cause"] != "not_reported"]
    assert sum(r["missed_tokens"] for r in known_rows) == known_missed
    assert mc[-1]["cause"] == "not_reported" and mc[-1]["missed_tokens"] == unknown
    assert mc[-1]["share_of_missed"] == 0 and mc[-1]["gpu_seconds"] is None
    drift = next(r for r in mc if r["cause"] == "prefix_drift")
    assert drift["missed_tokens"] == 19 * 560  # turns 2..20: the 576-token prompt from the system prompt on
    assert abs(drift["share_of_missed"] - drift["missed_tokens"] / known_missed) < 1e-9
    assert abs(sum(r["share_of_missed"] for r in known_rows) - 1) < 1e-9
    assert all(r["gpu_seconds"] is None for r in rows(store, "miss_requests", cause="not_reported"))

    # fix first and "does cache work pay?": over known misses / known prompt tokens
    (first,) = findings.fix_first(store, since, until, limit=1)
    assert (first.cause, first.missed_tokens) == ("prefix_drift", drift["missed_tokens"])
    assert abs(first.share_of_tenant_missed - drift["missed_tokens"] / known_missed) < 1e-9
    (worth,) = findings.worth_it(store, since, until)
    assert worth.recoverable_tokens == drift["missed_tokens"]
    assert abs(worth.recoverable_share - drift["missed_tokens"] / (20 * 576)) < 1e-9

    # the digest: missed tokens, cause lines and the summary over known misses; the unknown tokens apart
    d = digest.gather(store, since, until)
    assert d.missed_tokens == known_missed and d.unknown_tokens == unknown
    assert "not_reported" not in {c.cause for c in d.causes}
    assert d.tenants[0].missed_tokens == known_missed
    assert d.tenants[0].finding is not None and d.tenants[0].finding.missed_tokens == drift["missed_tokens"]
    assert "11.5k missed tokens" in digest_render.subject(d)
    text = digest_render.plain_text(d)
    assert f"{known_missed:,} missed tokens; {unknown:,} prompt tokens with unknown hits" in text
    assert "92 % of its misses" in text
    assert f"{known_missed + unknown:,}" not in text
    assert f"Not counted: {unknown:,} prompt tokens" in text and "--enable-prompt-tokens-details" in text  # the fix

    # the built-in alert prefix_drift_share (> 50 % of a tenant's missed tokens) fires: 92 % of the known misses
    (rule,) = [r for r in parse_rules(BUILTIN_RULES_TOML, "builtin") if r.name == "prefix_drift_share"]
    ev = alerts.evaluate_rule(store, rule, T0 + timedelta(hours=1, seconds=30))
    assert ev.state == alerts.FIRING and ev.value == round(100 * drift["missed_tokens"] / known_missed, 1)
    with pytest.raises(AlertRulesError, match="not_reported"):
        parse_rules('[[rule]]\nname = "x"\nkind = "cause_share"\ncause = "not_reported"\nshare_percent = 10\n')

    # the Miss causes page: its Missed tokens equal the Overview's; the unknown tokens shown apart
    data.register_store(store)
    try:
        at = AppTest.from_file(str(APP), default_timeout=60)
        at.query_params.update({"range": "all"})
        at.run()
        at.switch_page("views/miss_causes.py")
        at.query_params.update({"range": "all"})
        at.run()
        assert not at.exception, at.exception
        m = {x.label: x.value for x in at.metric}
        assert m["Missed tokens"] == f"{known_missed:,}"
        assert m["Unknown hits (not reported)"] == f"{unknown:,}"
        assert m["Its share of missed tokens"] == f"{drift['missed_tokens'] / known_missed:.1%}"
    finally:
        data.register_store(None)


def test_the_overview_shows_unknown_hits_apart_from_the_missed_tokens(store: Store, tmp_path: Path) -> None:
    # "Where the missed tokens went": bars and table of the known misses; not_reported's tokens a metric apart
    lines = unknown_counts_fleet()
    load(store, tmp_path, lines)
    known_missed = sum(x["prompt_tokens"] - x["cached_tokens"] for x in lines if x["cached_tokens"] is not None)
    unknown = sum(x["prompt_tokens"] for x in lines if x["cached_tokens"] is None)
    data.register_store(store)
    try:
        at = AppTest.from_file(str(APP), default_timeout=60)
        at.query_params.update({"range": "all"})
        at.run()
        assert not at.exception, at.exception
        charts = [json.loads(e.proto.spec) for e in at.get("plotly_chart")]
        (where,) = [c for c in charts if c["layout"].get("xaxis", {}).get("title", {}).get("text") == "Missed tokens"]
        bars = where["data"][0]
        assert sum(bars["x"]) == known_missed and not any("not reported" in y.lower() for y in bars["y"])
        (table,) = [d.value for d in at.dataframe if "missed_tokens" in d.value.columns]
        assert int(table["missed_tokens"].sum()) == known_missed
        assert {x.label: x.value for x in at.metric}["Unknown hits (not reported)"] == f"{unknown:,} prompt tokens"
    finally:
        data.register_store(None)


# -- latency percentiles over the population samples counts ----------------------------------------------------
def test_gateway_latency_percentiles_are_over_the_served_requests(store: Store, tmp_path: Path) -> None:
    # five served requests (TTFT 10..14 ms) and six lines with status 200 and prompt_tokens 0 (a stream that ended
    # without usage): not served, not counted in samples, so not in the percentiles either
    lines = [line(f"s{i}", i, "acme", 1000, 500, ttft=10.0 + i) for i in range(5)]
    lines += [line(f"z{i}", 10 + i, "acme", 0, None, ttft=5000.0 + i, stream=True,
                   error="stream ended without usage: prompt_tokens from the fingerprint") for i in range(6)]
    load(store, tmp_path, lines)
    served = sorted(x["ttft_ms"] for x in lines if x["status"] < 400 and x["prompt_tokens"] > 0)
    lat = {r["metric"]: r for r in rows(store, "latency", bucket_seconds=3600) if r["source"] == "gateway"}
    ttft = lat["ttft_ms"]
    assert ttft["samples"] == len(served) == 5
    assert (ttft["p50_ms"], ttft["p95_ms"]) == (served[2], served[-1])  # t-digest: nearest rank on small sets
    (profile,) = rows(store, "tenant_profile")
    assert profile["requests"] == 5 and profile["ttft_p95_ms"] == served[-1]
    e2e = store.query_df("SELECT quantilesTDigestMerge(0.5, 0.95, 0.99)(e2e_ms)[3] AS p99 FROM requests_1m").to_dicts()
    assert e2e == [{"p99": served[-1] + 100}]


# -- digest periods in whole minutes -----------------------------------------------------------------------------
def test_digest_periods_inside_a_minute_never_share_a_minute(store: Store, tmp_path: Path) -> None:
    # 12 requests of 1,000 prompt tokens, one every 10 s from 10:00:00 (all in the minutes 10:00 and 10:01)
    lines = [line(f"r{i}", 10 * i, "acme", 1000, 800 if i < 6 else 200) for i in range(12)]
    load(store, tmp_path, lines)
    inside = T0 + timedelta(seconds=30)  # 10:00:30
    assert digest.period(since=inside, until=inside + timedelta(minutes=30)) == (
        T0, T0 + timedelta(minutes=30))
    assert digest.period(timedelta(minutes=30), until=inside) == (T0 - timedelta(minutes=30), T0)
    assert digest.period(timedelta(minutes=30), since=inside) == (T0, T0 + timedelta(minutes=30))
    with pytest.raises(ValueError, match="whole minutes"):
        digest.period(since=inside, until=inside + timedelta(seconds=20))

    # two consecutive periods meeting at 10:00:30: every prompt token in exactly one of them
    first = digest.gather(store, *digest.period(since=inside - timedelta(minutes=30), until=inside))
    second = digest.gather(store, *digest.period(since=inside, until=inside + timedelta(minutes=30)))
    tokens = [sum(h.query_tokens for h in d.hit_rates if h.source == "gateway") for d in (first, second)]
    assert sum(tokens) == sum(x["prompt_tokens"] for x in lines) == 12_000
    assert second.previous_since == first.since and second.since == first.until == T0
    # the second period's "previous period" is the first one: its change compares disjoint minutes
    assert second.hit_rates[0].previous is None and second.hit_rates[0].rate == 0.5

    out = tmp_path / "d.eml"
    cli(store, "digest", "--since", "2026-12-06T10:00:30Z", "--until", "2026-12-06T10:30:30Z", "--dry-run", str(out))
    text = out.read_text()
    assert "Period: 2026-12-06 10:00 to 2026-12-06 10:30 UTC (30 min)" in text
    assert "whole minutes" in text
