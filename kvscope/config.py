"""Configuration is one table: every setting, its ``KVSCOPE_*`` variable, default and help.

Each process builds a frozen :class:`Config` from command-line flags (highest), then the environment, then
the defaults. An unknown ``KVSCOPE_`` variable stops start-up (a typo must not silently fall back), and so does
a vLLM target list with two targets of one name or one URL under two names.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from collector.publish import DEFAULT_MAX_MESSAGE_BYTES, MIN_MAX_MESSAGE_BYTES
from collector.vllm_metrics import DEFAULT_BODY_SIZE_LIMIT, DEFAULT_LIMITS
from ingest.adhoc import ADHOC_MAX_MEMORY_BYTES
from sql import DATABASE_NAME


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    help: str
    type: type = str

    @property
    def env(self) -> str:
        return "KVSCOPE_" + self.name.upper()


SETTINGS: list[Setting] = [
    Setting("data_dir", str(Path.home() / ".kvscope" / "data"), "chDB data directory (embedded store)"),
    Setting("clickhouse_url", "", "ClickHouse server URL (e.g. http://default:@clickhouse:8123); wins over data_dir"),
    Setting("database", "kvscope", "ClickHouse database name"),
    Setting("clickhouse_cluster", "", "ClickHouse cluster (remote_servers name) to create the database on, "
            "replicated; '' = a single server or chDB"),
    Setting("retention_days", 30, "Days raw rows (requests, answers, vLLM series, KV events, dead letters) are kept, "
            "1 to 3650; set on the tables by the commands that write (docs/scale.md)", int),
    Setting("rollup_retention_days", 400, "Days the per-minute and per-hour rollups are kept, 1 to 3650; set on the "
            "tables by the commands that write (docs/scale.md)", int),
    Setting("adhoc_max_memory_bytes", ADHOC_MAX_MEMORY_BYTES, "Memory one ad hoc query (kvscope sql, the "
            "dashboard's SQL page) may use (ClickHouse max_memory_usage), at least 1 MiB; over it the query fails",
            int),
    Setting("kafka_bootstrap", "", "Kafka bootstrap servers (host:port,...); empty = in-process queue (embedded)"),
    Setting("kafka_max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, "Bytes of value (the JSON batch before "
            "compression) one Kafka message may carry, at least 16384; keep it under the broker's message.max.bytes "
            "and the topics' max.message.bytes (Kafka's default: 1048588). A vLLM KV-event batch larger than this "
            "alone is sent in parts; any other event that large is sent as a dead letter (docs/reliability.md, "
            "\"Message size\")", int),
    Setting("consumer_group", "kvscope-ingest", "Kafka consumer group of the ingesters"),
    Setting("topic_namespace", "kvscope", "Topic prefix: topics are <namespace>.<kind>.v1"),
    Setting("vllm", "", "Comma-separated vLLM targets: NAME=http://host:port or http://host:port (name = host:port); "
            "each name and each URL once"),
    Setting("vllm_label_limit", DEFAULT_LIMITS.labels, "Labels one vLLM /metrics sample may have (Prometheus' "
            "label_limit; vLLM 0.32's cache_config_info has 37); a sample with more is a dead letter, the rest of the "
            "scrape is kept (docs/reliability.md); 0 = no limit", int),
    Setting("vllm_label_name_length_limit", DEFAULT_LIMITS.name_bytes, "Bytes (UTF-8) a label name of a vLLM "
            "/metrics sample may have (Prometheus' label_name_length_limit); longer: the sample is a dead letter; "
            "0 = no limit", int),
    Setting("vllm_label_value_length_limit", DEFAULT_LIMITS.value_bytes, "Bytes (UTF-8) a label value of a vLLM "
            "/metrics sample may have (Prometheus' label_value_length_limit; a model_name or a proxy's instance "
            "label of megabytes); longer: the sample is a dead letter; 0 = no limit", int),
    Setting("vllm_body_size_limit", DEFAULT_BODY_SIZE_LIMIT, "Bytes (uncompressed) a vLLM /metrics body may have "
            "(Prometheus' body_size_limit); over it the scrape fails, counted and dead-lettered with its first 64 KiB, "
            "and the next scrape's increases cover the interval; 0 = no limit", int),
    Setting("gateway_log", "", "Comma-separated gateway fingerprint log files (JSONL) to tail"),
    Setting("kv_events_endpoint", "", "ZMQ endpoint the collector binds for vLLM KV events, e.g. tcp://127.0.0.1:5557"),
    Setting("kv_events_dp_ranks", 1, "Data-parallel ranks per vLLM pod (its --data-parallel-size): vLLM's rank r "
            "publishes to the kv-events endpoint's port + r, so the collector binds that many consecutive ports from "
            "KVSCOPE_KV_EVENTS_ENDPOINT's (1 to 256)", int),
    Setting("kv_events_replay", "", "Comma-separated POD=tcp://host:port of each pod's vLLM KV-event replay socket "
            "(its kv-events-config replay_endpoint); missed batches are fetched from there"),
    Setting("state_dir", "", "Where the collector keeps its checkpoints (log offsets, KV-event sequence numbers); "
            "'' = <data_dir>.state beside an embedded store, ~/.kvscope/state with a ClickHouse server"),
    Setting("queue_max_bytes", 256 << 20, "Embedded mode: bytes the in-process queue may hold (in flight included) "
            "before the collector waits for the ingester", int),
    Setting("scrape_interval_seconds", 5.0, "Seconds between /metrics scrapes of each pod", float),
    Setting("attribution_interval_seconds", 5.0, "Seconds between miss-cause attribution runs", float),
    Setting("attribution_settle_seconds", 2.0, "Requests ingested less than this long ago (store clock) wait for "
            "the next attribution run", float),
    Setting("attribution_overlap_seconds", 300.0, "Each attribution run looks this far before its watermark for "
            "requests still unanswered (inserts that became visible late)", float),
    Setting("attribution_horizon_seconds", 3600.0, "How far back a request's predecessor may be", float),
    Setting("attribution_lookback_seconds", 7 * 86400.0, "How far back a request without a predecessor within the "
            "horizon looks for one beyond it (its reusable part is then beyond_horizon, not cold); "
            "<= the horizon = off", float),
    Setting("default_block_size", 16, "KV block size (tokens) when a pod's vllm:cache_config_info is not seen", int),
    Setting("dashboard_address", "127.0.0.1", "Address the dashboard listens on"),
    Setting("dashboard_port", 8501, "Port of the dashboard", int),
    Setting("gateway_port", 8800, "Port of the reference gateway", int),
    Setting("routing_policy", "round_robin", "Gateway routing policy: round_robin | prefix_affinity"),
    Setting("tokenizer", "", "Path of a HF tokenizer.json the gateway counts segment tokens with"),
    Setting("gateway_block_chain", "auto", "Gateway precise mode, auto or off: auto logs each prompt's KV block chain "
            "(token ids from the serving pod's /tokenize, asked after it answered; pods without /tokenize get none)"),
    Setting("gateway_block_size", 0, "KV block size (tokens) the gateway hashes prompt chains with; 0 = each pod's "
            "vllm:cache_config_info block_size from its /metrics", int),
    Setting("demo_model_dir", "", "Where `kvscope demo` builds and keeps its tiny model (demo/model.py); "
            "'' = ~/.cache/kvscope/tiny-llama"),
    Setting("log_level", "INFO", "Python log level: DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    Setting("metrics_port", 0, "Port serving kvscope's own Prometheus metrics (/metrics); 0 = off", int),
    Setting("gpu_hour_price", 0.0, "Price of one GPU-hour, for the money a miss costs (GPU-seconds x price / 3600); "
            "0 = show GPU-seconds only", float),
    Setting("kv_bytes_per_token", 0.0, "KV-cache bytes per token for the Agent TTL retention cost when a pod's "
            "vllm:cache_config_info lacks kv_cache_memory_bytes / kv_cache_size_tokens; 0 = unknown", float),
    Setting("currency", "USD", "Currency code of gpu_hour_price, shown beside money"),
    Setting("dashboard_url", "", "The dashboard's address as readers reach it (e.g. https://kvscope.example.com), "
            "for drill-down links in the digest and alerts; '' = no links"),
    Setting("smtp_host", "", "SMTP server the digest and alert emails go through; '' = no email"),
    Setting("smtp_port", 587, "SMTP port (587 STARTTLS, 465 SSL, 25 plain)", int),
    Setting("smtp_security", "starttls", "SMTP transport security: starttls | ssl | none"),
    Setting("smtp_username", "", "SMTP user name ('' = no login)"),
    Setting("smtp_password", "", "SMTP password (read from the environment; never logged)"),
    Setting("mail_from", "kvscope@localhost", "From address of the digest and alert emails"),
    Setting("digest_to", "", "Comma-separated recipients of the miss-cause digest"),
    Setting("digest_every", "", "Send the digest this often from `kvscope up` (e.g. 24h, 7d, 30m); '' = never"),
    Setting("alert_rules", "", "Alert rules file (TOML); '' = the built-in rules (docs/alerts.md)"),
    Setting("alert_every_seconds", 60.0, "Seconds between alert rule evaluations in `kvscope up` and `kvscope "
            "alerts --every`", float),
    Setting("alert_webhook_url", "", "URL alert state changes are POSTed to as JSON (Slack, Alertmanager, ...); "
            "'' = none"),
    Setting("alert_to", "", "Comma-separated recipients of alert emails ('' = no alert email)"),
]
BY_NAME = {s.name: s for s in SETTINGS}

#: The longest retention (days) a table's TTL may have: ten years. A TTL is ``toDateTime(ts) + days`` and
#: ClickHouse's DateTime ends at 2106-02-07 06:28:15 UTC; past it the sum wraps around (36,500 days from 2026 is
#: 1990), so every row would expire at once. Ten years keeps the sum inside the range for rows stamped up to 2096.
#: Source: https://clickhouse.com/docs/sql-reference/data-types/datetime (supported range).
MAX_RETENTION_DAYS = 3650


@dataclass(frozen=True)
class Config:
    data_dir: str
    clickhouse_url: str
    database: str
    clickhouse_cluster: str
    retention_days: int
    rollup_retention_days: int
    adhoc_max_memory_bytes: int
    kafka_bootstrap: str
    kafka_max_message_bytes: int
    consumer_group: str
    topic_namespace: str
    vllm: str
    vllm_label_limit: int
    vllm_label_name_length_limit: int
    vllm_label_value_length_limit: int
    vllm_body_size_limit: int
    gateway_log: str
    kv_events_endpoint: str
    kv_events_dp_ranks: int
    kv_events_replay: str
    state_dir: str
    queue_max_bytes: int
    scrape_interval_seconds: float
    attribution_interval_seconds: float
    attribution_settle_seconds: float
    attribution_overlap_seconds: float
    attribution_horizon_seconds: float
    attribution_lookback_seconds: float
    default_block_size: int
    dashboard_address: str
    dashboard_port: int
    gateway_port: int
    routing_policy: str
    tokenizer: str
    gateway_block_chain: str
    gateway_block_size: int
    demo_model_dir: str
    log_level: str
    metrics_port: int
    gpu_hour_price: float
    kv_bytes_per_token: float
    currency: str
    dashboard_url: str
    smtp_host: str
    smtp_port: int
    smtp_security: str
    smtp_username: str
    smtp_password: str
    mail_from: str
    digest_to: str
    digest_every: str
    alert_rules: str
    alert_every_seconds: float
    alert_webhook_url: str
    alert_to: str

    def list(self, name: str) -> list[str]:
        """A comma-separated setting as a list (empty items dropped)."""
        return [x.strip() for x in str(getattr(self, name)).split(",") if x.strip()]


class ConfigError(ValueError):
    """An unknown KVSCOPE_ variable or a value that does not convert."""


def build_config(overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Flags (``overrides``, None values ignored) > environment > defaults. Raises :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    known = {s.env for s in SETTINGS}
    unknown = sorted(k for k in env if k.startswith("KVSCOPE_") and k not in known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = (overrides or {}).get(s.name)
        if raw is None:
            raw = env.get(s.env, s.default)
        if isinstance(raw, list | tuple):
            raw = ",".join(str(x) for x in raw)
        try:
            values[s.name] = s.type(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{s.env}={raw!r}: expected {s.type.__name__}") from exc
    assert {f.name for f in fields(Config)} == set(BY_NAME)
    cfg = Config(**values)
    _check_targets(cfg)
    if cfg.gateway_block_chain not in ("auto", "off"):
        raise ConfigError(f"KVSCOPE_GATEWAY_BLOCK_CHAIN={cfg.gateway_block_chain!r}: expected auto or off")
    if not DATABASE_NAME.fullmatch(cfg.database):
        raise ConfigError(f"KVSCOPE_DATABASE / --database {cfg.database!r}: expected a plain identifier (letters, "
                          "digits and _, not starting with a digit)")
    for name in ("retention_days", "rollup_retention_days"):
        days = getattr(cfg, name)
        if not 1 <= days <= MAX_RETENTION_DAYS:
            raise ConfigError(f"{BY_NAME[name].env}={days}: expected whole days from 1 to {MAX_RETENTION_DAYS} "
                              "(fewer expires every row; more passes the end of ClickHouse's DateTime range, 2106)")
    if cfg.default_block_size < 1:
        raise ConfigError(f"KVSCOPE_DEFAULT_BLOCK_SIZE={cfg.default_block_size}: expected a KV block size of 1 token "
                          "or more")
    if not 1 <= cfg.kv_events_dp_ranks <= 256:
        raise ConfigError(f"KVSCOPE_KV_EVENTS_DP_RANKS={cfg.kv_events_dp_ranks}: expected 1 to 256 ranks")
    if cfg.kafka_max_message_bytes < MIN_MAX_MESSAGE_BYTES:
        raise ConfigError(f"KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={cfg.kafka_max_message_bytes}: expected at least "
                          f"{MIN_MAX_MESSAGE_BYTES} bytes (a dead letter must fit in one message)")
    _check_floats(cfg)
    for name in ("vllm_label_limit", "vllm_label_name_length_limit", "vllm_label_value_length_limit",
                 "vllm_body_size_limit"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{BY_NAME[name].env}={getattr(cfg, name)}: expected 0 (no limit) or a positive limit")
    if cfg.gateway_block_size < 0:
        raise ConfigError(f"KVSCOPE_GATEWAY_BLOCK_SIZE={cfg.gateway_block_size}: expected 0 or a positive size")
    _check_store(cfg)
    return cfg


#: The least memory an ad hoc query may be given (ClickHouse max_memory_usage; 0 would mean no limit there).
MIN_ADHOC_MEMORY_BYTES = 1 << 20
#: Python's log levels a name may give (logging.basicConfig accepts exactly these names).
LOG_LEVELS = tuple(logging.getLevelNamesMapping())


def _check_store(cfg: Config) -> None:
    """The store, logging, mail and gateway settings: a log level Python knows, a ClickHouse URL (and a dashboard URL,
    when given) that is http(s)://host[:port] with a port that exists, a cluster only with a server (chDB is one
    process), an SMTP port 1..65535, a routing policy the gateway has, an ad hoc memory bound from
    :data:`MIN_ADHOC_MEMORY_BYTES` to 2^63 − 1 bytes (ClickHouse's max_memory_usage: 0 there is no bound). Raises
    :class:`ConfigError` naming the variable."""
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"KVSCOPE_LOG_LEVEL={cfg.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
    if cfg.clickhouse_url:
        problem = url_problem(cfg.clickhouse_url)
        if problem:
            raise ConfigError(f"KVSCOPE_CLICKHOUSE_URL={cfg.clickhouse_url!r}: {problem}")
    elif cfg.clickhouse_cluster:
        raise ConfigError(f"KVSCOPE_CLICKHOUSE_CLUSTER={cfg.clickhouse_cluster!r}: a cluster needs a ClickHouse "
                          "server (KVSCOPE_CLICKHOUSE_URL); the embedded store (chDB) is one process")
    if cfg.dashboard_url and (problem := url_problem(cfg.dashboard_url)):
        raise ConfigError(f"KVSCOPE_DASHBOARD_URL={cfg.dashboard_url!r}: {problem} (the digest links to it)")
    if not 1 <= cfg.smtp_port <= 65535:
        raise ConfigError(f"KVSCOPE_SMTP_PORT={cfg.smtp_port}: expected a port from 1 to 65535")
    from gateway.routing import POLICIES

    if cfg.routing_policy not in POLICIES:
        raise ConfigError(f"KVSCOPE_ROUTING_POLICY={cfg.routing_policy!r}: expected one of {', '.join(POLICIES)}")
    if not MIN_ADHOC_MEMORY_BYTES <= cfg.adhoc_max_memory_bytes <= 2**63 - 1:
        raise ConfigError(f"KVSCOPE_ADHOC_MAX_MEMORY_BYTES={cfg.adhoc_max_memory_bytes}: expected bytes from "
                          f"{MIN_ADHOC_MEMORY_BYTES} (1 MiB) to 2^63 - 1; the ad hoc queries are always bounded")


def url_problem(url: str) -> str:
    """Why ``url`` is not an HTTP URL (``http(s)://[user:password@]host[:port][/...]``: a ClickHouse server, the
    dashboard, a vLLM target), or ""."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of 0..65535, an unclosed IPv6 bracket
        return f"expected http(s)://host[:port] ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected http(s)://host[:port]"
    if port == 0:
        return "expected a port from 1 to 65535"
    return ""


#: The longest duration (seconds) a ``*_seconds`` setting may have: ten years, as :data:`MAX_RETENTION_DAYS`
#: (``--every inf`` stopped the alert loop's thread with an OverflowError, leaving the command waiting forever).
MAX_SECONDS = MAX_RETENTION_DAYS * 86400
#: The settings that are the time between two runs of a loop: 0, negative or NaN made the loop run without
#: pause (``threading.Event.wait`` returns at once), evaluating the alerts or scraping the pods flat out.
INTERVALS = ("scrape_interval_seconds", "attribution_interval_seconds", "alert_every_seconds")
#: The options a float setting is also given by, named in its error.
_FLAGS = {"alert_every_seconds": "--every"}


def _check_floats(cfg: Config) -> None:
    """Every float setting finite and not negative (a price, a byte count, a duration); a ``*_seconds`` one at most
    :data:`MAX_SECONDS`; an interval (:data:`INTERVALS`) above 0. Raises :class:`ConfigError` naming the variable
    (and its option)."""
    for s in SETTINGS:
        if s.type is not float:
            continue
        value = getattr(cfg, s.name)
        high = MAX_SECONDS if s.name.endswith("_seconds") else math.inf
        positive = s.name in INTERVALS
        if math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= high:
            continue
        flag = f" / {_FLAGS[s.name]}" if s.name in _FLAGS else ""
        if high == math.inf:
            what = "a finite number, 0 or more"
        else:
            what = f"seconds {'above 0' if positive else '0 or more'}, at most {MAX_SECONDS:,} (ten years)"
        raise ConfigError(f"{s.env}{flag}={value!r}: expected {what}")


def _check_targets(cfg: Config) -> None:
    """Refuse a bad ``vllm`` target list at start: a spec that is not NAME=URL or URL, two targets with one
    name, one URL under two names (:func:`collector.service.check_targets`). Raises :class:`ConfigError`."""
    specs = cfg.list("vllm")
    if not specs:
        return
    from collector.service import parse_targets

    try:
        targets = parse_targets(specs)
    except ValueError as exc:
        raise ConfigError(f"KVSCOPE_VLLM / --vllm: {exc}") from exc
    for t in targets:
        if problem := url_problem(t.metrics_url):
            raise ConfigError(f"KVSCOPE_VLLM / --vllm: target {t.pod!r} at {t.metrics_url!r}: {problem}")


def settings_table() -> str:
    """The settings as a Markdown table (README and ``kvscope settings``)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = "~/.kvscope/data" if s.name == "data_dir" else s.default
        lines.append(f"| `{s.env}` | `{default}` | {s.help} |")
    return "\n".join(lines)
