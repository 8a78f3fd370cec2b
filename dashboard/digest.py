"""The miss-cause digest: what the prefix cache saved and lost over a period, against the period before it.

:func:`gather` reads everything from named queries (``sql/queries``) and :mod:`dashboard.findings`, so every
figure equals what ``kvscope query`` returns for the same window; :mod:`dashboard.digest_render` turns the
:class:`Digest` into an email. Sections and their rules are in docs/digest.md; definitions (token-weighted hit
rate, missed tokens, cause / sub_cause, GPU-seconds) in docs/miss-causes.md. The store holds no prompt text,
and nothing here adds any: tenants, pods, request ids, hashes' counts and token counts only.

Windows are ``[since, until)`` in UTC; the named queries read per-minute rollups, so a window resolves to whole
minutes (the default period ends on the last whole minute).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import polars as pl

from dashboard import causes, findings
from ingest import attribution
from kvscope.durations import parse_seconds

DEFAULT_PERIOD = timedelta(hours=24)
#: Tenants listed under "the tenants losing most".
TOP_TENANTS = 5
#: A pod's cache affinity "fell" when it dropped by at least this many percentage points.
AFFINITY_DROP_PP = 5.0
#: A segment's fingerprint cardinality "jumped" when its distinct raw hashes per request at least doubled and it
#: has at least this many more distinct raw hashes than in the previous period.
CARDINALITY_MIN_NEW = 3
CARDINALITY_FACTOR = 2.0
#: The share of next turns the TTL recommendation keeps warm (turn_gaps.gap_p90_ms).
TTL_WARM_SHARE = 0.9
#: Fingerprint segments: name → (raw hash cardinality column, normalized column) of fingerprint_cardinality.
SEGMENTS = {
    "system prompt": ("system_hash_cardinality", "system_norm_hash_cardinality"),
    "tool schemas": ("tools_hash_cardinality", "tools_canonical_hash_cardinality"),
    "retrieval pack": ("retrieval_pack_hash_cardinality", "retrieval_set_hash_cardinality"),
}
#: A bucket wider than any window (whole hours, so the hour rollups serve it): one row per tenant per query.
WHOLE_WINDOW = 3600 * 1_111_112
#: Bucket widths the hit-rate chart may use (whole minutes; whole hours from an hour up).
NICE_BUCKETS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400, 172800, 604800)
CHART_POINTS = 48
#: The longest period (a century: the period and the one before it stay within the store's years).
MAX_DURATION = timedelta(days=36500)


# -- the digest's parts -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HitRate:
    """Token-weighted hit rate of one ``source`` (``vllm`` counters or the ``gateway`` log, as hit_rate_total).

    ``rate`` / ``previous``: fractions 0..1 (None when the period has no data of that source);
    ``hit_tokens`` / ``query_tokens``: tokens; ``coverage``: the gateway's cached-count coverage (None for vllm).
    """

    source: str
    rate: float | None
    previous: float | None
    hit_tokens: int
    query_tokens: int
    coverage: float | None = None

    @property
    def change_pp(self) -> float | None:
        """(rate − previous) × 100, percentage points; None when either is unknown."""
        if self.rate is None or self.previous is None:
            return None
        return (self.rate - self.previous) * 100


@dataclass(frozen=True)
class CauseLine:
    """Missed tokens of one (cause, sub_cause) in the period (named query ``miss_causes``, tenants pooled).

    ``gpu_seconds``: GPU-seconds (None without a prefill-time measurement); ``money`` in the digest's currency
    (None without a price); ``share_of_missed``: fraction 0..1; ``previous_missed_tokens``: the period before.
    """

    cause: str
    sub_cause: str
    missed_tokens: int
    share_of_missed: float
    requests: int
    gpu_seconds: float | None
    money: float | None
    previous_missed_tokens: int = 0

    @property
    def label(self) -> str:
        return causes.label(self.cause, self.sub_cause)

    @property
    def color(self) -> str:
        return causes.color(self.cause, self.sub_cause)


@dataclass(frozen=True)
class TenantLoss:
    """One of the tenants losing most: its missed tokens (all causes), their cost, and its dominant actionable
    finding (:func:`dashboard.findings.fix_first` for the tenant; None when none of its misses has a fix)."""

    tenant_id: str
    missed_tokens: int
    gpu_seconds: float | None
    money: float | None
    previous_missed_tokens: int
    finding: findings.Finding | None
    link: str = ""
    #: whether cache work pays for this tenant's workload, and why (:func:`dashboard.findings.worth_it`)
    worth: findings.Worth | None = None


@dataclass(frozen=True)
class DriftEvent:
    """A prefix_drift sub-cause a tenant had in the period and not in the period before (tokens, requests), with
    what its missed tokens cost: ``gpu_seconds`` (None without a prefill measurement), ``money`` (None without a
    price)."""

    tenant_id: str
    sub_cause: str
    missed_tokens: int
    requests: int
    link: str = ""
    gpu_seconds: float | None = None
    money: float | None = None


@dataclass(frozen=True)
class CardinalityJump:
    """A tenant's segment whose distinct raw hashes jumped (see :data:`CARDINALITY_FACTOR`): ``raw`` /
    ``previous_raw`` distinct raw hashes, ``normalized`` distinct normalized ones now, requests in each period."""

    tenant_id: str
    segment: str
    raw: int
    previous_raw: int
    normalized: int
    requests: int
    previous_requests: int
    link: str = ""


@dataclass(frozen=True)
class AffinityDrop:
    """A pod whose cache affinity fell: share (0..1) of the prompt tokens of requests it served that have a
    prefix-sharing predecessor, served where that predecessor ran (named query ``pod_affinity``)."""

    pod: str
    affinity: float
    previous: float
    predecessor_tokens: int
    link: str = ""

    @property
    def change_pp(self) -> float:
        return (self.affinity - self.previous) * 100


@dataclass(frozen=True)
class TtlAdvice:
    """The hold-time recommendation from named query ``turn_gaps`` (pods pooled): gaps in ms between a turn and
    its next turn on the same pod; ``hold_ms`` keeps :data:`TTL_WARM_SHARE` of next turns warm;
    ``evicted_gpu_seconds`` / ``evicted_money``: what re-computing the evicted tokens cost (None when unknown /
    no price), from ``miss_causes``' evicted / evicted_before_next_turn row."""

    next_turns: int
    gap_p50_ms: float
    hold_ms: float
    gap_max_ms: float
    evicted_before_next_turn: int
    evicted_missed_tokens: int
    evicted_gap_p50_ms: float | None
    evicted_gpu_seconds: float | None = None
    evicted_money: float | None = None


@dataclass(frozen=True)
class DataQualityWarning:
    """A pod whose two hit-rate sources disagree (named query ``data_quality``, likely_cause ≠ agree)."""

    pod: str
    likely_cause: str
    gap_pp: float | None
    evidence: str


@dataclass(frozen=True)
class Digest:
    """Everything the digest email says, for ``[since, until)`` against ``[previous_since, since)`` (UTC).

    ``hit_rates``: per source (vllm first when present); ``series`` / ``previous_series``: the headline source's
    hit rate per bucket as ``(seconds from the period's start, rate 0..1)``; money in ``currency``.
    ``missed_tokens`` and ``causes`` are over the requests whose hits are known; ``unknown_tokens``: prompt tokens
    of the requests whose cached count was not reported (cause ``not_reported``), tokens, shown apart, never as
    missed and with no cost.
    """

    since: datetime
    until: datetime
    previous_since: datetime
    hit_rates: tuple[HitRate, ...]
    causes: tuple[CauseLine, ...]
    missed_tokens: int
    previous_missed_tokens: int
    gpu_seconds: float | None
    money: float | None
    currency: str
    tenants: tuple[TenantLoss, ...]
    drift: tuple[DriftEvent, ...]
    cardinality: tuple[CardinalityJump, ...]
    affinity: tuple[AffinityDrop, ...]
    ttl: TtlAdvice | None
    data_quality: tuple[DataQualityWarning, ...]
    series: tuple[tuple[float, float], ...] = ()
    previous_series: tuple[tuple[float, float], ...] = ()
    bucket_seconds: int = 3600
    dashboard_url: str = ""
    links: dict[str, str] = field(default_factory=dict)
    unknown_tokens: int = 0

    @property
    def length(self) -> timedelta:
        return self.until - self.since

    @property
    def headline(self) -> HitRate | None:
        """The hit rate the subject quotes: vLLM's counters when present, else the gateway's; None without data."""
        return next((h for h in self.hit_rates if h.rate is not None), None)


# -- periods ----------------------------------------------------------------------------------------------------
def parse_duration(text: str) -> timedelta:
    """``"24h"``, ``"7d"``, ``"30m"``, ``"1w"``, ``"90s"``, ``"1.5h"``, ``"1h30m"`` (kvscope.durations) → timedelta.

    Raises ValueError for anything else, a zero length or one over :data:`MAX_DURATION`.
    """
    seconds = parse_seconds(text)
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError(f"{text!r}: the duration must be at most {MAX_DURATION.days} days")
    return timedelta(seconds=seconds)


def period(length: timedelta = DEFAULT_PERIOD, *, since: datetime | None = None, until: datetime | None = None,
           now: datetime | None = None) -> tuple[datetime, datetime]:
    """The digest's window ``(since, until)`` in UTC, both on whole minutes: ``until`` defaults to ``now``,
    ``since`` to ``until − length``; given both, they win over ``length``. Naive times are taken as UTC.

    Both bounds are cut down to the start of their minute (``10:00:30`` → ``10:00``), the same direction for both:
    the rollups hold whole minutes, so a bound inside a minute would count that minute in this period and in the
    adjacent one. Cut so, consecutive periods (one's ``until`` the next one's ``since``) never share a minute.

    Raises ValueError when ``since`` is not before ``until`` once cut (both inside the same minute included), or
    when the period or the one before it reaches outside the years a datetime holds (1..9999).
    """
    try:
        if until is None:
            until = _utc(since) + length if since is not None else _utc(now or datetime.now(UTC))
        until = whole_minute(_utc(until))
        since = whole_minute(_utc(since) if since is not None else until - length)
        since - (until - since)  # the previous period must exist too  # noqa: B018
    except OverflowError as exc:
        raise ValueError("the period or the one before it falls outside the years 1 to 9999") from exc
    if since >= until:
        raise ValueError(f"the period must start before it ends, in whole minutes (since {since:%Y-%m-%dT%H:%MZ}, "
                         f"until {until:%Y-%m-%dT%H:%MZ})")
    return since, until


def whole_minute(t: datetime) -> datetime:
    """``t`` cut down to the start of its minute (seconds and microseconds 0); same timezone."""
    return t.replace(second=0, microsecond=0)


def parse_time(text: str) -> datetime:
    """An ISO 8601 time (``2026-11-30T08:00:00Z``, ``+01:00``; naive = UTC) → aware UTC datetime.

    Raises ValueError when it does not parse, or when its offset moves it out of the years 1..9999 in UTC
    (``9999-12-31T23:59:59-01:00``: an OverflowError traceback before)."""
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not an ISO 8601 time (e.g. 2026-11-30T08:00:00Z)") from exc
    try:
        return _utc(parsed)
    except OverflowError as exc:
        raise ValueError(f"{text!r} is outside the years 1..9999 in UTC") from exc


# -- gathering --------------------------------------------------------------------------------------------------
def gather(store: Any, since: datetime, until: datetime, *, gpu_hour_price: float = 0.0, currency: str = "USD",
           dashboard_url: str = "", top_tenants: int = TOP_TENANTS) -> Digest:
    """The digest of ``[since, until)`` against the period of the same length before it.

    ``store``: an :class:`ingest.store.Store`; ``gpu_hour_price``: price of one GPU-hour in ``currency`` (0 = no
    money); ``dashboard_url``: the dashboard as readers reach it, for drill-down links ('' = none).
    Raises what :meth:`ingest.store.Store.named` raises (``QueryError``, ``StoreUnavailable``).
    """
    since, until = _utc(since), _utc(until)
    prev = since - (until - since)
    now_w, prev_w = _window(since, until), _window(prev, since)
    link = _Links(dashboard_url, since, until)
    now_all = store.named("miss_causes", {**now_w, "by_tenant": "1"})
    known = findings.known_misses
    missed = _Missed(now=known(now_all), before=known(store.named("miss_causes", {**prev_w, "by_tenant": "1"})),
                     pooled_before=known(store.named("miss_causes", prev_w)))
    cause_lines = _causes(store, since, until, missed, gpu_hour_price)
    hit_rates = _hit_rates(store, now_w, prev_w)
    headline = next((h.source for h in hit_rates if h.rate is not None), "")
    bucket = chart_bucket(until - since)
    gpu = _sum_or_none([c.gpu_seconds for c in cause_lines])
    return Digest(
        since=since, until=until, previous_since=prev, hit_rates=hit_rates, causes=cause_lines,
        missed_tokens=sum(c.missed_tokens for c in cause_lines),
        previous_missed_tokens=int(missed.pooled_before["missed_tokens"].sum()),
        gpu_seconds=gpu, money=findings.money(gpu, gpu_hour_price),
        currency=currency,
        tenants=_tenants(store, since, until, missed, gpu_hour_price, top_tenants, link),
        drift=_drift(missed, link, gpu_hour_price), cardinality=_cardinality(store, now_w, prev_w, link),
        affinity=_affinity(store, now_w, prev_w, link), ttl=_ttl(store, now_w, missed, gpu_hour_price),
        data_quality=_data_quality(store, now_w),
        series=_series(store, since, until, bucket, headline),
        previous_series=_series(store, prev, since, bucket, headline),
        bucket_seconds=bucket, dashboard_url=dashboard_url,
        links={page: link(page) for page in ("overview", "miss_causes", "pods", "fingerprints", "data_quality",
                                             "tenants")},
        unknown_tokens=findings.unknown_tokens(now_all),
    )


@dataclass(frozen=True)
class _Missed:
    """The miss_causes results gather reads more than once: per tenant now and before, tenants pooled before;
    their known misses only (:func:`dashboard.findings.known_misses`: no ``not_reported`` rows)."""

    now: pl.DataFrame
    before: pl.DataFrame
    pooled_before: pl.DataFrame


def chart_bucket(length: timedelta) -> int:
    """The hit-rate chart's bucket width, seconds: the smallest of :data:`NICE_BUCKETS` giving at most
    :data:`CHART_POINTS` points over ``length``."""
    target = length.total_seconds() / CHART_POINTS
    return next((b for b in NICE_BUCKETS if b >= target), NICE_BUCKETS[-1])


def _hit_rates(store: Any, now_w: dict[str, str], prev_w: dict[str, str]) -> tuple[HitRate, ...]:
    now = {r["source"]: r for r in store.named("hit_rate_total", now_w).iter_rows(named=True)}
    before = {r["source"]: r for r in store.named("hit_rate_total", prev_w).iter_rows(named=True)}
    out = []
    for source in ("vllm", "gateway"):
        if source not in now and source not in before:
            continue
        r, p = now.get(source, {}), before.get(source, {})
        out.append(HitRate(source=source, rate=r.get("token_weighted_hit_rate"),
                           previous=p.get("token_weighted_hit_rate"), hit_tokens=int(r.get("hit_tokens") or 0),
                           query_tokens=int(r.get("query_tokens") or 0), coverage=r.get("cached_tokens_coverage")))
    return tuple(out)


def _causes(store: Any, since: datetime, until: datetime, missed: _Missed, price: float) -> tuple[CauseLine, ...]:
    now = findings.known_misses(findings.where_missed(store, since, until, gpu_hour_price=price))
    before = {(r["cause"], r["sub_cause"]): int(r["missed_tokens"])
              for r in missed.pooled_before.iter_rows(named=True)}
    order = {c: i for i, c in enumerate(causes.CAUSE_ORDER)}
    lines = [CauseLine(cause=r["cause"], sub_cause=r["sub_cause"], missed_tokens=int(r["missed_tokens"]),
                       share_of_missed=float(r["share_of_missed"]), requests=int(r["requests"]),
                       gpu_seconds=r["gpu_seconds"], money=r["money"],
                       previous_missed_tokens=before.get((r["cause"], r["sub_cause"]), 0))
             for r in now.iter_rows(named=True)]
    return tuple(sorted(lines, key=lambda c: (-c.missed_tokens, order.get(c.cause, 99), c.sub_cause)))


def _tenants(store: Any, since: datetime, until: datetime, missed: _Missed, price: float, top: int,
             link: _Links) -> tuple[TenantLoss, ...]:
    now, before = _per_tenant(missed.now), _per_tenant(missed.before)
    if now.is_empty():
        return ()
    by_cost = now["gpu_seconds"].null_count() == 0
    ranked = now.sort(["gpu_seconds" if by_cost else "missed_tokens", "tenant_id"], descending=[True, False])
    previous = dict(before.select("tenant_id", "missed_tokens").iter_rows())
    worth = {w.tenant_id: w for w in findings.worth_it(store, since, until)}
    out = []
    for r in ranked.head(top).iter_rows(named=True):
        tenant = r["tenant_id"]
        found = findings.fix_first(store, since, until, tenant=tenant, limit=1, gpu_hour_price=price)
        finding = found[0] if found else None
        gpu = r["gpu_seconds"]
        out.append(TenantLoss(
            tenant_id=tenant, missed_tokens=int(r["missed_tokens"]), gpu_seconds=gpu,
            money=findings.money(gpu, price),
            previous_missed_tokens=int(previous.get(tenant, 0)),
            finding=finding, worth=worth.get(tenant),
            link=finding.url(link.base, since, until) if finding else link("miss_causes", tenant=tenant)))
    return tuple(out)


def _per_tenant(df: pl.DataFrame) -> pl.DataFrame:
    """miss_causes by tenant → tenant_id, missed_tokens, gpu_seconds (None when any of its rows is None)."""
    if df.is_empty():
        return pl.DataFrame(schema={"tenant_id": pl.String, "missed_tokens": pl.Int64, "gpu_seconds": pl.Float64})
    return df.group_by("tenant_id").agg(
        pl.col("missed_tokens").sum().cast(pl.Int64),
        pl.when(pl.col("gpu_seconds").null_count() == 0).then(pl.col("gpu_seconds").sum()).alias("gpu_seconds"))


def _drift(missed: _Missed, link: _Links, price: float) -> tuple[DriftEvent, ...]:
    before = {(r["tenant_id"], r["sub_cause"]) for r in missed.before.iter_rows(named=True)
              if r["cause"] == attribution.PREFIX_DRIFT}
    out = [DriftEvent(tenant_id=r["tenant_id"], sub_cause=r["sub_cause"], missed_tokens=int(r["missed_tokens"]),
                      requests=int(r["requests"]),
                      link=link("miss_causes", tenant=r["tenant_id"], cause=r["cause"], sub_cause=r["sub_cause"]),
                      gpu_seconds=r["gpu_seconds"], money=findings.money(r["gpu_seconds"], price))
           for r in missed.now.iter_rows(named=True)
           if r["cause"] == attribution.PREFIX_DRIFT and (r["tenant_id"], r["sub_cause"]) not in before]
    return tuple(sorted(out, key=lambda d: (-d.missed_tokens, d.tenant_id, d.sub_cause)))


def _cardinality(store: Any, now_w: dict[str, str], prev_w: dict[str, str],
                 link: _Links) -> tuple[CardinalityJump, ...]:
    params = {"bucket_seconds": str(WHOLE_WINDOW), "by_tenant": "1"}
    now = {r["tenant_id"]: r for r in store.named("fingerprint_cardinality", {**now_w, **params}).iter_rows(named=True)}
    before = {r["tenant_id"]: r
              for r in store.named("fingerprint_cardinality", {**prev_w, **params}).iter_rows(named=True)}
    out = []
    for tenant, r in sorted(now.items()):
        p = before.get(tenant)
        if not p or not p["requests"] or not r["requests"]:
            continue  # a tenant new in this period has no level to jump from
        for segment, (raw, norm) in SEGMENTS.items():
            if _jumped(r[raw], r["requests"], p[raw], p["requests"]):
                out.append(CardinalityJump(tenant_id=tenant, segment=segment, raw=int(r[raw]),
                                           previous_raw=int(p[raw]), normalized=int(r[norm]),
                                           requests=int(r["requests"]), previous_requests=int(p["requests"]),
                                           link=link("fingerprints", tenant=tenant)))
    return tuple(sorted(out, key=lambda j: (-(j.raw - j.previous_raw), j.tenant_id, j.segment)))


def _jumped(raw: int, requests: int, previous_raw: int, previous_requests: int) -> bool:
    """At least :data:`CARDINALITY_MIN_NEW` more distinct raw hashes and at least :data:`CARDINALITY_FACTOR` times
    as many per request: a stable segment keeps one hash whatever the traffic, a volatile one gets one per request."""
    if raw - previous_raw < CARDINALITY_MIN_NEW:
        return False
    return raw / requests >= CARDINALITY_FACTOR * previous_raw / previous_requests


def _affinity(store: Any, now_w: dict[str, str], prev_w: dict[str, str], link: _Links) -> tuple[AffinityDrop, ...]:
    now = {r["pod"]: r for r in store.named("pod_affinity", now_w).iter_rows(named=True)}
    before = {r["pod"]: r["cache_affinity"] for r in store.named("pod_affinity", prev_w).iter_rows(named=True)}
    out = []
    for pod, r in sorted(now.items()):
        now_affinity, was = r["cache_affinity"], before.get(pod)
        if now_affinity is not None and was is not None and (was - now_affinity) * 100 >= AFFINITY_DROP_PP:
            out.append(AffinityDrop(pod=pod, affinity=now_affinity, previous=was,
                                    predecessor_tokens=int(r["predecessor_tokens"]), link=link("tenants", pod=pod)))
    return tuple(sorted(out, key=lambda d: (d.change_pp, d.pod)))


def _ttl(store: Any, now_w: dict[str, str], missed: _Missed, price: float) -> TtlAdvice | None:
    df = store.named("turn_gaps", now_w)
    if df.is_empty():
        return None
    r = df.row(0, named=True)
    evicted = [x["gpu_seconds"] for x in missed.now.iter_rows(named=True)
               if (x["cause"], x["sub_cause"]) == (attribution.EVICTED, attribution.EVICTED_BEFORE_NEXT_TURN)]
    gpu = _sum_or_none(evicted) if evicted else (0.0 if r["evicted_missed_tokens"] == 0 else None)
    return TtlAdvice(next_turns=int(r["next_turns"]), gap_p50_ms=r["gap_p50_ms"], hold_ms=r["gap_p90_ms"],
                     gap_max_ms=r["gap_max_ms"], evicted_before_next_turn=int(r["evicted_before_next_turn"]),
                     evicted_missed_tokens=int(r["evicted_missed_tokens"]), evicted_gap_p50_ms=r["evicted_gap_p50_ms"],
                     evicted_gpu_seconds=gpu, evicted_money=findings.money(gpu, price))


def _data_quality(store: Any, now_w: dict[str, str]) -> tuple[DataQualityWarning, ...]:
    return tuple(DataQualityWarning(pod=r["pod"], likely_cause=r["likely_cause"], gap_pp=r["gap_pp"],
                                    evidence=r["evidence"])
                 for r in store.named("data_quality", now_w).iter_rows(named=True) if r["likely_cause"] != "agree")


def _series(store: Any, since: datetime, until: datetime, bucket: int, source: str) -> tuple[tuple[float, float], ...]:
    if not source:
        return ()
    df = store.named("hit_rate", {**_window(since, until), "bucket_seconds": str(bucket)})
    out = []
    for r in df.filter(pl.col("source") == source).iter_rows(named=True):
        if r["token_weighted_hit_rate"] is not None:
            out.append((max((r["bucket"] - since).total_seconds(), 0.0), float(r["token_weighted_hit_rate"])))
    return tuple(out)


# -- helpers ----------------------------------------------------------------------------------------------------
class _Links:
    """Drill-down links into the dashboard (its URL scheme: page path, ``from``/``to`` ISO 8601 UTC, filters)."""

    def __init__(self, base: str, since: datetime, until: datetime) -> None:
        self.base, self.since, self.until = base.rstrip("/"), since, until

    def __call__(self, page: str, **filters: str) -> str:
        return dashboard_link(self.base, page, self.since, self.until, **filters)


def dashboard_link(base: str, page: str, since: datetime, until: datetime, **filters: str) -> str:
    """``<base>/<page>?from=..&to=..&<filters>`` (empty filters left out); '' when ``base`` is ''. The Overview
    is the dashboard's default page, served at ``/`` only (Streamlit answers ``/overview`` with "Page not
    found")."""
    if not base:
        return ""
    params = {"from": iso(since), "to": iso(until), **{k: v for k, v in filters.items() if v}}
    return f"{base.rstrip('/')}/{'' if page == 'overview' else page}?{urlencode(params)}"


def iso(t: datetime) -> str:
    """``2026-11-30T08:00:00Z``."""
    return _utc(t).strftime("%Y-%m-%dT%H:%M:%SZ")


def _window(since: datetime, until: datetime) -> dict[str, str]:
    return {"since": _ch(since), "until": _ch(until)}


def _ch(t: datetime) -> str:
    return _utc(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _sum_or_none(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]
