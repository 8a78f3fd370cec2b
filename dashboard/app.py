"""kvscope dashboard entry point: ``streamlit run dashboard/app.py`` (``kvscope up`` runs it in-process).

Draws the sidebar (time range, absolute from/to, tenant, pod, model, auto-refresh, each source's freshness),
keeps those filters and the URL in step both ways (a shared URL reopens the same view; a changed filter updates the
URL: scheme in :mod:`dashboard.data`), stores the choices for the pages in ``st.session_state["kvscope_filters"]``,
says above every page when the newest data is old, and runs the page picked in the navigation.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `streamlit run dashboard/app.py` puts only dashboard/ on the path
    sys.path.insert(0, _ROOT)

import polars as pl  # noqa: E402
import streamlit as st  # noqa: E402

from dashboard import data, status  # noqa: E402

st.set_page_config(page_title="kvscope", page_icon=":material/memory:", layout="wide")
# No "Deploy" button and developer menu: the option takes effect from the next run on, the CSS at once.
st.set_option("client.toolbarMode", "viewer")
st.html("<style>[data-testid='stAppDeployButton'] {display: none}</style>")

VIEWS = Path(__file__).parent / "views"
PAGES = [
    st.Page(VIEWS / "overview.py", title="Overview", icon=":material/speed:", default=True),
    st.Page(VIEWS / "tenants.py", title="Tenants", icon=":material/groups:"),
    st.Page(VIEWS / "miss_causes.py", title="Miss causes", icon=":material/troubleshoot:"),
    st.Page(VIEWS / "fingerprints.py", title="Fingerprints", icon=":material/fingerprint:"),
    st.Page(VIEWS / "pods.py", title="Pods", icon=":material/dns:"),
    st.Page(VIEWS / "vllm.py", title="vLLM", icon=":material/monitoring:"),
    st.Page(VIEWS / "ttl.py", title="Agent TTL", icon=":material/timer:"),
    st.Page(VIEWS / "data_quality.py", title="Data quality", icon=":material/rule:"),
    st.Page(VIEWS / "alerts.py", title="Alerts", icon=":material/notifications:"),
    st.Page(VIEWS / "adhoc_sql.py", title="SQL", icon=":material/terminal:"),
]
#: The filter parameters this session last wrote to the URL (to tell a link followed from a page switch).
WRITTEN = "kvscope_url_filters"


def url_filters() -> dict[str, str]:
    """The filter parameters in the URL now."""
    return {k: st.query_params[k] for k in data.FILTER_PARAMS if k in st.query_params}


def _naive(t: datetime) -> datetime:
    """A UTC time as the date/time pickers show it (they carry no zone)."""
    return t.astimezone(UTC).replace(tzinfo=None)


def _minute(t: datetime | None) -> datetime | None:
    return None if t is None else _naive(t).replace(second=0, microsecond=0)


def seed_from_url() -> None:
    """Set the sidebar to the view the URL names: on a session's first run, and whenever the URL's filters changed
    from outside (a link followed inside the app). A URL without filters (a page switch) keeps the sidebar's."""
    url = url_filters()
    written = st.session_state.get(WRITTEN)
    if written is not None and (not url or url == written):
        return
    f = data.Filters.from_query(url)
    st.session_state.update(time_range=f.time_range, tenant=f.tenant, pod=f.pod, model=f.model)
    if f.absolute:  # the pickers show minutes; the URL's seconds are kept while the pickers show that minute
        st.session_state.update(range_from=_minute(f.start), range_to=_minute(f.end), range_exact=(f.start, f.end))


def write_url(f: data.Filters) -> None:
    """Put ``f`` in the URL (its filter parameters only; a page's own, e.g. ``cause``, stay)."""
    want = f.query()
    if url_filters() != want:
        for k in data.FILTER_PARAMS:
            if k in st.query_params and k not in want:
                del st.query_params[k]
        st.query_params.update(want)
    st.session_state[WRITTEN] = want


def absolute_range() -> tuple[datetime | None, datetime | None]:
    """The From / To pickers (UTC, minute steps), first set to the last hour; (start, end) as UTC datetimes (to
    the second when they still show the URL's window)."""
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    st.session_state.setdefault("range_from", _naive(now - timedelta(hours=1)))
    st.session_state.setdefault("range_to", _naive(now + timedelta(minutes=1)))
    start = st.datetime_input("From (UTC)", key="range_from", step=60, format="YYYY-MM-DD")
    end = st.datetime_input("To (UTC)", key="range_to", step=60, format="YYYY-MM-DD")
    exact = st.session_state.get("range_exact")
    if exact and (_minute(exact[0]), _minute(exact[1])) == (start, end):
        return exact  # a URL's window to the second (e.g. a drill-down link), as long as the pickers show it
    if start is None or end is None or end <= start:
        st.error("Pick a From before To; the last hour is shown meanwhile.")
        return None, None
    return start.replace(tzinfo=UTC), end.replace(tzinfo=UTC)


def choice(label: str, kind: str, everything: str, dims: pl.DataFrame) -> str:
    """A tenant/pod/model select box ('' = all) over what the store has seen."""
    st.session_state.setdefault(kind, data.ALL)
    values = data.options(kind, st.session_state[kind], dimensions=dims)
    return st.selectbox(label, values, key=kind, format_func=lambda v: v or everything) or data.ALL


def sidebar() -> data.Filters:
    seed_from_url()
    st.session_state.setdefault("time_range", data.DEFAULT_TIME_RANGE)
    with st.sidebar:
        st.title("kvscope")
        st.caption("Prefix-cache hit rate per token, and why the rest missed.")
        time_range = st.selectbox("Time range", [*data.TIME_RANGES, data.CUSTOM], key="time_range")
        start, end = absolute_range() if time_range == data.CUSTOM else (None, None)
        dims = data.named("dimensions")
        tenant = choice("Tenant", "tenant", "All tenants", dims)
        pod = choice("Pod", "pod", "All pods", dims)
        model = choice("Model", "model", "All models", dims)
        auto = st.toggle(f"Auto-refresh every {data.REFRESH_SECONDS} s", key="auto_refresh", value=True)
        st.fragment(status.sidebar, run_every=data.REFRESH_SECONDS if auto else None)()
    f = data.Filters(time_range=time_range or data.DEFAULT_TIME_RANGE, tenant=tenant, pod=pod, model=model,
                     auto_refresh=auto, start=start, end=end)
    if time_range == data.CUSTOM and not f.absolute:  # an unusable pair: the URL keeps the default range
        f = data.Filters(tenant=tenant, pod=pod, model=model, auto_refresh=auto)
    write_url(f)
    return f


try:
    data.get_store()
except Exception as exc:  # noqa: BLE001  (no store: say how to get one instead of a traceback)
    st.error(f"kvscope cannot reach its store: {exc}")
    st.stop()
st.session_state["kvscope_filters"] = filters = sidebar()
st.fragment(status.banner, run_every=data.REFRESH_SECONDS if filters.auto_refresh else None)()
st.navigation(PAGES).run()
