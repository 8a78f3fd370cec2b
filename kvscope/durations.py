"""Durations as operators write and read them: ``"90s"``, ``"10m"``, ``"1.5h"``, ``"1h30m"``, ``"7d"``, ``"1w"``
in settings, alert rules and CLI flags; ``"850 ms"``, ``"2.1 s"``, ``"4.5 min"``, ``"3.5 h"``, ``"2 d"`` in
messages. One definition for the digest, the alert rules and the dashboard.
"""

from __future__ import annotations

import re

DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)")
"""One number-and-unit term; a duration is one or more of them (``1h30m``)."""
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_seconds(text: str, *, whole_seconds: bool = False) -> float:
    """Seconds in ``text``: one or more number-and-unit terms, units s, m, h, d, w (``"1h30m"`` = 5400.0;
    ``"1.5h"`` = 5400.0). ``whole_seconds``: integers only in each term (alert rules).

    Raises ValueError (saying what was expected) for anything else, and for a zero length."""
    text = (text or "").strip()
    number = r"\d+" if whole_seconds else r"\d+(?:\.\d+)?"
    term = rf"({number})\s*(s|m|h|d|w)"
    if not re.fullmatch(rf"(?:{term}\s*)+", text):
        raise ValueError(f"{text!r} is not a duration: expected a number and a unit s, m, h, d or w (e.g. 90s, 10m, "
                         "24h, 7d, 1h30m)")
    seconds = sum(float(n) * UNIT_SECONDS[u] for n, u in re.findall(term, text))
    if seconds <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return seconds


def human(seconds: float | None) -> str:
    """``"850 ms"``, ``"2.1 s"``, ``"4.5 min"``, ``"3.5 h"``, ``"2 d"`` (at most one decimal; 48 h and more in
    days); None → ``"–"``."""
    if seconds is None:
        return "–"
    s = float(seconds)
    if abs(s) < 1:
        return f"{s * 1000:.0f} ms"
    for unit, size, limit in (("s", 1, 60), ("min", 60, 3600), ("h", 3600, 172800)):
        if abs(s) < limit:
            return f"{round(s / size, 1):g} {unit}"
    return f"{round(s / 86400, 1):g} d"
