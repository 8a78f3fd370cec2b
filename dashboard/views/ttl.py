"""Agent TTL: did a conversation's or agent run's prefix survive the wait before its next turn, how long should
pods hold it, and what does holding it cost against what losing it costs (docs/ttl.md).

Reads the named queries ``ttl_survival`` (survival curve by gap per tenant and model), ``ttl_hold_time`` (the
hold time for 50/90/99 % of next turns, the bytes and blocks it holds) and ``ttl_runs`` (per run: waits, evicted
tokens, their re-compute time, the bytes holding it takes), with the sidebar's window, tenant, pod and model.
Costs: GPU-seconds of the evicted tokens beside the tokens, money when ``KVSCOPE_GPU_HOUR_PRICE`` is set; bytes
per token from each pod's ``vllm:cache_config_info``, else ``KVSCOPE_KV_BYTES_PER_TOKEN``.
"""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dashboard import causes, charts, data, findings, fix_first
from ingest import attribution as a
from kvscope import durations

st.header("Agent TTL")
st.caption(
    "For conversations and agent runs: the wait before each next turn (a tool call, the user's reply) against "
    "whether the pod still held the previous turn's prefix. Turns served by another pod than their previous turn "
    "are left out (routed_away: no pod held the prefix for them)."
)

#: The shares of next turns the hold-time table keeps warm, %.
PERCENTS = (50, 90, 99)
#: The colour of the cause the survival curve is about (evicted before the next turn), from dashboard/causes.py.
EVICTED_COLOR = causes.color(a.EVICTED, a.EVICTED_BEFORE_NEXT_TURN)


def kv_bytes_per_token() -> float:
    """``KVSCOPE_KV_BYTES_PER_TOKEN`` from the settings table (0 = unknown; a bad setting reads as 0)."""
    from kvscope.config import build_config

    try:
        return float(build_config({}).kv_bytes_per_token)
    except Exception:  # noqa: BLE001  (the process that starts reports a bad setting)
        return 0.0


def size(n: float | None) -> str:
    """Bytes in binary units: "512 B", "702.0 KiB", "1.5 GiB"; an en dash when unknown."""
    if n is None:
        return charts.MISSING
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def hold(ms: float) -> str:
    """A hold time in words, as the digest and alerts write durations: "850 ms", "9.9 s", "4.2 min", "1.5 h"."""
    return durations.human(ms / 1000)


def show(fig: go.Figure, key: str) -> None:
    """Draw ``fig`` with the margins the other pages' charts use."""
    fig.update_layout(margin={"l": 10, "r": 10, "t": 40, "b": 10}, legend_title_text="")
    st.plotly_chart(fig, key=key)


def cost_text(gpu_seconds: float | None, price: float, currency: str) -> str:
    """ "0.062 GPU-s · 0.00 USD" (money only when a price is set), or an en dash when no pod measured prefill."""
    return findings.cost_text(gpu_seconds, findings.money(gpu_seconds, price), currency)


def survival(df: pl.DataFrame) -> None:
    """The survival curve: share of next turns whose prefix survived, by gap bucket, one line per tenant/model."""
    names = charts.shown_strings(df.select("tenant_id", "model"), html=True)  # gateway values: plotly reads HTML
    df = df.with_columns(pl.concat_str([names["tenant_id"], names["model"]], separator=" / ").alias("series"))
    df = df.sort("bucket_index")
    order = ["<1s", "1-5s", "5-15s", "15-60s", "1-5m", "5-15m", "15-60m", ">1h"]
    fig = go.Figure()
    for (series,), part in df.group_by(["series"], maintain_order=True):
        fig.add_trace(go.Scatter(
            x=part["gap_bucket"].to_list(), y=part["survival_share"].to_list(), name=str(series),
            mode="lines+markers", customdata=list(zip(part["turns"], part["survived_turns"], strict=True)),
            hovertemplate="%{x}: %{y:.0%} survived (%{customdata[1]} of %{customdata[0]} turns)<extra>%{fullData.name}"
                          "</extra>"))
    fig.update_layout(title="Prefix survival by the wait before the next turn", height=380,
                      xaxis={"title": "Wait before the turn", "categoryorder": "array", "categoryarray": order,
                             "type": "category"},
                      yaxis={"title": "Turns whose prefix survived", "tickformat": ".0%", "range": [0, 1.05]})
    show(fig, "ttl_survival")


def evicted_bars(df: pl.DataFrame, price: float, currency: str) -> None:
    """Evicted missed tokens per gap bucket (all tenants), in the evicted cause's colour, GPU-seconds beside."""
    per = (df.group_by("bucket_index", "gap_bucket")
           .agg(pl.col("evicted_missed_tokens").sum(), pl.col("gpu_seconds").sum().alias("gpu_seconds"),
                pl.col("gpu_seconds").is_null().all().alias("no_cost"))
           .sort("bucket_index"))
    if per["evicted_missed_tokens"].sum() == 0:
        st.caption("No next turn lost its prefix during the wait in this window.")
        return
    text = [f"{charts.count(t)} tokens · {cost_text(None if nc else g, price, currency)}"
            for t, g, nc in zip(per["evicted_missed_tokens"], per["gpu_seconds"], per["no_cost"], strict=True)]
    fig = go.Figure(go.Bar(x=per["gap_bucket"].to_list(), y=per["evicted_missed_tokens"].to_list(), text=text,
                           marker_color=EVICTED_COLOR, name=causes.label(a.EVICTED, a.EVICTED_BEFORE_NEXT_TURN),
                           hovertemplate="%{x}: %{y:,} evicted tokens<extra></extra>"))
    fig.update_layout(title="Tokens evicted before the next turn, by wait", height=320,
                      xaxis={"title": "Wait before the turn", "type": "category"},
                      yaxis={"title": "Missed tokens (evicted)"})
    show(fig, "ttl_evicted")


def hold_table(f: data.Filters, per_token: float) -> None:
    """The hold time that keeps 50/90/99 % of next turns warm, and the tokens, bytes and blocks it holds."""
    st.subheader("How long to hold a prefix")
    df = data.named("ttl_hold_time", **f.params(), percents="[" + ",".join(map(str, PERCENTS)) + "]",
                    kv_bytes_per_token=per_token)
    if df.is_empty():
        st.caption(charts.NO_DATA_IN_WINDOW)
        return
    shown = pl.DataFrame({
        "keep warm": [f"{p} % of next turns" for p in df["percent"]],
        "hold time": [hold(x) for x in df["hold_ms"]],
        "warm turns": [f"{w:,} of {n:,}" for w, n in zip(df["warm_turns"], df["next_turns"], strict=True)],
        "held tokens per run": [charts.count(None if x is None else round(x)) for x in df["held_tokens"]],
        "held blocks per run": [charts.MISSING if x is None else f"{x:,.1f}" for x in df["held_blocks"]],
        "bytes per run": [size(x) for x in df["retained_bytes"]],
        "block-seconds taken": [f"{x:,.0f}" for x in df["held_block_seconds"]],
    })
    st.dataframe(shown, hide_index=True, key="ttl_hold_time")
    if df["bytes_per_token"].drop_nulls().len() == 0:
        st.caption("Bytes need vLLM's `vllm:cache_config_info` with kv_cache_memory_bytes and kv_cache_size_tokens "
                   "(vLLM ≥ 0.32), or `KVSCOPE_KV_BYTES_PER_TOKEN` (docs/ttl.md).")
    else:
        st.caption(f"At {df['bytes_per_token'].mean():,.0f} bytes per token. Block-seconds: the KV blocks held for "
                   "the waits, taken from other traffic (docs/ttl.md).")


def runs_table(f: data.Filters, per_token: float) -> None:
    """The runs that lost most during their waits, with their re-compute time and the bytes holding them takes."""
    st.subheader("Agent runs and conversations")
    df = data.named("ttl_runs", **f.params(), kv_bytes_per_token=per_token, limit=200)
    if df.is_empty():
        st.caption(charts.NO_DATA_IN_WINDOW)
        return
    charts.table(df.with_columns(pl.col("cache_retained_bytes").map_elements(size, return_dtype=pl.String)),
                 labels={"evicted_before_next_turn": "evicted before next turn (tokens)",
                         "recompute_prefill_ms": "recompute prefill (GPU-ms)",
                         "cache_retained_bytes": "cache retained"},
                 key="ttl_runs")


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    df = data.named("ttl_survival", **f.params())
    if df.is_empty():
        st.container(key="ttl_empty").info(
            "No next turns in this window: the TTL analysis needs requests of one conversation or agent run (the "
            "gateway log's `conversation_id` or `agent_run_id`) served by the pod of their previous turn.",
            icon=":material/hourglass_empty:")
        return
    price, currency = fix_first.gpu_hour_price()
    turns, survived = int(df["turns"].sum()), int(df["survived_turns"].sum())
    evicted = int(df["evicted_missed_tokens"].sum())
    gpu = None if df["gpu_seconds"].drop_nulls().len() == 0 else float(df["gpu_seconds"].sum())
    cols = st.columns(4)
    cols[0].metric("Next turns", charts.count(turns))
    cols[1].metric("Prefix survived the wait", charts.pct(survived / turns, 1))
    cols[2].metric("Tokens evicted before the next turn", charts.count(evicted))
    cols[3].metric("Re-compute cost of those tokens", cost_text(gpu, price, currency))
    survival(df)
    evicted_bars(df, price, currency)
    per_token = kv_bytes_per_token()
    hold_table(f, per_token)
    runs_table(f, per_token)


data.live(render)
