"""A Kafka message never exceeds what the broker accepts, and one oversized event never stalls the pipeline.

Apache Kafka refuses a record batch larger than the broker's ``message.max.bytes`` (default 1,048,588 bytes);
the collector used to put up to 2,000 envelopes of one (kind, pod) in one message whatever their size, so a
burst of long prompts (precise mode's block hashes) or of KV-event batches made a message the broker refused,
and the collector retried it forever: that source stopped. Now each message's value is at most
``KVSCOPE_KAFKA_MAX_MESSAGE_BYTES``, an envelope larger than that alone is a dead letter, and a message the
broker still refuses as too large is split down to dead-lettering the one envelope it cannot take.

Real things only: the tansu Kafka-protocol broker (``kafka_bootstrap``), real chDB (``store``), a real file
tailed by the collector. tansu enforces no size limit, so a broker whose limit is below the setting is stood
for by kafka-python's own check (``max_request_size``), which refuses a record with the same
``MessageSizeTooLargeError`` a broker answers with (error code 10).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from kafka import KafkaConsumer
from prometheus_client import REGISTRY

from collector.events import DeadLetter, Envelope, GatewayRequest, decode_batch, encode_batch, envelope, topic_for
from collector.publish import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KafkaPublisher,
    plan_messages,
    to_messages,
)
from kvscope.config import ConfigError, build_config
from kvscope.pipeline import Pipeline
from tests.clock import DAY
from tests.test_bad_input import wait_rows


def hashes(n: int, seed: int) -> list[str]:
    """``n`` distinct block hashes as the gateway logs them (16 lowercase hex characters)."""
    return [f"{(seed << 32) + i:016x}" for i in range(n)]


def record(i: int, blocks: int = 0, pod: str = "pod-0") -> dict:
    """A gateway log record; ``blocks``: its precise-mode chain length (19 bytes of JSON a block)."""
    rec = {"log_version": 1, "request_id": f"req-{i}", "ts": f"{DAY}T12:{i // 60 % 60:02d}:{i % 60:02d}.000Z",
           "tenant_id": "acme", "pod": pod, "model": "tiny", "prompt_tokens": 16 * max(blocks, 1) + 1,
           "cached_tokens": 0, "completion_tokens": 8, "ttft_ms": 50.0, "e2e_ms": 80.0, "status": 200}
    if blocks:
        rec |= {"prompt_block_hashes": hashes(blocks, i), "prompt_block_size": 16}
    return rec


def request_event(i: int, blocks: int = 0, pod: str = "pod-0") -> Envelope:
    return envelope(GatewayRequest(record=record(i, blocks, pod), source_file="/var/log/gw.jsonl", line_offset=i),
                    pod=pod, natural_key=(f"req-{i}",), observed_at_ms=1_800_000_000_000 + i)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def consume(bootstrap: str, topics: list[str], n_messages: int, timeout: float = 60.0) -> list:
    """Every record of ``topics`` from the start, once at least ``n_messages`` arrived (or ``timeout``)."""
    consumer = KafkaConsumer(*topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=f"probe-{uuid.uuid4().hex[:8]}",
                             session_timeout_ms=6000, heartbeat_interval_ms=2000)
    out: list = []
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and len(out) < n_messages:
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(records)
        # whatever else is there (nothing more is expected: a copy would show up here)
        for records in consumer.poll(timeout_ms=2000).values():
            out.extend(records)
    finally:
        consumer.close()
    return out


# --- to_messages: grouping by bytes -------------------------------------------------------------------------


def test_messages_are_capped_in_bytes_packed_in_order_and_encoded_as_a_batch() -> None:
    cap = 60_000
    # two pods interleaved, sizes from ~300 bytes to ~40 kB
    events = [request_event(i, blocks=(i * 37) % 2000, pod=f"pod-{i % 2}") for i in range(120)]
    messages, oversized = plan_messages(events, max_message_bytes=cap)
    assert oversized == []
    assert len(messages) > 2  # the ~1.5 MB would have been one message per pod
    by_pod: dict[bytes, list[Envelope]] = {}
    for m in messages:
        assert len(m.value) <= cap
        batch = decode_batch(m.value)
        assert m.value == encode_batch(batch)  # exactly the batch encoding the ingester decodes
        by_pod.setdefault(m.key, []).extend(batch)
    for pod in ("pod-0", "pod-1"):  # every envelope once, in its order within (kind, pod)
        assert [e.event_id for e in by_pod[pod.encode()]] == [e.event_id for e in events if e.pod == pod]
    # greedy: a message is cut only where the next envelope would not fit
    for a, b in zip(messages, messages[1:], strict=False):
        if a.key == b.key:
            first_next = encode_batch([decode_batch(b.value)[0]])
            assert len(a.value) + 1 + len(first_next) - 2 > cap


def test_the_event_count_limit_still_applies_and_no_cap_keeps_one_message() -> None:
    events = [request_event(i, blocks=200) for i in range(50)]
    assert [len(decode_batch(m.value)) for m in to_messages(events, max_events_per_message=20)] == [20, 20, 10]
    assert len(to_messages(events)) == 1  # the in-process queue and imports: no byte cap
    assert len(to_messages(events, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES)) == 1  # ~200 kB fits


def test_an_envelope_larger_than_the_cap_alone_becomes_a_dead_letter_and_the_rest_is_sent() -> None:
    cap = 50_000
    big = request_event(7, blocks=4000)  # ~76 kB
    events = [request_event(i, blocks=100) for i in range(7)] + [big] + [request_event(i, 100) for i in range(8, 12)]
    messages, oversized = plan_messages(events, max_message_bytes=cap)
    assert all(len(m.value) <= cap for m in messages)
    data = [e for m in messages if m.topic == topic_for("gateway_request") for e in decode_batch(m.value)]
    assert [e.event_id for e in data] == [e.event_id for e in events if e is not big]
    [dead] = [e for m in messages if m.topic == topic_for("dead_letter") for e in decode_batch(m.value)]
    [o] = oversized
    assert (o.kind, o.pod, o.event_id, o.why) == ("gateway_request", "pod-0", big.event_id, "setting")
    assert o.size == len(encode_batch([big])) > cap
    assert o.dead_letter == dead and dead.pod == "pod-0"
    assert isinstance(dead.payload, DeadLetter)
    assert dead.payload.source == "gateway_log" and dead.payload.location == "/var/log/gw.jsonl:7"
    assert f"{o.size} bytes" in dead.payload.reason and f"KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={cap}" in dead.payload.reason
    assert dead.payload.raw and big.event_id in dead.payload.raw  # the head of the event it stands for
    # a re-send makes the same dead letter (stored once)
    assert plan_messages(events, max_message_bytes=cap)[1][0].dead_letter.event_id == dead.event_id


def test_a_dead_letter_larger_than_the_cap_keeps_its_id_and_reason_and_shows_less_of_its_input() -> None:
    dl = envelope(DeadLetter(source="gateway_log", reason="not JSON", raw="x" * 65_536, location="/gw.jsonl:0"),
                  pod="gateway", natural_key=("/gw.jsonl", 0), observed_at_ms=1_800_000_000_000)
    messages, oversized = plan_messages([dl], max_message_bytes=20_000)
    assert oversized == []
    [m] = messages
    assert len(m.value) <= 20_000
    [sent] = decode_batch(m.value)
    assert isinstance(sent.payload, DeadLetter)
    assert (sent.event_id, sent.payload.reason, sent.payload.location) == (dl.event_id, "not JSON", "/gw.jsonl:0")
    assert 0 < len(sent.payload.raw) < 20_000 and dl.payload.raw.startswith(sent.payload.raw)


def test_the_setting_is_checked_at_start() -> None:
    assert build_config({}, environ={}).kafka_max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert build_config({}, environ={"KVSCOPE_KAFKA_MAX_MESSAGE_BYTES": "500000"}).kafka_max_message_bytes == 500_000
    with pytest.raises(ConfigError, match="KVSCOPE_KAFKA_MAX_MESSAGE_BYTES=100"):
        build_config({}, environ={"KVSCOPE_KAFKA_MAX_MESSAGE_BYTES": "100"})


# --- through the real broker ---------------------------------------------------------------------------------


def pipeline(store, kafka_bootstrap: str, tmp_path: Path, lines: list[dict]) -> Pipeline:  # type: ignore[no-untyped-def]
    log = tmp_path / "gateway.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    ns = f"size{uuid.uuid4().hex[:8]}"
    cfg = replace(build_config({}, environ={}), database=store.database, kafka_bootstrap=kafka_bootstrap,
                  state_dir=str(tmp_path / "state"), gateway_log=str(log), topic_namespace=ns,
                  consumer_group=f"{ns}-g", attribution_interval_seconds=3600)
    pipe = Pipeline(cfg, store=store, attribute=False)
    pipe.start()
    return pipe


@pytest.mark.broker
def test_a_burst_of_several_megabytes_arrives_complete_and_once_in_messages_under_the_cap(
        store, kafka_bootstrap: str, tmp_path: Path) -> None:
    n = 150  # long prompts in precise mode: 2,000 blocks (32k tokens) each, ~38 kB a line, ~5.7 MB in all
    pipe = pipeline(store, kafka_bootstrap, tmp_path, [record(i, blocks=2000) for i in range(n)])
    try:
        assert wait_rows(store, "SELECT count() FROM gateway_requests", n, timeout=120) == n
        cap = pipe.cfg.kafka_max_message_bytes
        records = consume(kafka_bootstrap, [topic_for("gateway_request", pipe.cfg.topic_namespace)], 7)
    finally:
        pipe.close()
    assert sum(len(r.value) for r in records) > 5_000_000
    assert max(len(r.value) for r in records) <= cap  # every message within what a default broker accepts
    ids = [e.event_id for r in records for e in decode_batch(r.value)]
    assert len(ids) == len(set(ids)) == n  # each event once on the broker
    assert store.query_rows("SELECT count(), uniqExact(request_id), sum(length(prompt_block_hashes)) "
                            "FROM gateway_requests") == [(n, n, n * 2000)]
    assert store.query_rows("SELECT count() FROM dead_letters")[0][0] == 0


@pytest.mark.broker
def test_one_event_larger_than_a_message_is_dead_lettered_with_its_reason_and_the_rest_arrives(
        store, kafka_bootstrap: str, tmp_path: Path) -> None:
    oversized_before = metric("kvscope_collector_oversized_events_total", kind="gateway_request", why="setting")
    dead_before = metric("kvscope_dead_letters_total", source="gateway_log")
    # a 60,000-block prompt (~1.1 MB line, 960k tokens) between small ones
    lines = [record(i, blocks=10) for i in range(40)] + [record(40, blocks=60_000)] + \
            [record(i, blocks=10) for i in range(41, 80)]
    pipe = pipeline(store, kafka_bootstrap, tmp_path, lines)
    try:
        assert wait_rows(store, "SELECT count() FROM gateway_requests", 79) == 79
        assert wait_rows(store, "SELECT count() FROM dead_letters", 1) == 1
        cap = pipe.cfg.kafka_max_message_bytes
    finally:
        pipe.close()
    assert sorted(r[0] for r in store.query_rows("SELECT request_id FROM gateway_requests")) == \
        sorted(f"req-{i}" for i in range(80) if i != 40)
    [(source, pod, reason, location, raw)] = store.query_rows(
        "SELECT source, pod, reason, location, raw FROM dead_letters")
    assert (source, pod) == ("gateway_log", "pod-0")
    assert location.endswith("gateway.jsonl:" + str(sum(len(json.dumps(r)) + 1 for r in lines[:40])))
    assert "gateway_request event of " in reason and f"KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={cap}" in reason
    size = int(reason.split("event of ")[1].split(" bytes")[0])
    assert size > cap
    assert '"request_id":"req-40"' in raw
    assert metric("kvscope_collector_oversized_events_total", kind="gateway_request", why="setting") \
        - oversized_before == 1
    assert metric("kvscope_dead_letters_total", source="gateway_log") - dead_before == 1


@pytest.mark.broker
def test_a_broker_limit_below_the_setting_splits_messages_and_dead_letters_what_cannot_fit(
        kafka_bootstrap: str) -> None:
    ns = f"low{uuid.uuid4().hex[:8]}"
    # the setting says 200 kB; the "broker" takes 60 kB (kafka-python's own check refuses with the broker's error)
    pub = KafkaPublisher(kafka_bootstrap, namespace=ns, max_message_bytes=200_000, max_request_size=60_000)
    before = metric("kvscope_collector_oversized_events_total", kind="gateway_request", why="broker")
    small = [request_event(i, blocks=250) for i in range(60)]  # ~5 kB each, 300 kB in all
    big = request_event(60, blocks=5000)  # ~95 kB: under the setting, over the broker's limit
    # a dead letter of a bad line with 64 KiB of it: the broker refuses it too; it is sent with less of the line
    bad = envelope(DeadLetter(source="gateway_log", reason="not JSON", raw="x" * 65_536, location="/gw.jsonl:0"),
                   pod="gateway", natural_key=("/gw.jsonl", 0), observed_at_ms=1_800_000_000_000)
    acked = []
    try:
        pub.publish(small[:30] + [big, bad] + small[30:], on_ack=lambda: acked.append(True))
    finally:
        pub.close()
    assert acked == [True]
    data = consume(kafka_bootstrap, [topic_for("gateway_request", ns)], 6)
    assert max(len(r.value) for r in data) <= 60_000
    got = [e.event_id for r in data for e in decode_batch(r.value)]
    assert sorted(got) == sorted(e.event_id for e in small)  # each once
    dead_letters = {e.pod: e for r in consume(kafka_bootstrap, [topic_for("dead_letter", ns)], 2)
                    for e in decode_batch(r.value)}
    assert sorted(dead_letters) == ["gateway", "pod-0"]
    cut = dead_letters["gateway"]
    assert isinstance(cut.payload, DeadLetter)
    assert (cut.event_id, cut.payload.reason, cut.payload.location) == (bad.event_id, "not JSON", "/gw.jsonl:0")
    assert 0 < len(cut.payload.raw) < 60_000
    dead = dead_letters["pod-0"]
    assert isinstance(dead.payload, DeadLetter) and dead.payload.source == "gateway_log"
    assert "refused by Kafka as too large (MessageSizeTooLargeError)" in dead.payload.reason
    assert "KVSCOPE_KAFKA_MAX_MESSAGE_BYTES=200000; lower the setting" in dead.payload.reason
    assert metric("kvscope_collector_oversized_events_total", kind="gateway_request", why="broker") - before == 1
