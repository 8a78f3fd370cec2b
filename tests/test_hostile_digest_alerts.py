"""Hostile values from the gateway log in everything that shows them: the digest, alert notices, the dashboard,
terminal tables and log lines.

Tenant ids, pods, models, request and conversation ids are written by whoever sends requests through the gateway.
These tests log traffic whose ids hold HTML and JavaScript, Markdown (links, Streamlit colours, LaTeX, icon
shortcodes), Slack control sequences, CR/LF (mail-header and log-line injection), ANSI escape sequences,
bidirectional overrides and zero-width characters, a 500-character id and an empty tenant, load it through the
gateway's fingerprinting, the bulk import and the attribution job, and read every output the way its reader does:
the digest from a real SMTP server (aiosmtpd) and in headless Chromium, alert notices from a real HTTP server and
SMTP server, the dashboard in headless Chromium, tables through a real pseudo-terminal. Also: empty stores and
windows, times outside what the store can hold, bad periods.
"""

from __future__ import annotations

import base64
import email
import io
import json
import logging
import os
import pty
import re
import selectors
import subprocess
import sys
import threading
import time
import unicodedata
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email import policy
from email.message import EmailMessage
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from aiosmtpd.controller import Controller

from dashboard import untrusted
from dashboard.alert_delivery import Notifier, payload
from dashboard.alert_rules import parse_rules
from dashboard.alerts import Evaluation, run_once
from dashboard.digest import gather, parse_duration, period
from dashboard.digest_render import render
from dashboard.findings import fix_first
from dashboard.mail import MailSettings, send
from ingest.store import Store
from kvscope.config import build_config
from kvscope.tables import render_markdown, render_table
from tests.clock import T0
from tests.conftest import ARTIFACTS, free_port

ROOT = Path(__file__).resolve().parents[1]
BASE_URL = "http://kvscope.test:8501"

SCRIPT = "<script>alert(1)</script>"
MARKDOWN = "**bold** [link](javascript:alert(1)) :red[red] $x^2$ evil@example.com :material/home:"
SLACK = "<!channel> <@U123> <http://evil.example|click>"
CRLF = "a\r\nBcc: evil@example.com\r\nX-Forged: 1"
ANSI = "\x1b[31mred\x1b[0m\x1b]0;title\x07"
BIDI = "\u202eevil\u200b\u2066"
LONG = "T" * 500
#: Tenants of the hostile traffic; '' is "no tenant" (docs/gateway-log.md).
TENANTS = [SCRIPT, MARKDOWN, SLACK, CRLF, ANSI, BIDI, LONG, ""]
PODS = ["<img src=x onerror=alert(1)>", '"><b>x</b> :blue[pod]']
MODEL = "m<i>odel</i>"
#: Unicode categories no output may carry raw (control, format, separators, surrogates).
HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def request_prefix(tenant: str) -> str:
    """Request ids carry the tenant's hostile text too (ids are limited to 512 characters)."""
    return tenant[:200] if tenant else "notenant"


def hostile_lines(now: datetime) -> list[dict[str, Any]]:
    """Gateway log lines over [now − 2 h, now): per tenant ('' too), one conversation of four turns in the previous hour
    with a stable system prompt (turns after the first hit the cache) and one in the current hour whose system
    prompt starts with a timestamp (prefix_drift / volatile_system: nothing cached). Hashes and token counts come
    from the gateway's real fingerprinting."""
    from gateway.fingerprint import TokenCounter, fingerprint_chat

    counter = TokenCounter()
    lines = []
    for i, tenant in enumerate(TENANTS):
        pod = PODS[i % len(PODS)]
        for period_start, volatile in ((now - timedelta(hours=2), False), (now - timedelta(hours=1), True)):
            conv = f"{request_prefix(tenant)}-{'cur' if volatile else 'prev'}"
            for turn in range(4):
                ts = period_start + timedelta(minutes=5 + 10 * turn, seconds=i)
                rules = "Rules. " * (80 if tenant else 40)  # no tenant: smaller misses than any tenant's
                system = (f"Now: {ts:%Y-%m-%dT%H:%M:%SZ}. " if volatile else "") + "You help. " + rules
                history = [m for k in range(turn) for m in ({"role": "user", "content": f"question {k}"},
                                                            {"role": "assistant", "content": f"answer {k}"})]
                body = {"model": "tiny", "messages": [{"role": "system", "content": system}, *history,
                                                      {"role": "user", "content": f"question {turn}"}]}
                fingerprint = fingerprint_chat(body, counter)
                fp = fingerprint.to_log_fields()
                prompt = fingerprint.segment_tokens + 8
                cached = 0 if volatile or turn == 0 else (prompt - fp["suffix_tokens"] - 8) // 16 * 16
                lines.append({
                    "log_version": 1, "request_id": f"{conv}-{turn}", "ts": f"{ts:%Y-%m-%dT%H:%M:%S}.000Z",
                    "tenant_id": tenant, "conversation_id": conv, "model": MODEL, "pod": pod, "status": 200,
                    "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 4, "ttft_ms": 10.0,
                    "e2e_ms": 20.0, **fp})
    return lines


def write_log(path: Path, now: datetime) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in hostile_lines(now)))
    return path


#: The Python-API tests' clock: the current hour is [NOW − 1 h, NOW).
NOW = T0 + timedelta(hours=2)  # 14:00 on the test data's day (tests/clock.py)


@pytest.fixture(scope="module")
def hostile(chdb_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """The hostile traffic in its own database of the session's chDB directory, attributed."""
    from ingest.attribution_job import run_attribution
    from ingest.bulk import load_gateway_log

    s = Store.open(data_dir=chdb_dir, database=f"hx_{uuid.uuid4().hex[:12]}")
    s.migrate()
    log = write_log(tmp_path_factory.mktemp("hostile") / "gateway.jsonl", NOW)
    assert load_gateway_log(s, log).rows == len(TENANTS) * 8
    run_attribution(s, settle_seconds=0.0, overlap_seconds=300.0, horizon_seconds=3600.0, default_block_size=16)
    return s


def visible(text: str) -> bool:
    """No character of the :data:`HIDDEN` categories except line ends."""
    return not any(unicodedata.category(c) in HIDDEN for c in text.replace("\r\n", "\n").replace("\n", ""))


# -- the shared functions ---------------------------------------------------------------------------------------
def test_shown_makes_one_visible_line_of_any_value() -> None:
    assert untrusted.shown("acme") == "acme"
    assert untrusted.shown(CRLF) == "a\\x0d\\x0aBcc: evil@example.com\\x0d\\x0aX-Forged: 1"
    assert untrusted.shown(ANSI) == "\\x1b[31mred\\x1b[0m\\x1b]0;title\\x07"
    assert untrusted.shown(BIDI) == "\\u202eevil\\u200b\\u2066"
    assert untrusted.shown("") == "" and untrusted.tenant("") == "(no tenant)"
    long = untrusted.shown("x" * 10_000)
    assert len(long) == untrusted.LIMIT and long.endswith("…")
    assert untrusted.shown("x" * 10_000, limit=None) == "x" * 10_000
    assert untrusted.shown("日本語 café") == "日本語 café"  # printable text is left alone
    assert untrusted.slack(SLACK) == "&lt;!channel&gt; &lt;@U123&gt; &lt;http://evil.example|click&gt;"
    assert untrusted.html_text(SCRIPT) == "&lt;script&gt;alert(1)&lt;/script&gt;"
    md = untrusted.markdown(MARKDOWN)
    assert not re.search(r"(?<!\\)[*\[\]()$<>]", md), md  # every markup character escaped
    assert ":" + untrusted.WORD_JOINER + "red" in md  # no :red[...] colour, no :material/...: icon
    assert untrusted.markdown("pod-b / cap-3_x localhost:8000") == "pod-b / cap-3_x localhost:8000"
    assert untrusted.markdown("- a\n# b\n1. c") == "\\- a  \n\\# b  \n1\\. c"
    assert untrusted.WORD_JOINER + "@" in md  # breaks GFM's email autolink


def test_log_lines_stay_one_line() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(untrusted.OneLineFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"kvscope.test.{uuid.uuid4().hex}")
    log.addHandler(handler)
    log.propagate = False
    log.warning("scrape failed. pod=%s", "pod-a\nERROR forged line " + ANSI)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed. request_id=%s", CRLF)
    lines = out.getvalue().splitlines()
    assert lines[0] == "WARNING scrape failed. pod=pod-a\\x0aERROR forged line \\x1b[31mred\\x1b[0m\\x1b]0;title\\x07"
    assert lines[1].startswith("ERROR failed. request_id=a\\x0d\\x0aBcc")
    assert lines[2] == "Traceback (most recent call last):"  # the traceback keeps its lines
    assert "\x1b" not in out.getvalue()


# -- the digest -------------------------------------------------------------------------------------------------
class Inbox:
    """An aiosmtpd handler keeping what it received: (mail_from, recipients, message bytes)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, list[str], bytes]] = []

    async def handle_DATA(self, server, session, envelope) -> str:  # type: ignore[no-untyped-def]
        self.received.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content))
        return "250 OK"

    def messages(self) -> list[EmailMessage]:
        return [email.message_from_bytes(raw, policy=policy.default) for _, _, raw in self.received]  # type: ignore[misc]


@pytest.fixture
def smtp() -> Iterator[tuple[Inbox, MailSettings]]:
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    env = {"KVSCOPE_SMTP_HOST": "127.0.0.1", "KVSCOPE_SMTP_PORT": str(controller.port),
           "KVSCOPE_SMTP_SECURITY": "none", "KVSCOPE_MAIL_FROM": "kvscope@example.com"}
    try:
        yield inbox, MailSettings.from_config(build_config({}, environ=env))
    finally:
        controller.stop()


def body_parts(msg: EmailMessage) -> tuple[str, str, dict[str, bytes]]:
    text = msg.get_body(("plain",)).get_content()  # type: ignore[union-attr]
    html = msg.get_body(("html",)).get_content()  # type: ignore[union-attr]
    images = {p["Content-ID"].strip("<>"): p.get_content() for p in msg.walk() if p.get_content_type() == "image/png"}
    return text, html, images


@pytest.fixture(scope="module")
def digest_received(hostile: Store) -> EmailMessage:
    """The digest of the hostile hour, delivered through a real SMTP server and parsed as a client would."""
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        env = {"KVSCOPE_SMTP_HOST": "127.0.0.1", "KVSCOPE_SMTP_PORT": str(controller.port),
               "KVSCOPE_SMTP_SECURITY": "none"}
        d = gather(hostile, NOW - timedelta(hours=1), NOW, dashboard_url=BASE_URL)
        send(render(d, to=["oncall@example.com"]), MailSettings.from_config(build_config({}, environ=env)))
    finally:
        controller.stop()
    [(_, recipients, _)] = inbox.received
    assert recipients == ["oncall@example.com"]
    return inbox.messages()[0]


def test_the_digest_shows_hostile_ids_as_text(digest_received: EmailMessage) -> None:
    msg = digest_received
    assert "Bcc" not in msg and "X-Forged" not in msg and msg["To"] == "oncall@example.com"
    text, html, _ = body_parts(msg)
    # plain text: every line visible, nothing forged at a line start, each hostile id written out
    assert visible(text)
    assert not any(line.lstrip().startswith(("Bcc:", "X-Forged:")) for line in text.splitlines())
    for shown in (SCRIPT, "a\\x0d\\x0aBcc: evil@example.com", "\\x1b[31mred", "\\u202eevil\\u200b",
                  "(no tenant)", "<img src=x onerror=alert(1)>"):
        assert shown in text, shown
    assert "fix first: ," not in text and "all tenants:" not in text
    words = [line for line in text.splitlines() if "http://" not in line]  # drill-down URLs carry the whole id
    assert any("T" * 79 + "…" in line for line in words) and not any("T" * 81 in line for line in words)
    # HTML: escaped, never markup
    assert visible(html)
    for raw in ("<script", "<img src=x", "<b>x</b>", "\u202e"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_the_digest_links_open_existing_pages(hostile: Store) -> None:
    """The Overview is the dashboard's default page: Streamlit serves it at / and answers /overview with "Page
    not found"."""
    d = gather(hostile, NOW - timedelta(hours=1), NOW, dashboard_url=BASE_URL)
    assert d.links["overview"].startswith(BASE_URL + "/?from=")
    pages = {link.removeprefix(BASE_URL).split("?")[0] for link in d.links.values()}
    assert pages <= {"/", "/miss_causes", "/pods", "/fingerprints", "/data_quality", "/tenants"}, pages


def test_the_no_tenant_traffic_has_its_own_evidence(hostile: Store) -> None:
    """A tenant filter of '' means every tenant in the named queries: the finding of the traffic without a
    tenant must still show one of its own requests, not another tenant's."""
    top = fix_first(hostile, NOW - timedelta(hours=1), NOW, limit=20, per_tenant=True)
    mine = [f for f in top if f.tenant_id == ""]
    assert mine and mine[0].evidence is not None
    assert mine[0].evidence.request_id.startswith("notenant-cur-")
    assert mine[0].headline.startswith("(no tenant): ")


@pytest.mark.browser
def test_the_digest_html_runs_nothing_in_chromium(digest_received: EmailMessage) -> None:
    from playwright.sync_api import sync_playwright

    _, html, images = body_parts(digest_received)
    for cid, png in images.items():
        html = html.replace(f"cid:{cid}", "data:image/png;base64," + base64.b64encode(png).decode())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 800, "height": 1200})
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.set_content(html, wait_until="load")
            page.wait_for_timeout(500)
            found = page.evaluate("""() => ({
                scripts: document.querySelectorAll('script').length,
                imgs: Array.from(document.querySelectorAll('img')).map(i => i.getAttribute('src').slice(0, 10)),
                bold_x: Array.from(document.querySelectorAll('b')).filter(b => b.innerText === 'x').length,
                links: Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'))
                    .filter(h => !h.startsWith('http://kvscope.test:8501/')),
                text: document.body.innerText})""")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "digest-hostile.png"), full_page=True)
        finally:
            browser.close()
    assert dialogs == [] and found["scripts"] == 0 and found["bold_x"] == 0 and found["links"] == []
    assert found["imgs"] == ["data:image"] * 2
    assert SCRIPT in found["text"] and "\u202e" not in found["text"]


def test_digest_periods_that_cannot_be() -> None:
    for bad in ("0h", "-5m", "5", "soon", "99999999999d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert parse_duration("1h30m") == timedelta(minutes=90) == parse_duration("1.5h")
    with pytest.raises(ValueError, match="must start before it ends"):
        period(since=NOW, until=NOW - timedelta(hours=1))
    with pytest.raises(ValueError, match="years 1 to 9999"):
        period(timedelta(days=1), until=datetime(1, 1, 1, 12, tzinfo=UTC))
    assert period(timedelta(hours=2), since=NOW) == (NOW, NOW + timedelta(hours=2))


def test_a_window_beyond_what_the_store_holds_is_empty(hostile: Store) -> None:
    """The rollups keep minutes as 32-bit DateTime (to 2106): a window starting later once read every row."""
    for since, until in (("3000-01-01T00:00:00Z", "3000-01-02T00:00:00Z"), ("2150-01-01T00:00:00Z", "2200-01-01"),
                         ("1960-01-01T00:00:00Z", "1960-01-02T00:00:00Z")):
        for name in ("hit_rate_total", "miss_causes", "tenant_affinity"):
            assert hostile.named(name, {"since": since, "until": until}).is_empty(), (name, since)
    assert not hostile.named("hit_rate_total", {"since": "1960-01-01", "until": "3000-01-01"}).is_empty()
    d = gather(hostile, datetime(3000, 1, 1, tzinfo=UTC), datetime(3000, 1, 2, tzinfo=UTC))
    assert d.headline is None and not d.missed_tokens and not d.tenants


def test_an_empty_store_digest_says_there_was_no_traffic(store: Store) -> None:
    text, _, _ = body_parts(render(gather(store, NOW - timedelta(days=1), NOW)))
    assert "In short: no traffic in this period" in text
    assert "No pod served traffic in this period" in text and "agree on every pod" not in text


# -- alerts -----------------------------------------------------------------------------------------------------
class Hooks(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        Hooks.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    Hooks.bodies = []
    server = HTTPServer(("127.0.0.1", free_port()), Hooks)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", Hooks.bodies
    finally:
        server.shutdown()


RULES = """
[[rule]]
name = "drift"
kind = "cause_share"
window = "1h"
cause = "prefix_drift"
share_percent = 10
per_tenant = true
min_missed_tokens = 100

[[rule]]
name = "system_prompts"
kind = "cardinality_jump"
window = "1h"
segment = "system_hash"
factor = 2
min_cardinality = 2

[[rule]]
name = "pods_silent"
kind = "source_silent"
source = "gateway_log"
silent_seconds = "1m"
lookback = "3h"
"""


def test_alert_notices_show_hostile_ids_as_text(hostile: Store, smtp: tuple[Inbox, MailSettings],
                                                webhook: tuple[str, list[dict[str, Any]]]) -> None:
    """Every rule fires on the hostile hour; each notice reaches the webhook and the mailbox (a CR/LF in a tenant
    once made the email's Subject invalid and the notice was lost), one visible line per fact."""
    inbox, mail = smtp
    url, bodies = webhook
    rules = parse_rules(RULES, "hostile.toml")
    notifier = Notifier(webhook_url=url, mail=mail, to=["oncall@example.com"], dashboard_url=BASE_URL)
    evs = run_once(hostile, rules, notifier, now=NOW)
    assert [e.state for e in evs] == ["firing"] * 3
    assert len(bodies) == 3 and len(inbox.received) == 3
    for body in bodies:
        text = body["text"]
        assert visible(text)
        # the only Slack control sequence is the dashboard link kvscope adds
        assert re.findall(r"<[^>]*>", text) == [f"<{body['dashboard_url']}|Open in kvscope>"], text
        assert visible(body["message"])
    texts = "\n".join(b["text"] for b in bodies)
    assert "&lt;img src=x onerror=alert(1)&gt;" in texts  # the example request's pod
    for msg in inbox.messages():
        assert "Bcc" not in msg and "X-Forged" not in msg
        assert msg["To"] == "oncall@example.com" and visible(msg["Subject"])
        assert visible(msg.get_content()) and "\nBcc:" not in msg.get_content()
    states = hostile.named("alert_state")
    assert all(visible(m) for m in states["message"].to_list())


def test_a_slack_notice_pings_nobody() -> None:
    """The Slack text of a notice whose tenant, request ids and pods are Slack control sequences."""
    rule = parse_rules(RULES, "hostile.toml")[0]
    evidence = {"tenant": SLACK, "cause": "prefix_drift", "sub_cause": "volatile_system", "request_id": SLACK,
                "pod": "<@U123>", "predecessor_request_id": "<!here>", "predecessor_pod": CRLF, "gap_ms": 1000.0,
                "changed_segment": "system", "fix": "Move it."}
    ev = Evaluation(rule, "firing", 90.0, f"{untrusted.tenant(SLACK)}: 90 % of its missed tokens", evidence, NOW,
                    NOW - timedelta(hours=1), NOW, changed_at=NOW, notice="firing")
    body = payload(ev, BASE_URL)
    assert "<!" not in body["text"] and "<@" not in body["text"] and "<http://evil" not in body["text"]
    assert "&lt;!channel&gt;" in body["text"] and "&lt;!here&gt;" in body["text"]
    assert visible(body["text"]) and "a\\x0d\\x0aBcc" in body["text"]
    assert body["evidence"]["tenant"] == SLACK  # the structured fields keep the value as stored (JSON-encoded)
    assert body["labels"]["tenant"] == SLACK


# -- the command line and the dashboard (their own chDB directory: one process per directory) --------------------
@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chDB directory holding the hostile traffic of the last two hours (wall clock: the alerts command
    evaluates now), loaded with ``kvscope import gateway-log``, and alert states from ``kvscope alerts --once``."""
    d = tmp_path_factory.mktemp("hostile-cli")
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    log = write_log(d / "gateway.jsonl", now)
    (d / "rules.toml").write_text(RULES)
    for args in (["import", "gateway-log", str(log)], ["alerts", "--once", "--rules", str(d / "rules.toml")]):
        done = subprocess.run([sys.executable, "-m", "kvscope.cli", *args, "--data-dir", str(d / "data")],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    return d / "data"


def in_terminal(*args: str, columns: int = 200) -> bytes:
    """What ``kvscope ARGS`` writes to a real pseudo-terminal (stdout is a TTY: styled output, no stripping)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.cli", *args], stdout=follower, stderr=subprocess.DEVNULL,
                            cwd=ROOT, env=env)
    os.close(follower)
    out = b""
    # selectors (epoll), not select.select: this process may hold more than 1024 descriptors by now (chDB keeps
    # three /proc files open per thread it started), and select() refuses any descriptor past 1023
    with selectors.DefaultSelector() as sel:
        sel.register(leader, selectors.EVENT_READ)
        while True:
            if not sel.select(120):
                proc.kill()
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    proc.wait(timeout=60)
    os.close(leader)
    return out


#: What may reach a terminal: SGR styling (rich's bold header), nothing else that starts with ESC.
_STYLING = re.compile(rb"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("fmt,columns", [("table", 200), ("table", 30), ("markdown", 200)])
def test_terminal_tables_never_pass_escape_sequences(hostile_dir: Path, fmt: str, columns: int) -> None:
    out = in_terminal("query", "dimensions", "--format", fmt, "--data-dir", str(hostile_dir), columns=columns)
    assert b"tenant" in out
    rest = _STYLING.sub(b"", out)
    assert b"\x1b" not in rest and b"\x07" not in rest and "\u202e".encode() not in rest
    assert b"\\x1b[31mred" in rest or b"\\\\x1b\\[31mred" in rest  # the value, written out
    if fmt == "markdown":
        assert b"<script>" not in rest and b"\\<script\\>" in rest and b"\\*\\*bold" in rest


def test_terminal_table_cells_render_as_written() -> None:
    df = pl.DataFrame({"v": [ANSI, CRLF, BIDI, MARKDOWN], "n": [1, 2, 3, 4]})
    table = render_table(df, 200)
    assert visible(table) and "\\x1b[31mred" in table and "a Bcc: evil" in table  # line breaks become spaces
    md = render_markdown(df)
    assert visible(md) and md.count("\n") == 6 and "\\[link\\](javascript" in md


def test_alerts_refuse_a_data_dir_that_holds_nothing(tmp_path: Path) -> None:
    """A mistyped --data-dir once became a new, empty store whose rules all read "ok"."""
    done = subprocess.run([sys.executable, "-m", "kvscope.cli", "alerts", "--once", "--data-dir",
                           str(tmp_path / "typo")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and "no kvscope data at" in done.stderr
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("command", [["query", "tokens"], ["sql", "SELECT count() FROM gateway_requests"],
                                     ["alerts", "--once"]])
def test_a_read_command_refuses_a_database_that_does_not_exist(tmp_path: Path, command: list[str]) -> None:
    """A mistyped --database once became a new, empty database, migrated, whose answers read 0 tokens and rules
    "ok". A read-only command now names it and exits 1; no database is created. (Subprocesses: chDB opens one data
    directory per process, and this one holds the session's.)"""
    data_dir = str(tmp_path / "data")
    subprocess.run([sys.executable, "-m", "kvscope.cli", "migrate", "--data-dir", data_dir], check=True, cwd=ROOT,
                   capture_output=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "kvscope.cli", *command, "--data-dir", data_dir, "--database",
                           "typo_db"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and "database 'typo_db' does not exist" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    check = subprocess.run([sys.executable, "-c", "import sys; from ingest.store import Store; s = Store.open("
                            "data_dir=sys.argv[1]); print(s.query_rows('EXISTS DATABASE typo_db')[0][0])", data_dir],
                           capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    assert check.stdout.strip() == "0"


@pytest.mark.parametrize("text", ["", "# all rules removed\n"])
def test_alerts_refuse_a_rules_file_without_rules(tmp_path: Path, text: str) -> None:
    """An empty rules file once evaluated nothing and exited 0: every alert silently off."""
    from dashboard.alert_rules import AlertRulesError, load_rules

    (tmp_path / "rules.toml").write_text(text)
    with pytest.raises(AlertRulesError, match="no \\[\\[rule\\]\\] table"):
        load_rules(tmp_path / "rules.toml")


def test_mail_addresses_are_checked_before_anything_is_sent(hostile_dir: Path, tmp_path: Path) -> None:
    """A CR/LF in --to once ended in a traceback (the To header refused it), and 'not an address' was handed to
    the SMTP server; each is now one line naming the setting, exit 1, before the store is read."""
    from dashboard.alert_delivery import Notifier
    from dashboard.mail import MailError
    from kvscope.schedule import check_schedule

    base = [sys.executable, "-m", "kvscope.cli", "digest", "--data-dir", str(hostile_dir), "--dry-run",
            str(tmp_path / "d.eml")]
    for to in ("oncall@example.com\r\nBcc: evil@example.com", "not an address"):
        done = subprocess.run([*base, "--to", to], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("Error: --to: ") and "Traceback" not in done.stderr
    assert not (tmp_path / "d.eml").exists()
    ok = {"KVSCOPE_SMTP_HOST": "smtp.example.com"}
    with pytest.raises(MailError, match="KVSCOPE_ALERT_TO"):
        Notifier.from_config(build_config({}, environ={**ok, "KVSCOPE_ALERT_TO": "a@example.com,oops"}))
    with pytest.raises(MailError, match="KVSCOPE_MAIL_FROM"):
        MailSettings.from_config(build_config({}, environ={**ok, "KVSCOPE_MAIL_FROM": "x\nBcc: y@example.com"}))
    with pytest.raises(ValueError, match="KVSCOPE_DIGEST_TO"):
        check_schedule(build_config({}, environ={**ok, "KVSCOPE_DIGEST_EVERY": "24h", "KVSCOPE_DIGEST_TO": "x"}))
    assert MailSettings.from_config(build_config({}, environ={**ok, "KVSCOPE_MAIL_FROM": "kvscope <k@example.com>"}))


@pytest.fixture(scope="module")
def dashboard_url(hostile_dir: Path) -> Iterator[str]:
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    logf = open(ARTIFACTS / "dashboard-hostile.log", "wb")  # noqa: SIM115 - the dashboard writes it while it runs
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.cli", "dashboard", "--data-dir", str(hostile_dir),
                             "--port", str(port), "--address", "127.0.0.1"], stdout=logf, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError as exc:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the dashboard did not start; see its log in tests/artifacts") from exc
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        logf.close()


#: Elements the page would hold if a value from the log were rendered as markup: links out of the dashboard,
#: images, emphasis of the test's words, Streamlit colours and LaTeX, material icons named by the data.
_INJECTED_JS = """() => {
  const main = document.querySelector('[data-testid=stMain]') || document.body;
  const q = s => Array.from(main.querySelectorAll(s));
  return {
    links: q('a').map(a => a.getAttribute('href') || '')
      .filter(h => /^(javascript|mailto|https?:\\/\\/(?!127\\.0\\.0\\.1))/i.test(h)),
    imgs: q('img').map(i => i.getAttribute('src')).filter(s => s === 'x'),
    emphasis: q('strong, b, em, i, del').map(e => e.innerText).filter(t => ['bold', 'x', 'odel', 'link'].includes(t)),
    colours: q('.stMarkdownColoredText').map(e => e.innerText).filter(t => t === 'red' || t === 'pod'),
    latex: q('.katex').length,
    icons: q('[data-testid=stIconMaterial]').map(e => e.innerText).filter(t => t === 'home'),
    svg_markup: q('svg a, svg tspan[style*="bold"]').map(e => e.textContent).filter(t => !t.includes(' ')),
    text: main.innerText,
  };
}"""


#: Text each page shows once its slowest part is drawn.
READY = {"": "Show these requests", "tenants": "that missed", "miss_causes": "Requests", "alerts": "threshold"}


@pytest.mark.browser
def test_the_dashboard_shows_hostile_ids_as_text(dashboard_url: str) -> None:
    """Every page over the hostile traffic in headless Chromium: no value from the log becomes a link, an image,
    emphasis, a colour, LaTeX, an icon or plotly markup, no script runs, and the values read as written."""
    from playwright.sync_api import sync_playwright

    now = datetime.now(UTC)
    window = f"from={now - timedelta(hours=3):%Y-%m-%dT%H:%M:00Z}&to={now + timedelta(minutes=5):%Y-%m-%dT%H:%M:00Z}"
    request = urllib.request.quote(f"{request_prefix(SCRIPT)}-cur-2")
    pages = ["", "tenants", "miss_causes", f"miss_causes?request_id={request}&", "fingerprints", "pods",
             "data_quality", "alerts"]
    seen: dict[str, dict[str, Any]] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            for path in pages:
                sep = "" if path.endswith("&") else "?"
                page.goto(f"{dashboard_url}/{path}{sep}{window}")
                page.wait_for_selector("[data-testid=stMain]", timeout=60_000)
                ready = READY.get(path.split("?")[0], "")
                if ready:  # the slowest part of the page is drawn
                    page.wait_for_function("t => document.body.innerText.includes(t)", arg=ready, timeout=90_000)
                page.wait_for_timeout(4000)  # the page's other queries and charts
                seen[path] = page.evaluate(_INJECTED_JS)
                name = (path.split("?")[0] or "overview") + ("-request" if "request_id" in path else "")
                page.screenshot(path=str(ARTIFACTS / f"dashboard-hostile-{name}.png"), full_page=True)
        finally:
            browser.close()
    assert dialogs == []
    for path, found in seen.items():
        assert {k: v for k, v in found.items() if k != "text" and v} == {}, (path, found)
        assert "Traceback" not in found["text"] and "\u202e" not in found["text"], path
    overview = seen[""]["text"]  # the Overview is / (Streamlit answers /overview with "Page not found")
    assert "Show these requests" in overview and "Page not found" not in overview
    assert any(t in overview for t in (SCRIPT, "**bold**", "<!channel>", "a\\x0d\\x0aBcc", "\\x1b[31mred",
                                       "\\u202eevil", "(no tenant)"))
    assert f"Requests of {SCRIPT} that missed" in seen["tenants"]["text"]  # a page_link label
    assert "(no tenant)" in seen["tenants"]["text"]
    detail = seen[f"miss_causes?request_id={request}&"]["text"]
    assert f"Request {request_prefix(SCRIPT)}-cur-2" in detail and PODS[0] in detail
    assert "a\\x0d\\x0aBcc" in seen["alerts"]["text"] or "\\u202eevil" in seen["alerts"]["text"]
