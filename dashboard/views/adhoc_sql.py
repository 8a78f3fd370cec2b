"""SQL: ad hoc read-only queries (one read statement; the database enforces readonly and the limits), and the
named queries."""

from __future__ import annotations

import polars as pl
import streamlit as st

import sql as sqlfiles
from dashboard import charts, data
from ingest.adhoc import ADHOC_MAX_RESULT_BYTES, ADHOC_MAX_ROWS
from kvscope.tables import holds_map, json_text

st.html(
    "<style>.st-key-sql_text textarea {font-family: 'Source Code Pro', ui-monospace, SFMono-Regular, Menlo, "
    "monospace; font-size: 0.875rem; line-height: 1.5}</style>"
)
st.header("SQL")
limits = data.get_store().adhoc_settings
st.caption(
    "Read-only: one SELECT, WITH, SHOW, DESCRIBE (of a table), EXISTS or EXPLAIN over the database's tables (no "
    "file(), url() or other table functions that reach outside it); the database refuses writes, stops a query "
    f"after {limits['max_execution_time']} s or {limits['max_memory_usage'] / 2**30:g} GiB of memory, and "
    f"returns at most {ADHOC_MAX_ROWS:,} rows and {ADHOC_MAX_RESULT_BYTES >> 20} MiB. Tables: gateway_requests, "
    "request_attribution (weight by sign), miss_attribution (one row per request and cause), vllm_metrics (kept "
    "vLLM series; counters as increases), vllm_cache_config, kv_block_events, kv_block_log, kv_block_residency "
    "and kv_cache_resets (block residency, docs/kv-events.md), kv_gaps (one row per KV-event gap, lost batches "
    "counted against the store; kv_event_gaps holds the collectors' reports), dead_letters; "
    "rollups requests_1m/1h, misses_1m/1h, affinity_1m/1h, vllm_1m/1h (docs/scale.md)."
)

EXAMPLE = """SELECT tenant_id,
       count() AS requests,
       sum(cached_tokens) / sum(prompt_tokens) AS token_weighted_hit_rate
FROM gateway_requests
WHERE status < 400 AND prompt_tokens > 0
GROUP BY tenant_id
ORDER BY requests DESC"""

text = st.text_area("Query", EXAMPLE, height=180, key="sql_text")
if st.button("Run", type="primary", key="sql_run"):
    try:
        result = data.get_store().adhoc(text)  # DateTime columns come back as datetimes
    except Exception as exc:  # noqa: BLE001  (refused, bad SQL, a limit, an unreadable result: a message, no traceback)
        st.error(f"**The query failed.** {charts.plain(data.error_text(exc))}", icon=":material/error:")
    else:
        cut = f" (at most {ADHOC_MAX_ROWS:,} are shown: there may be more)" if result.height == ADHOC_MAX_ROWS else ""
        st.caption(f"{result.height:,} rows{cut}")
        if result.height:  # a map as JSON text: the table would turn its entries into arrays of one type
            maps = [c for c, t in result.schema.items() if holds_map(t)]
            charts.table(result.with_columns(pl.col(c).map_elements(json_text, return_dtype=pl.String) for c in maps),
                         key="sql_result")

with st.expander("Named queries (sql/queries)"):
    for name in sqlfiles.query_names():
        q = sqlfiles.load_query(name)
        st.markdown(
            f"**{name}**: {q.description}  \n"
            f"params: {', '.join(f'`{p.name}`' for p in q.params) or 'none'}; "
            f"columns: {', '.join(f'`{c.name}`' for c in q.returns)}"
        )
