"""Hostile input found by trying to break the pipeline: each is dead-lettered with a reason, never raises,
and costs only itself (the good input beside it lands)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

from collector.checkpoint import CheckpointStore
from collector.events import GatewayRequest, encode_event, envelope
from collector.gateway_log import GatewayLogSource, read_file
from collector.kv_decode import message_events
from collector.publish import MemoryQueue, Message, QueuePublisher
from ingest.bulk import load_gateway_log
from ingest.ingester import Ingester
from ingest.source import QueueSource
from kvscope.importer import import_events
from tests.clock import DAY

GOOD = {"log_version": 1, "request_id": "good", "ts": f"{DAY}T12:00:00.000Z", "tenant_id": "acme",
        "pod": "pod-0", "model": "tiny", "prompt_tokens": 762, "cached_tokens": 736, "status": 200, "ttft_ms": 50.0,
        "e2e_ms": 80.0}


def kv(payload: object, seq: int = 1) -> list[bytes]:
    return [b"pod-0", seq.to_bytes(8, "big"), msgspec.msgpack.encode(payload)]


@pytest.mark.parametrize("payload", [
    [1e300, [{"type": "BlockStored", "block_size": 16}]],          # ts out of range (crashed the ingester)
    [float("nan"), []],
    [1795950818.0, {"type": "BlockStored"}],                        # events not a list
])
def test_hostile_kv_messages_are_dead_letters(payload: object) -> None:
    (ev,) = message_events(kv(payload))
    assert ev.schema == "dead_letter" and ev.payload.reason and ev.payload.location == "zmq:pod-0"


@pytest.mark.parametrize("topic", [b"pod-\xff", b"pod-\xfe"])
def test_a_kv_topic_that_is_not_utf8_names_no_pod(topic: bytes) -> None:
    """Both topics decoded to pod-\ufffd: two publishers read as one stream of one pod. Each message is now a dead
    letter saying why."""
    (ev,) = message_events([topic, *kv([1795950818.0, []])[1:]])
    assert ev.schema == "dead_letter" and ev.payload.reason.startswith("topic is not UTF-8")


@pytest.mark.parametrize("event", [
    {"type": "BlockStored", "block_hashes": 5},
    {"type": "BlockStored", "token_ids": ["a"]},
    {"type": "BlockStored", "block_size": -16},
    {"type": "BlockStored", "block_hashes": [-1]},
    {"type": "BlockStored", "medium": 5},
    {"type": "Nope"},
    ["Nope", [1]],
    {"type": 7},
    "BlockStored",
])
def test_a_hostile_kv_event_costs_only_itself(event: object) -> None:
    """The batch keeps its good events at their positions in vLLM's batch; the bad one is its own dead letter."""
    good = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    batch, dead = message_events(kv([1795950818.0, [good, event, good], 0], seq=4))
    assert batch.schema == "kv_event_batch" and batch.payload.seq == 4
    assert [(e.type, e.idx) for e in batch.payload.events] == [("BlockRemoved", 0), ("BlockRemoved", 2)]
    assert dead.schema == "dead_letter" and dead.payload.reason.startswith("event 1 of the batch: ")
    assert dead.payload.location == "zmq:pod-0:0:seq 4:event 1" and dead.payload.raw


_KEY = msgspec.msgpack.encode("type") + msgspec.msgpack.encode("BlockRemoved") + msgspec.msgpack.encode("x")


@pytest.mark.parametrize("event", [
    b"\x82" + _KEY + b"\xa2\xff\xfe",           # a str that is not UTF-8, in a field kvscope never reads
    b"\x82" + _KEY + b"\xc7\x03\xff\x00\x00\x00",  # a timestamp ext with a 3-byte body
    b"\x81\x81\x01\x01\x01",                      # a map whose key is a map
    b"\x91" * 200_000 + b"\xc0",                    # nested deeper than msgspec's recursion limit
], ids=["not-utf8", "bad-timestamp-ext", "map-key", "nested-too-deep"])
def test_a_kv_event_msgpack_cannot_decode_costs_only_itself(event: bytes) -> None:
    """Bytes of one event that msgspec refuses made the whole payload undecodable: one dead letter for the message,
    its good events lost and its seq a gap. The batch is now decoded again event by event (only then: a payload that
    decodes pays nothing): the bad event is its own dead letter, with its bytes, the others are kept. An event nested
    too deep for msgspec to even split the batch cost the whole message until the batch was split without recursion
    (collector/msgpack_split.py)."""
    good = msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"})
    payload = b"\x93" + msgspec.msgpack.encode(1795950818.0) + b"\x93" + good + event + good + b"\x00"
    batch, dead = message_events([b"pod-0", (4).to_bytes(8, "big"), payload])
    assert batch.schema == "kv_event_batch" and batch.payload.seq == 4
    assert [(e.type, e.idx) for e in batch.payload.events] == [("BlockRemoved", 0), ("BlockRemoved", 2)]
    assert dead.schema == "dead_letter" and dead.payload.reason.startswith("event 1 of the batch: ")
    assert base64.b64decode(dead.payload.raw) == event[:49152]  # a dead letter keeps up to 64 KiB of base64


@pytest.mark.parametrize("line", [
    json.dumps({**GOOD, "request_id": "\ud800"}),                   # lone surrogate (crashed the tailer)
    "[" * 100_000 + "]" * 100_000,                                   # recursion
    json.dumps({**GOOD, "ttft_ms": 10**400}),                        # int too large for a float
    '{"request_id": "x", "ts": "2026-11-29T12:00:00Z", "prompt_tokens": 1, "cached_tokens": 0, "ttft_ms": NaN}',
    json.dumps({**GOOD, "status": 70000}),                           # beyond UInt16
    json.dumps({**GOOD, "prompt_tokens": 2**32 + 5}),                # beyond UInt32
    json.dumps({**GOOD, "stream": "false"}),
    json.dumps({**GOOD, "pod": {"name": "x"}}),
    json.dumps({**GOOD, "ts": "9999-01-01T00:00:00Z"}),
    "\x0c", " \x0b ",                                                # not JSON whitespace: not a blank line
])
def test_hostile_log_lines_cost_only_themselves(store, tmp_path: Path, line: str) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "g.jsonl"
    log.write_text(json.dumps(GOOD) + "\n" + line + "\n" + json.dumps({**GOOD, "request_id": "good2"}) + "\n")
    written = import_events(store, read_file(log))
    assert written == {"gateway_requests": 2, "dead_letters": 1}
    assert store.query_rows("SELECT count() FROM gateway_requests")[0][0] == 2
    assert store.query_rows("SELECT count() FROM dead_letters")[0][0] == 1
    assert import_events(store, read_file(log)) == {}  # a re-import writes nothing: every row is already there
    assert store.query_rows("SELECT count() FROM gateway_requests")[0][0] == 2
    assert store.query_rows("SELECT count() FROM dead_letters")[0][0] == 1


@pytest.mark.parametrize("line", ["\x0c", " \x0b "])
def test_a_line_of_a_form_feed_or_vertical_tab_is_a_dead_letter_in_a_bulk_import(store, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                 line: str) -> None:
    """Python's bytes.strip() takes \\x0b and \\x0c for whitespace, JSON does not (RFC 8259): such a line was
    skipped uncounted; it is now a line, and a dead letter. Blank lines (spaces, tabs, CR) are still skipped."""
    log = tmp_path / "g.jsonl"
    log.write_text(json.dumps(GOOD) + "\n \t\r\n" + line + "\n" + json.dumps({**GOOD, "request_id": "good2"}) + "\n")
    stats = load_gateway_log(store, log)
    assert (stats.lines, stats.rows, stats.dead_letters) == (3, 2, 1)


def test_a_refused_envelope_does_not_take_its_message_with_it(store) -> None:  # type: ignore[no-untyped-def]
    """An envelope from another producer that skipped validation: the store refuses its row; the good
    envelope published in the same Kafka-sized message still lands."""
    q = MemoryQueue()
    good = envelope(GatewayRequest(record=GOOD), pod="pod-0", natural_key=("good",), observed_at_ms=1)
    bad = envelope(GatewayRequest(record={**GOOD, "request_id": "bad", "status": 70000}), pod="pod-0",
                   natural_key=("bad",), observed_at_ms=1)
    QueuePublisher(q).publish([good, bad])
    source = QueueSource(q)
    assert len(source.poll()) == 1  # one message carrying both
    Ingester(store, source).run_once()
    assert store.query_rows("SELECT request_id FROM gateway_requests") == [("good",)]
    [(reason,)] = store.query_rows("SELECT reason FROM dead_letters")
    assert "field status" in reason  # the record contract refuses it before the store would


@pytest.mark.parametrize("bad", [
    b'{"schema": "gateway_request", "schema_version": 1, "event_id": "x", "pod": "p", "observed_at_ms": null}',
    b'{"schema": "no_such_kind", "schema_version": 1}',
    b'{"schema": "gateway_request", "schema_version": 99, "event_id": "y", "pod": "p", "observed_at_ms": 1, '
    b'"payload": {"record": {}}}',
    b'17',
])
def test_an_undecodable_envelope_costs_only_itself_not_its_message(store, bad: bytes) -> None:  # type: ignore[no-untyped-def]
    """A message whose array holds one envelope that does not decode (a float the encoder wrote as null, an unknown
    kind or version from another producer): before, the whole message was one dead letter and the good envelopes
    beside it were lost. Now each bad element is its own dead letter (location: the message and the envelope's
    index) and the rest of the message is stored, once also when the message is delivered again."""
    envs = [envelope(GatewayRequest(record={**GOOD, "request_id": rid}), pod="pod-0", natural_key=(rid,),
                     observed_at_ms=1) for rid in ("good", "good2")]
    value = b"[" + encode_event(envs[0]) + b"," + bad + b"," + encode_event(envs[1]) + b"]"
    q = MemoryQueue()
    for _ in range(2):  # a redelivery
        assert q.put_all([Message(topic="kvscope.test", key=b"pod-0", value=value)], timeout=1)
        Ingester(store, QueueSource(q)).run_once()
    assert sorted(store.query_rows("SELECT request_id FROM gateway_requests")) == [("good",), ("good2",)]
    [(reason, location, raw)] = store.query_rows("SELECT reason, location, raw FROM dead_letters")
    assert location.endswith(":envelope 1") and raw == bad.decode(), (reason, location, raw)


def test_a_line_longer_than_the_read_window_is_skipped_not_stuck(tmp_path: Path) -> None:
    log = tmp_path / "g.jsonl"
    log.write_text("x" * 600 + "\n" + json.dumps(GOOD) + "\n")
    tailer = GatewayLogSource(log, CheckpointStore(None), max_bytes=256)
    first, _ = tailer.poll()
    assert [e.schema for e in first] == ["dead_letter"] and "longer than 256" in first[0].payload.reason
    assert [e.schema for e in tailer.poll()[0]] == ["gateway_request"]
