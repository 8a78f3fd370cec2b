"""Query results as text for a terminal (``kvscope query/sql --format table``) or a Markdown document
(``--format markdown``).

Cells are formatted the same way in both: integers with thousands separators ("3,232"), floats with the
digits their column needs (4 significant digits of the column's smallest non-zero magnitude, at most 6
decimals), fractions and percentages as the query returned them (a fraction stays 0.5096, never "50.96 %"),
times as ``YYYY-MM-DD HH:MM:SS[.mmm]`` in the column's zone (named queries return UTC), NULL as an en dash,
nested values as JSON text. Numbers are right-aligned.

The terminal table fits a width (:func:`terminal_width`): the widest text columns are cut first, their
cells ending in an ellipsis; times and numbers keep their full width while the table still fits; a result
with too many columns for the width is shown one record per row instead. Markdown
is GitHub-flavoured (a header row, a separator row with ``---:`` for numeric columns) and never truncated.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
from datetime import date, datetime, time
from typing import Any

import polars as pl

from dashboard.untrusted import shown

#: How NULL shows (as on the dashboard's tables).
MISSING = "–"
#: Width when stdout is not a terminal and $COLUMNS is not set.
DEFAULT_WIDTH = 120
#: Columns never shrink below this many characters (an ellipsis and a few characters of the value); a result
#: whose columns do not fit at this width is shown as records instead (:func:`render_records`).
MIN_COLUMN_WIDTH = 6


def terminal_width(isatty: bool) -> int:
    """Characters per line for the table: ``$COLUMNS`` when set to a positive integer, else the terminal's
    width when stdout is one (``shutil.get_terminal_size``), else :data:`DEFAULT_WIDTH` (120)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if isatty:
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def _float_decimals(values: pl.Series) -> int:
    """Decimals for a float column: enough for 4 significant digits of its smallest non-zero |value|, 0..6."""
    finite = [abs(v) for v in values.drop_nulls().to_list() if v and math.isfinite(v)]
    if not finite:
        return 1
    return max(0, min(6, 3 - math.floor(math.log10(min(finite)))))


def _time_text(value: datetime | time, millis: bool) -> str:
    text = value.strftime("%Y-%m-%d %H:%M:%S" if isinstance(value, datetime) else "%H:%M:%S")
    return text + f".{value.microsecond // 1000:03d}" if millis else text


def _json_default(value: Any) -> str:
    return value.isoformat() if isinstance(value, date | datetime | time) else str(value)


def json_text(value: Any) -> str:
    """A nested value (a list, a dict, a tuple, or a polars Series of one) as one line of JSON: times and dates
    ISO 8601 (``2026-11-29T12:00:05+00:00``), a map's keys as text (a DateTime key too, which ``json`` refuses),
    anything else JSON cannot hold as its ``str``."""
    if isinstance(value, pl.Series):
        value = value.to_list()
    return json.dumps(_text_keys(value), default=_json_default)


def writable(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with the top-level columns JSON and CSV writers cannot take as text: a duration (a ClickHouse Interval
    of seconds or less) in ISO 8601 (``PT5S``), bytes (a state or a value no other rule shows) as hex."""
    return df.with_columns(
        *(pl.col(c).dt.to_string("iso") for c, t in df.schema.items() if isinstance(t, pl.Duration)),
        *(pl.col(c).bin.encode("hex") for c, t in df.schema.items() if t == pl.Binary))


def render_json(df: pl.DataFrame) -> str:
    """``df`` as a JSON array of row objects (``--format json``): polars' ``write_json``, except for a frame
    holding a Map whose keys are not String anywhere (polars cannot write one: a ClickHouse ``Map(UInt8, ..)``
    or ``Map(DateTime, ..)``), written the same way with the keys as text (:func:`json_text`)."""
    df = writable(df)
    if not any(holds_map(t, keyed=True) for t in df.dtypes):
        return df.write_json()
    return json.dumps(_text_keys(df.to_dicts()), default=_json_default, separators=(",", ":"))


def _text_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k if isinstance(k, str | int | float | bool) or k is None else _json_default(k): _text_keys(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_text_keys(v) for v in value]
    return value


def holds_map(dtype: pl.DataType, *, keyed: bool = False) -> bool:
    """Whether ``dtype`` is or holds (in a List, Array or Struct) a Map; with ``keyed``, one whose keys are not
    String (a ClickHouse ``Map(UInt8, ..)`` or ``Map(DateTime, ..)``)."""
    if isinstance(dtype, pl.Map):
        return not keyed or dtype.key != pl.String or holds_map(dtype.value, keyed=keyed)
    if isinstance(dtype, pl.List | pl.Array):
        return holds_map(dtype.inner, keyed=keyed)
    if isinstance(dtype, pl.Struct):
        return any(holds_map(f.dtype, keyed=keyed) for f in dtype.fields)
    return False


def _text(value: Any) -> str:
    """One line of visible text for a string or other scalar: line breaks and tabs become spaces; other control
    characters (an ANSI escape sequence's ESC, BEL), bidirectional overrides and invisible format characters
    become escapes such as ``\x1b`` (:func:`dashboard.untrusted.shown`), so a value read from the gateway log
    cannot drive the terminal or hide what it is."""
    if value is None:
        return MISSING
    return shown(" ".join(str(value).replace("\t", " ").splitlines()), limit=None)


#: Shrink order when a table is too wide: text first, then times, then numbers (kept whole longest).
TEXT, TIME, NUMBER = 0, 1, 2


def column_cells(series: pl.Series) -> tuple[list[str], int]:
    """``(cells, kind)``: a column's values as display text (see the module docstring) and its kind,
    :data:`TEXT`, :data:`TIME` or :data:`NUMBER` (right-aligned, shrunk last)."""
    dtype = series.dtype
    values = series.to_list()
    if dtype.is_integer():
        return [MISSING if v is None else f"{v:,}" for v in values], NUMBER
    if dtype.is_float() or dtype.is_decimal():
        d = _float_decimals(series.cast(pl.Float64))
        return [MISSING if v is None else (f"{v:,.{d}f}" if math.isfinite(v) else str(v)) for v in values], NUMBER
    if isinstance(dtype, pl.Datetime) or dtype == pl.Time:
        millis = any(v is not None and v.microsecond for v in values)
        return [MISSING if v is None else _time_text(v, millis) for v in values], TIME
    if dtype == pl.Date:
        return [MISSING if v is None else v.isoformat() for v in values], TIME
    if dtype == pl.Boolean:
        return [MISSING if v is None else ("true" if v else "false") for v in values], TEXT
    if dtype.is_nested():
        return [MISSING if v is None else json_text(v) for v in values], TEXT
    return [_text(v) for v in values], TEXT


def _columns(df: pl.DataFrame) -> list[tuple[str, list[str], int]]:
    return [(_text(name), *column_cells(df[name])) for name in df.columns]


def _water_fill(widths: list[int], floors: list[int], excess: int) -> list[int]:
    """Widths with the widest cut to a common cap c (never below their floor) so that about ``excess``
    characters go: the largest c that removes at least ``excess`` (binary search), then columns cut to c given
    one character back while more than ``excess`` would go."""
    def removed(c: int) -> int:
        return sum(w - max(f, min(w, c)) for w, f in zip(widths, floors, strict=True))

    lo, hi = 0, max(widths, default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if removed(mid) >= excess else (lo, mid - 1)
    slack = removed(lo) - excess
    out = []
    for w, f in zip(widths, floors, strict=True):
        cut = max(f, min(w, lo))
        if cut < w and cut == lo and slack > 0:
            cut, slack = cut + 1, slack - 1
        out.append(cut)
    return out


def fit_widths(natural: list[int], content: list[int], kinds: list[int], budget: int) -> list[int]:
    """Column widths (characters) whose sum is at most ``budget`` when it can be. ``natural``: the widest of
    header and cells; ``content``: the widest cell. Cut in turn, the widest first, until the sum fits: text
    columns and the part of a header wider than its number or time cells; then times; then numbers. No column
    goes below :data:`MIN_COLUMN_WIDTH` (or its natural width when narrower); over budget only when every
    column is at that minimum (then :func:`render_table` shows records instead)."""
    floor = [min(n, MIN_COLUMN_WIDTH) for n in natural]
    widths = list(natural)
    stages = (
        [floor[i] if k == TEXT else max(floor[i], min(natural[i], content[i])) for i, k in enumerate(kinds)],
        [floor[i] if k in (TEXT, TIME) else w for i, (k, w) in enumerate(zip(kinds, widths, strict=True))],
        floor,
    )
    for floors in stages:
        excess = sum(widths) - budget
        if excess <= 0:
            break
        floors = [min(f, w) for f, w in zip(floors, widths, strict=True)]
        widths = _water_fill(widths, floors, excess)
    return widths


def render_table(df: pl.DataFrame, width: int, *, styled: bool = False) -> str:
    """``df`` as a text table at most ``width`` characters wide: cells and headers too long for their column
    end in an ellipsis, the widest text columns cut first (:func:`fit_widths`); numbers are right-aligned.
    When the columns do not fit even at :data:`MIN_COLUMN_WIDTH` each, one record per row instead
    (:func:`render_records`). ``styled``: a bold header with ANSI codes (for a terminal). An empty frame
    prints its header and "(no rows)"."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    columns = _columns(df)
    content = [max((len(c) for c in cells), default=0) for _, cells, _ in columns]
    natural = [max(len(name), n) for (name, _, _), n in zip(columns, content, strict=True)]
    gaps = 2 * (len(columns) - 1)  # between two columns: one space of padding and the (blank) border
    widths = fit_widths(natural, content, [kind for _, _, kind in columns], width - gaps)
    if sum(widths) + gaps > width and df.height:
        return render_records(columns, df.height, width)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), show_edge=False,
                  header_style="bold" if styled else "", caption="(no rows)" if df.is_empty() else None)
    for (name, _, kind), w in zip(columns, widths, strict=True):
        table.add_column(Text(name), justify="right" if kind == NUMBER else "left", no_wrap=True,
                         overflow="ellipsis", width=w)
    for i in range(df.height):
        table.add_row(*(Text(cells[i]) for _, cells, _ in columns))
    out = io.StringIO()
    console = Console(file=out, width=max(width, sum(widths) + gaps), force_terminal=styled,
                      color_system="standard" if styled else None, no_color=not styled, highlight=False,
                      emoji=False, markup=False, legacy_windows=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def render_records(columns: list[tuple[str, list[str], int]], rows: int, width: int) -> str:
    """Rows too wide for a table at ``width`` as records (psql's expanded display): a rule ``-[ row N ]---``,
    then one ``column  value`` line per column, names padded to the longest (cut to half the width at most),
    values cut with an ellipsis to fit."""
    name_width = min(max(len(name) for name, _, _ in columns), max(width // 2 - 2, 1))
    value_width = max(width - name_width - 2, 1)
    lines = []
    for i in range(rows):
        title = f"-[ row {i + 1} ]"
        lines.append(title + "-" * max(width - len(title), 0))
        lines += [f"{_cut(name, name_width):<{name_width}}  {_cut(cells[i], value_width)}".rstrip()
                  for name, cells, _ in columns]
    return "\n".join(lines) + "\n"


#: Characters that start Markdown markup inside a table cell (emphasis, code, links and images, HTML tags and
#: entities, strikethrough, math, the cell separator); backslash-escaped so a cell shows as written. An
#: underscore inside a word (``tenant_id``) starts nothing in GitHub's Markdown and stays as it is.
_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|~$&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def _md_cell(text: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", _text(text))


def render_markdown(df: pl.DataFrame) -> str:
    """``df`` as a GitHub-flavoured Markdown table: header, separator (``---:`` under numeric columns), one
    line per row, every row with the header's cell count; Markdown's markup characters in a cell (``|``, ``*``,
    ``_``, ``[``, ``<``, ...) are backslash-escaped, so a value shows as written and never as a link, an image or
    HTML; nothing is truncated."""
    columns = _columns(df)
    lines = ["| " + " | ".join(_md_cell(name) for name, _, _ in columns) + " |",
             "|" + "|".join("---:" if kind == NUMBER else "---" for _, _, kind in columns) + "|"]
    for i in range(df.height):
        lines.append("| " + " | ".join(_md_cell(cells[i]) for _, cells, _ in columns) + " |")
    return "\n".join(lines) + "\n"
