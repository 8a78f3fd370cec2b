"""Alerts: evaluate the rules (:mod:`dashboard.alert_rules`) against the store, keep each rule's state, and send
a notice when a state changes (:mod:`dashboard.alert_delivery`). docs/alerts.md.

Every figure comes from a named query (``store.named``): ``hit_rate_total`` / ``tenant_affinity`` (hit rates),
``miss_causes`` and ``miss_requests`` (causes and their evidence), ``fingerprint_cardinality``, ``freshness``
and ``alert_state`` (the previous states). Windows end at the start of the current minute (the rollups' grain:
a minute still filling would read low) and are compared with the window of the same length before them.

State: each evaluation appends one row per rule to ``alert_state`` (sql/migrations/0015). A notice goes out
only when a rule's state changes (ok → firing: ``firing``; firing → ok: ``resolved``); the previous state is
read from the store, so a restart does not re-send.

Messages are text for people: tenants and pods in them are shown as :func:`dashboard.untrusted.shown` makes
them (one visible line, '' as "(no tenant)" where a tenant is meant); the evidence keeps the values as stored.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl

from dashboard import causes, findings, untrusted
from dashboard.alert_rules import Rule
from ingest.errors import KvscopeError
from ingest.store import Store
from kvscope.durations import human as human_duration

log = logging.getLogger("kvscope.alerts")

FIRING, OK = "firing", "ok"
#: A fingerprint_cardinality bucket this wide (about 136 years, whole hours) holds any window in one bucket.
BUCKET_ALL = 3600 * 1_193_046
SOURCE_WORDS = {"vllm_scrape": "/metrics scrape", "gateway_log": "gateway log line", "kv_events": "KV event",
                "attribution": "attribution answer"}


@dataclass(frozen=True)
class Evaluation:
    """One rule evaluated once.

    ``value`` and the rule's threshold are in the kind's unit (:data:`dashboard.alert_rules.UNITS`); None when
    there was nothing to measure. ``evidence`` is JSON-ready (docs/alerts.md lists its keys). ``since``/``until``
    is the window evaluated (None for ``source_silent``). ``changed_at``, ``notice`` (``firing``, ``resolved``
    or '': what this evaluation sends) and ``previous`` (the rule's prior ``alert_state`` row, or None) are set
    by :func:`transition`.
    """

    rule: Rule
    state: str
    value: float | None
    message: str
    evidence: dict[str, Any]
    evaluated_at: datetime
    since: datetime | None = None
    until: datetime | None = None
    changed_at: datetime | None = None
    notice: str = ""
    previous: dict[str, Any] | None = field(default=None, compare=False)


def iso(t: datetime | None) -> str:
    """``2026-12-01T04:00:00Z`` (UTC, seconds) or '' for None."""
    return "" if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")




def _q(store: Store, name: str, **params: Any) -> pl.DataFrame:
    """A named query with ``datetime`` parameters as ISO 8601 UTC and the rest as strings."""
    return store.named(name, {k: iso_ms(v) if isinstance(v, datetime) else str(v) for k, v in params.items()})


def iso_ms(t: datetime) -> str:
    """``2026-12-01T04:00:00.123Z`` (UTC, milliseconds)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def windows(now: datetime, seconds: int) -> tuple[datetime, datetime, datetime]:
    """``(previous_since, since, until)``: the window ends at the start of ``now``'s minute; the previous one
    has the same length and ends where it starts."""
    until = now.astimezone(UTC).replace(second=0, microsecond=0)
    since = until - timedelta(seconds=seconds)
    return since - timedelta(seconds=seconds), since, until


# -- evidence -----------------------------------------------------------------------------------------------
def _finding_evidence(f: findings.Finding) -> dict[str, Any]:
    out: dict[str, Any] = {"tenant": f.tenant_id, "cause": f.cause, "sub_cause": f.sub_cause,
                           "share_percent": round(100 * f.share_of_tenant_missed, 1), "missed_tokens": f.missed_tokens,
                           "gpu_seconds": f.gpu_seconds, "headline": f.headline, "fix": f.fix, "changed_segment": ""}
    if f.evidence is not None:
        e = f.evidence
        out.update(request_id=e.request_id, request_ts=iso_ms(e.ts), pod=e.pod,
                   predecessor_request_id=e.predecessor_request_id, predecessor_pod=e.predecessor_pod,
                   gap_ms=e.gap_ms, changed_segment=e.changed_segment)
    return out


def cause_evidence(store: Store, since: datetime, until: datetime, tenant: str = "", cause: str = "",
                   sub_cause: str = "") -> dict[str, Any]:
    """What explains a tenant's misses in the window, as JSON-ready facts.

    Without ``cause``: the tenant's first finding of :func:`dashboard.findings.fix_first` (the fix the Overview
    and the digest put first). With ``cause`` (and ``sub_cause``): that cause. Keys: ``cause``, ``sub_cause``,
    ``share_percent`` (of the tenant's missed tokens), ``missed_tokens``, the example request (``request_id``,
    ``request_ts``, ``pod``, ``predecessor_request_id``, ``predecessor_pod``, ``gap_ms``: the largest miss of
    that cause, from ``miss_requests``), ``changed_segment`` (prefix_drift: system, tools, retrieval,
    history or cache_salt), ``gpu_seconds`` (what re-computing the missed tokens cost, None without a prefill
    measurement) and ``fix`` in plain words (:func:`dashboard.causes.fix_for`; '' when no fix removes the cause).
    {} when nothing matches."""
    if not cause:
        top = findings.fix_first(store, since, until, tenant=tenant, limit=1)
        return _finding_evidence(top[0]) if top else {}
    mc = findings.known_misses(_q(store, "miss_causes", since=since, until=until, tenant=tenant))
    match = mc.filter((pl.col("cause") == cause) & (pl.lit(not sub_cause) | (pl.col("sub_cause") == sub_cause)))
    total = int(mc["missed_tokens"].sum()) if not mc.is_empty() else 0
    if match.is_empty() or not total:
        return {}
    gpu = match["gpu_seconds"]
    out: dict[str, Any] = {"cause": cause, "sub_cause": sub_cause, "missed_tokens": int(match["missed_tokens"].sum()),
                           "share_percent": round(100 * int(match["missed_tokens"].sum()) / total, 1),
                           "gpu_seconds": None if gpu.null_count() else float(gpu.sum())}
    ex = _q(store, "miss_requests", since=since, until=until, tenant=tenant, cause=cause, sub_cause=sub_cause,
            limit=1)
    if not ex.is_empty():
        r = ex.row(0, named=True)
        out.update(sub_cause=r["sub_cause"], request_id=r["request_id"], request_ts=iso_ms(r["ts"]), pod=r["pod"],
                   predecessor_request_id=r["predecessor_request_id"], predecessor_pod=r["predecessor_pod"],
                   gap_ms=r["gap_ms"])
    out["changed_segment"] = findings.SEGMENT_OF.get(out["sub_cause"], "") if cause == "prefix_drift" else ""
    fix = causes.fix_for(cause, out["sub_cause"])
    out["fix"] = fix.advice if fix else ""
    return out


def _with_cause(message: str, ev: dict[str, Any]) -> str:
    if not ev.get("cause"):
        return message
    return f"{message}; top cause: {causes.label(ev['cause'], ev['sub_cause'])} ({ev['share_percent']:g} % of missed)"


# -- the four kinds -----------------------------------------------------------------------------------------
Outcome = tuple[str, float | None, str, dict[str, Any]]


def _hit_rates(store: Store, rule: Rule, since: datetime, until: datetime) -> dict[str, tuple[float, float]]:
    """subject → (token-weighted hit rate, known prompt tokens) in the window."""
    p = rule.params
    if p["per_tenant"]:
        df = _q(store, "tenant_affinity", since=since, until=until)
        return {r["tenant_id"]: (r["token_weighted_hit_rate"], r["prompt_tokens"] * (r["cached_tokens_coverage"] or 0))
                for r in df.iter_rows(named=True) if r["token_weighted_hit_rate"] is not None}
    df = _q(store, "hit_rate_total", since=since, until=until, tenant=p["tenant"])
    out = {}
    for r in df.iter_rows(named=True):
        if r["source"] == p["source"] and r["token_weighted_hit_rate"] is not None:
            out[p["tenant"]] = (r["token_weighted_hit_rate"], r["query_tokens"])
    return out


def hit_rate_drop(store: Store, rule: Rule, now: datetime) -> Outcome:
    """Token-weighted hit rate of the last window vs the one before, in percentage points (value = the largest
    drop among subjects with at least ``min_prompt_tokens`` known prompt tokens in both windows)."""
    p, w = rule.params, human_duration(rule.params["window"])
    before_since, since, until = windows(now, p["window"])
    before, current = _hit_rates(store, rule, before_since, since), _hit_rates(store, rule, since, until)
    rows = []
    for subject, (rate, tokens) in current.items():
        if subject in before and min(tokens, before[subject][1]) >= p["min_prompt_tokens"]:
            prev = before[subject][0]
            rows.append({"tenant": subject, "previous_hit_rate": round(prev, 4), "current_hit_rate": round(rate, 4),
                         "drop_pp": round(100 * (prev - rate), 2)})
    rows.sort(key=lambda r: -r["drop_pp"])
    if not rows:
        return OK, None, (f"not enough traffic to compare: fewer than {p['min_prompt_tokens']:,} known prompt "
                          f"tokens in the last {w} or the {w} before"), {}
    firing = [r for r in rows if r["drop_pp"] >= rule.threshold]
    top = (firing or rows)[0]
    fleet = "the fleet (vLLM counters)" if p["source"] == "vllm" else "the fleet"
    who = untrusted.tenant(top["tenant"]) if p["per_tenant"] else (untrusted.shown(top["tenant"]) or fleet)
    if not firing:
        return OK, top["drop_pp"], f"largest drop {top['drop_pp']:.1f} pp ({who}), under {rule.threshold:g} pp", {
            "tenants": rows[:5]}
    evidence = {"tenant": top["tenant"], "tenants": firing[:10],
                **cause_evidence(store, since, until, top["tenant"])}
    message = (f"{who}: token-weighted hit rate fell {top['drop_pp']:.1f} pp ({top['previous_hit_rate']:.1%} → "
               f"{top['current_hit_rate']:.1%}), last {w} vs the {w} before")
    if len(firing) > 1:
        message += f" (and {len(firing) - 1} more tenant(s))"
    return FIRING, top["drop_pp"], _with_cause(message, evidence), evidence


def _shares(per: pl.DataFrame) -> list[dict[str, Any]]:
    return [{"tenant": r["tenant_id"], "share_percent": round(100 * r["matching"] / r["total"], 1),
             "missed_tokens": int(r["matching"]), "tenant_missed_tokens": int(r["total"])}
            for r in per.iter_rows(named=True) if r["total"]]


def cause_share(store: Store, rule: Rule, now: datetime) -> Outcome:
    """A cause's (or cause/sub_cause's) share of missed tokens in the window, percent, per tenant or pooled
    (value = the share of the most affected firing subject, else the largest share). Pooled, the evidence
    names the tenants that contributed most of the cause's missed tokens. Shares and ``min_missed_tokens`` are
    over the missed tokens of requests whose hits are known (``not_reported`` rows left out)."""
    p, w = rule.params, human_duration(rule.params["window"])
    _, since, until = windows(now, p["window"])
    df = findings.known_misses(_q(store, "miss_causes", since=since, until=until, tenant=p["tenant"], by_tenant=1))
    label = causes.label(p["cause"], p["sub_cause"])
    is_match = (pl.col("cause") == p["cause"]) & (pl.lit(not p["sub_cause"]) | (pl.col("sub_cause") == p["sub_cause"]))
    per = df.group_by("tenant_id").agg(pl.col("missed_tokens").sum().alias("total"),
                                       pl.col("missed_tokens").filter(is_match).sum().alias("matching"))
    contributors = sorted((r for r in _shares(per) if r["missed_tokens"]), key=lambda r: -r["missed_tokens"])
    if not p["per_tenant"]:
        per = per.select(pl.lit(p["tenant"]).alias("tenant_id"), pl.col("total").sum(), pl.col("matching").sum())
    rows = [r for r in _shares(per) if r["tenant_missed_tokens"] >= p["min_missed_tokens"]]
    if not rows:
        return OK, None, f"fewer than {p['min_missed_tokens']:,} missed tokens in the last {w}: nothing to judge", {}
    firing = sorted((r for r in rows if r["share_percent"] > rule.threshold), key=lambda r: -r["missed_tokens"])
    if not firing:
        top = max(rows, key=lambda r: r["share_percent"])
        who = untrusted.tenant(top["tenant"]) if p["per_tenant"] else (untrusted.shown(top["tenant"]) or "all tenants")
        return OK, top["share_percent"], (f"{label} is at most {top['share_percent']:g} % of missed tokens ({who}), "
                                          f"under {rule.threshold:g} %"), {}
    top = firing[0]
    tenants = firing if p["per_tenant"] else contributors
    culprit = top["tenant"] or (tenants[0]["tenant"] if tenants else "")
    evidence = {"tenants": tenants[:10], **cause_evidence(store, since, until, culprit, p["cause"], p["sub_cause"]),
                "tenant": culprit}
    share = f"{top['share_percent']:g} %"
    whose = (f"{untrusted.tenant(top['tenant'])}: {share} of its" if p["per_tenant"] or top["tenant"]
             else f"{share} of all")
    message = f"{whose} missed tokens in the last {w} are {label} (threshold {rule.threshold:g} %)"
    if p["per_tenant"] and len(firing) > 1:
        message += "; also " + ", ".join(f"{untrusted.tenant(r['tenant'])} ({r['share_percent']:g} %)"
                                         for r in firing[1:4])
    elif not p["per_tenant"] and tenants:
        message += f"; most from {untrusted.tenant(culprit)} ({tenants[0]['missed_tokens']:,} tokens)"
    return FIRING, top["share_percent"], message, evidence


def cardinality_jump(store: Store, rule: Rule, now: datetime) -> Outcome:
    """A tenant's distinct values of ``segment`` in the window ÷ in the window before (value = the largest
    factor among tenants with at least ``min_cardinality`` values now and at least one before)."""
    p, w = rule.params, human_duration(rule.params["window"])
    before_since, since, until = windows(now, p["window"])
    col = f"{p['segment']}_cardinality"

    def read(a: datetime, b: datetime) -> dict[str, dict[str, Any]]:
        df = _q(store, "fingerprint_cardinality", since=a, until=b, tenant=p["tenant"], bucket_seconds=BUCKET_ALL)
        return {r["tenant_id"]: r for r in df.iter_rows(named=True)}

    before, current = read(before_since, since), read(since, until)
    rows = [{"tenant": t, "previous": before[t][col], "current": r[col],
             "factor": round(r[col] / before[t][col], 2),
             "previous_requests": before[t]["requests"], "current_requests": r["requests"]}
            for t, r in current.items() if r[col] >= p["min_cardinality"] and before.get(t, {}).get(col)]
    if not rows:
        return OK, None, (f"no tenant with {p['min_cardinality']} or more distinct {p['segment']} values in the "
                          f"last {w}"), {}
    rows.sort(key=lambda r: -r["factor"])
    firing = [r for r in rows if r["factor"] >= rule.threshold]
    if not firing:
        top = rows[0]
        return OK, top["factor"], (f"largest growth {top['factor']:g}x ({untrusted.tenant(top['tenant'])}), under "
                                   f"{rule.threshold:g}x"), {}
    top = firing[0]
    segments = {k.removesuffix("_cardinality"): v for k, v in current[top["tenant"]].items()
                if k.endswith("_cardinality")}
    evidence = {"tenant": top["tenant"], "tenants": firing[:10], "segment": p["segment"], "segments": segments,
                **cause_evidence(store, since, until, top["tenant"])}
    message = (f"{untrusted.tenant(top['tenant'])}: distinct {p['segment']} values grew {top['factor']:g}x "
               f"({top['previous']} → {top['current']}; requests {top['previous_requests']} → "
               f"{top['current_requests']}), last {w} vs the {w} before")
    return FIRING, top["factor"], _with_cause(message, evidence), evidence


#: How far ahead of the store's clock a source's row may be stamped and still count as heard from (clock skew).
CLOCK_SKEW_SECONDS = 300.0


def source_silent(store: Store, rule: Rule, now: datetime) -> Outcome:
    """Seconds since each pod's (or the source's) latest row, from the named query ``freshness`` (value = the
    oldest). A pod silent for longer than ``lookback`` has no row and is no longer watched. Rows stamped more
    than :data:`CLOCK_SKEW_SECONDS` after ``now`` are not signs of life (one line dated next year would
    otherwise keep the source "fresh" for a year)."""
    p = rule.params
    what = SOURCE_WORDS[p["source"]]
    df = _q(store, "freshness", since=now - timedelta(seconds=p["lookback"]),
            until=now + timedelta(seconds=CLOCK_SKEW_SECONDS), pod=p["pod"])
    df = df.filter(pl.col("source") == p["source"])
    if df.is_empty():
        return OK, None, f"no {what} in the last {human_duration(p['lookback'])}: nothing to watch", {}
    if not p["per_pod"]:
        df = df.select(pl.lit("").alias("pod"), pl.col("last_ts").max())
    rows = sorted(({"pod": r["pod"], "last_ts": iso_ms(r["last_ts"]),
                    "age_seconds": round((now - r["last_ts"]).total_seconds(), 1)} for r in df.iter_rows(named=True)),
                  key=lambda r: -r["age_seconds"])
    top = rows[0]
    silent = [r for r in rows if r["age_seconds"] > rule.threshold]
    if not silent:
        who = f" (oldest: {untrusted.shown(top['pod'])})" if top["pod"] else ""
        return OK, top["age_seconds"], (f"latest {what} {top['age_seconds']:.0f} s ago{who}, within "
                                        f"{rule.threshold:g} s"), {}
    pods = ", ".join(untrusted.shown(r["pod"]) for r in silent if r["pod"])
    where = f" from {pods}" if pods else ""
    message = (f"no {what}{where} for {human_duration(top['age_seconds'])} (last {top['last_ts']}; limit "
               f"{rule.threshold:g} s)")
    return FIRING, top["age_seconds"], message, {"pod": top["pod"], "pods": silent, "source": p["source"]}


EVALUATORS: dict[str, Callable[[Store, Rule, datetime], Outcome]] = {
    "hit_rate_drop": hit_rate_drop, "cause_share": cause_share, "cardinality_jump": cardinality_jump,
    "source_silent": source_silent,
}


def evaluate_rule(store: Store, rule: Rule, now: datetime) -> Evaluation:
    """Evaluate ``rule`` at ``now`` (timezone-aware). Raises what the named queries raise (KvscopeError)."""
    state, value, message, evidence = EVALUATORS[rule.kind](store, rule, now)
    since = until = None
    if rule.window_seconds:
        _, since, until = windows(now, rule.window_seconds)
    return Evaluation(rule, state, value, message, evidence, now, since, until)


# -- state ----------------------------------------------------------------------------------------------------
def current_states(store: Store) -> dict[str, dict[str, Any]]:
    """rule name → its latest ``alert_state`` row (named query ``alert_state``)."""
    return {r["rule"]: r for r in store.named("alert_state").iter_rows(named=True)}


def transition(ev: Evaluation, previous: dict[str, Any] | None) -> Evaluation:
    """``ev`` with ``changed_at`` (kept while the state holds) and ``notice``: ``firing`` when it fires and did
    not before (also on its first evaluation), ``resolved`` when it stops firing, else ''."""
    before = previous["state"] if previous else None
    if before == ev.state:
        return replace(ev, changed_at=previous["changed_at"], previous=previous)  # type: ignore[index]
    notice = "firing" if ev.state == FIRING else ("resolved" if before == FIRING else "")
    return replace(ev, changed_at=ev.evaluated_at, notice=notice, previous=previous)


COLUMNS = ["rule", "kind", "severity", "state", "value", "threshold", "message", "evidence", "evaluated_at",
           "changed_at"]


def record(store: Store, evaluations: Sequence[Evaluation]) -> None:
    """Append one ``alert_state`` row per evaluation (one INSERT)."""
    store.insert("alert_state", [
        (e.rule.name, e.rule.kind, e.rule.severity, e.state, e.value, e.rule.threshold, e.message,
         json.dumps(e.evidence, default=str, sort_keys=True), e.evaluated_at, e.changed_at) for e in evaluations
    ], COLUMNS)


def run_once(store: Store, rules: Sequence[Rule], notifier: Any = None,
             now: datetime | None = None) -> list[Evaluation]:
    """Evaluate every rule at ``now`` (default: the wall clock), record the states, send the notices of the
    rules whose state changed through ``notifier`` (:class:`dashboard.alert_delivery.Notifier`; None = none).

    A rule whose queries fail is logged and left out (its previous state stands). Returns the evaluations.
    Raises :class:`~ingest.errors.KvscopeError` when the previous states cannot be read or the new ones
    cannot be written.
    """
    now = now or datetime.now(UTC)
    previous = current_states(store)
    out = []
    for rule in rules:
        try:
            ev = evaluate_rule(store, rule, now)
        except KvscopeError as exc:
            log.warning("alert rule not evaluated. rule=%s error=%s", rule.name, exc)
            continue
        out.append(transition(ev, previous.get(rule.name)))
    record(store, out)
    if notifier is not None:
        notifier.notify([e for e in out if e.notice])
    return out


def alert_loop(store: Store, rules: Sequence[Rule], notifier: Any, stop: threading.Event, every_seconds: float,
               first_delay: float = 0.0) -> None:
    """Run :func:`run_once` every ``every_seconds`` until ``stop`` is set, the first after ``first_delay``
    seconds (``kvscope up`` waits one interval, so a restart's first scrapes land before silence is judged).
    An evaluation that fails is logged; the loop goes on."""
    if stop.wait(first_delay):
        return
    while True:
        try:
            evs = run_once(store, rules, notifier)
            log.info("alerts evaluated. rules=%d firing=%d", len(evs), sum(e.state == FIRING for e in evs))
        except Exception:  # noqa: BLE001  (never let one bad evaluation end the schedule)
            log.exception("alert evaluation failed")
        if stop.wait(every_seconds):
            return
