"""Showing values that come from the gateway log (tenants, pods, models, request and conversation ids) to people.

Those values are written by whoever sends requests through the gateway, so they are untrusted text: they may
hold control characters (CR/LF that forge lines or mail headers, ANSI escape sequences that drive a terminal),
bidirectional overrides and invisible characters that make a name read as another, markup for the place they
are shown in (HTML, Streamlit's Markdown with its colours and links, Slack's ``<!channel>``), or be very long or
empty. Every place that shows one goes through a function here:

- :func:`shown`: one line of visible text, for plain text, terminals, email subjects and bodies, log lines and
  alert messages (the base of the others);
- :func:`markdown`: text escaped for Streamlit's Markdown (``st.markdown``, captions, ``st.page_link`` labels);
- :func:`slack`: text escaped for Slack's mrkdwn (a webhook's ``text``);
- :func:`html_text`: text escaped for HTML (the digest; plotly labels, which render a subset of HTML);
- :class:`OneLineFormatter`: log lines (every ``kvscope`` command logs through it).

The stored value is never changed; machine-readable outputs (JSON, CSV, the webhook's structured fields, URLs)
carry it as it is, in their own encoding.
"""

from __future__ import annotations

import html
import logging
import re
import unicodedata

#: How a missing tenant reads in sentences (``tenant_id`` '' means "no tenant", docs/gateway-log.md).
NO_TENANT = "(no tenant)"
#: Characters of a value shown in running text before it is cut (identifiers may be up to 512 characters).
LIMIT = 80
#: Unicode categories that are never shown as they are: control (C0, C1, DEL), format (bidirectional
#: overrides and isolates, zero-width spaces and joiners, the BOM, soft hyphen), line and paragraph separators,
#: lone surrogates.
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _escape_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def shown(value: object, *, limit: int | None = LIMIT, empty: str = "") -> str:
    """``value`` as one line of visible text: characters of :data:`_HIDDEN` categories as Python-style escapes
    (``\\x1b``, ``\\r``→``\\x0d``, ``\\u202e``), cut to ``limit`` characters (None = not cut) ending in ``…``
    when longer, ``empty`` for '' (e.g. :data:`NO_TENANT`). Non-strings are shown with ``str``."""
    text = "" if value is None else str(value)
    if not text:
        return empty
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    if text.isprintable() and text.isascii():
        return text
    return "".join(_escape_char(ch) if unicodedata.category(ch) in _HIDDEN else ch for ch in text)


def tenant(value: str, *, limit: int | None = LIMIT) -> str:
    """A tenant id for a sentence: :func:`shown`, '' as :data:`NO_TENANT`."""
    return shown(value, limit=limit, empty=NO_TENANT)


#: Characters that start markup anywhere in a line of Streamlit's Markdown: emphasis, code, links and images,
#: GFM tables and strikethrough, ``$`` for LaTeX, ``<`` for HTML and autolinks, ``&`` for entities; an underscore
#: only at a word's edge (``tenant_id`` stays as it is: an underscore inside a word starts nothing).
_MARKDOWN_SPECIAL = re.compile(r"[\\`*{}\[\]()|<>~$&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
#: What starts a block only at the start of a line: a list (``-``, ``+``, ``1.``, ``1)``), a heading (``#``, and
#: ``=``/``-`` underlines), a quote (``>``, escaped anyway).
_LINE_START = re.compile(r"(?m)^([ \t]*)([-+#=])|^([ \t]*\d+)([.)])")
#: Patterns Streamlit acts on in the text after escapes are resolved, so a backslash does not stop them: GFM's
#: links from plain text (https://, www., an email address), ``:red[...]`` colours, ``:material/icon:`` and
#: ``:emoji:`` shortcodes. A WORD JOINER (U+2060, invisible, no break) inside the pattern does.
_AUTOLINK = re.compile(r"(?i)(?<=[a-z0-9])(?=://)|(?<=www)(?=\.)|(?=@)|(?<=:)(?=[a-z])")
WORD_JOINER = "\u2060"


def markdown(text: str) -> str:
    """``text`` (already visible text: pass untrusted values through :func:`shown` first) escaped for
    Streamlit's Markdown: shown as written, no emphasis, link, colour, icon, LaTeX, HTML, list or heading; line
    breaks kept as hard breaks. Characters that mean nothing where they stand are left alone, so ``pod-b`` and
    ``localhost:8000`` read (and compare) as they are."""
    escaped = _MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(0), _AUTOLINK.sub(WORD_JOINER, text))
    escaped = _LINE_START.sub(lambda m: f"{m.group(1)}\\{m.group(2)}" if m.group(2) else f"{m.group(3)}\\{m.group(4)}",
                              escaped)
    return escaped.replace("\r\n", "\n").replace("\n", "  \n")


def slack(text: str) -> str:
    """``text`` for Slack's mrkdwn: ``&``, ``<``, ``>`` as the entities Slack decodes, so ``<!channel>``,
    ``<@U123>`` and ``<http://x|label>`` show as text instead of pinging or linking (api.slack.com, "Formatting
    text for app surfaces": escaping)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def html_text(value: object, *, limit: int | None = LIMIT, empty: str = "", quote: bool = True) -> str:
    """:func:`shown` escaped for HTML text and, with ``quote``, attribute values (quotes as entities). Plotly's
    labels want ``quote=False``: plotly decodes ``&lt;``, ``&gt;`` and ``&amp;`` but shows ``&quot;`` as is."""
    return html.escape(shown(value, limit=limit, empty=empty), quote=quote)


class OneLineFormatter(logging.Formatter):
    """A log formatter whose message part is :func:`shown` (never cut): a value logged from the gateway log or a
    request (a pod, a request id, an error text) cannot start a forged log line with CR/LF or colour the
    terminal with an ANSI sequence. A traceback (``exc_info``) is appended as usual, on its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802  (logging's name)
        record.message = shown(record.message, limit=None)
        return super().formatMessage(record)
