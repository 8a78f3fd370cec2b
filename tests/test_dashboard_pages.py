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

from dashboard import charts, data
from ingest.store import Store
from tests.fixture_data import at as fixture_time
from tests.fixture_data import load_fixture

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = [
    "views/overview.py",
    "views/tenants.py",
    "views/miss_causes.py",
    "views/fingerprints.py",
    "views/pods.py",
    "views/data_quality.py",
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


@pytest.fixture(autouse=True)
def _unregister() -> Iterator[None]:
    yield
    data.register_store(None)  # the registry is process-wide: reset it between tests


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
    assert not at.warning  # the two sources agree on the fixture
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
    assert "tenant=globex&cause=prefix_drift&sub_cause=volatile_system&request_id=cap-4-timestamp-first" in links[1]


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
    assert by_bucket["2026-11-29T12:01:00.000"] == pytest.approx((672 + 288) / (764 + 784 + 400 + 19 + 400))
    assert line["connectgaps"] is False
    vllm_line, vllm_partial = traces(fig, "Token-weighted hit rate, vLLM counters")
    assert vllm_partial["mode"] == "markers" and "partial bucket" in vllm_partial["name"]
    partial = points(vllm_partial)
    assert partial["2026-11-29T12:02:00.000"] == pytest.approx((768 + 768) / (800 + 1651))
    assert points(vllm_line)["2026-11-29T12:02:00.000"] is None
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
    causes = at.dataframe[0].value
    assert set(causes["cause"]) == {"cold", "prefix_drift", "routed_away", "unavoidable", "below_block"}
    assert len(at.dataframe[1].value) == 16  # every (request, cause) row
    at.selectbox(key="miss_cause").select("prefix_drift / tools_reordered").run()
    assert_clean(at)
    drill = at.dataframe[1].value
    assert drill["request_id"].tolist() == ["cap-3-tools-reordered"]
    assert drill["predecessor_request_id"].tolist() == ["cap-2-warm"]


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
    warnings = {w.value.split("**")[1]: w.value for w in at.warning}
    assert sorted(warnings) == ["bypass", "connector", "details", "direct", "edge", "preempt", "unscraped"]
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
