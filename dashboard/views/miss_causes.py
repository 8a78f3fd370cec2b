"""Miss causes: missed tokens by cause and sub-cause, per tenant, and the drill-down to request ids."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboard import charts, data

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


def drill_down(f: data.Filters, causes: pl.DataFrame) -> None:
    st.subheader("Requests")
    choices = [ALL_CAUSES, *causes["label"].to_list()]
    left, right = st.columns([3, 1])
    picked = left.selectbox("Cause", choices, key="miss_cause")
    limit = right.number_input("Rows", min_value=10, max_value=10_000, value=100, step=50, key="miss_limit")
    cause, sub_cause = "", ""
    if picked != ALL_CAUSES:
        row = causes.filter(pl.col("label") == picked).row(0, named=True)
        cause, sub_cause = row["cause"], row["sub_cause"]
    rows = data.named("miss_requests", **f.params(), cause=cause, sub_cause=sub_cause, limit=int(limit))
    charts.table(rows, key="miss_requests")


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    causes = data.named("miss_causes", **f.params())
    if causes.is_empty():
        st.info(
            "No attributed misses in this time range and filter yet: the attribution job writes miss causes "
            "a few seconds after the gateway logs a request. Widen the time range if traffic is older.",
            icon=":material/hourglass_empty:",
        )
        return
    causes = label(causes)
    total = int(causes["missed_tokens"].sum())
    top = causes.row(0, named=True)
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
        causes.sort("missed_tokens"),
        "label",
        "missed_tokens",
        "Missed tokens by cause",
        horizontal=True,
        key="cause_bars",
    )
    charts.table(
        causes.select(["cause", "sub_cause", "missed_tokens", "share_of_missed", "requests"]),
        percent_cols=["share_of_missed"],
        key="cause_table",
    )
    per_tenant = data.named("miss_causes", **f.params(), by_tenant=1)
    if not per_tenant.is_empty():
        charts.bars(
            label(per_tenant).sort("tenant_id"),
            "tenant_id",
            "missed_tokens",
            "Missed tokens per tenant by cause",
            color="label",
            barmode="stack",
            key="cause_tenants",
        )
    drill_down(f, causes)


data.live(render)
