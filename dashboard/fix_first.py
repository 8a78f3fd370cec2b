"""The Overview's answer to "why did the rest miss?": where the missed tokens went, then what to fix first.

Both read :mod:`dashboard.findings` (the digest and the alerts read the same), so the page, the email and the
alert name the same causes with the same figures. Colours come from :mod:`dashboard.causes`.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dashboard import causes, charts, data, findings, untrusted

MISS_CAUSES_PAGE = "views/miss_causes.py"


@functools.cache
def gpu_hour_price() -> tuple[float, str]:
    """``(KVSCOPE_GPU_HOUR_PRICE, KVSCOPE_CURRENCY)`` from the settings table (0 = no money shown)."""
    from kvscope.config import build_config

    try:
        cfg = build_config({})
    except Exception:  # noqa: BLE001  (a bad setting is reported by the process that starts; show no money)
        return 0.0, "USD"
    return cfg.gpu_hour_price, cfg.currency


def window(f: data.Filters) -> tuple[datetime, datetime]:
    """The filters' window as UTC datetimes."""
    since, until = f.window()
    return (datetime.fromisoformat(since).replace(tzinfo=UTC), datetime.fromisoformat(until).replace(tzinfo=UTC))


def render(f: data.Filters) -> None:
    """Draw "Where the missed tokens went" and "Fix first" for the sidebar's window, tenant and pod."""
    since, until = window(f)
    price, currency = gpu_hour_price()
    store = data.get_store()
    try:
        where = findings.where_missed(store, since, until, tenant=f.tenant, pod=f.pod, model=f.model,
                                      gpu_hour_price=price)
        top = findings.fix_first(store, since, until, tenant=f.tenant, pod=f.pod, model=f.model,
                                 gpu_hour_price=price)
    except Exception as exc:  # noqa: BLE001  (a failing query shows its error; the page goes on)
        st.error(f"Miss causes could not be read: {charts.plain(data.error_text(exc))}")
        return
    st.subheader("Where the missed tokens went")
    if where.is_empty():  # (a window of not_reported alone shows its unknown hits: where_chart)
        st.info("No attributed misses in this window yet: the attribution job answers requests a few seconds "
                "after the gateway logs them.", icon=":material/hourglass_empty:")
        return
    where_chart(where, currency)
    st.subheader("Fix first")
    if not top:
        st.success("Nothing to fix: every missed token in this window is cold, beyond the horizon, below one block "
                   "or unavoidable (new content no cache can hold).", icon=":material/check_circle:")
        return
    for i, finding in enumerate(top, 1):
        fix_card(i, finding, f, currency)


def where_chart(where: pl.DataFrame, currency: str) -> None:
    """Horizontal bars of missed tokens per cause (one colour per cause), with GPU-seconds and share beside. The
    prompt tokens of requests whose cached count is not reported (cause ``not_reported``) are unknown hits, not
    missed tokens: left out of the bars and the table and counted apart in a metric, as the Miss causes page
    does (docs/miss-causes.md)."""
    unknown = findings.unknown_tokens(where)
    df = findings.known_misses(where).sort(["missed_tokens"], descending=True)
    if unknown:
        st.metric("Unknown hits (not reported)", f"{charts.count(unknown)} prompt tokens",
                  help="Prompt tokens of requests whose pod did not report the cached count: their hits are "
                       "unknown, so they are neither missed tokens nor in the shares, and cost nothing.")
    if df.is_empty():
        st.caption("No missed tokens known in this window: every request's cached count was not reported.")
        return
    labels = df["label"].to_list()
    has_cost = df["gpu_seconds"].drop_nulls().len() > 0
    text = [
        f"{charts.count(t)} tokens · {s * 100:.1f} %"
        + (f" · {findings.gpu_seconds_text(g)} GPU-s" if g is not None else "")
        for t, s, g in zip(df["missed_tokens"], df["share_of_missed"], df["gpu_seconds"], strict=True)
    ]
    fig = go.Figure(go.Bar(
        x=df["missed_tokens"].to_list(), y=labels, orientation="h", text=text, textposition="auto",
        marker_color=[causes.color(c, s) for c, s in zip(df["cause"], df["sub_cause"], strict=True)],
        hovertemplate="%{y}: %{x:,} missed tokens<extra></extra>",
    ))
    fig.update_layout(height=60 + 34 * len(labels), margin={"l": 10, "r": 10, "t": 10, "b": 30},
                      xaxis_title="Missed tokens", yaxis={"autorange": "reversed"}, showlegend=False)
    st.plotly_chart(fig, key="where_missed")
    columns = ["label", "missed_tokens", "share_of_missed", "gpu_seconds", "requests"]
    if df["money"].drop_nulls().len() > 0:
        df = df.rename({"money": f"cost ({currency})"})
        columns.insert(4, f"cost ({currency})")
    table = df.select(columns)
    if not has_cost:
        st.caption("GPU-seconds need vLLM's `vllm:request_prefill_time_seconds` in the window (docs/miss-causes.md, "
                   "Cost of a miss).")
    charts.table(table.rename({"label": "cause"}), percent_cols=["share_of_missed"], key="where_missed_table")


def fix_card(rank: int, finding: findings.Finding, f: data.Filters, currency: str) -> None:
    """One finding: headline, the fix in plain words, the evidence, and a link to its requests."""
    with st.container(border=True):
        cost = ""
        if finding.gpu_seconds is not None:
            cost = f" · {findings.gpu_seconds_text(finding.gpu_seconds)} GPU-s"
        if finding.money is not None:
            cost += f" · {finding.money:,.2f} {currency}"
        st.markdown(f"**{rank}. {charts.name(finding.tenant_id, empty=untrusted.NO_TENANT)}: "
                    f":{_streamlit_color(finding)}[{finding.label}]** — {finding.share_of_tenant_missed * 100:.0f} % "
                    f"of its missed tokens ({finding.missed_tokens:,} tokens in {finding.requests:,} "
                    f"request{'s' if finding.requests != 1 else ''}{cost})")
        st.markdown(charts.plain(finding.fix))
        if finding.evidence:
            st.caption("Evidence: " + charts.plain(finding.evidence.text()))
        params = {**f.query(), "tenant": finding.tenant_id, "cause": finding.cause}  # the page's window and filters
        if finding.sub_cause:
            params["sub_cause"] = finding.sub_cause
        if finding.evidence:
            params["request_id"] = finding.evidence.request_id
            params["ts"] = findings.ts_param(finding.evidence.ts)  # ids can repeat across runs
        st.page_link(MISS_CAUSES_PAGE, label="Show these requests", icon=":material/arrow_forward:",
                     query_params=params)


def _streamlit_color(finding: findings.Finding) -> str:
    """Streamlit's markdown colours are named; the cause's own colour shows in the chart above."""
    return {"prefix_drift": "orange", "routed_away": "blue", "evicted": "violet", "not_reported": "gray"}.get(
        finding.cause, "gray")
