"""kvscope dashboard entry point: ``streamlit run dashboard/app.py`` (``kvscope up`` runs it in-process).

Draws the sidebar (time range, tenant, pod, auto-refresh), stores the choices for the pages in
``st.session_state["kvscope_filters"]`` and runs the page picked in the navigation.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `streamlit run dashboard/app.py` puts only dashboard/ on the path
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from dashboard import data  # noqa: E402

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
    st.Page(VIEWS / "data_quality.py", title="Data quality", icon=":material/rule:"),
    st.Page(VIEWS / "alerts.py", title="Alerts", icon=":material/notifications:"),
    st.Page(VIEWS / "adhoc_sql.py", title="SQL", icon=":material/terminal:"),
]


def sidebar() -> data.Filters:
    with st.sidebar:
        st.title("kvscope")
        st.caption("Prefix-cache hit rate per token, and why the rest missed.")
        time_range = st.selectbox(
            "Time range",
            list(data.TIME_RANGES),
            key="time_range",
            index=list(data.TIME_RANGES).index(data.DEFAULT_TIME_RANGE),
        )
        tenant = st.selectbox(
            "Tenant", data.options("tenant"), key="tenant", format_func=lambda v: v or "All tenants"
        )
        pod = st.selectbox("Pod", data.options("pod"), key="pod", format_func=lambda v: v or "All pods")
        auto = st.toggle(f"Auto-refresh every {data.REFRESH_SECONDS} s", key="auto_refresh", value=True)
    return data.Filters(
        time_range=time_range or data.DEFAULT_TIME_RANGE,
        tenant=tenant or data.ALL,
        pod=pod or data.ALL,
        auto_refresh=auto,
    )


try:
    data.get_store()
except Exception as exc:  # noqa: BLE001  (no store: say how to get one instead of a traceback)
    st.error(f"kvscope cannot reach its store: {exc}")
    st.stop()
st.session_state["kvscope_filters"] = sidebar()
st.navigation(PAGES).run()
