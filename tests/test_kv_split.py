"""A vLLM KV-event batch larger than a Kafka message reaches the store complete, in parts (docs/kv-events.md, "A
batch larger than a Kafka message"; collector/kv_split.py).

It used to become one dead letter, its blocks missing from kv_block_log and kv_block_residency: a long prompt
(thousands of blocks) or a flood of evictions makes such batches, so the evidence went missing exactly when
eviction happened. Now the batch is cut between events, and an event with too many blocks between blocks; every
kv_block_log row, the restart mark of a vLLM start, the named queries' counts are what the whole batch gives, and
a re-send or a redelivery stores nothing twice. Only a single block that alone does not fit is a dead letter.

Real things only: vLLM's ZMQ frames through the collector's decoder and chain hashing, the tansu Kafka-protocol
broker (``kafka_bootstrap``), the ingester and real chDB (``store``); the same batch sent whole through the
in-process queue (no size cap) into a second database is the reference. tansu enforces no size limit, so a
broker whose limit is below the setting is stood for by kafka-python's own check (``max_request_size``), which
refuses a record with the error a broker answers with.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer

from collector.events import Envelope, decode_batch, topic_for, topics
from collector.kv_decode import message_events
from collector.publish import KafkaPublisher, ensure_topics, plan_messages
from ingest.ingester import Ingester
from ingest.kv_pieces import trim_kv_rows
from ingest.rows import COLUMNS
from ingest.source import KafkaSource
from ingest.store import Store
from tests.test_kafka_size import consume, metric
from tests.test_kv_residency import CLEARED, collect, frames, ingest, removed, stored

CAP = 60_000


def small(i: int) -> dict[str, Any]:
    """The i-th small event of the big batch: stores of one block on GPU, removals of two on CPU after 600."""
    if i < 600:
        return stored([10_000 + i], 32 * i, parent=10_000 + i - 1 if i else None)
    return {**removed([20_000 + i, 30_000 + i]), "medium": "CPU"}


def big_batch() -> list[list[bytes]]:
    """A vLLM start (seq 0) whose batch is ~15 Kafka messages at :data:`CAP`: a malformed event first (a dead
    letter of its own), 1,200 small events, a BlockStored of 6,000 blocks (96,000 tokens: a long prompt), a
    cache reset and a BlockRemoved of 8,000 blocks (a flood of evictions); then a small batch (seq 1)."""
    events: list[dict[str, Any]] = [{"type": "BlockStored", "block_hashes": "not a list"}]
    events += [small(i) for i in range(700)]
    events.append(stored([(7 << 56) + b for b in range(6000)], 5000, parent=10_699 - 100))
    events += [small(i) for i in range(700, 900)]
    events.append(CLEARED)
    events.append({**removed([(7 << 56) + b for b in range(1000, 9000)]), "medium": "CPU"})
    events += [small(i) for i in range(900, 1200)]
    return [frames("pod-s", 0, 0, *events), frames("pod-s", 1, 1, stored([1, 2], 0), removed([10_001]))]


def snapshot(store: Store) -> dict[str, Any]:
    """What the store says about the KV events: kv_block_log rows as written (no FINAL: a row written twice shows
    twice) and per kind under FINAL, the resets, the dead letters, the per-event sums of kv_block_events (an event
    in pieces is more than one row there, each its own under FINAL) and the named queries' counts (kv_evictions,
    kv_resident_at, freshness's and data_extent's KV events)."""
    log = store.query_rows("SELECT pod, engine, medium, block_hash, ts, seq, idx, pos, kind, parent_block_hash, "
                           "chain_hash, block_size FROM kv_block_log")
    events = store.query_rows(
        "SELECT count(), uniqExact(seq, idx), sum(length(block_hashes)), sum(token_count), "
        "groupUniqArray(event_type) FROM kv_block_events")
    final = store.query_rows("SELECT count() FROM kv_block_events FINAL")[0][0]
    return {
        "kv_block_log": Counter(log),
        "resets": sorted(store.query_rows("SELECT pod, engine, ts, seq, idx, kind FROM kv_cache_resets")),
        "dead_letters": sorted(store.query_rows("SELECT event_id, source, reason, location FROM dead_letters")),
        "events": [(*events[0][1:4], sorted(events[0][4]))],
        "no_row_collapses": events[0][0] == final,  # (pieces of one event differ in their sorting key)
        "kv_evictions": store.named("kv_evictions", {}).to_dicts(),
        "kv_resident_at": store.named("kv_resident_at", {}).to_dicts(),
        "freshness": store.named("freshness", {}).filter(source="kv_events").select("pod", "rows").to_dicts(),
        "data_extent": store.named("data_extent", {}).filter(table="kv_block_events").select("rows").to_dicts(),
        "block_log_final": store.query_rows("SELECT kind, count() FROM kv_block_log FINAL GROUP BY kind "
                                            "ORDER BY kind"),
    }


def reference(chdb_dir: Path, envs: list[Envelope]) -> dict[str, Any]:
    """The snapshot of ``envs`` sent whole (the in-process queue has no size cap) into a database of its own."""
    ref = Store.open(data_dir=chdb_dir, database=f"ref_{uuid.uuid4().hex[:12]}")
    ref.migrate()
    ingest(ref, envs)
    return snapshot(ref)


def drain(store: Store, bootstrap: str, namespace: str, n_messages: int) -> None:
    """Ingest every message of ``namespace`` from the start under a new consumer group, one message per insert
    (so the parts of a batch land in separate inserts), until ``n_messages`` were handled."""
    source = KafkaSource(bootstrap, f"{namespace}-{uuid.uuid4().hex[:6]}", namespace=namespace)
    ingester = Ingester(store, source, max_messages=1, poll_timeout_ms=200)
    deadline = time.time() + 180
    try:
        while ingester.messages_handled < n_messages and time.time() < deadline:
            ingester.run_once()
    finally:
        source.close()
    assert ingester.messages_handled == n_messages


def rows_of(snap: dict[str, Any]) -> int:
    return sum(snap["kv_block_log"].values())


@pytest.mark.broker
def test_a_batch_larger_than_a_message_arrives_in_parts_with_exactly_the_rows_of_the_whole_batch(
        store: Store, chdb_dir: Path, kafka_bootstrap: str) -> None:
    envs = collect(big_batch())
    want = reference(chdb_dir, envs)
    assert rows_of(want) > 15_000 and len(want["dead_letters"]) == 1  # the malformed event's own dead letter
    assert [r[-1] for r in want["resets"]] == ["restart", "cleared"]
    oversized_before = metric("kvscope_collector_oversized_events_total", kind="kv_event_batch", why="setting")
    split_before = metric("kvscope_collector_kv_batches_split_total", why="setting")
    ns = f"kvsplit{uuid.uuid4().hex[:8]}"
    pub = KafkaPublisher(kafka_bootstrap, namespace=ns, max_message_bytes=CAP)
    try:
        for _ in range(3):  # sent, then re-sent twice (a collector restarting before its checkpoint)
            pub.publish(envs)
    finally:
        pub.close()
    per_send = len(plan_messages(envs, max_message_bytes=CAP)[0])
    drain(store, kafka_bootstrap, ns, 3 * per_send)
    assert snapshot(store) == want
    drain(store, kafka_bootstrap, ns, 3 * per_send)  # Kafka redelivers every message (a new consumer group)
    assert snapshot(store) == want
    records = consume(kafka_bootstrap, [topic_for("kv_event_batch", ns), topic_for("dead_letter", ns)], 3 * per_send)
    assert len(records) == 3 * per_send and max(len(r.value) for r in records) <= CAP
    parts = [e for r in records for e in decode_batch(r.value) if e.schema == "kv_event_batch"]
    assert len({e.event_id for e in parts}) == len(parts) // 3 > 10  # the same parts, under the same ids, each send
    assert sum(not e.payload.continued for e in parts if e.payload.seq == 0) == 3  # the first part of each send
    assert metric("kvscope_collector_oversized_events_total", kind="kv_event_batch", why="setting") \
        == oversized_before  # nothing dead-lettered for its size
    assert metric("kvscope_collector_kv_batches_split_total", why="setting") - split_before == 3


@pytest.mark.broker
def test_a_broker_limit_below_the_setting_cuts_a_kv_batch_until_its_parts_fit(
        store: Store, chdb_dir: Path, kafka_bootstrap: str) -> None:
    envs = collect(big_batch())
    want = reference(chdb_dir, envs)
    before = metric("kvscope_collector_kv_batches_split_total", why="broker")
    ns = f"kvlow{uuid.uuid4().hex[:8]}"
    # the setting says 900 kB; the "broker" takes 100 kB (kafka-python's own check refuses with the broker's error)
    pub = KafkaPublisher(kafka_bootstrap, namespace=ns, max_message_bytes=900_000, max_request_size=100_000)
    try:
        pub.publish(envs)
    finally:
        pub.close()
    records = consume(kafka_bootstrap, [topic_for("kv_event_batch", ns), topic_for("dead_letter", ns)], 8)
    drain(store, kafka_bootstrap, ns, len(records))
    assert snapshot(store) == want
    assert max(len(r.value) for r in records) <= 100_000
    assert metric("kvscope_collector_kv_batches_split_total", why="broker") - before >= 1


@pytest.mark.broker
def test_only_a_single_block_that_alone_exceeds_the_limit_is_dead_lettered_and_counted_once_stored(
        store: Store, chdb_dir: Path, kafka_bootstrap: str) -> None:
    # a block of 30,000 tokens whose ids are published as they are (the collector publishes token ids when chain
    # hashing fails): ~200 kB for one block, which no cut can make smaller
    huge = {"type": "BlockStored", "block_hashes": [77], "parent_block_hash": 5, "token_ids": list(range(30_000)),
            "block_size": 30_000, "lora_id": None, "medium": "GPU"}
    message = frames("pod-h", 5, 2, stored([5], 0), huge, removed([5]), stored([6, 7, 8], 32, parent=5))
    envs = message_events(message)
    rest = message_events(frames("pod-h", 5, 2, stored([5], 0), removed([5]), stored([6, 7, 8], 32, parent=5)))
    oversized_before = metric("kvscope_collector_oversized_events_total", kind="kv_event_batch", why="setting")
    dead_before = metric("kvscope_dead_letters_total", source="kv_events")
    ns = f"kvhuge{uuid.uuid4().hex[:8]}"
    pub = KafkaPublisher(kafka_bootstrap, namespace=ns, max_message_bytes=CAP)
    try:
        pub.publish(envs)
        assert metric("kvscope_collector_oversized_events_total", kind="kv_event_batch", why="setting") \
            - oversized_before == 1
        pub.publish(envs)  # a re-send: its dead letter is stored once
    finally:
        pub.close()
    per_send = len(plan_messages(envs, max_message_bytes=CAP)[0])
    drain(store, kafka_bootstrap, ns, 2 * per_send)
    # every other event of the batch, at its idx: the rows of the batch without the huge block
    blocks = store.query_rows("SELECT block_hash, idx, pos, kind, parent_block_hash FROM kv_block_log "
                              "ORDER BY idx, pos")
    assert blocks == [(5, 0, 0, "stored", None), (5, 2, 0, "removed", None), (6, 3, 0, "stored", 5),
                      (7, 3, 1, "stored", 6), (8, 3, 2, "stored", 7)]
    assert len(rest) == 1
    [(source, pod, reason, location, raw)] = store.query_rows(
        "SELECT source, pod, reason, location, raw FROM dead_letters")
    assert (source, pod, location) == ("kv_events", "pod-h", "zmq:pod-h:5:event 1:block 0")
    assert reason.startswith("block 0 of KV event 1 (BlockStored) of batch seq 5 alone encodes ")
    assert f"KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={CAP}" in reason and "other blocks and events were" in reason
    assert int(reason.split("alone encodes ")[1].split(" bytes")[0]) > CAP
    assert '"block_hashes":[77]' in raw
    assert metric("kvscope_dead_letters_total", source="kv_events") - dead_before == 1


@pytest.mark.broker
def test_a_batch_whose_parts_the_broker_cuts_again_counts_once(kafka_bootstrap: str) -> None:
    # kvscope_collector_kv_batches_split_total counts batches sent in parts, not cuts: the big batch (~660 kB) is
    # refused by a 100 kB "broker", cut in halves, and its halves refused and cut again (three rounds); with a
    # 300 kB setting it is first split by the setting, then each part is cut by the broker. Each publish sends
    # one batch in parts: +1, under why="broker" (the broker's limit shaped its parts), nothing under "setting".
    envs = collect(big_batch())
    for setting in (900_000, 300_000):
        before = {why: metric("kvscope_collector_kv_batches_split_total", why=why) for why in ("setting", "broker")}
        ns = f"kvrecut{uuid.uuid4().hex[:8]}"
        pub = KafkaPublisher(kafka_bootstrap, namespace=ns, max_message_bytes=setting, max_request_size=100_000)
        try:
            pub.publish(envs)
        finally:
            pub.close()
        records = consume(kafka_bootstrap, [topic_for("kv_event_batch", ns)], 8)
        parts = [e for r in records for e in decode_batch(r.value) if e.payload.seq == 0]  # (seq 1: not cut)
        assert len(parts) >= 8 and max(len(r.value) for r in records) <= 100_000  # cut in three rounds at least
        after = {why: metric("kvscope_collector_kv_batches_split_total", why=why) for why in ("setting", "broker")}
        assert (after["broker"] - before["broker"], after["setting"] - before["setting"]) == (1, 0), setting


@pytest.mark.broker
def test_a_batch_resent_with_another_message_size_limit_stores_every_block_once(
        store: Store, chdb_dir: Path, kafka_bootstrap: str) -> None:
    # a collector whose publish failed after some of its messages were taken, restarted with another
    # KVSCOPE_KAFKA_MAX_MESSAGE_BYTES, replays from its checkpoint: the batch comes again in parts cut elsewhere,
    # under other ids (60 kB, then 97 kB: the 6,000-block and 8,000-block events in pieces that overlap those of
    # the first send), then whole (900 kB: one message), then the first send is redelivered whole. Every reader
    # counts every block and event once: kv_block_events' sums, kv_block_log as written, the restart mark, the
    # named queries (the reference: the batch sent whole once).
    envs = collect(big_batch())
    want = reference(chdb_dir, envs)
    for table in ("kv_block_events", "kv_block_log"):  # a copy must not hide in a background merge
        store.command(f"SYSTEM STOP MERGES {table}")
    sends: dict[int, tuple[str, int]] = {}
    ids: dict[int, set[str]] = {}
    for cap in (CAP, 97_000, 900_000):
        ns = f"kvlimit{cap}x{uuid.uuid4().hex[:8]}"
        pub = KafkaPublisher(kafka_bootstrap, namespace=ns, max_message_bytes=cap)
        try:
            pub.publish(envs)
        finally:
            pub.close()
        messages = plan_messages(envs, max_message_bytes=cap)[0]
        sends[cap] = (ns, len(messages))
        ids[cap] = {e.event_id for m in messages for e in decode_batch(m.value)
                    if e.schema == "kv_event_batch" and e.payload.seq == 0}
    assert len(ids[CAP]) > 10 and len(ids[97_000]) > 5 and not ids[CAP] & ids[97_000]  # other parts, other ids
    # the first send's publish failed after its first message (the batch's first part) was taken
    cut_short = f"kvshort{uuid.uuid4().hex[:8]}"
    first = plan_messages(envs, max_message_bytes=CAP, namespace=cut_short)[0][0]
    assert [e.payload.continued for e in decode_batch(first.value)] == [False]
    ensure_topics(kafka_bootstrap, topics(cut_short), 1)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        producer.send(first.topic, key=first.key, value=first.value).get(timeout=30)
    finally:
        producer.close()
    drain(store, kafka_bootstrap, cut_short, 1)
    partial = snapshot(store)
    assert 0 < rows_of(partial) < rows_of(want) and "restart" in [r[-1] for r in partial["resets"]]
    for cap in (97_000, 900_000, CAP):
        drain(store, kafka_bootstrap, *sends[cap])
        assert snapshot(store) == want, cap


def test_the_ingester_keeps_of_each_row_only_the_blocks_its_event_does_not_hold(store: Store) -> None:
    # trim_kv_rows against the store and the rows before it: event (seq 0, idx 0) of 10 blocks of 32 tokens
    # holds blocks 2..4 and 7..9 (pieces stored earlier); a whole copy of the event brings 0..1 and 5..6, chained
    # to the blocks before them, with their share of the tokens; a second copy in the same insert brings nothing;
    # an AllBlocksCleared (idx 1) already stored is not stored again, one not yet stored (idx 2) is, once; the
    # batch's start is marked (a row of it not continued is stored), so the new rows are continued.
    columns = COLUMNS["kv_block_events"]
    ts = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

    def row(eid: str, idx: int, kind: str, first: int, hashes: list[int], continued: int) -> tuple[Any, ...]:
        return (eid, ts, "pod-t", "0", 0, idx, kind, hashes, first - 1 if first and hashes else None,
                32 * len(hashes), 32, "GPU", [h + 1000 for h in hashes], first, continued)

    store.insert("kv_block_events", [row("a", 0, "BlockStored", 2, [2, 3, 4], 0),
                                     row("a", 1, "AllBlocksCleared", 0, [], 0),
                                     row("b", 0, "BlockStored", 7, [7, 8, 9], 1)], columns)
    whole = row("c", 0, "BlockStored", 0, list(range(10)), 0)
    incoming = [whole, row("c", 1, "AllBlocksCleared", 0, [], 0), row("c", 2, "AllBlocksCleared", 0, [], 0),
                whole, row("d", 2, "AllBlocksCleared", 0, [], 0)]
    out = trim_kv_rows(store, incoming, columns, [1, 1, 1, 2, 2])
    assert [i for i, _ in out] == [0, 0, 2]
    got = [dict(zip(columns, r, strict=True)) for _, r in out]
    assert [(r["idx"], r["first_pos"], r["block_hashes"], r["parent_block_hash"], r["chain_hashes"],
             r["token_count"], r["continued"]) for r in got] == [
        (0, 0, [0, 1], None, [1000, 1001], 64, 1), (0, 5, [5, 6], 4, [1005, 1006], 64, 1), (2, 0, [], None, [], 0, 1)]
