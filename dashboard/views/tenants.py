"""Tenants: tenant_cache_affinity and hit rates per tenant, and the tenant × pod matrix of prefix tokens."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data

st.header("Tenants")
st.caption(
    "Tenant cache affinity: of a tenant's requests with a predecessor sharing their prefix (same agent "
    "run or conversation, else same prompt fingerprint), the token-weighted share served by the "
    "predecessor's pod. Low affinity means routing sends follow-up turns away from the pod holding "
    "their prefix."
)

COLUMNS = [
    "tenant_id",
    "tenant_cache_affinity",
    "token_weighted_hit_rate",
    "cached_tokens_coverage",
    "request_weighted_hit_rate",
    "requests",
    "requests_with_predecessor",
    "prompt_tokens",
    "cached_tokens",
    "pods",
]
PERCENT = ["tenant_cache_affinity", "token_weighted_hit_rate", "cached_tokens_coverage", "request_weighted_hit_rate"]


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    p = f.params()
    affinity = data.named("tenant_affinity", **p)
    if affinity.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    charts.bars(
        affinity,
        "tenant_id",
        ["tenant_cache_affinity", "token_weighted_hit_rate"],
        "Cache affinity and token-weighted hit rate per tenant",
        percent=True,
        key="tenant_bars",
    )
    charts.table(affinity.select(COLUMNS), percent_cols=PERCENT, key="tenant_table")
    matrix = data.named("tenant_pod_matrix", **p)
    charts.heatmap(
        matrix,
        "pod",
        "tenant_id",
        "prefix_tokens",
        "Prefix tokens served, tenant × pod",
        key="tenant_pod_matrix",
    )


data.live(render)
