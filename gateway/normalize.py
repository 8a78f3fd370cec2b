"""Masking of volatile values in prompt text, for `system_norm_hash` (gateway → fingerprint log).

A system prompt that carries "Current time: 2026-11-29T12:00:03Z" or "request req-8f3a91c2" changes on every
request, so vLLM's prefix cache misses from the first changed block on (a timestamp line in front of a
1,293-token system prompt gave 0 cached tokens on vLLM 0.32, `docs/environment.md`). Hashing the
prompt with such values masked lets attribution name the miss `prefix_drift/volatile_system` (normalized hash
equal, raw hash different) instead of `system_changed`.

The patterns are one ordered table, `VOLATILE_PATTERNS`; order matters (a full timestamp is masked before
its date or clock time could be).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)


@dataclass(frozen=True)
class VolatilePattern:
    """One kind of volatile value: `name`, the regex that finds it, the mask it becomes, and an example."""

    name: str
    regex: re.Pattern[str]
    mask: str
    example: str


def _p(name: str, pattern: str, mask: str, example: str, flags: int = 0) -> VolatilePattern:
    return VolatilePattern(name, re.compile(pattern, flags), mask, example)


VOLATILE_PATTERNS: tuple[VolatilePattern, ...] = (
    # ISO 8601 / RFC 3339 date-time, with optional seconds, fraction and zone: 2026-11-29T12:00:03.123Z
    _p(
        "iso_datetime",
        r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?(?![\w:])",
        "<ts>",
        "2026-11-29T12:00:03.123Z",
    ),
    # UUID (any version), before the date patterns could eat digit groups: 9b2e4c1a-...
    _p(
        "uuid",
        r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
        "<uuid>",
        "9b2e4c1a-5f3d-4e6a-8b7c-0d1e2f3a4b5c",
    ),
    # Request-id-like tokens: a known prefix, a separator, then an id containing at least one digit
    # (so "request-handling" and "run_tools" stay): req-8f3a91c2, chatcmpl-abc123def, call_9XbQ2kLm.
    _p(
        "request_id",
        r"\b(?:req|request|chatcmpl|cmpl|resp|msg|run|trace|span|sess|session|conv|call|job|task|evt)"
        r"[-_](?=[A-Za-z0-9_-]*\d)[A-Za-z0-9][A-Za-z0-9_-]{5,}",
        "<id>",
        "req-8f3a91c2",
        re.IGNORECASE,
    ),
    # Long hex ids (>= 16 hex digits): trace ids, digests, object ids.
    _p("hex_id", r"\b[0-9a-fA-F]{16,}\b", "<hex>", "4bf92f3577b34da6a3ce929d0e0e4736"),
    # Bare ISO date: 2026-11-29
    _p("iso_date", r"\b\d{4}-\d{2}-\d{2}\b", "<date>", "2026-11-29"),
    # Numeric dates with slashes or dots: 11/29/2026, 29.11.2026, 2026/11/29
    _p(
        "numeric_date",
        r"\b(?:\d{1,2}[/.]\d{1,2}[/.]\d{2,4}|\d{4}/\d{1,2}/\d{1,2})\b",
        "<date>",
        "11/29/2026",
    ),
    # Dates with a month name, optional weekday: Sunday, November 29, 2026 / 29 Nov 2026
    _p(
        "month_date",
        r"\b(?:(?:Mon|Tues?|Wed(?:nes)?|Thu(?:rs)?|Fri|Sat(?:ur)?|Sun)(?:day)?,?\s+)?"
        rf"(?:{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}|\d{{1,2}}\s+{_MONTH}\.?,?\s+\d{{4}})\b",
        "<date>",
        "Sunday, November 29, 2026",
    ),
    # Clock times: 12:00, 09:41:07, 9:41 pm, 12:00:03.5
    _p(
        "clock_time",
        r"\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?(?!\d)",
        "<time>",
        "09:41:07",
    ),
    # Unix epoch seconds (10 digits, 2001-09 .. 2033-05) or milliseconds (13 digits), optional fraction.
    _p("unix_epoch", r"\b1\d{9}(?:\d{3})?(?:\.\d+)?\b", "<epoch>", "1795950818"),
)


def mask_volatile(text: str) -> str:
    """`text` with every `VOLATILE_PATTERNS` match replaced by its mask (e.g. "<ts>"), in table order."""
    for pattern in VOLATILE_PATTERNS:
        text = pattern.regex.sub(pattern.mask, text)
    return text
