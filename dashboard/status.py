"""Where the dashboard's numbers come from and how fresh they are: per-source freshness in the sidebar ("last scrape
12 s ago", "gateway log: 3 s ago", "no KV events: ..."), a banner when the newest data is old ("data is from
<time> (X min ago); no new data since"), and the start-up state that says what is starting instead of an empty page.

Freshness is the named query ``freshness`` (latest time and rows per source and pod, on the store's clock, over the
last day of data). What
the process watches (its pods, gateway logs, KV-event endpoint, scrape interval, when it started) comes from a
:class:`RunContext` that ``kvscope up`` / ``kvscope demo`` register before Streamlit starts in the same process;
``kvscope dashboard`` alone registers none, and the pages then say only what the store holds.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import streamlit as st

from dashboard import data

#: The newest data is old once it is older than this many scrape intervals (scrapes come every interval, so a
#: live pipeline never gets there; a second start over an old store, or a stopped collector, does).
STALE_SCRAPES = 3
DEFAULT_SCRAPE_INTERVAL = 5.0
NO_KV_EVENTS = ("no KV events: routed_away/evicted are inferred from which pod served the predecessor "
                "(docs/miss-causes.md)")

_context: RunContext | None = None
_lock = threading.Lock()


@dataclass(frozen=True)
class RunContext:
    """What the embedded process watches, for the start-up state and the freshness lines.

    ``config`` returns the settings in force (a :class:`kvscope.config.Config`; the demo fills in its pods once it
    starts them); ``step`` what the process is doing now, in words ('' when it has nothing to add); ``store`` how
    the store is named to a reader (e.g. ``chdb:///data (database kvscope)``).
    """

    started_at: datetime
    config: Callable[[], Any]
    step: Callable[[], str] = field(default=lambda: "")
    store: str = ""

    def pods(self) -> list[tuple[str, str]]:
        """(pod name, /metrics URL) of each configured vLLM target (empty when a target does not parse)."""
        from collector.service import parse_target

        try:
            return [(t.pod, t.metrics_url) for t in (parse_target(s) for s in self.config().list("vllm"))]
        except ValueError:
            return []

    def gateway_logs(self) -> list[str]:
        return list(self.config().list("gateway_log"))

    def kv_events_endpoint(self) -> str:
        return str(self.config().kv_events_endpoint or "")

    def scrape_interval(self) -> float:
        return float(self.config().scrape_interval_seconds)


def register_context(context: RunContext | None) -> None:
    """Make ``context`` the one every dashboard session reads (None unregisters)."""
    global _context
    with _lock:
        _context = context


def registered_context() -> RunContext | None:
    return _context


@dataclass(frozen=True)
class Fresh:
    """One source's freshness over the last day of data (named query ``freshness``): its latest time (UTC), that
    time's age on the store's clock (seconds), the rows it delivered, and each pod's latest time and age."""

    source: str
    last_ts: datetime
    age_seconds: float
    rows: int
    pods: dict[str, tuple[datetime, float]] = field(default_factory=dict)


#: How far back from the newest data the sidebar looks (the query's scan stays bounded at any store size).
LOOKBACK = timedelta(days=1)


#: How long one reading serves the sidebar and the banner of the same run (seconds).
REUSE_SECONDS = 2.0


def read() -> dict[str, Fresh]:
    """Each source with data in the last day of data (the day before the newest scrape or gateway line), by
    source name; empty when the store holds nothing (or a query failed, which :func:`dashboard.data.named`
    shows). The sidebar and the banner of one run share a reading (:data:`REUSE_SECONDS`)."""
    at, fresh = st.session_state.get("_kvscope_fresh", (0.0, None))
    if fresh is not None and time.monotonic() - at < REUSE_SECONDS:
        return fresh
    fresh = _read()
    st.session_state["_kvscope_fresh"] = (time.monotonic(), fresh)
    return fresh


def _read() -> dict[str, Fresh]:
    last = data.extent()[1]
    if last is None:
        return {}
    df = data.named("freshness", since=data.fmt(last - LOOKBACK))
    if df.is_empty() or "source" not in df.columns:
        return {}
    out = {}
    for (source,), rows in df.group_by("source", maintain_order=True):
        newest = rows.sort("last_ts").row(-1, named=True)
        pods = {r["pod"]: (r["last_ts"], r["age_seconds"]) for r in rows.iter_rows(named=True) if r["pod"]}
        out[source] = Fresh(str(source), newest["last_ts"], newest["age_seconds"], int(rows["rows"].sum()), pods)
    return out


def waiting(fresh: dict[str, Fresh]) -> int:
    """Requests in the gateway log without a miss-cause answer yet (the job answers each a few seconds after it
    is stored): gateway lines minus answered requests over the same day."""
    logged = fresh["gateway_log"].rows if "gateway_log" in fresh else 0
    answered = fresh["attribution"].rows if "attribution" in fresh else 0
    return max(logged - answered, 0)


def ago(seconds: float | None) -> str:
    """An age in words: "12 s ago", "3 min ago", "2 h ago", "4 d ago" ("just now" under a second or ahead)."""
    if seconds is None:
        return "never"
    if seconds < 1:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _at(t: datetime) -> str:
    return f"{t.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def scrape_interval(context: RunContext | None) -> float:
    """The collector's scrape interval: the running process's, else ``KVSCOPE_SCRAPE_INTERVAL_SECONDS``, else 5 s."""
    if context is not None:
        return context.scrape_interval()
    try:
        return float(os.environ.get("KVSCOPE_SCRAPE_INTERVAL_SECONDS", "") or DEFAULT_SCRAPE_INTERVAL)
    except ValueError:
        return DEFAULT_SCRAPE_INTERVAL


def _before_start(f: Fresh | None, context: RunContext | None) -> bool:
    return f is not None and context is not None and f.last_ts < context.started_at


def lines(fresh: dict[str, Fresh], context: RunContext | None) -> list[str]:
    """One sentence per source for the sidebar: how long ago it last delivered, or what it waits for."""
    out = []
    scrape = fresh.get("vllm_scrape")
    if scrape is None or _before_start(scrape, context):
        configured = ", ".join(name for name, _ in context.pods()) if context else ""
        if context is not None and not configured:
            out.append("vLLM: no pods configured (`--vllm`)")
        else:
            text = f"vLLM: first scrape pending{f' ({configured})' if configured else ''}"
            out.append(text + (f"; the last stored is from {_at(scrape.last_ts)}" if scrape else ""))
    else:
        per_pod = ", ".join(f"{pod} {ago(age).removesuffix(' ago')}" for pod, (_, age) in sorted(scrape.pods.items()))
        out.append(f"last scrape {ago(scrape.age_seconds)}" + (f" ({per_pod})" if len(scrape.pods) > 1 else ""))
    gateway = fresh.get("gateway_log")
    if gateway is None or _before_start(gateway, context):
        logs = ", ".join(context.gateway_logs()) if context else ""
        if context is not None and not logs:
            out.append("gateway log: none configured (`--gateway-log`)")
        elif gateway is not None:  # lines read at start-up from the log's backlog, none logged since
            out.append(f"gateway log: no request since this start; the latest is from {_at(gateway.last_ts)} "
                       f"({ago(gateway.age_seconds)})")
        else:
            out.append(f"gateway log: waiting for the first line{f' in {logs}' if logs else ''}")
    else:
        out.append(f"gateway log: {ago(gateway.age_seconds)} ({gateway.rows:,} lines in the last day of data)")
    kv = fresh.get("kv_events")
    if kv is None:
        endpoint = context.kv_events_endpoint() if context else ""
        out.append(NO_KV_EVENTS + (f"; listening on {endpoint}" if endpoint else ""))
    else:
        out.append(f"KV events: {ago(kv.age_seconds)}")
    answers = fresh.get("attribution")
    if answers is None and gateway is None:
        out.append("attribution: waiting for the first requests")
    else:
        n = waiting(fresh)
        latest = f"latest answer {ago(answers.age_seconds)}" if answers else "no answer yet"
        out.append(f"attribution: {latest}; {n:,} request{'s' if n != 1 else ''} waiting")
    return out


def stale_note(fresh: dict[str, Fresh], context: RunContext | None) -> str | None:
    """"Data is from <time> (X min ago); no new data since." when the newest scrape or gateway line is older than
    :data:`STALE_SCRAPES` scrape intervals; None while data is fresh or when there is none."""
    newest = [f for f in (fresh.get("vllm_scrape"), fresh.get("gateway_log")) if f]
    if not newest:
        return None
    latest = max(newest, key=lambda f: f.last_ts)
    if latest.age_seconds <= STALE_SCRAPES * scrape_interval(context):
        return None
    note = f"Data is from {_at(latest.last_ts)} ({ago(latest.age_seconds)}); no new data since."
    if context is not None and latest.last_ts < context.started_at:
        note += (f" kvscope started {ago((datetime.now(UTC) - context.started_at).total_seconds())}: the numbers "
                 "below are from before this start.")
    return note


def startup(context: RunContext) -> list[str]:
    """The start-up checklist (markdown lines) while the store holds no data yet."""
    fresh = read()
    items = [f"done: store open{f' ({context.store})' if context.store else ''}"]
    step = context.step()
    if step:
        items.append(f"now: {step}")
    pods = context.pods()
    scraped = set(fresh["vllm_scrape"].pods) if "vllm_scrape" in fresh else set()
    for name, url in pods:
        items.append(f"done: first scrape of {name}" if name in scraped else
                     f"pending: first scrape of {name} ({url}, every {scrape_interval(context):g} s)")
    if not pods:
        items.append("no vLLM pods configured (`--vllm`): the vLLM panels stay empty")
    for path in context.gateway_logs():
        items.append(f"waiting for the first gateway line in {path}")
    if not context.gateway_logs():
        items.append("no gateway log configured (`--gateway-log`): no per-request numbers or miss causes")
    endpoint = context.kv_events_endpoint()
    items.append(f"listening for KV events on {endpoint}" if endpoint else NO_KV_EVENTS)
    return items


def render_startup(context: RunContext) -> None:
    """The page body while nothing is stored yet: what is starting, instead of an empty page."""
    body = "\n".join(f"- {data_text(line)}" for line in startup(context))
    st.info(f"**kvscope is starting** (since {_at(context.started_at)}). The panels fill in as data arrives.\n\n"
            + body, icon=":material/hourglass_top:")


def data_text(text: str) -> str:
    """``text`` with its backticks kept and nothing else markdown (paths and URLs stay as written)."""
    return text.replace("*", "\\*").replace("_", "\\_")


def sidebar() -> None:
    """The sidebar's "Sources" block: one line per source, refreshed with the pages."""
    context = registered_context()
    fresh = read()
    st.caption("**Sources**  \n" + "  \n".join(data_text(line) for line in lines(fresh, context)))


def banner() -> None:
    """The old-data banner above every page (nothing while data is fresh)."""
    note = stale_note(read(), registered_context())
    if note:
        st.warning(note, icon=":material/history:")
