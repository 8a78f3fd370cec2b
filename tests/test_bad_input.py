"""Bad input is counted and dead-lettered with its reason; the pipeline keeps going and loses nothing else.

Real things only: a real HTTP server serves the /metrics bodies, a real file is tailed, real chDB stores the
rows, and (for the contract test) a real Kafka-protocol broker carries a garbage message."""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from kafka import KafkaProducer
from prometheus_client import REGISTRY

from collector.events import topic_for
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from tests.clock import DAY

SAMPLES = Path(__file__).parent / "samples"


class MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def serve(body: bytes) -> http.server.ThreadingHTTPServer:
    handler = type("H", (MetricsHandler,), {"body": body})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def wait_rows(store, sql: str, n: int, timeout: float = 60.0) -> int:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    got = 0
    while time.time() < deadline:
        got = store.query_rows(sql)[0][0]
        if got >= n:
            return got
        time.sleep(0.2)
    return got


def good_record(i: int) -> dict:
    return {"log_version": 1, "request_id": f"good-{i}", "ts": f"{DAY}T12:00:0{i}.000Z",
            "tenant_id": "acme", "pod": "pod-0", "model": "tiny", "prompt_tokens": 762, "cached_tokens": 736,
            "completion_tokens": 8, "ttft_ms": 50.0, "e2e_ms": 80.0, "status": 200}


def test_malformed_metrics_and_log_lines_are_dead_lettered(store, tmp_path: Path) -> None:
    good_body = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_bytes()
    broken = good_body.replace(b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 4064.0',
                               b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny" 40x64.0')
    assert broken != good_body
    srv_bad = serve(broken)
    srv_junk = serve(b"<html>502 Bad Gateway</html>\n")
    log = tmp_path / "gateway.jsonl"
    lines = [json.dumps(good_record(1)), "{not json", json.dumps({"log_version": 1, "request_id": "x"}),
             json.dumps({**good_record(2), "cached_tokens": 900}), json.dumps(good_record(3)),
             json.dumps({**good_record(4), "ts": "yesterday"}), "[1, 2]"]
    log.write_text("\n".join(lines) + "\n")
    before = REGISTRY.get_sample_value("kvscope_dead_letters_total", {"source": "gateway_log"}) or 0.0
    cfg = replace(build_config({}, environ={}), database=store.database, state_dir=str(tmp_path / "state"),
                  vllm=f"bad=http://127.0.0.1:{srv_bad.server_port},junk=http://127.0.0.1:{srv_junk.server_port}",
                  gateway_log=str(log), scrape_interval_seconds=0.5, attribution_interval_seconds=3600)
    pipe = Pipeline(cfg, store=store)
    pipe.start()
    try:
        assert wait_rows(store, "SELECT count() FROM gateway_requests", 2) == 2
        assert wait_rows(store, "SELECT count() FROM dead_letters WHERE source = 'gateway_log'", 5) == 5
        assert wait_rows(store, "SELECT uniqExact(event_id) FROM dead_letters WHERE source = 'vllm_metrics'", 2) >= 2
        # two scrapes of the broken body at least (under load the two dead letters above may be one per pod)
        assert wait_rows(store, "SELECT count() FROM vllm_metrics WHERE pod = 'bad' "
                                "AND name = 'vllm:num_requests_running'", 2, timeout=60) >= 2
        # the pipeline keeps going: a line appended later still arrives
        with log.open("a") as fh:
            fh.write(json.dumps(good_record(5)) + "\n")
        assert wait_rows(store, "SELECT count() FROM gateway_requests", 3) == 3
    finally:
        pipe.close()
        srv_bad.shutdown()
        srv_junk.shutdown()
    reasons = dict(store.query_rows(
        "SELECT raw, any(reason) FROM dead_letters WHERE source = 'gateway_log' GROUP BY raw"))
    assert reasons["{not json"].startswith("not JSON")
    assert "missing field ts" in reasons[json.dumps({"log_version": 1, "request_id": "x"})]
    assert "exceeds prompt_tokens" in reasons[lines[3]]
    assert "RFC 3339" in reasons[lines[5]]
    assert "not an object" in reasons["[1, 2]"]
    metric_dl = store.query_rows("SELECT reason, raw, location FROM dead_letters WHERE source = 'vllm_metrics'")
    assert any("unparseable sample line" in r[0] and "40x64.0" in r[1] for r in metric_dl)
    junk = [r for r in metric_dl if f":{srv_junk.server_port}/" in r[2]]
    assert junk and all(r[1] == "<html>502 Bad Gateway</html>" for r in junk)
    assert all(r[0].startswith("an HTML page, not Prometheus text") for r in junk), junk  # one per body
    # the rest of the broken body was kept: its gauges land with every scrape, and its cache config once
    gauges = store.query_rows("SELECT count(), uniqExact(ts) FROM vllm_metrics WHERE pod = 'bad' "
                              "AND name = 'vllm:num_requests_running'")[0]
    assert gauges[0] == gauges[1] >= 2
    assert store.query_rows("SELECT block_size FROM vllm_cache_config WHERE pod = 'bad'")[0][0] == 32
    after = REGISTRY.get_sample_value("kvscope_dead_letters_total", {"source": "gateway_log"})
    assert after - before == 5


@pytest.mark.broker
def test_garbage_kafka_message_is_dead_lettered_and_committed(store, kafka_bootstrap: str, tmp_path: Path) -> None:
    ns = f"bad{uuid.uuid4().hex[:8]}"
    cfg = replace(build_config({}, environ={}), database=store.database, kafka_bootstrap=kafka_bootstrap,
                  state_dir=str(tmp_path / "state"),
                  topic_namespace=ns, consumer_group=f"{ns}-g", attribution_interval_seconds=3600)
    pipe = Pipeline(cfg, store=store, collect=True)  # creates the topics; no sources configured
    pipe.start()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        producer.send(topic_for("gateway_request", ns), key=b"pod-0", value=b"\x00garbage")
        producer.send(topic_for("gateway_request", ns), key=b"pod-0",
                      value=json.dumps([{"schema": "gateway_request", "schema_version": 99, "event_id": "e",
                                         "pod": "p", "engine": "", "observed_at_ms": 0,
                                         "payload": {"type": "gateway_request", "record": {}}}]).encode())
        producer.flush()
        pipe.collector.publisher.publish(  # type: ignore[union-attr]
            __import__("collector.gateway_log", fromlist=["x"]).read_file(_write_one(good_record(7))))
        assert wait_rows(store, "SELECT count() FROM dead_letters WHERE source = 'ingest'", 2, 60) == 2
        assert wait_rows(store, "SELECT count() FROM gateway_requests", 1, 60) == 1
        reasons = [r[0] for r in store.query_rows("SELECT reason FROM dead_letters WHERE source = 'ingest'")]
        assert any("not a batch of kvscope envelopes" in r for r in reasons)
        assert any("unsupported schema_version 99" in r for r in reasons)
    finally:
        producer.close()
        pipe.close()


def _write_one(record: dict) -> Path:
    import tempfile

    p = Path(tempfile.mkdtemp()) / "one.jsonl"
    p.write_text(json.dumps(record) + "\n")
    return p
