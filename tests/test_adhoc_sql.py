"""Ad hoc SQL (``kvscope sql``, ``kvscope query``, the dashboard's SQL page) on the real chDB store: the limits
the database enforces, read-only refusals by statement kind, every failure as one line with exit code 1, and
an ad hoc query that does not pause ingestion."""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import clickhouse_connect
import pytest
from click.testing import CliRunner

import ingest.store
from ingest.adhoc import ADHOC_MAX_ROWS, check_sources
from ingest.errors import QueryError
from ingest.store import Store
from kvscope.cli import main

LONG = "SELECT count() FROM numbers(1000000000000)"  # runs until its time limit, or until killed


@pytest.fixture(scope="module")
def store(chdb_dir: Path) -> Store:
    """One migrated database for the module, holding one dead letter ``kept`` (the refusals must keep it)."""
    s = Store.open(data_dir=chdb_dir, database=f"t_{uuid.uuid4().hex[:12]}")
    s.migrate()
    s.insert("dead_letters", [("kept", "test", datetime.now(UTC))], ["event_id", "source", "ts"])
    return s


def cli(store: Store, *args: str) -> tuple[int, str, str]:
    """``kvscope <args>`` in this process on ``store``'s chDB directory and database: (exit code, stdout, stderr).
    An exception that escaped click (a traceback for a user) is re-raised."""
    data_dir = store.dsn.removeprefix("chdb://")
    result = CliRunner().invoke(main, [*args, "--data-dir", data_dir, "--database", store.database])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, stderr: str, *expected: str) -> None:
    assert code == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert "FORMAT Arrow" not in lines[0] and "formatQuerySingleLine" not in lines[0]


# -- limits ----------------------------------------------------------------------------------------------------
def test_memory_cap_fails_cleanly(store: Store, chdb_dir: Path) -> None:
    # groupArray of 10^7 UInt64 holds 8 * 10^7 bytes (80 MB) in memory: fine under the default cap (2 GiB),
    # over a 10 MiB one
    query = "SELECT length(groupArray(number)) AS n FROM numbers(10000000)"
    assert store.adhoc(query)["n"].to_list() == [10_000_000]
    low = Store.open(data_dir=chdb_dir, database=store.database, adhoc_max_memory_bytes=10 << 20)
    with pytest.raises(QueryError, match="memory limit") as err:
        low.adhoc(query)
    assert "\n" not in str(err.value) and "max_memory_usage" in str(err.value)
    assert low.adhoc("SELECT 1 + 1 AS two")["two"].to_list() == [2]  # the session is usable again
    assert store.query_rows("SELECT 2 + 2")[0][0] == 4  # and the writer's session untouched


def test_result_rows_and_bytes_caps(store: Store) -> None:
    from ingest.adhoc import ADHOC_MAX_ROWS

    # the row cap cuts the outer result only: a subquery keeps its 20,000 rows
    assert store.adhoc("SELECT number FROM numbers(20000) ORDER BY number")["number"].to_list() == list(
        range(ADHOC_MAX_ROWS))
    assert store.adhoc("SELECT count() AS n FROM (SELECT number FROM numbers(20000))")["n"].to_list() == [20_000]
    # 9,000 rows of >= 10,000 bytes: > 90 MB, over the 64 MiB result cap
    with pytest.raises(QueryError, match="Limit for result exceeded, max bytes: 64.00 MiB"):
        store.adhoc("SELECT toString(number) || repeat('x', 10000 + number % 3) AS s FROM numbers(9000)")


def test_repeated_column_names_are_made_unique(store: Store) -> None:
    df = store.adhoc("SELECT 1, 1, 2 AS `1_2`")
    assert df.columns == ["1", "1_3", "1_2"] and df.row(0) == (1, 1, 2)


# -- read-only by statement kind --------------------------------------------------------------------------------
REFUSED = {
    "KILL QUERY WHERE 1": "KILL QUERY",
    "/* comment */ kill query where query_id = 'x' SYNC": "KILL QUERY",
    "SYSTEM FLUSH LOGS": "SYSTEM FLUSH LOGS",
    # named as the user wrote them, not as ClickHouse renders them (SYSTEM CLEAR ... CACHE, BEGIN TRANSACTION,
    # TRUNCATE TABLE)
    "system drop mark cache": "SYSTEM DROP MARK CACHE",
    "SYSTEM DROP DNS CACHE": "SYSTEM DROP DNS CACHE",
    "START TRANSACTION": "START TRANSACTION",
    "TRUNCATE dead_letters": "TRUNCATE",
    "GRANT SELECT ON *.* TO default": "GRANT",
    "CREATE OR REPLACE TABLE y (a Int8) ENGINE = Memory": "CREATE OR REPLACE TABLE",
    "DELETE FROM dead_letters WHERE 1": "DELETE FROM",
    "SET max_memory_usage = 0": "SET",
    "INSERT INTO dead_letters (event_id) VALUES ('x')": "INSERT INTO",
    "ALTER TABLE dead_letters DELETE WHERE 1": "ALTER TABLE",
    "DROP TABLE dead_letters": "DROP TABLE",
    "OPTIMIZE TABLE dead_letters FINAL": "OPTIMIZE TABLE",
    "CREATE TABLE y (a Int8) ENGINE = Memory": "CREATE TABLE",
    "-- a comment\nTRUNCATE TABLE dead_letters;": "TRUNCATE TABLE",
}


@pytest.mark.parametrize("statement", list(REFUSED))
def test_writes_and_admin_statements_are_refused_as_read_only(store: Store, statement: str) -> None:
    with pytest.raises(QueryError) as err:
        store.adhoc(statement)
    assert str(err.value).startswith(f"read-only: {REFUSED[statement]} is refused")
    assert store.query_rows("SELECT count() FROM dead_letters WHERE event_id = 'kept'")[0][0] == 1


def test_into_outfile_is_refused(store: Store, tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    with pytest.raises(QueryError, match="^read-only: INTO OUTFILE"):
        store.adhoc(f"SELECT 1 INTO OUTFILE '{target}'")
    assert not target.exists()


def test_database_readonly_alone_lets_kill_query_through(store: Store) -> None:
    """Why the statement check is needed: a ClickHouse session with ``readonly=1`` may kill its own user's
    queries, and on chDB every session (the ingester's too) is user ``default``: it kills another session's
    query."""
    other = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    readonly = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    readonly.command("SET readonly = 1")
    outcome: list[str] = []

    def run() -> None:
        try:
            other.query(LONG, settings={"max_execution_time": 30})
        except Exception as exc:  # noqa: BLE001  (the outcome is the assertion)
            outcome.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive() and not readonly.command(
            f"SELECT count() FROM system.processes WHERE query LIKE '{LONG}%'"):
        time.sleep(0.02)
    readonly.command(f"KILL QUERY WHERE query LIKE '{LONG}%' SYNC")
    thread.join()
    assert len(outcome) == 1 and "QUERY_WAS_CANCELLED" in outcome[0], outcome
    other.close()
    readonly.close()


@pytest.mark.parametrize("statement", [
    "SELECT 1 AS one", "-- c\nWITH 1 AS one SELECT one; ", "(SELECT 1 AS one)", "SELECT 'KILL QUERY' AS one",
    "SHOW TABLES", "DESC dead_letters", "EXISTS TABLE dead_letters", "EXPLAIN SYNTAX SELECT 1",
])
def test_reads_run(store: Store, statement: str) -> None:
    assert store.adhoc(statement).height >= 1


# -- nothing outside the database: table functions, files, URLs ---------------------------------------------------
@pytest.fixture()
def web() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on 127.0.0.1 serving a CSV: (its URL, the paths it was asked for, in order)."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"a,b\n1,2\n")

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    thread.join()


URL_READS = [
    "DESCRIBE {url}", "DESC TABLE {url}", "SELECT * FROM {url}", "EXPLAIN PLAN SELECT * FROM {url}",
    "EXPLAIN PIPELINE SELECT * FROM {url}", "EXPLAIN ESTIMATE SELECT * FROM {url}",
    "EXPLAIN QUERY TREE SELECT * FROM {url}", "EXPLAIN SYNTAX SELECT * FROM {url}",
    "DESCRIBE (SELECT * FROM {url})", "SELECT * FROM view(SELECT * FROM {url})",
    "WITH t AS (SELECT * FROM {url}) SELECT * FROM t", "SELECT 1 IN (SELECT a FROM {url})",
    "SELECT * FROM (EXPLAIN SELECT * FROM {url})", "SELECT * FROM dead_letters, {url}",
]


@pytest.mark.parametrize("template", URL_READS)
def test_url_table_function_is_refused_without_a_request(store: Store, web: tuple[str, list[str]],
                                                         template: str) -> None:
    """DESCRIBE url(...) inferred the CSV's schema with a real GET (readonly checks SELECT, not DESCRIBE): every
    statement naming url() is refused before ClickHouse runs it, and the server is asked nothing."""
    base, asked = web
    with urllib.request.urlopen(f"{base}/control.csv") as answer:  # the server answers: it would see a request
        assert answer.read() == b"a,b\n1,2\n"
    assert asked == ["/control.csv"]
    with pytest.raises(QueryError) as err:
        store.adhoc(template.format(url=f"url('{base}/x.csv', 'CSVWithNames')"))
    assert str(err.value).startswith("read-only: ") and "\n" not in str(err.value)
    assert asked == ["/control.csv"]


@pytest.mark.parametrize("template", [
    "DESCRIBE {file}", "DESCRIBE TABLE {file}", "SELECT * FROM {file}", "EXPLAIN SELECT * FROM {file}",
    "SELECT {path}", "SELECT `file`({path})", "SELECT length({path}) AS n",
])
def test_server_files_are_refused(store: Store, tmp_path: Path, template: str) -> None:
    """DESCRIBE file('<path>', 'TSVWithNames') returned a file's first line as a column name, and file(path) a
    whole file: refused, and the file's text appears nowhere in the message."""
    secret = tmp_path / "secret.tsv"
    secret.write_text("first-line-secret\tsecond\nrest\tof it\n")
    path = f"'{secret}'"
    statement = template.format(file=f"file({path}, 'TSVWithNames')", path=f"file({path})")
    with pytest.raises(QueryError) as err:
        store.adhoc(statement)
    assert str(err.value).startswith("read-only: ") and "secret" not in str(err.value).replace(str(secret), "")


@pytest.mark.parametrize(("statement", "reason"), [
    ("DESCRIBE s3('http://127.0.0.1:1/b/x.csv', 'CSV')", "DESCRIBE takes a table name only"),
    ("DESCRIBE (SELECT 1)", "DESCRIBE takes a table name only"),
    ("DESCRIBE input('a String')", "DESCRIBE takes a table name only"),
    ("DESCRIBE format(CSV, '1,2')", "DESCRIBE takes a table name only"),
    ("SELECT * FROM remote('127.0.0.1:1', system.one)", "table function remote() is refused"),
    ("SELECT * FROM executable('x.sh', 'TSV', 'a String')", "table function executable() is refused"),
    ("SELECT * FROM python('store')", "table function python() is refused"),
    ("SELECT * FROM mysql('127.0.0.1:1', 'd', 't', 'u', 'p')", "table function mysql() is refused"),
])
def test_table_functions_outside_the_database_are_refused(store: Store, statement: str, reason: str) -> None:
    with pytest.raises(QueryError, match=f"^read-only: {re.escape(reason)}"):
        store.adhoc(statement)


def test_describe_of_a_table_and_readonly_table_functions_run(store: Store) -> None:
    described = store.adhoc("DESCRIBE TABLE gateway_requests")
    assert ("ts", "DateTime64(3, 'UTC')") in described.select("name", "type").rows()
    assert store.adhoc(f"DESC {store.database}.dead_letters").height >= 3
    assert store.adhoc("SELECT sum(number) AS s FROM numbers(10)")["s"].to_list() == [45]
    # text that only looks like a table function or file() is a literal and an alias
    df = store.adhoc("SELECT 'FROM file(\\'/etc/passwd\\')\n TableExpression\n  Function url' AS `Function file`")
    assert df.columns == ["Function file"] and df["Function file"][0].startswith("FROM file(")


def test_a_syntax_tree_cut_by_the_row_limit_is_refused(store: Store) -> None:
    """EXPLAIN AST answers under the ad hoc result limits too: a tree longer than ADHOC_MAX_ROWS cannot be read
    whole, and what follows (here a file() after 10,000 literals) would go unchecked: the statement is refused."""
    statement = f"SELECT tuple({', '.join(['1'] * ADHOC_MAX_ROWS)}) AS t, file('/etc/hostname') AS f"
    with pytest.raises(QueryError, match="^read-only: the statement is too large to check"):
        store.adhoc(statement)


def test_check_sources_reads_the_tree() -> None:
    """The rule on ClickHouse's EXPLAIN AST lines: the first child of a TableExpression is what it reads."""
    tree = ["SelectWithUnionQuery (children 1)", " TableExpression (children 1)", "  Function numbers (children 1)",
            " Function file (children 1)"]
    check_sources(tree[:3], {"numbers"})
    with pytest.raises(QueryError, match="table function numbers"):
        check_sources(tree[:3], set())
    with pytest.raises(QueryError, match=r"file\(\) is refused"):
        check_sources(tree, {"numbers"})
    check_sources(["SelectWithUnionQuery", " Literal 'Function file'", " Identifier Function file"], set())


# -- DateTime prints as a datetime ---------------------------------------------------------------------------------
def test_datetime_columns_come_back_as_datetimes(store: Store) -> None:
    """Arrow carries DateTime as uint32 seconds: now() printed as 1,796,183,180. Every DateTime (Nullable,
    LowCardinality, in an Array, with a zone) is a datetime again; a UInt32 stays a number."""
    at = "toDateTime('2026-11-29 12:00:05', 'UTC')"
    df = store.adhoc(
        f"SELECT {at} AS a, toStartOfInterval({at}, INTERVAL 1 HOUR) AS h, toNullable({at}) AS n, "
        f"toLowCardinality({at}) AS lc, [{at}] AS arr, toTimeZone({at}, 'Asia/Tokyo') AS tokyo, "
        f"toUInt32({at}) AS u, toDateTime64({at}, 3, 'UTC') AS d64"
    )
    expected = datetime(2026, 11, 29, 12, 0, 5, tzinfo=UTC)
    row = df.row(0, named=True)
    assert row["a"] == row["n"] == row["lc"] == row["arr"][0] == row["tokyo"] == row["d64"] == expected
    assert row["h"] == datetime(2026, 11, 29, 12, tzinfo=UTC)
    assert str(df.schema["a"]) == "Datetime(time_unit='ms', time_zone='UTC')"
    assert str(df.schema["tokyo"]) == "Datetime(time_unit='ms', time_zone='Asia/Tokyo')"
    assert row["u"] == 1_795_953_605


def test_nested_datetimes_come_back_as_datetimes(store: Store) -> None:
    """A DateTime inside a Tuple (named or not), a Map (key or value) or an Array of them printed as an integer:
    each is a datetime in its own zone, and the uint32 and Date beside it keep their types."""
    at = "toDateTime('2026-11-29 12:00:05', 'UTC')"
    df = store.adhoc(
        f"SELECT tuple({at}, toUInt32(7)) AS t, "
        f"CAST(({at}, 'x'), 'Tuple(at DateTime(\\'Asia/Tokyo\\'), `s s` String)') AS named, "
        f"map('k', {at}) AS m, map({at}, toUInt32(1)) AS mk, [tuple({at}, toNullable({at}), toDate({at}))] AS at, "
        f"[[{at}]] AS aa, map('k', [{at}]) AS ma, tuple(toUInt32(5)) AS u, "
        f"CAST(('a,(b', {at}), 'Tuple(e Enum8(\\'a,(b\\' = 1), at DateTime(\\'UTC\\'))') AS e"  # quoted , and (
    )
    expected = datetime(2026, 11, 29, 12, 0, 5, tzinfo=UTC)
    row = df.row(0, named=True)
    assert row["t"] == {"1": expected, "2": 7}
    assert row["named"] == {"at": expected, "s s": "x"}
    assert str(df.schema["named"]) == ("Struct({'at': Datetime(time_unit='ms', time_zone='Asia/Tokyo'), "
                                       "'s s': String})")
    assert row["m"] == {"k": expected} and row["mk"] == {expected: 1}
    assert row["at"] == [{"1": expected, "2": expected, "3": expected.date()}]
    assert row["aa"] == [[expected]] and row["ma"] == {"k": [expected]}
    assert row["u"] == {"1": 5} and str(df.schema["u"]) == "Struct({'1': UInt32})"
    assert row["e"]["at"] == expected


AT = "2026-11-29T12:00:05+00:00"


@pytest.mark.parametrize(("fmt", "expected"), [
    ("json", f'[{{"t":{{"1":"{AT}","2":1}},"mk":{{"{AT}":[1]}},"m":{{"1":2}}}}]\n'),
    ("csv", f't,mk,m\n"{{""1"": ""{AT}"", ""2"": 1}}","{{""{AT}"": [1]}}","{{""1"": 2}}"\n'),
    ("markdown", f'| t | mk | m |\n|---|---|---|\n| {{"1": "{AT}", "2": 1}} | {{"{AT}": \\[1\\]}} | {{"1": 2}} |\n'),
])
def test_sql_prints_nested_datetimes(store: Store, fmt: str, expected: str) -> None:
    """Tuple(DateTime, UInt8) printed {"1": 1795953605, ...}; a Map with a DateTime or integer key failed in JSON
    with a traceback (polars writes String keys only): keys are text, as in the other formats."""
    at = "toDateTime('2026-11-29 12:00:05', 'UTC')"
    code, out, _ = cli(store, "sql", f"SELECT tuple({at}, 1) AS t, map({at}, [1]) AS mk, map(1, 2) AS m",
                       "--format", fmt)
    assert code == 0 and out == expected


@pytest.mark.parametrize(("fmt", "expected"), [
    ("json", '[{"a":"2026-11-29T12:00:05+00:00","n":1}]\n'),
    ("csv", "a,n\n2026-11-29T12:00:05.000+0000,1\n"),
    ("table", "a                    n\n" + "─" * 22 + "\n2026-11-29 12:00:05  1\n"),
])
def test_sql_prints_datetimes(store: Store, fmt: str, expected: str) -> None:
    code, out, _ = cli(store, "sql", "SELECT toDateTime('2026-11-29 12:00:05', 'UTC') AS a, 1 AS n", "--format", fmt)
    assert code == 0 and out == expected


# -- one clean line, exit 1 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("statement", "expected"), [
    ("SELEC 1", ("Syntax error: failed at position 7", "[code 62]")),
    ("SELECT * FROM nope", ("Unknown table expression identifier 'nope'", "[code 60]")),
    ("SELECT 1; SELECT 2", ("Multi-statements are not allowed",)),
    ("SYSTEM FLUSH LOGS", ("read-only: SYSTEM FLUSH LOGS is refused",)),
    ("SYSTEM DROP DNS CACHE", ("read-only: SYSTEM DROP DNS CACHE is refused",)),
    ("KILL QUERY WHERE 1", ("read-only: KILL QUERY is refused",)),
    ("DELETE FROM dead_letters WHERE 1", ("read-only: DELETE FROM is refused",)),
    ("SELECT 1 FORMAT JSON", ("drop the FORMAT clause",)),
])
def test_sql_errors_are_one_line(store: Store, statement: str, expected: tuple[str, ...]) -> None:
    code, out, err = cli(store, "sql", statement)
    assert out == ""
    assert_one_line_error(code, err, *expected)


def test_sql_timeout_is_one_line(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest.store, "adhoc_settings", functools.partial(ingest.store.adhoc_settings, max_seconds=1))
    code, _, err = cli(store, "sql", LONG)
    assert_one_line_error(code, err, "Timeout exceeded", "[code 159]", "max_execution_time")


def test_sql_duplicate_names_print(store: Store) -> None:
    code, out, _ = cli(store, "sql", "SELECT 1, 1", "--format", "csv")
    assert code == 0 and out == "1,1_2\n1,1\n"


@pytest.mark.parametrize(("args", "expected"), [
    (("query", "no_such_query"), "no_such_query"),
    (("query", "hit_rate", "--param", "since=yesterday"), "since"),
    (("query", "hit_rate", "--param", "since=1764633600"),  # a Unix time: the forms it takes are named
     "parameter since: '1764633600' is not a real date and time; give YYYY-MM-DD, YYYY-MM-DD HH:MM[:SS[.fff]] or"),
    (("query", "hit_rate", "--param", "since=2026-13-01"), "parameter since: '2026-13-01' is not a real date"),
    (("query", "hit_rate", "--param", "until=2026-11-31"), "parameter until: '2026-11-31' is not a real date"),
    (("query", "hit_rate", "--param", "bucket_seconds=90"), "bucket_seconds: 90 is refused: the rollups hold whole"),
    (("query", "latency", "--param", "bucket_seconds=99999999999"), "is not a UInt32"),
])
def test_query_errors_are_one_line(store: Store, args: tuple[str, ...], expected: str) -> None:
    code, _, err = cli(store, *args)
    assert_one_line_error(code, err, expected)


# -- ad hoc queries do not pause ingestion ------------------------------------------------------------------------
def test_adhoc_query_does_not_pause_ingestion(store: Store) -> None:
    """While an ad hoc query runs (until it is killed, or its 10 s limit), the ingester's insert completes: the
    insert is done before the query ends."""
    order: list[str] = []

    def run() -> None:
        try:
            store.adhoc(LONG)
        except Exception as exc:  # noqa: BLE001  (the outcome is the assertion)
            order.append(f"query ended: {exc}")

    running = f"SELECT count() FROM system.processes WHERE query LIKE '{LONG}%'"
    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive() and not store.query_rows(running)[0][0]:
        time.sleep(0.02)
    store.insert("dead_letters", [("during-adhoc", "test", datetime.now(UTC))], ["event_id", "source", "ts"])
    order.append("insert done")
    store.command(f"KILL QUERY WHERE query LIKE '{LONG}%' SYNC")
    thread.join()
    assert order[0] == "insert done" and order[1].startswith("query ended"), order
    assert "cancelled" in order[1].lower()
    assert store.query_rows("SELECT count() FROM dead_letters WHERE event_id = 'during-adhoc'")[0][0] == 1


# -- results of every type ---------------------------------------------------------------------------------------
#: (statement, the values ClickHouse's own text shows): before, polars panicked (a BaseException the dashboard's SQL
#: page did not catch: a blank page; a traceback from `kvscope sql`) on a String cut through a character, a
#: Decimal256 and a Variant, and the enum's number, the wide integer's and the address's raw bytes were shown.
SHOWN = [
    ("SELECT substring('é', 1, 1) AS x", {"x": "\ufffd"}),
    ("SELECT toDecimal256(1, 2) AS x", {"x": "1.00"}),
    ("SELECT 1::Variant(UInt8, String) AS x", {"x": "1"}),
    ("SELECT CAST('b' AS Enum8('a' = 1, 'b' = 2)) AS x, CAST('it''s' AS Enum16('it''s' = 300)) AS y",
     {"x": "b", "y": "it's"}),
    ("SELECT toUInt128(5) AS x, toInt256(-7) AS y, toNullable(toUInt128(9)) AS z", {"x": "5", "y": "-7", "z": "9"}),
    ("SELECT toBFloat16(1.5) AS x, toIPv6('::1') AS y, toIPv4('1.2.3.4') AS z", {"x": 1.5, "y": "::1", "z": "1.2.3.4"}),
    ("SELECT toFixedString('ab', 2) AS x, [toUInt128(3), NULL] AS y", {"x": "ab", "y": ["3", None]}),
]


@pytest.mark.parametrize(("statement", "shown"), SHOWN, ids=[s for s, _ in SHOWN])
def test_every_result_type_is_shown_as_clickhouse_shows_it(store: Store, statement: str, shown: dict) -> None:
    assert store.adhoc(statement).row(0, named=True) == shown
    for fmt in ("table", "csv", "json"):
        code, out, err = cli(store, "sql", statement, "--format", fmt)
        assert code == 0 and "Traceback" not in err, (fmt, out, err)
        if fmt == "json":
            assert json.loads(out) == [shown], out


U = "61f0c404-5cb3-11e7-907b-a6006ad3dba0"


@pytest.mark.parametrize(("fmt", "expected"), [
    ("json", f'[{{"u":"{U}","us":["{U}"],"i":"PT5S","j":"{{\\"a\\":1}}"}}]\n'),
    ("csv", f'u,us,i,j\n{U},"[""{U}""]",PT5S,"{{""a"":1}}"\n'),
    ("markdown", f'| u | us | i | j |\n|---|---|---|---|\n| {U} | \\["{U}"\\] | 0:00:05 | {{"a":1}} |\n'),
])
def test_sql_prints_uuids_intervals_and_json(store: Store, fmt: str, expected: str) -> None:
    """Found by trying to break `kvscope sql`: a UUID (an Arrow ``arrow.uuid`` extension) printed as Python bytes in a
    table and crashed JSON with a traceback (a polars panic); an Interval or a JSON column crashed CSV (polars
    cannot write a duration or an extension type). A UUID is its text, an Interval ISO 8601 where JSON/CSV need
    text, a JSON value its text."""
    code, out, _ = cli(store, "sql", f"SELECT toUUID('{U}') AS u, [toUUID('{U}')] AS us, toIntervalSecond(5) AS i, "
                       """CAST('{"a":1}' AS JSON) AS j""", "--format", fmt)
    assert code == 0 and out == expected


@pytest.mark.parametrize("fmt", ["json", "csv", "table", "markdown"])
def test_sql_prints_an_aggregate_state_as_hex(store: Store, fmt: str) -> None:
    code, out, _ = cli(store, "sql", "SELECT sumState(toUInt64(3)) AS s", "--format", fmt)
    assert code == 0 and re.search(r"\b[0-9a-f]{16}\b", out) and "b'" not in out
