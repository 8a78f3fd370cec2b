"""Contract tests: every event kind round-trips through the wire format, ids are deterministic, unknown
fields are ignored, unknown versions refused, and every table has the columns the ingester writes."""

from __future__ import annotations

import json

import pytest

from collector.events import (
    KINDS,
    ContractError,
    DeadLetter,
    GatewayRequest,
    KvBlockEvent,
    KvEventBatch,
    KvEventGap,
    SeriesSample,
    VllmScrape,
    decode_batch,
    encode_batch,
    envelope,
    topic_for,
)
from ingest.rows import COLUMNS, rows_for
from tests.clock import DAY, T0

#: 12:00:00 on the stored test data's day (tests/clock.py), unix ms: inside the tables' retention
AT_MS = int(T0.timestamp()) * 1000
EXAMPLES = [
    VllmScrape(target="http://p:8000/metrics", scraped_at_ms=AT_MS, previous_scraped_at_ms=0,
               duration_ms=2.5,
               samples=[SeriesSample("vllm:prefix_cache_hits_total", "0", "tiny", "", 4064.0, 1408.0)],
               cache_config={"0": {"block_size": "32", "num_gpu_blocks": "128"}}, restarts=["0"]),
    GatewayRequest(record={"log_version": 1, "request_id": "r1", "ts": f"{DAY}T12:00:00.000Z",
                           "tenant_id": "acme", "status": 200, "prompt_tokens": 762, "cached_tokens": 736,
                           "ttft_ms": 50.0, "e2e_ms": 80.0}, source_file="g.jsonl", line_offset=0),
    KvEventBatch(topic="pod-0", seq=10, batch_ts=AT_MS / 1000 + 0.34, dp_rank=0,
                 events=[KvBlockEvent(type="BlockStored", block_hashes=[2**64 - 1], parent_block_hash=None,
                                      token_ids=list(range(32)), block_size=32, medium="GPU", idx=0),
                         KvBlockEvent(type="BlockRemoved", block_hashes=[7], medium="GPU", idx=2)]),  # 1: bad
    KvEventGap(topic="pod-0", dp_rank=0, first_seq=11, last_seq=13, detected_at_ms=AT_MS + 340,
               reason="missed", replayed_batches=3, recovered=True),
    DeadLetter(source="gateway_log", reason="not JSON", raw="{", location="g.jsonl:0"),
]


def test_every_kind_has_an_example() -> None:
    assert {type(e).__struct_config__.tag for e in EXAMPLES} == set(KINDS)


@pytest.mark.parametrize("payload", EXAMPLES, ids=lambda p: type(p).__name__)
def test_round_trip_and_deterministic_id(payload) -> None:  # type: ignore[no-untyped-def]
    ev = envelope(payload, pod="pod-0", natural_key=("k",), observed_at_ms=5)
    again = envelope(payload, pod="pod-0", natural_key=("k",), observed_at_ms=99)
    assert ev.event_id == again.event_id and len(ev.event_id) == 32
    assert envelope(payload, pod="pod-1", natural_key=("k",), observed_at_ms=5).event_id != ev.event_id
    [back] = decode_batch(encode_batch([ev]))
    assert back == ev
    assert topic_for(ev.schema) == f"kvscope.{ev.schema}.v1"


def test_unknown_fields_are_ignored_and_unknown_versions_refused() -> None:
    ev = envelope(EXAMPLES[3], pod="p", natural_key=("k",), observed_at_ms=1)
    obj = json.loads(encode_batch([ev]))
    obj[0]["added_in_v1_1"] = "x"
    obj[0]["payload"]["also_new"] = 1
    assert decode_batch(json.dumps(obj).encode()) == [ev]
    obj[0]["schema_version"] = 2
    with pytest.raises(ContractError, match="schema_version 2"):
        decode_batch(json.dumps(obj).encode())
    obj[0]["schema_version"] = 1
    obj[0]["payload"]["type"] = "no_such_kind"
    with pytest.raises(ContractError):
        decode_batch(json.dumps(obj).encode())


def test_every_table_has_the_columns_written(store) -> None:  # type: ignore[no-untyped-def]
    for table, columns in COLUMNS.items():
        have = {r[0] for r in store.query_rows(
            "SELECT name FROM system.columns WHERE database = currentDatabase() AND table = {t:String}", {"t": table})}
        assert set(columns) <= have, f"{table} lacks {set(columns) - have}"


@pytest.mark.parametrize("payload", EXAMPLES, ids=lambda p: type(p).__name__)
def test_every_kind_maps_to_rows_the_store_accepts(store, payload) -> None:  # type: ignore[no-untyped-def]
    ev = envelope(payload, pod="pod-0", natural_key=("k",), observed_at_ms=AT_MS)
    mapped = rows_for(ev)
    assert mapped and all(rows for _, rows in mapped)
    for table, rows in mapped:
        store.insert(table, rows, COLUMNS[table])
        assert store.query_rows(f"SELECT count() FROM {table}")[0][0] == len(rows) >= 1
