"""The digest's inline charts as static PNG images (matplotlib, Agg backend: no display, no pyplot state, so a
scheduler thread can draw while the dashboard runs).

Colours come from :mod:`dashboard.causes` (one colour per cause and sub-cause, as on every dashboard page).
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

from dashboard.digest import Digest  # noqa: E402

#: Pixels per inch of the PNGs; the HTML shows them at :data:`WIDTH_PX` CSS pixels (sharp on 2x screens).
DPI = 200
WIDTH_PX = 640
NOW_COLOR = "#0072B2"
PREVIOUS_COLOR = "#999999"


def compact(n: float) -> str:
    """Token counts for people: 950, 9,500, 95k, 1.2M, 3.4B."""
    n = float(n)
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size * (10 if unit == "k" else 1):
            value = n / size
            return f"{value:.1f}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"
    return f"{n:,.0f}"


def causes_png(d: Digest) -> bytes | None:
    """Missed tokens by cause / sub-cause as horizontal bars (largest on top), each in its cause colour, labelled
    with tokens and share. None when the period missed nothing."""
    lines = [c for c in d.causes if c.missed_tokens > 0]
    if not lines:
        return None
    fig = Figure(figsize=(WIDTH_PX / 100, 0.42 * len(lines) + 1.1), dpi=DPI)
    ax = fig.add_subplot()
    labels = [c.label for c in reversed(lines)]
    values = [c.missed_tokens for c in reversed(lines)]
    bars = ax.barh(labels, values, color=[c.color for c in reversed(lines)], edgecolor="none")
    for bar, c in zip(bars, reversed(lines), strict=True):
        ax.annotate(f" {compact(c.missed_tokens)} ({c.share_of_missed * 100:.0f} %)",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.3)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: compact(x)))
    ax.set_xlabel("missed prompt tokens")
    ax.set_title("Where the missed tokens went", loc="left", fontsize=10)
    _style(ax, grid="x")
    return _png(fig)


def hit_rate_png(d: Digest) -> bytes | None:
    """The headline source's token-weighted hit rate per bucket over the period (solid) and the period before
    (dashed), on one time axis (time since each period's start; a point sits at its bucket's middle). None when
    neither period has a point."""
    if not d.series and not d.previous_series:
        return None
    hours = d.length.total_seconds() >= 3 * 3600
    scale, unit = (3600, "hours") if hours else (60, "minutes")
    fig = Figure(figsize=(WIDTH_PX / 100, 2.6), dpi=DPI)
    ax = fig.add_subplot()
    end = d.length.total_seconds()
    for series, color, style, name in ((d.previous_series, PREVIOUS_COLOR, "--", "previous period"),
                                       (d.series, NOW_COLOR, "-", "this period")):
        if series:
            xs = [min(x + d.bucket_seconds / 2, end) / scale for x, _ in series]
            ax.plot(xs, [y for _, y in series], style, color=color, label=name,
                    marker="o" if len(series) < 3 else None, markersize=3, linewidth=1.6)
    ax.set_xlim(0, d.length.total_seconds() / scale)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(f"{unit} since the period's start (bucket {_bucket(d.bucket_seconds)})")
    source = d.headline.source if d.headline else ""
    ax.set_title(f"Token-weighted hit rate ({'vLLM counters' if source == 'vllm' else 'gateway log'})",
                 loc="left", fontsize=10)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    _style(ax, grid="y")
    return _png(fig)


def _bucket(seconds: int) -> str:
    return f"{seconds // 3600} h" if seconds % 3600 == 0 else f"{seconds // 60} min"


def _style(ax, grid: str) -> None:  # type: ignore[no-untyped-def]
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=8)
    ax.grid(axis=grid, color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)


def _png(fig: Figure) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()
