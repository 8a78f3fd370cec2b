"""Delivering alert notices: a JSON POST to a webhook (``KVSCOPE_ALERT_WEBHOOK_URL``: Slack-compatible ``text``,
structured fields, and an Alertmanager-style ``status``/``labels``/``annotations`` with ``alerts``), and an email
(``KVSCOPE_ALERT_TO``, through :mod:`dashboard.mail`). docs/alerts.md shows the JSON.

A failed delivery is logged and counted (``kvscope_alert_notifications_failed_total{channel}``); it never raises
into the evaluation loop. Notices carry ids, counts and hashes' meanings only, never prompt text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from typing import Any
from urllib.parse import urlencode

import httpx
from prometheus_client import Counter

from dashboard import causes, findings, untrusted
from dashboard.alerts import Evaluation, iso
from dashboard.mail import MailError, MailSettings, check_addresses, send
from kvscope.durations import human as human_duration

log = logging.getLogger("kvscope.alerts")

NOTIFICATIONS_FAILED = Counter(
    "kvscope_alert_notifications_failed",
    "Alert notices not delivered, by channel (webhook: refused, unreachable or a non-2xx answer; email: the SMTP "
    "server refused or could not be reached)", ["channel"])
NOTIFICATIONS_SENT = Counter("kvscope_alert_notifications_sent", "Alert notices delivered, by channel", ["channel"])

#: The dashboard page each kind links to (paths as Streamlit derives them from dashboard/views/).
PAGES = {"hit_rate_drop": "miss_causes", "cause_share": "miss_causes", "cardinality_jump": "fingerprints",
         "source_silent": "pods"}


def dashboard_link(base_url: str, ev: Evaluation) -> str:
    """The drill-down URL of a notice on the dashboard at ``base_url`` ('' = no link): the kind's page with the
    window (``from``/``to``) and the evidence's tenant, cause, sub-cause, example request (``request_id`` and its
    arrival ``ts``) or pod as filters."""
    if not base_url:
        return ""
    e = ev.evidence
    q: dict[str, str] = {"from": iso(ev.since), "to": iso(ev.until)} if ev.since else {"range": "1h"}
    for key in ("tenant", "pod") if ev.rule.kind == "source_silent" else ("tenant",):
        if e.get(key):
            q[key] = e[key]
    if PAGES[ev.rule.kind] == "miss_causes":
        q.update({k: e[k] for k in ("cause", "sub_cause", "request_id") if e.get(k)})
        if e.get("request_id") and e.get("request_ts"):  # ids can repeat across runs: the request is (id, ts)
            q["ts"] = e["request_ts"]
    return f"{base_url.rstrip('/')}/{PAGES[ev.rule.kind]}?{urlencode(q)}"


def _status(ev: Evaluation) -> str:
    return "firing" if ev.notice == "firing" else "resolved"


def _evidence(ev: Evaluation) -> dict[str, Any]:
    """The evidence to send: this evaluation's, or for a resolved notice the evidence it fired with."""
    if ev.notice == "resolved" and ev.previous:
        try:
            return {**json.loads(ev.previous.get("evidence") or "{}"), **ev.evidence}
        except ValueError:
            return dict(ev.evidence)
    return dict(ev.evidence)


def summary_lines(ev: Evaluation, link: str = "", *, slack: bool = False, gpu_hour_price: float = 0.0,
                  currency: str = "USD") -> list[str]:
    """The notice as lines of plain text (Slack mrkdwn when ``slack``): what, the cause's missed tokens with their
    GPU-seconds (and money = GPU-seconds / 3600 × ``gpu_hour_price`` in ``currency`` when a price is set), the
    example request, the fix.

    Every line is one visible line (ids and messages through :func:`dashboard.untrusted.shown`); for Slack,
    ``&``, ``<`` and ``>`` are escaped (:func:`dashboard.untrusted.slack`), so a tenant called ``<!channel>``
    pings nobody and only the dashboard link is a link."""
    r, e = ev.rule, _evidence(ev)
    show = untrusted.shown
    head = f"[{_status(ev).upper()}] {r.name} ({r.severity})"
    lines = [head, show(ev.message, limit=None)]
    if ev.notice == "resolved" and ev.previous:
        lines.append(f"Was firing since {iso(ev.previous['changed_at'])}: {show(ev.previous['message'], limit=None)}")
    if e.get("cause") and e.get("missed_tokens"):
        gpu = e.get("gpu_seconds")
        cost = f", {findings.cost_text(gpu, findings.money(gpu, gpu_hour_price), currency)}" if gpu is not None else ""
        lines.append(f"Missed: {int(e['missed_tokens']):,} tokens of {causes.label(e['cause'], e.get('sub_cause', ''))}"
                     f"{cost}.")
    if e.get("request_id"):
        ex = f"Example: request {show(e['request_id'])} on {show(e.get('pod'), empty='?')}"
        if e.get("predecessor_request_id"):
            ex += f", predecessor {show(e['predecessor_request_id'])} on {show(e.get('predecessor_pod'), empty='?')}"
            if e.get("gap_ms") is not None:
                ex += f" ({human_duration(float(e['gap_ms']) / 1000)} earlier)"
        if e.get("changed_segment"):
            ex += f", changed segment: {e['changed_segment']}"
        lines.append(ex + ".")
    if e.get("fix") and ev.notice == "firing":
        lines.append(f"Fix: {show(e['fix'], limit=None)}")
    if slack:
        lines = [f"*{untrusted.slack(lines[0])}*", *(untrusted.slack(line) for line in lines[1:])]
    if link:
        lines.append(f"<{link}|Open in kvscope>" if slack else f"Dashboard: {link}")
    return lines


def payload(ev: Evaluation, dashboard_url: str = "", *, gpu_hour_price: float = 0.0,
            currency: str = "USD") -> dict[str, Any]:
    """The webhook's JSON body for one notice (docs/alerts.md): ``text`` for Slack, the structured fields, and
    Alertmanager's webhook shape (``status``, ``labels``, ``annotations``, ``alerts``: one alert). The price
    (0 = none) puts money beside the GPU-seconds in ``text``."""
    r, e = ev.rule, _evidence(ev)
    link = dashboard_link(dashboard_url, ev)
    cause = causes.label(e["cause"], e.get("sub_cause", "")) if e.get("cause") else ""
    labels = {"alertname": r.name, "severity": r.severity, "kind": r.kind, "tenant": e.get("tenant", ""),
              "cause": e.get("cause", ""), "sub_cause": e.get("sub_cause", ""), "pod": e.get("pod", "")}
    labels = {k: str(v) for k, v in labels.items() if v}
    annotations = {"summary": ev.message, "description": e.get("fix", ""), "dashboard": link}
    annotations = {k: v for k, v in annotations.items() if v}
    starts = ev.previous["changed_at"] if ev.notice == "resolved" and ev.previous else ev.changed_at
    alert = {"status": _status(ev), "labels": labels, "annotations": annotations, "startsAt": iso(starts),
             "endsAt": iso(ev.evaluated_at) if ev.notice == "resolved" else "", "generatorURL": link}
    return {
        "text": "\n".join(summary_lines(ev, link, slack=True, gpu_hour_price=gpu_hour_price, currency=currency)),
        "rule": r.name, "kind": r.kind, "state": _status(ev), "severity": r.severity, "value": ev.value,
        "threshold": r.threshold, "unit": r.unit,
        "window": {"seconds": r.window_seconds, "since": iso(ev.since), "until": iso(ev.until)} if ev.since else None,
        "tenant": e.get("tenant", ""), "cause": cause, "message": ev.message, "evidence": e,
        "evaluated_at": iso(ev.evaluated_at), "changed_at": iso(ev.changed_at), "dashboard_url": link,
        "status": _status(ev), "labels": labels, "annotations": annotations, "alerts": [alert],
    }


def value_text(value: float | None, unit: str) -> str:
    """``"91.1 %"``, ``"12.5 pp"``, ``"3x"``, ``"130 s"``; ``"none"`` for None."""
    if value is None:
        return "none"
    return f"{value:g}x" if unit == "x" else f"{value:g} {unit}"


def email_message(ev: Evaluation, to: Sequence[str], dashboard_url: str = "", *, gpu_hour_price: float = 0.0,
                  currency: str = "USD") -> EmailMessage:
    """The notice as a plain-text email to ``to``: subject ``[kvscope FIRING] rule: message`` (the price, 0 = none,
    puts money beside the GPU-seconds)."""
    msg = EmailMessage()
    subject = untrusted.shown(f"[kvscope {_status(ev).upper()}] {ev.rule.name}: {ev.message}", limit=None)
    msg["Subject"] = subject if len(subject) <= 200 else subject[:199] + "…"
    msg["To"] = ", ".join(to)
    msg["Date"] = formatdate(localtime=False)
    msg["Message-ID"] = make_msgid(domain="kvscope")
    body = summary_lines(ev, dashboard_link(dashboard_url, ev), gpu_hour_price=gpu_hour_price, currency=currency)
    unit = ev.rule.unit
    body += ["", f"Value: {value_text(ev.value, unit)}, threshold {value_text(ev.rule.threshold, unit)}",
             f"Evaluated at {iso(ev.evaluated_at)}", "", "Evidence:",
             json.dumps(_evidence(ev), indent=2, sort_keys=True, default=str)]
    msg.set_content("\n".join(body) + "\n")
    return msg


@dataclass
class Notifier:
    """Sends each notice to the webhook (when ``webhook_url``) and by email (when ``to`` and ``mail``), money
    beside GPU-seconds when ``gpu_hour_price`` (in ``currency``) is set."""

    webhook_url: str = ""
    mail: MailSettings | None = None
    to: list[str] = field(default_factory=list)
    dashboard_url: str = ""
    timeout_seconds: float = 10.0
    gpu_hour_price: float = 0.0
    currency: str = "USD"

    @classmethod
    def from_config(cls, cfg: Any) -> Notifier:
        """From a :class:`kvscope.config.Config`. Raises :class:`~dashboard.mail.MailError` for a bad
        ``KVSCOPE_SMTP_SECURITY``, sender or recipient when alert email is on."""
        to = check_addresses(cfg.list("alert_to"), "KVSCOPE_ALERT_TO")
        return cls(webhook_url=cfg.alert_webhook_url, mail=MailSettings.from_config(cfg) if to else None, to=to,
                   dashboard_url=cfg.dashboard_url, gpu_hour_price=cfg.gpu_hour_price, currency=cfg.currency)

    def notify(self, evaluations: Sequence[Evaluation]) -> int:
        """Deliver every notice on every channel; returns how many deliveries failed (each logged, counted)."""
        failed = 0
        for ev in evaluations:
            if self.webhook_url:
                failed += not self._deliver("webhook", ev, self._post)
            if self.to and self.mail is not None:
                failed += not self._deliver("email", ev, self._email)
        return failed

    def _deliver(self, channel: str, ev: Evaluation, how: Any) -> bool:
        try:
            how(ev)
        except (httpx.HTTPError, MailError, OSError, ValueError) as exc:
            NOTIFICATIONS_FAILED.labels(channel).inc()
            log.warning("alert notice not delivered. channel=%s rule=%s state=%s error=%s", channel, ev.rule.name,
                        _status(ev), exc)
            return False
        NOTIFICATIONS_SENT.labels(channel).inc()
        return True

    def _post(self, ev: Evaluation) -> None:
        resp = httpx.post(self.webhook_url, json=payload(ev, self.dashboard_url, gpu_hour_price=self.gpu_hour_price,
                                                        currency=self.currency), timeout=self.timeout_seconds)
        resp.raise_for_status()

    def _email(self, ev: Evaluation) -> None:
        assert self.mail is not None
        send(email_message(ev, self.to, self.dashboard_url, gpu_hour_price=self.gpu_hour_price,
                           currency=self.currency), self.mail)

