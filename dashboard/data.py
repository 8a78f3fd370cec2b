"""How the dashboard pages reach the store and the sidebar's filters (ClickHouse → here → pages).

The store comes from, in order: a :class:`~ingest.store.Store` registered by the embedded process
(:func:`register_store`, called by ``kvscope up`` before it starts Streamlit in the same process: chDB allows
one process per data directory); else one opened from ``KVSCOPE_CLICKHOUSE_URL`` or ``KVSCOPE_DATA_DIR``
(+ ``KVSCOPE_DATABASE``, default ``kvscope``), cached for the Streamlit server's life.

Pages call :func:`named` (a named query with the sidebar's window, tenant and pod bound as typed parameters);
a failing query shows its error on the page and yields an empty frame, so a page never dies on a traceback.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import streamlit as st

import sql as sqlfiles
from ingest.errors import KvscopeError
from ingest.store import Store

_registered: Store | None = None
_lock = threading.Lock()

#: Sidebar time ranges: label → seconds back from now (None = all time).
TIME_RANGES: dict[str, int | None] = {
    "Last 15 min": 15 * 60,
    "Last 1 h": 3600,
    "Last 6 h": 6 * 3600,
    "Last 24 h": 24 * 3600,
    "All": None,
}
DEFAULT_TIME_RANGE = "Last 1 h"
#: Bucket widths (seconds) a chart may use: ~100 points per chart, never below a minute (the rollups' grain).
NICE_BUCKETS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
REFRESH_SECONDS = 10
ALL = ""  # a tenant/pod filter of '' means "all" in every named query

_EPOCH = "1970-01-01 00:00:00.000"
_FAR_FUTURE = "2200-01-01 00:00:00.000"


def register_store(store: Store | None) -> None:
    """Make ``store`` the one every dashboard session uses (embedded mode, same process); None unregisters."""
    global _registered
    with _lock:
        _registered = store


def registered_store() -> Store | None:
    return _registered


@st.cache_resource(show_spinner=False)
def _store_from_env(clickhouse_url: str, data_dir: str, database: str, adhoc_max_memory_bytes: int) -> Store:
    return Store.open(clickhouse_url=clickhouse_url or None, data_dir=data_dir or None, database=database,
                      adhoc_max_memory_bytes=adhoc_max_memory_bytes)


def get_store() -> Store:
    """The store: the registered one, else one from the environment.

    Raises :class:`RuntimeError` when neither is available, :class:`~ingest.errors.StoreUnavailable` when the
    configured store cannot be opened.
    """
    if _registered is not None:
        return _registered
    url = os.environ.get("KVSCOPE_CLICKHOUSE_URL", "")
    data_dir = os.environ.get("KVSCOPE_DATA_DIR", "")
    if not url and not data_dir:
        raise RuntimeError(
            "No store configured: run `kvscope up`, or set KVSCOPE_CLICKHOUSE_URL "
            "(a ClickHouse server) or KVSCOPE_DATA_DIR (a chDB directory no other process holds)."
        )
    from ingest.adhoc import ADHOC_MAX_MEMORY_BYTES

    memory = int(os.environ.get("KVSCOPE_ADHOC_MAX_MEMORY_BYTES", "") or ADHOC_MAX_MEMORY_BYTES)
    return _store_from_env(url, data_dir, os.environ.get("KVSCOPE_DATABASE", "kvscope"), memory)


# -- filters -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Filters:
    """The sidebar's choices. ``tenant``/``pod`` are '' for all; ``auto_refresh`` reruns pages every few s."""

    time_range: str = DEFAULT_TIME_RANGE
    tenant: str = ALL
    pod: str = ALL
    auto_refresh: bool = False

    def window(self, now: datetime | None = None) -> tuple[str, str]:
        """``(since, until)``: ClickHouse DateTime64(3) literals in UTC, computed now (live pages move on)."""
        seconds = TIME_RANGES.get(self.time_range)
        if seconds is None:
            return _EPOCH, _FAR_FUTURE
        now = now or datetime.now(UTC)
        return _fmt(now - timedelta(seconds=seconds)), _fmt(now + timedelta(minutes=1))

    def params(self, *, tenant: bool = True, pod: bool = True) -> dict[str, str]:
        since, until = self.window()
        out = {"since": since, "until": until}
        if tenant:
            out["tenant"] = self.tenant
        if pod:
            out["pod"] = self.pod
        return out


def _fmt(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def current_filters() -> Filters:
    """The filters the sidebar (``app.py``) stored for this run; defaults when a page runs on its own."""
    f = st.session_state.get("kvscope_filters")
    return f if isinstance(f, Filters) else Filters()


@dataclass(frozen=True)
class Buckets:
    """How a page's time charts are bucketed: ``seconds`` wide, over data that covers ``covered`` (the
    window's start or the first data, whichever is later, to the newest data). A bucket reaching outside
    ``covered`` holds only part of its time (the window's first bucket, the newest one still filling)."""

    seconds: int
    covered: tuple[datetime, datetime] | None = None


def buckets(f: Filters, now: datetime | None = None) -> Buckets:
    """The bucket width for the window (about a hundred points, at least 15 s) and the span the data covers."""
    first, last = extent()
    seconds = TIME_RANGES.get(f.time_range)
    if seconds is None:
        seconds = int((last - first).total_seconds()) if first and last else 3600
        start = first
    else:
        start = (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        start = max(start, first) if first else start
    target = seconds / 100
    width = next((b for b in NICE_BUCKETS if b >= target), NICE_BUCKETS[-1])
    return Buckets(width, (start, last) if start and last else None)


def bucket_seconds(f: Filters) -> int:
    """A chart bucket width for the window: about a hundred points, at least 15 s."""
    return buckets(f).seconds


# -- queries -------------------------------------------------------------------------------------------------
def named(name: str, **params: Any) -> pl.DataFrame:
    """Run named query ``name`` with ``params`` (strings or numbers); on failure show why, return empty."""
    try:
        return get_store().named(name, {k: str(v) for k, v in params.items()})
    except (KvscopeError, RuntimeError) as exc:
        st.error(f"Query `{name}` failed: {exc}")
        try:  # an empty frame with the header's columns, so the page's column references still hold
            return pl.DataFrame(schema={c.name: pl.String for c in sqlfiles.load_query(name).returns})
        except (KeyError, sqlfiles.HeaderError):
            return pl.DataFrame()


def data_extent() -> pl.DataFrame:
    return named("data_extent")


def extent() -> tuple[datetime | None, datetime | None]:
    """First and last ts over the gateway log and vLLM samples (None, None when both are empty)."""
    df = data_extent()
    if df.is_empty():
        return None, None
    df = df.filter(pl.col("table").is_in(["gateway_requests", "vllm_metrics"]) & (pl.col("rows") > 0))
    if df.is_empty():
        return None, None
    return df["first_ts"].min(), df["last_ts"].max()  # type: ignore[return-value]


def has_data() -> bool:
    """Whether the gateway log or the vLLM samples hold any row at all."""
    return extent()[0] is not None


def options(kind: str) -> list[str]:
    """Tenants or pods seen in the store (for the sidebar), '' (all) first."""
    df = named("dimensions")
    values = [] if df.is_empty() else df.filter(pl.col("kind") == kind)["value"].to_list()
    return [ALL, *values]


def live(render: Callable[[Filters], None]) -> None:
    """Run a page body, rerunning it every :data:`REFRESH_SECONDS` when auto-refresh is on."""
    f = current_filters()
    st.fragment(render, run_every=REFRESH_SECONDS if f.auto_refresh else None)(f)


# -- ad hoc SQL ----------------------------------------------------------------------------------------------
#: A ClickHouse DateTime result type (not DateTime64), its time zone in group 1: Arrow carries it as uint32.
_DATETIME = re.compile(r"(?:Nullable\()?(?:LowCardinality\()?DateTime(?:\('([^']*)'\))?\)*")
_CH_ERROR = re.compile(r"Code:\s*(\d+)\.\s*DB::Exception:\s*(.*)", re.S)


def adhoc(statement: str) -> pl.DataFrame:
    """Run read-only user SQL (the store enforces read-only and limits) with its DateTime columns as datetimes.

    ClickHouse's Arrow output carries ``DateTime`` as uint32 epoch seconds with no type metadata; the result's
    ClickHouse types come from ``DESCRIBE TABLE (<query>)`` (asked only when an integer column came back, and
    through the same read-only path), and those columns are cast back to UTC (or their own zone) datetimes.
    """
    store = get_store()
    df = store.adhoc(statement)
    ints = {name for name, dtype in df.schema.items() if dtype.is_integer()}
    if not ints:
        return df
    try:  # the newline keeps a trailing -- comment from swallowing the parenthesis
        types = store.adhoc(f"DESCRIBE TABLE (\n{statement.strip().rstrip(';')}\n)")
    except Exception:  # noqa: BLE001  (SHOW, EXPLAIN ...: not a subquery, so no types; show the integers)
        return df
    casts = []
    for name, ch_type in types.select("name", "type").iter_rows():
        m = _DATETIME.fullmatch(ch_type)
        if m and name in ints:
            at = pl.from_epoch(name, time_unit="s").dt.replace_time_zone("UTC")
            casts.append(at.dt.convert_time_zone(m.group(1)) if m.group(1) else at)
    try:
        return df.with_columns(casts) if casts else df
    except pl.exceptions.PolarsError:  # an unknown time zone name, say: keep the integers
        return df


def error_text(exc: BaseException) -> str:
    """A query error as one readable message: ClickHouse's text after ``DB::Exception:`` with its code, without
    the driver's prefixes and the server's version and stack trace; any other error as its type and message."""
    text = str(exc).strip()
    m = _CH_ERROR.search(text)
    if m:
        message = re.split(r"\s*(?:\(version [^)]*\)|Stack trace:)", m.group(2).strip())[0]
        return f"{message.strip()} [code {m.group(1)}]"
    if isinstance(exc, KvscopeError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
