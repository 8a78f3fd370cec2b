"""Pods: per pod requests, hit rate (gateway beside vLLM), KV cache usage, cache config; dead letters."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data

st.header("Pods")

NO_DEAD_LETTERS = "No dead letters: every line and event parsed."
PERCENT = ["token_weighted_hit_rate", "cached_tokens_coverage", "vllm_token_weighted_hit_rate", "kv_cache_usage"]


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    pods = data.named("pods", **f.params())
    if pods.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
    else:
        left, right = st.columns(2)
        with left:
            charts.bars(
                pods.rename({"token_weighted_hit_rate": "Token-weighted hit rate (gateway)"}),
                "pod",
                ["Token-weighted hit rate (gateway)", "vllm_token_weighted_hit_rate"],
                "Token-weighted hit rate per pod (gateway vs vLLM)",
                percent=True,
                legend_below=True,
                key="pod_hit_rate",
            )
        with right:
            charts.bars(pods, "pod", "kv_cache_usage", "KV cache usage (latest)", percent=True, key="pod_kv")
        note = (
            "KV cache usage counts blocks held by running requests; cached blocks no request holds count "
            "as free (vLLM's definition), so an idle pod shows ~0 % while still holding prefixes."
        )
        if f.tenant:
            note += " vLLM's counters carry no tenant: with a tenant selected, its hit-rate columns stay empty."
        st.caption(note)
        charts.table(pods, percent_cols=PERCENT, key="pod_table")
    st.subheader("Dead letters")
    since, until = f.window()
    dead = data.named("dead_letters", since=since, until=until, pod=f.pod)
    if dead.is_empty():
        st.success(NO_DEAD_LETTERS, icon=":material/check_circle:")
        return
    st.caption("Input the pipeline could not use, by source and reason: nothing is dropped silently.")
    charts.table(dead, key="dead_letters")


data.live(render)
