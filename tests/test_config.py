"""The settings table: every setting documented, env and flags applied, unknown KVSCOPE_ variables and
duplicate vLLM targets refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from collector.publish import MemoryQueue, QueuePublisher
from collector.service import Collector, Target, parse_targets
from kvscope.cli import main
from kvscope.config import SETTINGS, ConfigError, build_config, settings_table


def test_every_setting_has_help_and_is_in_the_readme() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for s in SETTINGS:
        assert s.help and len(s.help) > 10, s.name
        assert f"`{s.env}`" in readme, f"{s.env} is not documented in README.md"


def test_readme_settings_table_is_the_settings_table() -> None:
    """README's Settings table is `kvscope settings` as printed: defaults and meanings, not only the names."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert settings_table() in readme


#: Where a product process reads an environment variable by name (bench/ and tests/ are tools, not the product).
ENV_READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](KVSCOPE_[A-Z0-9_]+)["']""")


def test_every_kvscope_variable_the_product_reads_is_a_setting() -> None:
    """A KVSCOPE_ variable read anywhere in the product must be a setting: build_config refuses any other as
    unknown, so setting it (e.g. KVSCOPE_DEMO_MODEL_DIR for `kvscope demo`) stopped every command at start."""
    root = Path(__file__).parents[1]
    read = {m.group(1) for d in ("collector", "ingest", "kvscope", "gateway", "dashboard", "demo", "sql")
            for f in (root / d).rglob("*.py") for m in ENV_READ.finditer(f.read_text())}
    assert "KVSCOPE_DEMO_MODEL_DIR" in read  # the scan sees demo/model.py
    assert read <= {s.env for s in SETTINGS}, sorted(read - {s.env for s in SETTINGS})
    cfg = build_config({}, environ={"KVSCOPE_DEMO_MODEL_DIR": "/tmp/kvscope-model"})
    assert cfg.demo_model_dir == "/tmp/kvscope-model"


def test_precedence_flags_over_env_over_default() -> None:
    cfg = build_config({"dashboard_port": 9000}, environ={"KVSCOPE_DASHBOARD_PORT": "8000",
                                                          "KVSCOPE_SCRAPE_INTERVAL_SECONDS": "2.5"})
    assert cfg.dashboard_port == 9000
    assert cfg.scrape_interval_seconds == 2.5
    assert build_config({}, environ={}).database == "kvscope"


def test_unknown_variable_stops_startup() -> None:
    with pytest.raises(ConfigError, match="KVSCOPE_DATADIR"):
        build_config({}, environ={"KVSCOPE_DATADIR": "/tmp/x"})


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match="KVSCOPE_DASHBOARD_PORT"):
        build_config({}, environ={"KVSCOPE_DASHBOARD_PORT": "eighty"})


@pytest.mark.parametrize(("vllm", "message"), [
    ("a=http://h:8000,a=http://h:8001", "two vLLM targets are named 'a'"),
    ("http://h:8000,http://h:8000/metrics", "two vLLM targets are named 'h:8000'"),  # the default name is host:port
    ("a=http://h:8000,b=http://H:8000/metrics", "vLLM target http://H:8000/metrics is given twice, as 'a' and 'b'"),
    ("a=h:8000", "must be an http(s) URL"),
])
def test_bad_vllm_targets_stop_startup(vllm: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config({"vllm": vllm}, environ={})
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config({}, environ={"KVSCOPE_VLLM": vllm})


def test_distinct_vllm_targets_are_accepted() -> None:
    cfg = build_config({"vllm": ["a=http://h:8000", "b=http://h:8001", "http://g:8000"]}, environ={})
    assert [t.pod for t in parse_targets(cfg.list("vllm"))] == ["a", "b", "g:8000"]


def test_a_collector_refuses_two_targets_with_one_name() -> None:
    """Before: accepted, and the two pods' counters interleaved as one series."""
    with pytest.raises(ValueError, match="two vLLM targets are named 'pod-0'"):
        Collector(publisher=QueuePublisher(MemoryQueue()),
                  targets=[Target("pod-0", "http://a:8000/metrics"), Target("pod-0", "http://b:8000/metrics")])


def test_the_cli_refuses_two_targets_with_one_name() -> None:
    result = CliRunner().invoke(main, ["collect", "--kafka-bootstrap", "localhost:1", "--vllm", "a=http://h:1",
                                       "--vllm", "a=http://h:2"], env={})
    assert result.exit_code == 2 and "two vLLM targets are named 'a'" in result.output


def test_every_command_option_has_help() -> None:
    """`kvscope CMD --help` explains every option (dashboard's --port/--address, the gateway's --policy/--host and
    the demo's --routing-policy printed bare), and names the setting an option overrides when there is one."""
    import click

    bare: list[str] = []

    def walk(cmd: click.Command, path: str) -> None:
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}")
            return
        for p in cmd.params:
            if isinstance(p, click.Option) and not (p.help or "").strip():
                bare.append(f"{path} {p.opts[0]}")

    walk(main, "kvscope")
    assert bare == []
    result = CliRunner().invoke(main, ["dashboard", "--help"])
    assert "[KVSCOPE_DASHBOARD_PORT]" in result.output and "[KVSCOPE_DASHBOARD_ADDRESS]" in result.output


def test_the_label_limits_are_settings_and_a_negative_one_stops_startup() -> None:
    """The bounds on a vLLM sample's labels (collector/vllm_metrics.py LabelLimits) come from the settings the
    collector and `kvscope import metrics` are given; 0 is no limit; a negative one is refused, named."""
    from collector.vllm_metrics import LabelLimits
    from kvscope.pipeline import label_limits

    assert label_limits(build_config(environ={})) == LabelLimits(64, 128, 1024)
    env = {"KVSCOPE_VLLM_LABEL_LIMIT": "0", "KVSCOPE_VLLM_LABEL_NAME_LENGTH_LIMIT": "7",
           "KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT": "9"}
    assert label_limits(build_config(environ=env)) == LabelLimits(0, 7, 9)
    assert LabelLimits(0, 0, 0).problem({f"l{i}": "v" * 10_000 for i in range(100)}) == ""
    with pytest.raises(ConfigError, match="KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT=-1"):
        build_config(environ={"KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT": "-1"})


@pytest.mark.parametrize("size", ["0", "-16"])
def test_a_default_block_size_below_one_token_stops_startup(size: str) -> None:
    with pytest.raises(ConfigError, match="KVSCOPE_DEFAULT_BLOCK_SIZE"):
        build_config({}, environ={"KVSCOPE_DEFAULT_BLOCK_SIZE": size})


@pytest.mark.parametrize(("variable", "value"), [
    ("KVSCOPE_LOG_LEVEL", "LOUD"), ("KVSCOPE_LOG_LEVEL", "5"), ("KVSCOPE_LOG_LEVEL", "info"),
    ("KVSCOPE_CLICKHOUSE_URL", "http://127.0.0.1:99999"), ("KVSCOPE_CLICKHOUSE_URL", "http://[::1"),
    ("KVSCOPE_CLICKHOUSE_URL", "notaurl"), ("KVSCOPE_CLICKHOUSE_URL", "ftp://ch:8123"),
    ("KVSCOPE_CLICKHOUSE_URL", "http://ch:0"), ("KVSCOPE_CLICKHOUSE_CLUSTER", "c"),
    ("KVSCOPE_ADHOC_MAX_MEMORY_BYTES", "0"), ("KVSCOPE_ADHOC_MAX_MEMORY_BYTES", "-1"),
    ("KVSCOPE_ADHOC_MAX_MEMORY_BYTES", "99999999999999999999999"), ("KVSCOPE_DASHBOARD_URL", "javascript:alert(1)"),
    ("KVSCOPE_DASHBOARD_URL", "not a url"), ("KVSCOPE_SMTP_PORT", "-5"), ("KVSCOPE_SMTP_PORT", "70000"),
    ("KVSCOPE_ROUTING_POLICY", "banana"), ("KVSCOPE_VLLM", "http://h:99999"), ("KVSCOPE_VLLM", "a=ftp://h:8000"),
])
def test_a_bad_store_or_log_setting_stops_startup_naming_it(variable: str, value: str) -> None:
    """Before: an unknown log level broke every command at logging.basicConfig, a URL with a port past 65535 or an
    open IPv6 bracket raised ValueError from urllib, a cluster with chDB a ValueError from Store.open, each a
    traceback; a URL without a scheme was read as localhost:8123; an ad hoc memory bound of 0 meant no bound and one
    past UInt64 failed only when a query ran, without naming the variable. Each is now a ConfigError naming it,
    and the CLI prints one line and exits 2."""
    with pytest.raises(ConfigError, match=variable):
        build_config({}, environ={variable: value})
    result = CliRunner().invoke(main, ["query", "data_extent"], env={variable: value})
    assert result.exit_code == 2 and variable in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize(("variable", "value"), [
    ("KVSCOPE_LOG_LEVEL", "DEBUG"), ("KVSCOPE_CLICKHOUSE_URL", "http://default:@clickhouse:8123"),
    ("KVSCOPE_CLICKHOUSE_URL", "https://[::1]:8443/"), ("KVSCOPE_ADHOC_MAX_MEMORY_BYTES", str(1 << 20)),
    ("KVSCOPE_DASHBOARD_URL", "https://kvscope.example.com/"), ("KVSCOPE_SMTP_PORT", "465"),
    ("KVSCOPE_ROUTING_POLICY", "prefix_affinity"), ("KVSCOPE_VLLM", "pod-0=http://127.0.0.1:8000"),
])
def test_good_store_and_log_settings_are_accepted(variable: str, value: str) -> None:
    assert build_config({}, environ={variable: value})
