"""Tenants: tenant_cache_affinity and hit rates per tenant, and the tenant × pod matrix of prefix tokens."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, findings, fix_first, untrusted

st.header("Tenants")
st.caption(
    "Tenant cache affinity: of a tenant's requests with a predecessor sharing their prefix (same agent "
    "run or conversation, else same prompt fingerprint), the token-weighted share served by the "
    "predecessor's pod. Low affinity means routing sends follow-up turns away from the pod holding "
    "their prefix."
)

COLUMNS = [
    "tenant_id",
    "tenant_cache_affinity",
    "token_weighted_hit_rate",
    "cached_tokens_coverage",
    "request_weighted_hit_rate",
    "requests",
    "requests_with_predecessor",
    "prompt_tokens",
    "cached_tokens",
    "pods",
]
PERCENT = ["tenant_cache_affinity", "token_weighted_hit_rate", "cached_tokens_coverage", "request_weighted_hit_rate"]


def render(f: data.Filters) -> None:
    if not data.has_data():
        charts.no_data()
        return
    p = f.params()
    affinity = data.named("tenant_affinity", **p)
    if affinity.is_empty():
        charts.no_data(in_window=True, latest=data.extent()[1])
        return
    charts.bars(
        affinity,
        "tenant_id",
        ["tenant_cache_affinity", "token_weighted_hit_rate"],
        "Cache affinity and token-weighted hit rate per tenant",
        percent=True,
        key="tenant_bars",
    )
    charts.table(affinity.select(COLUMNS), percent_cols=PERCENT, key="tenant_table")
    worth(f)
    matrix = data.named("tenant_pod_matrix", **p)
    charts.heatmap(
        matrix,
        "pod",
        "tenant_id",
        "prefix_tokens",
        "Prefix tokens served, tenant × pod",
        key="tenant_pod_matrix",
    )


#: Tenants listed in "Does cache work pay?" (largest prompt volume first).
WORTH_TENANTS = 20


def worth(f: data.Filters) -> None:
    """Per tenant: does cache work pay (docs/fix-first.md), its dominant fix, and a link to its missed requests."""
    st.subheader("Does cache work pay?")
    since, until = fix_first.window(f)
    price, currency = fix_first.gpu_hour_price()
    try:
        verdicts = findings.worth_it(data.get_store(), since, until, tenant=f.tenant, pod=f.pod, model=f.model)
        top = {x.tenant_id: x for x in findings.fix_first(data.get_store(), since, until, tenant=f.tenant, pod=f.pod,
                                                            model=f.model, limit=WORTH_TENANTS, per_tenant=True,
                                                            gpu_hour_price=price)}
    except Exception as exc:  # noqa: BLE001  (a failing query shows its error; the page goes on)
        st.error(f"Could not read the tenants' misses: {charts.plain(data.error_text(exc))}")
        return
    if not verdicts:
        st.caption(charts.NO_DATA_IN_WINDOW)
        return
    for w in verdicts[:WORTH_TENANTS]:
        finding = top.get(w.tenant_id)
        with st.container(border=True):
            icon = ":material/check_circle:" if w.pays else ":material/remove_circle_outline:"
            verdict = "cache work pays" if w.pays else "little to gain from cache work"
            who = charts.name(w.tenant_id, empty=untrusted.NO_TENANT)
            st.markdown(f"{icon} **{who}**: {verdict}. " + charts.plain("; ".join(w.reasons)))
            if finding is not None:
                cost = findings.cost_text(finding.gpu_seconds, finding.money, currency)
                st.caption(charts.plain(f"Fix first: {finding.label} ({finding.share_of_tenant_missed * 100:.0f} % of "
                                        f"its missed tokens, {finding.missed_tokens:,} tokens, {cost}): "
                                        f"{finding.fix}"))
            st.page_link(fix_first.MISS_CAUSES_PAGE, label=f"Requests of {who} that missed",
                         icon=":material/arrow_forward:", query_params={**f.query(), "tenant": w.tenant_id})


data.live(render)
