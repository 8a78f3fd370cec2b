"""Fingerprints: prompt_fingerprint_cardinality per tenant and per segment over time (drift = a jump)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboard import charts, data

st.header("Fingerprints")
st.caption(
    "Prompt fingerprint cardinality: distinct stable-prefix fingerprints per window. A jump means something "
    "volatile entered the prefix. Per segment, a raw hash with more values than its normalized variant "
    "points at the cause: volatile values in the system prompt, reordered tool schemas or RAG documents."
)

#: column → (segment, variant): a raw hash and its normalized variant share a colour.
SEGMENTS = {
    "system_hash_cardinality": ("system prompt", "raw"),
    "system_norm_hash_cardinality": ("system prompt", "normalized (volatile values masked)"),
    "tools_hash_cardinality": ("tool schemas", "raw"),
    "tools_canonical_hash_cardinality": ("tool schemas", "normalized (keys sorted)"),
    "retrieval_pack_hash_cardinality": ("retrieval pack", "raw"),
    "retrieval_set_hash_cardinality": ("retrieval pack", "normalized (as a set)"),
}


def segments_long(pooled: pl.DataFrame) -> pl.DataFrame:
    """bucket, segment, variant, distinct values: one line per segment and variant."""
    long = pooled.unpivot(
        index="bucket", on=list(SEGMENTS), variable_name="column", value_name="distinct values"
    )
    return long.with_columns(
        pl.col("column").replace_strict({k: v[0] for k, v in SEGMENTS.items()}).alias("segment"),
        pl.col("column").replace_strict({k: v[1] for k, v in SEGMENTS.items()}).alias("variant"),
    )


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    b = data.bucket_seconds(f)
    per_tenant = data.named("fingerprint_cardinality", **f.params(), bucket_seconds=b, by_tenant=1)
    if per_tenant.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    charts.time_lines(
        per_tenant,
        "prompt_fingerprint_cardinality",
        "Prompt fingerprint cardinality per tenant",
        color="tenant_id",
        key="fp_tenants",
    )
    pooled = data.named("fingerprint_cardinality", **f.params(), bucket_seconds=b, by_tenant=0)
    charts.time_lines(
        segments_long(pooled) if not pooled.is_empty() else pooled,
        "distinct values",
        "Distinct values per segment, raw vs normalized (all tenants in the filter)",
        color="segment",
        dash="variant",
        key="fp_segments",
    )
    charts.table(per_tenant, key="fp_table")


data.live(render)
