"""Faults on the way: the store refusing writes for a while, the broker frozen, a predecessor's line arriving
late, the whole log read again. Each time: nothing committed past what the store holds, nothing lost after,
nothing counted twice."""

from __future__ import annotations

import hashlib
import json
import signal
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError
from conftest import start_tansu, stop_process
from prometheus_client import REGISTRY

from collector.events import topic_for
from demo.history import format_ts, gateway_lines
from ingest.store import Store
from kvscope.config import Config, build_config
from kvscope.pipeline import Pipeline
from tests.kill_harness import wait_until


class RefusingClient:
    """The store's clickhouse-connect client with a switch: while ``refusing`` is True every insert fails as
    a loaded server fails (code 241, memory limit exceeded). Reads pass through. A fault at the client
    boundary, the only place kvscope sees ClickHouse."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.refusing = False
        self.refused = 0

    def insert(self, *args: Any, **kwargs: Any) -> Any:
        if self.refusing:
            self.refused += 1
            raise DatabaseError("Code: 241. DB::Exception: Memory limit (total) exceeded: would use 9.31 GiB "
                                "(MEMORY_LIMIT_EXCEEDED)")
        return self._client.insert(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def config(store: Store, tmp: Path, **kw: Any) -> Config:
    ns = f"f{uuid.uuid4().hex[:8]}"
    return replace(build_config({}, environ={}), database=store.database, topic_namespace=ns,
                   consumer_group=f"{ns}-ingest", gateway_log=str(tmp / "gateway.jsonl"), state_dir=str(tmp / "state"),
                   attribution_interval_seconds=0.5, **kw)


def append(path: Path, lines: list[str]) -> None:
    with path.open("a") as fh:
        fh.write("".join(line + "\n" for line in lines))


def count(store: Store, sql: str = "SELECT count(), uniqExact(request_id) FROM gateway_requests") -> tuple:
    return tuple(store.query_rows(sql)[0])


def committed(bootstrap: str, group: str, topic: str) -> int:
    """Σ over partitions of the group's committed offsets on ``topic`` (0 for none)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        return sum(consumer.committed(TopicPartition(topic, p)) or 0 for p in parts)
    finally:
        consumer.close(autocommit=False)


def retries() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "kvscope_ingest_retries"
               for s in m.samples if s.name.endswith("_total"))


@pytest.mark.broker
def test_store_refusing_writes_commits_nothing_and_loses_nothing(store: Store, tmp_path: Path,
                                                                  kafka_bootstrap: str) -> None:
    lines = list(gateway_lines(300, seed=21, id_prefix="refused"))
    cfg = config(store, tmp_path, kafka_bootstrap=kafka_bootstrap)
    faulty = RefusingClient(store.client)
    store.client = faulty
    pipe = Pipeline(cfg, store=store)
    pipe.start()
    topic = topic_for("gateway_request", cfg.topic_namespace)
    try:
        append(Path(cfg.gateway_log), lines[:100])
        wait_until(lambda: count(store)[0] == 100, 60, "the first 100 rows")
        first = wait_until(lambda: committed(kafka_bootstrap, cfg.consumer_group, topic), 30, "a commit")
        before = retries()
        faulty.refusing = True
        append(Path(cfg.gateway_log), lines[100:])
        wait_until(lambda: faulty.refused >= 3, 60, "the ingester to retry the refused batch")
        time.sleep(2)
        assert count(store) == (100, 100)  # nothing landed
        assert committed(kafka_bootstrap, cfg.consumer_group, topic) == first  # and nothing was committed
        assert retries() > before
        faulty.refusing = False
        wait_until(lambda: count(store)[0] >= 300, 90, "the held batch to land")
        time.sleep(2)
        assert count(store) == (300, 300)
        assert committed(kafka_bootstrap, cfg.consumer_group, topic) > first
    finally:
        pipe.close()


def test_embedded_queue_holds_the_batch_while_the_store_refuses(store: Store, tmp_path: Path) -> None:
    lines = list(gateway_lines(200, seed=22, id_prefix="held"))
    cfg = config(store, tmp_path)
    faulty = RefusingClient(store.client)
    store.client = faulty
    faulty.refusing = True
    pipe = Pipeline(cfg, store=store)
    pipe.start()
    try:
        append(Path(cfg.gateway_log), lines)
        wait_until(lambda: faulty.refused >= 3, 60, "the ingester to retry")
        assert count(store) == (0, 0)
        assert not pipe._queue.empty()  # type: ignore[union-attr]  # the batch is still held, in flight
        faulty.refusing = False
        wait_until(lambda: count(store)[0] >= 200, 60, "the held batch to land")
        time.sleep(1)
        assert count(store) == (200, 200)
    finally:
        pipe.close()


@pytest.mark.broker
def test_frozen_broker_loses_nothing(store: Store, tmp_path: Path) -> None:
    """SIGSTOP the broker (a Kafka that stops answering, no connection refused) while lines keep coming."""
    broker, bootstrap = start_tansu("tansu-frozen.log")
    lines = list(gateway_lines(300, seed=23, id_prefix="frozen"))
    cfg = config(store, tmp_path, kafka_bootstrap=bootstrap)
    pipe = Pipeline(cfg, store=store)
    try:
        pipe.start()
        append(Path(cfg.gateway_log), lines[:100])
        wait_until(lambda: count(store)[0] == 100, 60, "the first 100 rows")
        broker.send_signal(signal.SIGSTOP)
        append(Path(cfg.gateway_log), lines[100:])
        time.sleep(8)
        assert count(store) == (100, 100)
        broker.send_signal(signal.SIGCONT)
        wait_until(lambda: count(store)[0] >= 300, 120, "the rest after the broker woke")
        time.sleep(3)
        assert count(store) == (300, 300)
    finally:
        broker.send_signal(signal.SIGCONT)
        pipe.close()
        stop_process(broker)


# -- late data -------------------------------------------------------------------------------------------------
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)


def hx(name: str) -> str:
    """A hash in the log's format (16 lowercase hex characters) standing for ``name``."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def turn(rid: str, at: float, pod: str, **kw: Any) -> str:
    """A chat turn of conversation conv-late (tenant acme): 720 system tokens, a 22-token question."""
    rec = {"log_version": 1, "request_id": rid, "ts": format_ts(T0 + timedelta(seconds=at)), "tenant_id": "acme",
           "conversation_id": "conv-late", "agent_run_id": "", "model": "tiny", "pod": pod, "status": 200,
           "prompt_tokens": 762, "cached_tokens": 0, "completion_tokens": 8, "ttft_ms": 50.0, "e2e_ms": 400.0,
           "system_hash": hx("5y5"), "system_norm_hash": hx("5y5"), "system_tokens": 720, "tools_hash": "",
           "tools_canonical_hash": "", "tools_tokens": 0, "retrieval_pack_hash": "", "retrieval_set_hash": "",
           "retrieval_tokens": 0, "history_prefix_hash": "", "prev_history_hash": "", "history_tokens": 0,
           "suffix_hash": hx("q1"), "suffix_tokens": 22, "prompt_fingerprint": hx("fp1"), **kw}
    return json.dumps(rec)


def causes(store: Store) -> dict[tuple[str, str, str], int]:
    rows = store.named("miss_causes", {"by_tenant": "0"}).rows()
    by_request = store.query_rows("SELECT request_id, cause, sum(tokens) FROM miss_attribution GROUP BY ALL")
    return {("*", r[1], r[2]): r[3] for r in rows} | {(r[0], r[1], ""): r[2] for r in by_request}


def test_a_late_predecessor_corrects_its_successor_and_a_reread_changes_nothing(store: Store,
                                                                                   tmp_path: Path) -> None:
    """Turn 2 (pod-b) is logged and attributed first: cold. Turn 1 (pod-a, two minutes earlier in event time)
    is delivered well after (beyond the job's settle and overlap): turn 2 becomes routed_away. Then the
    whole log is read again from scratch (checkpoints gone): every total stays the same."""
    cfg = config(store, tmp_path, attribution_settle_seconds=0.2, attribution_overlap_seconds=1.0,
                 default_block_size=32)
    log = Path(cfg.gateway_log)
    t2 = turn("late-t2", 120, "pod-b", prompt_tokens=830, history_prefix_hash=hx("h1"), history_tokens=50,
              suffix_hash=hx("q2"), suffix_tokens=20)
    t1 = turn("late-t1", 0, "pod-a")
    pipe = Pipeline(cfg, store=store)
    pipe.start()
    try:
        append(log, [t2])
        wait_until(lambda: causes(store).get(("late-t2", "cold", "")), 30, "turn 2 attributed")
        assert causes(store)[("late-t2", "cold", "")] == 800
        time.sleep(3)  # several job runs: turn 2's answer is settled, the watermark well past it
        append(log, [t1])
        wait_until(lambda: causes(store).get(("late-t2", "routed_away", "")), 30, "turn 2 re-attributed")
    finally:
        pipe.close()
    after = causes(store)
    assert after[("late-t2", "routed_away", "")] == 736 and ("late-t2", "cold", "") not in after
    assert after[("*", "routed_away", "")] == 736
    # read everything again: a new pipeline with no checkpoints re-sends the whole log
    cfg2 = replace(cfg, state_dir=str(tmp_path / "state-2"))

    def duplicates() -> float:
        return REGISTRY.get_sample_value("kvscope_ingest_rows_duplicate_total", {"table": "gateway_requests"}) or 0.0

    before = duplicates()
    pipe = Pipeline(cfg2, store=store)
    pipe.start()
    try:  # both lines were read again and dropped as already stored, then a few job runs
        wait_until(lambda: duplicates() >= before + 2, 30, "the re-read lines reached the ingester")
        time.sleep(2)
    finally:
        pipe.close()
    assert causes(store) == after
    assert count(store) == (2, 2)


class RowRefusingClient(RefusingClient):
    """The store's client refusing, as a server refuses a value it cannot convert (code 53, a data error), any
    insert into ``table`` that holds a row with ``marker`` in it. Everything else passes through."""

    def __init__(self, client: Any, table: str, marker: Any) -> None:
        super().__init__(client)
        self.table, self.marker = table, marker

    def insert(self, table: str, data: Any = None, *args: Any, **kwargs: Any) -> Any:
        if table == self.table and any(self.marker in row for row in data):
            self.refused += 1
            raise DatabaseError("Code: 53. DB::Exception: Type mismatch in IN or VALUES section. (TYPE_MISMATCH)")
        return self._client.insert(table, data, *args, **kwargs)


def test_a_refused_event_of_a_kv_batch_costs_only_itself(store: Store) -> None:
    """One KV-event batch (one envelope, one event id for all its rows) whose third event the store refuses as
    data: the other events land, the refused one is dead-lettered, and nothing else is lost. Before, the halves
    of the batch were checked against the store again: the first half's rows made the envelope read as already
    stored, and the rest of the batch was dropped without a trace."""
    from test_kv_residency import collect, frames, ingest, removed, stored

    pod = f"pod-{uuid.uuid4().hex[:8]}"
    marker = 7_777_000_000 + int(uuid.uuid4().int % 1000)
    events = [stored([marker - 3]), stored([marker - 2]), removed([marker]), stored([marker - 1]),
              removed([marker - 3])]
    faulty = RowRefusingClient(store.client, "kv_block_events", [marker])
    store.client = faulty
    try:
        ingest(store, collect([frames(pod, 1, 0, *events)]))
    finally:
        store.client = faulty._client
    assert faulty.refused >= 1
    kept = store.query_rows("SELECT idx, event_type, block_hashes FROM kv_block_events WHERE pod = {p:String} "
                            "ORDER BY idx", {"p": pod})
    assert [(i, t, list(h)) for i, t, h in kept] == [
        (0, "BlockStored", [marker - 3]), (1, "BlockStored", [marker - 2]), (3, "BlockStored", [marker - 1]),
        (4, "BlockRemoved", [marker - 3])]
    [(reason, raw)] = store.query_rows("SELECT reason, raw FROM dead_letters WHERE pod = {p:String}", {"p": pod})
    assert reason.startswith("store refused a row of kv_block_events") and str(marker) in raw


@pytest.mark.broker
@pytest.mark.parametrize("kind", ["expired", "contract", "refused"])
def test_an_envelope_sent_twice_through_kafka_is_one_dead_letter(kind: str, store: Store,
                                                                 kafka_bootstrap: str) -> None:
    """A collector re-sends what it cannot prove was stored (a publish that failed after the broker took part of
    it, a kill between the broker's ack and the checkpoint, the scrape outbox at start); the copy lands at
    another offset. The dead letters the ingester makes (rows older than the retention, an envelope that maps
    to no row, a row the store refuses as data) must not count twice for it: their ids used to come from the
    message's partition and offset."""
    from collector.events import GatewayRequest, envelope
    from collector.publish import KafkaPublisher, to_messages
    from ingest.ingester import Ingester
    from ingest.source import KafkaSource

    ns = f"twice{uuid.uuid4().hex[:8]}"
    ts = datetime.now(UTC) - timedelta(days=40 if kind == "expired" else 1)
    record = {"log_version": 1, "request_id": f"{kind}-1", "ts": ts.isoformat().replace("+00:00", "Z"),
              "tenant_id": "acme", "pod": "pod-0", "prompt_tokens": 100, "cached_tokens": 64,
              "status": 70000 if kind == "contract" else 200, "ttft_ms": 5.0, "e2e_ms": 9.0}
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    good = {**record, "request_id": "good", "status": 200, "ts": now}
    events = [envelope(GatewayRequest(record=r), pod="pod-0", natural_key=(r["request_id"],), observed_at_ms=1)
              for r in (record, good)]
    if kind == "refused":
        store.client = RowRefusingClient(store.client, "gateway_requests", f"{kind}-1")
    publisher = KafkaPublisher(kafka_bootstrap, namespace=ns)
    source = KafkaSource(kafka_bootstrap, f"{ns}-g", namespace=ns)
    try:
        ingester, per_copy = Ingester(store, source), len(to_messages(events, namespace=ns))
        for copy in (1, 2):  # the second: the re-send, once the first is stored
            publisher.publish(events)
            wait_until(lambda n=copy * per_copy: ingester.run_once() >= 0 and ingester.messages_handled >= n, 60,
                       f"copy {copy} ingested")
    finally:
        publisher.close()
        source.close()
        if kind == "refused":
            store.client = store.client._client
    assert store.query_rows("SELECT request_id FROM gateway_requests") == [("good",)]
    letters = store.query_rows("SELECT reason, location FROM dead_letters")
    assert len(letters) == 1, letters


def test_kv_batches_received_before_a_stop_are_published_at_the_stop(store: Store, tmp_path: Path) -> None:
    """``kvscope up`` stopped (SIGTERM, Ctrl-C) while KV-event batches wait in the collector's socket: they were
    received, so they are published and stored and the checkpoint moves past them (the gateway log's lines are
    drained the same way). Before, the KV loop ended at once and dropped them: only a replay at the next start
    could bring them back, and none when vLLM stopped too (its next start numbers its batches from 0 again).
    Real ZMQ over inproc, where a sent message is in the subscriber's socket when the send returns."""
    import zmq
    from test_kv_residency import frames, stored

    from collector.checkpoint import CheckpointStore
    from collector.kv_events import KvEventSubscriber, checkpoint_key
    from collector.publish import MemoryQueue, QueuePublisher
    from collector.service import Collector
    from ingest.ingester import Ingester
    from ingest.source import QueueSource

    pod, endpoint = f"pod-{uuid.uuid4().hex[:8]}", f"inproc://kv-stop-{uuid.uuid4().hex[:8]}"
    queue, checkpoints = MemoryQueue(), CheckpointStore(tmp_path / "checkpoints.json")
    collector = Collector(publisher=QueuePublisher(queue), checkpoints=checkpoints)
    sub = KvEventSubscriber(endpoint, checkpoints=checkpoints)
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(10)[0]:  # until the subscription reached the PUB: a probe arrives (a dead letter)
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            pub.send_multipart([b"probe", b"not a KV-event batch"])
        for seq in range(5):
            pub.send_multipart(frames(pod, seq, seq, stored([1_000 + seq])))
        collector.stop.set()  # the stop arrives with the five batches in the socket
        collector._kv_loop(sub)  # what the collector's KV thread runs, from the stop on
    finally:
        pub.close()
    ingester = Ingester(store, QueueSource(queue))
    while ingester.run_once():
        pass
    got = store.query_rows("SELECT seq FROM kv_block_events WHERE pod = {p:String} ORDER BY seq", {"p": pod})
    assert [s for (s,) in got] == [0, 1, 2, 3, 4]
    assert checkpoints.get(checkpoint_key(pod, 0))["seq"] == 4


def test_a_checkpoint_that_cannot_be_written_costs_neither_the_queue_nor_the_source(store: Store,
                                                                                   tmp_path: Path) -> None:
    """Embedded mode: the state directory cannot be written for a while (disk full, a vanished mount: here a
    file where the directory was). An acknowledgement that cannot write its checkpoint must not stop the
    others or keep its messages' bytes in the in-process queue: before, the ingester's commit raised, the
    queue never gave those bytes back (a longer outage filled it for good: every publish then failed) and a
    stop waited its whole timeout on it. The lines are stored; the checkpoint moves once it can be written again."""
    from collector.checkpoint import CheckpointStore
    from collector.gateway_log import GatewayLogSource
    from collector.publish import MemoryQueue, QueuePublisher
    from collector.service import Collector
    from ingest.ingester import Ingester
    from ingest.source import QueueSource

    log_path, state = tmp_path / "gw.jsonl", tmp_path / "state"
    checkpoints = CheckpointStore(state / "checkpoints.json")
    lines = list(gateway_lines(20, seed=31, id_prefix="ckpt"))
    append(log_path, lines[:10])
    queue = MemoryQueue()
    collector = Collector(publisher=QueuePublisher(queue), checkpoints=checkpoints)
    source, ingester = GatewayLogSource(log_path, checkpoints), Ingester(store, QueueSource(queue))
    state.write_text("not a directory")  # the state dir cannot be made
    events, ack = source.poll()
    assert collector._publish("gateway_log", events, ack)
    assert ingester.run_once() and queue.empty() and queue.bytes_used == 0
    assert count(store) == (10, 10) and state.is_file()
    state.unlink()  # writable again
    append(log_path, lines[10:])
    events, ack = source.poll()
    assert collector._publish("gateway_log", events, ack)
    assert ingester.run_once() and queue.empty()
    assert count(store) == (20, 20)
    restarted = GatewayLogSource(log_path, CheckpointStore(state / "checkpoints.json"))
    assert restarted.poll() == ([], None)  # the checkpoint is past every line
