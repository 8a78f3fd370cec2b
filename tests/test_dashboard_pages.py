"""Each dashboard page under Streamlit's AppTest, reading a registered store (as ``kvscope up`` registers it):
on the fixture (tests/fixture_data.py) it runs without exception and shows the expected numbers; on an empty
database it shows the "no data yet" state."""

from __future__ import annotations

import base64
import json
import math
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard import causes, charts, data, status
from dashboard import causes as causes_module
from ingest.store import Store
from tests.clock import DAY, day
from tests.fixture_data import PREFILL_SECONDS_PER_TOKEN, load_fixture
from tests.fixture_data import at as fixture_time

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = [
    "views/overview.py",
    "views/tenants.py",
    "views/miss_causes.py",
    "views/fingerprints.py",
    "views/pods.py",
    "views/vllm.py",
    "views/data_quality.py",
    "views/ttl.py",
    "views/adhoc_sql.py",
]


@pytest.fixture(scope="module")
def fixture_store(chdb_dir: Path) -> Store:
    s = Store.open(data_dir=chdb_dir, database=f"dash_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_fixture(s)
    return s


def app(store: Store, time_range: str = "All") -> AppTest:
    """The app on its default page with ``store`` registered and the sidebar's time range set."""
    data.register_store(store)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    at.selectbox(key="time_range").select(time_range).run()
    assert not at.exception, at.exception
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def figure(at: AppTest, key: str) -> dict[str, Any]:
    """The plotly figure (as sent to the browser) of the chart with ``key``."""
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id and key in c.proto.id]
    return json.loads(chart.proto.spec)


def traces(fig: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [t for t in fig["data"] if name in t.get("name", "")]


def values(v: Any) -> list[Any]:
    """A figure's data array as a list (plotly sends numpy arrays base64-encoded), NaN as None."""
    if isinstance(v, dict) and "bdata" in v:
        v = np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return [None if isinstance(x, float) and math.isnan(x) else x for x in v]


def points(trace: dict[str, Any]) -> dict[str, Any]:
    return dict(zip(values(trace["x"]), values(trace["y"]), strict=True))


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def url_app(store: Store, query: dict[str, str], page: str | None = None) -> AppTest:
    """The app opened at a URL with ``query`` (as a shared link opens it), on ``page`` (default the Overview)."""
    data.register_store(store)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params.update(query)
    at.run()
    if page:
        at.switch_page(page)
        at.query_params.update(query)  # a link to the page: its URL carries the filters
        at.run()
    assert_clean(at)
    return at


@pytest.fixture(autouse=True)
def _unregister() -> Iterator[None]:
    yield
    data.register_store(None)  # the registries are process-wide: reset them between tests
    status.register_context(None)


def test_overview(fixture_store: Store) -> None:
    at = app(fixture_store)
    assert_clean(at)
    m = metrics(at)
    # 3,232 / 6,342 from both sources (derived in test_named_queries.py); request-weighted 4.4485 / 11.
    assert m["Token-weighted hit rate (vLLM)"] == "50.96%"
    assert m["Token-weighted hit rate (gateway)"] == "50.96%"
    assert m["Request-weighted hit rate (gateway)"] == "40.44%"
    assert m["Cached-count coverage (gateway)"] == "100.00%"  # every fixture request reports cached tokens
    assert m["Prefill tokens saved"] == "3,232"
    assert m["Missed tokens"] == "3,110"
    assert not [w for w in at.warning if "disagree" in w.value]  # the two sources agree on the fixture
    assert len(at.get("plotly_chart")) == 6  # where missed, hit rate, tokens ×2, TTFT, queue wait
    assert st.get_option("client.toolbarMode") == "viewer"  # no "Deploy" button


def test_overview_says_where_the_missed_tokens_went_and_what_to_fix_first(fixture_store: Store) -> None:
    """The tiles, then the causes with their tokens in their own colours, then the top 3 findings with their fix,
    evidence and a link to their requests (figures from tests/test_findings.py on the same fixture)."""
    from dashboard import causes

    at = app(fixture_store)
    assert_clean(at)
    subheaders = [h.value for h in at.subheader]
    assert subheaders[:2] == ["Where the missed tokens went", "Fix first"]
    fig = figure(at, "where_missed")
    bars = fig["data"][0]
    got = dict(zip(values(bars["y"]), values(bars["x"]), strict=True))
    assert got["cold"] == 1120 and got["routed_away"] == 768 and got["prefix_drift / volatile_system"] == 768
    assert sum(got.values()) == 3110
    colours = dict(zip(values(bars["y"]), bars["marker"]["color"], strict=True))
    assert colours["prefix_drift / volatile_system"] == causes.color("prefix_drift", "volatile_system")
    assert colours["routed_away"] == causes.color("routed_away")
    cards = [m.value.replace("\\", "") for m in at.markdown]
    assert cards[0].startswith("**1. acme: :blue[routed_away]** — 46 % of its missed tokens (768 tokens in 1 request")
    assert cards[2].startswith("**2. globex: :orange[prefix_drift / volatile_system]** — 85 %")
    assert cards[3] == causes.fix_for("prefix_drift", "volatile_system").advice  # type: ignore[union-attr]
    captions = [c.value.replace("\\", "") for c in at.caption]
    assert "Evidence: request cap-4-timestamp-first on pod-a missed 768 tokens from its system prompt on" in captions[1]
    links = [p.proto.query_string for p in at.get("page_link") if p.proto.page == "miss_causes"]
    assert links[1] == ("range=all&tenant=globex&cause=prefix_drift&sub_cause=volatile_system"
                        "&request_id=cap-4-timestamp-first&ts=2026-12-05T12%3A01%3A10.000Z")  # a request: (id, ts)


def test_overview_latency_gateway_first(fixture_store: Store) -> None:
    """vLLM's histogram quantiles are dotted, labelled as interpolated and hidden while the gateway has
    exact values; a caption says why."""
    at = app(fixture_store)
    for key in ("latency_ttft_ms", "latency_queue_wait_ms"):
        fig = figure(at, key)
        vllm = traces(fig, "vLLM histogram (bucket-interpolated)")
        gateway = traces(fig, "gateway (exact)")
        assert vllm and gateway
        assert all(t["visible"] == "legendonly" and t["line"]["dash"] == "dot" for t in vllm if "line" in t)
        assert all(t.get("visible", True) is True for t in gateway)
    # the capture's queue times all sit in vLLM's first bucket (0-0.3 s): 150/285/297 ms, the gateway 0.1-2 ms
    queue = figure(at, "latency_queue_wait_ms")
    p50 = next(t for t in traces(queue, "p50, vLLM") if "partial" not in t["name"])
    assert 150.0 in values(p50["y"])
    assert any("bucket artefact" in c.value for c in at.caption)


def test_time_charts_mark_partial_buckets(fixture_store: Store) -> None:
    """Minute buckets (the rollups' grain) over the fixture: the last bucket (12:02, where the data ends at
    12:02:30) is partial: an unconnected marker, shaded; the line never connects across gaps."""
    at = app(fixture_store)
    fig = figure(at, "hit_rate")
    (line,) = [t for t in traces(fig, "Token-weighted hit rate, gateway log") if "partial" not in t["name"]]
    by_bucket = points(line)
    assert by_bucket[f"{DAY}T12:01:00.000"] == pytest.approx((672 + 288) / (764 + 784 + 400 + 19 + 400))
    assert line["connectgaps"] is False
    vllm_line, vllm_partial = traces(fig, "Token-weighted hit rate, vLLM counters")
    assert vllm_partial["mode"] == "markers" and "partial bucket" in vllm_partial["name"]
    partial = points(vllm_partial)
    assert partial[f"{DAY}T12:02:00.000"] == pytest.approx((768 + 768) / (800 + 1651))
    assert points(vllm_line)[f"{DAY}T12:02:00.000"] is None
    assert any(shape["type"] == "rect" for shape in fig["layout"]["shapes"])


def test_bars_fade_partial_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    shown: dict[str, Any] = {}
    monkeypatch.setattr(charts, "_show", lambda fig, key=None, legend_below=False: shown.update(fig=fig))
    df = pl.DataFrame({"bucket": [fixture_time(t) for t in (30, 45, 60)], "tokens": [10, 12, 3]})
    charts.bars(df, "bucket", "tokens", "t", buckets=charts.Buckets(15, (fixture_time(30), fixture_time(64))))
    (bar,) = [t for t in shown["fig"].data if t.type == "bar"]
    assert list(bar.marker.opacity) == [1.0, 1.0, 0.35]
    assert [t.name for t in shown["fig"].data if t.type == "scatter"] == ["partial bucket (data covers part of it)"]


def test_buckets_cover_the_data() -> None:
    ends = (fixture_time(30), fixture_time(150))
    b = charts.Buckets(15, ends)
    df = pl.DataFrame(
        {"bucket": [fixture_time(t) for t in (15, 30, 45, 90, 135, 150)], "s": ["a"] * 6, "v": [1.0] * 6}
    ).with_columns(pl.col("bucket").dt.cast_time_unit("ms"))
    marked = charts.mark_partial(df, b)
    assert marked["_partial"].to_list() == [True, False, False, False, False, True]
    filled = charts.fill_gaps(df.filter(pl.col("bucket") != fixture_time(45)), ["s"], 15)
    assert filled.height == (150 - 15) // 15 + 1
    assert filled.filter(pl.col("v").is_null())["bucket"].dt.second().to_list() == [45, 0, 15, 45, 0]


def test_overview_tenant_filter(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.selectbox(key="tenant").select("acme").run()
    assert_clean(at)
    m = metrics(at)
    assert m["Token-weighted hit rate (gateway)"] == "47.66%"  # 1,504 / 3,156
    assert m["Token-weighted hit rate (vLLM)"] == "–"  # vLLM's counters carry no tenant
    assert any("carry no tenant" in c.value for c in at.caption)
    # the vLLM-only chart says why it is empty instead of "widen the time range"
    assert any(charts.NO_TENANT_IN_VLLM in c.value for c in at.caption)
    assert not any(charts.NO_DATA_IN_WINDOW in c.value for c in at.caption)


def test_tenants(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/tenants.py").run()
    assert_clean(at)
    table = at.dataframe[0].value.set_index("tenant_id")
    assert table.loc["acme", "tenant_cache_affinity"] == pytest.approx(1594 / 2394)
    assert table.loc["initech", "tenant_cache_affinity"] == pytest.approx(400 / 419)
    assert table.loc["globex", "token_weighted_hit_rate"] == pytest.approx(1440 / 2348)
    assert len(at.get("plotly_chart")) == 2  # bars and the tenant × pod matrix
    assert figure(at, "tenant_pod_matrix")["layout"]["coloraxis"]["cmin"] == 0
    at.selectbox(key="tenant").select("globex").run()
    at.selectbox(key="pod").select("pod-a").run()
    assert_clean(at)  # one cell: its colour scale still starts at 0, not at the cell's value
    fig = figure(at, "tenant_pod_matrix")
    assert fig["layout"]["coloraxis"]["cmin"] == 0 and len(fig["data"][0]["y"]) == 1


def test_tenants_say_whether_cache_work_pays_and_link_to_their_requests(fixture_store: Store) -> None:
    """Each tenant's verdict (tests/test_findings.py derives it on the same fixture), its first fix, and a
    link to its missed requests: the drill-down from a tenant."""
    at = app(fixture_store)
    at.switch_page("views/tenants.py").run()
    assert_clean(at)
    assert "Does cache work pay?" in [h.value for h in at.subheader]
    cards = [m.value.replace("\\", "") for m in at.markdown if "cache work" in m.value]
    assert [c.split("**")[1] for c in cards] == ["acme", "globex", "initech"]  # by prompt volume
    assert "**acme**: cache work pays. long repeated prefixes: 752 stable tokens" in cards[0]
    assert "**initech**: little to gain from cache work." in cards[2]
    captions = [c.value.replace("\\", "") for c in at.caption if "Fix first" in c.value]
    # its cost beside its tokens: 768 tokens on pod-b, at the fleet's (pod-a's) 0.139662678 s / 1715 tokens
    assert captions[0].startswith("Fix first: routed_away (46 % of its missed tokens, 768 tokens, 0.063 GPU-s): "
                                  "Route each conversation")
    links = {p.proto.label: p.proto.query_string for p in at.get("page_link") if p.proto.page == "miss_causes"}
    assert links["Requests of globex that missed"] == "range=all&tenant=globex"


def test_miss_causes_and_drill_down(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/miss_causes.py").run()
    assert_clean(at)
    m = metrics(at)
    assert (m["Missed tokens"], m["Largest cause"], m["Its share of missed tokens"]) == (
        "3,110",
        "cold",
        "36.0%",
    )
    # cost beside tokens: all 3,110 missed tokens at pod-a's measured 0.139662678 s / 1715 tokens (pod-b, which
    # measured nothing, takes the fleet's rate: pod-a's)
    assert m["Re-compute cost"] == "0.253 GPU-s"
    causes = at.dataframe[0].value
    assert set(causes["cause"]) == {"cold", "prefix_drift", "routed_away", "unavoidable", "below_block"}
    assert causes["gpu_seconds"].sum() == pytest.approx(3110 * PREFILL_SECONDS_PER_TOKEN)
    assert len(at.dataframe[1].value) == 16  # every (request, cause) row
    at.selectbox(key="miss_cause").select("prefix_drift / tools_reordered").run()
    assert_clean(at)
    drill = at.dataframe[1].value
    assert drill["request_id"].tolist() == ["cap-3-tools-reordered"]
    assert drill["predecessor_request_id"].tolist() == ["cap-2-warm"]
    # its cost beside its tokens: 64 missed tokens at pod-a's measured rate; no money without a price
    assert drill["gpu_seconds"].tolist() == [pytest.approx(64 * PREFILL_SECONDS_PER_TOKEN)]
    assert not [c for c in drill.columns if c.startswith("cost")]


def miss_page(store: Store, **params: str) -> AppTest:
    """The Miss causes page over all time, opened with URL ``params`` (as a link would open it)."""
    at = app(store)
    for k, v in params.items():
        at.query_params[k] = v
    at.switch_page("views/miss_causes.py").run()
    assert_clean(at)
    return at


def table(at: AppTest, column: str) -> Any:
    """The pandas value of the one table with ``column`` (a read-only st.dataframe has no key to find it by)."""
    (df,) = [d.value for d in at.dataframe if column in d.value.columns]
    return df


def test_request_detail_from_the_url(fixture_store: Store) -> None:
    """?request_id=cap-4-timestamp-first: its predecessor cap-3-tools-reordered (the previous step of
    run-globex-1, 12:01:00, pod-a, 1.5 s gap), its causes in prompt order prefix_drift / volatile_system 768
    then unavoidable 16 (tests/fixture_data.py), the first differing segment system, and a link that opens the
    predecessor's own detail (whose predecessor is cap-2-warm)."""
    at = miss_page(fixture_store, request_id="cap-4-timestamp-first")
    m = metrics(at)
    assert (m["Predecessor"], m["Its arrival (UTC)"], m["Pod: this / predecessor"], m["Gap"]) == (
        "cap-3-tools-reordered", "12:01:00", "pod-a / pod-a", "1.5 s")
    causes = table(at, "share_of_request_missed")
    assert causes[["cause", "sub_cause", "missed_tokens"]].values.tolist() == [
        ["prefix_drift", "volatile_system", 768], ["unavoidable", "", 16]]
    bar = figure(at, "request_prompt_bar")
    assert [(t["name"], t["marker"]["color"]) for t in bar["data"]] == [
        ("prefix_drift / volatile_system", causes_module.color("prefix_drift", "volatile_system")),
        ("unavoidable", causes_module.color("unavoidable"))]
    # cost beside tokens: 768 and 16 tokens at pod-a's rate, 784 in all (0.0638 GPU-s)
    assert causes["gpu_seconds"].tolist() == [pytest.approx(768 * PREFILL_SECONDS_PER_TOKEN),
                                              pytest.approx(16 * PREFILL_SECONDS_PER_TOKEN)]
    assert any("its missed tokens cost 0.064 GPU-s" in c.value for c in at.caption)
    segments = table(at, "compared_with_predecessor").set_index("segment")
    # which line of the system prompt differs (fixture STRUCTURE: the first, the timestamp, 52 tokens)
    assert segments["what_differs"].tolist() == ["line 1 (52 tokens, new)", "", "", "", ""]
    (evidence,) = [md.value for md in at.markdown if md.value.startswith("**Evidence.**")]
    assert "**system** is the first segment that differs (differs only in masked volatile values (timestamps, " \
           "ids)); in it: line 1 (52 tokens, new)." in evidence
    assert segments.loc["system", "first_change"].startswith("◀")
    assert segments.loc["system", "compared_with_predecessor"].startswith("differs only in masked volatile")
    assert segments.loc["tools", "compared_with_predecessor"] == "same tools, other order"
    assert segments["missed_tokens"].tolist() == [730, 38, 0, 0, 16]
    assert any("block size 32 tokens" in c.value for c in at.caption)
    (link,) = at.get("page_link")
    # the view's filters kept; the predecessor's arrival beside its id (ids can repeat across runs)
    assert link.proto.query_string == "range=all&request_id=cap-3-tools-reordered&ts=2026-12-05T12%3A01%3A00.000Z"
    at.query_params["request_id"] = "cap-3-tools-reordered"  # following the link
    at.query_params["ts"] = "2026-12-05T12:01:00.000Z"
    at.run()
    assert_clean(at)
    assert metrics(at)["Predecessor"] == "cap-2-warm"


def test_costs_in_money_and_changed_chunks(fixture_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 36,000 USD per GPU-hour (10 USD per GPU-second) the drill-down and the request's causes carry a cost
    column beside gpu_seconds; acme-c1-t4's message chunks against acme-c1-t3's (fixture STRUCTURE): doc-y 24
    new, doc-x 20 moved from the first place, question-4 20 new; 2 chunks before, 3 now. Its 64 missed tokens on
    pod-b (unmeasured: the fleet's rate, pod-a's) cost 64 · 0.139662678 / 1715 = 0.0052 GPU-s, 0.05 USD."""
    from dashboard import fix_first

    monkeypatch.setenv("KVSCOPE_GPU_HOUR_PRICE", "36000")
    fix_first.gpu_hour_price.cache_clear()
    try:
        at = miss_page(fixture_store, cause="unavoidable", request_id="acme-c1-t4")
        drill = at.dataframe(key="miss_requests").value
        assert list(drill.columns[6:9]) == ["missed_tokens", "gpu_seconds", "cost (USD)"]
        row = drill[drill["request_id"] == "acme-c1-t4"].iloc[0]
        assert (row["gpu_seconds"], row["cost (USD)"]) == (pytest.approx(64 * PREFILL_SECONDS_PER_TOKEN),
                                                           pytest.approx(640 * PREFILL_SECONDS_PER_TOKEN))
        causes = table(at, "share_of_request_missed")
        assert causes["cost (USD)"].tolist() == [pytest.approx(640 * PREFILL_SECONDS_PER_TOKEN)]
        assert any("its missed tokens cost 0.005 GPU-s · 0.05 USD" in c.value for c in at.caption)
        segments = table(at, "compared_with_predecessor").set_index("segment")
        assert segments.loc["suffix", "what_differs"] == ("chunk 1 (24 tokens, new); chunk 2 (20 tokens, moved); "
                                                          "chunk 3 (20 tokens, new); 2 chunks before, 3 now")
    finally:
        fix_first.gpu_hour_price.cache_clear()


def test_request_detail_routed_away_evidence(fixture_store: Store) -> None:
    at = miss_page(fixture_store, request_id="acme-c1-t3")
    assert metrics(at)["Pod: this / predecessor"] == "pod-b / pod-a"
    (evidence,) = [md.value for md in at.markdown if md.value.startswith("**Evidence.**")]
    assert "went to **pod-b**, the predecessor to **pod-a**" in evidence
    assert "inferred from which pod served the predecessor" in evidence
    history = table(at, "compared_with_predecessor").set_index("segment").loc["history"]
    assert history["compared_with_predecessor"] == "continues the predecessor's conversation"


def test_request_detail_from_a_picked_row(fixture_store: Store) -> None:
    """Picking a row of the drill-down table opens that request's detail and puts its id in the URL."""
    at = miss_page(fixture_store, cause="routed_away")
    assert at.dataframe(key="miss_requests").value["request_id"].tolist() == ["acme-c1-t3"]
    assert not at.get("page_link")
    at.session_state["miss_requests"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert_clean(at)
    assert metrics(at)["Predecessor"] == "cap-2-warm"
    assert at.query_params["request_id"] in ("acme-c1-t3", ["acme-c1-t3"])


def test_cause_from_the_url(fixture_store: Store) -> None:
    """?cause=prefix_drift&sub_cause=tools_reordered (an overview "fix first" link) preselects that cause; a
    cause with no misses in the window is kept (an empty drill-down), not replaced by another."""
    at = miss_page(fixture_store, cause="prefix_drift", sub_cause="tools_reordered")
    assert at.selectbox(key="miss_cause").value == "prefix_drift / tools_reordered"
    assert at.dataframe(key="miss_requests").value["request_id"].tolist() == ["cap-3-tools-reordered"]
    at = miss_page(fixture_store, cause="evicted")
    assert at.selectbox(key="miss_cause").value == "evicted"
    assert len(at.get("dataframe")) == 1  # the cause table only: no requests of that cause


def test_fix_first_link_opens_its_request(fixture_store: Store) -> None:
    """The overview's second finding links to /miss_causes with its cause, sub-cause and example request: the
    page opens on that cause with cap-4-timestamp-first's detail."""
    from urllib.parse import parse_qsl

    at = app(fixture_store)
    links = [p.proto.query_string for p in at.get("page_link") if p.proto.page == "miss_causes"]
    params = dict(parse_qsl(links[1]))
    assert (params["cause"], params["sub_cause"]) == ("prefix_drift", "volatile_system")
    for k, v in params.items():
        at.query_params[k] = v
    at.switch_page("views/miss_causes.py").run()
    assert_clean(at)
    assert at.selectbox(key="miss_cause").value == "prefix_drift / volatile_system"
    assert at.dataframe(key="miss_requests").value["request_id"].tolist() == ["cap-4-timestamp-first"]
    assert metrics(at)["Predecessor"] == "cap-3-tools-reordered"


def test_unknown_request_id(fixture_store: Store) -> None:
    at = miss_page(fixture_store, request_id="no-such-request")
    assert any("No miss attribution for request" in i.value for i in at.info)


def test_largest_cause_shows_the_sub_cause(fixture_store: Store) -> None:
    """A sub-cause is the metric's value and its cause the line under it, so the value fits its column."""
    at = app(fixture_store)
    at.selectbox(key="tenant").select("globex").run()
    at.switch_page("views/miss_causes.py").run()
    assert_clean(at)
    (largest,) = [m for m in at.metric if m.label == "Largest cause"]
    assert (largest.value, largest.delta) == ("volatile_system", "prefix_drift")


def test_fingerprints(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/fingerprints.py").run()
    assert_clean(at)
    table = at.dataframe[0].value.set_index("tenant_id")
    assert set(table.index) == {"acme", "globex", "initech"}
    # over the whole window, per tenant: raw ≫ normalized where the fixture drifts
    assert table.loc["globex", ["system_hash_cardinality", "system_norm_hash_cardinality"]].tolist() == [2, 1]
    assert table.loc["globex", ["tools_hash_cardinality", "tools_canonical_hash_cardinality"]].tolist() == [2, 1]
    assert table.loc["initech", ["retrieval_pack_hash_cardinality", "retrieval_set_hash_cardinality"]].tolist() == [
        2,
        1,
    ]
    assert table.loc["acme", ["system_hash_cardinality", "system_norm_hash_cardinality"]].tolist() == [1, 1]
    assert table.loc["acme", "prompt_fingerprint_cardinality"] == 4  # a new fingerprint per turn, healthy
    assert len(at.get("plotly_chart")) == 3  # tenant × segment map, segments over time, fingerprints
    cells = figure(at, "fp_segments_tenants")["data"][0]
    assert "2 raw / 1 normalized" in json.dumps(cells["text"])
    assert any("new turn" in c.value for c in at.caption)


def test_pods(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/pods.py").run()
    assert_clean(at)
    pods = at.dataframe[0].value.set_index("pod")
    assert pods.loc["pod-a", "block_size"] == 32
    assert pods.loc["pod-b", "vllm_token_weighted_hit_rate"] == pytest.approx(1056 / 2451)
    assert pods.loc["pod-a", "kv_cache_usage"] == pytest.approx(0.25)
    dead = at.dataframe[1].value
    assert set(dead["source"]) == {"vllm_metrics", "gateway_log"}
    kv = figure(at, "pod_kv")
    assert kv["layout"]["yaxis"]["range"] == [0, 1]  # not -100 %…100 % when usage is ~0
    assert kv["data"][0]["texttemplate"] == "%{y:.1%}"


def test_data_quality_when_the_sources_agree(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/data_quality.py").run()
    assert_clean(at)
    assert [s.value for s in at.success] == ["Both sources agree on every pod (2)."]
    assert list(at.dataframe[0].value["likely_cause"]) == ["agree", "agree"]
    # attribution against the fixture's workload labels (tests/test_labels.py derives the figures)
    assert "Micro precision **83%** and recall **71%** over 7 labelled requests (every cause but none)." in \
        [m.value for m in at.markdown]  # fmt: skip
    agreement = at.dataframe[1].value
    assert list(agreement["intended_cause"])[-1] == "all" and list(agreement["requests"])[-1] == 5
    at.selectbox(key="tenant").select("globex").run()  # cap-3, cap-4 match; globex-run1-s3 does not
    assert "Micro precision **100%** and recall **67%** over 3 labelled requests (every cause but none)." in \
        [m.value for m in at.markdown]  # fmt: skip


def test_data_quality_names_each_disagreement_and_the_overview_links_to_it(chdb_dir: Path) -> None:
    """One pod per cause (tests/test_data_quality.py): a warning for each pod that disagrees, with its evidence;
    the overview's disagreement banner links to the page."""
    from tests.test_data_quality import load

    s = Store.open(data_dir=chdb_dir, database=f"dash_dq_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load(s)
    at = app(s)
    assert any("disagree" in w.value for w in at.warning)
    assert any("data_quality" in str(link.proto) for link in at.get("page_link"))
    at.switch_page("views/data_quality.py").run()
    assert_clean(at)
    warnings = {w.value.split("**")[1]: w.value for w in at.warning if "**" in w.value}  # not the old-data banner
    assert sorted(warnings) == ["bypass", "connector", "cut", "details", "direct", "edge", "fan-out",
                                "fan-out-bypass", "preempt", "preempt-skip", "unscraped"]
    assert "requests run as several sequences (+1.7 pp)" in warnings["fan-out"]
    # its prompt-logprobs request is no missing count: the preemptions explain the gap
    assert "2 preemptions" in warnings["preempt-skip"] and "not reported" not in warnings["preempt-skip"]
    assert "hits from a KV connector (+30.0 pp)" in warnings["connector"] and "300 tokens" in warnings["connector"]
    assert "requests not seen by the gateway (-20.0 pp)" in warnings["bypass"]
    assert "cached counts not reported (+25.0 pp)" in warnings["details"]
    assert "40 % of the prompt tokens" in warnings["details"]


def test_pods_with_a_tenant(fixture_store: Store) -> None:
    """vLLM's columns are NULL with a tenant: an en dash in the table, no vLLM bars, a 0..100 % axis."""
    at = app(fixture_store)
    at.switch_page("views/pods.py").run()
    at.selectbox(key="tenant").select("globex").run()
    assert_clean(at)
    assert at.dataframe[0].proto.placeholder == charts.MISSING
    assert at.dataframe[0].value["vllm_token_weighted_hit_rate"].isna().all()
    fig = figure(at, "pod_hit_rate")
    assert [t["name"] for t in fig["data"]] == ["Token-weighted hit rate (gateway)"]
    assert fig["layout"]["yaxis"]["range"] == [0, 1]
    assert any("carry no tenant" in c.value for c in at.caption)


def test_sql_page_reads_and_refuses_writes(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/adhoc_sql.py").run()
    assert_clean(at)
    at.button(key="sql_run").click().run()
    assert_clean(at)
    result = at.dataframe[0].value.set_index("tenant_id")
    assert result.loc["acme", "requests"] == 4
    at.text_area(key="sql_text").input("INSERT INTO dead_letters (event_id) VALUES ('x')")
    at.button(key="sql_run").click().run()
    assert not at.exception
    assert at.error and "read-only: INSERT INTO is refused" in at.error[0].value.replace("\\", "")
    assert "DB::Exception" not in at.error[0].value  # the message, not the driver's wrapping
    at.text_area(key="sql_text").input("KILL QUERY WHERE 1")
    at.button(key="sql_run").click().run()
    assert at.error and "read-only: KILL QUERY is refused" in at.error[0].value.replace("\\", "")
    assert fixture_store.query_rows("SELECT count() FROM dead_letters WHERE event_id = 'x'")[0][0] == 0
    assert "Store.adhoc" not in " ".join(c.value for c in at.caption)


def test_sql_page_shows_datetimes(fixture_store: Store) -> None:
    """DateTime comes through Arrow as uint32 epoch seconds: the page shows it as a datetime again."""
    at = app(fixture_store)
    at.switch_page("views/adhoc_sql.py").run()
    at.text_area(key="sql_text").input(
        "SELECT toStartOfMinute(ts) AS minute, toDateTime(ts, 'Asia/Tokyo') AS tokyo, count() AS requests "
        "FROM gateway_requests GROUP BY minute, tokyo ORDER BY tokyo LIMIT 1 -- first request"
    )
    at.button(key="sql_run").click().run()
    assert_clean(at)
    row = at.dataframe[0].value.iloc[0]
    assert row["minute"].to_pydatetime() == fixture_time(0)
    assert row["tokyo"].to_pydatetime() == fixture_time(40) and str(row["tokyo"].tz) == "Asia/Tokyo"
    assert row["requests"] == 1


def test_sql_page_shows_nested_datetimes(fixture_store: Store) -> None:
    """A DateTime in a Tuple, an Array or a Map (a key too) is a datetime on the page as on the command line; a
    map shows as JSON text (the table turned its entries into arrays of one type: the value 2 a time in 1970)."""
    at = app(fixture_store)
    at.switch_page("views/adhoc_sql.py").run()
    moment = "toDateTime('2026-11-29 12:00:05', 'UTC')"
    at.text_area(key="sql_text").input(f"SELECT tuple({moment}, 1) AS t, [{moment}] AS a, map({moment}, 2) AS m")
    at.button(key="sql_run").click().run()
    assert_clean(at)
    row = at.dataframe[0].value.iloc[0]
    expected = datetime(2026, 11, 29, 12, 0, 5, tzinfo=UTC)
    assert row["t"] == {"1": expected, "2": 1} and list(row["a"]) == [np.datetime64("2026-11-29T12:00:05")]
    assert row["m"] == '{"2026-11-29T12:00:05+00:00": 2}'  # as JSON text: as a table, the 2 became a time


@pytest.mark.parametrize(
    "failure",
    [pa.ArrowInvalid("Message metadata too long by 492 bytes"), RuntimeError("boom")],
    ids=["arrow", "other"],
)
def test_sql_page_errors_without_traceback(
    fixture_store: Store, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    def fail(statement: str) -> pl.DataFrame:
        raise failure

    at = app(fixture_store)
    at.switch_page("views/adhoc_sql.py").run()
    monkeypatch.setattr(fixture_store, "adhoc", fail)
    at.button(key="sql_run").click().run()
    assert not at.exception
    assert at.error and type(failure).__name__ in at.error[0].value


def test_error_text() -> None:
    exc = RuntimeError(
        "query: HTTPDriver received ClickHouse error code 47\n Code: 47. DB::Exception: Unknown expression "
        "identifier `x` in scope SELECT x. (UNKNOWN_IDENTIFIER) (version 25.8.1.1)"
    )
    assert data.error_text(exc) == "Unknown expression identifier `x` in scope SELECT x. (UNKNOWN_IDENTIFIER) [code 47]"
    assert charts.plain("a `b` *c*") == "a \\`b\\` \\*c\\*"


@pytest.mark.parametrize("page", PAGES)
def test_empty_store_shows_no_data_yet(store: Store, page: str) -> None:
    at = app(store)
    if page != PAGES[0]:
        at.switch_page(page).run()
    assert_clean(at)
    if page.endswith("adhoc_sql.py"):
        assert at.text_area(key="sql_text").value  # the SQL page works on an empty store too
    else:
        assert [i.value for i in at.info] == [charts.NO_DATA_YET]
        assert not at.metric


def test_no_store_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCOPE_CLICKHOUSE_URL", raising=False)
    monkeypatch.delenv("KVSCOPE_DATA_DIR", raising=False)
    data.register_store(None)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert "KVSCOPE_CLICKHOUSE_URL" in at.error[0].value


def test_bucket_widths() -> None:
    assert data.bucket_seconds(data.Filters(time_range="Last 15 min")) == 60  # never below the rollups' minute
    assert data.bucket_seconds(data.Filters(time_range="Last 1 h")) == 60
    assert data.bucket_seconds(data.Filters(time_range="Last 24 h")) == 900
    since, until = data.Filters(time_range="All").window()
    assert since.startswith("1970") and until.startswith("2200")


def test_buckets_span(fixture_store: Store) -> None:
    data.register_store(fixture_store)
    b = data.buckets(data.Filters(time_range="All"))
    assert b == data.Buckets(60, (fixture_time(30), fixture_time(150)))
    now = fixture_time(60) + timedelta(minutes=15)  # a window starting after the first data
    b = data.buckets(data.Filters(time_range="Last 15 min"), now=now)
    assert b.covered == (now - timedelta(minutes=15), fixture_time(150))
    assert b.covered[0].tzinfo is not None and datetime.now(UTC) > b.covered[1]


# -- operator basics: filters in the URL, time axes, colours, freshness, start-up, the vLLM page -----------------
FROM, TO = f"{DAY}T12:00:00Z", f"{DAY}T12:03:00Z"


def test_url_filters_reopen_the_same_view(fixture_store: Store) -> None:
    """A URL with an absolute window, tenant, pod and model opens the sidebar on those values and the pages on
    those numbers; the URL keeps them across a page switch."""
    at = url_app(fixture_store, {"from": FROM, "to": TO, "tenant": "globex", "pod": "pod-a", "model": "tiny"})
    assert at.selectbox(key="time_range").value == data.CUSTOM
    assert at.datetime_input(key="range_from").value == fixture_time(0).replace(tzinfo=None)
    assert at.datetime_input(key="range_to").value == fixture_time(180).replace(tzinfo=None)
    assert (at.selectbox(key="tenant").value, at.selectbox(key="pod").value, at.selectbox(key="model").value) == (
        "globex", "pod-a", "tiny")
    # globex on pod-a (tests/test_named_queries.py): 1,440 / 2,348 cached
    assert metrics(at)["Token-weighted hit rate (gateway)"] == "61.33%"
    assert at.query_params == {"from": FROM, "to": TO, "tenant": "globex", "pod": "pod-a", "model": "tiny"}
    at.switch_page("views/pods.py").run()
    assert_clean(at)
    assert at.dataframe[0].value["pod"].tolist() == ["pod-a"]
    assert at.selectbox(key="tenant").value == "globex"
    assert at.query_params["tenant"] == "globex" and at.query_params["from"] == FROM


def test_changing_a_filter_updates_the_url(fixture_store: Store) -> None:
    at = url_app(fixture_store, {"range": "24h"})
    assert at.selectbox(key="time_range").value == "Last 24 h"
    at.selectbox(key="tenant").select("acme").run()
    assert at.query_params == {"range": "24h", "tenant": "acme"}
    at.selectbox(key="time_range").select("Last 7 d").run()
    at.selectbox(key="model").select("tiny").run()
    assert at.query_params == {"range": "7d", "tenant": "acme", "model": "tiny"}
    at.selectbox(key="tenant").select("").run()  # All tenants: the parameter goes
    assert at.query_params == {"range": "7d", "model": "tiny"}
    at.selectbox(key="time_range").select(data.CUSTOM).run()
    at.datetime_input(key="range_from").set_value(fixture_time(60).replace(tzinfo=None)).run()
    at.datetime_input(key="range_to").set_value(fixture_time(120).replace(tzinfo=None)).run()
    assert_clean(at)
    assert at.query_params == {"from": f"{DAY}T12:01:00Z", "to": f"{DAY}T12:02:00Z", "model": "tiny"}


def test_a_bad_url_falls_back_to_defaults(fixture_store: Store) -> None:
    at = url_app(fixture_store, {"range": "3 weeks", "from": "yesterday", "to": TO, "tenant": "nobody"})
    assert at.selectbox(key="time_range").value == data.DEFAULT_TIME_RANGE
    assert at.selectbox(key="tenant").value == "nobody"  # kept: the view names it (nothing shows for it)
    assert at.query_params == {"range": "1h", "tenant": "nobody"}


@pytest.mark.parametrize(
    ("query", "expected"),
    [({}, data.Filters()), ({"range": "all"}, data.Filters(time_range="All")),
     ({"range": "15m", "model": "m"}, data.Filters(time_range="Last 15 min", model="m")),
     ({"from": f"{DAY}T13:00:00+01:00", "to": f"{DAY}T12:30:00.250Z"},
      data.Filters(time_range=data.CUSTOM, start=fixture_time(0), end=fixture_time(1800.25))),
     ({"from": TO, "to": FROM, "range": "6h"}, data.Filters(time_range="Last 6 h"))],
    ids=["empty", "all", "preset", "absolute", "backwards"],
)
def test_filters_from_and_to_the_url(query: dict[str, str], expected: data.Filters) -> None:
    f = data.Filters.from_query(query)
    assert f == expected
    assert data.Filters.from_query(f.query()) == f  # the round trip
    if f.absolute:
        assert f.window() == (f"{DAY} 12:00:00.000", f"{DAY} 12:30:00.250")


def test_time_axis_spans_the_window_and_titles_state_the_bucket(fixture_store: Store) -> None:
    """Over 12:00-13:00 the data fills three minutes: the axis still shows the hour (from the first bucket's
    start, half a bucket of margin), and the title says the bucket width."""
    at = url_app(fixture_store, {"from": f"{DAY}T12:00:00Z", "to": f"{DAY}T13:00:00Z"})
    fig = figure(at, "hit_rate")
    assert fig["layout"]["title"]["text"] == "Prefix-cache hit rate · 1 bucket = 1 min"
    assert fig["layout"]["xaxis"]["range"] == [f"{DAY}T11:59:30", f"{DAY}T13:00:30"]
    bars = figure(at, "tokens_gateway")
    assert bars["layout"]["title"]["text"].endswith("· 1 bucket = 1 min")
    assert bars["layout"]["xaxis"]["range"] == fig["layout"]["xaxis"]["range"]
    at = url_app(fixture_store, {"from": f"{DAY}T00:00:00Z", "to": f"{day(1)}T00:00:00Z"})
    fig = figure(at, "hit_rate")  # a day in ~100 buckets: 15 min
    assert fig["layout"]["title"]["text"].endswith("1 bucket = 15 min")
    assert fig["layout"]["xaxis"]["range"] == [f"{day(-1)}T23:52:30", f"{day(1)}T00:07:30"]
    assert data.duration(7200) == "2 h" and data.duration(86400) == "1 d" and data.duration(90) == "2 min"


def test_one_colour_per_cause(fixture_store: Store) -> None:
    """The Miss causes page draws each cause in dashboard/causes.py's colour, whatever the filter."""
    for tenant in ("", "globex"):
        at = url_app(fixture_store, {"range": "all", **({"tenant": tenant} if tenant else {})}, "views/miss_causes.py")
        for key in ("cause_bars", "cause_tenants"):
            colours = {tr["name"]: tr["marker"]["color"] for tr in figure(at, key)["data"] if tr["type"] == "bar"}
            assert colours and colours == causes.color_map(list(colours)), (tenant, key)
    assert colours["prefix_drift / volatile_system"] == causes.color("prefix_drift", "volatile_system")


def test_cause_in_the_url(fixture_store: Store) -> None:
    """The Miss causes page opens on the URL's cause and sub-cause, and a picked cause goes to the URL."""
    at = url_app(fixture_store, {"range": "all", "cause": "prefix_drift", "sub_cause": "tools_reordered"},
                 "views/miss_causes.py")
    assert at.selectbox(key="miss_cause").value == "prefix_drift / tools_reordered"
    assert at.dataframe[1].value["request_id"].tolist() == ["cap-3-tools-reordered"]
    at.selectbox(key="miss_cause").select("cold").run()
    assert at.query_params.get("cause") == "cold" and "sub_cause" not in at.query_params
    assert at.query_params["range"] == "all"


def test_freshness_per_source_and_the_old_data_banner(fixture_store: Store) -> None:
    at = url_app(fixture_store, {"range": "all"})
    (sources,) = [c.value.replace("\\", "") for c in at.sidebar.caption if "Sources" in c.value]
    scrape = age_of(fixture_time(150))  # the last scrape, 12:02:30
    assert f"last scrape {scrape} (pod-a {scrape.removesuffix(' ago')}, pod-b {scrape.removesuffix(' ago')})" in sources
    assert f"gateway log: {age_of(fixture_time(145))} (12 lines in the last day of data)" in sources
    assert "no KV events: routed_away/evicted are inferred from which pod served the predecessor" in sources
    assert f"attribution: latest answer {age_of(fixture_time(300))}; 1 request waiting" in sources
    (old,) = [w.value for w in at.warning]
    assert old.startswith(f"Data is from {DAY} 12:02:30 UTC ({scrape}); no new data since.")
    assert "before this start" not in old  # no kvscope process registered: only what the store says


def age_of(t: datetime) -> str:
    """What the sidebar says of a fixture time read at the clock's now: "2 d ago" (tests/clock.py puts the fixture
    36 to 60 h back), "1 d ago" for its later times in the first minutes after midnight UTC, so the page is checked
    against the same words whenever the suite runs."""
    return status.ago((datetime.now(UTC) - t).total_seconds())


def test_a_second_start_says_the_numbers_are_old(fixture_store: Store) -> None:
    """`kvscope up` over a store with old data: the banner says the numbers are from before this start, the
    sidebar that the first scrape and gateway line are pending."""
    status.register_context(context())
    at = url_app(fixture_store, {"range": "all"})
    (old,) = [w.value for w in at.warning]
    assert "no new data since" in old and "the numbers below are from before this start" in old
    (sources,) = [c.value.replace("\\", "") for c in at.sidebar.caption if "Sources" in c.value]
    assert f"vLLM: first scrape pending (pod-0, pod-1); the last stored is from {DAY} 12:02:30 UTC" in sources
    assert (f"gateway log: no request since this start; the latest is from {DAY} 12:02:25 UTC "
            f"({age_of(fixture_time(145))})") in sources
    assert metrics(at)["Token-weighted hit rate (gateway)"] == "50.96%"  # old numbers, said to be old


def context(**settings: Any) -> status.RunContext:
    from kvscope.config import build_config

    cfg = build_config({"vllm": "pod-0=http://127.0.0.1:8100,pod-1=http://127.0.0.1:8101",
                        "gateway_log": "/var/log/gw.jsonl", **settings}, environ={})
    return status.RunContext(started_at=datetime.now(UTC), config=lambda: cfg, step=lambda: "starting the collector",
                             store="chdb:///data, database kvscope")


@pytest.mark.parametrize("page", PAGES[:-1])
def test_start_up_state_says_what_is_starting(store: Store, page: str) -> None:
    status.register_context(context(kv_events_endpoint="tcp://127.0.0.1:5557"))
    at = url_app(store, {}, page if page != PAGES[0] else None)
    (info,) = [i.value.replace("\\", "") for i in at.info]
    assert info.startswith("**kvscope is starting**")
    for line in ("done: store open (chdb:///data, database kvscope)", "now: starting the collector",
                 "pending: first scrape of pod-0 (http://127.0.0.1:8100/metrics, every 5 s)",
                 "waiting for the first gateway line in /var/log/gw.jsonl",
                 "listening for KV events on tcp://127.0.0.1:5557"):
        assert f"- {line}" in info
    assert not at.metric and not at.warning


def test_vllm_page(fixture_store: Store) -> None:
    """The vLLM-board panels per pod, equal to the fixture's hand-computed figures (tests/test_named_queries.py)."""
    at = url_app(fixture_store, {"range": "all"}, "views/vllm.py")
    prompt = figure(at, "vllm_prompt_tokens_per_s")
    assert prompt["layout"]["title"]["text"] == "Prompt throughput (tokens/s) · 1 bucket = 1 min"
    (pod_a,) = [tr for tr in traces(prompt, "pod-a") if "partial" not in tr["name"]]
    assert points(pod_a)[f"{DAY}T12:01:00.000"] == pytest.approx(3091 / 60)
    running = figure(at, "vllm_running")
    assert points(next(tr for tr in traces(running, "pod-a") if "partial" not in tr["name"]))[
        f"{DAY}T12:01:00.000"] == 2.0
    usage = figure(at, "vllm_kv_cache_usage")
    assert usage["layout"]["yaxis"]["tickformat"] == ".0%"
    itl = figure(at, "vllm_inter_token_ms")
    assert points(traces(itl, "pod-a, p99")[0])[f"{DAY}T12:01:00.000"] == pytest.approx(19.75)
    e2e = figure(at, "vllm_e2e_ms")
    assert points(traces(e2e, "pod-a, p50")[0])[f"{DAY}T12:01:00.000"] == pytest.approx(150.0)
    assert any("Error rate" in c.value for c in at.caption)  # no request_success in the fixture: says so
    at.selectbox(key="tenant").select("acme").run()
    assert [i.value for i in at.info] == [charts.NO_TENANT_IN_VLLM]


def test_no_dead_letters_reads_as_good_news(fixture_store: Store) -> None:
    at = url_app(fixture_store, {"from": f"{DAY}T12:02:10Z", "to": f"{DAY}T12:02:40Z"}, "views/pods.py")
    assert [s.value for s in at.success] == ["No dead letters: every line and event parsed."]
    at = url_app(fixture_store, {"range": "all"}, "views/pods.py")
    assert not at.success and set(at.dataframe[1].value["source"]) == {"vllm_metrics", "gateway_log"}


def test_model_filter(fixture_store: Store) -> None:
    at = url_app(fixture_store, {"range": "all", "model": "tiny"})
    assert metrics(at)["Token-weighted hit rate (vLLM)"] == "50.96%"
    at = url_app(fixture_store, {"range": "all", "model": "another"})
    assert [i.value for i in at.info][0].startswith(charts.NO_DATA_IN_WINDOW)


def test_agent_ttl_page(chdb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Agent TTL page on the scenario of tests/ttl_data.py (figures derived in tests/test_ttl_queries.py): 5
    next turns with a known cached count on their previous turn's pod, 3 survived; 960 + 736 tokens evicted,
    costing 960·1e-4 + 736·5e-5 = 0.1328 GPU-s, 1.33 USD at 36,000 USD per GPU-hour; one survival line per
    tenant/model; the hold-time table for 50/90/99 % (10 s, 2 min, 2 min)."""
    from dashboard import fix_first
    from tests import ttl_data

    s = Store.open(data_dir=chdb_dir, database=f"dash_ttl_{uuid.uuid4().hex[:8]}")
    s.migrate()
    ttl_data.load(s)
    monkeypatch.setenv("KVSCOPE_GPU_HOUR_PRICE", "36000")
    monkeypatch.setenv("KVSCOPE_KV_BYTES_PER_TOKEN", "2048")
    fix_first.gpu_hour_price.cache_clear()
    try:
        at = app(s)
        at.switch_page("views/ttl.py").run()
        assert_clean(at)
        m = metrics(at)
        assert (m["Next turns"], m["Prefix survived the wait"], m["Tokens evicted before the next turn"]) == (
            "5", "60.0%", "1,696")
        assert m["Re-compute cost of those tokens"] == "0.133 GPU-s · 1.33 USD"
        fig = figure(at, "ttl_survival")
        lines = {t["name"]: points(t) for t in fig["data"]}
        assert lines == {"agentco / tiny": {"<1s": 1.0, "1-5s": 1.0, "5-15s": 0.0, "1-5m": 0.0},
                         "chatco / tiny": {"15-60s": 1.0}}
        (bars,) = figure(at, "ttl_evicted")["data"]
        assert values(bars["x"]) == ["<1s", "1-5s", "5-15s", "15-60s", "1-5m"]  # by gap, every bucket with turns
        assert points(bars) == {"<1s": 0, "1-5s": 0, "5-15s": 960, "15-60s": 0, "1-5m": 736}
        assert bars["marker"]["color"] == causes.color("evicted", "evicted_before_next_turn")
        assert values(bars["text"])[2:5:2] == ["960 tokens · 0.096 GPU-s · 0.96 USD",
                                               "736 tokens · 0.037 GPU-s · 0.37 USD"]
        hold = table(at, "hold time")
        assert hold["hold time"].tolist() == ["10 s", "2 min", "2 min"]
        assert hold["warm turns"].tolist() == ["3 of 6", "6 of 6", "6 of 6"]
        assert hold["bytes per run"].tolist() == ["1.0 MiB"] * 3  # (2420·1024 + 1960·2048) / 6 = 1,082,027 B
        assert hold["block-seconds taken"].tolist() == ["1,013", "3,705", "3,705"]
        runs = table(at, "run_id")
        assert runs["run_id"].tolist() == ["run-2", "run-1", "conv-1"]
        assert runs["cache_retained_bytes"].tolist() == ["2.0 MiB", "760.0 KiB", "800.0 KiB"]
    finally:
        fix_first.gpu_hour_price.cache_clear()
