"""Hostile input on the command line an operator types and the files they import: ``kvscope query --param``,
``kvscope import gateway-log | labels | metrics``, ``kvscope alerts`` options. Each is run through the real CLI
against a real chDB store. The rule: a user error is one line (no traceback), a bad line is a dead letter with
its reason and costs only itself, and a re-run counts nothing twice.

(Covered elsewhere: SQL guards of ``kvscope sql`` in test_store_guards.py, hostile digest/alert config in
test_hostile_digest_alerts.py, blank names and impossible times in test_named_queries.py, bad gateway log lines
in test_hostile_input.py.)"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import sql as sqlfiles
from ingest.errors import QueryError
from ingest.store import Store
from kvscope.cli import main
from tests.fixture_data import load_fixture


@pytest.fixture(scope="module")
def fx(chdb_dir: Path) -> Store:
    s = Store.open(data_dir=chdb_dir, database=f"hc_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_fixture(s)
    return s


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--data-dir", store.dsn.removeprefix("chdb://"), "--database",
                                     store.database], env={})


def one_line_error(result: Result, exit_code: int) -> str:
    """The last output line of a command that failed with ``exit_code`` as click's one-line error."""
    assert result.exit_code == exit_code and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    last = result.output.splitlines()[-1]
    assert last.startswith("Error: "), result.output
    return last


# -- named-query parameters -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ptype", "value", "error"), [
    ("Array(UInt64)", "[18446744073709551616]", "element 18446744073709551616 is not a UInt64"),  # was [0]
    ("Array(UInt8)", "[50, 300]", "element 300 is not a UInt8"),  # was [50, 44]
    ("Array(UInt8)", "[-1]", "element -1 is not a UInt8"),
    ("Array(UInt64)", "[1.5]", "'[1.5]' is not an Array(UInt64)"),
    ("Array(UInt64)", "[1,2]); DROP TABLE gateway_requests; --", "is not an Array(UInt64)"),
    ("Array(UInt64)", "['a']", "is not an Array(UInt64)"),
    ("Array(UInt64)", "[1,]", "is not an Array(UInt64)"),
    ("UInt32", "9" * 5000, "is not a UInt32"),  # Python refuses int() of 5000 digits: a ValueError, a traceback
    ("Array(UInt64)", f"[{'9' * 5000}]", "is not a UInt64"),
    ("UInt32", "\u0663", "is not a UInt32"),  # an Arabic-Indic digit: int() reads it, ClickHouse would not
])
def test_integer_values_out_of_their_type_are_refused_not_wrapped(ptype: str, value: str, error: str) -> None:
    with pytest.raises(sqlfiles.ParamError, match="^parameter p: ") as err:
        sqlfiles.check_value(sqlfiles.Param("p", ptype, None), value)
    assert error in str(err.value) and len(str(err.value)) < 200


def test_integer_arrays_go_to_clickhouse_as_written() -> None:
    chain = sqlfiles.Param("chain", "Array(UInt64)", None)
    assert sqlfiles.check_value(chain, " [ 1, +2 ,18446744073709551615 ] ") == "[1,2,18446744073709551615]"
    assert sqlfiles.check_value(chain, "[]") == sqlfiles.check_value(chain, "[ ]") == "[]"


def test_a_chain_out_of_uint64_is_one_line_on_the_command_line(fx: Store) -> None:
    """kv_resident_at's chain wrapped: [2^64] looked up block hash 0."""
    line = one_line_error(cli(fx, "query", "kv_resident_at", "--param", "chain=[18446744073709551616]"), 1)
    assert line.startswith("Error: parameter chain: element 18446744073709551616 is not a UInt64"), line
    line = one_line_error(cli(fx, "query", "ttl_hold_time", "--param", "percents=[50, 300]"), 1)
    assert line.startswith("Error: parameter percents: element 300 is not a UInt8"), line


def test_a_chain_of_a_million_blocks_runs(fx: Store) -> None:
    chain = "[" + ",".join(str(2**64 - 1 - i) for i in range(10**6)) + "]"
    df = fx.named("kv_resident_at", {"chain": chain})
    assert set(df["chain_blocks"].to_list()) <= {10**6}


def test_a_parameter_given_twice_is_a_usage_error(fx: Store) -> None:
    """``--param pod=a --param pod=b`` ran for pod b alone, without a word."""
    line = one_line_error(cli(fx, "query", "hit_rate", "--param", "pod=pod-a", "--param", "pod=pod-b"), 2)
    assert line == ("Error: Invalid value for --param pod: pod is given twice ('pod-a' and 'pod-b'); a query takes "
                    "one value of each parameter")


@pytest.mark.parametrize("name", ["../parts/kv_bytes_per_token", "../migrations/0001_create_gateway_requests",
                                  "hit_rate/../hit_rate", "/etc/passwd"])
def test_a_query_name_is_a_name_not_a_path(fx: Store, name: str) -> None:
    """``--show-sql ../parts/x`` printed a traceback; ``query ../migrations/x`` read a migration as a query."""
    with pytest.raises(KeyError, match="no named query"):
        sqlfiles.load_query(name)
    with pytest.raises(QueryError, match="^no named query"):
        fx.named(name)
    for args in (["query", "--show-sql", name], ["query", name]):
        line = one_line_error(cli(fx, *args), 2 if "--show-sql" in args else 1)
        assert line.startswith(f"Error: no named query {name!r}"), line
