"""collector/prom_text.py checked differentially against prometheus_client's parser: on every real capture, on
random expositions (written by hand-rolled rules and by prometheus_client's own exposition writer), and on
malformed lines, which both must reject (or differ only as prom_text's docstring documents)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from collector.prom_text import AFTER_EOF, parse
from collector.vllm_metrics import KEPT_NAMES

SAMPLES = Path(__file__).parent / "samples"
CAPTURES = sorted(SAMPLES.glob("*.txt"))
NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
Row = tuple[str, dict[str, str], float]


def theirs(text: str) -> list[Row]:
    """prometheus_client's samples, flattened across families, values as floats."""
    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def mine(text: str, keep: frozenset[str] | set[str] | None = None) -> list[Row]:
    r = parse(text, keep)
    assert not r.bad_lines, r.bad_lines
    return [(n, dict(lab), v) for n, lab, v in r.samples]


def same(a: list[Row], b: list[Row]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_every_capture_parses_as_prometheus_client_parses_it(path: Path) -> None:
    body = path.read_text()
    ref = theirs(body)
    assert len(ref) > 400
    assert same(mine(body), ref)
    names = {n for n, _, _ in ref}
    for keep in (KEPT_NAMES, {n for n in names if n.startswith("vllm:")}, {n for n in names if "bucket" in n},
                 set(), names):
        assert same(mine(body, keep), [r for r in ref if r[0] in keep])
    # the same bodies with indented lines and names in braces (the fast path sends these lines the careful way),
    # and with CRLF line ends and tab separators (the whole body goes the careful way)
    indented = body.replace('\nvllm:prefix_cache_hits_total{', '\n{__name__="vllm:prefix_cache_hits_total",'
                            ).replace("\nvllm:", "\n  vllm:")
    assert indented.count('{__name__="vllm:prefix_cache_hits_total",') == body.count("\nvllm:prefix_cache_hits_total{")
    odd = body.replace("\n", "\r\n").replace("} ", "}\t").replace("\nvllm:", "\n  vllm:")
    for variant in (indented, odd):
        assert same(mine(variant, KEPT_NAMES), [r for r in ref if r[0] in KEPT_NAMES])
        assert same(mine(variant), ref)


# --- random expositions -------------------------------------------------------------------------------------

names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,6}", fullmatch=True) | st.sampled_from(sorted(KEPT_NAMES))
label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,5}", fullmatch=True).filter(lambda s: not s.startswith("__"))
# a label value as written: plain characters (odd ones included), the three escapes, and other backslash pairs
value_chars = st.characters(blacklist_characters='"\\\n', blacklist_categories=("Cs",))
written_value = st.lists(
    value_chars | st.sampled_from([",", "}", "{", "=", '\\"', "\\\\", "\\n", "\\t", "\\q", " ", "\t", "\r", "#",
                                   "\x0b", "\x85", "\u2028", "é", "日本", "\U0001f600", 'a=\\"b\\"', "} 1"]),
    max_size=8).map("".join)
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "inf", "nan", "-0", "+0", "0.0", "-0.0", "1e3", "1E-3", ".5",
                     "5.", "+5", "1.7959496553552358e+09", "00012", "Infinity"]),
)
separators = st.sampled_from([" ", " ", " ", "\t", "  ", " \t "])


@st.composite
def sample_lines(draw: st.DrawFn) -> str:
    name = draw(names)
    labels = draw(st.lists(st.tuples(label_names, written_value), max_size=4, unique_by=lambda t: t[0]))
    block = ",".join(f'{k}="{v}"' for k, v in labels)
    if labels and draw(st.booleans()):
        block += ","
    if draw(st.integers(0, 9)) == 0:  # the name inside the braces (prometheus_client's UTF-8 form)
        head = "{" + ",".join([f'__name__="{name}"', *([block] if block else [])]) + "}"
    else:
        head = name + (f"{{{block}}}" if labels or draw(st.booleans()) else "")
    line = head + draw(separators) + draw(numbers)
    if draw(st.booleans()):
        line += draw(separators) + str(draw(st.integers(-(10**13), 10**13)))
    return draw(st.sampled_from(["", " ", "\t"])) + line + draw(st.sampled_from(["", "", " ", "\r", "\t"]))


@st.composite
def other_lines(draw: st.DrawFn) -> str:
    name = draw(names)
    return draw(st.sampled_from([
        "", " ", "\t", "#", "# a comment", f"# HELP {name} help with \\\\ and \\n and \"quotes\"", f"# HELP {name}",
        f"# TYPE {name} gauge", f"# TYPE {name} untyped", f"# TYPE {name} histogram", f"# TYPE {name} summary",
        f"  # TYPE {name} gauge", "# TYPE x_total counter", "#HELP no space", "# EOF", "# EOF\r", " # EOF", "# EOFX",
    ]))


expositions = st.lists(sample_lines() | other_lines(), max_size=25).map("\n".join)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=expositions, data=st.data())
@example(text='a{b="x\\\\"} 1\nc{d="\\"",e="=,}{"} -0\n\n# TYPE f histogram\nf_bucket{le="+Inf"} NaN 123', data=None)
@example(text="# EOFX\nx 1\n# EOFX\n# EOF\ny 2\n# EOF\nz 3", data=None)  # candidates that are not `# EOF`, then two
@example(text="x 1\n# EOFX\ny 2", data=None)  # only a candidate that is not `# EOF` (once an endless loop)
def test_random_expositions_parse_as_prometheus_client_parses_them(text: str, data: st.DataObject | None) -> None:
    """Up to a `# EOF` line as prometheus_client; each sample line after it rejected (prom_text difference 6)."""
    lines = text.split("\n")
    eof = next((i for i, line in enumerate(lines) if line in ("# EOF", "# EOF\r")), len(lines))
    ref = theirs("\n".join(lines[:eof]))
    after = [line for line in lines[eof + 1:] if line.strip() and not line.strip().startswith("#")]
    r = parse(text)
    assert same([(n, dict(lab), v) for n, lab, v in r.samples], ref)
    assert r.bad_lines == [(line, AFTER_EOF) for line in after]
    present = sorted({n for n, _, _ in ref})
    keeps = [set(present[::2]), KEPT_NAMES]
    if data is not None:
        keeps.append(data.draw(st.sets(st.sampled_from(present)) if present else st.just(set())))
    for keep in keeps:
        r = parse(text, keep)
        assert same([(n, dict(lab), v) for n, lab, v in r.samples], [x for x in ref if x[0] in keep])
        assert [b for b in r.bad_lines if b[0] not in after or b[1] != AFTER_EOF] == []


label_values = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
floats = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def registries(draw: st.DrawFn) -> CollectorRegistry:
    """What vLLM serves: prometheus_client's writer on counters, gauges and histograms with odd label values."""
    families = []
    for i, kind in enumerate(draw(st.lists(st.sampled_from(["counter", "gauge", "histogram"]), max_size=5))):
        label_keys = draw(st.lists(label_names.filter(lambda s: s != "le"), max_size=3, unique=True))
        if kind == "counter":
            fam = CounterMetricFamily(f"vllm:m{i}", draw(label_values), labels=label_keys)
        elif kind == "gauge":
            fam = GaugeMetricFamily(f"vllm:m{i}", draw(label_values), labels=label_keys)
        else:
            fam = HistogramMetricFamily(f"vllm:m{i}_seconds", draw(label_values), labels=label_keys)
        for _ in range(draw(st.integers(0, 3))):
            lv = [draw(label_values) for _ in label_keys]
            if kind == "histogram":
                bounds = sorted(set(draw(st.lists(st.floats(-1e6, 1e6), max_size=3))))
                counts = sorted(draw(st.lists(st.integers(0, 10**6), min_size=len(bounds) + 1,
                                              max_size=len(bounds) + 1)))
                fam.add_metric(lv, [(repr(b), c) for b, c in zip(bounds, counts, strict=False)]
                               + [("+Inf", counts[-1])], sum_value=draw(floats))
            elif kind == "gauge":
                fam.add_metric(lv, draw(floats))
            else:
                fam.add_metric(lv, draw(st.floats(0, 1e18)), created=draw(st.none() | st.floats(0, 2e9)))
        families.append(fam)

    class Fixed:
        def collect(self):  # type: ignore[no-untyped-def]
            return families

    reg = CollectorRegistry()
    reg.register(Fixed())
    return reg


@settings(max_examples=200, deadline=None, database=None)
@given(reg=registries())
def test_prometheus_client_writer_output_parses_identically(reg: CollectorRegistry) -> None:
    text = generate_latest(reg).decode()
    ref = theirs(text)
    assert same(mine(text), ref)
    keep = {n for n, _, _ in ref if n.endswith(("_total", "_bucket", "_created"))}
    assert same(mine(text, keep), [r for r in ref if r[0] in keep])


# --- malformed input ----------------------------------------------------------------------------------------

MALFORMED = [
    '{engine="0"} 12',  # no metric name
    'vllm:prefix_cache_hits_total{engine="0" 40x64.0',  # unterminated labels
    "vllm:prefix_cache_hits_total NaNa",  # not a number
    "vllm:prefix_cache_hits_total 1_000",  # Python accepts 1_000, Prometheus does not
    "vllm:prefix_cache_hits_total",  # no value
    'vllm:prefix_cache_hits_total{engine="0"}',  # no value
    'vllm:prefix_cache_hits_total{engine="0",engine="1"} 1',  # duplicate label
    'vllm:prefix_cache_hits_total{__reserved="x"} 1',  # reserved label name
    'vllm:prefix_cache_hits_total{engine=0} 1',  # unquoted label value
    'vllm:prefix_cache_hits_total{engine="0"x} 1',  # text after the quote
    'vllm:prefix_cache_hits_total{engine="0",,model_name="a"} 1',  # two commas
    'vllm:prefix_cache_hits_total{engine="0\\"} 1',  # escaped closing quote: unterminated
    'vllm:prefix_cache_hits_total{1x="0"} 1',  # invalid label name
    "vllm:prefix_cache_hits_total 1 notatimestamp",
    'vllm:prefix_cache_hits_total{engine="0"} 1 2\t3x',
    "\x00\x01 binary",
    "<html>502 Bad Gateway</html>",
    "5 vllm:prefix_cache_hits_total",
]


@pytest.mark.parametrize("junk", MALFORMED)
def test_a_malformed_line_is_rejected_with_a_reason_and_costs_only_itself(junk: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - prometheus_client raises ValueError, IndexError, ...
        theirs(junk + "\n")
    body = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
    broken = body.replace("# HELP vllm:prefix_cache_queries_total", junk + "\n# HELP vllm:prefix_cache_queries_total")
    for keep in (None, KEPT_NAMES):
        clean, r = parse(body, keep), parse(broken, keep)
        assert r.samples == clean.samples
        assert [line for line, _ in r.bad_lines] == [junk]
        assert r.bad_lines[0][1].startswith("unparseable sample line")


def documented_difference(line: str, name: str) -> bool:
    """prom_text docstring, difference 4: prometheus_client read the sample ``name`` from before "{" but it is not
    a valid metric name written first on the line and followed by "{" or whitespace (prometheus_client takes
    that text unvalidated, and drops the last character of a line without blanks)."""
    s = line.strip()
    if s.startswith("{"):
        return False
    after = s[len(name):len(name) + 1]
    return not (NAME_RE.fullmatch(name) and s.startswith(name) and (after in ("", "{") or after.isspace()))


@settings(max_examples=500, deadline=None, database=None)
@given(line=st.text(max_size=40) | sample_lines().map(lambda s: s[: len(s) // 2]) | st.lists(
    st.sampled_from(['x', '{', '}', '"', '\\', '=', ',', ' ', '\t', '1', 'e', 'a="b"', '#', 'NaN', '_']),
    max_size=14).map("".join))
def test_any_line_is_parsed_or_rejected_as_prometheus_client_does(line: str) -> None:
    line = line.replace("\n", " ")
    r = parse(line)  # never raises
    s = line.strip()
    if not s or s.startswith("#"):
        assert r == ([], [])
        return
    try:
        ref: list[Row] | None = theirs(line)
    except Exception:
        ref = None
    if ref is None or documented_difference(line, ref[0][0]):
        assert not r.samples and [b for b, _ in r.bad_lines] == [line]
    else:
        assert same([(n, dict(lab), v) for n, lab, v in r.samples], ref) and not r.bad_lines
    # with keep, a line is reported only if it names a kept sample or cannot name any
    kept = parse(line, {"x", "a"})
    assert all(n in {"x", "a"} for n, _, _ in kept.samples)


def test_comment_lines_prometheus_client_rejects_are_ignored() -> None:
    """prom_text docstring, difference 2: a malformed HELP/TYPE line carries no sample."""
    body = "# TYPE foo\n# HELP 1bad x\nfoo 1\n"
    with pytest.raises(ValueError):
        theirs(body)
    assert mine(body) == [("foo", {}, 1.0)]


def test_counter_names_are_reported_as_exposed() -> None:
    """prom_text docstring, difference 3: no `_total` is appended to a counter sample lacking it."""
    assert theirs("# TYPE foo counter\nfoo 1\n")[0][0] == "foo_total"
    assert mine("# TYPE foo counter\nfoo 1\n") == [("foo", {}, 1.0)]


def test_nothing_after_eof_is_loaded() -> None:
    """prom_text docstring, difference 6: a real capture served as OpenMetrics (`# EOF` last) parses as without
    it; lines after `# EOF` (another body, junk) are rejected one by one, on the fast and the careful path."""
    body = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
    other = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_2.txt").read_text() + "<html>\n"
    for b, o in ((body, other), (body.replace("\n", "\r\n"), other.replace("\n", "\r\n"))):
        for keep in (None, KEPT_NAMES):
            clean = parse(b, keep)
            assert parse(b + "# EOF\n", keep) == clean and parse(b + "# EOF", keep) == clean
            r = parse(b + "# EOF\n" + o, keep)
            assert r.samples == clean.samples and r.samples
            wanted = [line for line in o.split("\n") if line.strip() and not line.startswith("#")
                      and (keep is None or line.strip() == "<html>" or re.split(r"[{ ]", line)[0] in keep)]
            assert r.bad_lines == [(line, AFTER_EOF) for line in wanted] and len(wanted) > 100


def test_a_huge_label_value_is_parsed_as_prometheus_client_does_and_not_kept_in_the_cache() -> None:
    """A 5 MB label value (with escapes) is one sample, the same as prometheus_client's; its label block is not
    kept in the parser's cache (a 50 MB value stayed alive there, twice, after the scrape)."""
    from collector import prom_text

    value = "x" * 5_000_000 + '\\"' + "y" * 10
    line = f'vllm:num_requests_running{{engine="0",instance="{value}"}} 1.0\n'
    [(name, labels, v)] = mine(line, KEPT_NAMES)
    assert same([(name, labels, v)], theirs(line))
    assert labels["instance"] == "x" * 5_000_000 + '"' + "y" * 10
    assert max(map(len, prom_text._label_cache), default=0) <= 4096
