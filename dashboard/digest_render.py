"""The digest as an email: a plain-text part and an HTML part with inline PNG charts.

MIME layout (RFC 2387 / RFC 2046)::

    multipart/related
    ├── multipart/alternative
    │   ├── text/plain; charset=utf-8
    │   └── text/html; charset=utf-8      (<img src="cid:...">)
    ├── image/png  (Content-ID, inline)  missed tokens by cause
    └── image/png  (Content-ID, inline)  hit rate, this period vs the previous

Both parts are rendered from one list of :class:`Section` so they say the same thing. Only what the store holds
appears (tenants, pods, request ids, token counts, hash counts); the store holds no prompt text. Tenants, pods
and request ids come from the gateway log: they are shown as :func:`dashboard.untrusted.shown` makes them (one
visible line, control and bidirectional characters as escapes, cut when very long) and HTML-escaped in the HTML.
"""

from __future__ import annotations

import html as _html
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from email.message import EmailMessage, MIMEPart
from email.utils import formatdate, make_msgid

from dashboard import causes, digest_charts, findings, untrusted
from dashboard.digest import Digest, TenantLoss
from dashboard.digest_charts import compact
from kvscope.durations import human

MINUS = "\u2212"
#: How a pod without a name reads.
NO_POD = "(no pod)"


# -- a neutral layout both parts are rendered from -------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """A table cell: ``text``, an optional ``link`` (HTML only) and colour ``swatch`` (#RRGGBB, HTML only)."""

    text: str
    link: str = ""
    swatch: str = ""


@dataclass(frozen=True)
class Table:
    """Columns, rows of cells; ``right``: the indexes of right-aligned (numeric) columns."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    right: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Section:
    """A titled block: paragraphs, an optional image (its key in the message's images), an optional table,
    numbered items (each a list of paragraphs), and a drill-down ``link``."""

    title: str
    paragraphs: tuple[str, ...] = ()
    image: str = ""
    table: Table | None = None
    items: tuple[tuple[str, ...], ...] = ()
    item_links: tuple[str, ...] = ()
    link: str = ""


# -- formatting ---------------------------------------------------------------------------------------------------
def pct(x: float | None, digits: int = 1) -> str:
    """0.562 → "56.2 %"; None → "–"."""
    return "–" if x is None else f"{x * 100:.{digits}f} %"


def pp(x: float | None) -> str:
    """Percentage points with a sign: "−3.1 pp", "+0.4 pp"; None → "–"."""
    if x is None:
        return "–"
    return f"{'+' if x >= 0 else MINUS}{abs(x):.1f} pp"


def versus(now: float, before: float) -> str:
    """Against the previous period: "+12 % on 2,800 in the previous period", "none in the previous period",
    "as many as in the previous period"."""
    if before == 0:
        return "none in the previous period"
    rel = (now - before) / before * 100
    if abs(rel) < 0.5:
        return "as many as in the previous period"
    return f"{'+' if rel > 0 else MINUS}{abs(rel):.0f} % on {before:,.0f} in the previous period"


def plural(n: int, word: str) -> str:
    """"1 request", "3 requests" (with thousands separators)."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def gpu(x: float | None) -> str:
    """GPU-seconds as the dashboard writes them: "340 GPU-s", "2.5 GPU-s", "0.062 GPU-s"; None → "–"."""
    return "–" if x is None else f"{findings.gpu_seconds_text(x)} GPU-s"


def money(x: float | None, currency: str) -> str:
    """"12.40 USD", "<0.01 USD"; None → "–"."""
    if x is None:
        return "–"
    return f"<0.01 {currency}" if 0 < x < 0.005 else f"{x:,.2f} {currency}"


def duration(ms: float | None) -> str:
    """"850 ms", "2.1 s", "4.5 min", "3.5 h" (kvscope.durations.human); None → "–"."""
    return human(None if ms is None else ms / 1000)


def span(d: Digest) -> str:
    """"24 h", "7 d", "3 min"."""
    s = d.length.total_seconds()
    if s % 86400 == 0:
        return f"{s / 86400:.0f} d"
    if s % 3600 == 0:
        return f"{s / 3600:.0f} h"
    return f"{s / 60:.0f} min" if s % 60 == 0 else f"{s:.0f} s"


def subject(d: Digest) -> str:
    """E.g. "kvscope digest 2026-11-30: hit rate 56.2 % (−3.1 pp), 1.2M missed tokens" (the date the period ends
    in, UTC; the headline hit rate is vLLM's counters when present, else the gateway's); without traffic, "kvscope
    digest 2026-11-30: no traffic in the period (1 d)" (not "the last", which a --since/--until period in the
    past is not)."""
    day = (d.until - timedelta(milliseconds=1)).strftime("%Y-%m-%d")
    h = d.headline
    if h is None and not d.missed_tokens and not d.unknown_tokens:
        return f"kvscope digest {day}: no traffic in the period ({span(d)})"
    rate = f"hit rate {pct(h.rate if h else None)}"
    if h is not None and h.change_pp is not None:
        rate += f" ({pp(h.change_pp)})"
    return f"kvscope digest {day}: {rate}, {compact(d.missed_tokens)} missed tokens"


# -- sections -----------------------------------------------------------------------------------------------------
def sections(d: Digest) -> list[Section]:
    """The digest's sections in reading order (docs/digest.md explains each)."""
    return [_hit_rate(d), _causes(d), _tenants(d), _drift(d), _cardinality(d), _affinity(d), _ttl(d),
            _quality(d)]


def _hit_rate(d: Digest) -> Section:
    rows = []
    for h in d.hit_rates:
        name = "vLLM counters" if h.source == "vllm" else "gateway log"
        rows.append((Cell(name), Cell(pct(h.rate)), Cell(pp(h.change_pp)), Cell(pct(h.previous)),
                     Cell(f"{compact(h.hit_tokens)} / {compact(h.query_tokens)}"),
                     Cell(pct(h.coverage, 0) if h.source == "gateway" else "")))
    if not rows:
        return Section("Hit rate", ("No prompt tokens in this period or the one before.",))
    return Section(
        "Hit rate", ("Token-weighted: cached prompt tokens / prompt tokens, this period against the one before.",),
        image="hit_rate",
        table=Table(("source", "hit rate", "change", "previous", "cached / prompt tokens", "coverage"),
                    tuple(rows), frozenset({1, 2, 3, 4, 5})),
        link=d.links.get("overview", ""))


def unknown_line(d: Digest) -> str:
    """The sentence on prompt tokens whose hits are unknown (cause not_reported), '' when there are none: they
    are shown apart, never as missed tokens and with no cost (docs/miss-causes.md)."""
    if not d.unknown_tokens:
        return ""
    return (f"Not counted: {d.unknown_tokens:,} prompt tokens whose hits are unknown (the pod did not report the "
            "cached count: not_reported). To count them, start vLLM with --enable-prompt-tokens-details and have "
            "streaming clients ask for usage (stream_options.include_usage); the Data quality page shows it per "
            "pod.")


def _causes(d: Digest) -> Section:
    unknown = unknown_line(d)
    if not d.causes:
        return Section("Where the missed tokens went", ("No missed tokens in this period.", *filter(None, [unknown])))
    cost = f", {gpu(d.gpu_seconds)}" if d.gpu_seconds is not None else ""
    cost += f", {money(d.money, d.currency)}" if d.money is not None else ""
    intro = f"{d.missed_tokens:,} missed prompt tokens{cost} ({versus(d.missed_tokens, d.previous_missed_tokens)})."
    if unknown:
        intro += " " + unknown
    with_money = d.money is not None
    rows = []
    for c in d.causes:
        row = [Cell(c.label, swatch=c.color), Cell(f"{c.missed_tokens:,}"), Cell(pct(c.share_of_missed, 0)),
               Cell(gpu(c.gpu_seconds).removesuffix(" GPU-s"))]
        if with_money:
            row.append(Cell(money(c.money, d.currency).removesuffix(" " + d.currency)))
        row += [Cell(f"{c.requests:,}"), Cell(f"{c.previous_missed_tokens:,}")]
        rows.append(tuple(row))
    cols = ("cause", "missed tokens", "share", "GPU-s", *([d.currency] if with_money else []), "requests",
            "previous period")
    return Section("Where the missed tokens went", (intro,), image="causes",
                   table=Table(cols, tuple(rows), frozenset(range(1, len(cols)))), link=d.links.get("miss_causes", ""))


def _tenants(d: Digest) -> Section:
    if not d.tenants:
        return Section("Fix first: the tenants losing most", ("No tenant missed tokens in this period.",))
    items = tuple(_tenant_item(d, t) for t in d.tenants)
    return Section("Fix first: the tenants losing most",
                   (f"The {len(d.tenants)} tenants with the most missed tokens"
                    f"{' (ranked by GPU-seconds)' if all(t.gpu_seconds is not None for t in d.tenants) else ''}, "
                    "each with its dominant cause that a fix removes.",),
                   items=items, item_links=tuple(t.link for t in d.tenants))


def _tenant_item(d: Digest, t: TenantLoss) -> tuple[str, ...]:
    cost = f", {gpu(t.gpu_seconds)}" if t.gpu_seconds is not None else ""
    cost += f", {money(t.money, d.currency)}" if t.money is not None else ""
    head = (f"{untrusted.tenant(t.tenant_id)}: {t.missed_tokens:,} missed tokens{cost} "
            f"({versus(t.missed_tokens, t.previous_missed_tokens)})")
    f = t.finding
    worth = ()
    if t.worth is not None:
        verdict = "Cache work pays" if t.worth.pays else "Little to gain from cache work"
        worth = (f"{verdict}: {'; '.join(t.worth.reasons)}.",)
    if f is None:
        return (head, "None of its misses has a fix: they are cold starts (or prefixes seen too long ago), new "
                      "content or partial blocks.", *worth)
    out = [head, f"Dominant cause: {f.label}, {pct(f.share_of_tenant_missed, 0)} of this tenant's missed tokens "
                 f"({f.missed_tokens:,} tokens in {plural(f.requests, 'request')}{_cost(f.gpu_seconds, f.money, d)}).",
           f"Fix ({pct(f.share_of_tenant_missed, 0)} of this tenant's misses): {f.fix}"]
    if f.evidence is not None:
        out.append(f"Evidence: {f.evidence.text()}.")
    return (*out, *worth)


def _cost(gpu_seconds: float | None, amount: float | None, d: Digest) -> str:
    """", 0.062 GPU-s, 0.01 USD" to follow a token count ('' when no pod measured prefill time)."""
    if gpu_seconds is None:
        return ""
    return f", {gpu(gpu_seconds)}" + (f", {money(amount, d.currency)}" if amount is not None else "")


def _drift(d: Digest) -> Section:
    title = "New prefix drift"
    if not d.drift:
        return Section(title, ("None: no tenant's prompt started changing in a new segment.",))
    with_money = any(x.money is not None for x in d.drift)
    rows = tuple((Cell(untrusted.tenant(x.tenant_id), link=x.link),
                  Cell(x.sub_cause, swatch=causes.color("prefix_drift", x.sub_cause)),
                  Cell(f"{x.missed_tokens:,}"), Cell(gpu(x.gpu_seconds).removesuffix(" GPU-s")),
                  *([Cell(money(x.money, d.currency))] if with_money else []),
                  Cell(f"{x.requests:,}")) for x in d.drift)
    cols = ("tenant", "changed segment", "missed tokens", "GPU-s", *([d.currency] if with_money else []), "requests")
    return Section(title, ("Tenants whose prompt changed in a segment that did not drift in the previous period.",),
                   table=Table(cols, rows, frozenset(range(2, len(cols)))),
                   link=d.links.get("miss_causes", ""))


def _cardinality(d: Digest) -> Section:
    title = "Fingerprint cardinality jumps"
    if not d.cardinality:
        return Section(title, ("None: every tenant's prompt segments kept their usual number of variants.",))
    rows = tuple((Cell(untrusted.tenant(j.tenant_id), link=j.link), Cell(j.segment), Cell(f"{j.raw:,}"),
                  Cell(f"{j.previous_raw:,}"),
                  Cell(f"{j.normalized:,}"), Cell(f"{j.requests:,} / {j.previous_requests:,}")) for j in d.cardinality)
    return Section(
        title, ("Distinct raw hashes of a segment, now and before: a jump means something volatile entered the "
                "prompt. Far more raw than normalized variants: a timestamp, an id or a reordering.",),
        table=Table(("tenant", "segment", "distinct now", "before", "normalized now", "requests now / before"), rows,
                    frozenset({2, 3, 4, 5})),
        link=d.links.get("fingerprints", ""))


def _affinity(d: Digest) -> Section:
    title = "Pods whose cache affinity fell"
    if not d.affinity:
        return Section(title, ("None: no pod lost cache affinity (a drop of 5 pp or more).",))
    rows = tuple((Cell(untrusted.shown(a.pod, empty=NO_POD), link=a.link), Cell(pct(a.affinity)),
                  Cell(pct(a.previous)), Cell(pp(a.change_pp)),
                  Cell(f"{a.predecessor_tokens:,}")) for a in d.affinity)
    return Section(
        title, ("Of the prompt tokens a pod served for requests whose prefix was cached by a predecessor, the share "
                "it served where that predecessor ran. A fall means the router moves conversations between pods.",),
        table=Table(("pod", "affinity", "before", "change", "tokens with a predecessor"), rows,
                    frozenset({1, 2, 3, 4})),
        link=d.links.get("pods", ""))


def _ttl(d: Digest) -> Section:
    title = "Hold time (TTL)"
    t = d.ttl
    if t is None:
        return Section(title, ("No conversation or agent run came back to the same pod in this period.",))
    paras = [f"{plural(t.next_turns, 'next turn')} came back to the pod that served their previous turn; they waited "
             f"{duration(t.gap_p50_ms)} (median), {duration(t.gap_max_ms)} at most.",
             f"Holding conversation and agent-run prefixes for {duration(t.hold_ms)} would keep 90 % of next turns "
             "warm."]
    if t.evicted_before_next_turn:
        share = pct(t.evicted_before_next_turn / t.next_turns, 0)
        paras.append(f"{plural(t.evicted_before_next_turn, 'next turn')} ({share}) "
                     f"found their prefix evicted, {t.evicted_missed_tokens:,} missed tokens"
                     f"{_cost(t.evicted_gpu_seconds, t.evicted_money, d)}; their median wait was "
                     f"{duration(t.evicted_gap_p50_ms)}, so the pods held prefixes for less than that.")
    else:
        paras.append("None of them found its prefix evicted: the pods held prefixes long enough.")
    return Section(title, tuple(paras))


def _quality(d: Digest) -> Section:
    title = "Data quality"
    if not d.data_quality and d.headline is None:
        return Section(title, ("No pod served traffic in this period: nothing to compare.",))
    if not d.data_quality:
        return Section(title, ("The two hit-rate sources (vLLM's counters, the gateway log) agree on every pod.",))
    rows = tuple((Cell(untrusted.shown(w.pod, empty=NO_POD)), Cell(w.likely_cause), Cell(pp(w.gap_pp)),
                  Cell(w.evidence)) for w in d.data_quality)
    return Section(title, ("Pods where vLLM's counters and the gateway log disagree, with the likely cause.",),
                   table=Table(("pod", "likely cause", "gap", "evidence"), rows, frozenset({2})),
                   link=d.links.get("data_quality", ""))


# -- plain text ----------------------------------------------------------------------------------------------------
def header_lines(d: Digest) -> list[str]:
    """The period and what it is compared with, one line each (bounds in whole minutes: :func:`digest.period`
    cuts --since/--until down to their minute's start)."""
    fmt = "%Y-%m-%d %H:%M"
    return [f"Period: {d.since:{fmt}} to {d.until:{fmt}} UTC ({span(d)}), against {d.previous_since:{fmt}} to "
            f"{d.since:{fmt}} UTC; whole minutes (a time inside a minute counts from that minute's start)."]


def summary(d: Digest) -> str:
    """One sentence: the headline hit rate and its change, the missed tokens, and the first fix."""
    h = d.headline
    if h is None and not d.missed_tokens and not d.unknown_tokens:
        return "In short: no traffic in this period (no prompt tokens counted by vLLM or logged by the gateway)."
    parts = []
    if h is not None:
        name = "vLLM counters" if h.source == "vllm" else "gateway log"
        parts.append(f"hit rate {pct(h.rate)} ({name}" + (f", {pp(h.change_pp)})" if h.change_pp is not None
                                                           else ", no previous data)"))
    parts.append(f"{d.missed_tokens:,} missed tokens")
    if d.unknown_tokens:
        parts.append(f"{d.unknown_tokens:,} prompt tokens with unknown hits")
    first = next((t for t in d.tenants if t.finding is not None), None)
    if first is not None and first.finding is not None:
        parts.append(f"fix first: {untrusted.tenant(first.tenant_id)}, {first.finding.label} "
                     f"({pct(first.finding.share_of_tenant_missed, 0)} of its misses)")
    return "In short: " + "; ".join(parts) + "."


def plain_text(d: Digest) -> str:
    """The text/plain part."""
    out = ["kvscope miss-cause digest", "", *header_lines(d), summary(d)]
    for s in sections(d):
        out += ["", s.title.upper(), *[f"  {p}" for p in s.paragraphs]]
        if s.table:
            out += [""] + [f"  {line}" for line in _text_table(s.table)]
        for i, item in enumerate(s.items, 1):
            out += [f"  {i}. {item[0]}", *[f"     {p}" for p in item[1:]]]
            if s.item_links and s.item_links[i - 1]:
                out.append(f"     Drill down: {s.item_links[i - 1]}")
        if s.link:
            out.append(f"  Dashboard: {s.link}")
    out += ["", _FOOTER]
    return "\n".join(out) + "\n"


_FOOTER = ("Figures come from kvscope's named queries for the same windows (kvscope query ...); definitions: "
           "docs/miss-causes.md, sections: docs/digest.md. kvscope stores no prompt text.")


def _text_table(t: Table) -> list[str]:
    cells = [list(t.columns)] + [[c.text for c in row] for row in t.rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(t.columns))]

    def line(r: list[str]) -> str:
        return "  ".join(v.rjust(w) if i in t.right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths,
                                                                                                 strict=True))).rstrip()

    return [line(cells[0]), line(["-" * w for w in widths]), *[line(r) for r in cells[1:]]]


# -- HTML ------------------------------------------------------------------------------------------------------------
def html(d: Digest, cids: dict[str, str]) -> str:
    """The text/html part; ``cids``: image key → Content-ID (without brackets) of the inline images."""
    e = _html.escape
    body = [f"<h1 style='{_H1}'>kvscope miss-cause digest</h1>",
            *[f"<p style='{_P}'>{e(x)}</p>" for x in header_lines(d)],
            f"<p style='{_P}'><b>{e(summary(d))}</b></p>"]
    for s in sections(d):
        body.append(f"<h2 style='{_H2}'>{e(s.title)}</h2>")
        body += [f"<p style='{_P}'>{e(p)}</p>" for p in s.paragraphs]
        if s.image and s.image in cids:
            body.append(f"<img src='cid:{e(cids[s.image])}' width='{digest_charts.WIDTH_PX}' "
                        f"alt='{e(s.title)} chart' style='display:block;max-width:100%;height:auto;margin:8px 0'>")
        if s.table:
            body.append(_html_table(s.table))
        if s.items:
            body.append(f"<ol style='{_P}padding-left:20px'>")
            for i, item in enumerate(s.items):
                link = s.item_links[i] if s.item_links else ""
                more = "".join(f"<br><span style='color:#333'>{e(p)}</span>" for p in item[1:])
                drill = f"<br><a href='{e(link)}'>Drill down</a>" if link else ""
                body.append(f"<li style='margin-bottom:10px'><b>{e(item[0])}</b>{more}{drill}</li>")
            body.append("</ol>")
        if s.link:
            body.append(f"<p style='{_P}'><a href='{e(s.link)}'>Open in the dashboard</a></p>")
    body.append(f"<p style='{_P}color:#666;font-size:12px;margin-top:24px'>{e(_FOOTER)}</p>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + e(subject(d)) + "</title></head>"
            f"<body style='margin:0;padding:16px;background:#ffffff'><div style='{_WRAP}'>" + "\n".join(body)
            + "</div></body></html>")


_WRAP = "max-width:720px;font-family:Helvetica,Arial,sans-serif;color:#111;"
_H1 = "font-size:20px;margin:0 0 4px 0;"
_H2 = "font-size:16px;margin:22px 0 6px 0;border-bottom:1px solid #ddd;padding-bottom:3px;"
_P = "font-size:14px;line-height:1.45;margin:4px 0;"
_TD = "padding:3px 8px;border-bottom:1px solid #eee;font-size:13px;"


def _html_table(t: Table) -> str:
    e = _html.escape

    def align(i: int) -> str:
        return "text-align:right;white-space:nowrap;" if i in t.right else "text-align:left;"

    head = "".join(f"<th style='{_TD}{align(i)}background:#f5f5f5'>{e(c)}</th>" for i, c in enumerate(t.columns))
    rows = []
    for row in t.rows:
        tds = []
        for i, c in enumerate(row):
            text = f"<a href='{e(c.link)}'>{e(c.text)}</a>" if c.link else e(c.text)
            if c.swatch:
                text = (f"<span style='display:inline-block;width:10px;height:10px;background:{e(c.swatch)};"
                        f"margin-right:6px'></span>{text}")
            tds.append(f"<td style='{_TD}{align(i)}'>{text}</td>")
        rows.append("<tr>" + "".join(tds) + "</tr>")
    return (f"<table cellspacing='0' cellpadding='0' style='border-collapse:collapse;margin:6px 0'>"
            f"<tr>{head}</tr>{''.join(rows)}</table>")


# -- the message -----------------------------------------------------------------------------------------------------
def render(d: Digest, *, to: Sequence[str] = (), sender: str = "") -> EmailMessage:
    """The digest email (layout in the module docstring). ``to``: recipients (the To header; may be empty for
    --dry-run); ``sender``: the From header ('' = left for :func:`dashboard.mail.send` to set)."""
    images = {k: png for k, png in (("hit_rate", digest_charts.hit_rate_png(d)),
                                    ("causes", digest_charts.causes_png(d))) if png}
    cids = {k: make_msgid(idstring=f"digest-{k}", domain="kvscope")[1:-1] for k in images}
    alternative = MIMEPart()
    alternative.set_content(plain_text(d), charset="utf-8")
    alternative.add_alternative(html(d, cids), subtype="html", charset="utf-8")
    msg = EmailMessage()
    msg["Subject"] = subject(d)
    if sender:
        msg["From"] = sender
    if to:
        msg["To"] = ", ".join(to)
    msg["Date"] = formatdate(usegmt=True)
    msg["Message-ID"] = make_msgid(idstring="digest", domain="kvscope")
    msg["MIME-Version"] = "1.0"
    # the stdlib converts only a single part or mixed to related (EmailMessage.make_related): set it up directly
    msg["Content-Type"] = "multipart/related"
    msg.set_param("type", "multipart/alternative")
    msg.set_payload([alternative])
    for key, png in images.items():
        msg.add_related(png, "image", "png", cid=f"<{cids[key]}>", filename=f"{key}.png", disposition="inline")
    return msg
