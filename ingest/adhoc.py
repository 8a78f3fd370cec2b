"""Ad hoc SQL (``kvscope sql``, the dashboard's SQL page): the limits the database enforces, the statement-kind
check in front of it, and ClickHouse errors as one readable line. :meth:`ingest.store.Store.adhoc` runs it.
"""

from __future__ import annotations

import re
from typing import Any

from ingest.errors import QueryError

#: Rows an ad hoc query returns at most; a result of exactly this many rows may have been cut.
ADHOC_MAX_ROWS = 10_000
#: Bytes of an ad hoc result at most, as ClickHouse counts its result blocks (``max_result_bytes``).
ADHOC_MAX_RESULT_BYTES = 64 << 20
#: Memory one ad hoc query may use (``max_memory_usage``); KVSCOPE_ADHOC_MAX_MEMORY_BYTES sets it.
ADHOC_MAX_MEMORY_BYTES = 2 << 30
#: Seconds an ad hoc query may run (``max_execution_time``).
ADHOC_MAX_SECONDS = 10

#: First words (of ClickHouse's own rendering of the statement) of the statements ad hoc SQL runs: reads only.
READ_KINDS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "EXISTS", "EXPLAIN", "(")
#: Asks ClickHouse's parser for the statement, rendered on one line: comments dropped, keywords upper case, one
#: statement only (a second one is a syntax error). Positions in a syntax error are the user's own.
FORMAT_QUERY = "SELECT formatQuerySingleLine({statement:String})"

# Literals, quoted names and comments are blanked before looking for clauses.
_NOT_CODE = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`[^`]*`|--[^\n]*|/\*.*?\*/", re.S)
_KIND = re.compile(r"\(|[A-Z]+(?: [A-Z]+)?")
_CH_ERROR = re.compile(r"Code:\s*(\d+)\.\s*DB::Exception:\s*(.*)", re.S)
_WRAPPER = re.compile(r"(?:\. )?:? In scope SELECT formatQuerySingleLine\(.*\)(?=\. \(\w+\)$)", re.S)
_HINTS = {
    159: "the query hit max_execution_time",
    241: "the query hit max_memory_usage; for ad hoc SQL it is KVSCOPE_ADHOC_MAX_MEMORY_BYTES",
    396: "add a LIMIT or select fewer or narrower columns",
}


def adhoc_settings(max_memory_bytes: int = ADHOC_MAX_MEMORY_BYTES,
                   max_seconds: int = ADHOC_MAX_SECONDS) -> dict[str, Any]:
    """The ClickHouse settings every ad hoc query runs under (datasette's ``sql_time_limit_ms`` and
    ``max_returned_rows``, enforced by the database).

    ``limit`` cuts the top-level result to :data:`ADHOC_MAX_ROWS` rows (subqueries keep theirs: ClickHouse's
    analyzer applies the setting to the outer query only); a result still larger than ``max_result_rows`` or
    ``max_result_bytes`` fails (``result_overflow_mode=throw``), as a query over ``max_memory_usage`` or
    ``max_execution_time`` does. ``readonly`` comes last: once it is set, no setting can change.
    """
    return {
        "max_execution_time": max_seconds,
        "max_memory_usage": max_memory_bytes,
        "limit": ADHOC_MAX_ROWS,
        "max_result_rows": ADHOC_MAX_ROWS,
        "max_result_bytes": ADHOC_MAX_RESULT_BYTES,
        "result_overflow_mode": "throw",
        "readonly": 1,
    }


def check_read_only(rendered: str) -> None:
    """Refuse a statement that is not a read, given ClickHouse's one-line rendering of it (:data:`FORMAT_QUERY`).

    The database's ``readonly`` stays the guard; this check names the refusal ("read-only: ...") instead of a
    syntax error (``SET``, ``SYSTEM``, ``DELETE`` do not parse with a FORMAT clause after them), and refuses
    what ``readonly`` lets through: ``KILL QUERY`` (a user may kill its own queries, and on chDB every session,
    the ingester's too, is the same user) and ``INTO OUTFILE`` (chDB writes the file). A ``FORMAT`` clause is
    refused too: kvscope chooses the output format. Raises :class:`QueryError`.
    """
    code = _NOT_CODE.sub("''", rendered).strip()
    m = _KIND.match(code)
    kind = m.group(0) if m else code.split(" ", 1)[0]
    if kind.split(" ")[0] not in READ_KINDS:
        raise QueryError(f"read-only: {kind} is refused; ad hoc SQL runs {', '.join(READ_KINDS[:-1])} only")
    if re.search(r"\bINTO OUTFILE\b", code):
        raise QueryError("read-only: INTO OUTFILE is refused (it writes a file)")
    if re.search(r"\bFORMAT \w+$", code):
        raise QueryError("drop the FORMAT clause: kvscope chooses the output format (--format on the command line)")


def error_line(text: str) -> str:
    """A ClickHouse error as one line: its message with its code (``<message> (NAME) [code N]``), without the
    driver's prefixes, the server's version and stack trace, the ``FORMAT Arrow`` clause the client appends,
    and the :data:`FORMAT_QUERY` wrapper; with a hint for the ad hoc limits. Other text is only joined onto
    one line."""
    m = _CH_ERROR.search(text)
    code = 0
    if m:
        code = int(m.group(1))
        message = re.split(r"\s*(?:\(version [^)]*\)|Stack trace:)", m.group(2))[0]
        message = message.replace("\n FORMAT Arrow", "")
        message = _WRAPPER.sub("", message.strip())
        text = f"{message} [code {code}]"
    line = " ".join(text.split())
    return f"{line} ({_HINTS[code]})" if code in _HINTS else line


def unique_names(names: list[str]) -> list[str]:
    """Column names made unique for a DataFrame: a repeated name gets ``_2``, ``_3``... (``SELECT 1, 1`` →
    ``1``, ``1_2``); a suffixed name that is taken is skipped."""
    taken = set(names)
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out or (n > 1 and candidate in taken):
            n += 1
            candidate = f"{name}_{n}"
        out.append(candidate)
    return out
