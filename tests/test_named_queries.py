"""Contract tests of the named queries (sql/queries/*.sql): every header parses and matches its SQL and its
result columns, and every query returns the hand-computed rows on the fixture (tests/fixture_data.py).

Expected numbers are derived in the comments from the fixture's constants; pod-a's are the real vLLM
capture's (Δ 3,091 queried / 1,408 hit between its first two scrapes).
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

import sql as sqlfiles
from collector.events import VllmScrape
from collector.vllm_metrics import ScrapeState, scrape_events
from ingest.errors import QueryError
from ingest.rows import metric_rows
from ingest.store import Store
from kvscope.cli import main
from sql import TIME_MAX, TIME_MIN
from tests.clock import DAY
from tests.fixture_data import PREFILL_SECONDS_PER_TOKEN, at, load_fixture
from tests.test_vllm_metrics import BODY1, vllm_0_10

PARAM_USE = re.compile(r"\{(\w+):([^{}]+)\}")
QUERIES = sqlfiles.query_names()
REQUIRED = {
    "hit_rate",
    "hit_rate_total",
    "miss_causes",
    "miss_requests",
    "request_detail",
    "tenant_affinity",
    "tenant_pod_matrix",
    "fingerprint_cardinality",
    "latency",
    "tokens",
    "pods",
    "dead_letters",
    "freshness",
    "vllm_series",
    "vllm_latency",
}
WINDOW_PARAMS = {"since", "until"}


@pytest.fixture(scope="module")
def fx(chdb_dir: Path) -> Store:
    """The fixture data set in its own database (read-only for the tests of this module)."""
    s = Store.open(data_dir=chdb_dir, database=f"nq_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_fixture(s)
    return s


@pytest.fixture(scope="module")
def empty(chdb_dir: Path) -> Store:
    s = Store.open(data_dir=chdb_dir, database=f"nq_empty_{uuid.uuid4().hex[:12]}")
    s.migrate()
    return s


def rows(store: Store, name: str, **params: Any) -> list[dict[str, Any]]:
    return store.named(name, {k: str(v) for k, v in params.items()}).to_dicts()


def by(rows_: list[dict[str, Any]], *keys: str) -> dict[Any, dict[str, Any]]:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows_}


def approx(x: float) -> Any:
    return pytest.approx(x, abs=1e-9)


# -- headers -------------------------------------------------------------------------------------------------
def test_required_queries_exist() -> None:
    assert REQUIRED <= set(QUERIES)


@pytest.mark.parametrize("name", QUERIES)
def test_header_matches_sql(name: str) -> None:
    q = sqlfiles.load_query(name)  # parses; raises if the header name differs from the file stem
    assert q.name == name == Path(name).stem
    assert q.description and q.returns
    declared = {p.name: p.type for p in q.params}
    body = "\n".join(line for line in q.sql.splitlines() if not line.startswith("--"))
    used = {}
    for pname, ptype in PARAM_USE.findall(body):
        assert used.setdefault(pname, ptype.strip()) == ptype.strip(), f"{pname} used with two types"
    assert used == declared, "every {param:Type} in the SQL is declared with that type, and vice versa"
    assert all(c.help for c in q.returns), "every returned column says what it is and its unit"
    assert len({c.name for c in q.returns}) == len(q.returns)
    if declared:
        assert WINDOW_PARAMS <= set(declared), "every parameterised query takes since and until"
        for p in q.params:
            assert p.default is not None, f"{p.name} has a default (defaults cover all time and everything)"
    for p in q.params:
        if p.name in WINDOW_PARAMS:
            assert p.type == "DateTime64(3, 'UTC')"
        if p.name in {"tenant", "pod", "model"}:
            assert p.type == "String" and p.default == "''"
    if {"tenant", "pod"} <= set(declared) and name != "request_detail":  # that one names a single request
        assert "model" in declared, "a query filtered by tenant and pod is filtered by model too (the sidebar's)"
    bucketed = set(re.findall(r"toIntervalSecond\(\{(\w+):", body))
    assert bucketed <= {sqlfiles.BUCKET_PARAM}, "a bucket width is bucket_seconds, which bind holds to whole minutes"
    if sqlfiles.BUCKET_PARAM in declared:
        assert declared[sqlfiles.BUCKET_PARAM] == "UInt32" and bucketed
    if "_rollup(" in body:  # the rollups hold minutes: the window widens to whole minutes (docs/scale.md)
        for p in q.params:
            if p.name in WINDOW_PARAMS:
                assert "whole minutes" in p.help and "inside a minute" in p.help, p.help


@pytest.mark.parametrize("name", QUERIES)
def test_columns_and_types_match_header(fx: Store, name: str) -> None:
    q = sqlfiles.load_query(name)
    result = fx.client.query(q.sql, parameters=q.bind({}))
    assert list(result.column_names) == [c.name for c in q.returns]
    assert [t.name for t in result.column_types] == [c.type for c in q.returns]
    assert result.result_rows, f"{name} returns rows on the fixture"


@pytest.mark.parametrize("name", QUERIES)
def test_runs_on_empty_store(empty: Store, name: str) -> None:
    df = empty.named(name)
    expected = 6 if name == "data_extent" else 0
    assert df.height == expected
    assert df.columns == [c.name for c in sqlfiles.load_query(name).returns]


def test_includes_expand_and_unknown_parts_are_refused() -> None:
    """``-- include: <part>`` lines become the part's text; every part is included somewhere; an unknown part
    names the file."""
    q = sqlfiles.load_query("miss_requests")
    assert "-- include:" not in q.sql and "AS seconds_per_token_on" in q.sql
    raw = {name: (sqlfiles.QUERIES_DIR / f"{name}.sql").read_text() for name in QUERIES}
    for part in sqlfiles.part_names():
        assert any(f"-- include: {part}\n" in text for text in raw.values()), f"part {part} is included"
    with pytest.raises(sqlfiles.HeaderError, match="x.sql: no SQL part 'nope'"):
        sqlfiles.expand_includes("SELECT 1\n    -- include: nope\n", "x.sql")


def test_unknown_parameter_is_refused(fx: Store) -> None:
    with pytest.raises(QueryError, match="no parameter"):
        fx.named("hit_rate", {"tenant_id": "acme"})


def test_buckets_are_datetimes(fx: Store) -> None:
    df = fx.named("hit_rate")
    assert df.schema["bucket"] == pl.Datetime("ms", "UTC")


# -- parameter values ------------------------------------------------------------------------------------------
BUCKETED = [n for n in QUERIES if any(p.name == sqlfiles.BUCKET_PARAM for p in sqlfiles.load_query(n).params)]


@pytest.mark.parametrize("name", BUCKETED)
@pytest.mark.parametrize("bucket", ["90", "30", "0", "-60", "61", "99999999999", "4294967295", "1e3", "", "60s"])
def test_bucket_not_whole_minutes_is_refused(fx: Store, name: str, bucket: str) -> None:
    """The rollups hold minutes: 90 s buckets held one minute or two by turns, 30 s ones came back 60 s wide,
    and 99999999999 wrapped in UInt32. Each is refused in one line naming the parameter."""
    with pytest.raises(QueryError, match="^parameter bucket_seconds: ") as err:
        fx.named(name, {"bucket_seconds": bucket})
    assert "\n" not in str(err.value)


def test_buckets_of_whole_minutes_run(fx: Store) -> None:
    """Two-minute buckets start on even minutes and hold the one-minute buckets' tokens."""
    for bucket in (60, 120, 420, sqlfiles.BUCKET_MAX_SECONDS):
        assert fx.named("hit_rate", {"bucket_seconds": str(bucket)}).height >= 2
    per_minute = rows(fx, "hit_rate", bucket_seconds=60)
    per_two = rows(fx, "hit_rate", bucket_seconds=" 120 ")
    assert all(r["bucket"].timestamp() % 120 == 0 for r in per_two)
    for source in ("vllm", "gateway"):
        two = {r["bucket"]: r["query_tokens"] for r in per_two if r["source"] == source}
        one: dict[datetime, int] = {}
        for r in per_minute:
            if r["source"] == source:
                start = datetime.fromtimestamp(r["bucket"].timestamp() // 120 * 120, UTC)
                one[start] = one.get(start, 0) + r["query_tokens"]
        assert two == one and len(two) >= 1


def test_dashboard_buckets_are_whole_minutes() -> None:
    """Every bucket width the dashboard, the digest and the alerts pass is one bind accepts."""
    from dashboard.alerts import BUCKET_ALL
    from dashboard.data import NICE_BUCKETS
    from dashboard.digest import WHOLE_WINDOW

    param = next(p for p in sqlfiles.load_query("hit_rate").params if p.name == sqlfiles.BUCKET_PARAM)
    for bucket in (*NICE_BUCKETS, WHOLE_WINDOW, BUCKET_ALL):
        assert sqlfiles.check_value(param, str(bucket)) == str(bucket)


@pytest.mark.parametrize(("param", "value"), [
    ("since", "2026-13-01"),             # ClickHouse read it as a day in 2027: every row
    ("since", "2026-11-31"),             # ... as December 1st: no row
    ("until", "2026-02-29 12:00:00"),    # not a leap year
    ("since", "2026-11-29 24:00:00"),
    ("since", "2026-11-29T12:60:00Z"),
    ("until", "2026-11-29T12:00:00+25:00"),
    ("since", "yesterday"),
    ("since", "1796184238"),
    ("until", "2026-1-2"),
    ("since", ""),
])
def test_impossible_times_are_refused(fx: Store, param: str, value: str) -> None:
    with pytest.raises(QueryError) as err:
        fx.named("hit_rate_total", {param: value})
    message = str(err.value)
    assert message.startswith(f"parameter {param}: {value!r} is not a real date and time; give YYYY-MM-DD")
    assert "\n" not in message and "Z or an offset" in message


@pytest.mark.parametrize("value", [
    f"{DAY} 12:01", f"{DAY} 12:01:00", f"{DAY}T12:01:00Z", f"{DAY}T12:01:00.000", f"{DAY}T13:01:00+01:00",
    f"{DAY}T08:01-0400", f" {DAY}t12:01:00.000000000Z ", f"{DAY} 12",
])
def test_time_forms_accepted(fx: Store, value: str) -> None:
    """The forms that worked keep working, and mean the same time (12:01 UTC; 12:00 for the hour alone)."""
    expected = f"{DAY} 12:00:00" if value.endswith(" 12") else f"{DAY} 12:01:00"
    assert rows(fx, "hit_rate_total", since=value) == rows(fx, "hit_rate_total", since=expected)
    assert sqlfiles.check_value(sqlfiles.Param("since", "DateTime64(3, 'UTC')", None), value) == f"{expected}.000"


@pytest.mark.parametrize(("ptype", "value", "bound"), [
    ("UInt32", "100", "100"), ("UInt32", "+7", "7"), ("UInt8", "255", "255"), ("Int8", "-128", "-128"),
    ("UInt32", "99999999999", None), ("UInt32", "-1", None), ("UInt8", "256", None), ("UInt32", "1.5", None),
    ("UInt64", "18446744073709551616", None),
    ("Date", "2026-11-29", "2026-11-29"), ("Date", "2026-02-29", None), ("Date", "2026-11-29 12:00", None),
    ("Date", "2200-01-01", "2149-06-06"), ("Date32", "1800-01-01", "1900-01-01"),
    ("DateTime", "2026-11-29T12:00:00+01:00", "2026-11-29 11:00:00.000"), ("DateTime", "0001-01-01", TIME_MIN),
    ("DateTime64(3, 'UTC')", "9999-12-31 23:59:59.999", TIME_MAX),
    ("String", "2026-13-01", "2026-13-01"), ("Array(UInt8)", "[1, 2]", "[1,2]"),
])
def test_check_value_by_type(ptype: str, value: str, bound: str | None) -> None:
    param = sqlfiles.Param("p", ptype, None)
    if bound is None:
        with pytest.raises(sqlfiles.ParamError, match=f"^parameter p: {re.escape(repr(value))} is not a "):
            sqlfiles.check_value(param, value)
    else:
        assert sqlfiles.check_value(param, value) == bound


def test_integer_out_of_its_type_is_refused(fx: Store) -> None:
    """limit is UInt32: 99999999999 wrapped to 1,215,752,191 in ClickHouse."""
    with pytest.raises(QueryError, match=r"^parameter limit: '99999999999' is not a UInt32 \(a whole number "):
        fx.named("miss_requests", {"limit": "99999999999"})
    assert len(rows(fx, "miss_requests", limit=2)) == 2


SAMPLE = Path(__file__).parent / "samples" / "vllm_0.32.0_cpu_real_metrics_1.txt"


@pytest.mark.parametrize(("args", "error"), [
    (["query", "hit_rate", "--param", "pod="],
     "Error: Invalid value for --param pod: '' is blank; leave --param pod out for its default (pod, tenant, "
     "model ...: all)"),
    (["query", "tenant_profile", "--param", "tenant= "], "Error: Invalid value for --param tenant: ' ' is blank"),
    (["query", "hit_rate", "--param", "model=\t"], "Error: Invalid value for --param model: '\\t' is blank"),
    (["import", "metrics", str(SAMPLE), "--pod", "", "--at", f"{DAY}T12:00:00Z"],
     "Error: Invalid value for --pod: '' is blank; give a name"),
    (["import", "metrics", str(SAMPLE), "--pod", "  ", "--at", f"{DAY}T12:00:00Z"],
     "Error: Invalid value for --pod: '  ' is blank; give a name"),
])
def test_blank_names_on_the_command_line_are_usage_errors(fx: Store, args: list[str], error: str) -> None:
    """``--pod ""`` was taken: a filter matched nothing, an import stored a scrape of pod ''. Each is click's
    usage error (exit 2), its error one line, before the store is touched. (Store.named still takes '' for all,
    which the dashboard passes, and any stored name: the gateway log stores identifiers exactly as logged.)"""
    stored = "SELECT sum(total_rows) FROM system.tables WHERE database = currentDatabase()"
    before = fx.query_rows(stored)
    result = CliRunner().invoke(main, [*args, "--data-dir", fx.dsn.removeprefix("chdb://"), "--database",
                                       fx.database], env={})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.splitlines()[-1].startswith(error), result.output
    assert fx.query_rows(stored) == before


def test_a_gateway_pod_without_a_name_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["gateway", "--pod", "=http://127.0.0.1:1", "--log", str(tmp_path / "g.log")],
                                env={})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.splitlines()[-1] == "Error: Invalid value for --pod: '' is blank; give NAME=http://host:port"


# -- hit rate ------------------------------------------------------------------------------------------------
def test_hit_rate_per_bucket(fx: Store) -> None:
    r = by(rows(fx, "hit_rate"), "bucket", "source")
    # vLLM: the first scrape (12:00:30) gives no delta, so there is no vllm row at 12:00.
    assert (at(0), "vllm") not in r
    # 12:01: pod-a 12909-9818 = 3091 / 5472-4064 = 1408; pod-b dropped 5000→800 and 2000→288 (restart):
    # delta = the new values. Ratio of sums (1408+288)/(3091+800), not the mean of ratios (0.4078).
    v1 = r[(at(60), "vllm")]
    assert (v1["hit_tokens"], v1["query_tokens"]) == (1696, 3891)
    assert v1["token_weighted_hit_rate"] == approx(1696 / 3891)
    assert v1["request_weighted_hit_rate"] is None and v1["requests"] is None
    # 12:02: pod-a 13709-12909 = 800 / 768; pod-b 2451-800 = 1651 / 1056-288 = 768.
    v2 = r[(at(120), "vllm")]
    assert (v2["hit_tokens"], v2["query_tokens"]) == (1536, 2451)
    # gateway 12:00: cap-1 762/0 and cap-2 762/736 (its duplicate log line was dropped at load).
    g0 = r[(at(0), "gateway")]
    assert (g0["hit_tokens"], g0["query_tokens"], g0["requests"]) == (736, 1524, 2)
    assert g0["request_weighted_hit_rate"] == approx((0 + 736 / 762) / 2)
    # gateway 12:01: 764/672, 784/0, 400/0, 19/0, 400/288.
    g1 = r[(at(60), "gateway")]
    assert (g1["hit_tokens"], g1["query_tokens"], g1["requests"]) == (960, 2367, 5)
    assert g1["token_weighted_hit_rate"] == approx(960 / 2367)
    assert g1["request_weighted_hit_rate"] == approx((672 / 764 + 288 / 400) / 5)
    # gateway 12:02: 800/0, 832/768, 19/0, 800/768; the 400-status request is not served.
    g2 = r[(at(120), "gateway")]
    assert (g2["hit_tokens"], g2["query_tokens"], g2["requests"]) == (1536, 2451, 4)
    assert g2["request_weighted_hit_rate"] == approx((768 / 832 + 768 / 800) / 4)


def test_hit_rate_total_sources_agree_on_fixture(fx: Store) -> None:
    r = by(rows(fx, "hit_rate_total"), "source")
    assert set(r) == {"vllm", "gateway"}
    for source in ("vllm", "gateway"):
        assert (r[source]["hit_tokens"], r[source]["query_tokens"]) == (3232, 6342)
        assert r[source]["token_weighted_hit_rate"] == approx(3232 / 6342)
    gw = r["gateway"]
    assert gw["requests"] == 11
    assert gw["request_weighted_hit_rate"] == approx(
        (736 / 762 + 672 / 764 + 288 / 400 + 768 / 832 + 768 / 800) / 11
    )


def test_hit_rate_filters_and_window(fx: Store) -> None:
    # A tenant filter keeps the gateway only (vLLM counters carry no tenant).
    r = by(rows(fx, "hit_rate_total", tenant="acme"), "source")
    assert set(r) == {"gateway"} and (r["gateway"]["hit_tokens"], r["gateway"]["query_tokens"]) == (
        1504,
        3156,
    )
    # A pod filter applies to both sources.
    r = by(rows(fx, "hit_rate_total", pod="pod-b"), "source")
    assert (r["vllm"]["hit_tokens"], r["vllm"]["query_tokens"]) == (1056, 2451)
    assert (r["gateway"]["hit_tokens"], r["gateway"]["query_tokens"]) == (1056, 2451)
    # since after the first scrape: the increases were computed by the collector, stamped at the later scrape.
    r = by(rows(fx, "hit_rate_total", since=f"{DAY} 12:01:00"), "source")
    assert r["vllm"]["query_tokens"] == 6342
    assert r["gateway"]["query_tokens"] == 2367 + 2451
    # until before the 12:01 minute (windows resolve to whole minutes): no vLLM increase yet.
    r = by(rows(fx, "hit_rate_total", until=f"{DAY} 12:01:00"), "source")
    assert set(r) == {"gateway"}
    # bucket_seconds: one hour puts everything in one bucket.
    assert {(x["source"], x["query_tokens"]) for x in rows(fx, "hit_rate", bucket_seconds=3600)} == {
        ("vllm", 6342),
        ("gateway", 6342),
    }


def test_hit_rate_engines_and_name_generations(chdb_dir: Path) -> None:
    """Counter increases as the collector sends them (its restart and generation rules are tested with the
    collector): DP engines are summed before dividing, vLLM <= 0.11's gpu_ names count the same, and vLLM 0.10's
    two generations of one counter are counted once."""
    s = Store.open(data_dir=chdb_dir, database=f"nq_counters_{uuid.uuid4().hex[:12]}")
    s.migrate()
    increases = [  # (pod, engine, name, increase)
        ("dp", "0", "vllm:prefix_cache_queries_total", 1000), ("dp", "0", "vllm:prefix_cache_hits_total", 900),
        ("dp", "1", "vllm:prefix_cache_queries_total", 100),  # engine 1 hit nothing: the mean of ratios is 0.45
        ("old", "0", "vllm:gpu_prefix_cache_queries_total", 200), ("old", "0", "vllm:gpu_prefix_cache_hits_total", 100),
    ]
    columns = ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"]
    s.insert("vllm_metrics", [(at(30), pod, eng, "tiny", name, "", 0.0, float(n)) for pod, eng, name, n in increases],
             columns)
    # vLLM 0.10 exposes both generations with equal values: through the collector, counted once.
    state = ScrapeState()
    for seconds, queries, hits in ((20, 500.0, 100.0), (30, 900.0, 400.0)):
        ms = int(at(seconds).timestamp() * 1000)
        for ev in scrape_events("both", "http://both/metrics", vllm_0_10(BODY1, queries, hits), ms, 1.0, state):
            if isinstance(ev.payload, VllmScrape):
                s.insert("vllm_metrics", metric_rows(ev, ev.payload), columns)

    def vllm(pod: str = "") -> tuple[int, int]:
        r = by(rows(s, "hit_rate_total", pod=pod), "source")["vllm"]
        return r["hit_tokens"], r["query_tokens"]

    assert vllm("dp") == (900, 1100)
    assert by(rows(s, "hit_rate_total", pod="dp"), "source")["vllm"]["token_weighted_hit_rate"] == approx(900 / 1100)
    assert vllm("old") == (100, 200)
    assert vllm("both") == (300, 400)
    assert vllm() == (1300, 1700)
    assert [(r["pod"], r["vllm_hit_tokens"], r["vllm_query_tokens"]) for r in rows(s, "pods")] == [
        ("both", 300, 400),
        ("dp", 900, 1100),
        ("old", 100, 200),
    ]
    assert by(rows(s, "pods"), "pod")["dp"]["engines"] == 2


def test_the_sql_examples_in_the_docs_run(fx: Store) -> None:
    """Every ```sql block of README.md and docs/*.md runs on a migrated store as written."""
    root = Path(__file__).parents[1]
    blocks = [(f.name, b) for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
              for b in re.findall(r"```sql\n(.*?)```", f.read_text(), re.S)]
    assert blocks
    for name, block in blocks:
        for statement in filter(str.strip, block.split(";")):
            try:
                fx.query_rows(statement)
            except Exception as exc:  # noqa: BLE001 - the message names the block
                pytest.fail(f"{name}: {statement.strip()[:80]}...: {exc}")



DOCS = [Path(__file__).parents[1] / "README.md", *sorted((Path(__file__).parents[1] / "docs").glob("*.md"))]


def doc_sections() -> list[tuple[str, str, str]]:
    """(file name, heading line, text) of each section of README.md and docs/*.md: a section runs from a
    Markdown heading to the next (fenced code blocks are text, their # lines no headings)."""
    out = []
    for f in DOCS:
        heading, text, fenced = "", [], False
        for line in f.read_text().splitlines():
            fenced ^= line.startswith("```")
            if line.startswith("#") and not fenced:
                out.append((f.name, heading, "\n".join(text)))
                heading, text = line, []
            else:
                text.append(line)
        out.append((f.name, heading, "\n".join(text)))
    return out


def test_every_named_query_is_described_in_the_docs() -> None:
    """`kvscope query --list` listed queries no page described (data_extent, dimensions, tenant_pod_matrix,
    latency, tokens; hit_rate and pods only named in passing), and no test compared sql/queries/ with the docs.
    Each query is named (`name`, `kvscope query name ...`) in a section of README.md or docs/*.md that speaks of
    named queries; a query with a heading of its own (### `name`) names there every parameter and every column
    it returns, and shows a `kvscope query name` example."""
    sections = doc_sections()
    about_queries = [heading + "\n" + text for _, heading, text in sections
                     if re.search(r"named quer|kvscope query", heading + text, re.I)]
    missing = [name for name in QUERIES
               if not any(re.search(rf"`(kvscope query )?{name}\b[^`]*`", s) for s in about_queries)]
    assert not missing, f"named queries no doc describes: {missing} (docs/dashboard.md lists where each is)"
    own = {m.group(1): (f, text) for f, heading, text in sections if (m := re.fullmatch(r"#+ `(\w+)`", heading))}
    assert {"data_extent", "dimensions", "tenant_pod_matrix", "latency", "tokens", "pods", "hit_rate"} <= set(own)
    for name, (f, text) in own.items():
        assert name in QUERIES, f"{f}: ### `{name}` is no named query"
        q = sqlfiles.load_query(name)
        spans = set(re.findall(r"`([^`]+)`", text))
        unnamed = [x.name for x in (*q.params, *q.returns) if x.name not in spans]
        assert not unnamed, f"{f}, ### `{name}`: parameters or columns not described: {unnamed}"
        assert f"kvscope query {name}" in text, f"{f}, ### `{name}`: no example"


def test_the_query_commands_in_the_docs_run(fx: Store) -> None:
    """Every `kvscope query NAME --param k=v ...` in a ```bash block of README.md and docs/*.md names a query
    and parameters it has, with values it takes, and runs (on the fixture; its dates may differ)."""
    import shlex

    commands = []
    for f in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", f.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                rest = words[words.index("query") + 1:] if "query" in words else []
                if words and words[0].endswith("kvscope") and rest and rest[0] != "--list":
                    commands.append((f.name, rest))
    assert len(commands) >= 10
    for f, words in commands:
        name, params = words[0], {}
        for flag, value in zip(words, words[1:], strict=False):
            if flag == "--param":
                key, _, params[key] = value.partition("=")
        declared = {p.name for p in sqlfiles.load_query(name).params}
        assert set(params) <= declared, f"{f}: kvscope query {name}: unknown parameters {set(params) - declared}"
        fx.named(name, params)

# -- miss causes ---------------------------------------------------------------------------------------------
def test_miss_causes(fx: Store) -> None:
    r = rows(fx, "miss_causes")
    total = 3110  # Σ(prompt - cached) over served requests = 6342 - 3232
    assert sum(x["missed_tokens"] for x in r) == total
    got = {(x["cause"], x["sub_cause"]): (x["missed_tokens"], x["requests"]) for x in r}
    assert got == {
        ("cold", ""): (736 + 384, 2),  # the stale 700-token answer of cap-1-cold is cancelled (sign -1)
        ("prefix_drift", "volatile_system"): (768, 1),
        ("routed_away", ""): (768, 1),
        ("unavoidable", ""): (26 + 26 + 28 + 16 + 16 + 112 + 32 + 64 + 32, 9),
        ("prefix_drift", "tools_reordered"): (64, 1),
        ("below_block", ""): (19 + 19, 2),
    }
    assert r[0]["cause"] == "cold" and r[0]["share_of_missed"] == approx(1120 / total)
    assert all(x["tenant_id"] == "" for x in r)
    # pod-a measured its prefill time; pod-b did not and takes the fleet's rate, which is pod-a's
    for x in r:
        assert x["gpu_seconds"] == approx(x["missed_tokens"] * PREFILL_SECONDS_PER_TOKEN), x


def test_tenant_profile(fx: Store) -> None:
    got = {x["tenant_id"]: x for x in rows(fx, "tenant_profile")}
    acme = got["acme"]  # four served requests: 762 + 762 + 800 + 832 prompt tokens, suffixes 26 + 26 + 32 + 64
    assert (acme["requests"], acme["prompt_tokens"], acme["prefix_tokens"]) == (4, 3156, 3156 - 148)
    assert acme["mean_prefix_tokens"] == approx(3008 / 4)
    assert (acme["requests_with_predecessor"], acme["reuse_share"]) == (3, 0.75)
    assert got["initech"]["requests_per_fingerprint"] == approx(4 / 3)
    assert [x["tenant_id"] for x in rows(fx, "tenant_profile")] == ["acme", "globex", "initech"]


def test_miss_causes_gpu_seconds_need_a_measurement(fx: Store) -> None:
    # a window with misses but no prefill-time increase (before pod-a's second scrape): unknown, not 0
    r = rows(fx, "miss_causes", until=f"{DAY} 12:01:00.000")
    assert r and all(x["gpu_seconds"] is None for x in r)


def test_miss_causes_per_tenant(fx: Store) -> None:
    r = rows(fx, "miss_causes", by_tenant=1)
    got = {(x["tenant_id"], x["cause"], x["sub_cause"]): x["missed_tokens"] for x in r}
    assert got[("acme", "routed_away", "")] == 768
    assert got[("acme", "unavoidable", "")] == 26 + 26 + 32 + 64
    assert got[("globex", "prefix_drift", "volatile_system")] == 768
    assert got[("initech", "below_block", "")] == 38
    assert sum(x["share_of_missed"] for x in r) == approx(1.0)
    only = rows(fx, "miss_causes", by_tenant=1, tenant="initech")
    assert {x["tenant_id"] for x in only} == {"initech"}
    assert sum(x["missed_tokens"] for x in only) == 384 + 16 + 112 + 38


def test_miss_requests_drill_down(fx: Store) -> None:
    r = rows(fx, "miss_requests", cause="prefix_drift")
    assert [(x["request_id"], x["sub_cause"], x["missed_tokens"]) for x in r] == [
        ("cap-4-timestamp-first", "volatile_system", 768),
        ("cap-3-tools-reordered", "tools_reordered", 64),
    ]
    top = r[1]
    assert (top["request_missed_tokens"], top["prompt_tokens"], top["cached_tokens"]) == (92, 764, 672)
    assert (top["predecessor_request_id"], top["predecessor_pod"], top["pod"]) == (
        "cap-2-warm",
        "pod-a",
        "pod-a",
    )
    assert top["agent_run_id"] == "run-globex-1"
    routed = rows(fx, "miss_requests", cause="routed_away")[0]
    assert (routed["request_id"], routed["pod"], routed["predecessor_pod"]) == (
        "acme-c1-t3",
        "pod-b",
        "pod-a",
    )
    assert routed["gap_ms"] == approx(69985.0)
    # each row's cost: its missed tokens × pod-a's measured rate (pod-b, unmeasured, takes the fleet's: pod-a's)
    assert [x["gpu_seconds"] for x in r] == [approx(768 * PREFILL_SECONDS_PER_TOKEN),
                                             approx(64 * PREFILL_SECONDS_PER_TOKEN)]
    assert routed["gpu_seconds"] == approx(768 * PREFILL_SECONDS_PER_TOKEN)  # served by pod-b
    assert len(rows(fx, "miss_requests", limit=3)) == 3
    assert len(rows(fx, "miss_requests")) == 16
    assert {x["sub_cause"] for x in rows(fx, "miss_requests", sub_cause="tools_reordered")} == {
        "tools_reordered"
    }


def test_miss_requests_gpu_seconds_need_a_measurement(fx: Store) -> None:
    """Before pod-a's second scrape no pod measured its prefill time: the cost is unknown (NULL), not 0."""
    r = rows(fx, "miss_requests", until=f"{DAY} 12:01:00.000")
    assert [(x["request_id"], x["missed_tokens"], x["gpu_seconds"]) for x in r] == [
        ("cap-1-cold", 736, None), ("cap-2-warm", 26, None), ("cap-1-cold", 26, None)]


def segments(r: list[dict[str, Any]], *keys: str) -> dict[str, tuple[Any, ...]]:
    return {x["segment"]: tuple(x[k] for k in keys) for x in r}


def test_request_detail(fx: Store) -> None:
    """cap-4-timestamp-first (globex, pod-a, 784 prompt / 0 cached, suffix 16): system sys-globex-ts, 784 - 16 =
    768 tokens; tools tools-globex, 40. Its predecessor, the previous step of run-globex-1, is
    cap-3-tools-reordered (12:01:00, pod-a): system sys-globex (736 = 764 - 28), same normalized hash; tools
    tools-globex-reordered, same canonical hash. So the first segment whose hash differs is system, and its
    variant matched (volatile_system, as attributed). Segment ends: cumulative counts 768, 808, 808, 808, 824
    scaled by 784 / 824 and floored: 730, 768, 768, 768, 784; all of [0, 784) missed."""
    r = rows(fx, "request_detail", request_id="cap-4-timestamp-first")
    assert [x["segment"] for x in r] == ["system", "tools", "retrieval", "history", "suffix"]
    assert [x["segment_index"] for x in r] == [1, 2, 3, 4, 5]
    head = r[0]
    assert {k: head[k] for k in ("request_id", "tenant_id", "pod", "prompt_tokens", "cached_tokens", "block_size",
                                 "predecessor_request_id", "predecessor_pod", "predecessor_kind", "gap_ms",
                                 "changed_segment")} == {
        "request_id": "cap-4-timestamp-first", "tenant_id": "globex", "pod": "pod-a", "prompt_tokens": 784,
        "cached_tokens": 0, "block_size": 32, "predecessor_request_id": "cap-3-tools-reordered",
        "predecessor_pod": "pod-a", "predecessor_kind": "previous_turn", "gap_ms": 1500.0, "changed_segment": "system",
    }  # fmt: skip
    assert head["predecessor_ts"] == at(60)
    assert (head["causes"], head["sub_causes"], head["cause_missed_tokens"]) == (
        ["prefix_drift", "unavoidable"], ["volatile_system", ""], [768, 16])
    assert (head["kv_events"], head["kv_blocks_removed"]) == (0, 0)  # the fixture has no KV events
    assert segments(r, "segment_tokens", "predecessor_segment_tokens", "hash_matched", "variant_matched",
                    "segment_missed_tokens") == {
        "system": (768, 736, 0, 1, 730),
        "tools": (40, 40, 0, 1, 38),
        "retrieval": (0, 0, 1, None, 0),  # empty on both sides: equal
        "history": (0, 0, 1, None, 0),
        "suffix": (16, 28, 0, None, 16),
    }
    assert all(set(x) == set(head) for x in r) and {x["request_id"] for x in r} == {"cap-4-timestamp-first"}
    # cost: 768 and 16 missed tokens on pod-a at its measured rate; 784 in all
    assert head["cause_gpu_seconds"] == [approx(768 * PREFILL_SECONDS_PER_TOKEN),
                                         approx(16 * PREFILL_SECONDS_PER_TOKEN)]
    assert head["gpu_seconds"] == approx(784 * PREFILL_SECONDS_PER_TOKEN)
    # which line changed (fixture STRUCTURE): globex's 4 system lines, the first (the timestamp) differs, 52
    # tokens here, new (not elsewhere in the predecessor's); no chunks logged for either message
    assert segments(r, "segment_parts", "predecessor_segment_parts", "changed_parts", "changed_part_tokens",
                    "changed_part_moved") == {
        "system": (4, 4, [1], [52], [0]),
        "tools": (0, 0, [], [], []), "retrieval": (0, 0, [], [], []), "history": (0, 0, [], [], []),
        "suffix": (0, 0, [], [], []),
    }


def test_request_detail_changed_chunks(fx: Store) -> None:
    """acme-c1-t4's message (fixture STRUCTURE) is chunks doc-y 24, doc-x 20, question-4 20; its predecessor
    acme-c1-t3's was doc-x 20, question-3 12. Position by position all three differ (the third lies past the
    predecessor's last); doc-x was the predecessor's first chunk (moved), doc-y and question-4 are new. Cost: 64
    missed tokens on pod-b, which measured no prefill time: the fleet's rate (pod-a's)."""
    r = rows(fx, "request_detail", request_id="acme-c1-t4")
    assert segments(r, "segment_parts", "predecessor_segment_parts", "changed_parts", "changed_part_tokens",
                    "changed_part_moved")["suffix"] == (3, 2, [1, 2, 3], [24, 20, 20], [0, 1, 0])
    assert {x["segment"] for x in r if x["changed_parts"]} == {"suffix"}
    assert r[0]["gpu_seconds"] == approx(64 * PREFILL_SECONDS_PER_TOKEN)
    # the predecessor acme-c1-t3's own detail: its predecessor cap-2-warm logged no chunks, so none is named
    assert [x["changed_parts"] for x in rows(fx, "request_detail", request_id="acme-c1-t3")] == [[]] * 5
    unmeasured = rows(fx, "request_detail", request_id="cap-1-cold", until=f"{DAY} 12:01:00.000")[0]
    assert (unmeasured["cause_gpu_seconds"], unmeasured["gpu_seconds"]) == ([None, None], None)


def test_request_detail_routed_away_next_turn(fx: Store) -> None:
    """acme-c1-t3 (pod-b, 800 / 0) after cap-2-warm (pod-a, 12:00:50): system equal (768 vs 736 tokens: the
    fixture counts the whole prefix as system), history hist-a-3 (60) vs none: it differs, but continues the
    predecessor's conversation (previous_turn, prev_history_hash = the predecessor's history hash). Ends: 768,
    768, 768, 828, 860 × 800 / 860 → 714, 714, 714, 770, 800."""
    r = rows(fx, "request_detail", request_id="acme-c1-t3")
    head = r[0]
    assert (head["pod"], head["predecessor_pod"], head["predecessor_ts"]) == ("pod-b", "pod-a", at(50))
    assert (head["causes"], head["cause_missed_tokens"], head["changed_segment"]) == (
        ["routed_away", "unavoidable"], [768, 32], "history")
    assert head["gap_ms"] == approx(69985.0)
    assert segments(r, "hash_matched", "variant_matched", "segment_missed_tokens") == {
        "system": (1, None, 714), "tools": (1, None, 0), "retrieval": (1, None, 0), "history": (0, 1, 56),
        "suffix": (0, None, 30),
    }


def test_request_detail_without_predecessor_and_defaults(fx: Store) -> None:
    """cap-1-cold has none (its stale answer, cold 700, is cancelled); '' picks the request that missed most in
    the window and filters: acme-c1-t3 (800) overall, cap-4-timestamp-first (784) for globex."""
    r = rows(fx, "request_detail", request_id="cap-1-cold")
    head = r[0]
    assert (head["predecessor_request_id"], head["predecessor_ts"], head["changed_segment"]) == ("", None, "")
    assert (head["causes"], head["cause_missed_tokens"]) == (["cold", "unavoidable"], [736, 26])
    assert {(x["hash_matched"], x["variant_matched"], x["predecessor_segment_tokens"]) for x in r} == {
        (None, None, None)}
    assert [x["segment_missed_tokens"] for x in r] == [736, 0, 0, 0, 26]  # 736 + 26 tokens: nothing scaled
    cross = rows(fx, "request_detail", request_id="cap-3-tools-reordered")[0]  # a fingerprint predecessor
    assert (cross["predecessor_kind"], cross["predecessor_request_id"], cross["predecessor_ts"]) == (
        "fingerprint", "cap-2-warm", at(50))  # found in another tenant (acme)
    assert rows(fx, "request_detail")[0]["request_id"] == "acme-c1-t3"
    assert rows(fx, "request_detail", tenant="globex")[0]["request_id"] == "cap-4-timestamp-first"
    assert rows(fx, "request_detail", request_id="cap-4-timestamp-first", since=at(71)) == []
    assert rows(fx, "request_detail", request_id="cap-4-timestamp-first", pod="pod-b") == []
    assert rows(fx, "request_detail", request_id="no-such-request") == []


def test_request_detail_kv_events(chdb_dir: Path) -> None:
    """KV events of the predecessor's pod (pod-a) after cap-3-tools-reordered arrived (12:01:00) up to
    cap-4-timestamp-first's arrival (12:01:10): a BlockStored of 2 blocks (sent twice: counted once) and a
    BlockRemoved of 3 (sent in two pieces, collector/kv_split.py: counted once); the ones at 12:01:00 itself,
    after 12:01:10 or on pod-b are not counted."""
    s = Store.open(data_dir=chdb_dir, database=f"nq_kv_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_fixture(s)
    cols = ["event_id", "ts", "pod", "engine", "seq", "idx", "event_type", "block_hashes", "token_count",
            "block_size", "medium", "first_pos", "continued"]
    events = [
        ("e1", at(60), "pod-a", "0", 1, 0, "BlockStored", [1], 32, 32, "GPU", 0, 0),  # with the predecessor: before
        ("e2", at(62), "pod-a", "0", 2, 0, "BlockStored", [2, 3], 64, 32, "GPU", 0, 0),
        ("e3", at(65), "pod-a", "0", 3, 0, "BlockRemoved", [4, 5], 0, 32, "GPU", 0, 0),
        ("e3b", at(65), "pod-a", "0", 3, 0, "BlockRemoved", [6], 0, 32, "GPU", 2, 1),
        ("e4", at(66), "pod-b", "0", 1, 0, "AllBlocksCleared", [], 0, 32, "", 0, 0),
        ("e5", at(75), "pod-a", "0", 4, 0, "AllBlocksCleared", [], 0, 32, "", 0, 0),
    ]
    s.insert("kv_block_events", events, cols)
    s.insert("kv_block_events", [events[1]], cols)  # a re-sent batch
    head = rows(s, "request_detail", request_id="cap-4-timestamp-first")[0]
    assert (head["kv_events"], head["kv_blocks_stored"], head["kv_blocks_removed"], head["kv_caches_cleared"]) == (
        2, 2, 3, 0)
    later = rows(s, "request_detail", request_id="globex-run1-s3")[0]  # after cap-4 (12:01:10) up to 12:02:20
    assert (later["kv_events"], later["kv_caches_cleared"]) == (1, 1)


# -- tenants -------------------------------------------------------------------------------------------------
def test_tenant_affinity(fx: Store) -> None:
    r = by(rows(fx, "tenant_affinity"), "tenant_id")
    # acme: cap-2 (pred cap-1 on pod-a, same pod), acme-c1-t3 (pred cap-2 on pod-a, served by pod-b),
    # acme-c1-t4 (pred acme-c1-t3 on pod-b, same pod).
    acme = r["acme"]
    assert (acme["requests_with_predecessor"], acme["predecessor_tokens"], acme["same_pod_tokens"]) == (
        3,
        762 + 800 + 832,
        762 + 832,
    )
    assert acme["tenant_cache_affinity"] == approx(1594 / 2394)
    assert (acme["prompt_tokens"], acme["cached_tokens"], acme["requests"], acme["pods"]) == (
        3156,
        1504,
        4,
        2,
    )
    assert acme["token_weighted_hit_rate"] == approx(1504 / 3156)
    assert acme["request_weighted_hit_rate"] == approx((736 / 762 + 768 / 832) / 4)
    # globex: cap-3 is first in its agent run but the attribution names cap-2 (another tenant, pod-a).
    globex = r["globex"]
    assert (globex["requests_with_predecessor"], globex["predecessor_tokens"]) == (3, 764 + 784 + 800)
    assert globex["tenant_cache_affinity"] == approx(1.0)
    # initech: initech-c1-t2 follows t1 on pod-b; initech-oneshot-2 (no conversation) follows cap-5 by
    # prompt_fingerprint (the attribution says so), which pod-a served: 400 / (400 + 19).
    initech = r["initech"]
    assert (
        initech["requests_with_predecessor"],
        initech["predecessor_tokens"],
        initech["same_pod_tokens"],
    ) == (2, 419, 400)
    assert initech["tenant_cache_affinity"] == approx(400 / 419)
    # A pod filter keeps the requests served there, predecessors still found on every pod.
    acme_b = by(rows(fx, "tenant_affinity", pod="pod-b"), "tenant_id")["acme"]
    assert (acme_b["predecessor_tokens"], acme_b["same_pod_tokens"]) == (800 + 832, 832)
    # A window starting after the predecessors keeps their answers (the attribution named them).
    late = by(rows(fx, "tenant_affinity", since=f"{DAY} 12:02:00"), "tenant_id")
    assert late["acme"]["requests_with_predecessor"] == 2 and late["initech"]["same_pod_tokens"] == 0


def test_tenant_pod_matrix(fx: Store) -> None:
    r = {
        (x["tenant_id"], x["pod"]): (x["prefix_tokens"], x["requests"]) for x in rows(fx, "tenant_pod_matrix")
    }
    # prefix tokens = prompt - suffix: cap-1/2 736 each; t3 800-32, t4 832-64; globex 736 + 768 + 768;
    # cap-5 19-19; initech t1 400-16, t2 400-112, oneshot 19-19.
    assert r == {
        ("acme", "pod-a"): (1472, 2),
        ("acme", "pod-b"): (1536, 2),
        ("globex", "pod-a"): (2272, 3),
        ("initech", "pod-a"): (0, 1),
        ("initech", "pod-b"): (672, 3),
    }


# -- fingerprints --------------------------------------------------------------------------------------------
def test_fingerprint_cardinality(fx: Store) -> None:
    r = by(rows(fx, "fingerprint_cardinality"), "bucket", "tenant_id")
    assert r[(at(0), "acme")]["prompt_fingerprint_cardinality"] == 1  # cap-1 and cap-2 share their prefix
    g = r[(at(60), "globex")]  # cap-3 (tools reordered) and cap-4 (timestamp in the system prompt)
    assert (
        g["prompt_fingerprint_cardinality"],
        g["system_hash_cardinality"],
        g["system_norm_hash_cardinality"],
        g["tools_hash_cardinality"],
        g["tools_canonical_hash_cardinality"],
    ) == (2, 2, 1, 2, 1)
    i = r[(at(60), "initech")]  # RAG documents reordered between t1 and t2; cap-5 has no segments
    assert (
        i["requests"],
        i["prompt_fingerprint_cardinality"],
        i["system_hash_cardinality"],
        i["retrieval_pack_hash_cardinality"],
        i["retrieval_set_hash_cardinality"],
    ) == (3, 3, 1, 2, 1)
    assert r[(at(120), "acme")]["requests"] == 3  # every logged request, the 400 one included
    pooled = rows(fx, "fingerprint_cardinality", by_tenant=0, bucket_seconds=3600)
    assert len(pooled) == 1
    assert (
        pooled[0]["tenant_id"],
        pooled[0]["requests"],
        pooled[0]["prompt_fingerprint_cardinality"],
        pooled[0]["system_hash_cardinality"],
        pooled[0]["system_norm_hash_cardinality"],
    ) == ("", 12, 10, 4, 3)


# -- latency, tokens, pods, dead letters ---------------------------------------------------------------------
def test_latency(fx: Store) -> None:
    r = by(rows(fx, "latency"), "bucket", "source", "metric")
    # Gateway, t-digest over the rollup (a small set keeps every value: nearest rank): 12:01 TTFTs 12, 22, 30, 40,
    # 50 ms.
    g = r[(at(60), "gateway", "ttft_ms")]
    assert (g["p50_ms"], g["p95_ms"], g["p99_ms"], g["samples"]) == (approx(30), approx(50), approx(50), 5)
    # queue_wait_ms where vLLM reported it (initech-c1-t1 did not): 0.2, 0.3, 0.5, 0.8 (t-digest keeps float32).
    q = r[(at(60), "gateway", "queue_wait_ms")]
    assert (round(q["p50_ms"], 6), q["samples"]) == (0.3, 4)
    assert r[(at(120), "gateway", "ttft_ms")]["samples"] == 4  # the 400 response is not served
    # vLLM, histogram_quantile over the real capture's TTFT deltas (5 requests): le 0.02 +2, 0.04 +1, 0.06 +1,
    # 0.08 +1. p50: rank 2.5 in (0.02, 0.04] holding 1 → 0.02 + 0.02 × 0.5 = 30 ms; p95: rank 4.75 in
    # (0.06, 0.08] → 75 ms; p99: 4.95 → 79 ms.
    v = r[(at(60), "vllm", "ttft_ms")]
    assert (v["p50_ms"], v["p95_ms"], v["p99_ms"], v["samples"]) == (approx(30), approx(75), approx(79), 5)
    # Queue time: all 5 in (0, 0.3] → 0.3 × q.
    vq = r[(at(60), "vllm", "queue_wait_ms")]
    assert (vq["p50_ms"], vq["p95_ms"], vq["p99_ms"]) == (approx(150), approx(285), approx(297))
    assert not [k for k in r if k[1] == "vllm" and k[0] != at(60)]  # pod-a's histograms: two scrapes only
    assert {k[1] for k in by(rows(fx, "latency", tenant="acme"), "bucket", "source", "metric")} == {"gateway"}


def test_histogram_quantile_edges(chdb_dir: Path) -> None:
    """A rank in the +Inf bucket returns the highest finite bound (bucket increases as the collector sends
    them; after a restart the increases are the new counts)."""
    s = Store.open(data_dir=chdb_dir, database=f"nq_hist_{uuid.uuid4().hex[:12]}")
    s.migrate()
    rows_ = []
    for t, increases in ((60, (1, 3, 5)), (120, (1, 1, 1))):  # 12:01: +1, +3, +5 (cumulative per le); 12:02: restart
        for le, n in zip(("0.5", "1.0", "+Inf"), increases, strict=True):
            rows_.append((at(t), "p", "0", "tiny", "vllm:time_to_first_token_seconds_bucket", le, 0.0, float(n)))
    s.insert("vllm_metrics", rows_, ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"])
    r = by(rows(s, "latency", bucket_seconds=60), "bucket")
    first = r[at(60)]  # p50 rank 2.5 in (0.5, 1.0] holding 2 → 0.875 s
    assert first["p50_ms"] == approx(875.0)
    assert first["p99_ms"] == approx(1000.0)  # rank 4.95 falls in +Inf → highest finite bound
    assert first["samples"] == 5
    restart = r[at(120)]  # 1, 1, 1 → everything ≤ 0.5 s
    assert restart["p50_ms"] == approx(250.0) and restart["samples"] == 1


def test_tokens(fx: Store) -> None:
    r = by(rows(fx, "tokens"), "bucket", "source")
    g = r[(at(60), "gateway")]
    assert (
        g["requests"],
        g["prompt_tokens"],
        g["cached_tokens"],
        g["prefill_computed_tokens"],
        g["decode_tokens"],
    ) == (5, 2367, 960, 1407, 40)
    # vLLM 12:01: prompt 3091 (pod-a) + 800 (pod-b after its reset); generation 40 + 16.
    v = r[(at(60), "vllm")]
    assert (v["prompt_tokens"], v["decode_tokens"], v["cached_tokens"], v["requests"]) == (
        3891,
        56,
        None,
        None,
    )
    assert (r[(at(120), "vllm")]["prompt_tokens"], r[(at(120), "vllm")]["decode_tokens"]) == (2451, 56)
    assert (at(0), "vllm") not in r


def test_pods(fx: Store) -> None:
    r = by(rows(fx, "pods"), "pod")
    a, b = r["pod-a"], r["pod-b"]
    assert (a["requests"], a["errors"], a["prompt_tokens"], a["cached_tokens"]) == (6, 1, 3891, 2176)
    assert (a["vllm_hit_tokens"], a["vllm_query_tokens"]) == (2176, 3891)
    assert a["vllm_token_weighted_hit_rate"] == approx(2176 / 3891)
    assert (b["requests"], b["prompt_tokens"], b["cached_tokens"], b["vllm_query_tokens"]) == (
        5,
        2451,
        1056,
        2451,
    )
    assert (a["kv_cache_usage"], b["kv_cache_usage"]) == (approx(0.25), approx(0.1))  # latest samples
    assert (a["block_size"], a["enable_prefix_caching"], a["prefix_caching_hash_algo"], a["engines"]) == (
        32,
        "True",
        "sha256",
        1,
    )
    assert a["bytes_per_token"] == approx(1073741824 / 1048576)
    assert a["last_scrape_ts"] == at(150)
    only = rows(fx, "pods", tenant="globex")
    assert [(x["pod"], x["requests"], x["vllm_hit_tokens"]) for x in only] == [("pod-a", 3, None)]


def test_dead_letters(fx: Store) -> None:
    r = by(rows(fx, "dead_letters"), "source", "reason")
    m = r[("vllm_metrics", "malformed exposition line")]
    assert (m["occurrences"], m["distinct_events"], m["first_ts"], m["last_ts"], m["latest_pod"]) == (
        2,
        2,
        at(60),
        at(120),
        "pod-a",
    )
    assert m["latest_raw"].endswith("123")
    assert r[("gateway_log", "missing required field request_id")]["occurrences"] == 1
    assert rows(fx, "dead_letters")[0]["source"] == "vllm_metrics"  # latest first
    assert [x["source"] for x in rows(fx, "dead_letters", pod="pod-a")] == ["vllm_metrics"]


def test_dimensions_and_extent(fx: Store) -> None:
    assert [(x["kind"], x["value"], x["requests"]) for x in rows(fx, "dimensions")] == [
        ("tenant", "acme", 5),
        ("tenant", "globex", 3),
        ("tenant", "initech", 4),
        ("pod", "pod-a", 7),
        ("pod", "pod-b", 5),
        ("model", "tiny", 12),  # the gateway's model and vLLM's model_name label, once
    ]
    ext = by(rows(fx, "data_extent"), "table")
    assert ext["gateway_requests"]["rows"] == 12  # the duplicate line dropped at load, as the ingester does
    assert ext["request_attribution"]["rows"] == 11  # one current answer per request (the stale one cancelled)
    assert (ext["vllm_metrics"]["first_ts"], ext["vllm_metrics"]["last_ts"]) == (
        at(30),
        at(150),
    )
    assert ext["kv_block_events"]["rows"] == 0 and ext["kv_block_events"]["first_ts"] is None
    assert isinstance(ext["gateway_requests"]["first_ts"], datetime)


def test_real_capture_through_the_collector(chdb_dir: Path) -> None:
    """The two real /metrics captures (tests/samples), scraped in turn by the collector (which computes the
    counter increases) and mapped by ingest as in production, give the capture's numbers: Δ 1,408 hit of
    3,091 queried (README of the samples)."""
    from collector.vllm_metrics import ScrapeState, scrape_events
    from ingest.rows import COLUMNS, rows_for

    s = Store.open(data_dir=chdb_dir, database=f"nq_real_{uuid.uuid4().hex[:12]}")
    s.migrate()
    samples = Path(__file__).parent / "samples"
    t0 = int(at(0).timestamp() * 1000)
    state = ScrapeState()
    for i, name in enumerate(("vllm_0.32.0_cpu_real_metrics_1.txt", "vllm_0.32.0_cpu_real_metrics_2.txt")):
        body = (samples / name).read_text()
        for ev in scrape_events("pod-a", "http://pod-a:8000/metrics", body, t0 + i * 60_000, 5.0, state):
            for table, rows_ in rows_for(ev):
                s.insert(table, rows_, COLUMNS[table])
    vllm = by(rows(s, "hit_rate_total"), "source")["vllm"]
    assert (vllm["hit_tokens"], vllm["query_tokens"]) == (1408, 3091)
    tokens = rows(s, "tokens")
    assert [(x["source"], x["prompt_tokens"], x["decode_tokens"]) for x in tokens] == [("vllm", 3091, 40)]
    ttft = by(rows(s, "latency"), "metric")["ttft_ms"]
    assert (ttft["p50_ms"], ttft["p95_ms"], ttft["p99_ms"], ttft["samples"]) == (
        approx(30),
        approx(75),
        approx(79),
        5,
    )
    pod = rows(s, "pods")[0]
    assert (pod["pod"], pod["block_size"], pod["engines"], pod["kv_cache_usage"]) == ("pod-a", 32, 1, 0.0)
    # the vLLM board: request_success{length} 12 → 17, no abort or error; e2e and inter-token as in test_vllm_latency
    (series,) = [x for x in rows(s, "vllm_series") if x["prompt_tokens_per_s"] > 0]
    assert (series["prompt_tokens_per_s"], series["generation_tokens_per_s"]) == (approx(3091 / 60), approx(40 / 60))
    assert (series["finished_requests_per_s"], series["error_rate"], series["running"]) == (approx(5 / 60), 0.0, 0.0)
    lat = by(rows(s, "vllm_latency"), "metric")
    assert (lat["e2e_ms"]["p50_ms"], lat["e2e_ms"]["samples"]) == (approx(150), 5)
    assert (lat["inter_token_ms"]["p99_ms"], lat["inter_token_ms"]["samples"]) == (approx(19.75), 35)
    assert pod["bytes_per_token"] == approx(1024.0)


# -- model filter, freshness, the vLLM board -----------------------------------------------------------------
@pytest.mark.parametrize("name", [q for q in QUERIES if "model" in {p.name for p in sqlfiles.load_query(q).params}])
def test_model_filter(fx: Store, name: str) -> None:
    """The fixture's one model keeps every row; another model keeps none (gateway `model` and vLLM `model_name`)."""
    assert rows(fx, name, model="tiny") == rows(fx, name)
    assert rows(fx, name, model="other-model") == [] or name == "data_quality"
    if name == "data_quality":  # one row per pod, whose figures are all missing
        assert all(r["gateway_requests"] in (None, 0) and r["vllm_query_tokens"] is None
                   for r in rows(fx, name, model="other-model"))


def test_freshness(fx: Store, empty: Store) -> None:
    r = by(rows(fx, "freshness"), "source", "pod")
    assert {k for k in r if k[0] == "vllm_scrape"} == {("vllm_scrape", "pod-a"), ("vllm_scrape", "pod-b")}
    assert (r[("vllm_scrape", "pod-b")]["last_ts"], r[("vllm_scrape", "pod-b")]["rows"]) == (at(150), 3)  # scrapes
    assert (r[("gateway_log", "pod-a")]["last_ts"], r[("gateway_log", "pod-a")]["rows"]) == (at(145), 7)
    assert (r[("gateway_log", "pod-b")]["last_ts"], r[("gateway_log", "pod-b")]["rows"]) == (at(135), 5)
    # answers per pod, sign-weighted (cap-1-cold's stale answer cancelled); the 400 has none: 7 + 5 logged, 11 answered
    assert sum(x["rows"] for k, x in r.items() if k[0] == "attribution") == 11
    assert r[("attribution", "pod-a")]["last_ts"] == at(300)
    assert not [k for k in r if k[0] == "kv_events"]  # none in the fixture: no row
    g = r[("gateway_log", "pod-a")]
    assert g["age_seconds"] == pytest.approx((datetime.now(UTC) - at(145)).total_seconds(), abs=30)
    late = by(rows(fx, "freshness", since=at(140)), "source", "pod")  # a window: pod-b's last line is before it
    assert ("gateway_log", "pod-b") not in late and late[("gateway_log", "pod-a")]["rows"] == 2  # 12:02:20, :25
    assert rows(empty, "freshness") == []


def test_vllm_series(fx: Store) -> None:
    r = by(rows(fx, "vllm_series"), "bucket", "pod")
    a1 = r[(at(60), "pod-a")]
    # pod-a 12:01 (scrape 12:01:30): prompt 12909 - 9818 = 3091, generation 138 - 98 = 40, over 60 s
    assert (a1["prompt_tokens_per_s"], a1["generation_tokens_per_s"]) == (approx(3091 / 60), approx(40 / 60))
    assert (a1["running"], a1["waiting"], a1["kv_cache_usage"]) == (2.0, 1.0, 0.0)
    b1 = r[(at(60), "pod-b")]  # pod-b restarted: the increase is the new value, 800 and 16
    assert (b1["prompt_tokens_per_s"], b1["generation_tokens_per_s"]) == (approx(800 / 60), approx(16 / 60))
    assert r[(at(120), "pod-a")]["kv_cache_usage"] == approx(0.25)
    assert a1["error_rate"] is None and a1["finished_requests_per_s"] == 0  # no request_success in the fixture
    hourly = by(rows(fx, "vllm_series", bucket_seconds=3600), "pod")  # one bucket: the rates over the hour
    assert hourly["pod-a"]["prompt_tokens_per_s"] == approx((3091 + 800) / 3600)
    assert hourly["pod-a"]["running"] == approx(1.0)  # mean of 0, 2, 1
    assert rows(fx, "vllm_series", tenant="acme") == []


def test_vllm_series_error_rate_and_preemptions(chdb_dir: Path) -> None:
    """Error rate = Δ request_success{abort, error} / Δ request_success (every reason); preemptions per second;
    two engines: running summed, usage averaged."""
    s = Store.open(data_dir=chdb_dir, database=f"nq_errors_{uuid.uuid4().hex[:12]}")
    s.migrate()
    inc = [("0", "vllm:request_success_total", "stop", 6.0), ("0", "vllm:request_success_total", "abort", 1.0),
           ("1", "vllm:request_success_total", "length", 2.0), ("1", "vllm:request_success_total", "error", 1.0),
           ("0", "vllm:num_preemptions_total", "", 3.0)]
    gauges = [("0", "vllm:num_requests_running", 4.0), ("1", "vllm:num_requests_running", 2.0),
              ("0", "vllm:kv_cache_usage_perc", 0.5), ("1", "vllm:kv_cache_usage_perc", 0.25)]
    s.insert("vllm_metrics", [(at(30), "p", e, "tiny", n, lab, 0.0, v) for e, n, lab, v in inc]
             + [(at(30), "p", e, "tiny", n, "", v, 0.0) for e, n, v in gauges],
             ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"])
    (row,) = rows(s, "vllm_series")
    assert row["error_rate"] == approx(2 / 10)
    assert (row["finished_requests_per_s"], row["failed_requests_per_s"]) == (approx(10 / 60), approx(2 / 60))
    assert row["preemptions_per_s"] == approx(3 / 60)
    assert (row["running"], row["kv_cache_usage"]) == (approx(6.0), approx(0.375))


def test_vllm_latency(fx: Store) -> None:
    """histogram_quantile over the real capture's deltas (pod-a, 12:01): end-to-end 5 requests all in (0, 0.3] s:
    0.3 × q; inter-token 35 gaps, 34 in (0, 10] ms and 1 in (10, 25] ms: p50 rank 17.5 → 10 × 17.5 / 34, p95
    rank 33.25 → 10 × 33.25 / 34, p99 rank 34.65 → 10 + 15 × 0.65."""
    r = by(rows(fx, "vllm_latency"), "bucket", "pod", "metric")
    e2e = r[(at(60), "pod-a", "e2e_ms")]
    assert (e2e["p50_ms"], e2e["p95_ms"], e2e["p99_ms"], e2e["samples"]) == (
        approx(150), approx(285), approx(297), 5)
    itl = r[(at(60), "pod-a", "inter_token_ms")]
    assert (itl["p50_ms"], itl["p95_ms"], itl["p99_ms"], itl["samples"]) == (
        approx(10 * 17.5 / 34), approx(10 * 33.25 / 34), approx(10 + 15 * 0.65), 35)
    assert len(r) == 2  # the histograms' only delta; pod-b has none
    pooled = by(rows(fx, "vllm_latency", by_pod=0), "pod", "metric")
    assert pooled[("", "e2e_ms")]["p50_ms"] == approx(150)
    assert rows(fx, "vllm_latency", tenant="acme") == []
