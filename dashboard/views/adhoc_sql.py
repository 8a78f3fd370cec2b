"""SQL: ad hoc read-only queries (the database enforces readonly=1 and limits), and the named queries."""

from __future__ import annotations

import streamlit as st

import sql as sqlfiles
from dashboard import charts, data
from ingest.store import ADHOC_SETTINGS

MAX_ROWS = int(ADHOC_SETTINGS["max_result_rows"])

st.html(
    "<style>.st-key-sql_text textarea {font-family: 'Source Code Pro', ui-monospace, SFMono-Regular, Menlo, "
    "monospace; font-size: 0.875rem; line-height: 1.5}</style>"
)
st.header("SQL")
st.caption(
    f"Read-only: the database refuses writes, stops a query after {ADHOC_SETTINGS['max_execution_time']} s "
    f"and returns at most {MAX_ROWS:,} rows. Tables: gateway_requests, request_attribution (weight by sign), "
    "miss_attribution (one row per request and cause), vllm_metrics (kept vLLM series; counters as increases), "
    "vllm_cache_config, kv_block_events, kv_event_gaps, dead_letters; rollups requests_1m/1h, misses_1m/1h, "
    "affinity_1m/1h, vllm_1m/1h (docs/scale.md)."
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
        result = data.adhoc(text)
    except Exception as exc:  # noqa: BLE001  (refused, bad SQL, an unreadable result: a message, no traceback)
        st.error(f"**The query failed.** {charts.plain(data.error_text(exc))}", icon=":material/error:")
    else:
        cut = f" (the first {MAX_ROWS:,}: the limit)" if result.height >= MAX_ROWS else ""
        st.caption(f"{result.height:,} rows{cut}")
        if result.height:
            charts.table(result, key="sql_result")

with st.expander("Named queries (sql/queries)"):
    for name in sqlfiles.query_names():
        q = sqlfiles.load_query(name)
        st.markdown(
            f"**{name}**: {q.description}  \n"
            f"params: {', '.join(f'`{p.name}`' for p in q.params) or 'none'}; "
            f"columns: {', '.join(f'`{c.name}`' for c in q.returns)}"
        )
