"""What to fix first (dashboard/findings.py) on the fixture (tests/fixture_data.py): the ranking, the evidence,
the cost, the drill-down link, and the adoption order within a tenant."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import pytest
from pytest import approx

from dashboard import causes, findings
from dashboard.findings import Finding
from ingest.store import Store
from tests.clock import DAY, T0
from tests.fixture_data import PREFILL_SECONDS_PER_TOKEN, load_fixture

SINCE, UNTIL = T0, T0 + timedelta(hours=1)  # 12:00-13:00 of the fixture's day
TOTAL_MISSED = 3110  # tests/test_named_queries.py::test_miss_causes


@pytest.fixture(scope="module")
def fx(chdb_dir) -> Store:  # type: ignore[no-untyped-def]
    import uuid

    st = Store.open(data_dir=chdb_dir, database=f"findings_{uuid.uuid4().hex[:8]}")
    st.migrate()
    load_fixture(st)
    return st


def test_fix_first_ranks_actionable_causes_by_cost_with_evidence(fx: Store) -> None:
    top = findings.fix_first(fx, SINCE, UNTIL, gpu_hour_price=2.5)
    assert [(f.tenant_id, f.cause, f.sub_cause) for f in top] == [
        ("acme", "routed_away", ""),  # 768 tokens, tie with globex broken by tenant
        ("globex", "prefix_drift", "volatile_system"),
        ("globex", "prefix_drift", "tools_reordered"),
    ]
    g = top[1]
    assert g.missed_tokens == 768 and g.requests == 1
    assert g.share_of_missed == approx(768 / TOTAL_MISSED)
    # globex: 768 + 64 drift, + the unavoidable tails of cap-3 (28), cap-4 (16) and globex-run1-s3 (32)
    assert g.share_of_tenant_missed == approx(768 / (768 + 64 + 28 + 16 + 32))
    assert g.gpu_seconds == approx(768 * PREFILL_SECONDS_PER_TOKEN)
    assert g.money == approx(768 * PREFILL_SECONDS_PER_TOKEN / 3600 * 2.5)
    assert g.fix == causes.fix_for("prefix_drift", "volatile_system").advice  # type: ignore[union-attr]
    assert g.evidence is not None and g.evidence.request_id == "cap-4-timestamp-first"
    assert g.evidence.changed_segment == "system"
    assert g.evidence.text().startswith("request cap-4-timestamp-first on pod-a missed 768 tokens from its system "
                                        "prompt on; its predecessor cap-3-tools-reordered ran on pod-a 1.5 s before")
    assert "globex: 85 % of its missed tokens are prefix_drift / volatile_system" in g.headline
    a = top[0].evidence
    assert a is not None and a.predecessor_pod and a.predecessor_pod != a.pod  # routed away: another pod held it
    assert f"its predecessor {a.predecessor_request_id} ran on {a.predecessor_pod}" in a.text()


def test_no_price_no_money_and_unactionable_causes_never_appear(fx: Store) -> None:
    top = findings.fix_first(fx, SINCE, UNTIL, limit=10)
    assert top and all(f.money is None for f in top)
    assert not {f.cause for f in top} & {"cold", "unavoidable", "below_block", "unknown"}


def test_per_tenant_keeps_each_tenants_dominant_finding(fx: Store) -> None:
    top = findings.fix_first(fx, SINCE, UNTIL, limit=10, per_tenant=True)
    assert [(f.tenant_id, f.sub_cause) for f in top] == [("acme", ""), ("globex", "volatile_system")]


def test_where_missed_equals_the_named_query(fx: Store) -> None:
    df = findings.where_missed(fx, SINCE, UNTIL)
    q = fx.named("miss_causes", {"since": f"{DAY} 12:00:00.000", "until": f"{DAY} 13:00:00.000"})
    assert df["missed_tokens"].to_list() == q["missed_tokens"].to_list()
    assert int(df["missed_tokens"].sum()) == TOTAL_MISSED
    assert dict(zip(df["label"], df["actionable"], strict=True))["routed_away"] is True
    assert dict(zip(df["label"], df["actionable"], strict=True))["cold"] is False


def test_drill_down_url_carries_the_finding_and_window(fx: Store) -> None:
    f = findings.fix_first(fx, SINCE, UNTIL)[1]
    url = f.url("https://kvscope.example.com/", SINCE, UNTIL)
    u = urlparse(url)
    assert (u.netloc, u.path) == ("kvscope.example.com", "/miss_causes")
    q = {k: v[0] for k, v in parse_qs(u.query).items()}
    assert q == {"from": f"{DAY}T12:00:00Z", "to": f"{DAY}T13:00:00Z", "tenant": "globex",
                 "cause": "prefix_drift", "sub_cause": "volatile_system", "request_id": "cap-4-timestamp-first",
                 "ts": f"{DAY}T12:01:10.000Z"}  # ids can repeat across runs: the request is (request_id, ts)
    assert f.url("", SINCE, UNTIL) == ""


def _f(tenant: str, cause: str, sub: str, gpu: float, tenant_share: float) -> Finding:
    fix = causes.fix_for(cause, sub)
    assert fix
    return Finding(tenant, cause, sub, int(gpu * 1000), 1, gpu, None, tenant_share, 0.1, fix.stage, fix.advice)


def test_a_tenants_prompt_fix_comes_before_its_routing_fix() -> None:
    ranked = findings._rank([
        _f("t1", "routed_away", "", 9.0, 0.6),
        _f("t2", "evicted", "", 5.0, 0.9),
        _f("t1", "prefix_drift", "volatile_system", 3.0, 0.3),
        _f("t1", "prefix_drift", "rag_changed", 0.5, 0.05),  # under MIN_TENANT_SHARE: keeps its cost rank
    ])
    assert [(f.tenant_id, f.sub_cause or f.cause) for f in ranked] == [
        ("t1", "volatile_system"), ("t1", "routed_away"), ("t2", "evicted"), ("t1", "rag_changed")]


def test_worth_it_says_per_tenant_whether_cache_work_pays(fx: Store) -> None:
    got = {w.tenant_id: w for w in findings.worth_it(fx, SINCE, UNTIL)}
    assert set(got) == {"acme", "globex", "initech"}
    acme = got["acme"]  # 768 routed_away of 3,156 prompt tokens; 3 of 4 requests follow a prefix-sharing one
    assert acme.pays and acme.recoverable_tokens == 768
    assert acme.recoverable_share == approx(768 / 3156)
    assert acme.reasons[0] == ("long repeated prefixes: 752 stable tokens per request, and 75 % of requests could "
                               "reuse an earlier request's prefix")
    assert got["globex"].pays and got["globex"].recoverable_tokens == 768 + 64
    initech = got["initech"]  # only cold, below_block and unavoidable misses: nothing a fix recovers
    assert not initech.pays and initech.recoverable_tokens == 0
    assert initech.text().startswith("initech: little to gain from cache work: repeated prefixes: 168 stable")


@pytest.mark.parametrize("filters", [{}, {"pod": "pod-a"}, {"tenant": "globex"}])
def test_each_example_is_the_request_miss_requests_lists_first(fx: Store, filters: dict[str, str]) -> None:
    """miss_examples reads all (tenant, cause, sub_cause) at once; each row equals miss_requests' first row for
    that tenant, cause and sub-cause (the most missed tokens, then the latest, then the first request_id)."""
    window = {"since": f"{DAY} 00:00:00.000", "until": f"{DAY} 23:59:59.000", **filters}
    examples = fx.named("miss_examples", window)
    assert len(examples) >= 3
    several = 0
    for r in examples.iter_rows(named=True):
        drill = fx.named("miss_requests", {**window, "tenant": r["tenant_id"], "cause": r["cause"],
                                           "sub_cause": r["sub_cause"], "limit": "1000"})
        drill = drill.filter((drill["tenant_id"] == r["tenant_id"]) & (drill["cause"] == r["cause"])
                             & (drill["sub_cause"] == r["sub_cause"]))
        several += len(drill) > 1
        first = drill.row(0, named=True)
        assert {k: r[k] for k in ("ts", "request_id", "pod", "missed_tokens", "predecessor_request_id",
                                  "predecessor_pod", "gap_ms")} == \
               {k: first[k] for k in ("ts", "request_id", "pod", "missed_tokens", "predecessor_request_id",
                                      "predecessor_pod", "gap_ms")}
    assert several, "no group with more than one request: the order is not exercised"


def test_fix_first_makes_one_example_read_for_all_its_findings(fx: Store) -> None:
    asked: list[str] = []

    class Counting:
        def named(self, name: str, params: dict[str, str]):  # type: ignore[no-untyped-def]
            asked.append(name)
            return fx.named(name, params)

    top = findings.fix_first(Counting(), SINCE, UNTIL, limit=10, per_tenant=True)
    assert len(top) == 2 and all(f.evidence is not None for f in top)
    assert asked == ["miss_causes", "miss_examples"]
