"""vLLM: the panels of a vLLM Grafana board from vLLM's own series, per pod: prompt and generation throughput
(tokens/s), running and waiting requests, preemptions per second, KV-cache usage over time, end-to-end and
inter-token latency p50/p95/p99 (bucket-interpolated), and the error rate (named queries ``vllm_series`` and
``vllm_latency``)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboard import charts, data

st.header("vLLM")
st.caption(
    "vLLM's own series, per pod: rates are a bucket's counter increase over the bucket's width; running, waiting "
    "and KV-cache usage are the mean of the bucket's scrapes; latency quantiles are interpolated inside vLLM's "
    "histogram buckets as Prometheus histogram_quantile does; the error rate is requests finished with "
    "finished_reason abort or error over all finished. vLLM's series carry no tenant."
)

#: column → (title, y-axis title, percent) of each per-pod panel, two to a row.
PANELS = {
    "prompt_tokens_per_s": ("Prompt throughput (tokens/s)", "tokens/s", False),
    "generation_tokens_per_s": ("Generation throughput (tokens/s)", "tokens/s", False),
    "running": ("Running requests", "requests", False),
    "waiting": ("Waiting requests", "requests", False),
    "preemptions_per_s": ("Preemptions per second", "preemptions/s", False),
    "kv_cache_usage": ("KV-cache usage", "KV cache usage", True),
    "error_rate": ("Error rate (abort or error / finished)", "error rate", True),
    "failed_requests_per_s": ("Failed requests per second (abort or error)", "requests/s", False),
}
LATENCY = {"e2e_ms": "End-to-end latency (ms)", "inter_token_ms": "Inter-token latency (ms)"}
DASHES = {"p50_ms": "solid", "p95_ms": "dash", "p99_ms": "dot"}


def panels(series: pl.DataFrame, bk: data.Buckets) -> None:
    names = list(PANELS)
    for i in range(0, len(names), 2):
        for col, name in zip(st.columns(2), names[i:i + 2], strict=True):
            title, y_title, percent = PANELS[name]
            with col:
                charts.time_lines(series.select("bucket", "pod", name).drop_nulls(name), name, title, color="pod",
                                  percent=percent, y_title=y_title, buckets=bk, legend_below=True,
                                  key=f"vllm_{name}")


def latency(lat: pl.DataFrame, bk: data.Buckets) -> None:
    for col, (metric, title) in zip(st.columns(2), LATENCY.items(), strict=True):
        with col:
            rows = lat.filter(pl.col("metric") == metric) if not lat.is_empty() else lat
            long = rows.unpivot(index=["bucket", "pod"], on=list(DASHES), variable_name="quantile",
                                value_name="ms").drop_nulls("ms") if not rows.is_empty() else rows
            if not long.is_empty():
                long = long.with_columns(pl.col("quantile").str.replace("_ms", ""))
            charts.time_lines(long, "ms", title, color="pod", dash="quantile",
                              dash_map={k.removesuffix("_ms"): v for k, v in DASHES.items()}, y_title="ms",
                              buckets=bk, legend_below=True, key=f"vllm_{metric}")


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    if f.tenant:
        st.info(charts.NO_TENANT_IN_VLLM, icon=":material/info:")
        return
    bk = data.buckets(f)
    series = data.named("vllm_series", **f.params(), bucket_seconds=bk.seconds)
    if series.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    panels(series, bk)
    latency(data.named("vllm_latency", **f.params(), bucket_seconds=bk.seconds, by_pod=1), bk)
    st.caption(
        "KV-cache usage counts blocks held by running requests; cached blocks no request holds count as free "
        "(vLLM's definition). A preemption evicts a running request's blocks to make room: its prefill is "
        "recomputed later. vLLM's latency buckets are coarse (end-to-end: 0-0.3 s first), so small values read "
        "as fractions of the first bucket."
    )


data.live(render)
