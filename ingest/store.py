"""The store: kvscope's one door to ClickHouse (chDB in-process, or a server), used by ingest, the attribution
job, the dashboard, ``kvscope query`` and ``kvscope sql``.

The client is clickhouse-connect in both modes (``dsn="chdb:///abs/path"`` or ``http://host:8123``), so every
statement is ClickHouse SQL and runs unchanged on chDB, a server or a cluster. chDB allows one data directory
per process (docs/environment.md), so one :class:`Store` is opened per process and shared by
threads; calls are serialised by a lock (clickhouse-connect clients are not safe for concurrent queries).
Ad hoc SQL has a client and a lock of its own (a second chDB session on the same engine), so a slow user query
never pauses ingestion.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import clickhouse_connect
import polars as pl
import pyarrow as pa
from clickhouse_connect.driver import exceptions as ch_exc

import sql as sqlfiles
from ingest.adhoc import (
    ADHOC_MAX_MEMORY_BYTES,
    ADHOC_MAX_ROWS,
    DESCRIBE_RESULT,
    EXPLAIN_AST,
    FORMAT_QUERY,
    READONLY_TABLE_FUNCTIONS,
    TOO_LARGE,
    adhoc_settings,
    check_read_only,
    check_sources,
    datetimes,
    error_line,
    needs_types,
    readable,
    to_polars,
    unique_names,
)
from ingest.errors import MissingDatabase, QueryError, RejectedRows, StoreUnavailable, TooManyPartitions

# The ClickHouse error codes that mean "these rows are wrong" (parse, type, range): the only failures of an
# insert that are permanent. Every other failure of a write (network, timeouts, memory limit 241, too many
# parts 252, a missing table during a migration, an error without a code) may pass and is retried; too many
# partitions in one block (also 252) is split instead (INSERT_SETTINGS, _halves).
# Source: ClickHouse src/Common/ErrorCodes.cpp.
DATA_ERROR_CODES = frozenset({
    6,    # CANNOT_PARSE_TEXT
    26,   # CANNOT_PARSE_QUOTED_STRING
    27,   # CANNOT_PARSE_INPUT_ASSERTION_FAILED
    38,   # CANNOT_PARSE_DATE
    41,   # CANNOT_PARSE_DATETIME
    53,   # TYPE_MISMATCH
    69,   # ARGUMENT_OUT_OF_BOUND
    70,   # CANNOT_CONVERT_TYPE
    72,   # CANNOT_PARSE_NUMBER
    117,  # INCORRECT_DATA
    131,  # TOO_LARGE_STRING_SIZE
    321,  # VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
    349,  # CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN
})
log = logging.getLogger("kvscope.store")
#: Read failures that may pass (timeouts, too many queries, network, memory limit, too many parts).
_RETRYABLE_READ_CODES = {159, 202, 209, 210, 241, 242, 252, 425}
#: What clickhouse-connect raises while serialising values that do not fit their column (a data error).
_SERIALISE_ERRORS = (ValueError, TypeError, OverflowError, struct.error, ch_exc.DataError)
_CODE = re.compile(r"Code:\s*(\d+)")
#: What ClickHouse says (code 252, like "too many parts") when one INSERT block spans more partitions than
#: ``max_partitions_per_insert_block`` allows: permanent for that block, so never retried as it is. Newer
#: servers say "for a single INSERT block".
_TOO_MANY_PARTITIONS = re.compile(r"Too many partitions for (?:a )?single INSERT block", re.IGNORECASE)
#: The settings of the writers' session: any number of partitions per INSERT block (ClickHouse default 100;
#: 0 = unlimited, https://clickhouse.com/docs/operations/settings/settings#max_partitions_per_insert_block).
#: kvscope's raw tables are partitioned by day and the rollups by month, so a backfill of more than 100 days
#: (or a replay of 100 months) is one block over many partitions; the parts it makes are merged as usual.
INSERT_SETTINGS = {"max_partitions_per_insert_block": 0}
#: Set once on each embedded (chDB) session: query results handed to Python as Arrow are not LZ4-compressed
#: (ClickHouse's default ``output_format_arrow_compression_method`` is lz4_frame,
#: https://clickhouse.com/docs/operations/settings/formats#output_format_arrow_compression_method). In one
#: process compressing only to decompress again is pure cost: reading 9.5M KV log rows took 2.5 CPU-s
#: uncompressed against 3.4–4.6 compressed. A server's answers keep the default (they cross a network).
EMBEDDED_SESSION_SETTINGS = {"output_format_arrow_compression_method": "none"}


def _set_session(client: Any, settings: dict[str, Any]) -> None:
    """SET each of ``settings`` on ``client``'s session (chDB: a SET lasts for the session), in order."""
    for key, value in settings.items():
        client.command(f"SET {key} = {value!r}" if isinstance(value, str) else f"SET {key} = {value}")


def _code(exc: BaseException) -> int | None:
    m = _CODE.search(str(exc))
    return int(m.group(1)) if m else None


def error_code(exc: BaseException) -> int | None:
    """The ClickHouse error code a failure carries (``Code: N`` in its message or in its cause's), None when it
    has none (a network failure, a Python error)."""
    while exc is not None:
        code = _code(exc)
        if code is not None:
            return code
        exc = exc.__cause__  # type: ignore[assignment]
    return None


def _halves(exc: BaseException, rows: int) -> bool:
    """Whether a refused insert of ``rows`` rows is to be retried as two halves: the store refused it for
    spanning too many partitions (a server whose user may not raise ``max_partitions_per_insert_block``).
    Halving ends: a block of at most that many rows touches at most that many partitions."""
    return rows > 1 and bool(_TOO_MANY_PARTITIONS.search(str(exc)))


def _insert_error(table: str, exc: BaseException) -> Exception:
    """A failed insert as kvscope's error: a data error (:data:`DATA_ERROR_CODES`) → :class:`RejectedRows`,
    anything else → :class:`StoreUnavailable` (retryable)."""
    code = _code(exc)
    if code in DATA_ERROR_CODES or isinstance(exc, ch_exc.DataError):
        return RejectedRows(table, str(exc), code)
    return StoreUnavailable(f"insert into {table}: {exc}")


def accepted_settings(client: Any, settings: dict[str, Any], instead: str) -> dict[str, Any]:
    """``settings`` when a session of ``client``'s store accepts them, else ``{}`` with a warning saying what
    happens ``instead``: a server whose settings profile makes one of them read-only or constrains it (the client
    refuses a read-only setting; the server answers a constrained one with an error). Probed with ``SELECT 1``
    under the settings; a network failure raises (clickhouse-connect's OperationalError)."""
    try:
        client.query("SELECT 1", settings=settings)
    except ch_exc.OperationalError:
        raise
    except ch_exc.Error as exc:
        log.warning("the store does not let this user set %s; %s. error=%s", settings, instead,
                    error_line(str(exc)))
        return {}
    return dict(settings)


def insert_settings(client: Any) -> dict[str, Any]:
    """:data:`INSERT_SETTINGS` when the store accepts them (:func:`accepted_settings`), else ``{}``: then
    :meth:`Store.insert` splits what the server refuses for spanning too many partitions."""
    return accepted_settings(client, INSERT_SETTINGS, "inserts refused for spanning too many partitions are split")


class Store:
    """A ClickHouse database reached through one clickhouse-connect client.

    Open with :meth:`open`. ``database`` is created if missing (tests isolate by database name).
    Raises :class:`StoreUnavailable` when the store cannot be reached.
    """

    def __init__(self, client: Any, database: str, dsn: str, cluster: str = "",
                 adhoc: dict[str, Any] | None = None) -> None:
        self.client = client
        self.database = database
        self.dsn = dsn
        self.cluster = cluster
        #: The settings ad hoc queries run under (:func:`ingest.adhoc.adhoc_settings`).
        self.adhoc_settings = adhoc or adhoc_settings()
        self._lock = threading.RLock()
        # Ad hoc SQL has its own client (its own chDB session) and its own lock: a slow user query never holds
        # the lock the ingester and the attribution job write under.
        self._adhoc_lock = threading.Lock()
        self._adhoc_client: Any = None
        self._table_functions: frozenset[str] | None = None  # ingest.adhoc.READONLY_TABLE_FUNCTIONS, read once
        self._accepted: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}  # per-call settings, probed once

    @classmethod
    def open(cls, *, data_dir: str | Path | None = None, clickhouse_url: str | None = None,
             database: str = "kvscope", cluster: str = "",
             adhoc_max_memory_bytes: int = ADHOC_MAX_MEMORY_BYTES, create: bool = True) -> Store:
        """Open chDB at ``data_dir`` (embedded) or the server at ``clickhouse_url`` (e.g. ``http://ch:8123``).

        Exactly one of the two is used; ``clickhouse_url`` wins when both are given. ``cluster`` (server only):
        a cluster name from the server's ``remote_servers``: the database is created ON CLUSTER with the
        Replicated database engine, so every migration's DDL reaches every replica, and the migrations'
        MergeTree-family tables are created as their Replicated* engines (:func:`replicated`). docs/scale.md.
        ``adhoc_max_memory_bytes``: the memory cap of each ad hoc query (:meth:`adhoc`). ``create``: create the
        database when it is missing (False, for the read-only commands: :class:`MissingDatabase` instead).
        """
        if not sqlfiles.DATABASE_NAME.fullmatch(database):
            raise ValueError(f"database name {database!r} must be an identifier")
        if clickhouse_url:
            dsn = clickhouse_url
        elif data_dir:
            path = Path(data_dir).expanduser().resolve()
            path.mkdir(parents=True, exist_ok=True)
            dsn = f"chdb://{path}"
        else:
            raise ValueError("Store.open needs data_dir or clickhouse_url")
        if cluster and not clickhouse_url:
            raise ValueError("a ClickHouse cluster needs clickhouse_url (chDB is one process)")
        try:
            boot = clickhouse_connect.get_client(dsn=dsn)
            if create:
                boot.command(create_database(database, cluster))
            elif not boot.command("EXISTS DATABASE {db:Identifier}", parameters={"db": database}):
                raise MissingDatabase(f"database {database!r} does not exist at {dsn.removeprefix('chdb://')} (the "
                                      "commands that write create it: kvscope up, import, ingest); check --database")
            client = clickhouse_connect.get_client(dsn=dsn, database=database, settings=insert_settings(boot))
            if not clickhouse_url:
                _set_session(client, EMBEDDED_SESSION_SETTINGS)
        except ch_exc.Error as exc:
            raise StoreUnavailable(f"cannot open ClickHouse at {dsn}: {exc}") from exc
        return cls(client, database, dsn, cluster, adhoc_settings(adhoc_max_memory_bytes))

    @contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """Hold the lock and translate clickhouse-connect errors of a read or a command: network, timeouts
        and load → StoreUnavailable (retry); an INSERT ... SELECT over more partitions than the server lets
        this user write in one block → TooManyPartitions; others → QueryError (the statement itself is
        wrong)."""
        try:
            with self._lock:
                try:
                    yield
                except ch_exc.Error:
                    self._after_failure()
                    raise
        except ch_exc.OperationalError as exc:
            raise StoreUnavailable(f"{what}: {exc}") from exc
        except ch_exc.Error as exc:
            if _TOO_MANY_PARTITIONS.search(str(exc)):
                raise TooManyPartitions(f"{what}: {exc}") from exc
            if _code(exc) in _RETRYABLE_READ_CODES:
                raise StoreUnavailable(f"{what}: {exc}") from exc
            raise QueryError(f"{what}: {exc}") from exc

    def _after_failure(self) -> None:
        """After a failed statement on chDB: its session may hand the next statement the rest of the failed one's
        output (an Arrow stream begun before the error: a query that fails mid-result, even ``throwIf``), which that
        statement then fails to read or, worse, reads as its own. Read and drop such leftovers (``SELECT 1`` until it
        answers ``1``, at most 3 times) before the error is raised. A server answers each HTTP request apart: nothing
        to do there. Never raises: the original error is what the caller must see."""
        if not self.dsn.startswith("chdb:"):
            return
        try:
            with self._lock:
                for _ in range(3):
                    if self.client.raw_query("SELECT 1", fmt="TabSeparated") == b"1\n":
                        return
        except Exception:  # noqa: BLE001 - the failed statement's own error follows
            log.warning("chDB session not confirmed clean after a failed statement", exc_info=True)

    # -- writes -------------------------------------------------------------------------------------------
    def command(self, statement: str, parameters: dict[str, Any] | None = None) -> Any:
        """Run a statement that returns no rows (DDL, INSERT ... SELECT). Raises :class:`StoreUnavailable` (may
        pass), :class:`TooManyPartitions` (an INSERT ... SELECT over more partitions than a server lets this user
        write at once: :func:`insert_settings`), :class:`QueryError` (the statement is wrong)."""
        with self._translate("command"):
            return self.client.command(statement, parameters=parameters)

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        """Insert row tuples into ``table`` (one INSERT; ClickHouse writes one part per partition touched).

        The session allows any number of partitions per INSERT (:data:`INSERT_SETTINGS`); where a server does
        not let this user change that, a batch it refuses for spanning too many partitions is inserted in
        halves (:func:`_halves`): a half that landed stays, so the rows land once.
        Raises :class:`RejectedRows` only for data errors: the client could not serialise a value into its
        column, or ClickHouse answered with one of :data:`DATA_ERROR_CODES`. Every other failure raises
        :class:`StoreUnavailable` (retryable): the rows may or may not have landed, so a retry must first
        check what the store holds (the ingester's dedup does).
        """
        if not rows:
            return
        try:
            with self._lock:
                self.client.insert(table, list(rows), column_names=list(column_names))
        except ch_exc.Error as exc:
            self._after_failure()
            if _halves(exc, len(rows)):
                mid = len(rows) // 2
                self.insert(table, rows[:mid], column_names)
                self.insert(table, rows[mid:], column_names)
                return
            raise _insert_error(table, exc) from exc
        except _SERIALISE_ERRORS as exc:
            raise RejectedRows(table, f"client could not serialise rows: {exc!r}") from exc

    def insert_raw(self, table: str, data: bytes, fmt: str, settings: dict[str, Any] | None = None) -> None:
        """Insert ``data`` in ClickHouse input format ``fmt`` (e.g. JSONEachRow: ClickHouse parses it). Errors as
        :meth:`insert` (a parse error of the data is :class:`RejectedRows`); only JSONEachRow data is split in
        halves (at line ends) when refused for spanning too many partitions."""
        if not data:
            return
        try:
            with self._lock:
                self.client.raw_insert(table, None, insert_block=data, fmt=fmt, settings=settings)
        except ch_exc.Error as exc:
            self._after_failure()
            lines = data.split(b"\n") if fmt == "JSONEachRow" else []
            if _halves(exc, len(lines)):
                mid = len(lines) // 2
                self.insert_raw(table, b"\n".join(lines[:mid]), fmt, settings)
                self.insert_raw(table, b"\n".join(lines[mid:]), fmt, settings)
                return
            raise _insert_error(table, exc) from exc

    def insert_arrow(self, table: str, data: pa.Table, settings: dict[str, Any] | None = None) -> None:
        """Insert an Arrow table (columns named as the table's): the fast path for column-wise writers (the
        attribution job, bulk import). ``settings``: ClickHouse settings for this INSERT only (on top of the
        session's), optimisations a store may forbid: probed once per set (:func:`accepted_settings`), and left
        out with a warning where the store refuses them. Errors as :meth:`insert`."""
        if data.num_rows == 0:
            return
        settings = self._if_accepted(settings, "inserts run without them")
        try:
            with self._lock:
                self.client.insert_arrow(table, data, settings=settings)
        except ch_exc.Error as exc:
            self._after_failure()
            if _halves(exc, data.num_rows):
                mid = data.num_rows // 2
                self.insert_arrow(table, data.slice(0, mid), settings)
                self.insert_arrow(table, data.slice(mid), settings)
                return
            raise _insert_error(table, exc) from exc
        except (*_SERIALISE_ERRORS, pa.ArrowException) as exc:
            raise RejectedRows(table, f"client could not serialise rows: {exc!r}") from exc

    def _if_accepted(self, settings: dict[str, Any] | None, instead: str) -> dict[str, Any] | None:
        """``settings`` when this store lets its user set them, else ``{}`` (one warning, :func:`accepted_settings`);
        probed once per set of settings."""
        if not settings:
            return settings
        key = tuple(sorted(settings.items()))
        if key not in self._accepted:
            with self._lock, self._translate("settings"):
                self._accepted[key] = accepted_settings(self.client, settings, instead)
        return self._accepted[key]

    # -- reads --------------------------------------------------------------------------------------------
    def query_df(self, statement: str, parameters: dict[str, Any] | None = None,
                 settings: dict[str, Any] | None = None, preferred: dict[str, Any] | None = None) -> pl.DataFrame:
        """Run a SELECT and return a polars DataFrame (through Arrow; DateTime64 columns stay datetimes).
        ``preferred``: settings used only where the store lets its user set them (probed once, as for
        :meth:`insert_arrow`), e.g. ``output_format_arrow_low_cardinality_as_dictionary``: the answer is the
        same without them, only its types or speed differ. The frame is one contiguous chunk per column: the
        store answers in blocks (261 Arrow batches for 5·10^5 rows), and polars works on a frame of many chunks
        up to 8 times slower (a filter, a sort and a comparison on a chunk of arrivals: 0.94 against 0.34 CPU-s,
        after 0.11 to join them; a gather of 4.5·10^5 rows: 0.67 against 0.08)."""
        settings = {**(settings or {}), **(self._if_accepted(preferred, "queries run without them") or {})}
        with self._translate("query"):
            table = self.client.query_arrow(statement, parameters=parameters, settings=settings or None)
        return pl.from_arrow(table).rechunk()  # type: ignore[union-attr]

    def query_rows(self, statement: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run a SELECT and return its rows as tuples (for small internal reads)."""
        with self._translate("query"):
            return list(self.client.query(statement, parameters=parameters).result_rows)

    def named(self, name: str, params: dict[str, str] | None = None) -> pl.DataFrame:
        """Run named query ``sql/queries/<name>.sql`` with typed parameters (defaults from its header).

        Raises :class:`QueryError` for an unknown query or parameter, a value the parameter does not allow
        (:func:`sql.check_value`: an impossible date, a bucket that is not whole minutes), or a failing query.
        """
        try:
            q = sqlfiles.load_query(name)
            bound = q.bind(params or {})
        except (KeyError, sqlfiles.HeaderError, sqlfiles.ParamError) as exc:
            raise QueryError(str(exc).strip('"')) from exc
        return self.query_df(q.sql, parameters=bound)

    def adhoc(self, statement: str) -> pl.DataFrame:
        """Run one user statement, read-only, under :attr:`adhoc_settings` (time, memory, result rows and bytes).

        ClickHouse parses the statement first (:data:`ingest.adhoc.FORMAT_QUERY`) and only reads run
        (:func:`ingest.adhoc.check_read_only`) that stay inside the database (its syntax tree,
        :data:`~ingest.adhoc.EXPLAIN_AST`, checked by :func:`~ingest.adhoc.check_sources`: no table function a
        read-only user may not call, no ``file()``, DESCRIBE of a table name only); the database's ``readonly``
        stays the guard. The query runs on the ad hoc client, never under the writers' lock, so ingestion goes on
        while it runs. On chDB that client is its own session, set read-only once (clickhouse-connect's chDB
        backend applies per-query settings with SET and cannot restore them after ``readonly=1``), with chDB's
        ``python()`` table function switched off; on a server the settings travel with each query, where they
        cannot outlive it (``readonly=2`` lets the request carry them).
        Returns at most :data:`~ingest.adhoc.ADHOC_MAX_ROWS` rows (exactly that many: the result may have been
        cut), repeated column names made unique (:func:`~ingest.adhoc.unique_names`), ``DateTime`` columns as
        datetimes (:func:`~ingest.adhoc.datetimes`, the types from :data:`~ingest.adhoc.DESCRIBE_RESULT`).
        Raises :class:`QueryError` (one line, :func:`~ingest.adhoc.error_line`) when the statement is not a
        single read, fails, exceeds a limit or its result cannot be read; :class:`StoreUnavailable` when the
        store cannot be reached.
        """
        for attempt in (1, 2):  # a read-only query is safe to run again after a garbled result
            try:
                table = self._adhoc_once(statement)
                break
            except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as exc:
                if attempt == 2:
                    raise QueryError(f"the result could not be read: {exc}") from exc
        df = to_polars(table.rename_columns(unique_names(table.column_names)))
        return df.head(ADHOC_MAX_ROWS)

    def _adhoc_once(self, statement: str) -> pa.Table:
        per_query = None if self.dsn.startswith("chdb:") else {**self.adhoc_settings, "readonly": 2}
        with self._adhoc_lock:
            client = self._adhoc_session()
            try:
                rendered = client.query(FORMAT_QUERY, parameters={"statement": statement},
                                        settings=per_query).result_rows[0][0]
                check_read_only(rendered, statement)
                if self._table_functions is None:
                    self._table_functions = frozenset(
                        r[0] for r in client.query(READONLY_TABLE_FUNCTIONS, settings=per_query).result_rows)
                check_sources(self._syntax_tree(client, rendered, per_query), self._table_functions)
                table = client.query_arrow(statement, settings=per_query)
                if needs_types(table) and rendered.startswith(("SELECT", "WITH", "(")):
                    described = client.query(DESCRIBE_RESULT.format(statement=rendered), settings=per_query)
                    types = [r[1] for r in described.result_rows]
                    table = readable(datetimes(table, types), types)
                return table
            except ch_exc.OperationalError as exc:
                self._drop_adhoc_session()
                raise StoreUnavailable(f"ad hoc query: {error_line(str(exc))}") from exc
            except ch_exc.Error as exc:
                # chDB can hand the next query on a session the rest of a failed Arrow result: start afresh
                self._drop_adhoc_session()
                raise QueryError(error_line(str(exc))) from exc
            except (pa.ArrowInvalid, OSError, UnicodeDecodeError):
                self._drop_adhoc_session()
                raise

    def _syntax_tree(self, client: Any, rendered: str, per_query: dict[str, Any] | None) -> list[str]:
        """The lines of ClickHouse's syntax tree of ``rendered`` (:data:`~ingest.adhoc.EXPLAIN_AST`); a tree over
        the ad hoc result cap (``max_result_rows``) is refused as too large to check."""
        try:
            return [r[0] for r in client.query(EXPLAIN_AST + rendered, settings=per_query).result_rows]
        except ch_exc.Error as exc:
            if _code(exc) != 396:  # TOO_MANY_ROWS_OR_BYTES
                raise
            self._drop_adhoc_session()
            raise QueryError(TOO_LARGE) from exc

    def _adhoc_session(self) -> Any:
        """The ad hoc client, opened on first use (call with ``_adhoc_lock`` held)."""
        if self._adhoc_client is None:
            try:
                client = clickhouse_connect.get_client(dsn=self.dsn, database=self.database)
                if self.dsn.startswith("chdb:"):
                    # chDB's python() reads the process's Python objects; once off, a session cannot turn it on
                    client.command("SET allow_python_table_function = 0")
                    # readonly last: then nothing can change
                    _set_session(client, {**EMBEDDED_SESSION_SETTINGS, **self.adhoc_settings})
            except ch_exc.Error as exc:
                raise StoreUnavailable(f"cannot open the ad hoc session at {self.dsn}: {exc}") from exc
            self._adhoc_client = client
        return self._adhoc_client

    def _drop_adhoc_session(self) -> None:
        client, self._adhoc_client = self._adhoc_client, None
        if client is not None:
            client.close()

    # -- schema -------------------------------------------------------------------------------------------
    def migrate(self) -> list[str]:
        """Apply ``sql/migrations`` not yet recorded in ``schema_migrations``; returns the versions applied.

        Migrations are safe to rerun (IF NOT EXISTS, guarded statements), so a crash between a migration and
        its record is safe.
        """
        self.command(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version String, applied_at DateTime64(3, 'UTC') "
            "DEFAULT now64(3)) ENGINE = ReplacingMergeTree ORDER BY version"
        )
        done = {r[0] for r in self.query_rows("SELECT version FROM schema_migrations")}
        applied = []
        for version, text in sqlfiles.migrations():
            if version in done:
                continue
            self.run_migration(text)
            self.insert("schema_migrations", [(version,)], ["version"])
            applied.append(version)
        return applied

    def run_migration(self, text: str) -> None:
        """Run every statement of one migration file, skipping a guarded statement whose guard is false
        (see :func:`split_statements`); on a cluster, with Replicated* engines (:func:`replicated`)."""
        for guard, statement in split_statements(text):
            if guard and not self.query_rows(guard)[0][0]:
                continue
            self.command(replicated(statement) if self.cluster else statement)

    def apply_retention(self, raw_days: int, rollup_days: int) -> list[str]:
        """Set each table's TTL to ``raw_days`` (raw tables) or ``rollup_days`` (rollups) when it differs;
        returns the tables changed. ClickHouse then drops expired parts in the background (partitions are
        days or months, so whole partitions go)."""
        changed = []
        current = dict(self.query_rows(
            "SELECT name, create_table_query FROM system.tables WHERE database = currentDatabase()"))
        for table, column, rollup in RETENTION:
            days = rollup_days if rollup else raw_days
            ttl = f"toDateTime({column}) + toIntervalDay({days})"
            query = current.get(table, "")
            if not query or f"toIntervalDay({days})" in query:
                continue
            self.command(f"ALTER TABLE {table} MODIFY TTL {ttl}")
            changed.append(table)
        return changed


#: (table, time column, is a rollup) of every table with a retention TTL (KVSCOPE_RETENTION_DAYS,
#: KVSCOPE_ROLLUP_RETENTION_DAYS).
RETENTION = (
    ("gateway_requests", "ts", False), ("request_keys", "ts", False), ("request_attribution", "ts", False),
    ("vllm_metrics", "ts", False), ("kv_block_events", "ts", False), ("kv_block_log", "ts", False),
    ("kv_pod_minutes", "minute", False), ("model_pod_minutes", "minute", False),
    ("kv_event_gaps", "detected_at", False), ("dead_letters", "ts", False), ("alert_state", "evaluated_at", False),
    ("workload_labels", "ts", False),
    ("requests_1m", "minute", True), ("requests_1h", "minute", True), ("misses_1m", "minute", True),
    ("misses_1h", "minute", True), ("affinity_1m", "minute", True), ("affinity_1h", "minute", True),
    ("vllm_1m", "minute", True), ("vllm_1h", "minute", True), ("vllm_cache_config", "ts", True),
    ("kv_block_sizes", "minute", True),
)
_MERGE_TREE = re.compile(
    r"\bENGINE\s*=\s*((?:Replacing|Aggregating|VersionedCollapsing|Collapsing|Summing)?MergeTree)\b")


def create_database(database: str, cluster: str = "") -> str:
    """The CREATE DATABASE statement: plain, or on ``cluster`` with the Replicated database engine (DDL in it
    is replicated to every replica; ClickHouse docs, "Replicated database engine")."""
    if not cluster:
        return f"CREATE DATABASE IF NOT EXISTS {database}"
    return (f"CREATE DATABASE IF NOT EXISTS {database} ON CLUSTER '{cluster}' "
            f"ENGINE = Replicated('/clickhouse/databases/{database}', '{{shard}}', '{{replica}}')")


def replicated(statement: str) -> str:
    """``statement`` with its MergeTree-family engine replaced by the Replicated* one (no arguments: in a
    Replicated database the Keeper path and replica name come from the database)."""
    return _MERGE_TREE.sub(lambda m: f"ENGINE = Replicated{m.group(1)}", statement)


_GUARD = re.compile(r"^\s*--\s*if:\s*(.+)$")


def split_statements(text: str) -> list[tuple[str, str]]:
    """Split a migration file into ``(guard, statement)`` on ``;`` at line ends, dropping comment-only chunks.

    A comment line ``-- if: SELECT ...`` inside a statement's chunk is its guard: the runner executes the
    statement only when that SELECT returns a true first value. ClickHouse has no conditional RENAME or
    INSERT; guards make such steps safe to rerun (e.g. "only if the old table still exists"). ``guard`` is
    "" for an unguarded statement.
    """
    out = []
    for chunk in re.split(r";\s*(?:\n|$)", text):
        guard = ""
        for line in chunk.splitlines():
            m = _GUARD.match(line)
            if m:
                guard = m.group(1).strip()
        body = "\n".join(line for line in chunk.splitlines() if not line.strip().startswith("--")).strip()
        if body:
            out.append((guard, body))
    return out
