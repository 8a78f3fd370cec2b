"""What the store's settings and options may do to it: retention settings out of range are refused, only the
commands that write set the tables' TTLs (a read run with other settings once deleted every raw row), inserts
span any number of day partitions (ClickHouse refuses more than 100 per INSERT block by default, and a
backfill of months was refused whole, then retried forever by the ingester), and a bad --database or
--data-dir is one line, never a traceback."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import clickhouse_connect
import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner, Result

from collector.gateway_log import read_file
from collector.publish import to_messages
from ingest.bulk import load_gateway_log
from ingest.errors import QueryError, TooManyPartitions
from ingest.ingester import Ingester
from ingest.store import INSERT_SETTINGS, Store, insert_settings
from kvscope.cli import main
from kvscope.config import MAX_RETENTION_DAYS, ConfigError, build_config
from kvscope.importer import _NoSource

NOW = datetime.now(UTC).replace(microsecond=0)
DAYS = 150  # more day partitions than ClickHouse's default max_partitions_per_insert_block (100)


def line(request_id: str, ts: datetime) -> dict[str, Any]:
    return {"log_version": 1, "request_id": request_id, "ts": ts.isoformat().replace("+00:00", "Z"),
            "tenant_id": "acme", "status": 200, "prompt_tokens": 100, "cached_tokens": 64, "ttft_ms": 5.0,
            "e2e_ms": 9.0}


def one_a_day(tmp_path: Path, days: int = DAYS) -> Path:
    """A gateway log of one request a day, the last 10 days ago: ``days`` day partitions."""
    path = tmp_path / "days.jsonl"
    path.write_text("".join(json.dumps(line(f"r{i}", NOW - timedelta(days=days + 10 - i))) + "\n"
                            for i in range(days)))
    return path


def cli(store: Store, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, [*args, "--data-dir", store.dsn.removeprefix("chdb://"),
                                     "--database", store.database], env=env)


def ttl(store: Store, table: str) -> str:
    return store.query_rows("SELECT engine_full FROM system.tables WHERE database = currentDatabase() "
                            "AND name = {t:String}", {"t": table})[0][0].split(" TTL ")[1].split(" SETTINGS ")[0]


def count(store: Store, table: str) -> int:
    return store.query_rows(f"SELECT count() FROM {table}")[0][0]


# -- retention settings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variable", ["KVSCOPE_RETENTION_DAYS", "KVSCOPE_ROLLUP_RETENTION_DAYS"])
@pytest.mark.parametrize("days", ["-1", "0", str(MAX_RETENTION_DAYS + 1), "100000000"])
def test_a_retention_out_of_range_is_refused_by_name(variable: str, days: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}={days}: expected whole days from 1 to 3650"):
        build_config({}, environ={variable: days})
    for end in (1, MAX_RETENTION_DAYS):  # the range's ends are accepted
        cfg = build_config({}, environ={variable: str(end)})
        assert getattr(cfg, variable.removeprefix("KVSCOPE_").lower()) == end


def test_the_longest_retention_stays_inside_clickhouse_datetime(store: Store) -> None:
    """Why the cap: past 2106 ``toDateTime(ts) + days`` wraps around, and the TTL lies in the past."""
    (longest, wrapped), = store.query_rows(
        f"SELECT toDateTime(now(), 'UTC') + toIntervalDay({MAX_RETENTION_DAYS}), "
        "toDateTime(now(), 'UTC') + toIntervalDay(36500)")
    assert longest.replace(tzinfo=UTC) > NOW and wrapped.replace(tzinfo=UTC) < NOW


def test_a_read_with_a_bad_retention_is_one_line_and_touches_nothing(store: Store) -> None:
    result = cli(store, "query", "hit_rate_total", env={"KVSCOPE_RETENTION_DAYS": "-1"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.output.splitlines()[-1].startswith("Error: KVSCOPE_RETENTION_DAYS=-1: expected whole days")


def test_reads_never_change_the_retention_and_writers_do(store: Store, tmp_path: Path) -> None:
    """Before: ``KVSCOPE_RETENTION_DAYS=1 kvscope query ...`` set every raw TTL to a day and ClickHouse deleted
    the older rows at once, while the rollups kept counting them."""
    store.insert("gateway_requests", [("three-days-old", NOW - timedelta(days=3), "acme", 200, 100)],
                 ["request_id", "ts", "tenant_id", "status", "prompt_tokens"])
    short = {"KVSCOPE_RETENTION_DAYS": "1", "KVSCOPE_ROLLUP_RETENTION_DAYS": "1"}
    for args in (["query", "hit_rate_total"], ["sql", "SELECT count() FROM gateway_requests"],
                 ["alerts", "--once"],
                 ["digest", "--to", "a@example.com", "--dry-run", str(tmp_path / "digest.eml")]):
        result = cli(store, *args, env=short)
        assert result.exit_code == 0, (args, result.output)
    assert ttl(store, "gateway_requests") == "toDateTime(ts) + toIntervalDay(30)"
    assert ttl(store, "requests_1h") == "minute + toIntervalDay(400)"
    assert count(store, "gateway_requests") == 1
    result = cli(store, "migrate", env={"KVSCOPE_RETENTION_DAYS": "90", "KVSCOPE_ROLLUP_RETENTION_DAYS": "800"})
    assert result.exit_code == 0, result.output
    assert ttl(store, "gateway_requests") == "toDateTime(ts) + toIntervalDay(90)"
    assert ttl(store, "requests_1h") == "toDateTime(minute) + toIntervalDay(800)"
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(line("new", NOW - timedelta(hours=1))) + "\n")
    result = cli(store, "import", "gateway-log", str(path), env={"KVSCOPE_RETENTION_DAYS": "60"})
    assert result.exit_code == 0, result.output
    assert ttl(store, "gateway_requests") == "toDateTime(ts) + toIntervalDay(60)"


# -- partitions -----------------------------------------------------------------------------------------------
def test_an_insert_spans_more_than_100_day_partitions(store: Store) -> None:
    store.apply_retention(400, 400)
    rows = [(f"r{i}", NOW - timedelta(days=DAYS + 10 - i), "acme", 200, 100) for i in range(DAYS)]
    store.insert("gateway_requests", rows, ["request_id", "ts", "tenant_id", "status", "prompt_tokens"])
    store.command("CREATE TABLE days (ts DateTime) ENGINE = MergeTree PARTITION BY toYYYYMMDD(ts) ORDER BY ts")
    store.command(f"INSERT INTO days SELECT now() - number * 86400 FROM numbers({DAYS})")
    store.insert_arrow("days", pa.table({"ts": [NOW - timedelta(days=i) for i in range(DAYS)]}))
    assert (count(store, "gateway_requests"), count(store, "days")) == (DAYS, 2 * DAYS)
    assert store.query_rows("SELECT sum(requests) FROM requests_1h")[0][0] == DAYS


def test_the_ingester_writes_a_backlog_of_many_days_at_once(store: Store, tmp_path: Path) -> None:
    """Before: the batch was refused (code 252), taken for a passing failure and retried forever."""
    store.apply_retention(400, 400)
    Ingester(store, _NoSource()).write_batch(to_messages(read_file(one_a_day(tmp_path, 120))))
    assert count(store, "gateway_requests") == 120


def test_import_of_five_months_loads_and_answers_every_request(store: Store, tmp_path: Path) -> None:
    result = cli(store, "import", "gateway-log", str(one_a_day(tmp_path)), env={"KVSCOPE_RETENTION_DAYS": "400"})
    assert result.exit_code == 0, result.output
    assert f"{DAYS} requests, 0 already stored, 0 dead letters" in result.stdout
    assert f"attribution: {DAYS} new answers" in result.stdout
    assert (count(store, "gateway_requests"), count(store, "request_attribution")) == (DAYS, DAYS)


def test_a_session_held_to_100_partitions_splits_what_it_may_not_write_at_once(store: Store,
                                                                               tmp_path: Path) -> None:
    """A server whose user may not change max_partitions_per_insert_block: the default-limit session of a
    plain client stands in for it (real chDB, limit 100)."""
    store.apply_retention(400, 400)
    plain = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    held = Store(plain, store.database, store.dsn)
    assert plain.query("SELECT getSetting('max_partitions_per_insert_block')").result_rows == [(100,)]
    rows = [(f"i{i}", NOW - timedelta(days=DAYS + 10 - i), "acme", 200, 100) for i in range(DAYS)]
    held.insert("gateway_requests", rows, ["request_id", "ts", "tenant_id", "status", "prompt_tokens"])
    assert count(store, "gateway_requests") == DAYS
    held.command("CREATE TABLE days (ts DateTime) ENGINE = MergeTree PARTITION BY toYYYYMMDD(ts) ORDER BY ts")
    with pytest.raises(TooManyPartitions, match="Too many partitions"):
        held.command(f"INSERT INTO days SELECT now() - number * 86400 FROM numbers({DAYS})")
    held.insert_arrow("days", pa.table({"ts": [NOW - timedelta(days=i) for i in range(DAYS)]}))
    stats = load_gateway_log(held, one_a_day(tmp_path))
    assert (stats.rows, stats.duplicates) == (DAYS, 0)
    assert (count(store, "gateway_requests"), count(store, "days")) == (2 * DAYS, DAYS)


def test_a_session_that_may_not_change_the_limit_is_opened_without_it(store: Store) -> None:
    """A read-only user stands in for a server's settings profile (real chDB, ``readonly = 1``)."""
    free = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    assert insert_settings(free) == INSERT_SETTINGS == {"max_partitions_per_insert_block": 0}
    held = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    held.command("SET readonly = 1")
    assert insert_settings(held) == {}


def test_a_preferred_query_setting_the_store_refuses_is_left_out(store: Store) -> None:
    """Store.query_df(preferred=...): the settings are used where the user may set them and left out (same
    answer, other types) where a settings profile forbids them (a read-only user stands in for it)."""
    sql = "SELECT toLowCardinality(toString(number % 3)) AS name FROM numbers(6)"
    dictionaries = {"output_format_arrow_low_cardinality_as_dictionary": 1}
    free = store.query_df(sql, preferred=dictionaries)
    held_client = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    held_client.command("SET readonly = 1")
    held = Store(held_client, store.database, store.dsn).query_df(sql, preferred=dictionaries)
    assert free.schema["name"] == pl.Categorical and held.schema["name"] == pl.String
    assert free["name"].cast(pl.String).to_list() == held["name"].to_list() == ["0", "1", "2", "0", "1", "2"]



def test_an_embedded_store_hands_its_answers_over_uncompressed(store: Store) -> None:
    """chDB answers in the same process: its Arrow results are not LZ4-compressed only to be decompressed again
    (ClickHouse's default compresses them), on the writers' session and on the ad hoc one; the answer is the
    same. 10^5 zeros are 800,000 bytes as they are and a few kilobytes compressed."""
    raw = store.client.raw_query("SELECT toUInt64(0) AS z FROM numbers(100000)", fmt="Arrow")
    assert len(raw) >= 800_000
    assert pa.ipc.open_file(raw).read_all()["z"].to_pylist() == [0] * 100_000
    assert store.query_df("SELECT sum(number) AS s FROM numbers(100000)")["s"].item() == 4_999_950_000
    setting = "SELECT getSetting('output_format_arrow_compression_method') AS m"
    assert store.query_rows(setting) == [("none",)]
    assert store.adhoc(setting)["m"].to_list() == ["none"]

def stage_tables(store: Store) -> list[str]:
    return [r[0] for r in store.query_rows("SELECT name FROM system.tables WHERE database = currentDatabase() "
                                           "AND startsWith(name, 'load_')")]


def test_a_failed_load_drops_its_stage_table(store: Store, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_gateway_log(store, tmp_path / "gone.jsonl")
    assert stage_tables(store) == []


def test_a_store_error_of_an_import_is_one_line(store: Store, tmp_path: Path) -> None:
    store.command("DROP TABLE gateway_requests SYNC")
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(line("a", NOW - timedelta(hours=1))) + "\n")
    result = cli(store, "import", "gateway-log", str(path))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    [error] = [x for x in result.output.splitlines() if x.startswith("Error: ")]
    assert "gateway_requests" in error and "Traceback" not in result.output


# -- store options --------------------------------------------------------------------------------------------
def test_a_bad_database_name_is_one_line(store: Store) -> None:
    for args in (["query", "hit_rate_total"], ["migrate"]):
        result = CliRunner().invoke(main, [*args, "--data-dir", store.dsn.removeprefix("chdb://"),
                                           "--database", "bad-name"], env={})
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.exception
        assert result.output.splitlines()[-1] == (
            "Error: KVSCOPE_DATABASE / --database 'bad-name': expected a plain identifier (letters, digits and _, "
            "not starting with a digit)")


def test_a_data_dir_that_cannot_be_a_directory_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for data_dir, why in [(a_file, "a file is there"), (a_file / "x", "a part of the path is a file"),
                          (Path("/dev/null/x"), "a part of the path is a file")]:
        for command in ("migrate", "attribute"):
            result = CliRunner().invoke(main, [command, "--once", "--data-dir", str(data_dir)]
                                        if command == "attribute" else [command, "--data-dir", str(data_dir)], env={})
            assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.exception
            assert result.output.splitlines()[-1] == (
                f"Error: --data-dir / KVSCOPE_DATA_DIR {data_dir}: cannot be the chDB data directory: {why} "
                f"({data_dir})")


def test_up_with_a_data_dir_under_a_file_is_one_line(tmp_path: Path) -> None:
    """``kvscope up`` checkpoints its gateway logs beside the data directory before it opens the store."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    log = tmp_path / "gateway.jsonl"
    log.write_text("")
    result = CliRunner().invoke(main, ["up", "--no-dashboard", "--data-dir", str(a_file / "data"),
                                       "--gateway-log", str(log)], env={})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.exception
    assert result.output.splitlines()[-1] == (
        "Error: the collector's checkpoints (KVSCOPE_STATE_DIR, else beside --data-dir) cannot be written: a part "
        f"of the path is a file ({a_file / 'data.state'})")


@pytest.mark.parametrize("failing", [
    "SELECT toUInt64(round(sum(x))) FROM (SELECT 1.5e308 AS x UNION ALL SELECT 1.5e308)",  # fails mid-result
    "SELECT throwIf(1)",
    "SELECT number, toUInt64(if(number = 70000, inf, 1.0)) FROM numbers(100000)",  # after blocks were sent
])
@pytest.mark.parametrize("how", ["query_df", "query_rows"])
def test_a_failed_query_leaves_nothing_for_the_next_one(store: Store, failing: str, how: str) -> None:
    """On chDB a failed query's Arrow output began before the error was handed to the next statement of the session:
    the named query after a failing one raised UnicodeDecodeError or ArrowInvalid, or read the wrong rows. The store
    now reads such leftovers away (Store._after_failure) before it raises QueryError."""
    with pytest.raises(QueryError):
        getattr(store, how)(failing)
    assert store.query_rows("SELECT 1") == [(1,)]
    assert store.query_df("SELECT number AS n FROM numbers(3)")["n"].to_list() == [0, 1, 2]
    with pytest.raises(QueryError):
        store.query_df(failing)
    assert store.named("data_extent").height >= 0
    assert store.query_df("SELECT 7 AS n")["n"].to_list() == [7]
