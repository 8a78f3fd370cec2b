"""Alerts (dashboard/alerts.py, alert_rules.py, alert_delivery.py) on real chDB, with a real local HTTP webhook
receiver (http.server in a thread) and a real SMTP server (aiosmtpd).

The scripted regression: gateway log lines built by the gateway's own fingerprinting (gateway/fingerprint.py,
written by gateway/log.py), loaded with ``kvscope import gateway-log`` (which runs the attribution job), then
rules evaluated window by window with the evaluation clock set to the end of each phase. The cached counts are
those vLLM reports for a pod that keeps every prefix it computed (full blocks of the longest shared prefix;
docs/environment.md): a timestamp at the top of the system prompt leaves nothing to hit.
"""

from __future__ import annotations

import email
import email.policy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from click.testing import CliRunner
from prometheus_client import REGISTRY
from streamlit.testing.v1 import AppTest

from dashboard import causes, data, findings
from dashboard.alert_delivery import Notifier
from dashboard.alert_rules import BUILTIN_RULES_TOML, AlertRulesError, builtin_rules, load_rules, parse_rules
from dashboard.alerts import FIRING, OK, current_states, run_once
from dashboard.mail import MailSettings
from gateway.fingerprint import TokenCounter, fingerprint_chat
from gateway.log import GatewayLogWriter, format_ts
from ingest.store import Store
from kvscope.cli import main
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from tests.clock import DAY
from tests.conftest import free_port
from tests.fixture_data import load_fixture

ROOT = Path(__file__).resolve().parents[1]
CANARY = "PLUMCANARY"  # a word of the system prompt: must never reach a notice
STABLE_SYSTEM = (
    f"You are the billing assistant of Globex. Secret house word {CANARY}. Answer questions about invoices, "
    "payment plans, refunds and taxes in plain language. Always cite the clause of the customer agreement you "
    "rely on, never promise a refund the policy does not allow, and hand the conversation to a human agent when "
    "the customer asks for one or mentions a legal dispute. Keep answers under one hundred and fifty words. "
) * 4
BLOCK = 16  # KVSCOPE_DEFAULT_BLOCK_SIZE's default: what `kvscope import gateway-log` attributes with
TEMPLATE_TOKENS = 12  # chat-template tokens vLLM counts beside the segments
COUNTER = TokenCounter()


# -- receivers ----------------------------------------------------------------------------------------------
class _Hook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts.append({"path": self.path, "type": self.headers["Content-Type"],  # type: ignore[attr-defined]
                                  "raw": body.decode(), "json": json.loads(body)})
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class Receiver(ThreadingHTTPServer):
    """A webhook receiver on 127.0.0.1: every POST's JSON in ``posts``; answers ``status``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Hook)
        self.posts: list[dict[str, Any]] = []
        self.status = 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/kvscope"

    def bodies(self, rule: str) -> list[dict[str, Any]]:
        return [p["json"] for p in self.posts if p["json"]["rule"] == rule]


@pytest.fixture
def webhook() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class Inbox:
    """aiosmtpd handler keeping every message, parsed."""

    def __init__(self) -> None:
        self.messages: list[email.message.EmailMessage] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 (aiosmtpd's name)
        self.messages.append(email.message_from_bytes(envelope.content, policy=email.policy.default))
        return "250 OK"


@pytest.fixture
def smtp() -> Iterator[tuple[Inbox, MailSettings]]:
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    yield inbox, MailSettings(host="127.0.0.1", port=controller.port, security="none", sender="kvscope@test")
    controller.stop()


# -- traffic --------------------------------------------------------------------------------------------------
class Fleet:
    """Writes gateway log lines for chat requests; each pod keeps every prefix it computed (no eviction), so a
    request hits the full blocks of its system prompt when the pod computed that system prompt before."""

    def __init__(self, path: Path) -> None:
        self.writer = GatewayLogWriter(path)
        self.seen: set[tuple[str, str]] = set()

    def request(self, rid: str, tenant: str, pod: str, at: datetime, *, stamped: bool, question: str) -> None:
        system = STABLE_SYSTEM
        if stamped:  # the regression: the current time and a request id first in the system prompt
            system = f"Current time: {format_ts(at.timestamp())} request {uuid.uuid4()}\n" + system
        body = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": question}]}
        fp = fingerprint_chat(body, COUNTER)
        segments = fp.system_tokens + fp.suffix_tokens
        prompt = segments + TEMPLATE_TOKENS
        shared = fp.system_tokens * prompt // segments if (pod, fp.system_hash) in self.seen else 0
        self.seen.add((pod, fp.system_hash))
        self.writer.write({
            "request_id": rid, "ts": format_ts(at.timestamp()), "tenant_id": tenant, "conversation_id": "",
            "agent_run_id": "", "model": "tiny", "pod": pod, "endpoint": "chat.completions", "stream": False,
            "routing_policy": "prefix_affinity", "routing_reason": "affinity_hit", "status": 200, "error": "",
            "prompt_tokens": prompt, "cached_tokens": min(shared, prompt - 1) // BLOCK * BLOCK,
            "completion_tokens": 8, "ttft_ms": 40.0, "e2e_ms": 120.0, "queue_wait_ms": None,
            "tool_latency_ms": None, **fp.to_log_fields(),
        })

    def phase(self, name: str, start: datetime, *, globex_stamped: bool, n: int = 20) -> None:
        """Ten minutes of traffic: ``n`` requests of globex on pod-a and of acme on pod-b, 30 s apart."""
        for i in range(n):
            at = start + timedelta(seconds=30 * i + 1)
            self.request(f"globex-{name}-{i}", "globex", "pod-a", at, stamped=globex_stamped,
                         question=f"Question {i} of {name}: why is my invoice higher this month?")
            self.request(f"acme-{name}-{i}", "acme", "pod-b", at + timedelta(seconds=2), stamped=False,
                         question=f"Question {i} of {name}: can I pay in three instalments?")


def cli(store: Store, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``kvscope ARGS`` against ``store``'s database; returns its output, asserting exit code 0."""
    result = CliRunner().invoke(main, [*args, "--data-dir", store.dsn.removeprefix("chdb://"), "--database",
                                       store.database], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


RULES = """
[[rule]]
name = "drift"
kind = "cause_share"
severity = "critical"
window = "10m"
cause = "prefix_drift/volatile_system"
share_percent = 50
per_tenant = true
min_missed_tokens = 500

[[rule]]
name = "drift_pooled"
kind = "cause_share"
window = "10m"
cause = "prefix_drift"
share_percent = 30

[[rule]]
name = "hit_rate"
kind = "hit_rate_drop"
window = "10m"
drop_pp = 20
per_tenant = true
min_prompt_tokens = 1000

[[rule]]
name = "cardinality"
kind = "cardinality_jump"
window = 600
factor = 3
min_cardinality = 10
"""


def test_timestamp_first_fires_cause_share_once_and_resolves(store: Store, tmp_path: Path, webhook: Receiver,
                                                             smtp: tuple[Inbox, MailSettings]) -> None:
    inbox, mail = smtp
    (tmp_path / "rules.toml").write_text(RULES)
    rules = load_rules(tmp_path / "rules.toml")
    notifier = Notifier(webhook_url=webhook.url, mail=mail, to=["oncall@example.com"],
                        dashboard_url="http://kvscope.test/")
    t0 = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=40)
    log = tmp_path / "gateway.jsonl"
    fleet = Fleet(log)

    def load_and_evaluate(phase: str, start: datetime, stamped: bool) -> dict[str, Any]:
        fleet.phase(phase, start, globex_stamped=stamped)
        assert "0 dead letters" in cli(store, "import", "gateway-log", str(log))
        evs = run_once(store, rules, notifier, now=start + timedelta(minutes=10, seconds=5))
        return {e.rule.name: e for e in evs}

    # healthy: every rule ok, nothing sent (a first "ok" is no change)
    evs = load_and_evaluate("healthy", t0, stamped=False)
    assert {n: e.state for n, e in evs.items()} == {"drift": OK, "drift_pooled": OK, "hit_rate": OK,
                                                     "cardinality": OK}
    assert webhook.posts == [] and inbox.messages == []

    # globex puts a timestamp first: the rule fires within this one evaluation, for globex only
    evs = load_and_evaluate("stamped", t0 + timedelta(minutes=10), stamped=True)
    drift = evs["drift"]
    assert drift.state == FIRING and drift.notice == "firing"
    window = {"since": drift.since.isoformat(), "until": drift.until.isoformat()}
    shares = store.named("miss_causes", {**window, "by_tenant": "1"})
    globex = shares.filter(shares["tenant_id"] == "globex")
    volatile = globex.filter((globex["cause"] == "prefix_drift") & (globex["sub_cause"] == "volatile_system"))
    expected = round(100 * volatile["missed_tokens"].sum() / globex["missed_tokens"].sum(), 1)
    assert drift.value == expected > 80  # the header sits in the first block: the whole system prompt misses
    assert evs["hit_rate"].state == FIRING and evs["cardinality"].state == FIRING
    assert {e.evidence["tenant"] for e in evs.values()} == {"globex"}
    pooled = evs["drift_pooled"]  # all tenants' missed tokens together: globex's drift is most of them
    all_missed = shares["missed_tokens"].sum()
    drift_missed = shares.filter(shares["cause"] == "prefix_drift")["missed_tokens"].sum()
    assert pooled.state == FIRING and pooled.value == round(100 * drift_missed / all_missed, 1)
    assert pooled.message.startswith(f"{pooled.value:g} % of all missed tokens")
    assert "most from globex" in pooled.message
    assert [t["tenant"] for t in pooled.evidence["tenants"]] == ["globex"]

    (body,) = webhook.bodies("drift")
    assert (body["state"], body["severity"], body["tenant"], body["cause"]) == (
        "firing", "critical", "globex", "prefix_drift / volatile_system")
    assert (body["value"], body["threshold"], body["unit"]) == (expected, 50.0, "%")
    assert body["window"] == {"seconds": 600, "since": f"{drift.since:%Y-%m-%dT%H:%M:%SZ}",
                              "until": f"{drift.until:%Y-%m-%dT%H:%M:%SZ}"}
    ev = body["evidence"]
    assert [t["tenant"] for t in ev["tenants"]] == ["globex"]  # acme stays healthy
    assert ev["request_id"].startswith("globex-stamped-") and ev["pod"] == "pod-a"
    assert ev["predecessor_request_id"].startswith("globex-") and ev["predecessor_pod"] == "pod-a"
    assert ev["changed_segment"] == "system" and 0 < ev["gap_ms"] <= 30_000
    assert ev["fix"] == causes.fix_for("prefix_drift", "volatile_system").advice
    example = store.named("miss_requests", {**window, "tenant": "globex", "cause": "prefix_drift", "limit": "1"})
    assert ev["request_id"] == example["request_id"][0]
    assert body["text"].startswith("*[FIRING] drift (critical)*\nglobex: ")
    assert "Move the volatile value" in body["text"] and ev["request_id"] in body["text"]
    # the cause's tokens with their cost beside them (GPU-seconds as miss_causes prices them; none measured here)
    assert (ev["missed_tokens"], ev["gpu_seconds"]) == (volatile["missed_tokens"].sum(), volatile["gpu_seconds"][0])
    cost = "" if ev["gpu_seconds"] is None else f", {findings.cost_text(ev['gpu_seconds'])}"
    assert f"\nMissed: {ev['missed_tokens']:,} tokens of prefix_drift / volatile_system{cost}.\n" in body["text"]
    assert body["dashboard_url"].startswith("http://kvscope.test/miss_causes?from=")
    assert "tenant=globex&cause=prefix_drift&sub_cause=volatile_system" in body["dashboard_url"]
    assert body["status"] == "firing" and body["labels"]["alertname"] == "drift"
    assert body["alerts"][0]["labels"] == body["labels"] and body["labels"]["tenant"] == "globex"
    assert {p["type"] for p in webhook.posts} == {"application/json"} and len(webhook.posts) == 4
    assert all(CANARY not in p["raw"] and "invoice" not in p["raw"] for p in webhook.posts)
    mails = {m["Subject"].split(":")[0]: m for m in inbox.messages}
    assert set(mails) == {"[kvscope FIRING] drift", "[kvscope FIRING] drift_pooled", "[kvscope FIRING] hit_rate",
                          "[kvscope FIRING] cardinality"}
    text = mails["[kvscope FIRING] drift"].get_content()
    assert mails["[kvscope FIRING] drift"]["To"] == "oncall@example.com"
    assert ev["request_id"] in text and "volatile_system" in text and CANARY not in text

    # still firing a minute later: no re-send, the state keeps its start
    fired_at = drift.changed_at
    evs = run_once(store, rules, notifier, now=t0 + timedelta(minutes=21, seconds=5))
    assert {e.rule.name: (e.state, e.notice) for e in evs}["drift"] == (FIRING, "")
    assert len(webhook.posts) == 4 and len(inbox.messages) == 4
    assert current_states(store)["drift"]["changed_at"] == fired_at

    # the timestamp is gone again: a resolved notice, with the evidence it fired on
    evs = load_and_evaluate("recovered", t0 + timedelta(minutes=20), stamped=False)
    assert evs["drift"].state == OK and evs["drift"].notice == "resolved"
    resolved = webhook.bodies("drift")[-1]
    assert (resolved["state"], resolved["status"], resolved["tenant"]) == ("resolved", "resolved", "globex")
    assert resolved["text"].startswith("*[RESOLVED] drift (critical)*") and "Was firing since" in resolved["text"]
    assert resolved["alerts"][0]["endsAt"] and resolved["alerts"][0]["startsAt"]
    assert len(webhook.bodies("drift")) == 2
    assert any(m["Subject"].startswith("[kvscope RESOLVED] drift:") for m in inbox.messages)
    states = current_states(store)
    assert states["drift"]["state"] == "ok" and states["drift"]["changed_at"] > fired_at


def test_source_silent_fires_on_a_stale_pod_through_the_cli(store: Store, webhook: Receiver) -> None:
    sample = ROOT / "tests" / "samples" / "vllm_0.32.0_cpu_real_metrics_1.txt"
    now = datetime.now(UTC)

    def scrape(pod: str, at: datetime) -> None:
        cli(store, "import", "metrics", str(sample), "--pod", pod, "--at", at.isoformat())

    scrape("pod-a", now - timedelta(minutes=10))
    scrape("pod-b", now - timedelta(seconds=5))
    rules = Path(store.dsn.removeprefix("chdb://")) / f"{store.database}-rules.toml"
    rules.write_text('[[rule]]\nname = "scrape_silent"\nkind = "source_silent"\nsource = "vllm_scrape"\n'
                     'silent_seconds = "2m"\nseverity = "critical"\n')
    env = {"KVSCOPE_ALERT_RULES": str(rules), "KVSCOPE_ALERT_WEBHOOK_URL": webhook.url}
    out = cli(store, "alerts", "--once", "--format", "json", env=env)
    (row,) = json.loads(out)
    assert (row["rule"], row["state"], row["unit"], row["threshold"]) == ("scrape_silent", "firing", "s", 120.0)
    assert 600 <= row["value"] < 700 and "pod-a" in row["message"] and "pod-b" not in row["message"]
    (body,) = webhook.bodies("scrape_silent")
    assert body["state"] == "firing" and [p["pod"] for p in body["evidence"]["pods"]] == ["pod-a"]
    assert body["labels"]["pod"] == "pod-a" and body["window"] is None

    assert "firing" in cli(store, "alerts", "--once", env=env)  # the table; still firing: nothing sent
    assert len(webhook.posts) == 1
    scrape("pod-a", datetime.now(UTC))
    (row,) = json.loads(cli(store, "alerts", "--once", "--format", "json", env=env))
    assert row["state"] == "ok" and row["value"] < 60
    assert [b["state"] for b in webhook.bodies("scrape_silent")] == ["firing", "resolved"]


def test_a_row_dated_in_the_future_does_not_keep_a_silent_source_fresh(store: Store) -> None:
    """One scrape stamped next year (a wrong clock, a hostile file) is not a sign of life; one a minute ahead of
    the store's clock (skew) is."""
    sample = ROOT / "tests" / "samples" / "vllm_0.32.0_cpu_real_metrics_1.txt"
    now = datetime.now(UTC)

    def scrape(at: datetime) -> None:
        cli(store, "import", "metrics", str(sample), "--pod", "pod-a", "--at", at.isoformat())

    rules = Path(store.dsn.removeprefix("chdb://")) / f"{store.database}-rules.toml"
    rules.write_text('[[rule]]\nname = "scrape_silent"\nkind = "source_silent"\nsource = "vllm_scrape"\n'
                     'silent_seconds = "2m"\n')
    env = {"KVSCOPE_ALERT_RULES": str(rules)}
    scrape(now - timedelta(minutes=10))
    scrape(now + timedelta(days=400))
    (row,) = json.loads(cli(store, "alerts", "--once", "--format", "json", env=env))
    assert row["state"] == "firing" and 600 <= row["value"] < 700, row
    scrape(now + timedelta(minutes=1))
    (row,) = json.loads(cli(store, "alerts", "--once", "--format", "json", env=env))
    assert row["state"] == "ok" and -90 < row["value"] < 0, row


def test_failed_deliveries_are_counted_and_do_not_stop_the_evaluation(store: Store, webhook: Receiver) -> None:
    webhook.status = 500
    closed = f"http://127.0.0.1:{free_port()}/nobody"
    rules = parse_rules('[[rule]]\nname = "silent"\nkind = "source_silent"\nsource = "gateway_log"\n'
                        'silent_seconds = 60\nper_pod = false\n')
    fleet = Fleet(Path(store.dsn.removeprefix("chdb://")) / f"{store.database}.jsonl")
    fleet.request("old-1", "acme", "pod-a", datetime.now(UTC) - timedelta(minutes=5), stamped=False, question="q")
    cli(store, "import", "gateway-log", str(fleet.writer.path))

    def failed(channel: str) -> float:
        return REGISTRY.get_sample_value("kvscope_alert_notifications_failed_total", {"channel": channel}) or 0.0

    before = failed("webhook"), failed("email")
    notifier = Notifier(webhook_url=webhook.url, mail=MailSettings(host="127.0.0.1", port=free_port(),
                                                                    security="none", timeout_seconds=2),
                        to=["oncall@example.com"])
    (ev,) = run_once(store, rules, notifier)
    assert ev.state == FIRING and len(webhook.posts) == 1  # answered 500
    assert (failed("webhook"), failed("email")) == (before[0] + 1, before[1] + 1)
    assert Notifier(webhook_url=closed).notify([ev]) == 1
    assert failed("webhook") == before[0] + 2
    assert current_states(store)["silent"]["state"] == "firing"  # recorded all the same


def test_kvscope_up_pipeline_evaluates_the_rules_on_schedule(store: Store, tmp_path: Path,
                                                               webhook: Receiver) -> None:
    """The alert thread `kvscope up` starts (kvscope/pipeline.py): the built-in rules are evaluated every
    alert_every_seconds against the running store, after one interval; close() ends the thread."""
    fleet = Fleet(tmp_path / "gateway.jsonl")
    fleet.request("stale-1", "acme", "pod-a", datetime.now(UTC) - timedelta(hours=1), stamped=False, question="q")
    cfg = replace(build_config({}, environ={}), database=store.database, state_dir=str(tmp_path / "state"),
                  gateway_log=str(fleet.writer.path), alert_every_seconds=0.5, attribution_interval_seconds=0.5)
    pipe = Pipeline(cfg, store=store, alerts=(builtin_rules(), Notifier(webhook_url=webhook.url)))
    pipe.start()
    try:
        deadline = time.monotonic() + 60
        while len(store.named("alert_state")) < len(builtin_rules()) or len(webhook.posts) < 1:
            assert time.monotonic() < deadline, store.named("alert_state")
            time.sleep(0.2)
    finally:
        pipe.close()
    assert not [t for t in pipe._threads if t.is_alive()]
    states = current_states(store)
    assert states["gateway_log_silent"]["state"] == "firing"  # the only line is an hour old
    assert states["vllm_scrape_silent"]["state"] == "ok"  # no pod was ever scraped: nothing to watch
    assert [b["rule"] for b in (p["json"] for p in webhook.posts)] == ["gateway_log_silent"]


# -- the rules file -------------------------------------------------------------------------------------------
GOOD = '[[rule]]\nname = "a"\nkind = "cause_share"\ncause = "prefix_drift"\nshare_percent = 50\n'


@pytest.mark.parametrize(("text", "message"), [
    ("[[rule]\nname = 'a'", "rules.toml: not valid TOML"),
    ('[[rule]]\nname = "a"\nkind = "cause_shares"\n', "rules.toml: rule 'a': kind = 'cause_shares': expected one of"),
    ('[[rule]]\nname = "a"\nkind = "cause_share"\ncause = "prefix_drift"\n',
     "rule 'a': missing parameter share_percent"),
    (GOOD + "shares_percent = 3\n", "rule 'a': unknown parameter(s) shares_percent for kind cause_share"),
    (GOOD.replace('"prefix_drift"', '"prefix_drift/volatile"'), "rule 'a': cause = 'prefix_drift/volatile': "
                                                                  "unknown sub-cause 'volatile'"),
    (GOOD.replace('"prefix_drift"', '"drift"'), "rule 'a': cause = 'drift': unknown cause 'drift'"),
    (GOOD + 'window = "90s"\n', "rule 'a': window = '90s': a window is whole minutes"),
    (GOOD + 'window = "soon"\n', "rule 'a': 'soon' is not a duration"),
    (GOOD.replace("50", '"50"'), "rule 'a': share_percent = '50': expected a positive number"),
    (GOOD.replace("50", "150"), "rule 'a': share_percent = 150: a share is at most 100"),
    (GOOD + 'tenant = "acme"\nper_tenant = true\n', "rule 'a': give tenant (one tenant) or per_tenant"),
    (GOOD + 'severity = "page"\n', "rule 'a': severity = 'page': expected one of info, warning, critical"),
    (GOOD + GOOD, "rule 'a': a second rule with this name"),
    ('[[rule]]\nkind = "cause_share"\n', "rule #1: name = None"),
    ('[[rule]]\nname = "b"\nkind = "hit_rate_drop"\ndrop_pp = 5\nsource = "vllm"\nper_tenant = true\n',
     "rule 'b': source = \"vllm\" has no tenants"),
    ('[[rule]]\nname = "c"\nkind = "cardinality_jump"\nfactor = 1\n', "rule 'c': factor = 1: a jump is a factor"),
    ('[[rule]]\nname = "d"\nkind = "source_silent"\nsource = "scrapes"\nsilent_seconds = 60\n',
     "rule 'd': source = 'scrapes': expected one of vllm_scrape, gateway_log, kv_events, attribution"),
    ('[rules]\nname = "x"\n', "rules.toml: unknown top-level key(s) rules"),
])
def test_rules_file_errors_name_the_rule(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises(AlertRulesError) as err:
        load_rules(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_rules_file_values_and_the_built_in_rules(tmp_path: Path) -> None:
    (rule,) = parse_rules(GOOD + 'window = "1h30m"\nseverity = "info"\n')
    assert (rule.kind, rule.severity, rule.window_seconds, rule.threshold, rule.unit) == (
        "cause_share", "info", 5400, 50.0, "%")
    assert (rule.params["cause"], rule.params["sub_cause"], rule.params["per_tenant"]) == ("prefix_drift", "", False)
    (silent,) = parse_rules('[[rule]]\nname = "s"\nkind = "source_silent"\nsource = "kv_events"\n'
                            'silent_seconds = "2m"\n')
    assert (silent.threshold, silent.params["lookback"], silent.window_seconds) == (120.0, 86400, None)
    with pytest.raises(AlertRulesError, match="cannot read it"):
        load_rules(tmp_path / "missing.toml")
    assert [r.name for r in load_rules("")] == [r.name for r in builtin_rules()]
    assert {r.kind for r in builtin_rules()} == {"hit_rate_drop", "cause_share", "cardinality_jump", "source_silent"}
    assert BUILTIN_RULES_TOML in (ROOT / "docs" / "alerts.md").read_text()  # the docs show what runs


# -- state and the page -------------------------------------------------------------------------------------
def alerts_page(store: Store) -> AppTest:
    data.register_store(store)
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("views/alerts.py").run()
    assert not at.exception, at.exception
    return at


def test_alert_state_query_and_the_alerts_page(store: Store) -> None:
    try:
        assert "No rule evaluated yet" in alerts_page(store).info[0].value
    finally:
        data.register_store(None)
    load_fixture(store)
    states = store.named("alert_state").to_dicts()
    assert [(s["rule"], s["state"], s["value"]) for s in states] == [
        ("prefix_drift_share", "firing", 94.0), ("vllm_scrape_silent", "ok", 30.0)]
    assert states[0]["changed_at"] == states[0]["evaluated_at"] and states[1]["changed_at"] < states[1]["evaluated_at"]

    try:
        at = alerts_page(store)
        assert {m.label: m.value for m in at.metric}["Firing"] == "1"
        text = "\n".join(m.value for m in at.markdown).replace("\\", "")  # unescaped
        assert f"**prefix_drift_share** · :red[firing] since {DAY} 12:02:00" in text
        assert "94.0 % vs threshold 50.0 %" in text and "Cause: prefix_drift / volatile_system" in text
        assert f"**vllm_scrape_silent** · :green[ok] since {DAY} 12:00:00" in text
    finally:
        data.register_store(None)


def test_a_cause_notice_says_its_tokens_and_their_cost() -> None:
    """8,512 missed tokens costing 0.6934 GPU-s: "0.693 GPU-s"; at 36,000 EUR per GPU-hour 0.6934 / 3600 × 36,000 =
    6.93 EUR beside them, in the Slack text and the email; without a price no money; without a measurement no
    cost at all."""
    from dashboard.alert_delivery import email_message, payload, summary_lines
    from dashboard.alerts import Evaluation

    now = datetime(2026, 12, 1, 4, 7, tzinfo=UTC)
    rule = parse_rules(BUILTIN_RULES_TOML, "builtin")[0]
    evidence = {"tenant": "globex", "cause": "prefix_drift", "sub_cause": "volatile_system", "missed_tokens": 8512,
                "gpu_seconds": 0.6934}
    ev = Evaluation(rule, FIRING, 91.1, "globex: 91.1 % of its missed tokens", evidence, now, now, now,
                    changed_at=now, notice="firing")
    line = "Missed: 8,512 tokens of prefix_drift / volatile_system, 0.693 GPU-s"
    assert f"{line} · 6.93 EUR." in payload(ev, gpu_hour_price=36000, currency="EUR")["text"].split("\n")
    assert f"{line} · 6.93 EUR." in email_message(ev, ["a@example.com"], gpu_hour_price=36000,
                                                  currency="EUR").get_content()
    assert f"{line}." in summary_lines(ev)
    unmeasured = Evaluation(rule, FIRING, 91.1, "m", {**evidence, "gpu_seconds": None}, now, now, now, now, "firing")
    assert "Missed: 8,512 tokens of prefix_drift / volatile_system." in summary_lines(unmeasured)
