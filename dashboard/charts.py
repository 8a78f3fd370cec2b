"""Chart and number helpers shared by the dashboard pages (plotly figures, formatted metrics, empty states).

Every helper takes a polars frame as a named query returned it and copes with an empty one by saying so
instead of drawing an empty axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.express as px
import plotly.graph_objects as go
import polars as pl
import streamlit as st

NO_DATA_YET = (
    "No data yet. kvscope fills these panels once the collector has scraped vLLM twice and the "
    "gateway has logged requests (`kvscope up`, or `kvscope demo` for a live demo fleet)."
)
NO_DATA_IN_WINDOW = "No data in this time range and filter yet; widen the time range in the sidebar."

#: Labels of the terms DESIGN.md defines, used for axis titles, legends and column headers.
LABELS = {
    "token_weighted_hit_rate": "Token-weighted hit rate",
    "request_weighted_hit_rate": "Request-weighted hit rate",
    "tenant_cache_affinity": "Tenant cache affinity",
    "prompt_fingerprint_cardinality": "Prompt fingerprint cardinality",
    "missed_tokens": "Missed tokens",
    "prefix_tokens": "Prefix tokens served",
    "bucket": "Time (UTC)",
    "vllm_token_weighted_hit_rate": "Token-weighted hit rate (vLLM)",
    "kv_cache_usage": "KV cache usage",
    "p50_ms": "p50",
    "p95_ms": "p95",
    "p99_ms": "p99",
}


def pct(x: float | None, digits: int = 2) -> str:
    """A fraction as a percentage ("50.96%"), or an en dash when there is none."""
    return "–" if x is None else f"{x * 100:.{digits}f}%"


def count(n: float | None) -> str:
    """An integer with thousands separators ("3,232"), or an en dash."""
    return "–" if n is None else f"{int(n):,}"


def no_data(in_window: bool = False, latest: object = None) -> None:
    """The friendly empty state of a page: nothing stored yet, or nothing in the window (``latest``: the
    newest data's time, to say how far to widen it)."""
    text = NO_DATA_IN_WINDOW if in_window else NO_DATA_YET
    if in_window and latest is not None:
        text += f" The latest data is from {latest:%Y-%m-%d %H:%M:%S} UTC."
    st.info(text, icon=":material/hourglass_empty:")


def _show(fig: go.Figure, key: str | None = None) -> None:
    fig.update_layout(margin={"l": 10, "r": 10, "t": 40, "b": 10}, legend_title_text="")
    st.plotly_chart(fig, key=key)


def time_lines(
    df: pl.DataFrame,
    y: str | Sequence[str],
    title: str,
    *,
    color: str | None = None,
    dash: str | None = None,
    percent: bool = False,
    y_title: str | None = None,
    key: str | None = None,
) -> None:
    """Lines over ``bucket``. With several ``y`` columns each becomes a colour, and ``color`` (a column, e.g.
    the source) becomes the line dash; with one ``y``, ``color`` and ``dash`` are columns of ``df``."""
    if not isinstance(y, str) and not df.is_empty():
        df = df.unpivot(
            index=["bucket", *([color] if color else [])],
            on=list(y),
            variable_name="series",
            value_name="value",
        )
        df = df.drop_nulls("value").with_columns(pl.col("series").replace(LABELS))
        color, dash, y = "series", color, "value"
    if df.is_empty():
        st.caption(f"**{title}**: {NO_DATA_IN_WINDOW}")
        return
    fig = px.line(
        df.sort("bucket"),
        x="bucket",
        y=y,
        color=color,
        line_dash=dash,
        markers=True,
        title=title,
        labels={**LABELS, y: y_title or LABELS.get(y, y)},
    )
    if percent:
        fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    _show(fig, key)


def bars(
    df: pl.DataFrame,
    x: str,
    y: str | Sequence[str],
    title: str,
    *,
    color: str | None = None,
    percent: bool = False,
    barmode: str = "group",
    horizontal: bool = False,
    key: str | None = None,
) -> None:
    """Bars of ``y`` by ``x`` (several ``y`` columns become grouped or stacked series)."""
    if df.is_empty():
        st.caption(f"**{title}**: {NO_DATA_IN_WINDOW}")
        return
    if not isinstance(y, str):
        df = df.unpivot(index=[x], on=list(y), variable_name="series", value_name="value")
        df = df.with_columns(pl.col("series").replace(LABELS))
        color, y = "series", "value"
    args = {"y": x, "x": y, "orientation": "h"} if horizontal else {"x": x, "y": y}
    fig = px.bar(df, color=color, barmode=barmode, title=title, labels={**LABELS, "value": ""}, **args)
    (fig.update_yaxes if horizontal else fig.update_xaxes)(
        title_text="" if x == "label" else LABELS.get(x, x)
    )
    if percent:
        (fig.update_xaxes if horizontal else fig.update_yaxes)(tickformat=".0%")
    _show(fig, key)


def heatmap(df: pl.DataFrame, x: str, y: str, z: str, title: str, key: str | None = None) -> None:
    """A matrix of ``z`` over ``x`` × ``y`` (missing cells are 0)."""
    if df.is_empty():
        st.caption(f"**{title}**: {NO_DATA_IN_WINDOW}")
        return
    wide = df.pivot(on=x, index=y, values=z, aggregate_function="sum").fill_null(0).sort(y)
    cols = [c for c in wide.columns if c != y]
    fig = px.imshow(
        wide.select(cols).to_numpy(),
        x=cols,
        y=wide[y].to_list(),
        text_auto=True,
        color_continuous_scale="Blues",
        aspect="auto",
        title=title,
        labels={"x": x, "y": y, "color": LABELS.get(z, z)},
    )
    _show(fig, key)


def table(df: pl.DataFrame, *, percent_cols: Sequence[str] = (), key: str | None = None) -> None:
    """A data table with DESIGN.md's names as headers and fractions shown as percentages."""
    if df.is_empty():
        st.caption(NO_DATA_IN_WINDOW)
        return
    config = {
        c: st.column_config.NumberColumn(LABELS.get(c, c), format="percent")
        for c in percent_cols
        if c in df.columns
    }
    st.dataframe(df, hide_index=True, column_config=config, key=key)
