"""What to fix first: the actionable miss causes ranked by what they cost, each with evidence and a fix.

Read by the Overview's "fix first", the digest and the alerts, so the three say the same thing. Everything comes
from named queries (``miss_causes`` per tenant for the amounts, ``miss_examples`` for every finding's example
request in one read: the one ``miss_requests`` lists first), so the figures equal what ``kvscope query`` returns
for the same window.

Ranking (docs/fix-first.md): findings are the (tenant, cause, sub-cause) rows whose cause has a fix
(:data:`dashboard.causes.FIXES`), with at least :data:`MIN_SHARE` of all missed tokens; they are ordered by
GPU-seconds (missed tokens when a window has no prefill-time measurement), except that within one tenant a
prompt-assembly fix that explains at least :data:`MIN_TENANT_SHARE` of the tenant's misses comes before its
routing or TTL fixes: routing by prefix only pays once the prefix is stable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import polars as pl

from dashboard import causes, untrusted
from dashboard.untrusted import shown
from kvscope.durations import human

#: A finding must explain at least this share of all missed tokens in the window (smaller ones are noise).
MIN_SHARE = 0.01
#: A tenant's prompt-assembly finding moves ahead of its routing/TTL ones when it explains this share of its misses.
MIN_TENANT_SHARE = 0.10


#: prefix_drift sub-cause → the prompt segment that changed (docs/miss-causes.md, "Miss causes").
SEGMENT_OF = {"volatile_system": "system", "system_changed": "system", "tools_reordered": "tools",
              "tools_changed": "tools", "rag_reordered": "retrieval", "rag_changed": "retrieval",
              "history_truncated": "history", "history_changed": "history",
              "cache_salt_changed": "cache_salt"}
SEGMENT_WORDS = {"system": "system prompt", "tools": "tool schemas", "retrieval": "retrieved documents",
                 "history": "conversation history", "cache_salt": "cache salt"}


def gpu_seconds_text(x: float) -> str:
    """GPU-seconds with sensible precision: "1,234", "12.3", "0.062"."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def cost_text(gpu_seconds: float | None, money: float | None = None, currency: str = "") -> str:
    """What missed tokens cost, for beside their count: "0.062 GPU-s", "340 GPU-s · 0.19 USD" (money when given),
    "–" when no pod measured its prefill time."""
    if gpu_seconds is None:
        return "–"
    out = f"{gpu_seconds_text(gpu_seconds)} GPU-s"
    return out + (f" · {money:,.2f} {currency}" if money is not None else "")


def money(gpu_seconds: float | None, gpu_hour_price: float) -> float | None:
    """What ``gpu_seconds`` cost at ``gpu_hour_price`` per GPU-hour: gpu_seconds / 3600 × price; None when the
    price is not set (≤ 0) or the GPU-seconds are unknown."""
    return gpu_seconds / 3600 * gpu_hour_price if gpu_seconds is not None and gpu_hour_price > 0 else None


def with_cost_column(df: pl.DataFrame, gpu_hour_price: float, currency: str) -> pl.DataFrame:
    """``df`` for a table: with a ``cost (<currency>)`` column (:func:`with_money`) right after ``gpu_seconds``
    when ``gpu_hour_price`` > 0, else unchanged (no money without a configured price)."""
    if gpu_hour_price <= 0:
        return df
    name = f"cost ({currency})"
    out = with_money(df.drop("money", strict=False), gpu_hour_price).rename({"money": name})
    cols = [c for c in df.columns if c != "money"]
    at = cols.index("gpu_seconds") + 1
    return out.select([*cols[:at], name, *cols[at:]])


#: The cause that carries the prompt tokens of requests whose cached count is unknown (docs/miss-causes.md, "When
#: the cached count is not reported"): unknown, never missed, never recoverable, no cost.
NOT_REPORTED = "not_reported"


def known_misses(df: pl.DataFrame) -> pl.DataFrame:
    """The rows of a named query ``miss_causes`` result (any frame with a ``cause`` column) whose tokens are missed
    tokens: every cause but ``not_reported``, whose rows hold prompt tokens whose hits are unknown. Same columns."""
    return df if df.is_empty() else df.filter(pl.col("cause") != NOT_REPORTED)


def unknown_tokens(df: pl.DataFrame, tenant: str | None = None) -> int:
    """Prompt tokens whose hits are unknown (the cached count was not reported) in a ``miss_causes`` result,
    tokens: the ``missed_tokens`` of its ``not_reported`` rows (of ``tenant`` only when given; 0 when none)."""
    if df.is_empty():
        return 0
    rows = df.filter(pl.col("cause") == NOT_REPORTED)
    if tenant is not None:
        rows = rows.filter(pl.col("tenant_id") == tenant)
    return int(rows["missed_tokens"].sum())


def with_money(df: pl.DataFrame, gpu_hour_price: float) -> pl.DataFrame:
    """``df`` (with a ``gpu_seconds`` column, e.g. named query ``miss_causes``) plus ``money`` = gpu_seconds / 3600
    × ``gpu_hour_price`` (None when the price is 0 or the GPU-seconds are unknown)."""
    if gpu_hour_price > 0:
        return df.with_columns((pl.col("gpu_seconds").cast(pl.Float64) / 3600 * gpu_hour_price).alias("money"))
    return df.with_columns(pl.lit(None, pl.Float64).alias("money"))


@dataclass(frozen=True)
class Evidence:
    """The largest miss of a finding's kind in the window: the request, where it ran, what it should have reused.

    ``gap_ms``: time from the predecessor to this request, ms (None without a predecessor); ``changed_segment``:
    the first prompt segment that changed (``system``, ``tools``, ``retrieval`` or ``history``, from the
    prefix_drift sub-cause), '' for other causes.
    """

    request_id: str
    ts: datetime
    pod: str
    predecessor_request_id: str
    predecessor_pod: str
    gap_ms: float | None
    changed_segment: str
    missed_tokens: int

    def text(self) -> str:
        """One sentence: "request r-9 on pod-b missed 768 tokens; its predecessor r-8 ran on pod-a 2.1 s before"
        (ids and pods as :func:`dashboard.untrusted.shown` shows them: one visible line)."""
        out = (f"request {shown(self.request_id)} on {shown(self.pod, empty='an unknown pod')} missed "
               f"{self.missed_tokens:,} tokens")
        if self.changed_segment:
            out += f" from its {SEGMENT_WORDS.get(self.changed_segment, self.changed_segment)} on"
        if self.predecessor_request_id:
            out += (f"; its predecessor {shown(self.predecessor_request_id)} ran on "
                    f"{shown(self.predecessor_pod, empty='an unknown pod')}")
            if self.gap_ms is not None:
                out += f" {human(self.gap_ms / 1000)} before"
        return out


@dataclass(frozen=True)
class Finding:
    """One (tenant, cause, sub_cause) worth fixing, with its cost and the fix in plain words.

    Token counts in tokens; ``gpu_seconds`` in GPU-seconds (None when no pod measured its prefill time in the
    window); ``money`` = gpu_seconds / 3600 × the GPU-hour price (None when no price is set);
    ``share_of_tenant_missed`` / ``share_of_missed``: fractions 0..1 of the tenant's / all missed tokens.
    """

    tenant_id: str
    cause: str
    sub_cause: str
    missed_tokens: int
    requests: int
    gpu_seconds: float | None
    money: float | None
    share_of_tenant_missed: float
    share_of_missed: float
    stage: int
    fix: str
    evidence: Evidence | None = None

    @property
    def label(self) -> str:
        return causes.label(self.cause, self.sub_cause)

    @property
    def headline(self) -> str:
        """E.g. "globex: 94 % of its missed tokens are prefix_drift / volatile_system (768 tokens, 0.06 GPU-s)"
        (the tenant as :func:`dashboard.untrusted.tenant` shows it; '' is the traffic without a tenant)."""
        cost = f", {gpu_seconds_text(self.gpu_seconds)} GPU-s" if self.gpu_seconds is not None else ""
        return (f"{untrusted.tenant(self.tenant_id)}: {self.share_of_tenant_missed * 100:.0f} % of its missed tokens "
                f"are {self.label} ({self.missed_tokens:,} tokens{cost})")

    def url(self, base_url: str, since: datetime, until: datetime) -> str:
        """The drill-down on the dashboard's Miss causes page for this finding's tenant, cause and window ('' when
        no ``base_url``: the dashboard's address as readers reach it, KVSCOPE_DASHBOARD_URL)."""
        if not base_url:
            return ""
        params = {"from": _iso(since), "to": _iso(until), "tenant": self.tenant_id, "cause": self.cause}
        if self.sub_cause:
            params["sub_cause"] = self.sub_cause
        if self.evidence:
            params["request_id"] = self.evidence.request_id
            params["ts"] = ts_param(self.evidence.ts)  # ids can repeat across runs: the request is (id, ts)
        return f"{base_url.rstrip('/')}/miss_causes?{urlencode(params)}"


#: "Does cache work pay?" thresholds (docs/fix-first.md).
LONG_PREFIX_TOKENS = 512
MIN_REUSE_SHARE = 0.2
MIN_RECOVERABLE_SHARE = 0.05
TTFT_COMPLAINT_MS = 1000.0


@dataclass(frozen=True)
class Worth:
    """Whether prefix-cache work pays for one tenant's workload, and why, in plain words.

    ``recoverable_tokens``: its missed tokens of causes with a fix (tokens); ``recoverable_share``: of its prompt
    tokens (fraction 0..1); ``reasons``: the traits behind the verdict (long repeated prefixes, TTFT, ...).
    """

    tenant_id: str
    pays: bool
    recoverable_tokens: int
    recoverable_share: float
    reasons: tuple[str, ...]

    def text(self) -> str:
        verdict = "cache work pays" if self.pays else "little to gain from cache work"
        return f"{self.tenant_id}: {verdict}: " + "; ".join(self.reasons)


def worth_it(store: Any, since: datetime, until: datetime, *, tenant: str = "", pod: str = "",
             model: str = "") -> list[Worth]:
    """Per tenant (largest prompt volume first): does fixing its misses pay? Reads the named queries
    ``tenant_profile`` and ``miss_causes``; the rule is in docs/fix-first.md ("Does cache work pay?"). The
    recoverable share is over the tenant's prompt tokens whose hits are known: a request whose cached count was
    not reported (cause ``not_reported``) is neither recoverable nor in the denominator."""
    profile = store.named("tenant_profile", _params(since, until, tenant, pod, model=model))
    raw = store.named("miss_causes", _params(since, until, tenant, pod, model=model, by_tenant=1))
    missed = _decorate(known_misses(raw), 0.0)
    recoverable: dict[str, int] = {}
    for r in missed.filter(pl.col("actionable")).iter_rows(named=True) if not missed.is_empty() else []:
        recoverable[r["tenant_id"]] = recoverable.get(r["tenant_id"], 0) + int(r["missed_tokens"])
    out = []
    for p in profile.iter_rows(named=True):
        tokens = recoverable.get(p["tenant_id"], 0)
        known = max(int(p["prompt_tokens"]) - unknown_tokens(raw, p["tenant_id"]), 0)
        share = tokens / known if known else 0.0
        out.append(_verdict(p, tokens, share))
    return out


def _verdict(p: dict[str, Any], tokens: int, share: float) -> Worth:
    prefix, reuse, ttft = p["mean_prefix_tokens"], p["reuse_share"], p["ttft_p95_ms"]
    reasons = []
    repeated = reuse >= MIN_REUSE_SHARE
    if repeated:
        size = "long " if prefix >= LONG_PREFIX_TOKENS else ""
        reasons.append(f"{size}repeated prefixes: {prefix:,.0f} stable tokens per request, and {reuse * 100:.0f} % "
                       "of requests could reuse an earlier request's prefix")
    else:
        reasons.append(f"prompts rarely share a prefix: {reuse * 100:.0f} % of requests follow one that shares it")
    if share >= MIN_RECOVERABLE_SHARE:
        reasons.append(f"{share * 100:.0f} % of its prompt tokens ({tokens:,}) were missed for causes with a fix")
    else:
        reasons.append(f"only {share * 100:.1f} % of its prompt tokens were missed for causes with a fix")
    if ttft is not None and ttft >= TTFT_COMPLAINT_MS:
        reasons.append(f"TTFT p95 is {ttft:,.0f} ms: users wait for prefill")
    return Worth(tenant_id=p["tenant_id"], pays=repeated and share >= MIN_RECOVERABLE_SHARE,
                 recoverable_tokens=tokens, recoverable_share=share, reasons=tuple(reasons))


def where_missed(store: Any, since: datetime, until: datetime, *, tenant: str = "", pod: str = "", model: str = "",
                 gpu_hour_price: float = 0.0) -> pl.DataFrame:
    """Missed tokens by cause for the window: named query ``miss_causes`` plus ``label``, ``money`` (None without
    a price) and ``actionable``; columns as ``miss_causes`` documents them, largest first, the ``not_reported`` row
    (prompt tokens whose hits are unknown, not missed: :func:`known_misses` leaves it out) last."""
    df = store.named("miss_causes", _params(since, until, tenant, pod, model=model, by_tenant=0))
    return _decorate(df, gpu_hour_price)


def fix_first(store: Any, since: datetime, until: datetime, *, tenant: str = "", pod: str = "", model: str = "",
              limit: int = 3, per_tenant: bool = False, gpu_hour_price: float = 0.0) -> list[Finding]:
    """The top ``limit`` findings of the window ``[since, until)`` (UTC), ranked as the module docstring says,
    each with the largest matching miss as evidence. ``per_tenant``: at most one finding per tenant (its
    dominant one). Shares are of the missed tokens of requests whose hits are known (``not_reported`` left out).
    Raises what :meth:`ingest.store.Store.named` raises (``QueryError``, ``StoreUnavailable``)."""
    df = _decorate(known_misses(store.named("miss_causes", _params(since, until, tenant, pod, model=model,
                                                                   by_tenant=1))), gpu_hour_price)
    if df.is_empty():
        return []
    total = float(df["missed_tokens"].sum())
    if not total:
        return []
    tenant_total = {t: float(v) for t, v in df.group_by("tenant_id").agg(pl.col("missed_tokens").sum()).iter_rows()}
    candidates = []
    for r in df.filter(pl.col("actionable")).iter_rows(named=True):
        fix = causes.fix_for(r["cause"], r["sub_cause"])
        assert fix is not None  # actionable
        share = r["missed_tokens"] / total
        if share < MIN_SHARE:
            continue
        candidates.append(Finding(
            tenant_id=r["tenant_id"], cause=r["cause"], sub_cause=r["sub_cause"],
            missed_tokens=int(r["missed_tokens"]), requests=int(r["requests"]), gpu_seconds=r["gpu_seconds"],
            money=r["money"], share_of_tenant_missed=r["missed_tokens"] / tenant_total[r["tenant_id"]],
            share_of_missed=share, stage=fix.stage, fix=fix.advice))
    ranked = _rank(candidates)
    if per_tenant:
        ranked = [f for i, f in enumerate(ranked) if all(g.tenant_id != f.tenant_id for g in ranked[:i])]
    ranked = ranked[:limit]
    if not ranked:
        return []
    examples = {(r["tenant_id"], r["cause"], r["sub_cause"]): r for r in store.named(
        "miss_examples", _params(since, until, tenant, pod, model=model)).iter_rows(named=True)}
    return [_with_evidence(f, examples.get((f.tenant_id, f.cause, f.sub_cause))) for f in ranked]


def _rank(candidates: list[Finding]) -> list[Finding]:
    """By cost, then a tenant's prompt-assembly fix (≥ MIN_TENANT_SHARE of its misses) before its later stages."""
    use_cost = bool(candidates) and all(f.gpu_seconds is not None for f in candidates)
    pending = sorted(candidates, key=lambda f: (-(f.gpu_seconds if use_cost else f.missed_tokens),  # type: ignore[operator]
                                                f.tenant_id, f.cause, f.sub_cause))
    out: list[Finding] = []
    while pending:
        f = pending[0]
        earlier = [g for g in pending if g.tenant_id == f.tenant_id and g.stage < f.stage
                   and g.share_of_tenant_missed >= MIN_TENANT_SHARE]
        pick = min(earlier, key=lambda g: g.stage) if earlier else f
        out.append(pick)
        pending.remove(pick)
    return out


def _with_evidence(f: Finding, r: dict[str, Any] | None) -> Finding:
    """``f`` with its evidence: ``r``, the row of named query ``miss_examples`` for its (tenant, cause, sub_cause),
    the request ``miss_requests`` lists first for them (None: no example, ``f`` as it is)."""
    if r is None:
        return f
    ev = Evidence(request_id=r["request_id"], ts=r["ts"], pod=r["pod"],
                  predecessor_request_id=r["predecessor_request_id"], predecessor_pod=r["predecessor_pod"],
                  gap_ms=r["gap_ms"],
                  changed_segment=SEGMENT_OF.get(f.sub_cause, "") if f.cause == "prefix_drift" else "",
                  missed_tokens=int(r["missed_tokens"]))
    return replace(f, evidence=ev)


def _decorate(df: pl.DataFrame, gpu_hour_price: float) -> pl.DataFrame:
    if df.is_empty():
        return df.with_columns(pl.lit(None, pl.Float64).alias("money"), pl.lit("").alias("label"),
                               pl.lit(False).alias("actionable"))
    return with_money(df, gpu_hour_price).with_columns(
        pl.struct("cause", "sub_cause").map_elements(lambda s: causes.label(s["cause"], s["sub_cause"]),
                                                     return_dtype=pl.String).alias("label"),
        pl.struct("cause", "sub_cause").map_elements(lambda s: causes.actionable(s["cause"], s["sub_cause"]),
                                                     return_dtype=pl.Boolean).alias("actionable"),
    )


def _params(since: datetime, until: datetime, tenant: str, pod: str, **extra: Any) -> dict[str, str]:
    return {"since": _ch(since), "until": _ch(until), "tenant": tenant, "pod": pod,
            **{k: str(v) for k, v in extra.items()}}


def _ch(t: datetime) -> str:
    """A ClickHouse DateTime64(3) literal in UTC."""
    return _utc(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def ts_param(t: datetime) -> str:
    """A request's arrival as a URL parameter (``ts``, with ``request_id``: ids can repeat across runs):
    ``2026-12-01T04:00:00.123Z`` (UTC, milliseconds)."""
    t = _utc(t)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def parse_ts_param(text: str | None) -> datetime | None:
    """A URL's ``ts`` (:func:`ts_param`; any ISO 8601 time, naive = UTC) → aware UTC datetime; None when missing or
    unreadable (the request is then found by its id alone)."""
    try:
        return _utc(datetime.fromisoformat(text.replace("Z", "+00:00"))) if text else None
    except (TypeError, ValueError):
        return None


def _iso(t: datetime) -> str:
    return _utc(t).strftime("%Y-%m-%dT%H:%M:%SZ")


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


