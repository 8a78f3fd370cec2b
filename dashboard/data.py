"""How the dashboard pages reach the store and the sidebar's filters (ClickHouse → here → pages).

The store comes from, in order: a :class:`~ingest.store.Store` registered by the embedded process
(:func:`register_store`, called by ``kvscope up`` before it starts Streamlit in the same process: chDB allows
one process per data directory); else one opened from ``KVSCOPE_CLICKHOUSE_URL`` or ``KVSCOPE_DATA_DIR``
(+ ``KVSCOPE_DATABASE``, default ``kvscope``), cached for the Streamlit server's life.

Pages call :func:`named` (a named query with the sidebar's window, tenant, pod and model bound as typed
parameters); a failing query shows its error on the page and yields an empty frame, so a page never dies on a
traceback.

The filters live in the URL (docs/dashboard.md): ``range`` (15m, 1h, 6h, 24h, 7d, all) or ``from``/``to`` (ISO 8601,
UTC) for an absolute window, ``tenant``, ``pod`` and ``model`` ('' or absent = all). :meth:`Filters.from_query`
reads them, :meth:`Filters.query` writes them; ``app.py`` keeps the URL and the sidebar in step both ways.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import streamlit as st

import sql as sqlfiles
from dashboard import untrusted
from ingest.errors import KvscopeError
from ingest.store import Store

_registered: Store | None = None
_lock = threading.Lock()

#: Time range presets: URL code → (sidebar label, seconds back from now; None = all time).
RANGES: dict[str, tuple[str, int | None]] = {
    "15m": ("Last 15 min", 15 * 60),
    "1h": ("Last 1 h", 3600),
    "6h": ("Last 6 h", 6 * 3600),
    "24h": ("Last 24 h", 24 * 3600),
    "7d": ("Last 7 d", 7 * 24 * 3600),
    "all": ("All", None),
}
#: Sidebar time ranges: label → seconds back from now (None = all time).
TIME_RANGES: dict[str, int | None] = dict(RANGES.values())
RANGE_CODES: dict[str, str] = {label: code for code, (label, _) in RANGES.items()}
#: The sidebar's choice for an absolute window (URL ``from``/``to``).
CUSTOM = "From / to (UTC)"
DEFAULT_TIME_RANGE = "Last 1 h"
#: Bucket widths (seconds) a chart may use: ~100 points per chart, never below a minute (the rollups' grain).
NICE_BUCKETS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
REFRESH_SECONDS = 10
ALL = ""  # a tenant/pod/model filter of '' means "all" in every named query
#: The URL query parameters the filters own (pages may add their own, e.g. the Miss causes page's ``cause``).
FILTER_PARAMS = ("range", "from", "to", "tenant", "pod", "model")

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

    Raises :class:`RuntimeError` when neither is available, :class:`~kvscope.config.ConfigError` for a bad
    ``KVSCOPE_`` value (named), :class:`~ingest.errors.StoreUnavailable` when the configured store cannot be opened.
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
    from kvscope.config import build_config

    cfg = build_config()  # a bad KVSCOPE_ value: ConfigError naming it
    return _store_from_env(cfg.clickhouse_url, "" if cfg.clickhouse_url else cfg.data_dir, cfg.database,
                           cfg.adhoc_max_memory_bytes)


# -- filters -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Filters:
    """The sidebar's choices. ``time_range`` is a :data:`TIME_RANGES` label, or :data:`CUSTOM` with ``start`` and
    ``end`` (UTC datetimes: the window [start, end)); ``tenant``/``pod``/``model`` are '' for all;
    ``auto_refresh`` reruns pages every few seconds."""

    time_range: str = DEFAULT_TIME_RANGE
    tenant: str = ALL
    pod: str = ALL
    auto_refresh: bool = False
    model: str = ALL
    start: datetime | None = None
    end: datetime | None = None

    @property
    def absolute(self) -> bool:
        """Whether the window is the absolute [start, end) rather than a span back from now."""
        return self.time_range == CUSTOM and self.start is not None and self.end is not None

    def bounds(self, now: datetime | None = None) -> tuple[datetime | None, datetime | None]:
        """The window as UTC datetimes: [start, end), or (now − range, now); (None, None) for all time."""
        if self.absolute:
            return self.start, self.end
        seconds = TIME_RANGES.get(self.time_range, TIME_RANGES[DEFAULT_TIME_RANGE])
        if seconds is None:
            return None, None
        now = now or datetime.now(UTC)
        return now - timedelta(seconds=seconds), now

    def window(self, now: datetime | None = None) -> tuple[str, str]:
        """``(since, until)``: ClickHouse DateTime64(3) literals in UTC, computed now (live pages move on; a span
        back from now ends a minute ahead, so the newest data is in)."""
        if self.absolute:
            return _fmt(self.start), _fmt(self.end)  # type: ignore[arg-type]
        start, end = self.bounds(now)
        if start is None or end is None:
            return _EPOCH, _FAR_FUTURE
        return _fmt(start), _fmt(end + timedelta(minutes=1))

    def params(self, *, tenant: bool = True, pod: bool = True, model: bool = True) -> dict[str, str]:
        """The named queries' ``since``, ``until``, ``tenant``, ``pod`` and ``model`` (those asked for)."""
        since, until = self.window()
        out = {"since": since, "until": until}
        if tenant:
            out["tenant"] = self.tenant
        if pod:
            out["pod"] = self.pod
        if model:
            out["model"] = self.model
        return out

    def query(self) -> dict[str, str]:
        """The URL query parameters of these filters: ``range`` or ``from``/``to``, and the set ones of
        ``tenant``, ``pod``, ``model`` (an unset filter is left out: '' = all)."""
        if self.absolute:
            out = {"from": iso(self.start), "to": iso(self.end)}  # type: ignore[arg-type]
        else:
            out = {"range": RANGE_CODES.get(self.time_range, RANGE_CODES[DEFAULT_TIME_RANGE])}
        out.update({k: v for k, v in (("tenant", self.tenant), ("pod", self.pod), ("model", self.model)) if v})
        return out

    @classmethod
    def from_query(cls, params: Mapping[str, str], *, auto_refresh: bool = False) -> Filters:
        """Filters from URL query parameters (see :meth:`query`); ``from``/``to`` win over ``range``. A value
        that does not parse (an unknown range, a time that is not ISO 8601, ``to`` not after ``from``) falls
        back to the default it replaces: a shared link never breaks the page."""
        start, end = parse_time(params.get("from", "")), parse_time(params.get("to", ""))
        time_range = RANGES.get(params.get("range", ""), (DEFAULT_TIME_RANGE, 0))[0]
        if start is not None and end is not None and end > start:
            time_range = CUSTOM
        else:
            start = end = None
        return cls(time_range=time_range, tenant=params.get("tenant", ALL), pod=params.get("pod", ALL),
                   model=params.get("model", ALL), auto_refresh=auto_refresh, start=start, end=end)


def fmt(t: datetime) -> str:
    """``t`` as a ClickHouse DateTime64(3) literal in UTC: ``2026-11-29 12:00:00.000``."""
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


_fmt = fmt


def iso(t: datetime) -> str:
    """``t`` as ISO 8601 UTC for a URL: ``2026-11-29T12:00:00Z`` (milliseconds only when it has some)."""
    t = t.astimezone(UTC)
    ms = f".{t.microsecond // 1000:03d}" if t.microsecond // 1000 else ""
    return t.strftime("%Y-%m-%dT%H:%M:%S") + ms + "Z"


def parse_time(text: str) -> datetime | None:
    """An ISO 8601 time (``2026-11-29T12:00:00Z``, ``+01:00`` offsets; no offset = UTC) as a UTC datetime, or
    None when ``text`` is empty or not such a time, or when its offset moves it out of the years 1..9999 in UTC
    (``9999-12-31T23:59:59-01:00`` in a shared link's ``to`` was an OverflowError: the page broke)."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
        return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    except (ValueError, OverflowError):
        return None


def current_filters() -> Filters:
    """The filters the sidebar (``app.py``) stored for this run; defaults when a page runs on its own."""
    f = st.session_state.get("kvscope_filters")
    return f if isinstance(f, Filters) else Filters()


@dataclass(frozen=True)
class Buckets:
    """How a page's time charts are bucketed: ``seconds`` wide, over data that covers ``covered`` (the
    window's start or the first data, whichever is later, to the newest data). A bucket reaching outside
    ``covered`` holds only part of its time (the window's first bucket, the newest one still filling).
    ``span`` is the chosen window, which every time chart's x-axis shows whole (all time: the data's span)."""

    seconds: int
    covered: tuple[datetime, datetime] | None = None
    span: tuple[datetime, datetime] | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """The bucket width in words, for chart titles: "1 bucket = 5 min"."""
        return f"1 bucket = {duration(self.seconds)}"


def duration(seconds: float) -> str:
    """A duration in its largest whole unit: "45 s", "5 min", "2 h", "1 d" (fractions rounded: "90 min")."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def buckets(f: Filters, now: datetime | None = None) -> Buckets:
    """The bucket width for the window (about a hundred points, at least a minute: the rollups' grain), the span
    the data covers, and the window the time axis shows."""
    first, last = extent()
    start, end = f.bounds(now)
    if start is None or end is None:  # all time: the data's own span
        start, end = first, last
    seconds = (end - start).total_seconds() if start and end else 3600
    width = next((b for b in NICE_BUCKETS if b >= seconds / 100), NICE_BUCKETS[-1])
    covered = None
    if first and last and start and end:
        covered = (max(start, first), min(last, end))
    return Buckets(width, covered, (start, end) if start and end else None)


def bucket_seconds(f: Filters) -> int:
    """A chart bucket width for the window: about a hundred points, at least a minute."""
    return buckets(f).seconds


# -- queries -------------------------------------------------------------------------------------------------
def named(name: str, **params: Any) -> pl.DataFrame:
    """Run named query ``name`` with ``params`` (strings or numbers); on failure show why, return empty."""
    try:
        return get_store().named(name, {k: str(v) for k, v in params.items()})
    except (KvscopeError, RuntimeError) as exc:
        st.error(f"Query `{name}` failed: {untrusted.markdown(error_text(exc))}")
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


def options(kind: str, keep: str = ALL, dimensions: pl.DataFrame | None = None) -> list[str]:
    """Tenants, pods or models (``kind``) seen in the store (for the sidebar), '' (all) first; ``keep`` (e.g. a
    value from a shared URL that has no data here) is listed too, so the view it names still opens.
    ``dimensions``: the named query's result when the caller already has it."""
    df = named("dimensions") if dimensions is None else dimensions
    values = [] if df.is_empty() else df.filter(pl.col("kind") == kind)["value"].to_list()
    return [ALL, *values, *([keep] if keep and keep not in values else [])]


def live(render: Callable[[Filters], None]) -> None:
    """Run a page body, rerunning it every :data:`REFRESH_SECONDS` when auto-refresh is on."""
    f = current_filters()
    st.fragment(render, run_every=REFRESH_SECONDS if f.auto_refresh else None)(f)


# -- ad hoc SQL ----------------------------------------------------------------------------------------------
_CH_ERROR = re.compile(r"Code:\s*(\d+)\.\s*DB::Exception:\s*(.*)", re.S)


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
