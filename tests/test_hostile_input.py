"""Hostile input found by trying to break the pipeline: each is dead-lettered with a reason, never raises,
and costs only itself (the good input beside it lands)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from collector.checkpoint import CheckpointStore
from collector.events import GatewayRequest, envelope
from collector.gateway_log import GatewayLogSource, read_file
from collector.kv_decode import message_events
from collector.publish import MemoryQueue, QueuePublisher
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


def test_a_line_longer_than_the_read_window_is_skipped_not_stuck(tmp_path: Path) -> None:
    log = tmp_path / "g.jsonl"
    log.write_text("x" * 600 + "\n" + json.dumps(GOOD) + "\n")
    tailer = GatewayLogSource(log, CheckpointStore(None), max_bytes=256)
    first, _ = tailer.poll()
    assert [e.schema for e in first] == ["dead_letter"] and "longer than 256" in first[0].payload.reason
    assert [e.schema for e in tailer.poll()[0]] == ["gateway_request"]
