"""Alert rules: what ``kvscope alerts`` and ``kvscope up`` evaluate, loaded from a TOML file
(``KVSCOPE_ALERT_RULES``) or the built-in set (:data:`BUILTIN_RULES_TOML`, shown in docs/alerts.md).

A file holds ``[[rule]]`` tables, each with ``name``, ``kind``, ``severity`` and the kind's parameters
(:data:`KINDS`). Every mistake is refused at load time with a message naming the file and the rule, so a typo
never turns into a rule that silently never fires. TOML is read with the standard library's :mod:`tomllib`
(TOML 1.0).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest import attribution as a
from ingest.errors import KvscopeError
from kvscope.durations import parse_seconds

SEVERITIES = ("info", "warning", "critical")
#: Sources whose silence ``source_silent`` watches (the named query ``freshness``'s ``source`` column).
SOURCES = ("vllm_scrape", "gateway_log", "kv_events", "attribution")
#: Columns of the named query ``fingerprint_cardinality`` a ``cardinality_jump`` rule may watch (``segment``).
SEGMENTS = ("prompt_fingerprint", "system_hash", "system_norm_hash", "tools_hash", "tools_canonical_hash",
            "retrieval_pack_hash", "retrieval_set_hash")
SUB_CAUSES = a.SUB_CAUSES

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
REQUIRED = object()


class AlertRulesError(KvscopeError):
    """A rules file that cannot be used: not TOML, or a rule with an unknown kind, a missing, unknown or
    out-of-range parameter, a duplicate name. The message names the file and the rule."""


@dataclass(frozen=True)
class Param:
    """One parameter of a rule kind: ``type`` is ``duration`` (seconds; TOML integer seconds or a string such
    as ``"10m"``), ``window`` (a duration in whole minutes: the rollups' grain), ``number``, ``int``, ``bool``,
    ``str``, ``cause`` (``cause`` or ``cause/sub_cause``) or a tuple of allowed strings."""

    type: str | tuple[str, ...]
    default: Any = REQUIRED
    help: str = ""


#: kind → its parameters. The threshold parameter of each kind is named in :data:`THRESHOLD`.
KINDS: dict[str, dict[str, Param]] = {
    "hit_rate_drop": {
        "window": Param("window", 3600, "the window compared with the one before it"),
        "drop_pp": Param("number", help="fire when the token-weighted hit rate fell by at least this many "
                                        "percentage points"),
        "source": Param(("gateway", "vllm"), "gateway", "whose hit rate: the gateway log's or vLLM's counters"),
        "tenant": Param("str", "", "only this tenant ('' = all tenants pooled, or each with per_tenant)"),
        "per_tenant": Param("bool", False, "evaluate each tenant on its own (gateway source only)"),
        "min_prompt_tokens": Param("int", 10_000, "ignore a subject with fewer known prompt tokens in either "
                                                  "window"),
    },
    "cause_share": {
        "window": Param("window", 3600, "the window evaluated"),
        "cause": Param("cause", help="a miss cause, or cause/sub_cause (docs/miss-causes.md)"),
        "share_percent": Param("number", help="fire when the cause's share of missed tokens is above this"),
        "tenant": Param("str", "", "only this tenant ('' = all tenants pooled, or each with per_tenant)"),
        "per_tenant": Param("bool", False, "evaluate each tenant's share of its own missed tokens"),
        "min_missed_tokens": Param("int", 1_000, "ignore a subject with fewer missed tokens in the window"),
    },
    "cardinality_jump": {
        "window": Param("window", 3600, "the window compared with the one before it"),
        "factor": Param("number", help="fire when a tenant's cardinality grew by at least this factor"),
        "segment": Param(SEGMENTS, "prompt_fingerprint", "which hash's distinct values to count"),
        "tenant": Param("str", "", "only this tenant ('' = every tenant, each on its own)"),
        "min_cardinality": Param("int", 10, "ignore a tenant with fewer distinct values in the current window"),
    },
    "source_silent": {
        "source": Param(SOURCES, help="vllm_scrape, gateway_log, kv_events or attribution"),
        "silent_seconds": Param("duration", help="fire when the source's latest row is older than this"),
        "pod": Param("str", "", "only this pod ('' = every pod)"),
        "per_pod": Param("bool", True, "each pod on its own; false = the source's latest row over all pods"),
        "lookback": Param("duration", 86_400, "how far back to look for the latest row: a pod silent for "
                                              "longer is no longer known"),
    },
}
THRESHOLD = {"hit_rate_drop": "drop_pp", "cause_share": "share_percent", "cardinality_jump": "factor",
             "source_silent": "silent_seconds"}
#: The unit of each kind's value and threshold, as messages show it.
UNITS = {"hit_rate_drop": "pp", "cause_share": "%", "cardinality_jump": "x", "source_silent": "s"}


@dataclass(frozen=True)
class Rule:
    """One alert rule: ``params`` holds every parameter of its kind (defaults filled in, durations in seconds,
    ``cause`` split into ``cause`` and ``sub_cause``)."""

    name: str
    kind: str
    severity: str
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def threshold(self) -> float:
        """The value the rule compares with (:data:`THRESHOLD`), in the kind's unit (:data:`UNITS`)."""
        return float(self.params[THRESHOLD[self.kind]])

    @property
    def unit(self) -> str:
        return UNITS[self.kind]

    @property
    def window_seconds(self) -> int | None:
        """The evaluated window's length, seconds (None for ``source_silent``)."""
        return self.params.get("window")


def parse_duration(value: Any) -> int:
    """Seconds from a TOML integer (seconds) or a string ``"90s"``, ``"10m"``, ``"1h"``, ``"7d"``, ``"1h30m"``.

    Raises ValueError for anything else, zero or negative included."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int):
        seconds = value
    elif isinstance(value, str):
        seconds = int(parse_seconds(value, whole_seconds=True))
    else:
        raise ValueError(f"{value!r} is not a duration (seconds, or e.g. \"90s\", \"10m\", \"1h\", \"7d\")")
    if seconds <= 0:
        raise ValueError(f"{value!r}: a duration must be positive")
    return seconds


def _convert(name: str, spec: Param, value: Any) -> Any:
    """``value`` as ``spec`` wants it; ValueError says what was expected."""
    t = spec.type
    if isinstance(t, tuple):
        if value not in t:
            raise ValueError(f"{name} = {value!r}: expected one of {', '.join(t)}")
        return value
    if t in ("duration", "window"):
        seconds = parse_duration(value)
        if t == "window" and seconds % 60:
            raise ValueError(f"{name} = {value!r}: a window is whole minutes (the rollups' grain)")
        return seconds
    if t == "number":
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} = {value!r}: expected a positive number")
        return float(value)
    if t == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} = {value!r}: expected a whole number >= 0")
        return value
    if t == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} = {value!r}: expected true or false")
        return value
    if t == "cause":
        return _cause(name, value)
    if not isinstance(value, str):
        raise ValueError(f"{name} = {value!r}: expected a string")
    return value


def _cause(name: str, value: Any) -> tuple[str, str]:
    cause, _, sub = str(value).partition("/")
    if cause not in a.CAUSES:
        raise ValueError(f"{name} = {value!r}: unknown cause {cause!r}; causes: {', '.join(a.CAUSES)}")
    if sub and sub not in SUB_CAUSES:
        raise ValueError(f"{name} = {value!r}: unknown sub-cause {sub!r}; sub-causes: {', '.join(SUB_CAUSES)}")
    return cause, sub


def _check(kind: str, p: dict[str, Any]) -> None:
    """Rules across parameters; ValueError names them."""
    if p.get("tenant") and p.get("per_tenant"):
        raise ValueError("give tenant (one tenant) or per_tenant = true (each tenant), not both")
    if kind == "hit_rate_drop" and p["source"] == "vllm" and (p["tenant"] or p["per_tenant"]):
        raise ValueError("source = \"vllm\" has no tenants (vLLM's counters carry none): drop tenant/per_tenant")
    if kind == "hit_rate_drop" and p["drop_pp"] > 100:
        raise ValueError(f"drop_pp = {p['drop_pp']:g}: a hit rate falls by at most 100 pp")
    if kind == "cause_share" and p["cause"] == "not_reported":
        raise ValueError("cause = \"not_reported\": those are prompt tokens whose hits are unknown, not missed "
                         "tokens, so they have no share of missed tokens; watch the cached-count coverage "
                         "(data_quality) instead")
    if kind == "cause_share" and p["share_percent"] > 100:
        raise ValueError(f"share_percent = {p['share_percent']:g}: a share is at most 100")
    if kind == "cardinality_jump" and p["factor"] <= 1:
        raise ValueError(f"factor = {p['factor']:g}: a jump is a factor above 1")


def parse_rule(raw: Any) -> Rule:
    """One ``[[rule]]`` table → :class:`Rule`. Raises ValueError saying what is wrong (without the rule's
    name: :func:`parse_rules` adds it)."""
    if not isinstance(raw, dict):
        raise ValueError("a rule is a table ([[rule]] with key = value lines)")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"name = {name!r}: give each rule a name of letters, digits, '_', '.', '-'")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}: expected one of {', '.join(KINDS)}")
    severity = raw.get("severity", "warning")
    if severity not in SEVERITIES:
        raise ValueError(f"severity = {severity!r}: expected one of {', '.join(SEVERITIES)}")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ValueError("description must be a string")
    specs = KINDS[kind]
    unknown = sorted(set(raw) - set(specs) - {"name", "kind", "severity", "description"})
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for kind {kind}; it takes "
                         f"{', '.join(specs)}")
    params: dict[str, Any] = {}
    for pname, spec in specs.items():
        if pname in raw:
            params[pname] = _convert(pname, spec, raw[pname])
        elif spec.default is REQUIRED:
            raise ValueError(f"missing parameter {pname} ({spec.help})")
        else:
            params[pname] = spec.default
    if kind == "cause_share":
        params["cause"], params["sub_cause"] = params["cause"]
    _check(kind, params)
    return Rule(name, kind, severity, params, description)


def parse_rules(text: str, source: str = "<rules>") -> list[Rule]:
    """Rules from TOML ``text``. Raises :class:`AlertRulesError` naming ``source`` and, for a bad rule, its
    name (or its position when it has none)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AlertRulesError(f"{source}: not valid TOML: {exc}") from exc
    extra = sorted(set(doc) - {"rule"})
    if extra:
        raise AlertRulesError(f"{source}: unknown top-level key(s) {', '.join(extra)}; rules are [[rule]] tables")
    raws = doc.get("rule", [])
    if not isinstance(raws, list):
        raise AlertRulesError(f"{source}: write each rule as a [[rule]] table (an array of tables)")
    rules: list[Rule] = []
    for i, raw in enumerate(raws, 1):
        label = f"rule {raw.get('name')!r}" if isinstance(raw, dict) and raw.get("name") else f"rule #{i}"
        try:
            rule = parse_rule(raw)
        except ValueError as exc:
            raise AlertRulesError(f"{source}: {label}: {exc}") from exc
        if any(r.name == rule.name for r in rules):
            raise AlertRulesError(f"{source}: {label}: a second rule with this name (names identify a rule's "
                                  "state)")
        rules.append(rule)
    return rules


#: The rules used when KVSCOPE_ALERT_RULES is '' (docs/alerts.md shows the same text).
BUILTIN_RULES_TOML = """\
[[rule]]
name = "hit_rate_drop"
kind = "hit_rate_drop"
severity = "warning"
description = "The fleet's token-weighted hit rate (gateway log) fell by 10 pp or more, last hour vs the hour before."
window = "1h"
drop_pp = 10

[[rule]]
name = "prefix_drift_share"
kind = "cause_share"
severity = "warning"
description = "Over half of a tenant's missed tokens in the last hour come from a prompt whose front changes."
window = "1h"
cause = "prefix_drift"
share_percent = 50
per_tenant = true
min_missed_tokens = 10000

[[rule]]
name = "routed_away_share"
kind = "cause_share"
severity = "info"
description = "Over half of a tenant's missed tokens in the last hour were cached on another pod."
window = "1h"
cause = "routed_away"
share_percent = 50
per_tenant = true
min_missed_tokens = 10000

[[rule]]
name = "fingerprint_cardinality_jump"
kind = "cardinality_jump"
severity = "warning"
description = "A tenant's distinct prompt fingerprints tripled, last hour vs the hour before."
window = "1h"
factor = 3
min_cardinality = 20

[[rule]]
name = "vllm_scrape_silent"
kind = "source_silent"
severity = "critical"
description = "No /metrics scrape of a pod for 2 minutes."
source = "vllm_scrape"
silent_seconds = "2m"

[[rule]]
name = "gateway_log_silent"
kind = "source_silent"
severity = "warning"
description = "No gateway log line for 15 minutes (also on a fleet without traffic)."
source = "gateway_log"
silent_seconds = "15m"
per_pod = false
"""


def builtin_rules() -> list[Rule]:
    """The built-in rules (:data:`BUILTIN_RULES_TOML`)."""
    return parse_rules(BUILTIN_RULES_TOML, "built-in rules")


def load_rules(path: str | Path | None) -> list[Rule]:
    """The rules of the TOML file at ``path``; the built-in rules when ``path`` is '' or None.

    Raises :class:`AlertRulesError` when the file cannot be read, a rule is wrong, or it holds no rule (an empty
    file would silently turn every alert off)."""
    if not path:
        return builtin_rules()
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AlertRulesError(f"alert rules file {p}: cannot read it: {exc}") from exc
    rules = parse_rules(text, str(p))
    if not rules:
        raise AlertRulesError(f"{p}: no [[rule]] table: the file would evaluate nothing (leave "
                              "KVSCOPE_ALERT_RULES empty for the built-in rules)")
    return rules
