"""Alerts: the current state of every alert rule (named query ``alert_state``): firing or ok, since when, the
value beside the threshold, the message and the evidence (docs/alerts.md). Rules are evaluated by ``kvscope up``
(every KVSCOPE_ALERT_EVERY_SECONDS) or ``kvscope alerts``; this page only reads their states."""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from dashboard import charts, data, untrusted
from dashboard.alert_rules import UNITS
from dashboard.causes import label

st.header("Alerts")
st.caption(
    "Each rule's latest evaluation. A notice goes to the webhook and by email only when a rule's state changes "
    "(ok → firing, firing → resolved). Rules: KVSCOPE_ALERT_RULES, else the built-in rules (docs/alerts.md). "
    "Times are UTC; the sidebar's filters do not apply here."
)

ICONS = {"firing": ":material/notifications_active:", "ok": ":material/check_circle:"}
COLOURS = {"firing": "red", "ok": "green"}


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return charts.MISSING
    return f"{v:,.1f} {unit}" if unit != "x" else f"{v:,.2f}x"


def _evidence_lines(ev: dict[str, Any], kind: str = "") -> list[str]:
    """The evidence in words (plain text: ids as :func:`dashboard.untrusted.shown` shows them): tenants or pods,
    the cause, the example request, the fix. A tenant '' is the fleet for ``hit_rate_drop`` (pooled), else the
    traffic without a tenant."""
    lines = []
    pooled = "all" if kind == "hit_rate_drop" else untrusted.NO_TENANT
    if ev.get("tenants"):
        lines.append("Tenants: " + ", ".join(
            f"{untrusted.shown(t['tenant'], empty=pooled)}"
            + (f" ({t['share_percent']:g} %)" if "share_percent" in t else "")
            + (f" ({t['drop_pp']:g} pp)" if "drop_pp" in t else "")
            + (f" ({t['factor']:g}x)" if "factor" in t else "") for t in ev["tenants"]))
    if ev.get("pods"):
        lines.append("Silent: " + ", ".join(f"{untrusted.shown(p['pod'], empty='all pods')} (last {p['last_ts']})"
                                            for p in ev["pods"]))
    if ev.get("cause"):
        lines.append(f"Cause: {label(ev['cause'], ev.get('sub_cause', ''))}")
    if ev.get("request_id"):
        text = f"Example request: {untrusted.shown(ev['request_id'])} on {untrusted.shown(ev.get('pod'), empty='?')}"
        if ev.get("predecessor_request_id"):
            text += (f"; predecessor {untrusted.shown(ev['predecessor_request_id'])} on "
                     f"{untrusted.shown(ev.get('predecessor_pod'), empty='?')}")
        if ev.get("changed_segment"):
            text += f"; changed segment {ev['changed_segment']}"
        lines.append(text)
    if ev.get("fix"):
        lines.append(f"Fix: {ev['fix']}")
    return lines


def render(f: data.Filters) -> None:
    states = data.named("alert_state")
    if states.is_empty():
        st.info("No rule evaluated yet: `kvscope up` evaluates the alert rules every KVSCOPE_ALERT_EVERY_SECONDS "
                "(first after one interval), `kvscope alerts --once` at once.", icon=":material/hourglass_empty:")
        return
    firing = states.filter(states["state"] == "firing").height
    cols = st.columns(3)
    cols[0].metric("Firing", firing)
    cols[1].metric("OK", states.height - firing)
    latest = states["evaluated_at"].max()
    cols[2].metric("Last evaluated (UTC)", f"{latest:%H:%M:%S}")
    for row in states.iter_rows(named=True):
        unit = UNITS.get(row["kind"], "")
        with st.container(border=True):
            # every run evaluates all its rules at one instant: a rule left out of the latest run was removed from
            # the rules (or its queries failed)
            stale = "" if row["evaluated_at"] == latest else (
                f" · not in the latest evaluation (last {row['evaluated_at']:%Y-%m-%d %H:%M:%S})")
            state = f":{COLOURS[row['state']]}[{row['state']}]" if row["state"] in COLOURS else row["state"]
            st.markdown(f"{ICONS.get(row['state'], '')} **{charts.plain(row['rule'])}** · {state} since "
                        f"{row['changed_at']:%Y-%m-%d %H:%M:%S} · {row['severity']} · {row['kind']}{stale}")
            st.markdown(f"{_value(row['value'], unit)} vs threshold {_value(row['threshold'], unit)} — "
                        f"{charts.plain(untrusted.shown(row['message'], limit=None))}")
            try:
                evidence = json.loads(row["evidence"] or "{}")
            except ValueError:
                evidence = {}
            for line in _evidence_lines(evidence, row["kind"]):
                st.markdown("- " + charts.plain(line))


data.live(render)
