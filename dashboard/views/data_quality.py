"""Data quality: per pod, vLLM's counters beside the gateway log, the gap and its likely cause
(named query ``data_quality``; the rules in docs/miss-causes.md, "When the two sources disagree"); and, when the
window holds workload labels, attribution against them (named query ``attribution_agreement``; docs/miss-causes.md,
"Validating attribution")."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data

st.header("Data quality")

PERCENT = ["cached_tokens_coverage", "request_coverage", "gateway_hit_rate", "vllm_hit_rate"]
CAUSES = {
    "no_vllm_metrics": "vLLM series missing",
    "no_gateway_traffic": "no gateway traffic",
    "external_kv_connector": "hits from a KV connector",
    "requests_not_seen_by_gateway": "requests not seen by the gateway",
    "several_engine_requests": "requests run as several sequences",
    "window_edge": "window edge",
    "details_not_reported": "cached counts not reported",
    "no_cache_queries": "no hit rate to compare",
    "preemption_recompute": "preemption recomputes",
    "unexplained": "unexplained",
}


def render(f: data.Filters) -> None:
    st.caption(
        "Two sources measure the prefix-cache hit rate: vLLM's counters (Δ hits / Δ queries) and the gateway log "
        "(Σ cached / Σ prompt over requests whose cached count was reported). They should agree within 0.5 pp; "
        "when they do not, the evidence below says why. vLLM's counters carry no tenant, so this page ignores the "
        "tenant filter."
    )
    if not data.has_data():
        charts.no_data()
        return
    dq = data.named("data_quality", **f.params(tenant=False))
    if dq.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    findings = dq.filter(dq["likely_cause"] != "agree")
    if findings.is_empty():
        st.success(f"Both sources agree on every pod ({dq.height}).")
    for row in findings.iter_rows(named=True):
        gap = "" if row["gap_pp"] is None else f" ({float(row['gap_pp']):+.1f} pp)"
        st.warning(f"**{charts.name(row['pod'], empty='(no pod)')}**: "
                   f"{charts.plain(CAUSES.get(row['likely_cause'], row['likely_cause']))}{gap}: "
                   f"{charts.plain(row['evidence'])}.")
    charts.table(dq, percent_cols=PERCENT, key="data_quality")
    agreement(f)


def agreement(f: data.Filters) -> None:
    """Per cause, how often attribution names the cause the labelled workload was built to show; nothing when the
    window holds no labelled request that was served and attributed."""
    ag = data.named("attribution_agreement", **f.params(pod=False, model=False))
    if ag.is_empty():
        return
    st.subheader("Attribution against workload labels")
    st.caption(
        "A labelled workload (the demo's, or `kvscope import labels`) says which cause each request was built to "
        "show; attribution's answer is its dominant cause by missed tokens, unavoidable aside (none: only "
        "unavoidable tokens missed). Precision: of the requests attributed to a cause, the share labelled so; "
        "recall: of those labelled, the share attributed so. The labels cannot know routing or eviction: those "
        "show as causes nobody labelled. Filtered by tenant."
    )
    total = ag.filter(ag["intended_cause"] == "all")
    if not total.is_empty():
        row = total.row(0, named=True)
        shown = [f"{name} **{row[name]:.0%}**" for name in ("precision", "recall") if row[name] is not None]
        st.markdown(f"Micro {' and '.join(shown) or 'figures: none yet'} over {row['labelled']:,} labelled requests "
                    "(every cause but none).")
    charts.table(ag.drop("attributed_cause", "attributed_sub_cause"), percent_cols=["precision", "recall"],
                 key="attribution_agreement")


data.live(render)
