"""A fast parser of the Prometheus text exposition format 0.0.4 that extracts only the series asked for.

Format: https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format, as vLLM serves it
(``prometheus_client.exposition.generate_latest``): ``# HELP`` / ``# TYPE`` comments and sample lines
``name{label="value",...} value [timestamp]``, label values escaping ``\\\\``, ``\\"`` and ``\\n``, values
Go-style floats (``NaN``, ``+Inf``, ``-Inf``, ``1.7e+09``).

:func:`parse` (``text`` → :class:`Parsed`) looks at a line's metric name first and parses the labels and value
only of names in ``keep``: a vLLM 0.32 body (631 lines, 230 kept) takes ~30x less CPU than
``prometheus_client.parser.text_string_to_metric_families`` (bench/collector.py). The result is *defined* as
prometheus_client's: lines of the shape prometheus_client writes are parsed here by a strict grammar, and any
other sample line is handed to prometheus_client itself, so an odd but accepted line gives prometheus_client's
answer and a rejected one its reason. ``tests/test_prom_text.py`` checks this differentially (real captures and
random expositions). The differences, each deliberate:

1. With ``keep``, a line whose metric name is not kept is skipped unparsed, so its errors are not reported. A
   line that cannot be a sample of any name (its first character is not a metric-name character, ``{``,
   ``#`` or whitespace: HTML, binary) is still reported.
2. Comment lines are not read. prometheus_client aborts the whole body on a malformed ``# HELP``/``# TYPE``
   line (missing type, invalid name); here such a line carries no sample and is ignored (kvscope's allowlist,
   not ``# TYPE``, says what each kept series is).
3. Sample names are reported as exposed. prometheus_client renames the samples of a ``# TYPE x counter``
   family whose name lacks ``_total`` to ``x_total``; every prometheus_client since 0.4 (all of vLLM) writes
   ``x_total`` itself.
4. A sample name written before ``{`` must be a valid metric name (``[a-zA-Z_:][a-zA-Z0-9_:]*``) followed by
   ``{`` or whitespace. prometheus_client takes whatever precedes the first ``{`` unvalidated (``foo bar{} 1``
   is a sample named ``foo bar``) and, on a line without whitespace, drops the last character before reading
   the name (``inf`` is a sample ``in`` of value +Inf); both are rejected here ("invalid metric name"). A name
   given inside the braces (``{__name__="x"}`` or ``{"x"}``, UTF-8 names) is accepted as prometheus_client does.
5. Values are floats: ``-0`` is -0.0 (prometheus_client: the int 0; equal as numbers), and integers beyond
   2**53 are rounded to the nearest float. Timestamps are validated as prometheus_client does, then dropped
   (vLLM writes none; the collector stamps each scrape).
6. Nothing after a line ``# EOF`` (OpenMetrics' end of the exposition, exactly so, a CRLF line end allowed:
   https://prometheus.io/docs/specs/om/open_metrics_spec/#overall-structure; prometheus_client's text parser
   reads it as a comment and goes on) is loaded: each line after it that would have been parsed (not blank,
   not a comment; with ``keep``, of a kept name or unable to start with a name) is returned in ``bad_lines``
   with :data:`AFTER_EOF`, as Prometheus' OpenMetrics parser refuses data after ``# EOF``. Lines before it
   are parsed as above.

Never raises on malformed input: each rejected line is returned in :attr:`Parsed.bad_lines` with a reason.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

Labels = dict[str, str]


#: One sample line: (name as exposed, e.g. ``vllm:prefix_cache_hits_total``; labels, label → unescaped value,
#: a dict that may be shared between samples and calls: do not mutate it; value, float with NaN/±Inf). A plain
#: tuple: a NamedTuple costs ~10 % of the parse.
Sample = tuple[str, Labels, float]


class Parsed(NamedTuple):
    """What :func:`parse` found: ``samples`` in body order and ``bad_lines`` as ``(line, reason)``, the line as
    it appeared (without its newline)."""

    samples: list[Sample]
    bad_lines: list[tuple[str, str]]


_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# A label value's text: runs of plain characters between escapes (the "unrolled loop" form of (?:[^"\\]|\\.)*, the
# same language; that form took ~1 s per 1 MB and more than linear time: 49 s for one 50 MB value).
_VALUE = r'[^"\\]*(?:\\.[^"\\]*)*'
_LABEL = rf'(?!__)[a-zA-Z_][a-zA-Z0-9_]*="{_VALUE}"'
_LABELS_RE = re.compile(rf"(?:{_LABEL}(?:,{_LABEL})*,?)?")
_LABEL_PAIR_RE = re.compile(rf'([a-zA-Z_][a-zA-Z0-9_]*)="({_VALUE})"')
# The shape prometheus_client writes (plus tabs and an optional timestamp); anything else goes to prometheus_client.
_STRICT_RE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{({_LABELS_RE.pattern})\}})?[ \t]+([^\s_]+)(?:[ \t]+([^\s_]+))?")
_ESCAPE_RE = re.compile(r'\\[\\n"]')  # prometheus_client.parser.ESCAPING_RE: other backslashes stay as written
_UNESCAPE = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
# Whitespace other than " " and "\n" (str.isspace, which str.strip and prometheus_client use): a body holding
# none of these can be read with the fast name cut of _parse_fast.
_ODD_WS_ASCII = "\t\r\x0b\x0c\x1c\x1d\x1e\x1f"
_ODD_WS = _ODD_WS_ASCII + "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"

#: The reason of a line after ``# EOF`` (difference 6).
AFTER_EOF = "after # EOF, the end of the exposition (OpenMetrics): not loaded"

_label_cache: dict[str, Labels] = {}
_LABEL_CACHE_MAX = 8192
#: The longest label block (characters between the braces) kept in ``_label_cache``: vLLM's longest, its
#: ``cache_config_info``, has ~1,100; a huge one (a 50 MB label value) is parsed each time and not kept alive.
_LABEL_CACHE_BLOCK_MAX = 4096


def parse(text: str, keep: Collection[str] | None = None) -> Parsed:
    """Parse an exposition body; with ``keep`` (sample names, e.g. ``{"vllm:prefix_cache_hits_total"}``, a set
    for speed), only the lines of those names are parsed and returned. ``keep=None`` parses every line. Lines
    after a ``# EOF`` line are rejected (difference 6 of the module docstring)."""
    text, after = _cut_at_eof(text)
    parsed = _parse_fast(text, keep) if keep is not None and _plain(text) else _parse_careful(text, keep)
    if after:
        _reject_after_eof(after, keep, parsed.bad_lines)
    return parsed


def _cut_at_eof(text: str) -> tuple[str, list[str]]:
    """(the body up to and without its first ``# EOF`` line, the lines after that line). A body without one
    costs one reverse search (~13 us for a 52 kB vLLM body; a forward ``find`` takes ~40 us there)."""
    if not text.startswith("# EOF") and text.rfind("\n# EOF") < 0:
        return text, []
    start = 0 if text.startswith("# EOF") else text.find("\n# EOF") + 1  # a candidate line's start; 0 = none
    while True:
        end = text.find("\n", start)
        if text[start : len(text) if end < 0 else end] in ("# EOF", "# EOF\r"):
            return text[:start], text[end + 1 :].split("\n") if end >= 0 else []
        start = text.find("\n# EOF", end) + 1 if end >= 0 else 0
        if start == 0:
            return text, []


def _reject_after_eof(lines: list[str], keep: Collection[str] | None, bad: list[tuple[str, str]]) -> None:
    """Each of ``lines`` that :func:`_careful_line` would parse goes to ``bad`` with :data:`AFTER_EOF`."""
    for line in lines:
        s = line.strip()
        if s and s[0] != "#" and not _skipped(s, keep):
            bad.append((line, AFTER_EOF))


def _plain(text: str) -> bool:
    odd = _ODD_WS_ASCII if text.isascii() else _ODD_WS
    return not any(c in text for c in odd)  # one memchr each: ~0.5 us for a 52 kB body


def _parse_fast(text: str, keep: Collection[str]) -> Parsed:
    """Bodies whose only whitespace is " " and "\n": the metric name of a line that starts with a name character
    is everything before its first " " or "{" (what prometheus_client reads too); other lines go the careful
    way, one by one."""
    samples: list[Sample] = []
    bad: list[tuple[str, str]] = []
    cache = _label_cache
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        j = line.find(" ")
        i = line.find("{", 0, j) if j >= 0 else line.find("{")
        cut = i if i >= 0 else j
        name = line[:cut] if cut >= 0 else line
        if name not in keep:
            if line[0] not in _NAME_START:  # "" was cut: an indented line, a name in braces, or junk
                _careful_line(line, keep, samples, bad)
            continue
        # the common shapes: `name{labels} value` and `name value`
        head, _, tail = line.rpartition(" ")
        labels: Labels | None = None
        if cut == i and head.endswith("}"):
            block = head[i + 1 : -1]
            labels = cache.get(block)
            if labels is None and _LABELS_RE.fullmatch(block):
                labels = _labels(block)
                if labels is not None and len(block) <= _LABEL_CACHE_BLOCK_MAX:
                    if len(cache) >= _LABEL_CACHE_MAX:
                        cache.clear()
                    cache[block] = labels
        elif cut == j and len(head) == j:
            labels = {}
        if labels is not None and "_" not in tail:
            try:
                samples.append((name, labels, float(tail)))
                continue
            except ValueError:
                pass
        _parse_line(line, keep, samples, bad)
    return Parsed(samples, bad)


def _parse_careful(text: str, keep: Collection[str] | None) -> Parsed:
    samples: list[Sample] = []
    bad: list[tuple[str, str]] = []
    for line in text.split("\n"):
        _careful_line(line, keep, samples, bad)
    return Parsed(samples, bad)


def _careful_line(line: str, keep: Collection[str] | None, samples: list[Sample],
                  bad: list[tuple[str, str]]) -> None:
    """One line of any shape: the name as prometheus_client would see it decides whether it is parsed."""
    s = line.strip()
    if not s or s[0] == "#" or _skipped(s, keep):
        return
    if keep is not None and s[0] not in _NAME_START and s[0] != "{":
        bad.append((line, "unparseable sample line: it does not start with a metric name"))
        return
    _parse_line(line, keep, samples, bad)


def _skipped(s: str, keep: Collection[str] | None) -> bool:
    """Whether ``s`` (a stripped sample line) is one of a name not in ``keep``: skipped unparsed."""
    if keep is None or s[0] == "{":
        return False
    m = _NAME_RE.match(s)
    if m is None:
        return False
    end = m.end()
    return m.group() not in keep or (end < len(s) and s[end] != "{" and not s[end].isspace())


def _labels(block: str) -> Labels | None:
    """Labels of a block that matched _LABELS_RE; None on a duplicate name (prometheus_client rejects it)."""
    pairs = _LABEL_PAIR_RE.findall(block)
    out = {k: (_ESCAPE_RE.sub(_unescape, v) if "\\" in v else v) for k, v in pairs}
    return out if len(out) == len(pairs) else None


def _unescape(m: re.Match[str]) -> str:
    return _UNESCAPE[m.group()]


def _parse_line(line: str, keep: Collection[str] | None, samples: list[Sample], bad: list[tuple[str, str]]) -> None:
    """One sample line by the strict grammar, else by prometheus_client; appends to ``samples`` or ``bad``."""
    s = line.strip()
    m = _STRICT_RE.fullmatch(s)
    if m is not None:
        name, block, value, ts = m.groups()
        labels = _labels(block) if block else {}
        if labels is not None:
            try:
                v = float(value)
                if ts is not None:
                    float(ts)
            except ValueError:
                pass
            else:
                if keep is None or name in keep:
                    samples.append((name, labels, v))
                return
    try:
        parsed = [x for fam in text_string_to_metric_families(s + "\n") for x in fam.samples]
    except Exception as exc:  # prometheus_client raises ValueError, IndexError, ... on odd lines: all are rejects
        bad.append((line, f"unparseable sample line: {exc or type(exc).__name__}"))
        return
    if len(parsed) != 1:  # cannot happen for one non-comment line; kept to never raise
        bad.append((line, f"unparseable sample line: read as {len(parsed)} samples"))
        return
    name, labels, value = parsed[0].name, parsed[0].labels, parsed[0].value
    if s[0] != "{" and not (_NAME_RE.fullmatch(name) and s.startswith(name)
                            and (len(s) == len(name) or s[len(name)] == "{" or s[len(name)].isspace())):
        bad.append((line, f"unparseable sample line: invalid metric name {name!r}"))
        return
    if keep is None or name in keep:
        samples.append((name, dict(labels), float(value)))
