"""Chart and number helpers shared by the dashboard pages (plotly figures, formatted metrics, empty states).

Every helper takes a polars frame as a named query returned it and copes with an empty one by saying so
instead of drawing an empty axis. Time charts (``buckets`` given) state their bucket width in the title
("1 bucket = 1 min"), span the chosen window on the x-axis (not only the data), break their lines where a bucket
has no data instead of joining across the gap, and draw a bucket the data covers only in part (the window's
first, the newest one still filling) as a shaded, unconnected point, so it does not read as a sudden drop.
Causes take their colour from :mod:`dashboard.causes` (``color_map``), the same on every page and filter.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import plotly.express as px
import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dashboard import untrusted
from dashboard.data import Buckets

NO_DATA_YET = (
    "No data yet. kvscope fills these panels once the collector has scraped vLLM twice and the "
    "gateway has logged requests (`kvscope up`, or `kvscope demo` for a live demo fleet)."
)
NO_DATA_IN_WINDOW = "No data in this time range and filter yet; widen the time range in the sidebar."
#: Why a vLLM-only panel is empty while a tenant is picked (vLLM's metrics have no tenant label).
NO_TENANT_IN_VLLM = "vLLM's counters carry no tenant; pick **All tenants** in the sidebar to see them."
#: How a missing value shows in tables.
MISSING = "–"

#: Labels of the terms docs/miss-causes.md defines, used for axis titles, legends and column headers.
LABELS = {
    "token_weighted_hit_rate": "Token-weighted hit rate",
    "request_weighted_hit_rate": "Request-weighted hit rate",
    "cached_tokens_coverage": "Cached-count coverage",
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
_PARTIAL = "_partial"
_PARTIAL_NOTE = "partial bucket"


def pct(x: float | None, digits: int = 2) -> str:
    """A fraction as a percentage ("50.96%"), or an en dash when there is none."""
    return MISSING if x is None else f"{x * 100:.{digits}f}%"


def count(n: float | None) -> str:
    """An integer with thousands separators ("3,232"), or an en dash."""
    return MISSING if n is None else f"{int(n):,}"


def plain(text: str) -> str:
    """``text`` escaped for Streamlit's markdown: shown as written (no emphasis, link, colour, icon, LaTeX or
    HTML), line breaks kept (:func:`dashboard.untrusted.markdown`). Values from the gateway log go through
    :func:`name` instead, or :func:`dashboard.untrusted.shown` before they join a sentence."""
    return untrusted.markdown(text)


def name(value: object, empty: str = "") -> str:
    """A tenant, pod, model or request id for Streamlit's markdown: one visible line, cut when very long, '' as
    ``empty`` (:func:`dashboard.untrusted.shown`), escaped (:func:`plain`)."""
    return untrusted.markdown(untrusted.shown(value, empty=empty))


def shown_strings(df: pl.DataFrame, *, html: bool = False) -> pl.DataFrame:
    """``df`` with every String column's values as :func:`dashboard.untrusted.shown` makes them (one visible
    line, never cut: a chart's categories stay distinct), and HTML-escaped when ``html``: plotly draws a subset
    of HTML (``<b>``, ``<a href>``, ``<br>``) in tick labels, legends and hover text, and ``&lt;`` as ``<``."""
    if html:
        def conv(v: str) -> str:
            return untrusted.html_text(v, limit=None, quote=False)
    else:
        def conv(v: str) -> str:
            return untrusted.shown(v, limit=None)
    cols = [c for c, t in df.schema.items() if t == pl.String and not c.startswith("_")]
    if not cols or df.is_empty():
        return df
    return df.with_columns(pl.col(c).map_elements(conv, return_dtype=pl.String, skip_nulls=True) for c in cols)


def no_data(in_window: bool = False, latest: object = None) -> None:
    """The friendly empty state of a page: nothing stored yet (while ``kvscope up`` starts: what is starting,
    :func:`dashboard.status.render_startup`), or nothing in the window (``latest``: the newest data's time, to say
    how far to widen it)."""
    from dashboard import status

    context = status.registered_context()
    if not in_window and context is not None:
        status.render_startup(context)
        return
    text = NO_DATA_IN_WINDOW if in_window else NO_DATA_YET
    if in_window and latest is not None:
        text += f" The latest data is from {latest:%Y-%m-%d %H:%M:%S} UTC."
    st.info(text, icon=":material/hourglass_empty:")


def _show(fig: go.Figure, key: str | None = None, legend_below: bool = False) -> None:
    fig.update_layout(margin={"l": 10, "r": 10, "t": 40, "b": 10}, legend_title_text="")
    if legend_below:  # a half-width chart keeps its width for the data
        fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.3, "x": 0})
    st.plotly_chart(fig, key=key)


# -- time buckets --------------------------------------------------------------------------------------------
def fill_gaps(df: pl.DataFrame, series: Sequence[str], seconds: int) -> pl.DataFrame:
    """Every bucket from the first to the last for every series (``series``: the columns naming one), with
    nulls where a series has no row, so a line breaks at a gap instead of joining across it."""
    if df.is_empty():
        return df
    dtype = df.schema["bucket"]
    first, last = df["bucket"].min(), df["bucket"].max()
    grid = pl.datetime_range(first, last, timedelta(seconds=seconds), eager=True).cast(dtype).alias("bucket")
    keys = df.select(series).unique(maintain_order=True) if series else pl.DataFrame()
    frame = grid.to_frame().join(keys, how="cross") if series else grid.to_frame()
    return frame.join(df, on=["bucket", *series], how="left", maintain_order="left")


def mark_partial(df: pl.DataFrame, buckets: Buckets | None) -> pl.DataFrame:
    """Adds ``_partial``: whether the bucket reaches outside the time the data covers."""
    if buckets is None or buckets.covered is None or df.is_empty():
        return df.with_columns(pl.lit(False).alias(_PARTIAL))
    start, end = buckets.covered
    after = pl.col("bucket") + pl.duration(seconds=buckets.seconds)
    return df.with_columns(((pl.col("bucket") < start) | (after > end)).fill_null(False).alias(_PARTIAL))


def _partial_spans(fig: go.Figure, df: pl.DataFrame, seconds: int) -> None:
    """Shades the partial buckets of ``df`` on ``fig``'s time axis (centred on the bucket's point), with one
    legend entry saying what the shade means."""
    starts = df.filter(pl.col(_PARTIAL))["bucket"].unique().sort()
    half = timedelta(seconds=seconds / 2)
    for start in starts:  # no annotation text: plotly widens the axis to fit it
        fig.add_vrect(x0=start - half, x1=start + half, fillcolor="gray", opacity=0.12, line_width=0, layer="below")
    if len(starts):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker={"symbol": "square", "size": 12, "color": "rgba(128,128,128,0.3)"},
                name=f"{_PARTIAL_NOTE} (data covers part of it)",
                hoverinfo="skip",
            )
        )


def _split_partial(fig: go.Figure) -> None:
    """Takes the partial buckets (customdata) out of each line and draws them as open, unconnected markers."""
    extra = []
    for trace in fig.data:
        flags = [bool(c[0]) for c in trace.customdata] if trace.customdata is not None else []
        ys = list(trace.y)
        if not any(f and y is not None and y == y for f, y in zip(flags, ys, strict=True)):  # y == y: not NaN
            continue
        trace.y = [None if f else y for f, y in zip(flags, ys, strict=True)]
        extra.append(
            go.Scatter(
                x=trace.x,
                y=[y if f else None for f, y in zip(flags, ys, strict=True)],
                mode="markers",
                marker={"color": trace.line.color, "symbol": "circle-open", "size": 9},
                name=f"{trace.name} ({_PARTIAL_NOTE})",
                legendgroup=trace.legendgroup,
                showlegend=False,
                visible=trace.visible,
                hovertemplate=(trace.hovertemplate or "").replace("<extra>", f"<br>{_PARTIAL_NOTE}<extra>"),
            )
        )
    for trace in extra:
        fig.add_trace(trace)


def _naive_utc(t: datetime) -> str:
    """A time as plotly's axis reads the data's times: naive ISO 8601 in UTC."""
    return (t.astimezone(UTC) if t.tzinfo else t).replace(tzinfo=None).isoformat()


def time_axis(fig: go.Figure, buckets: Buckets) -> None:
    """Makes ``fig``'s x-axis show the chosen window whole (from the bucket holding its start to its end, half a
    bucket of margin each side for the bars), not only the span of the data."""
    if buckets.span is None:
        return
    start, end = buckets.span
    epoch = datetime(1970, 1, 1, tzinfo=start.tzinfo)
    start = start - timedelta(seconds=(start - epoch).total_seconds() % buckets.seconds)  # the bucket's start
    half = timedelta(seconds=buckets.seconds / 2)
    fig.update_xaxes(range=[_naive_utc(start - half), _naive_utc(end + half)])


def titled(title: str, buckets: Buckets | None) -> str:
    """A time chart's title with its bucket width: "Prefix-cache hit rate · 1 bucket = 1 min"."""
    return f"{title} · {buckets.label}" if buckets is not None else title


def time_lines(
    df: pl.DataFrame,
    y: str | Sequence[str],
    title: str,
    *,
    color: str | None = None,
    dash: str | None = None,
    dash_map: dict[str, str] | None = None,
    hidden: Collection[str] = (),
    percent: bool = False,
    y_title: str | None = None,
    buckets: Buckets | None = None,
    empty: str = NO_DATA_IN_WINDOW,
    legend_below: bool = False,
    key: str | None = None,
) -> None:
    """Lines over ``bucket``. With several ``y`` columns each becomes a colour, and ``color`` (a column, e.g.
    the source) becomes the line dash; with one ``y``, ``color`` and ``dash`` are columns of ``df``.

    ``dash_map`` fixes the dash of each value of the dash column; lines of a dash value in ``hidden`` start
    hidden (a click on the legend shows them). ``buckets`` breaks lines at missing buckets and marks partial
    ones; ``empty`` is what an empty chart says instead; ``legend_below`` leaves a narrow chart its width.
    """
    if not isinstance(y, str) and not df.is_empty():
        df = df.unpivot(
            index=["bucket", *([color] if color else [])],
            on=list(y),
            variable_name="series",
            value_name="value",
        )
        df = df.drop_nulls("value").with_columns(pl.col("series").replace(LABELS))
        color, dash, y = "series", color, "value"
    title = titled(title, buckets)
    if df.is_empty():
        st.caption(f"**{title}**: {empty}")
        return
    series = [c for c in (color, dash) if c]
    if buckets is not None:
        df = fill_gaps(df.select(["bucket", *series, y]), series, buckets.seconds)
    df = shown_strings(mark_partial(df, buckets), html=True)
    fig = px.line(
        df.sort("bucket", maintain_order=True),
        x="bucket",
        y=y,
        color=color,
        line_dash=dash,
        line_dash_map=dash_map or {},
        markers=True,
        title=title,
        custom_data=[_PARTIAL],
        labels={**LABELS, y: y_title or LABELS.get(y, y)},
    )
    fig.update_traces(connectgaps=False)
    for trace in fig.data:
        if dash and any(trace.name.endswith(f", {h}") or trace.name == h for h in hidden):
            trace.visible = "legendonly"
            trace.opacity = 0.75
    _split_partial(fig)
    if buckets is not None:
        _partial_spans(fig, df, buckets.seconds)
        time_axis(fig, buckets)
    if percent:
        fig.update_yaxes(tickformat=".0%", range=[0, 1.02])
    _show(fig, key, legend_below)


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
    buckets: Buckets | None = None,
    empty: str = NO_DATA_IN_WINDOW,
    legend_below: bool = False,
    color_map: Mapping[str, str] | None = None,
    key: str | None = None,
) -> None:
    """Bars of ``y`` by ``x`` (several ``y`` columns become grouped or stacked series; missing values draw no
    bar). Percent bars are labelled and run from 0 to 100 %; over ``bucket`` with ``buckets``, bars of partial
    buckets are faded. ``color_map``: the colour of each value of ``color`` (e.g. ``causes.color_map``)."""
    if not isinstance(y, str) and not df.is_empty():
        df = df.unpivot(index=[x], on=list(y), variable_name="series", value_name="value")
        df = df.with_columns(pl.col("series").replace(LABELS))
        color, y = "series", "value"
    df = df.drop_nulls(y) if not df.is_empty() else df
    timed = x == "bucket" and buckets is not None
    title = titled(title, buckets if timed else None)
    if df.is_empty():
        st.caption(f"**{title}**: {empty}")
        return
    df = shown_strings(mark_partial(df, buckets if timed else None), html=True)
    args = {"y": x, "x": y, "orientation": "h"} if horizontal else {"x": x, "y": y}
    fig = px.bar(
        df,
        color=color,
        barmode=barmode,
        title=title,
        custom_data=[_PARTIAL],
        labels={**LABELS, "value": ""},
        color_discrete_map=dict(color_map or {}),
        **args,
    )
    (fig.update_yaxes if horizontal else fig.update_xaxes)(
        title_text="" if x == "label" else LABELS.get(x, x)
    )
    if percent:
        (fig.update_xaxes if horizontal else fig.update_yaxes)(tickformat=".0%", range=[0, 1])
        fig.update_traces(
            texttemplate="%{x:.1%}" if horizontal else "%{y:.1%}", textposition="outside", cliponaxis=False
        )
    if timed:
        for trace in fig.data:
            trace.marker.opacity = [0.35 if c[0] else 1.0 for c in trace.customdata]
        _partial_spans(fig, df, buckets.seconds)  # type: ignore[union-attr]
        time_axis(fig, buckets)  # type: ignore[arg-type]
    _show(fig, key, legend_below)


def heatmap(
    df: pl.DataFrame,
    x: str,
    y: str,
    z: str,
    title: str,
    *,
    text: str | None = None,
    color_scale: str = "Blues",
    show_scale: bool = True,
    key: str | None = None,
) -> None:
    """A matrix of ``z`` over ``x`` × ``y`` (missing cells are 0), its colour scale from 0; ``text``: a column
    to write in each cell instead of ``z``."""
    if df.is_empty():
        st.caption(f"**{title}**: {NO_DATA_IN_WINDOW}")
        return
    df = shown_strings(df, html=True)
    wide = df.pivot(on=x, index=y, values=z, aggregate_function="sum").fill_null(0).sort(y)
    cols = [c for c in wide.columns if c != y]
    fig = px.imshow(
        wide.select(cols).to_numpy(),
        x=cols,
        y=wide[y].to_list(),
        text_auto=text is None,
        zmin=0,
        color_continuous_scale=color_scale,
        aspect="auto",
        title=title,
        labels={"x": LABELS.get(x, x), "y": LABELS.get(y, y), "color": LABELS.get(z, z)},
    )
    if text is not None:
        cells = df.pivot(on=x, index=y, values=text, aggregate_function="first").fill_null("").sort(y)
        fig.update_traces(text=cells.select(cols).to_numpy(), texttemplate="%{text}")
    if not show_scale:
        fig.update_layout(coloraxis_showscale=False)
    _show(fig, key)


def table(
    df: pl.DataFrame,
    *,
    percent_cols: Sequence[str] = (),
    labels: dict[str, str] | None = None,
    key: str | None = None,
) -> None:
    """A data table with docs/miss-causes.md's names (or ``labels``) as headers, fractions shown as percentages and
    missing values as an en dash."""
    if df.is_empty():
        st.caption(NO_DATA_IN_WINDOW)
        return
    names = {**LABELS, **(labels or {})}
    config: dict[str, object] = {c: names[c] for c in df.columns if c in (labels or {})}
    config.update(
        {
            c: st.column_config.NumberColumn(names.get(c, c), format="percent")
            for c in percent_cols
            if c in df.columns
        }
    )
    st.dataframe(shown_strings(df), hide_index=True, column_config=config, placeholder=MISSING, key=key)
