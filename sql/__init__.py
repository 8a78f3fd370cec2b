"""kvscope's SQL: numbered migrations (``sql/migrations/NNNN_<verb>_<object>.sql``) and named queries
(``sql/queries/<name>.sql``), each named query opening with a header that :func:`load_query` parses.

Header format (one item per ``--`` line, before the SQL)::

    -- name: hit_rate
    -- description: One sentence on what it returns.
    -- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00.000 | start of the window, UTC
    -- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC

Parameters are bound as ClickHouse typed parameters (``{since:DateTime64(3)}``), never formatted in.

Shared pieces (``sql/parts/<part>.sql``): a line ``-- include: <part>`` in a query's SQL is replaced by that
file's text when the query loads, so SQL several queries need (the prefill cost of a missed token, the next turns
of conversations and agent runs) is written once. A part is a run of WITH items that ends with a comma, opening
with ``--`` comment lines that say what it defines and which parameters it reads (the including query declares
them). ClickHouse has no include of its own, and a view would need a migration; parts nest no further.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

SQL_DIR = Path(str(resources.files(__name__)))
MIGRATIONS_DIR = SQL_DIR / "migrations"
QUERIES_DIR = SQL_DIR / "queries"
PARTS_DIR = SQL_DIR / "parts"

#: A database name kvscope accepts: a plain ClickHouse identifier (letters, digits, _; not starting with a digit),
#: so it can be written into DDL unquoted.
DATABASE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER = re.compile(r"^--\s*(name|description|param|returns):\s*(.*)$")
_PARAM = re.compile(r"^(\w+):\s*([^=|]+?)\s*(?:=\s*([^|]*?))?\s*(?:\|\s*(.*))?$")
_RETURNS = re.compile(r"^(\w+)\s+([^|]+?)\s*(?:\|\s*(.*))?$")
_INCLUDE = re.compile(r"^[ \t]*--[ \t]*include:[ \t]*(\w+)[ \t]*$", re.MULTILINE)


class HeaderError(ValueError):
    """A named query's header is missing a field or a line does not parse."""


@dataclass(frozen=True)
class Param:
    """A typed parameter: ``name``, ClickHouse ``type``, ``default`` (string as written, None = required)."""

    name: str
    type: str
    default: str | None
    help: str = ""


@dataclass(frozen=True)
class Column:
    """A returned column: ``name``, ClickHouse ``type``, ``help`` (meaning and unit)."""

    name: str
    type: str
    help: str = ""


@dataclass(frozen=True)
class NamedQuery:
    """A parsed ``sql/queries/<name>.sql``: header fields and the SQL text (header included, comments are SQL)."""

    name: str
    description: str
    params: list[Param] = field(default_factory=list)
    returns: list[Column] = field(default_factory=list)
    sql: str = ""

    def bind(self, values: dict[str, str]) -> dict[str, str]:
        """Parameter values for ClickHouse: defaults filled in, unknown or missing ones rejected, given ones
        checked (:func:`check_value`).

        Raises :class:`HeaderError` for an unknown parameter name or a required one left out,
        :class:`ParamError` for a value its type or meaning does not allow.
        """
        known = {p.name for p in self.params}
        unknown = set(values) - known
        if unknown:
            raise HeaderError(f"query {self.name} has no parameter(s) {sorted(unknown)}; it takes {sorted(known)}")
        out: dict[str, str] = {}
        for p in self.params:
            if p.name in values:
                out[p.name] = check_value(p, values[p.name])
            elif p.default is not None:
                out[p.name] = p.default.strip("'")
            else:
                raise HeaderError(f"query {self.name} needs parameter {p.name} ({p.type})")
        return out


class ParamError(ValueError):
    """A parameter value its type or meaning does not allow (an impossible date, a bucket that is not whole
    minutes, an integer outside its type)."""


#: The times a time parameter is held to (UTC, naive). The rollups store minutes as ClickHouse ``DateTime``
#: (seconds since 1970 in 32 bits, up to 2106-02-07): a bound outside it saturates or wraps there, and a window
#: starting after 2106 read every row. No row can be outside it, so a bound beyond it means the same as this one.
TIME_MIN = "1970-01-01 00:00:00.000"
TIME_MAX = "2106-01-01 00:00:00.000"
#: The named queries' bucket width parameter (seconds). The rollups hold whole minutes (docs/scale.md), so a
#: bucket must be whole minutes: 90 s buckets would hold one minute or two by turns, 30 s ones a minute each.
BUCKET_PARAM = "bucket_seconds"
#: The widest bucket: whole minutes within UInt32, the parameter's type (a wider value would wrap).
BUCKET_MAX_SECONDS = (2**32 - 1) // 60 * 60
#: The forms a time parameter takes (ISO 8601 dates and times, checked against the calendar).
TIME_FORMS = ("YYYY-MM-DD, YYYY-MM-DD HH:MM[:SS[.fff]] or YYYY-MM-DDTHH:MM[:SS[.fff]], UTC unless it ends in "
              "Z or an offset ±HH:MM")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}(?:[Tt ]\d{2}(?::\d{2}(?::\d{2}(?:\.\d{1,9})?)?)?(?:Z|[+-]\d{2}:?\d{2})?)?")
_INTEGER = re.compile(r"(U?)Int(8|16|32|64)")
_INTEGER_ARRAY = re.compile(r"Array\(((U?)Int(8|16|32|64))\)")
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
#: A named query's name: a file stem in sql/queries/ (no path: ``../parts/x`` named a file that is no query).
QUERY_NAME = re.compile(r"\w+")
#: Date and Date32 ranges (ClickHouse docs, "Date", "Date32"); a date beyond them is held to them.
_DATE_RANGES = {"Date": ("1970-01-01", "2149-06-06"), "Date32": ("1900-01-01", "2299-12-31")}


def check_value(param: Param, value: str) -> str:
    """``value`` as ClickHouse is to read it for ``param``, or :class:`ParamError` naming the parameter, the
    value and what it accepts.

    DateTime and DateTime64: one of :data:`TIME_FORMS`, a real calendar date and time (ClickHouse reads
    ``2026-13-01`` and ``2026-11-31`` leniently, as other days), as UTC text within [:data:`TIME_MIN`,
    :data:`TIME_MAX`]. Date, Date32: ``YYYY-MM-DD``, a real date, within the type's range. (U)Int8..64: a
    whole number within the type (ClickHouse wraps a larger one). Array((U)Int8..64): ``[`` whole numbers
    within the element type, comma-separated ``]`` (ClickHouse wraps an element too: ``[300]`` as Array(UInt8) is
    ``[44]``, ``[2^64]`` as Array(UInt64) is ``[0]``). :data:`BUCKET_PARAM`: also a positive multiple of 60
    (whole minutes, the rollups' grain). Other types go to ClickHouse as given.
    """
    kind = param.type.split("(", 1)[0]
    if kind in ("DateTime", "DateTime64"):
        value = _clickhouse_time(param.name, value)
    elif kind in _DATE_RANGES:
        value = _clickhouse_date(param.name, value, *_DATE_RANGES[kind])
    elif m := _INTEGER.fullmatch(param.type):
        low, high = _bounds(unsigned=bool(m.group(1)), bits=int(m.group(2)))
        number = _whole(value, low, high)
        if number is None:
            raise ParamError(f"parameter {param.name}: {_cut(value)!r} is not a {param.type} (a whole number "
                             f"{low:,}..{high:,})")
        value = str(number)
    elif m := _INTEGER_ARRAY.fullmatch(param.type):
        value = _integer_array(param.name, value, m.group(1), unsigned=bool(m.group(2)), bits=int(m.group(3)))
    if param.name == BUCKET_PARAM and not (0 < int(value) <= BUCKET_MAX_SECONDS and int(value) % 60 == 0):
        raise ParamError(f"parameter {param.name}: {value} is refused: the rollups hold whole minutes, so a bucket "
                         f"is a positive multiple of 60 seconds, at most {BUCKET_MAX_SECONDS:,}")
    return value


def _integer_array(name: str, value: str, element: str, *, unsigned: bool, bits: int) -> str:
    """``[1, 2, 3]`` (spaces anywhere, ``[]`` empty) as ClickHouse's text of an Array(``element``), each element a
    whole number within the element type. Raises :class:`ParamError` naming parameter ``name`` otherwise."""
    low, high = _bounds(unsigned=unsigned, bits=bits)
    text = value.strip()
    inner = text[1:-1].strip() if text.startswith("[") and text.endswith("]") else None
    items = [] if inner == "" else None if inner is None else [x.strip() for x in inner.split(",")]
    if items is None or not all(_INTEGER_TEXT.fullmatch(x) for x in items):
        raise ParamError(f"parameter {name}: {_cut(value)!r} is not an Array({element}): give [n, n, ...], whole "
                         f"numbers {low:,}..{high:,}")
    numbers = [_whole(x, low, high) for x in items]
    if None in numbers:
        bad = items[numbers.index(None)]
        raise ParamError(f"parameter {name}: element {_cut(bad)} is not a {element} (a whole number {low:,}..{high:,})")
    return "[" + ",".join(map(str, numbers)) + "]"


def _bounds(*, unsigned: bool, bits: int) -> tuple[int, int]:
    """The least and greatest value of ClickHouse's (U)Int``bits``."""
    return (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def _whole(text: str, low: int, high: int) -> int | None:
    """``text`` (ASCII digits, a sign, spaces around) as an integer within [``low``, ``high``], else None (a
    number of thousands of digits too: Python refuses to convert those, so they are judged by their length)."""
    text = text.strip()
    if not _INTEGER_TEXT.fullmatch(text) or len(text.lstrip("+-").lstrip("0")) > 40:
        return None
    number = int(text)
    return number if low <= number <= high else None


def _cut(text: str, limit: int = 80) -> str:
    """``text``, or its first ``limit`` characters and ``…`` (an error line quotes a value, not a megabyte)."""
    return text if len(text) <= limit else text[:limit] + "…"


def _clickhouse_time(name: str, value: str) -> str:
    """An ISO 8601 time (``2026-11-29T12:00:00Z``, ``+01:00`` offsets too) as ClickHouse's UTC text
    ``2026-11-29 12:00:00.000``, held within [:data:`TIME_MIN`, :data:`TIME_MAX`]. Raises :class:`ParamError`
    (naming parameter ``name``) for any other text or an impossible date or time."""
    from datetime import UTC, datetime

    text = value.strip()
    try:
        if not _TIME.fullmatch(text):
            raise ValueError(text)
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ParamError(f"parameter {name}: {value!r} is not a real date and time; give {TIME_FORMS}") from None
    if dt.tzinfo is not None:
        dt = dt.astimezone(UTC)
    text = f"{dt.year:04d}" + dt.strftime("-%m-%d %H:%M:%S.") + f"{dt.microsecond // 1000:03d}"
    return min(max(text, TIME_MIN), TIME_MAX)  # same-width text: compares as the times do


def _clickhouse_date(name: str, value: str, low: str, high: str) -> str:
    """A ``YYYY-MM-DD`` date checked against the calendar, held within [``low``, ``high``]. Raises
    :class:`ParamError` (naming parameter ``name``) otherwise."""
    from datetime import date

    text = value.strip()
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError(text)
        date.fromisoformat(text)
    except ValueError:
        raise ParamError(f"parameter {name}: {value!r} is not a real date; give YYYY-MM-DD") from None
    return min(max(text, low), high)


def parse_query(text: str, source: str = "<string>") -> NamedQuery:
    """Parse a named query file's header. Raises :class:`HeaderError` naming ``source`` and the line."""
    name = description = None
    params: list[Param] = []
    returns: list[Column] = []
    for line in text.splitlines():
        if not line.startswith("--"):
            if line.strip():
                break
            continue
        m = _HEADER.match(line)
        if not m:
            if re.match(r"^--\s*(name|description|param|returns)\b", line):
                raise HeaderError(f"{source}: header line {line!r} needs a colon after its keyword")
            continue
        key, value = m.group(1), m.group(2).strip()
        if key == "name":
            name = value
        elif key == "description":
            description = value
        elif key == "param":
            pm = _PARAM.match(value)
            if not pm:
                raise HeaderError(f"{source}: cannot parse param line {line!r}")
            params.append(Param(pm.group(1), pm.group(2).strip(), pm.group(3), (pm.group(4) or "").strip()))
        else:
            rm = _RETURNS.match(value)
            if not rm:
                raise HeaderError(f"{source}: cannot parse returns line {line!r}")
            returns.append(Column(rm.group(1), rm.group(2).strip(), (rm.group(3) or "").strip()))
    if not name or not description or not returns:
        raise HeaderError(f"{source}: header needs name, description and at least one returns line")
    return NamedQuery(name, description, params, returns, text)


def query_names() -> list[str]:
    """Names of the named queries shipped in ``sql/queries/``."""
    return sorted(p.stem for p in QUERIES_DIR.glob("*.sql"))


def part_names() -> list[str]:
    """Names of the shared pieces in ``sql/parts/`` that queries include."""
    return sorted(p.stem for p in PARTS_DIR.glob("*.sql"))


def expand_includes(text: str, source: str = "<string>") -> str:
    """``text`` with every ``-- include: <part>`` line replaced by ``sql/parts/<part>.sql`` (its text as is, so
    it is indented as written there). Raises :class:`HeaderError` naming ``source`` for an unknown part."""
    def part(m: re.Match[str]) -> str:
        path = PARTS_DIR / f"{m.group(1)}.sql"
        if not path.is_file():
            raise HeaderError(f"{source}: no SQL part {m.group(1)!r} to include; known: {', '.join(part_names())}")
        return path.read_text().rstrip("\n")

    return _INCLUDE.sub(part, text)


def load_query(name: str) -> NamedQuery:
    """Load ``sql/queries/<name>.sql`` with its ``-- include:`` lines expanded (:func:`expand_includes`).
    Raises :class:`KeyError` if there is no such query, :class:`HeaderError` for a bad header or include."""
    path = QUERIES_DIR / f"{name}.sql"
    if not QUERY_NAME.fullmatch(name) or not path.is_file():
        raise KeyError(f"no named query {name!r}; known: {', '.join(query_names())}")
    q = parse_query(expand_includes(path.read_text(), str(path)), str(path))
    if q.name != name:
        raise HeaderError(f"{path}: header name {q.name!r} differs from the file name")
    return q


def migrations() -> list[tuple[str, str]]:
    """``(version, sql_text)`` of every migration in order; version = file stem (``0001_create_x``)."""
    return [(p.stem, p.read_text()) for p in sorted(MIGRATIONS_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql"))]
