"""Miss causes: missed tokens by cause and sub-cause, per tenant, and the drill-down to request ids."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboard import causes, charts, data

st.header("Miss causes")
st.caption(
    "Every missed prompt token (prompt − cached) is attributed to one cause: unavoidable, below_block, "
    "cold, routed_away, evicted, prefix_drift (by the first segment that changed) or unknown; a request whose "
    "pod did not report its cached count puts all its prompt tokens under not_reported."
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
        return (causes.CAUSE_ORDER.index(cause) if cause in causes.CAUSE_ORDER else len(causes.CAUSE_ORDER), sub)
    return sorted(labels, key=key)


#: The cause label this page last wrote to the URL (``cause``/``sub_cause``), to tell a followed link from a rerun.
URL_CAUSE = "miss_cause_url"


def cause_from_url(choices: list[str]) -> None:
    """Set the Cause box to the URL's ``cause``/``sub_cause`` when the URL names another one than this page last
    wrote (a shared link, a "fix first" card); an unknown cause shows all causes."""
    wanted = causes.label(st.query_params.get("cause", ""), st.query_params.get("sub_cause", "")) or ALL_CAUSES
    if st.session_state.get(URL_CAUSE) != wanted or "miss_cause" not in st.session_state:
        st.session_state["miss_cause"] = wanted if wanted in choices else ALL_CAUSES
        st.session_state[URL_CAUSE] = wanted


def cause_to_url(cause: str, sub_cause: str) -> None:
    """The picked cause into the URL (``cause``, ``sub_cause``; none for all causes)."""
    for k, v in (("cause", cause), ("sub_cause", sub_cause)):
        if v and st.query_params.get(k) != v:
            st.query_params[k] = v
        elif not v and k in st.query_params:
            del st.query_params[k]
    st.session_state[URL_CAUSE] = causes.label(cause, sub_cause) or ALL_CAUSES


def drill_down(f: data.Filters, by_cause: pl.DataFrame) -> None:
    st.subheader("Requests")
    choices = [ALL_CAUSES, *by_cause["label"].to_list()]
    cause_from_url(choices)
    left, right = st.columns([3, 1])
    picked = left.selectbox("Cause", choices, key="miss_cause")
    limit = right.number_input("Rows", min_value=10, max_value=10_000, value=100, step=50, key="miss_limit")
    cause, sub_cause = "", ""
    if picked != ALL_CAUSES:
        row = by_cause.filter(pl.col("label") == picked).row(0, named=True)
        cause, sub_cause = row["cause"], row["sub_cause"]
    cause_to_url(cause, sub_cause)
    rows = data.named("miss_requests", **f.params(), cause=cause, sub_cause=sub_cause, limit=int(limit))
    charts.table(rows, key="miss_requests")


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    by_cause = data.named("miss_causes", **f.params())
    if by_cause.is_empty():
        st.info(
            "No attributed misses in this time range and filter yet: the attribution job writes miss causes "
            "a few seconds after the gateway logs a request. Widen the time range if traffic is older.",
            icon=":material/hourglass_empty:",
        )
        return
    by_cause = label(by_cause)
    total = int(by_cause["missed_tokens"].sum())
    top = by_cause.row(0, named=True)
    cols = st.columns([1, 1.8, 1])  # room for the longest sub-cause, evicted_before_next_turn
    cols[0].metric("Missed tokens", charts.count(total))
    cols[1].metric(  # the sub-cause says most; its cause goes under it
        "Largest cause",
        top["sub_cause"] or top["cause"],
        delta=top["cause"] if top["sub_cause"] else None,
        delta_color="off",
        delta_arrow="off",
        help=f"{top['label']}: {charts.count(top['missed_tokens'])} missed tokens",
    )
    cols[2].metric("Its share of missed tokens", charts.pct(top["share_of_missed"], 1))
    charts.bars(
        by_cause.sort("missed_tokens"),
        "label",
        "missed_tokens",
        "Missed tokens by cause",
        color="label",
        color_map=causes.color_map(by_cause["label"].to_list()),
        horizontal=True,
        key="cause_bars",
    )
    charts.table(
        by_cause.select(["cause", "sub_cause", "missed_tokens", "share_of_missed", "requests"]),
        percent_cols=["share_of_missed"],
        key="cause_table",
    )
    per_tenant = data.named("miss_causes", **f.params(), by_tenant=1)
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
            color_map=causes.color_map(order),
            barmode="stack",
            key="cause_tenants",
        )
    drill_down(f, by_cause)


data.live(render)
