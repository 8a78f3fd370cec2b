"""``kvscope query/sql --format table|markdown|json|csv`` on the fixture (tests/fixture_data.py) in a real chDB
store: the table fits the terminal width ($COLUMNS, else 120 off a terminal), cuts long cells with an ellipsis,
right-aligns numbers with thousands separators; Markdown parses as a GitHub table; JSON and CSV are polars'
own output, unchanged."""

from __future__ import annotations

import uuid
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner
from markdown_it import MarkdownIt

from ingest.store import Store
from kvscope.cli import main
from kvscope.tables import MIN_COLUMN_WIDTH, fit_widths
from tests.clock import DAY
from tests.fixture_data import load_fixture


@pytest.fixture(scope="module")
def fx(chdb_dir: Path) -> Store:
    s = Store.open(data_dir=chdb_dir, database=f"fmt_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_fixture(s)
    return s


def cli(store: Store, *args: str, columns: int | None = None) -> str:
    """stdout of ``kvscope <args>`` on ``store`` with $COLUMNS set (None: unset); stdout is not a terminal."""
    data_dir = store.dsn.removeprefix("chdb://")
    env = {"COLUMNS": None if columns is None else str(columns)}
    result = CliRunner().invoke(main, [*args, "--data-dir", data_dir, "--database", store.database], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.stderr
    return result.stdout


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_table_fits_the_width_at_200(fx: Store) -> None:
    """miss_requests has 17 columns, 300 characters at full width: at 200 every line fits, the widest text
    cells end in an ellipsis, timestamps and numbers stay whole, and no column is dropped."""
    out = cli(fx, "query", "miss_requests", columns=200)
    assert widest(out) <= 200
    lines = out.splitlines()
    assert len(lines) == 2 + 16  # header, rule, one line per (request, cause) row
    assert len(lines[0].split()) == 17, lines[0]  # a cut header ends in "…" but stays
    assert "…" in lines[0] and "…" in out.split("\n", 2)[2]
    assert lines[2].startswith(f"{DAY} 12:02:00  ") and " 69,985 " in lines[2]  # the largest miss first


def test_too_many_columns_for_80_become_records(fx: Store) -> None:
    """At 80 characters, 17 columns of at least 6 do not fit: one record per row, every line within 80."""
    out = cli(fx, "query", "miss_requests", columns=80)
    assert widest(out) <= 80
    records = out.split("-[ row ")[1:]
    assert len(records) == 16
    first = dict(line.split(None, 1) for line in records[0].splitlines()[1:] if len(line.split(None, 1)) == 2)
    assert first["request_id"] == "acme-c1-t3" and first["missed_tokens"] == "768"
    assert first["gap_ms"] == "69,985" and first["ts"] == f"{DAY} 12:02:00"
    assert len(records[0].splitlines()) == 1 + 17


def test_table_numbers_right_aligned_with_separators(fx: Store) -> None:
    """miss_causes: cold 736 + 384 = 1,120 missed tokens, share 1,120 / 3,110 as the fraction it is."""
    out = cli(fx, "query", "miss_causes", columns=100)
    header, rule, *rows = out.splitlines()
    assert set(rule) == {"─"}
    (cold,) = [r for r in rows if r.split()[0] == "cold"]
    assert "1,120" in cold.split() and f"{1120 / 3110:.5f}" in cold.split()
    end = header.index("missed_tokens") + len("missed_tokens")
    assert all(r[:end].endswith(r[:end].split()[-1]) and r[end] == " " for r in rows)  # right edges align
    assert cold[:end].endswith("1,120")


def test_table_off_a_terminal_defaults_to_120(fx: Store) -> None:
    out = cli(fx, "query", "miss_requests", columns=None)
    assert 110 < widest(out) <= 120


def test_sql_table_keeps_every_column(fx: Store) -> None:
    """A long text cell is cut, its neighbours are not dropped; NULL shows as an en dash."""
    out = cli(fx, "sql", "SELECT repeat('x', 500) AS long, 1234567 AS n, CAST(NULL AS Nullable(Int32)) AS z",
              columns=80)
    header, _, row = out.splitlines()
    assert header.split() == ["long", "n", "z"]
    assert widest(out) == 80 and row.split()[0].endswith("…") and row.split()[1:] == ["1,234,567", "–"]


def test_markdown_parses(fx: Store) -> None:
    """A GitHub-flavoured table (markdown-it's GFM table rule): a header row, a separator row, every row with
    the header's cell count; nothing cut, numbers right-aligned."""
    out = cli(fx, "query", "miss_requests", "--format", "markdown", columns=80)
    lines = out.splitlines()
    assert lines[1].startswith("|---") and "---:" in lines[1]
    tokens = MarkdownIt("commonmark").enable("table").parse(out)
    assert [t.type for t in tokens[:2]] == ["table_open", "thead_open"]
    cells_per_row: list[int] = []
    aligns: list[str | None] = []
    for t in tokens:
        if t.type == "tr_open":
            cells_per_row.append(0)
        elif t.type in ("th_open", "td_open"):
            cells_per_row[-1] += 1
            if t.type == "th_open":
                aligns.append((t.attrGet("style") or "").removeprefix("text-align:") or None)
    assert cells_per_row == [17] * 17  # header + 16 rows
    names = pl.DataFrame(fx.named("miss_requests", {})).columns
    assert aligns[names.index("missed_tokens")] == "right" and aligns[names.index("request_id")] is None
    assert "…" not in out and widest(out) > 80
    assert "| cap-4-timestamp-first |" in out


def test_markdown_escapes_pipes(fx: Store) -> None:
    out = cli(fx, "sql", "SELECT 'a|b' AS s, 2 AS n", "--format", "markdown")
    assert out == "| s | n |\n|---|---:|\n| a\\|b | 2 |\n"
    tokens = MarkdownIt("commonmark").enable("table").parse(out)
    assert [t.content for t in tokens if t.type == "inline"] == ["s", "n", "a|b", "2"]


@pytest.mark.parametrize("name", ["miss_requests", "hit_rate_total"])
def test_json_and_csv_unchanged(fx: Store, name: str) -> None:
    df = fx.named(name, {})
    assert cli(fx, "query", name, "--format", "json", columns=80) == df.write_json() + "\n"
    assert cli(fx, "query", name, "--format", "csv", columns=80) == df.write_csv()


@pytest.mark.parametrize(("natural", "content", "kinds", "budget", "expected"), [
    ([10, 5, 8], [10, 5, 8], [0, 2, 1], 30, [10, 5, 8]),    # fits: natural widths
    ([40, 20, 8], [40, 20, 8], [0, 0, 2], 40, [16, 16, 8]),  # the widest text columns cut alike, numbers kept
    ([40, 21, 8], [40, 21, 8], [0, 0, 2], 40, [16, 16, 8]),
    ([40, 19, 8], [40, 19, 8], [0, 1, 2], 40, [13, 19, 8]),  # text before times
    ([40, 19, 8], [40, 19, 8], [0, 1, 2], 30, [6, 16, 8]),
    ([30, 19, 8], [30, 19, 8], [0, 1, 2], 24, [6, 10, 8]),   # then times
    ([30, 19, 12], [30, 19, 12], [0, 1, 2], 5, [6, 6, 6]),   # over budget only at the minimum
    ([30, 21, 8], [30, 5, 8], [0, 2, 2], 40, [16, 16, 8]),   # a number's long header is cut like text...
    ([30, 21, 8], [30, 5, 8], [0, 2, 2], 20, [6, 6, 8]),     # ...down to its values, which stay whole
    ([5, 2], [5, 2], [0, 2], 1, [5, 2]),                     # narrower than the minimum: never widened
])
def test_fit_widths(natural: list[int], content: list[int], kinds: list[int], budget: int,
                    expected: list[int]) -> None:
    widths = fit_widths(natural, content, kinds, budget)
    assert widths == expected
    assert sum(widths) <= budget or all(w == min(n, MIN_COLUMN_WIDTH) for w, n in zip(widths, natural, strict=True))


def test_show_sql_prints_the_query_with_its_parts_expanded(fx: Store) -> None:
    """`kvscope query NAME --show-sql`: the SQL that runs, its `-- include:` lines replaced by the parts' text."""
    import sql as sqlfiles

    raw = (sqlfiles.QUERIES_DIR / "miss_causes.sql").read_text()
    part = (sqlfiles.QUERIES_DIR.parent / "parts" / "prefill_cost.sql").read_text()
    out = cli(fx, "query", "miss_causes", "--show-sql")
    assert "-- include: prefill_cost" in raw
    assert "-- include:" not in out and part.strip() in out
    assert out.strip() == sqlfiles.load_query("miss_causes").sql.strip()
