"""Fingerprints: per tenant and segment, distinct raw vs normalized hashes over the window (raw ≫ normalized =
a volatile value or a reordering breaks the prefix), the same over time, and prompt_fingerprint_cardinality."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboard import charts, data

st.header("Fingerprints")
st.caption(
    "The gateway hashes each segment of a prompt's stable prefix twice: as sent (raw) and normalized "
    "(volatile values such as timestamps masked, tool-schema keys sorted, retrieved documents taken as a "
    "set). Within a tenant both should stay put from request to request. **Raw ≫ normalized** means the "
    "segment changes on every request in a way the normalization removes: a volatile value in the system "
    "prompt, reordered tool schemas or reordered documents, each of which breaks the prefix cache from that "
    "segment on."
)

#: segment → (raw column, normalized column): a raw hash and its normalized variant.
SEGMENTS = {
    "system prompt": ("system_hash_cardinality", "system_norm_hash_cardinality"),
    "tool schemas": ("tools_hash_cardinality", "tools_canonical_hash_cardinality"),
    "retrieval pack": ("retrieval_pack_hash_cardinality", "retrieval_set_hash_cardinality"),
}
VARIANTS = {"raw": 0, "normalized": 1}
#: A bucket wider than the epoch so far (until 2096), whole hours (so the hour rollups serve it):
#: fingerprint_cardinality then counts over the whole window.
WHOLE_WINDOW = 3600 * 1_111_112
#: Tenants drawn in the per-tenant cardinality chart (the highest peaks); the table above lists them all.
TOP_TENANTS = 20
COLUMN_LABELS = {
    "requests": "Requests",
    "prompt_fingerprint_cardinality": "Prompt fingerprints",
    **{cols[i]: f"{seg}, {v}" for seg, cols in SEGMENTS.items() for v, i in VARIANTS.items()},
}


def by_segment(df: pl.DataFrame, index: str) -> pl.DataFrame:
    """``index``, segment, raw, normalized, the cell text and colour (log ratio) of the tenant × segment map."""
    parts = [
        df.select(
            index,
            pl.lit(seg).alias("segment"),
            pl.col(raw).alias("raw"),
            pl.col(norm).alias("normalized"),
        )
        for seg, (raw, norm) in SEGMENTS.items()
    ]
    return pl.concat(parts).with_columns(
        pl.when(pl.col("raw") == 0)
        .then(pl.lit("not used"))
        .otherwise(pl.format("{} raw / {} normalized", "raw", "normalized"))
        .alias("text"),
        (pl.col("raw") / pl.max_horizontal("normalized", 1)).log10().clip(0).fill_nan(0).alias("volatility"),
    )


def segments_over_time(pooled: pl.DataFrame) -> pl.DataFrame:
    """bucket, segment, variant, distinct values: one line per segment and variant."""
    long = by_segment(pooled, "bucket").unpivot(
        index=["bucket", "segment"], on=list(VARIANTS), variable_name="variant", value_name="distinct values"
    )
    return long.filter(pl.col("distinct values") > 0)


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    per_tenant = data.named("fingerprint_cardinality", **f.params(), bucket_seconds=WHOLE_WINDOW, by_tenant=1)
    if per_tenant.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    charts.heatmap(
        by_segment(per_tenant, "tenant_id"),
        "segment",
        "tenant_id",
        "volatility",
        "Distinct values per tenant and segment over the window: raw vs normalized",
        text="text",
        color_scale="Reds",
        show_scale=False,
        key="fp_segments_tenants",
    )
    charts.table(per_tenant.drop("bucket"), labels=COLUMN_LABELS, key="fp_table")
    bk = data.buckets(f)
    pooled = data.named("fingerprint_cardinality", **f.params(), bucket_seconds=bk.seconds, by_tenant=0)
    charts.time_lines(
        segments_over_time(pooled) if not pooled.is_empty() else pooled,
        "distinct values",
        f"Distinct values per segment over time ({f.tenant or 'all tenants'})",
        color="segment",
        dash="variant",
        buckets=bk,
        key="fp_segments",
    )
    per_bucket = data.named("fingerprint_cardinality", **f.params(), bucket_seconds=bk.seconds, by_tenant=1)
    top = (per_tenant.sort("prompt_fingerprint_cardinality", descending=True).head(TOP_TENANTS)["tenant_id"]
           if not per_bucket.is_empty() else [])
    shown = per_bucket.filter(pl.col("tenant_id").is_in(list(top))) if not per_bucket.is_empty() else per_bucket
    more = per_tenant.height - len(top)
    charts.time_lines(
        shown,
        "prompt_fingerprint_cardinality",
        "Prompt fingerprint cardinality per tenant" + (f" (the {TOP_TENANTS} highest; {more} more in the table)"
                                                       if more > 0 else ""),
        color="tenant_id",
        buckets=bk,
        key="fp_tenants",
    )
    st.caption(
        "The prompt fingerprint covers the whole stable prefix, conversation history included, so every new "
        "turn of a conversation has a new one: its cardinality follows traffic for healthy tenants too. A jump "
        "against the tenant's own usual level is the signal; the segment map above says which segment moved."
    )


data.live(render)
