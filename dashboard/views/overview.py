"""Overview: token-weighted hit rate from vLLM's counters and from the gateway (with the coverage of the
gateway's cached counts), prefill tokens saved, missed tokens, prefill vs decode tokens, TTFT and queue wait."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboard import charts, data, fix_first

SOURCES = {"vllm": "vLLM counters", "gateway": "gateway log"}
LATENCY_SOURCES = {"gateway": "gateway (exact)", "vllm": "vLLM histogram (bucket-interpolated)"}
#: Gap (fraction) between the two token-weighted hit rates worth flagging (docs/miss-causes.md: "a disagreement is
#: itself a finding").
DISAGREEMENT = 0.005

st.header("Overview")


def headline(totals: pl.DataFrame) -> None:
    by = {r["source"]: r for r in totals.iter_rows(named=True)}
    vllm, gw = by.get("vllm", {}), by.get("gateway", {})
    main = gw or vllm  # tokens saved/missed: per request from the gateway when it logs, else vLLM's counters
    saved, looked_up = main.get("hit_tokens"), main.get("query_tokens")
    known = ", requests with a reported cached count" if gw else ""
    cols = st.columns(4)
    cols[0].metric(
        "Token-weighted hit rate (vLLM)",
        charts.pct(vllm.get("token_weighted_hit_rate")),
        help="Δ vllm:prefix_cache_hits / Δ vllm:prefix_cache_queries, summed over engines and pods",
    )
    cols[1].metric(
        "Token-weighted hit rate (gateway)",
        charts.pct(gw.get("token_weighted_hit_rate")),
        help="Σ cached_tokens / Σ prompt_tokens over the gateway's served requests whose pod reported the cached "
        "count (a count not reported is unknown, not 0)",
    )
    cols[2].metric(
        "Cached-count coverage (gateway)",
        charts.pct(gw.get("cached_tokens_coverage")),
        help="Prompt tokens of the requests whose cached count the pod reported / all prompt tokens: the share "
        "of traffic the gateway's hit rate covers (vLLM without --enable-prompt-tokens-details, forks that omit "
        "it, streams cut before their usage chunk lower it)",
    )
    cols[3].metric(
        "Request-weighted hit rate (gateway)",
        charts.pct(gw.get("request_weighted_hit_rate")),
        help="Mean over requests (with a reported cached count) of cached/prompt: shown only to expose the gap "
        "to the token-weighted one",
    )
    cols = st.columns(3)
    cols[0].metric(
        "Prefill tokens saved",
        charts.count(saved),
        help=f"prefix_cache_hit_tokens ({SOURCES['gateway' if gw else 'vllm']})",
    )
    cols[1].metric(
        "Missed tokens",
        charts.count(None if saved is None else looked_up - saved),
        help=f"prefix_cache_miss_tokens = prompt − cached ({SOURCES['gateway' if gw else 'vllm']}{known})",
    )
    cols[2].metric(
        "Prompt tokens",
        charts.count(looked_up),
        help=f"prefill_tokens_total, cached ones included ({SOURCES['gateway' if gw else 'vllm']}{known})",
    )
    a, b = vllm.get("token_weighted_hit_rate"), gw.get("token_weighted_hit_rate")
    if a is not None and b is not None and abs(a - b) > DISAGREEMENT:
        st.warning(
            f"vLLM's counters and the gateway disagree by {abs(a - b) * 100:.1f} pp. That is a finding: "
            "requests that bypass the gateway, pods the collector does not scrape, preempted requests "
            "(not exported by vLLM), or a window edge between scrapes."
            + _coverage_note(gw.get("cached_tokens_coverage"))
        )
        st.page_link("views/data_quality.py", label="Data quality: the gap per pod and its likely cause",
                     icon=":material/rule:")


def _coverage_note(coverage: float | None) -> str:
    """A sentence for the disagreement banner when the gateway's hit rate covers only part of the traffic."""
    if coverage is None or coverage >= 1:
        return ""
    return (f" The gateway's hit rate covers {charts.pct(coverage, 1)} of its prompt tokens: the rest are requests "
            "without a hit count (a pod started without cached-token details, a stream cut before its usage, or a "
            "request with prompt logprobs, for which vLLM reads no cache); the Data quality page tells them apart.")


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    p = f.params()
    totals = data.named("hit_rate_total", **p)
    if totals.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    headline(totals)
    fix_first.render(f)
    if f.tenant:
        st.caption(
            "vLLM's counters carry no tenant: with a tenant selected, only the gateway's numbers show."
        )
    bk = data.buckets(f)
    named_sources = pl.col("source").replace(SOURCES)
    hr = data.named("hit_rate", **p, bucket_seconds=bk.seconds).with_columns(named_sources)
    charts.time_lines(
        hr,
        ["token_weighted_hit_rate", "request_weighted_hit_rate"],
        "Prefix-cache hit rate",
        color="source",
        percent=True,
        y_title="Hit rate",
        buckets=bk,
        key="hit_rate",
    )
    left, right = st.columns(2)
    tokens = data.named("tokens", **p, bucket_seconds=bk.seconds)
    with left:
        gw_tokens = tokens.filter(pl.col("source") == "gateway") if not tokens.is_empty() else tokens
        charts.bars(
            gw_tokens.rename(
                {
                    "cached_tokens": "Prefill tokens saved (cached)",
                    "prefill_computed_tokens": "Prefill tokens computed",
                    "decode_tokens": "Decode tokens",
                },
                strict=False,
            ),
            "bucket",
            ["Prefill tokens saved (cached)", "Prefill tokens computed", "Decode tokens"],
            "Prefill vs decode tokens (gateway)",
            barmode="stack",
            buckets=bk,
            legend_below=True,
            key="tokens_gateway",
        )
    with right:
        vllm_tokens = tokens.filter(pl.col("source") == "vllm") if not tokens.is_empty() else tokens
        charts.time_lines(
            vllm_tokens.rename(
                {"prompt_tokens": "Prefill tokens", "decode_tokens": "Decode tokens"}, strict=False
            ),
            ["Prefill tokens", "Decode tokens"],
            "Prefill vs decode tokens (vLLM counters)",
            y_title="tokens",
            buckets=bk,
            empty=charts.NO_TENANT_IN_VLLM if f.tenant else charts.NO_DATA_IN_WINDOW,
            legend_below=True,
            key="tokens_vllm",
        )
    latency(data.named("latency", **p, bucket_seconds=bk.seconds), bk)


def latency(lat: pl.DataFrame, bk: data.Buckets) -> None:
    """TTFT and queue wait: the gateway's exact quantiles first; vLLM's histogram estimates dotted, hidden."""
    lat = lat.with_columns(pl.col("source").replace(LATENCY_SOURCES)) if not lat.is_empty() else lat
    has_gateway = not lat.is_empty() and (lat["source"] == LATENCY_SOURCES["gateway"]).any()
    left, right = st.columns(2)
    for col, metric, title in ((left, "ttft_ms", "TTFT (ms)"), (right, "queue_wait_ms", "Queue wait (ms)")):
        with col:
            charts.time_lines(
                lat.filter(pl.col("metric") == metric) if not lat.is_empty() else lat,
                ["p50_ms", "p95_ms", "p99_ms"],
                title,
                color="source",
                dash_map={v: "solid" if k == "gateway" else "dot" for k, v in LATENCY_SOURCES.items()},
                hidden=[LATENCY_SOURCES["vllm"]] if has_gateway else [],
                y_title="ms",
                buckets=bk,
                legend_below=True,
                key=f"latency_{metric}",
            )
    if not lat.is_empty() and (lat["source"] == LATENCY_SOURCES["vllm"]).any():
        st.caption(
            "Solid: the gateway's exact quantiles over its requests. Dotted (hidden while the gateway has "
            "data; click the legend to show them): vLLM's own p50/p95/p99, interpolated inside its histogram "
            "buckets as Prometheus histogram_quantile does. vLLM's buckets are coarse (queue time's first "
            "one is 0–300 ms), so every queue wait under 300 ms, 0.03 ms included, reads there as "
            "150 / 285 / 297 ms: a bucket artefact, not a measurement."
        )


data.live(render)
