"""Ad hoc SQL (``kvscope sql``, ``kvscope query``, the dashboard's SQL page) on the real chDB store: the limits
the database enforces, read-only refusals by statement kind, every failure as one line with exit code 1, and
an ad hoc query that does not pause ingestion."""

from __future__ import annotations

import functools
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import clickhouse_connect
import pytest
from click.testing import CliRunner

import ingest.store
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
    "SYSTEM FLUSH LOGS": "SYSTEM FLUSH",
    "system drop mark cache": "SYSTEM CLEAR",  # ClickHouse renders DROP ... CACHE as its new name
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


# -- one clean line, exit 1 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("statement", "expected"), [
    ("SELEC 1", ("Syntax error: failed at position 7", "[code 62]")),
    ("SELECT * FROM nope", ("Unknown table expression identifier 'nope'", "[code 60]")),
    ("SELECT 1; SELECT 2", ("Multi-statements are not allowed",)),
    ("SYSTEM FLUSH LOGS", ("read-only: SYSTEM FLUSH is refused",)),
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
