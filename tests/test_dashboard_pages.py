"""Each dashboard page under Streamlit's AppTest, reading a registered store (as ``kvscope up`` registers it):
on the fixture (tests/fixture_data.py) it runs without exception and shows the expected numbers; on an empty
database it shows the "no data yet" state."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import charts, data
from ingest.store import Store
from tests.fixture_data import load_fixture

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = [
    "views/overview.py",
    "views/tenants.py",
    "views/miss_causes.py",
    "views/fingerprints.py",
    "views/pods.py",
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
    assert m["Prefill tokens saved"] == "3,232"
    assert m["Missed tokens"] == "3,110"
    assert not at.warning  # the two sources agree on the fixture
    assert len(at.get("plotly_chart")) == 5  # hit rate, tokens ×2, TTFT, queue wait


def test_overview_tenant_filter(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.selectbox(key="tenant").select("acme").run()
    assert_clean(at)
    m = metrics(at)
    assert m["Token-weighted hit rate (gateway)"] == "47.66%"  # 1,504 / 3,156
    assert m["Token-weighted hit rate (vLLM)"] == "–"  # vLLM's counters carry no tenant
    assert any("carry no tenant" in c.value for c in at.caption)


def test_tenants(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/tenants.py").run()
    assert_clean(at)
    table = at.dataframe[0].value.set_index("tenant_id")
    assert table.loc["acme", "tenant_cache_affinity"] == pytest.approx(1594 / 2394)
    assert table.loc["initech", "tenant_cache_affinity"] == pytest.approx(400 / 419)
    assert table.loc["globex", "token_weighted_hit_rate"] == pytest.approx(1440 / 2348)
    assert len(at.get("plotly_chart")) == 2  # bars and the tenant × pod matrix


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


def test_fingerprints(fixture_store: Store) -> None:
    at = app(fixture_store)
    at.switch_page("views/fingerprints.py").run()
    assert_clean(at)
    table = at.dataframe[0].value
    assert table["prompt_fingerprint_cardinality"].sum() > 0
    assert set(table["tenant_id"]) == {"acme", "globex", "initech"}
    assert len(at.get("plotly_chart")) == 2


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
    assert at.error and "readonly" in at.error[0].value.lower()
    assert fixture_store.query_rows("SELECT count() FROM dead_letters WHERE event_id = 'x'")[0][0] == 0


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
    assert data.bucket_seconds(data.Filters(time_range="Last 15 min")) == 15
    assert data.bucket_seconds(data.Filters(time_range="Last 1 h")) == 60
    assert data.bucket_seconds(data.Filters(time_range="Last 24 h")) == 900
    since, until = data.Filters(time_range="All").window()
    assert since.startswith("1970") and until.startswith("2200")
