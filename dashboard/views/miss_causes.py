"""Miss causes: missed tokens by cause and sub-cause, per tenant, the drill-down to requests, and one request's
detail (its causes, predecessor, pods, gap, changed segment and evidence).

URL parameters (read here; the time range, tenant and pod are the sidebar's): ``cause`` and ``sub_cause``
preselect the drill-down's cause, ``request_id`` with ``ts`` (its arrival, ``2026-12-06T10:21:40.000Z``: request
ids can repeat across runs, a request is (request_id, ts); without ``ts`` the id's request with the most missed
tokens) opens a request's detail. Picking a cause or a row writes them back, so the URL reopens the same view.
"""

from __future__ import annotations

from datetime import datetime

import polars as pl
import streamlit as st

from dashboard import causes as vocabulary
from dashboard import charts, data, findings, fix_first, request_detail

st.header("Miss causes")
st.caption(
    "Every missed prompt token (prompt − cached) is attributed to one cause: unavoidable, below_block, "
    "cold, beyond_horizon, routed_away, evicted, prefix_drift (by the first segment that changed) or unknown; a "
    "request whose "
    "pod did not report its cached count puts all its prompt tokens under not_reported: unknown hits, shown "
    "apart, not counted as missed."
)

ALL_CAUSES = "All causes"


def label(df: pl.DataFrame) -> pl.DataFrame:
    """Adds ``label`` = 'cause' or 'cause / sub_cause'."""
    return df.with_columns(
        pl.when(pl.col("sub_cause") == "")
        .then(pl.col("cause"))
        .otherwise(pl.concat_str(["cause", "sub_cause"], separator=" / "))
        .alias("label")
    )


def ordered(labels: list[str]) -> list[str]:
    """Cause labels in the legend order every view uses (:data:`dashboard.causes.CAUSE_ORDER`, sub-causes by
    name within their cause)."""
    def key(lab: str) -> tuple[int, str]:
        cause, _, sub = lab.partition(" / ")
        order = vocabulary.CAUSE_ORDER
        return (order.index(cause) if cause in order else len(order), sub)
    return sorted(labels, key=key)


def url_cause(choices: list[str]) -> list[str]:
    """Preselect the cause the URL names (``cause``/``sub_cause``) when the URL changed since the last run (a
    link was followed). Returns ``choices`` with the picked cause added when the window has none of its misses
    (its drill-down is then empty, not silently another cause)."""
    wanted = (st.query_params.get("cause", ""), st.query_params.get("sub_cause", ""))
    if st.session_state.get("_miss_cause_url") != wanted:
        st.session_state["_miss_cause_url"] = wanted
        st.session_state["miss_cause"] = vocabulary.label(*wanted) if wanted[0] else ALL_CAUSES
    current = st.session_state.get("miss_cause")
    return choices if not current or current in choices else [*choices, current]


def set_url(name: str, value: str) -> None:
    """Write ``name`` to the URL ('' removes it)."""
    if value:
        st.query_params[name] = value
    elif name in st.query_params:
        del st.query_params[name]


def picked_cause(picked: str) -> tuple[str, str]:
    """``(cause, sub_cause)`` of a selectbox label ('', '' for all), also written to the URL."""
    cause, _, sub_cause = ("", "", "") if picked == ALL_CAUSES else picked.partition(" / ")
    st.session_state["_miss_cause_url"] = (cause, sub_cause)
    set_url("cause", cause)
    set_url("sub_cause", sub_cause)
    return cause, sub_cause


def picked_request(event: object, rows: pl.DataFrame) -> tuple[str, datetime | None]:
    """The request ``(request_id, ts)`` whose detail to show: the table's selected row, else the URL's
    ``request_id`` and ``ts`` (cleared when the user unselects the row that set them); written to the URL. ``ts``
    None: by the id alone (a link without ``ts``)."""
    selected = list(getattr(getattr(event, "selection", None), "rows", None) or [])
    was = st.session_state.get("_miss_selected", "")
    ts: datetime | None = None
    if selected and selected[0] < rows.height:
        rid, ts = rows["request_id"][selected[0]], rows["ts"][selected[0]]
    elif was:
        rid = ""  # the row that opened the detail was unselected: close it
    else:
        rid = st.query_params.get("request_id", "")
        ts = findings.parse_ts_param(st.query_params.get("ts")) if rid else None
    st.session_state["_miss_selected"] = rid if selected else ""
    set_url("request_id", rid)
    set_url("ts", findings.ts_param(ts) if rid and ts is not None else "")
    return rid, ts


def drill_down(f: data.Filters, causes: pl.DataFrame, price: float, currency: str) -> None:
    """The requests of the picked cause (named query ``miss_requests``) with what each one's missed tokens cost
    (``gpu_seconds``, and ``cost (<currency>)`` when ``price`` per GPU-hour > 0), and the picked request's
    detail."""
    st.subheader("Requests")
    choices = url_cause([ALL_CAUSES, *causes["label"].to_list()])
    left, right = st.columns([3, 1])
    picked = left.selectbox("Cause", choices, key="miss_cause")
    limit = right.number_input("Rows", min_value=10, max_value=10_000, value=100, step=50, key="miss_limit")
    cause, sub_cause = picked_cause(picked or ALL_CAUSES)
    rows = data.named("miss_requests", **f.params(), cause=cause, sub_cause=sub_cause, limit=int(limit))
    if rows.is_empty():
        st.caption(charts.NO_DATA_IN_WINDOW)
        event = None
    else:
        st.caption("Pick a row to see the request's predecessor, pods, gap, changed segment and evidence.")
        shown = findings.with_cost_column(rows, price, currency)
        event = st.dataframe(charts.shown_strings(shown), hide_index=True, placeholder=charts.MISSING,
                             key="miss_requests", on_select="rerun", selection_mode="single-row")
    request_id, ts = picked_request(event, rows)
    if request_id:
        request_detail.render(request_id, f, ts)


def _total(values: pl.Series) -> float | None:
    """The sum of a cost column, None when any row's cost is unknown (no prefill measurement)."""
    return None if values.is_empty() or values.null_count() else float(values.sum())


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    everything = data.named("miss_causes", **f.params())
    if everything.is_empty():
        st.info(
            "No attributed misses in this time range and filter yet: the attribution job writes miss causes "
            "a few seconds after the gateway logs a request. Widen the time range if traffic is older.",
            icon=":material/hourglass_empty:",
        )
        if st.query_params.get("request_id"):  # a shared link to a request outside the range still opens it
            request_detail.render(st.query_params["request_id"], f,
                                  findings.parse_ts_param(st.query_params.get("ts")))
        return
    everything = label(everything)
    price, currency = fix_first.gpu_hour_price()
    # not_reported holds the prompt tokens whose hits are unknown: shown apart, never as missed (as the Overview)
    unknown = findings.unknown_tokens(everything)
    causes = findings.known_misses(everything)
    if causes.is_empty():
        st.info(f"No missed tokens among the requests whose hits are known in this time range and filter; "
                f"{charts.count(unknown)} prompt tokens have unknown hits (the pod did not report the cached count).",
                icon=":material/help:")
        drill_down(f, findings.with_money(everything, price), price, currency)
        return
    total = int(causes["missed_tokens"].sum())
    top = causes.row(0, named=True)
    causes = findings.with_money(causes, price)
    cols = st.columns([1, 1.8, 1, 1, 1])  # room for the longest sub-cause, evicted_before_next_turn
    cols[0].metric("Missed tokens", charts.count(total),
                   help="prompt − cached over the requests whose cached count is known, as the Overview's")
    cols[1].metric(  # the sub-cause says most; its cause goes under it
        "Largest cause",
        top["sub_cause"] or top["cause"],
        delta=top["cause"] if top["sub_cause"] else None,
        delta_color="off",
        delta_arrow="off",
        help=f"{top['label']}: {charts.count(top['missed_tokens'])} missed tokens",
    )
    cols[2].metric("Its share of missed tokens", charts.pct(top["share_of_missed"], 1))
    cols[3].metric("Re-compute cost", findings.cost_text(_total(causes["gpu_seconds"]), _total(causes["money"]),
                                                         currency),
                   help="GPU-seconds of prefill the missed tokens cost (docs/miss-causes.md, Cost of a miss)")
    cols[4].metric("Unknown hits (not reported)", charts.count(unknown),
                   help="Prompt tokens of requests whose pod did not report the cached count (cause not_reported): "
                   "their hits are unknown, so they are neither missed tokens nor in the shares, and cost nothing "
                   "here")
    charts.bars(
        causes.sort("missed_tokens"),
        "label",
        "missed_tokens",
        "Missed tokens by cause",
        color="label",
        color_map=vocabulary.color_map(causes["label"].to_list()),
        horizontal=True,
        key="cause_bars",
    )
    columns = ["cause", "sub_cause", "missed_tokens", "share_of_missed", "gpu_seconds", "requests"]
    charts.table(findings.with_cost_column(causes.select(columns), price, currency), percent_cols=["share_of_missed"],
                 key="cause_table")
    per_tenant = findings.known_misses(data.named("miss_causes", **f.params(), by_tenant=1))
    if not per_tenant.is_empty():
        per_tenant = label(per_tenant)
        order = ordered(per_tenant["label"].unique().to_list())
        rank = {lab: i for i, lab in enumerate(order)}
        charts.bars(
            per_tenant.sort(pl.col("label").replace_strict(rank, return_dtype=pl.Int32), "tenant_id"),
            "tenant_id",
            "missed_tokens",
            "Missed tokens per tenant by cause",
            color="label",
            color_map=vocabulary.color_map(order),
            barmode="stack",
            key="cause_tenants",
        )
    drill_down(f, findings.with_money(everything, price), price, currency)


data.live(render)
