"""docker-compose.yml stays consistent with the CLI and the settings table (no Docker engine here to run it)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml
from click.testing import CliRunner

from kvscope.cli import main
from kvscope.config import SETTINGS, build_config

COMPOSE = yaml.safe_load((Path(__file__).parents[1] / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
KNOWN_ENV = {s.env for s in SETTINGS}


def env_of(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[name].get("environment") or {}).items()}


def test_deployment_has_every_stage() -> None:
    assert {"kafka", "clickhouse", "collector", "ingest", "attribute", "dashboard", "gateway", "vllm"} <= set(SERVICES)
    assert SERVICES["ingest"]["deploy"]["replicas"] == 2
    assert SERVICES["attribute"]["deploy"]["replicas"] == 1  # one writer of request_attribution per database
    assert "--attribution" not in SERVICES["ingest"]["command"]
    assert SERVICES["vllm"]["profiles"] == ["gpu"]
    kafka = env_of("kafka")
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert "zookeeper" not in SERVICES


def test_environment_uses_only_known_settings_and_they_build() -> None:
    for name in SERVICES:
        env = env_of(name)
        kv = {k: v for k, v in env.items() if k.startswith("KVSCOPE_")}
        assert set(kv) <= KNOWN_ENV, f"{name}: unknown {set(kv) - KNOWN_ENV}"
        if kv:
            build_config({}, environ=kv)  # raises on a value that does not convert


def test_commands_are_real_subcommands() -> None:
    runner = CliRunner()
    for name, svc in SERVICES.items():
        cmd = svc.get("command")
        if not cmd or not str(cmd).startswith("kvscope"):
            continue
        argv = shlex.split(cmd)[1:]
        result = runner.invoke(main, [argv[0], "--help"])
        assert result.exit_code == 0, f"{name}: kvscope {argv[0]} --help failed: {result.output}"
        for flag in [a.split("=")[0] for a in argv[1:] if a.startswith("--")]:
            assert flag in result.output, f"{name}: kvscope {argv[0]} has no {flag}"


def test_wiring_matches_across_services() -> None:
    kafka_port = env_of("kafka")["KAFKA_ADVERTISED_LISTENERS"].rsplit(":", 1)[1]
    for name in ("collector", "ingest", "attribute", "gateway", "dashboard"):
        env = env_of(name)
        if name in ("collector", "ingest"):
            assert env["KVSCOPE_KAFKA_BOOTSTRAP"] == f"kafka:{kafka_port}"
        if name in ("ingest", "attribute", "dashboard"):
            assert env["KVSCOPE_CLICKHOUSE_URL"].endswith("@clickhouse:8123")
            password = env_of("clickhouse")["CLICKHOUSE_PASSWORD"]
            assert f":{password}@" in env["KVSCOPE_CLICKHOUSE_URL"]
    dash = env_of("dashboard")
    assert f"{dash['KVSCOPE_DASHBOARD_PORT']}:{dash['KVSCOPE_DASHBOARD_PORT']}" in SERVICES["dashboard"]["ports"]
    gw = env_of("gateway")
    assert f"{gw['KVSCOPE_GATEWAY_PORT']}:{gw['KVSCOPE_GATEWAY_PORT']}" in SERVICES["gateway"]["ports"]
    # vLLM's KV-event publisher connects to the port the collector binds; its topic names the pod
    kv_port = env_of("collector")["KVSCOPE_KV_EVENTS_ENDPOINT"].rsplit(":", 1)[1]
    vllm_cmd = SERVICES["vllm"]["command"]
    kv_cfg = json.loads(vllm_cmd.split("--kv-events-config", 1)[1].strip().strip("'").split("'")[0])
    assert kv_cfg["endpoint"] == f"tcp://collector:{kv_port}"
    pod_names = [t.split("=")[0] for t in env_of("collector")["KVSCOPE_VLLM"].split(",")]
    assert kv_cfg["topic"] in pod_names
    assert "vllm-0=http://vllm:8000" in SERVICES["gateway"]["command"]
    # the collector's checkpoints survive a container restart
    state = env_of("collector")["KVSCOPE_STATE_DIR"]
    assert any(v.endswith(":" + state) for v in SERVICES["collector"]["volumes"])
