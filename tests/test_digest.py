"""The miss-cause digest (``kvscope digest``, dashboard/digest.py, dashboard/digest_render.py, kvscope/schedule.py).

Figures are checked against the named queries for the same windows and, where the data was built for it
(tests/digest_data.py), against hand-derived values. Delivery goes through a real SMTP server (aiosmtpd) in
plain, STARTTLS-with-login and SSL variants, with a certificate made here; the HTML is rendered in headless
Chromium; the canary test sends prompts through the gateway's real fingerprinting and the bulk import.
"""

from __future__ import annotations

import base64
import email
import html
import ipaddress
import json
import logging
import re
import ssl
import threading
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from email import policy
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult
from click.testing import CliRunner

from dashboard import causes, findings
from dashboard.digest import gather, parse_duration, period
from dashboard.digest_render import gpu, money, render
from dashboard.mail import MailSettings, send
from ingest.store import Store
from kvscope.cli import main
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from kvscope.schedule import DigestSchedule, check_schedule
from tests.clock import DAY, T0
from tests.conftest import ARTIFACTS, free_port
from tests.digest_data import PREVIOUS, SINCE, UNTIL, load_two_periods

BASE_URL = "http://kvscope.test:8501"


@pytest.fixture(scope="module")
def two(chdb_dir: Path) -> Store:
    """The two-period data set (tests/digest_data.py) in its own database, read-only for this module."""
    s = Store.open(data_dir=chdb_dir, database=f"dg_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_two_periods(s)
    return s


def window(since: datetime, until: datetime, **extra: str) -> dict[str, str]:
    return {"since": since.strftime("%Y-%m-%d %H:%M:%S"), "until": until.strftime("%Y-%m-%d %H:%M:%S"), **extra}


def rows(store: Store, name: str, since: datetime, until: datetime, **extra: str) -> list[dict[str, Any]]:
    return store.named(name, window(since, until, **extra)).to_dicts()


# -- gathering --------------------------------------------------------------------------------------------------
def test_hit_rates_and_causes_equal_the_named_queries(two: Store) -> None:
    d = gather(two, SINCE, UNTIL, gpu_hour_price=2.0, currency="EUR", dashboard_url=BASE_URL)
    now = {r["source"]: r for r in rows(two, "hit_rate_total", SINCE, UNTIL)}
    before = {r["source"]: r for r in rows(two, "hit_rate_total", PREVIOUS, SINCE)}
    assert [h.source for h in d.hit_rates] == ["vllm", "gateway"]
    for h in d.hit_rates:
        assert (h.hit_tokens, h.query_tokens) == (now[h.source]["hit_tokens"], now[h.source]["query_tokens"])
        assert h.rate == now[h.source]["token_weighted_hit_rate"]
        assert h.previous == before[h.source]["token_weighted_hit_rate"]
    # by hand: vLLM 3,232 / 6,342 now; the previous copy counted 1,536 more hits on the same prompt tokens
    vllm, gateway = d.hit_rates
    assert vllm.change_pp == pytest.approx((3232 - 4768) / 6342 * 100)
    # the gateway also logged umbrella (4 x 640, nothing cached) and hooli (3 x 500) now, umbrella before
    assert (gateway.hit_tokens, gateway.query_tokens) == (3232, 6342 + 2560 + 1500)
    assert gateway.previous == pytest.approx((4768 + 3 * 608) / (6342 + 2560))
    assert d.headline is vllm

    by_cause = {(r["cause"], r["sub_cause"]): r for r in rows(two, "miss_causes", SINCE, UNTIL)}
    previous = {(r["cause"], r["sub_cause"]): r["missed_tokens"] for r in rows(two, "miss_causes", PREVIOUS, SINCE)}
    assert {(c.cause, c.sub_cause): c.missed_tokens for c in d.causes} == {
        k: r["missed_tokens"] for k, r in by_cause.items()}
    for c in d.causes:
        r = by_cause[(c.cause, c.sub_cause)]
        assert (c.share_of_missed, c.requests, c.gpu_seconds) == (r["share_of_missed"], r["requests"], r["gpu_seconds"])
        assert c.money == pytest.approx(r["gpu_seconds"] / 3600 * 2.0)
        assert c.previous_missed_tokens == previous.get((c.cause, c.sub_cause), 0)
        assert c.color == causes.color(c.cause, c.sub_cause)
    # fixture 3,110 + umbrella 2,560 + hooli 1,500; before: 3,110 - 768 - 768 healed + umbrella 640 + 3 x 32
    assert (d.missed_tokens, d.previous_missed_tokens) == (7170, 2310)
    assert d.gpu_seconds == pytest.approx(sum(r["gpu_seconds"] for r in by_cause.values()))
    assert d.money == pytest.approx(d.gpu_seconds / 3600 * 2.0) and d.currency == "EUR"


def test_tenants_losing_most_carry_the_findings(two: Store) -> None:
    d = gather(two, SINCE, UNTIL, gpu_hour_price=2.0, dashboard_url=BASE_URL, top_tenants=3)
    per_tenant: dict[str, list[dict[str, Any]]] = {}
    for r in rows(two, "miss_causes", SINCE, UNTIL, by_tenant="1"):
        per_tenant.setdefault(r["tenant_id"], []).append(r)
    cost = {t: sum(r["gpu_seconds"] for r in rs) for t, rs in per_tenant.items()}
    assert [t.tenant_id for t in d.tenants] == sorted(cost, key=lambda t: -cost[t])[:3]
    for t in d.tenants:
        assert t.missed_tokens == sum(r["missed_tokens"] for r in per_tenant[t.tenant_id])
        assert t.gpu_seconds == pytest.approx(cost[t.tenant_id])
        expected = findings.fix_first(two, SINCE, UNTIL, tenant=t.tenant_id, limit=1, gpu_hour_price=2.0)
        assert t.finding == (expected[0] if expected else None)
        assert t.link.startswith(BASE_URL + "/miss_causes?")
        assert t.worth == {w.tenant_id: w for w in findings.worth_it(two, SINCE, UNTIL)}[t.tenant_id]
    umbrella = next(t for t in d.tenants if t.tenant_id == "umbrella")
    f = umbrella.finding
    assert f is not None and (f.cause, f.sub_cause, f.missed_tokens) == ("prefix_drift", "volatile_system", 1824)
    assert f.share_of_tenant_missed == pytest.approx(1824 / 2560)
    assert f.fix == causes.fix_for("prefix_drift", "volatile_system").advice  # type: ignore[union-attr]
    ev = f.evidence
    assert ev is not None and (ev.request_id, ev.pod, ev.predecessor_request_id, ev.predecessor_pod) == (
        "u-4", "pod-a", "u-3", "pod-a")  # three misses of 608: the latest first
    assert (ev.gap_ms, ev.changed_segment) == (70000.0, "system")


def test_drift_cardinality_affinity_ttl_and_data_quality(two: Store) -> None:
    d = gather(two, SINCE, UNTIL, dashboard_url=BASE_URL)
    # new: umbrella's volatile system prompt and globex's (healed before); globex's tools_reordered is not new
    assert [(x.tenant_id, x.sub_cause, x.missed_tokens, x.requests) for x in d.drift] == [
        ("umbrella", "volatile_system", 1824, 3), ("globex", "volatile_system", 768, 1)]
    # umbrella: 4 raw system prompts in 4 requests (1 normalized), against 1 in 4 before
    assert [(j.tenant_id, j.segment, j.raw, j.previous_raw, j.normalized, j.requests, j.previous_requests)
            for j in d.cardinality] == [("umbrella", "system prompt", 4, 1, 1, 4, 4)]
    fp = {r["tenant_id"]: r for r in rows(two, "fingerprint_cardinality", SINCE, UNTIL,
                                           bucket_seconds=str(3600 * 1_111_112))}
    assert fp["umbrella"]["system_hash_cardinality"] == 4
    # pod-b: (400 + 832 + 500 + 500) of (400 + 800 + 832 + 19 + 500 + 500) prompt tokens; before 2,032 / 2,051
    [drop] = d.affinity
    assert (drop.pod, drop.affinity, drop.previous) == ("pod-b", pytest.approx(2232 / 3051),
                                                        pytest.approx(2032 / 2051))
    for pod in ("pod-a", "pod-b"):  # pod_affinity is tenant_affinity per pod, tenants pooled
        aff = rows(two, "tenant_affinity", SINCE, UNTIL, pod=pod)
        [row] = rows(two, "pod_affinity", SINCE, UNTIL, pod=pod)
        assert (row["same_pod_tokens"], row["predecessor_tokens"]) == (
            sum(r["same_pod_tokens"] for r in aff), sum(r["predecessor_tokens"] for r in aff))
    assert drop.predecessor_tokens == 3051
    # ten next turns on their previous turn's pod; gaps sorted: 1.5, 9.908, 9.92, 9.93, 40, 50, 60, 60, 70, 90 s
    t = d.ttl
    assert t is not None
    assert (t.next_turns, t.gap_p50_ms, t.hold_ms, t.gap_max_ms) == (10, 40000.0, 70000.0, 90000.0)
    assert (t.evicted_before_next_turn, t.evicted_missed_tokens, t.evicted_gap_p50_ms) == (2, 960, 60000.0)
    # cost beside tokens: the evicted tokens' and each new drift's GPU-seconds, as miss_causes prices them
    causes_now = {(r["tenant_id"], r["cause"], r["sub_cause"]): r
                  for r in rows(two, "miss_causes", SINCE, UNTIL, by_tenant="1")}
    evicted = [r for k, r in causes_now.items() if k[1:] == ("evicted", "evicted_before_next_turn")]
    assert sum(r["missed_tokens"] for r in evicted) == 960
    assert t.evicted_gpu_seconds == pytest.approx(sum(r["gpu_seconds"] for r in evicted)) and t.evicted_gpu_seconds > 0
    assert t.evicted_money is None  # no price given
    assert [x.gpu_seconds for x in d.drift] == [causes_now[(x.tenant_id, "prefix_drift", x.sub_cause)]["gpu_seconds"]
                                                for x in d.drift]
    [tg] = rows(two, "turn_gaps", SINCE, UNTIL)
    assert (tg["next_turns"], tg["gap_p90_ms"]) == (t.next_turns, t.hold_ms)
    dq = [r for r in rows(two, "data_quality", SINCE, UNTIL) if r["likely_cause"] != "agree"]
    assert dq and [(w.pod, w.likely_cause, w.evidence) for w in d.data_quality] == [
        (r["pod"], r["likely_cause"], r["evidence"]) for r in dq]


def test_turn_gaps_by_pod(two: Store) -> None:
    by_pod = {r["pod"]: r for r in rows(two, "turn_gaps", SINCE, UNTIL, by_pod="1")}
    # pod-b: initech-c1-t2 9.92 s, acme-c1-t4 9.908 s, hooli 90 s and 60 s (both evicted)
    b = by_pod["pod-b"]
    assert (b["next_turns"], b["gap_p50_ms"], b["gap_p90_ms"], b["gap_max_ms"]) == (4, 9920.0, 90000.0, 90000.0)
    assert (b["evicted_before_next_turn"], b["evicted_missed_tokens"]) == (2, 960)
    assert by_pod["pod-a"]["next_turns"] == 6 and by_pod["pod-a"]["evicted_gap_p50_ms"] is None


def test_an_empty_period_gathers_and_renders(two: Store) -> None:
    d = gather(two, datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC))
    assert (d.hit_rates, d.causes, d.tenants, d.ttl, d.missed_tokens) == ((), (), (), None, 0)
    msg = render(d)
    # a period in the past (given with --since/--until) is not "the last 1 d"
    assert msg["Subject"] == "kvscope digest 2026-01-01: no traffic in the period (1 d)"
    assert not [p for p in msg.walk() if p.get_content_type() == "image/png"]


def test_periods_and_durations() -> None:
    assert parse_duration("24h") == timedelta(hours=24) and parse_duration("7d") == timedelta(days=7)
    assert parse_duration("30m") == timedelta(minutes=30) and parse_duration("1.5h") == timedelta(minutes=90)
    for bad in ("", "24", "h", "0h", "-1h", "3 weeks"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    now = datetime(2026, 11, 30, 8, 15, 42, 500000, tzinfo=UTC)
    assert period(timedelta(hours=24), now=now) == (datetime(2026, 11, 29, 8, 15, tzinfo=UTC),
                                                    datetime(2026, 11, 30, 8, 15, tzinfo=UTC))
    assert period(timedelta(hours=1), since=SINCE) == (SINCE, SINCE + timedelta(hours=1))
    assert period(timedelta(hours=1), since=SINCE, until=UNTIL) == (SINCE, UNTIL)
    with pytest.raises(ValueError, match="start before"):
        period(timedelta(hours=1), since=UNTIL, until=SINCE)


# -- the message ------------------------------------------------------------------------------------------------
def parts(msg: EmailMessage) -> dict[str, Any]:
    """The digest's layout, checked: multipart/related holding multipart/alternative (text, HTML) and the PNGs
    the HTML references by Content-ID. Returns text, html and {cid: png bytes}."""
    assert msg.get_content_type() == "multipart/related"
    related = list(msg.iter_parts())
    alternative = related[0]
    assert alternative.get_content_type() == "multipart/alternative"
    text_part, html_part = alternative.iter_parts()
    assert (text_part.get_content_type(), html_part.get_content_type()) == ("text/plain", "text/html")
    images = {p["Content-ID"].strip("<>"): p.get_content() for p in related[1:]}
    assert [p.get_content_type() for p in related[1:]] == ["image/png", "image/png"]
    assert all(p.get_content_disposition() == "inline" for p in related[1:])
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000 for png in images.values())
    html = html_part.get_content()
    assert set(re.findall(r"src='cid:([^']+)'", html)) == set(images)
    return {"text": text_part.get_content(), "html": html, "images": images}


def test_the_message_says_the_figures_in_both_parts(two: Store) -> None:
    d = gather(two, SINCE, UNTIL, gpu_hour_price=2.0, currency="EUR", dashboard_url=BASE_URL)
    msg = render(d, to=["oncall@example.com"], sender="kvscope@example.com")
    assert msg["Subject"] == (f"kvscope digest {DAY}: hit rate {3232 / 6342 * 100:.1f} % "
                              f"(\u2212{(4768 - 3232) / 6342 * 100:.1f} pp), 7,170 missed tokens")
    p = parts(msg)
    umbrella = next(t for t in d.tenants if t.tenant_id == "umbrella")
    for body in (p["text"], p["html"].replace("&#x27;", "'")):
        assert "7,170 missed prompt tokens" in body and "2,310 in the previous period" in body
        assert "prefix_drift / volatile_system" in body and "evicted / evicted_before_next_turn" in body
        assert "Fix (71 % of this tenant's misses): Move the volatile value" in body
        assert f"Evidence: {umbrella.finding.evidence.text()}." in body  # type: ignore[union-attr]
        assert "request u-4 on pod-a missed 608 tokens" in body
        assert "predecessor u-3 ran on pod-a 1.2 min before" in body
        assert "umbrella" in body and "system prompt" in body and "pod-b" in body
        assert "1.2 min" in body  # the hold time that keeps 90 % of next turns warm (70 s)
        ttl_cost = f"960 missed tokens, {gpu(d.ttl.evicted_gpu_seconds)}, {money(d.ttl.evicted_money, 'EUR')};"
        shown = html.unescape(body)  # "<0.01 EUR" is "&lt;0.01 EUR" in the HTML part
        assert ttl_cost in shown  # type: ignore[union-attr]
        assert money(d.drift[0].money, "EUR") in shown  # the new drift table's cost column
        f = umbrella.finding
        assert (f"({f.missed_tokens:,} tokens in {f.requests} requests, {gpu(f.gpu_seconds)}, "  # type: ignore[union-attr]
                f"{money(f.money, 'EUR')})") in shown  # type: ignore[union-attr]
        assert "window_edge" in body
        assert umbrella.worth is not None and f"{'; '.join(umbrella.worth.reasons)}." in body
    assert umbrella.link in p["text"] and umbrella.link.replace("&", "&amp;") in p["html"]
    assert "\u2212" in p["text"]  # the change in pp has a real minus sign, UTF-8 in both parts


def test_links_only_with_a_dashboard_url(two: Store) -> None:
    p = parts(render(gather(two, SINCE, UNTIL)))
    assert "http" not in p["text"] and "href" not in p["html"]


# -- delivery ---------------------------------------------------------------------------------------------------
class Inbox:
    """An aiosmtpd handler keeping what it received: (mail_from, recipients, message bytes)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, list[str], bytes]] = []
        self.event = threading.Event()

    async def handle_DATA(self, server, session, envelope) -> str:  # type: ignore[no-untyped-def]
        self.received.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content))
        self.event.set()
        return "250 OK"

    def message(self, i: int = -1) -> EmailMessage:
        return email.message_from_bytes(self.received[i][2], policy=policy.default)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A self-signed certificate for 127.0.0.1 / localhost: server context and a client context trusting it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvscope test SMTP")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(pem := cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "cert.pem", d / "key.pem")
    return {"server": server, "client": ssl.create_default_context(cadata=pem.decode())}


def smtp_server(inbox: Inbox, **kwargs: Any) -> Controller:
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port(), **kwargs)
    controller.start()
    return controller


def config(**env: str) -> Any:
    return build_config({}, environ={f"KVSCOPE_{k.upper()}": v for k, v in env.items()})


@pytest.fixture(scope="module")
def digest_msg(two: Store) -> EmailMessage:
    return render(gather(two, SINCE, UNTIL, dashboard_url=BASE_URL), to=["oncall@example.com", "lead@example.com"])


def test_delivered_over_plain_smtp(digest_msg: EmailMessage) -> None:
    inbox = Inbox()
    server = smtp_server(inbox)
    try:
        cfg = config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="none",
                     mail_from="kvscope@example.com")
        send(digest_msg, MailSettings.from_config(cfg))
    finally:
        server.stop()
    [(sender, recipients, _)] = inbox.received
    assert sender == "kvscope@example.com" and recipients == ["oncall@example.com", "lead@example.com"]
    got = inbox.message()
    assert got["Subject"] == digest_msg["Subject"]
    assert parts(got)["text"].replace("\r\n", "\n") == parts(digest_msg)["text"]  # CRLF on the wire


def test_delivered_over_starttls_with_a_login_from_the_environment(digest_msg: EmailMessage,
                                                                     tls: dict[str, Any]) -> None:
    logins: list[tuple[bytes, bytes]] = []

    def authenticator(server, session, envelope, mechanism, auth_data) -> AuthResult:  # type: ignore[no-untyped-def]
        logins.append((auth_data.login, auth_data.password))
        return AuthResult(success=(auth_data.login, auth_data.password) == (b"digest", b"s3cret pass"), handled=False)

    inbox = Inbox()
    server = smtp_server(inbox, tls_context=tls["server"], require_starttls=True, authenticator=authenticator,
                         auth_required=True)
    try:
        cfg = config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="starttls",
                     smtp_username="digest", smtp_password="s3cret pass")
        send(digest_msg, MailSettings.from_config(cfg), context=tls["client"])
        with pytest.raises(Exception, match="535|Authentication"):
            send(digest_msg, replace(MailSettings.from_config(cfg), password="wrong"), context=tls["client"])
    finally:
        server.stop()
    assert logins[0] == (b"digest", b"s3cret pass") and len(inbox.received) == 1
    parts(inbox.message())


def test_delivered_over_ssl(digest_msg: EmailMessage, tls: dict[str, Any]) -> None:
    inbox = Inbox()
    server = smtp_server(inbox, ssl_context=tls["server"])
    try:
        cfg = config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="ssl")
        send(digest_msg, MailSettings.from_config(cfg), context=tls["client"])
    finally:
        server.stop()
    assert parts(inbox.message())["images"]


# -- the command ------------------------------------------------------------------------------------------------
def cli(store: Store, *args: str, env: dict[str, str] | None = None) -> Any:
    data_dir = store.dsn.removeprefix("chdb://")
    result = CliRunner().invoke(main, ["digest", *args, "--data-dir", data_dir, "--database", store.database],
                                env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


WINDOW_ARGS = ("--since", f"{DAY}T12:00:00Z", "--until", f"{DAY}T12:03:00Z")


def test_dry_run_writes_a_parseable_eml(two: Store, tmp_path: Path) -> None:
    out = tmp_path / "digest.eml"
    result = cli(two, *WINDOW_ARGS, "--to", "a@example.com", "--to", "b@example.com", "--dry-run", str(out),
                 env={"KVSCOPE_SMTP_HOST": None, "KVSCOPE_DASHBOARD_URL": BASE_URL})  # type: ignore[dict-item]
    assert result.exit_code == 0, result.output
    assert "nothing sent" in result.stdout
    msg = email.message_from_bytes(out.read_bytes(), policy=policy.default)
    assert msg["To"] == "a@example.com, b@example.com"
    assert msg["Subject"].startswith(f"kvscope digest {DAY}: hit rate 51.0 %")
    assert BASE_URL in parts(msg)["text"]  # type: ignore[arg-type]
    assert b"\r\n" in out.read_bytes()


def test_the_command_sends_and_fails_in_one_line(two: Store) -> None:
    inbox = Inbox()
    server = smtp_server(inbox)
    try:
        env = {"KVSCOPE_SMTP_HOST": "127.0.0.1", "KVSCOPE_SMTP_PORT": str(server.port),
               "KVSCOPE_SMTP_SECURITY": "none", "KVSCOPE_DIGEST_TO": "team@example.com"}
        result = cli(two, "--period", "3m", "--until", f"{DAY}T12:03:00Z", env=env)
        assert result.exit_code == 0, result.output
        assert "digest sent to team@example.com" in result.stdout
    finally:
        server.stop()
    [(_, recipients, _)] = inbox.received
    assert recipients == ["team@example.com"]
    assert inbox.message()["Subject"].startswith(f"kvscope digest {DAY}: hit rate 51.0 % (\u2212")
    # no server configured: one line, exit 1
    result = cli(two, *WINDOW_ARGS, "--to", "x@example.com", env={"KVSCOPE_SMTP_HOST": None})  # type: ignore[dict-item]
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "Error: no SMTP server configured: set KVSCOPE_SMTP_HOST (or write the message with --dry-run)"]
    # a server that refuses the connection: one line too
    result = cli(two, *WINDOW_ARGS, "--to", "x@example.com", env={"KVSCOPE_SMTP_HOST": "127.0.0.1",
                                                                  "KVSCOPE_SMTP_PORT": str(free_port())})
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "ConnectionRefusedError" in result.stderr
    result = cli(two, "--period", "soon")
    assert result.exit_code == 2 and "not a duration" in result.output


# -- the schedule -------------------------------------------------------------------------------------------------
def test_schedule_sends_when_due_and_remembers(two: Store, tmp_path: Path) -> None:
    inbox = Inbox()
    server = smtp_server(inbox)
    try:
        cfg = config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="none",
                     digest_to="team@example.com", digest_every="3m")
        state = tmp_path / "digest-state.json"
        schedule = DigestSchedule(two, cfg, threading.Event(), every=check_schedule(cfg), state_path=state)
        schedule._record(UNTIL - timedelta(minutes=2))
        assert schedule.tick(UNTIL) is False and not inbox.received  # 2 min since the last one
        assert schedule.tick(UNTIL + timedelta(minutes=1)) is True
        assert inbox.message()["Subject"] == render(gather(two, SINCE + timedelta(minutes=1),
                                                           UNTIL + timedelta(minutes=1)))["Subject"]
        assert json.loads(state.read_text())["last_sent"] == (UNTIL + timedelta(minutes=1)).isoformat()
        again = DigestSchedule(two, cfg, threading.Event(), every=timedelta(minutes=3), state_path=state)
        assert again.tick(UNTIL + timedelta(minutes=2)) is False  # a restart does not send twice
    finally:
        server.stop()
    # the server gone: not sent, not raised, not recorded
    assert again.tick(UNTIL + timedelta(minutes=5)) is False
    assert again.last_sent() == UNTIL + timedelta(minutes=1)


def test_scheduled_digests_follow_each_other_and_a_retry_covers_the_same_period(two: Store, tmp_path: Path) -> None:
    """Each scheduled digest starts where the previous one ended (kept in the state file), whatever the check
    drift; a failed send is retried, by a restarted schedule too, for the period it was sending."""
    inbox = Inbox()
    server = smtp_server(inbox)
    cfg = config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="none",
                 digest_to="team@example.com", digest_every="3m")
    state = tmp_path / "digest-state.json"
    minute = timedelta(minutes=1)

    def period_line(i: int) -> str:
        body = inbox.message(i).get_body(("plain",)).get_content()  # type: ignore[union-attr]
        return next(x for x in body.splitlines() if x.startswith("Period:"))

    def expected(since: datetime, until: datetime) -> str:
        return f"Period: {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC"

    try:
        schedule = DigestSchedule(two, cfg, threading.Event(), every=timedelta(minutes=3), state_path=state)
        schedule._record(UNTIL - timedelta(minutes=3) + timedelta(seconds=50))  # the clock starts
        assert schedule.tick(UNTIL + timedelta(seconds=50)) is True  # first: the last 3 minutes
        assert period_line(-1).startswith(expected(SINCE, UNTIL))
        assert schedule.tick(UNTIL + 2 * minute + timedelta(seconds=55)) is False  # not due yet
        # the next check comes late, past another minute boundary (a slow send, a busy host): no minute skipped
        assert schedule.tick(UNTIL + 4 * minute + timedelta(seconds=10)) is True
        assert period_line(-1).startswith(expected(UNTIL, UNTIL + 4 * minute))
        assert json.loads(state.read_text())["until"] == (UNTIL + 4 * minute).isoformat()
    finally:
        server.stop()
    # the server gone: not sent; the period waits in the state file
    sent = len(inbox.received)
    assert schedule.tick(UNTIL + 7 * minute + timedelta(seconds=30)) is False
    assert json.loads(state.read_text())["pending"] == [(UNTIL + 4 * minute).isoformat(),
                                                        (UNTIL + 7 * minute).isoformat()]
    # a restart with the server back, minutes later: the same period, then the next one from its end
    server = smtp_server(inbox)
    try:
        again = DigestSchedule(two, config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="none",
                                           digest_to="team@example.com", digest_every="3m"),
                               threading.Event(), every=timedelta(minutes=3), state_path=state)
        assert again.tick(UNTIL + 9 * minute + timedelta(seconds=5)) is True
        assert len(inbox.received) == sent + 1
        assert period_line(-1).startswith(expected(UNTIL + 4 * minute, UNTIL + 7 * minute))
        assert "pending" not in json.loads(state.read_text())
        assert again.tick(UNTIL + 10 * minute + timedelta(seconds=5)) is True
        assert period_line(-1).startswith(expected(UNTIL + 7 * minute, UNTIL + 10 * minute))
    finally:
        server.stop()


def test_schedule_continues_an_old_state_file_and_drops_an_unreadable_pending(
        two: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A state file of the previous format ({"last_sent"} only) continues from the minute of that send, downtime
    included; a pending period that does not parse is dropped with a warning, and the schedule goes on."""
    hour = timedelta(hours=1)
    t = datetime(2026, 12, 6, 9, 0, 25, tzinfo=UTC)
    state = tmp_path / "digest-old.json"
    state.write_text(json.dumps({"last_sent": t.isoformat()}))
    schedule = DigestSchedule(two, config(), threading.Event(), every=hour, state_path=state)
    assert schedule.due(t + hour - timedelta(seconds=30)) is None  # not an hour since 09:00 yet
    assert schedule.due(t + hour + timedelta(seconds=5)) == (t.replace(second=0), t.replace(second=0) + hour)
    five_hours_down = t + 5 * hour + timedelta(seconds=5)
    assert schedule.due(five_hours_down) == (t.replace(second=0), t.replace(second=0) + 5 * hour)

    bad = tmp_path / "digest-bad.json"
    bad.write_text(json.dumps({"last_sent": t.isoformat(), "until": "2026-12-06T10:00:00+00:00",
                               "pending": ["bad", "worse"]}))
    # no mail server: the send fails (OSError, caught); nothing raises, the readable period is what is pending
    cfg = config(smtp_host="127.0.0.1", smtp_port="1", smtp_security="none", digest_to="team@example.com")
    schedule = DigestSchedule(two, cfg, threading.Event(), every=hour, state_path=bad)
    with caplog.at_level(logging.WARNING, logger="kvscope.digest"):
        assert schedule.tick(datetime(2026, 12, 6, 11, 0, 5, tzinfo=UTC)) is False
    assert "unreadable pending" in caplog.text
    assert json.loads(bad.read_text())["pending"] == ["2026-12-06T10:00:00+00:00", "2026-12-06T11:00:00+00:00"]


def test_kvscope_up_sends_the_digest_from_its_pipeline(two: Store, tmp_path: Path) -> None:
    inbox = Inbox()
    server = smtp_server(inbox)
    cfg = replace(config(smtp_host="127.0.0.1", smtp_port=str(server.port), smtp_security="none",
                         digest_to="team@example.com", digest_every="1s", state_dir=str(tmp_path)),
                  database=two.database)
    pipe = Pipeline(cfg, store=two, collect=False, ingest=False, attribute=False, digest=True)
    try:
        pipe.start()
        # periods are whole minutes and the first starts at the minute of the start: on a 1 s schedule the first
        # digest goes once the clock has crossed a minute (at most 60 s, checked every second)
        assert inbox.event.wait(75), "no digest within 75 s of a 1 s schedule"
    finally:
        pipe.close()
        server.stop()
    assert inbox.message()["Subject"].startswith("kvscope digest ")
    assert (tmp_path / f"digest-{two.database}.json").exists()


def test_schedule_settings_are_checked() -> None:
    assert check_schedule(config()) is None
    with pytest.raises(ValueError, match="KVSCOPE_DIGEST_EVERY"):
        check_schedule(config(digest_every="daily", digest_to="a@b", smtp_host="h"))
    with pytest.raises(ValueError, match="KVSCOPE_DIGEST_TO"):
        check_schedule(config(digest_every="24h", smtp_host="h"))
    with pytest.raises(ValueError, match="KVSCOPE_SMTP_HOST"):
        check_schedule(config(digest_every="24h", digest_to="a@b"))
    assert check_schedule(config(digest_every="24h", digest_to="a@b", smtp_host="h")) == timedelta(hours=24)


# -- no prompt text ------------------------------------------------------------------------------------------------
def test_a_canary_in_the_prompts_appears_nowhere_in_the_digest(store: Store, tmp_path: Path) -> None:
    """Prompts carrying a canary go through the gateway's fingerprinting (gateway/fingerprint.py) into log lines,
    the bulk import and the attribution job; the digest of that traffic names the tenant (a control string)
    and never the canary, in the raw message or in any decoded part."""
    from gateway.fingerprint import TokenCounter, fingerprint_chat
    from ingest.attribution_job import run_attribution
    from ingest.bulk import load_gateway_log

    canary = f"kvscopecanary{uuid.uuid4().hex}"
    tenant = f"tenantcontrol{uuid.uuid4().hex[:8]}"
    counter = TokenCounter()
    start = T0 + timedelta(hours=3)  # 15:00 on the fixture's day
    lines = []
    for turn in range(4):
        system = f"Now: {DAY}T15:0{turn}:00Z. You are the {canary} assistant. " + "Rules. " * 60
        history = [m for i in range(turn) for m in ({"role": "user", "content": f"question {i} {canary}"},
                                                    {"role": "assistant", "content": f"answer {i} {canary}"})]
        body = {"model": "tiny", "messages": [{"role": "system", "content": system}, *history,
                                              {"role": "user", "content": f"question {turn} {canary}"}],
                "documents": [{"title": f"doc {canary}", "text": f"secret {canary} " * 20}]}
        fingerprint = fingerprint_chat(body, counter)
        fp = fingerprint.to_log_fields()
        prompt = fingerprint.segment_tokens + 8
        lines.append({
            "log_version": 1, "request_id": f"canary-{turn}",
            "ts": (start + timedelta(seconds=20 * turn)).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
            "tenant_id": tenant, "conversation_id": "conv-canary", "agent_run_id": "", "model": "tiny",
            "pod": "pod-a", "endpoint": "chat.completions", "stream": False, "routing_policy": "round_robin",
            "routing_reason": "round_robin", "status": 200, "error": "", "prompt_tokens": prompt,
            "cached_tokens": 0, "completion_tokens": 4, "ttft_ms": 10.0, "e2e_ms": 20.0, "queue_wait_ms": None,
            "tool_latency_ms": None, **fp})
    log = tmp_path / "gateway.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert canary.encode() not in log.read_bytes()  # the gateway's log holds hashes and counts only
    assert load_gateway_log(store, log).rows == 4
    run_attribution(store, settle_seconds=0.0, overlap_seconds=300.0, horizon_seconds=3600.0, default_block_size=16)
    d = gather(store, start, start + timedelta(hours=1), dashboard_url=BASE_URL)
    assert [t.tenant_id for t in d.tenants] == [tenant]
    assert d.tenants[0].finding is not None and d.tenants[0].finding.sub_cause == "volatile_system"
    msg = render(d, to=["oncall@example.com"])
    raw = msg.as_bytes()
    decoded = [p.get_content() for p in msg.walk() if not p.is_multipart()]
    texts = [x for x in decoded if isinstance(x, str)]
    assert any(tenant in x for x in texts), "the control string (the tenant) is in the digest"
    assert canary.encode() not in raw
    assert all(canary not in x for x in texts)
    assert all(canary.encode() not in x for x in decoded if isinstance(x, bytes))


# -- the HTML in a browser ------------------------------------------------------------------------------------------
@pytest.mark.browser
def test_the_html_renders_in_headless_chromium(two: Store) -> None:
    """The HTML part as a mail client shows it: inline images resolved from their Content-IDs. Every image loads,
    the sections and figures are visible text; the screenshot is tests/artifacts/digest.png."""
    from playwright.sync_api import sync_playwright

    p = parts(render(gather(two, SINCE, UNTIL, gpu_hour_price=2.0, dashboard_url=BASE_URL)))
    html = p["html"]
    for cid, png in p["images"].items():
        html = html.replace(f"cid:{cid}", "data:image/png;base64," + base64.b64encode(png).decode())
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 800, "height": 1200})
            page.set_content(html, wait_until="load")
            widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
            text = page.inner_text("body")
            page.screenshot(path=str(ARTIFACTS / "digest.png"), full_page=True)
        finally:
            browser.close()
    assert len(widths) == 2 and all(w >= 1000 for w in widths), widths
    for heading in ("Hit rate", "Where the missed tokens went", "Fix first: the tenants losing most",
                    "New prefix drift", "Fingerprint cardinality jumps", "Pods whose cache affinity fell",
                    "Hold time (TTL)", "Data quality"):
        assert heading in text
    assert "7,170 missed prompt tokens" in text and "umbrella" in text
    assert (ARTIFACTS / "digest.png").stat().st_size > 50_000

