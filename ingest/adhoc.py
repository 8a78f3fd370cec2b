"""Ad hoc SQL (``kvscope sql``, the dashboard's SQL page): the limits the database enforces, the statement-kind
check in front of it, and ClickHouse errors as one readable line. :meth:`ingest.store.Store.adhoc` runs it.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import re
import struct
import zoneinfo
from collections.abc import Callable
from typing import Any

import polars as pl
import pyarrow as pa
from polars.exceptions import PanicException

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
#: Asks ClickHouse's parser for the syntax tree of a statement (the rendered one is appended): one node a line,
#: each child one space deeper than its parent. It only parses; nothing is read, called or fetched.
EXPLAIN_AST = "EXPLAIN AST "
#: The table functions ClickHouse lets a read-only user call (``system.table_functions.allow_readonly``:
#: numbers, values, view, merge ...; not file, url, s3, remote, executable, mysql, format ...).
READONLY_TABLE_FUNCTIONS = "SELECT name FROM system.table_functions WHERE allow_readonly"
#: Functions that read a file of the server, which ``readonly`` does not stop: ``file(path)`` returns a file's
#: contents as a String (ClickHouse docs, "Functions for working with files"; chDB reads any path).
FILE_FUNCTIONS = frozenset({"file"})
#: Why a statement whose syntax tree is too large to read whole (:data:`ADHOC_MAX_ROWS` nodes) is refused.
TOO_LARGE = f"read-only: the statement is too large to check (at most {ADHOC_MAX_ROWS:,} syntax tree nodes)"
#: Asks ClickHouse for the result types of a query (the rendered one is put between the parentheses).
DESCRIBE_RESULT = "DESCRIBE TABLE ({statement})"

# Literals, quoted names and comments are blanked before looking for clauses.
_NOT_CODE = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`[^`]*`|--[^\n]*|/\*.*?\*/", re.S)
#: Clause keywords that end a statement's head (``KILL QUERY WHERE``, ``GRANT SELECT ON``, ``DROP TABLE IF``).
_CLAUSES = frozenset({"WHERE", "ON", "TO", "AS", "IF", "FOR", "USING", "SETTINGS", "FORMAT", "VALUES", "AND",
                      "FINAL", "ASYNC", "SYNC", "SELECT", "WITH"})
_TOKEN = re.compile(r"\w+|\S")
_WORD = re.compile(r"[A-Za-z]+")
_AST_NODE = re.compile(r" *(\w+)(?: (\S+))?")
#: A ClickHouse DateTime type (not DateTime64), its time zone in group 1: Arrow carries it as uint32 seconds.
_DATETIME = re.compile(r"DateTime(?:\('([^']*)'\))?")
_WRAPPED = re.compile(r"(?:Nullable|LowCardinality)\((.*)\)")
#: A named Tuple element (``at DateTime('UTC')``, the name possibly back-quoted), its type in group 1.
_NAMED_ELEMENT = re.compile(r"(?:`(?:[^`\\]|\\.)*`|[A-Za-z_]\w*)\s+(\S.*)", re.S)
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


def check_read_only(rendered: str, statement: str) -> None:
    """Refuse a statement that is not a read, given ClickHouse's one-line rendering of it (:data:`FORMAT_QUERY`)
    and the statement as the user wrote it.

    The database's ``readonly`` stays the guard; this check names the refusal ("read-only: ...") instead of a
    syntax error (``SET``, ``SYSTEM``, ``DELETE`` do not parse with a FORMAT clause after them), and refuses
    what ``readonly`` lets through: ``KILL QUERY`` (a user may kill its own queries, and on chDB every session,
    the ingester's too, is the same user) and ``INTO OUTFILE`` (chDB writes the file). A ``FORMAT`` clause is
    refused too: kvscope chooses the output format. A refused statement is named by its leading keywords as
    the user wrote them (:func:`statement_head`). Raises :class:`QueryError`.
    """
    code = _NOT_CODE.sub("''", rendered).strip()
    if code.split(" ", 1)[0] not in READ_KINDS and code[:1] != "(":
        raise QueryError(f"read-only: {statement_head(rendered, statement)} is refused; ad hoc SQL runs "
                         f"{', '.join(READ_KINDS[:-1])} only")
    if re.search(r"\bINTO OUTFILE\b", code):
        raise QueryError("read-only: INTO OUTFILE is refused (it writes a file)")
    if re.search(r"\bFORMAT \w+$", code):
        raise QueryError("drop the FORMAT clause: kvscope chooses the output format (--format on the command line)")


def statement_head(rendered: str, statement: str) -> str:
    """The keywords ``statement`` starts with, as the user wrote them (upper case): ``SYSTEM DROP DNS CACHE``,
    ``KILL QUERY``, ``INSERT INTO``, ``START TRANSACTION``, ``TRUNCATE``.

    ``rendered`` is ClickHouse's rendering of it (:data:`FORMAT_QUERY`), whose leading upper-case words up to a
    clause keyword (``WHERE``, ``ON``, ``IF`` ...) or a name are the head. The rendering renames some keywords
    (``SYSTEM DROP ... CACHE`` is rendered ``SYSTEM CLEAR ... CACHE``, ``START TRANSACTION`` ``BEGIN
    TRANSACTION``) and adds some (``TRUNCATE t`` is rendered ``TRUNCATE TABLE t``), so the head is mapped back
    onto the user's words by aligning the two token lists (:class:`difflib.SequenceMatcher`): a renamed word is
    the user's, an added one is dropped. Comments and literals are not words of either."""
    ours, theirs = _tokens(rendered), _tokens(statement)
    n = 1
    while n < len(ours) and _WORD.fullmatch(ours[n]) and ours[n].isupper() and ours[n] not in _CLAUSES:
        n += 1
    head: list[str] = []
    matcher = difflib.SequenceMatcher(None, [t.upper() for t in ours], [t.upper() for t in theirs], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if i1 >= n:
            break
        if tag == "equal":
            head += theirs[j1:j1 + min(i2, n) - i1]
        elif tag == "replace":  # words ClickHouse renamed ("delete" ones it added are dropped)
            head += theirs[j1:j2] if i2 <= n else theirs[j1:j1 + n - i1]
        elif tag == "insert":  # words the user wrote and the rendering leaves out
            head += theirs[j1:j2]
    words = [w.upper() for w in head if _WORD.fullmatch(w)]
    return " ".join(words) if words else " ".join(ours[:n])


def _tokens(text: str) -> list[str]:
    """The words and single signs of ``text``; a literal or quoted name is one token (``''``), a comment none."""
    return _TOKEN.findall(_NOT_CODE.sub(lambda m: "''" if m.group(0)[0] in "'\"`" else " ", text))


def check_sources(ast: list[str], table_functions: frozenset[str] | set[str]) -> None:
    """Refuse a statement that reaches outside the database's tables, given ClickHouse's syntax tree of it
    (the lines of :data:`EXPLAIN_AST`) and the table functions a read-only user may call
    (:data:`READONLY_TABLE_FUNCTIONS`).

    Refused, anywhere in the statement (subqueries, CTEs, EXPLAIN, joins): a table function not in
    ``table_functions`` (``readonly`` refuses a SELECT from ``file()`` or ``url()``, but ``DESCRIBE`` of one
    infers its schema unchecked: it reads a local file's first line or fetches a URL), a function of
    :data:`FILE_FUNCTIONS`, and ``DESCRIBE`` of anything but a table name (``DESCRIBE gateway_requests``). A tree
    of :data:`ADHOC_MAX_ROWS` lines or more may have been cut by the ``limit`` setting and is refused whole
    (:data:`TOO_LARGE`; ClickHouse's ``max_result_rows`` usually refuses it first).
    Raises :class:`QueryError` ("read-only: ...").
    """
    if len(ast) >= ADHOC_MAX_ROWS:
        raise QueryError(TOO_LARGE)
    nodes = [(m.group(1), m.group(2) or "") for m in map(_AST_NODE.match, ast) if m]
    describe = any(kind == "DescribeQuery" for kind, _ in nodes)
    for i, (kind, name) in enumerate(nodes):
        if kind == "Function" and name in FILE_FUNCTIONS:
            raise QueryError(f"read-only: {name}() is refused (it reads a file of the server)")
        if kind != "TableExpression" or i + 1 == len(nodes):
            continue
        child, child_name = nodes[i + 1]  # a node's first child is the next line: the table, function or subquery
        if describe and child != "TableIdentifier":
            raise QueryError("read-only: DESCRIBE takes a table name only (DESCRIBE gateway_requests)")
        if child == "Function" and child_name not in table_functions:
            raise QueryError(f"read-only: table function {child_name}() is refused; ad hoc SQL reads the "
                             "database's tables and the table functions ClickHouse allows read-only users "
                             "(numbers, values ...)")


def datetimes(table: pa.Table, types: list[str]) -> pa.Table:
    """``table`` (ClickHouse's Arrow output) with its ``DateTime`` values as timestamps: Arrow carries them as
    uint32 epoch seconds without type metadata. ``types``: the ClickHouse type of each column, in order (the
    ``type`` column of :data:`DESCRIBE_RESULT`). A ``DateTime`` (also Nullable, LowCardinality, and anywhere in
    an Array, a Tuple (named or not) or a Map, key or value) becomes ``timestamp[s]`` in its own time zone, UTC
    when it names none (or one Python does not know: the instant stays right); other values are kept."""
    columns = list(table.columns)
    for i, (column, ch_type) in enumerate(zip(columns, types, strict=True)):
        target = _timestamp_type(ch_type, column.type)
        if target is not None:  # Arrow casts uint32 to int64 and int64 to timestamp, not uint32 to timestamp
            columns[i] = column.cast(_int64_like(target)).cast(target)
    return pa.table(columns, names=table.column_names)


def _timestamp_type(ch_type: str, arrow_type: pa.DataType) -> pa.DataType | None:
    """``arrow_type`` with each DateTime of ``ch_type`` (a uint32 in Arrow) a timestamp; None when it has none."""
    while m := _WRAPPED.fullmatch(ch_type):
        ch_type = m.group(1)
    if (dt := _DATETIME.fullmatch(ch_type)) and arrow_type == pa.uint32():
        return pa.timestamp("s", dt.group(1) if dt.group(1) in _zones() else "UTC")
    outer, _, rest = ch_type.partition("(")
    if outer not in ("Array", "Tuple", "Map") or not rest.endswith(")"):
        return None
    args = _type_args(rest[:-1])
    if outer == "Tuple":  # a named element is "name Type"
        args = [m.group(1) if (m := _NAMED_ELEMENT.fullmatch(arg)) else arg for arg in args]
    fields = _children(arrow_type)
    if len(args) != len(fields):
        return None
    targets = [_timestamp_type(arg, f.type) for arg, f in zip(args, fields, strict=True)]
    if all(t is None for t in targets):
        return None
    return _with_children(arrow_type, [f if t is None else f.with_type(t) for f, t in zip(fields, targets,
                                                                                           strict=True)])


def _type_args(text: str) -> list[str]:
    """The arguments of a ClickHouse type (``String, Array(DateTime('UTC'))``), split at the commas outside
    parentheses and quotes, stripped."""
    args, depth, start = [], 0, 0
    for m in re.finditer(r"'(?:[^'\\]|\\.)*'|`[^`]*`|[(),]", text):
        sign = m.group(0)
        depth += {"(": 1, ")": -1}.get(sign, 0)
        if sign == "," and depth == 0:
            args.append(text[start:m.start()].strip())
            start = m.end()
    return [*args, text[start:].strip()]


def _children(t: pa.DataType) -> list[pa.Field]:
    """The fields a nested Arrow type holds: a list's item, a struct's fields, a map's key and value."""
    if pa.types.is_map(t):
        return [t.key_field, t.item_field]
    if pa.types.is_list(t):
        return [t.value_field]
    if pa.types.is_struct(t):
        return [t.field(i) for i in range(t.num_fields)]
    return []


def _with_children(t: pa.DataType, fields: list[pa.Field]) -> pa.DataType:
    """``t`` (a type with :func:`_children`) holding ``fields`` instead."""
    if pa.types.is_map(t):
        return pa.map_(fields[0], fields[1], t.keys_sorted)
    if pa.types.is_list(t):
        return pa.list_(fields[0])
    return pa.struct(fields)


@functools.cache
def _zones() -> frozenset[str]:
    """The time zone names Python knows (a zone ClickHouse knows and Python not is shown in UTC)."""
    return frozenset(zoneinfo.available_timezones())


def _int64_like(t: pa.DataType) -> pa.DataType:
    """``t`` with each timestamp an int64 (the step between uint32 and timestamp)."""
    if pa.types.is_timestamp(t):
        return pa.int64()
    fields = _children(t)
    return _with_children(t, [f.with_type(_int64_like(f.type)) for f in fields]) if fields else t


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


#: ClickHouse types whose Arrow form is not the value a reader means (ClickHouse's Arrow output format): an enum as
#: its number, a wide integer, BFloat16 or IPv6 as raw bytes, an IPv4 as a number; and types polars cannot read
#: (Decimal over 38 digits, Variant). :func:`readable` turns them into what ClickHouse's own text shows.
_SHOWN_AS_TEXT = re.compile(r"(?:Enum(?:8|16)\(.*\)|U?Int(?:128|256)|BFloat16|IPv4|IPv6|AggregateFunction\(.*\)|"
                            r"FixedString\(\d+\)|"
                            r"Decimal\((?:39|[4-7]\d)(?:, *\d+)?\)|Variant\(.*\)|Dynamic(?:\(.*\))?|JSON(?:\(.*\))?)",
                            re.S)
_ENUM_VALUE = re.compile(r"'((?:[^'\\]|\\.)*)'\s*=\s*(-?\d+)")


def needs_types(table: pa.Table) -> bool:
    """Whether :func:`readable` or :func:`datetimes` may change a column of ``table`` (so the caller should ask
    ClickHouse for the result's types): int8/int16 (an enum?), uint32 (a DateTime or an IPv4), binary, decimal256
    or union values, at the top or nested, or a string column that is not valid UTF-8."""
    return any(_holds(t, _numbers_or_unreadable) for t in table.schema.types) or any(
        not _valid_utf8(c) for c in table.columns if pa.types.is_string(c.type))


def _holds(t: pa.DataType, test: Callable[[pa.DataType], bool]) -> bool:
    """Whether Arrow type ``t`` or a type nested in it passes ``test``."""
    return test(t) or any(_holds(f.type, test) for f in _children(t))


def _unreadable(t: pa.DataType) -> bool:
    """Bytes that stand for a value (a wide integer, an address) or a type polars cannot show."""
    return (pa.types.is_binary(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_decimal256(t)
            or pa.types.is_union(t))


def _numbers_or_unreadable(t: pa.DataType) -> bool:
    """:func:`_unreadable`, or a number that may stand for something else (an enum, a DateTime, an IPv4)."""
    return pa.types.is_int8(t) or pa.types.is_int16(t) or t == pa.uint32() or _unreadable(t)


def _valid_utf8(column: pa.ChunkedArray) -> bool:
    try:
        column.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def readable(table: pa.Table, types: list[str]) -> pa.Table:
    """``table`` with each top-level column of a type in :data:`_SHOWN_AS_TEXT` (``types``: the ClickHouse type of
    each column, :data:`DESCRIBE_RESULT`; Nullable and LowCardinality looked through) as the text ClickHouse shows
    for it (an enum's name, a wide integer's digits, a BFloat16 as a float, an address in its usual notation), and a
    String that is not valid UTF-8 (a substring cut through a character) with U+FFFD for each bad byte. Nested
    values: an Array of such a type has its elements shown so; any other value holding one as bytes (a wide integer, an
    address) or in a form polars cannot show is its Python text; other nested values are kept (a DateTime inside a
    Tuple stays a datetime, an enum there stays its number)."""
    columns = list(table.columns)
    for i, (column, ch_type) in enumerate(zip(columns, types, strict=True)):
        while m := _WRAPPED.fullmatch(ch_type):
            ch_type = m.group(1)
        if ch_type == "String" and pa.types.is_string(column.type) and not _valid_utf8(column):
            columns[i] = _column([_text(v) for v in column.cast(pa.binary()).to_pylist()], pa.string())
        elif _SHOWN_AS_TEXT.fullmatch(ch_type):
            show, kind = _shown(ch_type)
            columns[i] = _column([None if v is None else show(v) for v in column.to_pylist()], kind)
        elif _SHOWN_AS_TEXT.search(ch_type):  # inside an Array (its elements shown), or deeper (the value as text)
            element = _array_element(ch_type)
            if element is not None:
                show, kind = _shown(element)
                columns[i] = _column([None if v is None else [None if x is None else show(x) for x in v]
                                      for v in column.to_pylist()], pa.list_(kind))
            elif _holds(column.type, _unreadable):  # raw bytes or a type polars cannot show, in a Tuple or Map
                columns[i] = _column([None if v is None else str(v) for v in column.to_pylist()], pa.string())
    return pa.table(columns, names=table.column_names)


def _column(values: list[Any], kind: pa.DataType) -> pa.ChunkedArray:
    return pa.chunked_array([pa.array(values, kind)])


def _array_element(ch_type: str) -> str | None:
    """The element type of ``Array(T)`` when T (Nullable or LowCardinality looked through) is shown as text."""
    if not (ch_type.startswith("Array(") and ch_type.endswith(")")):
        return None
    element = ch_type[len("Array("):-1]
    while m := _WRAPPED.fullmatch(element):
        element = m.group(1)
    return element if _SHOWN_AS_TEXT.fullmatch(element) else None


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


def _shown(ch_type: str) -> tuple[Callable[[Any], Any], pa.DataType]:
    """How one value of ClickHouse type ``ch_type`` (an Arrow value as pyarrow gives it) is shown, and the Arrow type
    of what is shown (float32 for a BFloat16, else text)."""
    if ch_type.startswith("Enum"):
        names = {int(n): v.replace("\\'", "'") for v, n in _ENUM_VALUE.findall(ch_type)}
        return (lambda v: names.get(v, str(v))), pa.string()
    if ch_type.startswith(("UInt", "Int")):  # 128 or 256 bits, little-endian bytes
        signed = ch_type.startswith("Int")
        return (lambda v: str(int.from_bytes(v, "little", signed=signed)) if isinstance(v, bytes) else str(v)), \
            pa.string()
    if ch_type == "BFloat16":  # the high half of a float32, little-endian
        return (lambda v: struct.unpack("<f", b"\0\0" + v)[0] if isinstance(v, bytes) and len(v) == 2
                else float(v)), pa.float32()
    if ch_type == "IPv6":
        return (lambda v: str(ipaddress.IPv6Address(v)) if isinstance(v, bytes) and len(v) == 16 else str(v)), \
            pa.string()
    if ch_type == "IPv4":
        return (lambda v: str(ipaddress.IPv4Address(v)) if isinstance(v, int) else str(v)), pa.string()
    if ch_type.startswith("AggregateFunction"):  # a state: bytes only ClickHouse reads back; shown as hex
        return (lambda v: v.hex() if isinstance(v, bytes) else str(v)), pa.string()
    if ch_type.startswith("FixedString"):
        return (lambda v: _text(v) if isinstance(v, bytes) else str(v)), pa.string()
    return str, pa.string()  # Decimal(>38), Variant, Dynamic, JSON


def to_polars(table: pa.Table) -> pl.DataFrame:
    """``table`` as a polars frame; an Arrow extension type (ClickHouse's JSON comes as ``arrow.json``) as its storage
    (text), which every output format can write; a column polars cannot read (it may panic, a BaseException) becomes
    text, each value as Python shows it, so one odd column never costs the result."""
    plain = [_plain(t) for t in table.schema.types]
    if plain != table.schema.types:
        table = pa.table([_plain_column(c, t) for c, t in zip(table.columns, plain, strict=True)],
                         names=table.column_names)
    try:
        return pl.from_arrow(table)  # type: ignore[return-value]
    except (Exception, PanicException):  # noqa: BLE001 - polars raises panics, not errors, on some Arrow input
        pass
    series = []
    for name, column in zip(table.column_names, table.columns, strict=True):
        try:
            series.append(pl.from_arrow(column).alias(name))  # type: ignore[union-attr]
        except (Exception, PanicException):  # noqa: BLE001
            series.append(pl.Series(name, [None if v is None else str(v) for v in _values(column)], pl.String))
    return pl.DataFrame(series)


def _plain(t: pa.DataType) -> pa.DataType:
    """Arrow type ``t`` with every extension type in it (at the top or nested) replaced by its storage type, a UUID
    (``arrow.uuid``) by text."""
    if isinstance(t, pa.UuidType):
        return pa.string()
    if isinstance(t, pa.BaseExtensionType):
        return _plain(t.storage_type)
    fields = _children(t)
    if not fields:
        return t
    plain = [f.with_type(_plain(f.type)) for f in fields]
    return t if plain == fields else _with_children(t, plain)


def _plain_column(column: pa.ChunkedArray, plain: pa.DataType) -> pa.ChunkedArray:
    """``column`` as type ``plain`` (:func:`_plain` of its type): extension values as their storage, UUIDs as their
    text (``61f0c404-5cb3-11e7-907b-a6006ad3dba0``, at the top or in an array; deeper, the whole value as text)."""
    if column.type == plain:
        return column
    if not _holds(column.type, lambda t: isinstance(t, pa.UuidType)):
        return column.cast(plain)
    if isinstance(column.type, pa.UuidType):
        return _column([None if v is None else str(v) for v in column.to_pylist()], pa.string())
    if pa.types.is_list(column.type) and isinstance(column.type.value_type, pa.UuidType):
        return _column([None if v is None else [None if x is None else str(x) for x in v]
                        for v in column.to_pylist()], pa.list_(pa.string()))
    return _column([None if v is None else str(v) for v in column.to_pylist()], pa.string())


def _values(column: pa.ChunkedArray) -> list[Any]:
    try:
        return column.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException):
        return [None if v is None else repr(v) for v in column.cast(pa.binary()).to_pylist()]
