"""Hostile input on the command line an operator types and the files they import: ``kvscope query --param``,
``kvscope import gateway-log | labels | metrics``, ``kvscope alerts`` options. Each is run through the real CLI
against a real chDB store. The rule: a user error is one line (no traceback), a bad line is a dead letter with
its reason and costs only itself, and a re-run counts nothing twice.

(Covered elsewhere: SQL guards of ``kvscope sql`` in test_store_guards.py, hostile digest/alert config in
test_hostile_digest_alerts.py, blank names and impossible times in test_named_queries.py, bad gateway log lines
in test_hostile_input.py.)"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import sql as sqlfiles
from collector.gateway_log import MAX_LINE_BYTES, MAX_RAW
from ingest.errors import QueryError
from ingest.store import Store
from kvscope.cli import main
from kvscope.config import ConfigError, build_config
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
    assert df.height >= 1 and set(df["chain_blocks"].to_list()) == {10**6}


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


# -- imported files ---------------------------------------------------------------------------------------------
NOW = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "samples" / "vllm_0.32.0_cpu_real_metrics_1.txt"


def gateway_line(request_id: str, i: int = 0) -> str:
    ts = (NOW - timedelta(milliseconds=i)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return json.dumps({"log_version": 1, "request_id": request_id, "ts": ts, "tenant_id": "acme", "status": 200,
                       "prompt_tokens": 100, "cached_tokens": 64, "ttft_ms": 5.0, "e2e_ms": 9.0})


def label_line(request_id: str) -> str:
    return json.dumps({"request_id": request_id, "pathology": "none", "ts": NOW.isoformat()})


def count(store: Store, sql: str) -> int:
    return store.query_rows(sql)[0][0]


def top_free_fd() -> int:
    """The highest fd number free in this process, below the open-file limit. Files are given the lowest free
    number, so a long test session (chDB holds hundreds of files open) reaches this one last; a fixed number such as
    700 was already chDB's, and ``dup2`` over it closed chDB's file under it."""
    number = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1
    while True:
        try:
            fcntl.fcntl(number, fcntl.F_GETFD)
        except OSError:
            return number
        number -= 1


@contextlib.contextmanager
def piped(data: bytes, fd: int) -> Iterator[str]:
    """A pipe named as a path, as a shell's process substitution gives one (``<(zcat log.gz)``: /dev/fd/N), fed
    ``data`` by a thread. Its read end is fd ``fd`` (free: see :func:`top_free_fd`), as a shell gives the same
    command the same /dev/fd/N: the lowest free number would vary with the files chDB's background merges hold
    open."""
    first_fd, write_fd = os.pipe()
    read_fd = os.dup2(first_fd, fd)
    os.close(first_fd)

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError), os.fdopen(write_fd, "wb") as fh:
            fh.write(data)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    try:
        yield f"/dev/fd/{read_fd}"
    finally:
        os.close(read_fd)
        thread.join(10)


def test_a_label_line_nested_too_deep_is_a_dead_letter(store: Store, tmp_path: Path) -> None:
    """Python's JSON parser recurses per level: a line of 100,000 '[' was a RecursionError traceback, and the
    file's other lines were not loaded."""
    path = tmp_path / "labels.jsonl"
    path.write_text("\n".join([label_line("ok-1"), "[" * 100_000 + "]" * 100_000,
                               '{"a":' * 50_000 + "1" + "}" * 50_000, label_line("ok-2")]) + "\n")
    result = cli(store, "import", "labels", str(path))
    assert result.exit_code == 0, result.output
    assert f"{path}: 2 labels, 0 already stored, 2 bad lines (2 new dead letters)" in result.output
    reasons = store.query_rows("SELECT reason FROM dead_letters WHERE source = 'workload_labels'")
    assert [r[0] for r in reasons] == ["not JSON kvscope reads: nested too deep (a label is a flat object)"] * 2


@pytest.mark.parametrize("command", ["gateway-log", "labels"])
def test_a_gzip_file_is_refused_whole_and_writes_nothing(store: Store, tmp_path: Path, command: str) -> None:
    """Labels once took a gzip file as lines of garbage: a dead letter per newline byte, the reason 'not JSON
    ('utf-8' codec ...)'. Both imports now refuse it in one line, as import metrics does."""
    path = tmp_path / "rotated.jsonl.1"
    line = gateway_line("gz-1") if command == "gateway-log" else label_line("gz-1")
    path.write_bytes(gzip.compress(("\n".join([line] * 50) + "\n").encode()))
    last = one_line_error(cli(store, "import", command, str(path)), 1)
    assert last.startswith(f"Error: {path}: gzip-compressed bytes, not "), last
    assert last.endswith(": decompress it first (gunzip), or import <(zcat FILE)")
    assert count(store, "SELECT count() FROM dead_letters") == 0
    for table in ("gateway_requests", "workload_labels"):
        assert count(store, f"SELECT count() FROM {table}") == 0


def test_a_pipe_imports_once_and_again_without_doubles(store: Store) -> None:
    """``kvscope import gateway-log <(zcat log.gz)``: the path resolved to /proc/PID/fd/pipe:[N], no file (a
    FileNotFoundError traceback), and the gzip check read the pipe's first bytes away before it was read again.
    The same for labels and metrics. A pipe is read once; its dead letters are keyed by the path as given, so
    the same command again adds nothing."""
    log = ("\n".join([gateway_line(f"p-{i}", i) for i in range(5)] + ["not json"]) + "\n").encode()
    fd = top_free_fd()
    for _ in range(2):
        with piped(log, fd) as path:
            result = cli(store, "import", "gateway-log", path)
        assert result.exit_code == 0, result.output
        assert count(store, "SELECT count() FROM gateway_requests") == 5
        assert count(store, "SELECT count() FROM dead_letters") == 1
    assert "/dev/fd/" in store.query_rows("SELECT location FROM dead_letters")[0][0]
    with piped(("\n".join(label_line(f"p-{i}") for i in range(3)) + "\n").encode(), fd) as path:
        result = cli(store, "import", "labels", path)
    assert result.exit_code == 0 and f"{path}: 3 labels, 0 already stored, 0 bad lines" in result.output
    with piped(SAMPLE.read_bytes(), fd) as path:
        result = cli(store, "import", "metrics", path, "--pod", "pod-a", "--at", NOW.isoformat())
    assert result.exit_code == 0, result.output
    assert count(store, "SELECT count() FROM vllm_cache_config WHERE pod = 'pod-a'") == 1


def test_a_file_name_that_is_not_utf8_imports_and_keys_its_dead_letters(store: Store, tmp_path: Path) -> None:
    """A Linux file name is bytes: ``labels-\\xff.jsonl`` failed the insert of its dead letters (and its default
    run id) with a UnicodeEncodeError traceback. Such bytes are now written \\xff in the keys and locations."""
    name = os.fsdecode(b"run-\xff")
    log, labels = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.labels.jsonl"
    log.write_text(gateway_line("nu-1") + "\nnot json\n")
    labels.write_text(label_line("nu-1") + "\nnot json\n")
    for _ in range(2):  # a re-import adds nothing
        for command, path in (("gateway-log", log), ("labels", labels)):
            result = cli(store, "import", command, str(path))
            assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert sorted(r[0] for r in store.query_rows("SELECT location FROM dead_letters")) == [
        f"{tmp_path}/run-\\xff.jsonl:{len(gateway_line('nu-1')) + 1}",
        f"{tmp_path}/run-\\xff.labels.jsonl:{len(label_line('nu-1')) + 1}"]
    assert store.query_rows("SELECT run_id FROM workload_labels") == [("run-\\xff.labels",)]
    assert count(store, "SELECT count() FROM gateway_requests") == 1


@pytest.mark.parametrize(("run_id", "error"), [
    (" ", "Error: Invalid value for --run-id: ' ' is blank; give a name"),
    ("r" * 513, "Error: Invalid value for --run-id: longer than 512 characters"),
    (os.fsdecode(b"\xff"), "Error: Invalid value for --run-id: not UTF-8 (byte 0 of the argument)"),
])
def test_a_run_id_or_pod_the_store_cannot_name_is_a_usage_error(store: Store, tmp_path: Path, run_id: str,
                                                         error: str) -> None:
    """``--run-id " "`` was stored, and attribution_agreement refuses a blank run_id filter: the run could not be
    asked for by name; a run id in a label line is held to 512 characters and UTF-8, the option was not."""
    path = tmp_path / "labels.jsonl"
    path.write_text(label_line("r-1") + "\n")
    assert one_line_error(cli(store, "import", "labels", str(path), "--run-id", run_id), 2) == error
    assert count(store, "SELECT count() FROM workload_labels") == 0
    result = cli(store, "import", "metrics", str(SAMPLE), "--pod", run_id, "--at", NOW.isoformat())
    assert one_line_error(result, 2) == error.replace("--run-id", "--pod")  # a pod name as the gateway log's
    assert count(store, "SELECT count() FROM vllm_cache_config") == 0


@pytest.mark.parametrize("option", ["--since", "--until"])
@pytest.mark.parametrize("at", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_digest_time_outside_the_calendar_in_utc_is_a_usage_error(fx: Store, option: str, at: str) -> None:
    """As import metrics --at: an offset moving the time out of years 1..9999 in UTC was an OverflowError
    traceback."""
    last = one_line_error(cli(fx, "digest", option, at, "--dry-run", "/dev/null"), 2)
    assert last == f"Error: Invalid value: '{at}' is outside the years 1..9999 in UTC"


def test_a_dashboard_link_with_a_time_outside_the_calendar_falls_back() -> None:
    """The same time in a shared dashboard link's ``from``/``to`` raised OverflowError: the page broke, where a
    value that does not parse falls back to the default range."""
    from dashboard.data import Filters, parse_time

    for at in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"):
        assert parse_time(at) is None
        f = Filters.from_query({"from": "2026-11-29T12:00:00Z", "to": at})
        assert f.start is None and f.end is None and f == Filters.from_query({})


@pytest.mark.parametrize("target", ["/dev/full", "/proc/no/such.eml"])
def test_a_digest_file_that_cannot_be_written_is_one_line(fx: Store, target: str) -> None:
    """``kvscope digest --dry-run /dev/full`` (a full disk) or a directory that cannot be made was a traceback."""
    last = one_line_error(cli(fx, "digest", "--dry-run", target), 1)
    assert last.startswith(f"Error: --dry-run {target}: the message cannot be written: "), last


@pytest.mark.parametrize("at", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_scrape_time_outside_the_calendar_in_utc_is_a_usage_error(store: Store, at: str) -> None:
    """An offset that moves the time out of years 1..9999 in UTC was a ValueError traceback."""
    last = one_line_error(cli(store, "import", "metrics", str(SAMPLE), "--pod", "p", "--at", at), 2)
    assert last == f"Error: Invalid value for --at: '{at}' is outside the years 1..9999 in UTC"


# -- alerts and the other loops ---------------------------------------------------------------------------------
@pytest.mark.parametrize("every", ["nan", "0", "-1", "inf", "1e300"])
def test_alerts_every_must_be_a_real_interval(store: Store, every: str) -> None:
    """``kvscope alerts --every 0`` (or -1, nan) evaluated the rules flat out, without a pause; ``--every inf``
    ended the evaluation thread with an OverflowError while the command went on waiting, evaluating nothing."""
    last = one_line_error(cli(store, "alerts", "--every", every), 2)
    assert last.startswith("Error: KVSCOPE_ALERT_EVERY_SECONDS / --every="), last
    assert last.endswith(": expected seconds above 0, at most 315,360,000 (ten years)"), last


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("KVSCOPE_SCRAPE_INTERVAL_SECONDS", "0", "seconds above 0"),
    ("KVSCOPE_ATTRIBUTION_INTERVAL_SECONDS", "nan", "seconds above 0"),
    ("KVSCOPE_ATTRIBUTION_SETTLE_SECONDS", "-2", "seconds 0 or more"),
    ("KVSCOPE_ATTRIBUTION_HORIZON_SECONDS", "inf", "seconds 0 or more"),
    ("KVSCOPE_GPU_HOUR_PRICE", "nan", "a finite number, 0 or more"),
    ("KVSCOPE_KV_BYTES_PER_TOKEN", "-1", "a finite number, 0 or more"),
])
def test_float_settings_are_finite_and_not_negative(variable: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}=.*: expected {expected}"):
        build_config({}, environ={variable: value})
    assert build_config({}, environ={"KVSCOPE_ATTRIBUTION_SETTLE_SECONDS": "0", "KVSCOPE_GPU_HOUR_PRICE": "0"})


# -- Ctrl-C mid-import ------------------------------------------------------------------------------------------
def kvscope(data_dir: Path, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """The real command in its own process (chDB: one data directory per process; this one holds the tests')."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    return subprocess.Popen([sys.executable, "-m", "kvscope.cli", *args, "--data-dir", str(data_dir)], cwd=ROOT,
                            env={**env, "PYTHONPATH": str(ROOT)}, text=True, **kwargs)


def sql(data_dir: Path, statement: str) -> list[dict[str, Any]]:
    proc = kvscope(data_dir, "sql", statement, "--format", "json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out)


def _feed(fifo: Path, data: bytes, first: int | None, go_on: threading.Event) -> threading.Thread:
    """A thread writing ``data`` into the FIFO: all of it, or (``first``) its first bytes, then the rest once
    ``go_on`` is set."""
    def feed() -> None:
        with contextlib.suppress(BrokenPipeError), fifo.open("wb") as fh:
            fh.write(data if first is None else data[:first])
            if first is not None:
                fh.flush()
                go_on.wait(300)
                fh.write(data[first:])

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    return writer


def import_interrupted_after_first_chunk(data_dir: Path, what: str, fifo: Path, data: bytes, first: int,
                                         progress: str) -> tuple[str, str]:
    """`kvscope import WHAT FIFO` fed ``data[:first]``; once its stderr reports the first chunk (``progress``),
    SIGINT, then the rest of the data. Asserts exit 130 and no traceback; returns (stdout, stderr after the
    progress line)."""
    os.mkfifo(fifo)
    signalled = threading.Event()
    writer = _feed(fifo, data, first, signalled)
    proc = kvscope(data_dir, "import", what, str(fifo), stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stderr is not None
    watchdog = threading.Timer(600, proc.kill)  # a safety net, not a measure: a broken import fails, never hangs
    watchdog.start()
    err = []
    for line in proc.stderr:  # until the first chunk is written
        err.append(line)
        if "lines read" in line:
            break
    watchdog.cancel()
    assert err and f"  {fifo}: {progress}" in err[-1], "".join(err)
    proc.send_signal(signal.SIGINT)
    signalled.set()
    out, rest = proc.communicate(timeout=300)
    writer.join(60)
    assert proc.returncode == 130, (out, "".join(err) + rest)
    assert "Traceback" not in rest
    return out, rest


def import_again(data_dir: Path, what: str, fifo: Path, data: bytes) -> str:
    """The same import again, the FIFO fed the whole data; asserts exit 0 and returns its stdout."""
    writer = _feed(fifo, data, None, threading.Event())
    proc = kvscope(data_dir, "import", what, str(fifo), stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    writer.join(60)
    assert proc.returncode == 0, err
    return out


def test_ctrl_c_mid_import_stops_between_chunks_and_a_rerun_loads_the_rest_once(tmp_path: Path) -> None:
    """chDB takes SIGINT when it opens: Ctrl-C during `kvscope import gateway-log` did nothing, and the import ran
    to its end. Now it stops after the chunk being written (exit 130, saying so) and the same import again loads
    the rest: every line once, every bad line's dead letter once.

    Deterministic: the log is a FIFO the test writes. The first 16 MiB (more than one 50,000-line chunk) go in;
    once the import reports that chunk, the test sends SIGINT and only then writes the rest: the import is then
    waiting for it, inside its second chunk, and must stop there having written exactly the first."""
    lines = [gateway_line(f"c-{i}", i) if i % 1000 else f"bad line {i}" for i in range(100_000)]
    data = ("\n".join(lines) + "\n").encode()
    first = data.index(b"\n", 17 << 20) + 1  # the first read (16 MiB) holds more than one chunk
    assert data[:first].count(b"\n") > 50_000 + 1000 and len(data) < 32 << 20
    fifo = tmp_path / "gateway.jsonl"
    data_dir = tmp_path / "data"
    out, rest = import_interrupted_after_first_chunk(data_dir, "gateway-log", fifo, data, first,
                                                     "50,000 lines read, 49,950 requests loaded")
    assert "kvscope: interrupted: " + str(fifo) + " loaded up to line 50,000, the attribution not run" in rest
    stored = sql(data_dir, "SELECT (SELECT count() FROM gateway_requests) AS rows, "
                           "(SELECT count() FROM dead_letters) AS dead")
    assert stored == [{"rows": 49_950, "dead": 50}]

    out = import_again(data_dir, "gateway-log", fifo, data)
    assert f"{fifo}: 49950 requests, 49950 already stored, 50 dead letters" in out
    stored = sql(data_dir, "SELECT (SELECT count() FROM gateway_requests) AS rows, (SELECT uniqExact(request_id, ts) "
                           "FROM gateway_requests) AS distinct_rows, (SELECT count() FROM dead_letters) AS dead, "
                           "(SELECT uniqExact(location) FROM dead_letters) AS places")
    assert stored == [{"rows": 99_900, "distinct_rows": 99_900, "dead": 100, "places": 100}]


def test_ctrl_c_mid_label_import_stops_between_chunks_and_a_rerun_loads_the_rest_once(tmp_path: Path) -> None:
    """`kvscope import labels` read each file whole and Ctrl-C stopped it only between files. It now streams
    50,000 lines at a time as the gateway log import does: Ctrl-C stops it after the chunk being written (exit
    130, saying how far it got) and the same import again loads the rest, every label once, every bad line's dead
    letter once. Deterministic as the gateway log's: the file is a FIFO the test writes, 60,000 lines first, the
    rest only once the first chunk is reported and SIGINT sent."""
    lines = [label_line(f"l-{i}") if i % 1000 else f"bad line {i}" for i in range(100_000)]
    data = ("\n".join(lines) + "\n").encode()
    first = sum(len(line) + 1 for line in lines[:60_000])
    fifo = tmp_path / "labels.jsonl"
    data_dir = tmp_path / "data"
    out, rest = import_interrupted_after_first_chunk(data_dir, "labels", fifo, data, first,
                                                     "50,000 lines read, 49,950 labels loaded")
    assert f"{fifo}: 49950 labels, 0 already stored, 50 bad lines (50 new dead letters)" in out
    assert "kvscope: interrupted: " + str(fifo) + " loaded up to line 50,000; run the same import again" in rest
    stored = sql(data_dir, "SELECT (SELECT count() FROM workload_labels) AS rows, "
                           "(SELECT count() FROM dead_letters) AS dead")
    assert stored == [{"rows": 49_950, "dead": 50}]

    out = import_again(data_dir, "labels", fifo, data)
    assert f"{fifo}: 49950 labels, 49950 already stored, 100 bad lines (50 new dead letters)" in out
    stored = sql(data_dir, "SELECT (SELECT count() FROM workload_labels) AS rows, (SELECT uniqExact(request_id) "
                           "FROM workload_labels) AS distinct_rows, (SELECT count() FROM dead_letters) AS dead, "
                           "(SELECT uniqExact(location) FROM dead_letters) AS places")
    assert stored == [{"rows": 99_900, "distinct_rows": 99_900, "dead": 100, "places": 100}]


def test_ctrl_c_during_the_attribution_after_an_import_says_so_and_loses_nothing(tmp_path: Path) -> None:
    """Once the lines are in, the import runs the attribution: Ctrl-C there stops it between its chunks (it
    leaves its watermark, so a later run answers the rest) and the import says so and exits 130, rather than
    going on and exiting 0. The file is one full chunk: its progress line comes once it is written, then the
    file ends and the attribution starts."""
    path = tmp_path / "gateway.jsonl"
    path.write_text("".join(gateway_line(f"a-{i}", i) + "\n" for i in range(50_000)))
    data_dir = tmp_path / "data"
    proc = kvscope(data_dir, "import", "gateway-log", str(path), stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stderr is not None
    watchdog = threading.Timer(600, proc.kill)  # a safety net, not a measure
    watchdog.start()
    err = []
    for line in proc.stderr:
        err.append(line)
        if "lines read" in line:
            break
    watchdog.cancel()
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=300)
    assert proc.returncode == 130, (out, "".join(err) + rest)
    assert f"{path}: 50000 requests, 0 already stored, 0 dead letters" in out
    assert "kvscope: interrupted: every file loaded, the attribution interrupted after " in rest
    assert rest.rstrip().endswith("kvscope attribute --once (or the next import) answers any left")
    attribute = kvscope(data_dir, "attribute", "--once", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert attribute.wait(300) == 0
    assert sql(data_dir, "SELECT count() AS answered FROM (SELECT request_id, ts FROM request_attribution "
                         "GROUP BY request_id, ts HAVING sum(sign) = 1)") == [{"answered": 50_000}]


# -- a line with no end -----------------------------------------------------------------------------------------
def test_a_line_of_gigabytes_costs_bounded_memory_and_only_itself(store: Store, tmp_path: Path) -> None:
    """A file without a newline (a binary file imported by mistake, a log whose writer never ended its line) was
    read whole into memory before its line was refused as too long. The line's head is now kept and the rest
    skipped unread: Python's allocations while reading 256 MiB without a newline stay under 64 MiB (they were
    over 256 MiB), and the line is one dead letter, the lines after it loaded at their offsets."""
    from ingest.bulk import _chunks

    piece = b"a" * (1 << 20)
    after = (gateway_line("after-1") + "\n").encode()
    read_fd, write_fd = os.pipe()

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError), os.fdopen(write_fd, "wb") as fh:
            for _ in range(256):
                fh.write(piece)
            fh.write(b"\n" + after)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    tracemalloc.start()
    try:
        with os.fdopen(read_fd, "rb") as fh:
            lines = [line for chunk in _chunks(fh, 50_000) for line in chunk]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        thread.join(10)
    assert peak < 64 << 20, f"{peak:,} bytes"
    assert [(offset, len(line)) for offset, line in lines] == [(0, MAX_LINE_BYTES), ((256 << 20) + 1, len(after) - 1)]

    path = tmp_path / "endless.jsonl"
    with path.open("wb") as fh:
        for _ in range(20):
            fh.write(piece)
        fh.write(b"\n" + after)
    result = cli(store, "import", "gateway-log", str(path))
    assert result.exit_code == 0 and f"{path}: 1 requests, 0 already stored, 1 dead letters" in result.output
    assert store.query_rows("SELECT reason, location, length(raw) FROM dead_letters") == [
        (f"line longer than {MAX_LINE_BYTES} bytes", f"{path}:0", MAX_RAW)]
