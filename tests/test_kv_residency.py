"""Block-level evidence: KV events → kv_block_log → kv_block_residency, and the named queries kv_resident_at and
kv_evictions, on the real vLLM capture and on hand-built event sequences.

Every sequence goes the production way: ZMQ frames as vLLM sends them → the collector's decoder and chain
hashing → the in-process queue → the ingester (dedup by event id) → chDB, whose materialized views fill
kv_block_log.
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from collector.events import Envelope, KvEventGap, envelope
from collector.kv_chains import BlockChains
from collector.kv_decode import message_events
from collector.publish import MemoryQueue, QueuePublisher
from ingest.ingester import Ingester
from ingest.source import QueueSource
from ingest.store import Store
from kvscope.block_hash import chain_hashes
from tests.clock import T0

CAPTURE = Path(__file__).parent / "samples" / "vllm_0.32.0_cpu_real_kv_events.json"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def text(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def frames(pod: str, seq: int, t: float, *events: dict[str, Any]) -> list[bytes]:
    """One vLLM KV-event message: topic = pod, seq, msgpack [ts, [events], dp_rank 0]."""
    payload = msgspec.msgpack.encode([at(t).timestamp(), list(events), 0])
    return [pod.encode(), seq.to_bytes(8, "big"), payload]


def stored(hashes: list[int], first_token: int = 0, parent: int | None = None) -> dict[str, Any]:
    """BlockStored of ``hashes`` (32-token blocks), its tokens counting up from ``first_token``."""
    tokens = list(range(first_token, first_token + 32 * len(hashes)))
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 32, "lora_id": None, "medium": "GPU"}


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}
CHAIN = chain_hashes(range(96), 32)  # what a gateway computes for a prompt of tokens 0..95: blocks 1, 2, 3 below

# pod-a: blocks 1, 2, 3 (tokens 0..95); block 2 stored twice (a second copy) and removed twice; block 9 removed
# without a store in the events; block 4 stored on top of 3 and evicted unused; a prefix-cache reset; blocks
# 1-3 stored again; then vLLM restarts (seq back to 0). pod-b stores blocks 1-3 once and keeps them.
SEQUENCE = [
    frames("pod-a", 0, 0, stored([1, 2, 3])),
    frames("pod-b", 0, 0.5, stored([1, 2, 3])),
    frames("pod-a", 1, 1, stored([2], 32, parent=1)),
    frames("pod-a", 2, 2, removed([2])),
    frames("pod-a", 3, 3, removed([9])),
    frames("pod-a", 4, 4, removed([2])),
    frames("pod-a", 5, 5, stored([4], 96, parent=3)),
    frames("pod-a", 6, 6, removed([3])),
    frames("pod-a", 7, 7, removed([4])),
    frames("pod-a", 8, 8, CLEARED),
    frames("pod-a", 9, 9, stored([1, 2, 3])),
    frames("pod-a", 0, 10, stored([5], 500)),
]


def ingest(store: Store, envs: list[Envelope]) -> dict[str, int]:
    """Publish ``envs`` to the in-process queue and run the ingester until it is drained; rows written per table."""
    q = MemoryQueue()
    QueuePublisher(q).publish(envs)
    ingester = Ingester(store, QueueSource(q), poll_timeout_ms=10)
    while ingester.run_once():
        pass
    return dict(ingester.rows_written)


def collect(messages: list[list[bytes]], topic_pods: dict[str, str] | None = None) -> list[Envelope]:
    """What the collector publishes for these messages: decoded, token ids turned into chain hashes."""
    chains = BlockChains()
    return [chains.envelope(e) for m in messages for e in message_events(m, topic_pods)]


def named(store: Store, name: str, **params: Any) -> dict[str, dict[str, Any]]:
    rows = store.named(name, {k: text(v) if isinstance(v, datetime) else str(v) for k, v in params.items()})
    return {r["pod"]: r for r in rows.to_dicts()}


def residency(store: Store, pod: str) -> list[tuple[Any, ...]]:
    return store.query_rows(
        "SELECT block_hash, chain_hash, stored_at, removed_at, removed_by, stores, removals FROM kv_block_residency "
        "WHERE pod = {pod:String} ORDER BY block_hash, ifNull(stored_at, toDateTime64(0, 3, 'UTC'))", {"pod": pod})


def naive(t: float | None) -> datetime | None:
    return None if t is None else at(t).replace(tzinfo=None)


@pytest.fixture
def seq_store(store: Store) -> Store:
    ingest(store, collect(SEQUENCE))
    return store


def test_residency_intervals_of_each_case(seq_store: Store) -> None:
    c1, c2, c3 = CHAIN
    got = [(h, c, s.replace(tzinfo=None) if s else None, r.replace(tzinfo=None) if r else None, by, n, m)
           for h, c, s, r, by, n, m in residency(seq_store, "pod-a")]
    assert got == [
        (1, c1, naive(0), naive(8), "all_blocks_cleared", 1, 0),
        (1, c1, naive(9), naive(10), "pod_restart", 1, 0),
        (2, c2, naive(0), naive(4), "block_removed", 2, 2),  # two copies: resident until the second removal
        (2, c2, naive(9), naive(10), "pod_restart", 1, 0),
        (3, c3, naive(0), naive(6), "block_removed", 1, 1),
        (3, c3, naive(9), naive(10), "pod_restart", 1, 0),
        (4, chain_hashes(range(128), 32)[3], naive(5), naive(7), "block_removed", 1, 1),
        (5, chain_hashes(range(500, 532), 32)[0], naive(10), None, None, 1, 0),  # the restarted vLLM's first store
        (9, 0, None, naive(3), "block_removed", 0, 1),  # removed, never stored in the events: stored before them
    ]
    assert [r[4] for r in residency(seq_store, "pod-b")] == [None, None, None]


def test_resident_at_is_exact_at_event_times(seq_store: Store) -> None:
    """A block is resident at T when stored before T and not gone before T: at exactly the removal's time it is
    still there, a millisecond later it is not."""
    def at_t(t: datetime, **kw: Any) -> dict[str, dict[str, Any]]:
        return named(seq_store, "kv_resident_at", until=t, chain=json.dumps(CHAIN), **kw)

    r = at_t(at(2.5))
    assert (r["pod-a"]["resident_blocks"], r["pod-a"]["resident_tokens"]) == (4, 3 * 32)  # 1, 2 (a copy), 3, 9
    # (9's size is unknown: its BlockStored is not in the events)
    assert (r["pod-a"]["chain_resident_blocks"], r["pod-b"]["chain_resident_blocks"]) == (3, 3)
    assert r["pod-a"]["kv_events"] == 3 and r["pod-a"]["first_event_ts"] == at(0)
    assert at_t(at(4))["pod-a"]["resident_blocks"] == 3  # block 2's last copy leaves at 4: not yet at T = 4
    a = at_t(at(4) + timedelta(milliseconds=1))["pod-a"]
    assert (a["resident_blocks"], a["chain_blocks"], a["chain_resident_blocks"]) == (2, 3, 1)
    assert (a["stop_block_hash"], a["stop_removed_at"], a["stop_removed_by"]) == (CHAIN[1], at(4), "block_removed")
    a = at_t(at(8.5))["pod-a"]
    assert (a["resident_blocks"], a["chain_resident_blocks"], a["stop_block_hash"]) == (0, 0, CHAIN[0])
    assert (a["stop_removed_at"], a["stop_removed_by"]) == (at(8), "all_blocks_cleared")
    assert at_t(at(9.5))["pod-a"]["chain_resident_blocks"] == 3
    r = at_t(at(10.5))
    assert (r["pod-a"]["resident_blocks"], r["pod-a"]["chain_resident_blocks"]) == (1, 0)
    assert (r["pod-a"]["stop_removed_at"], r["pod-a"]["stop_removed_by"]) == (at(10), "pod_restart")
    assert (r["pod-b"]["resident_blocks"], r["pod-b"]["chain_resident_blocks"], r["pod-b"]["stop_block_hash"]) == (
        3, 3, None)
    # vLLM's own hashes name the same blocks; a block never seen stops the chain with no departure.
    b = at_t(at(0.25), pod="pod-a")
    assert set(b) == {"pod-a"} and b["pod-a"]["chain_resident_blocks"] == 3
    a = named(seq_store, "kv_resident_at", until=at(0.25), chain="[1, 2, 77, 3]")["pod-a"]
    assert (a["chain_resident_blocks"], a["stop_block_hash"], a["stop_removed_at"]) == (2, 77, None)
    assert at_t(at(1))["pod-b"]["resident_blocks"] == 3
    assert at_t(at(1), since=at(0.75))["pod-b"]["resident_blocks"] == 0  # stored before since: left out
    assert named(seq_store, "kv_resident_at", until=at(0)) == {}  # no KV event before T: no pod to speak of
    assert set(named(seq_store, "kv_resident_at", until=at(0.5))) == {"pod-a"}  # pod-b's first event is at T


def test_kv_evictions_per_pod_and_window(seq_store: Store) -> None:
    r = named(seq_store, "kv_evictions")
    a = r["pod-a"]
    assert {k: a[k] for k in ("kv_events", "blocks_stored", "block_removed_events", "blocks_removed",
                              "evicted_blocks", "caches_cleared", "restarts", "blocks_reset",
                              "removed_before_reuse")} == {
        "kv_events": 11, "blocks_stored": 9, "block_removed_events": 5, "blocks_removed": 5,
        "evicted_blocks": 4,  # 2 (its last copy), 3, 4, and 9 (stored before the events)
        "caches_cleared": 1, "restarts": 2,  # the first batch ever seen is a start too
        "blocks_reset": 4,  # 1 by the clear; 1, 2, 3 by the restart
        "removed_before_reuse": 1,  # 4; 2 was stored twice, 3 had 4 stored on top, 9's store is unseen
    }  # fmt: skip
    assert a["mean_residency_seconds"] == pytest.approx((4 + 6 + 2) / 3)  # 2, 3, 4; 9's store is unknown
    b = r["pod-b"]
    assert (b["kv_events"], b["blocks_stored"], b["evicted_blocks"], b["restarts"]) == (1, 3, 0, 1)
    assert b["mean_residency_seconds"] is None
    w = named(seq_store, "kv_evictions", since=at(3), until=at(7.5))
    assert set(w) == {"pod-a"}
    assert (w["pod-a"]["kv_events"], w["pod-a"]["evicted_blocks"], w["pod-a"]["blocks_stored"],
            w["pod-a"]["restarts"], w["pod-a"]["removed_before_reuse"]) == (5, 4, 1, 0, 1)
    assert w["pod-a"]["mean_residency_seconds"] == pytest.approx(4.0)


def test_a_redelivered_batch_counts_once(store: Store) -> None:
    """The collector re-sends everything (a restart before its acknowledgement), and one batch arrives a third
    time on its own: the ingester drops what the store holds, so the views see each event once."""
    first = ingest(store, collect(SEQUENCE))
    before = (residency(store, "pod-a"), named(store, "kv_evictions"), named(store, "kv_resident_at", until=at(2.5)))
    assert ingest(store, collect(SEQUENCE)) == {} and ingest(store, collect(SEQUENCE[3:4])) == {}
    assert first == {"kv_block_events": len(SEQUENCE)}
    assert store.query_rows("SELECT count() FROM kv_block_log")[0][0] == 9 + 5 + 1 + 2 + 3 + 1
    assert (residency(store, "pod-a"), named(store, "kv_evictions"),
            named(store, "kv_resident_at", until=at(2.5))) == before


@pytest.mark.parametrize("replayed", [0, 1])
def test_a_lost_vllm_restart_is_read_from_the_gap(store: Store, replayed: int) -> None:
    """vLLM restarted and the collector missed its first batches (an unrecovered publisher_restart gap of seqs
    0..1; with ``replayed`` = 1 vLLM's replay still held seq 1): the old process's blocks end at the first batch
    received from the new one (seq 1 at 4 s, else seq 2 at 5 s), and the new one's blocks stay."""
    messages = [frames("pod-c", 0, 0, stored([1])), frames("pod-c", 1, 4, stored([8], 320)),
                frames("pod-c", 2, 5, stored([7], 224))]
    envs = collect(messages if replayed else [messages[0], messages[2]])
    gap = KvEventGap(topic="pod-c", dp_rank=0, first_seq=0, last_seq=1, detected_at_ms=int(at(5.2).timestamp() * 1000),
                     reason="publisher_restart", replayed_batches=replayed, recovered=False)
    envs.append(envelope(gap, pod="pod-c", natural_key=("pod-c", 0, 0, 1), observed_at_ms=gap.detected_at_ms,
                         engine="0"))
    ingest(store, envs)
    restart = 4 if replayed else 5
    got = [(h, r.replace(tzinfo=None) if r else None, by) for h, _, _, r, by, _, _ in residency(store, "pod-c")]
    assert got == [(1, naive(restart), "pod_restart"), (7, None, None)] + ([(8, None, None)] if replayed else [])
    assert named(store, "kv_evictions")["pod-c"]["restarts"] == 2  # the first batch ever seen, and this one


def resets_read_by_the_job(store: Store) -> list[tuple[Any, ...]]:
    """The resets attribution reads (kv_evidence.fetch_resets) over the whole log, sorted."""
    from ingest.kv_evidence import fetch_resets

    frame = fetch_resets(store, {"kv_from": at(-3600), "until": at(3600)})
    return sorted(frame.select("pod", "engine", "ts", "seq", "idx", "kind").iter_rows())


def resets_of_the_view(store: Store) -> list[tuple[Any, ...]]:
    return sorted(store.query_rows(
        "SELECT CAST(pod AS String), CAST(engine AS String), toUnixTimestamp64Milli(ts), seq, idx, "
        "CAST(kind AS String) FROM kv_cache_resets"))


def test_the_job_reads_the_resets_of_the_view_without_a_gap_report(seq_store: Store) -> None:
    """Without a publisher_restart report the job reads the log's own resets, not the view: the same rows (the
    clear at 8 s and the restart at 9 s of pod-a among them)."""
    got = resets_read_by_the_job(seq_store)
    assert got == resets_of_the_view(seq_store)
    assert {(r[0], r[5]) for r in got} >= {("pod-a", "cleared"), ("pod-a", "restart")}


@pytest.mark.parametrize("replayed", [0, 1])
def test_the_job_reads_a_restart_known_only_from_a_gap_report(store: Store, replayed: int) -> None:
    """The lost vLLM restart above (read from the gap, no log row marks it at 5 s when nothing was replayed): the
    job reads it as the view does."""
    test_a_lost_vllm_restart_is_read_from_the_gap(store, replayed)
    got = resets_read_by_the_job(store)
    assert got == resets_of_the_view(store)
    assert ("pod-c", "0", int(at(4 if replayed else 5).timestamp() * 1000)) in {r[:3] for r in got}


def test_the_real_capture_block_by_block(store: Store) -> None:
    """The capture's five requests on one pod (block size 32): 52 blocks stored, none removed. cap-3's prompt
    chain (its first 21 blocks shared with cap-1, then 2 of its own; the gateway computes it from the prompt's
    token ids) is resident up to block 21 until its own BlockStored, and whole from then on."""
    messages = json.loads(CAPTURE.read_text())
    raw = [[m["topic"].encode(), m["seq"].to_bytes(8, "big"), base64.b64decode(m["payload_b64"])] for m in messages]
    assert ingest(store, collect(raw, {"kv": "pod-a"})) == {"kv_block_events": 6}
    rows = store.query_rows("SELECT seq, token_count, block_hashes = chain_hashes FROM kv_block_events ORDER BY seq")
    assert rows == [(10, 736, True), (11, 32, True), (12, 32, True), (13, 64, True), (14, 32, True), (15, 768, True)]
    cap1, cap3 = messages[0]["decoded"][1][0], messages[3]["decoded"][1][0]
    chain = chain_hashes(cap1["token_ids"][:21 * 32] + cap3["token_ids"], 32)
    assert chain == cap1["block_hashes"][:21] + cap3["block_hashes"]
    t13 = datetime.fromtimestamp(int(messages[3]["decoded"][0] * 1000) / 1000, tz=UTC)  # as stored: ms
    before = named(store, "kv_resident_at", until=t13, chain=json.dumps(chain))["pod-a"]
    assert (before["resident_blocks"], before["chain_resident_blocks"], before["stop_block_hash"]) == (
        23 + 1 + 1, 21, cap3["block_hashes"][0])
    assert before["stop_removed_at"] is None  # never resident before: not evicted
    end = named(store, "kv_resident_at", chain=json.dumps(chain))["pod-a"]
    assert (end["kv_events"], end["resident_blocks"], end["resident_tokens"], end["chain_resident_blocks"]) == (
        6, 52, 52 * 32, 23)
    ev = named(store, "kv_evictions")["pod-a"]
    assert (ev["blocks_stored"], ev["blocks_removed"], ev["evicted_blocks"], ev["restarts"]) == (52, 0, 0, 0)


def test_events_stored_before_the_migration_are_logged_once(chdb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that already holds KV events (no chain hashes yet) gets them into kv_block_log when the residency
    migration runs, once: running the migrations again copies nothing twice."""
    import sql as sqlfiles
    from ingest.rows import COLUMNS, rows_for

    everything = sqlfiles.migrations()
    mine = next(i for i, (v, _) in enumerate(everything) if v.endswith("_create_kv_block_residency"))
    version = everything[mine][0]
    s = Store.open(data_dir=chdb_dir, database=f"mig_{uuid.uuid4().hex[:12]}")
    monkeypatch.setattr(sqlfiles, "migrations", lambda: everything[:mine])
    s.migrate()
    n = COLUMNS["kv_block_events"].index("chain_hashes")  # the columns before it (and later migrations)
    old_columns = COLUMNS["kv_block_events"][:n]
    rows = [r[:n] for env in collect(SEQUENCE) for _, table_rows in rows_for(env) for r in table_rows]
    s.insert("kv_block_events", rows, old_columns)
    monkeypatch.setattr(sqlfiles, "migrations", lambda: everything)
    assert s.migrate()[0] == version
    s.command("DELETE FROM schema_migrations WHERE version = {v:String}", {"v": version})
    s.migrate()  # a crash before the migration was recorded: it runs again, its copy is guarded
    assert s.query_rows("SELECT count() FROM kv_block_log")[0][0] == 9 + 5 + 1 + 2 + 3 + 1
    got = [(h, c, by, n, m) for h, c, _, _, by, n, m in residency(s, "pod-a")]
    assert got[2] == (2, 0, "block_removed", 2, 2)  # no chain hash: stored before kvscope computed them
    assert named(s, "kv_evictions")["pod-a"]["evicted_blocks"] == 4


# pod-r: a vLLM process stores blocks 1, 2, 3; vLLM restarts at 10 s and the new process's first batch (seq 0)
# opens with a malformed event (block hash -1: a dead letter of its own), then stores blocks 5 and 6.
BAD_FIRST = [
    frames("pod-r", 0, 0, stored([1, 2, 3])),
    frames("pod-r", 1, 1, stored([4], 96, parent=3)),
    frames("pod-r", 0, 10, removed([-1]), stored([5], 500), stored([6], 532, parent=5)),
]


def restarts(store: Store, pod: str) -> list[tuple[Any, ...]]:
    rows = store.query_rows("SELECT ts, seq, idx FROM kv_cache_resets WHERE pod = {pod:String} AND kind = 'restart' "
                            "ORDER BY ts", {"pod": pod})
    return [(ts.replace(tzinfo=None), seq, idx) for ts, seq, idx in rows]


def test_a_restart_is_marked_from_the_first_good_event_of_its_batch(store: Store) -> None:
    """Event 0 of the restarted vLLM's first batch is a dead letter: the restart is still marked (once, though two
    events of the batch are good), so the old process's blocks end there and the new one's stay."""
    envs = collect(BAD_FIRST)
    assert ingest(store, envs) == {"kv_block_events": 4, "dead_letters": 1}
    assert restarts(store, "pod-r") == [(naive(0), 0, 0), (naive(10), 0, 0)]
    got = [(h, r.replace(tzinfo=None) if r else None, by) for h, _, _, r, by, _, _ in residency(store, "pod-r")]
    assert got == [(1, naive(10), "pod_restart"), (2, naive(10), "pod_restart"), (3, naive(10), "pod_restart"),
                   (4, naive(10), "pod_restart"), (5, None, None), (6, None, None)]
    assert named(store, "kv_evictions")["pod-r"]["restarts"] == 2
    assert store.query_rows("SELECT count() FROM kv_block_log FINAL WHERE pod = 'pod-r' AND kind = 'restart'") == [(2,)]


def test_a_restart_inserted_again_is_marked_once(store: Store) -> None:
    """Redelivered, the batch is dropped whole by the ingester's dedup. Inserted again anyway (two ingesters past
    the dedup check at once in a rebalance, docs/reliability.md), or in parts (the ingester halves rows the store
    refuses), each insert marks the restart as the same row: it is read once."""
    from ingest.rows import COLUMNS, kv_rows

    envs = collect(BAD_FIRST)
    assert ingest(store, envs) == {"kv_block_events": 4, "dead_letters": 1}
    assert ingest(store, envs) == {}
    batch = next(e for e in envs if e.schema == "kv_event_batch" and e.payload.batch_ts == at(10).timestamp())
    rows = kv_rows(batch, batch.payload)
    assert [r[5] for r in rows] == [1, 2]  # the events' idx in vLLM's batch: event 0 was the dead letter
    store.insert("kv_block_events", rows[1:], COLUMNS["kv_block_events"])
    store.insert("kv_block_events", rows, COLUMNS["kv_block_events"])
    assert restarts(store, "pod-r") == [(naive(0), 0, 0), (naive(10), 0, 0)]
    assert store.query_rows("SELECT count() FROM kv_block_log FINAL WHERE pod = 'pod-r' AND kind = 'restart'") == [(2,)]
    assert named(store, "kv_evictions")["pod-r"]["restarts"] == 2


def test_restarts_stored_before_the_migration_are_marked_once(chdb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Events stored before migration 0025 (the restart went unmarked: event 0 was a dead letter) get their restart
    when it runs, once: running it again adds nothing, and a restart already marked is not marked again."""
    import sql as sqlfiles

    everything = sqlfiles.migrations()
    mine = next(i for i, (v, _) in enumerate(everything) if v.startswith("0025_"))
    s = Store.open(data_dir=chdb_dir, database=f"mig_{uuid.uuid4().hex[:12]}")
    monkeypatch.setattr(sqlfiles, "migrations", lambda: everything[:mine])
    s.migrate()
    from ingest.rows import COLUMNS, rows_for

    n = COLUMNS["kv_block_events"].index("first_pos")  # the columns before it (a later migration's)
    rows = [r[:n] for env in collect(BAD_FIRST) for table, table_rows in rows_for(env) for r in table_rows
            if table == "kv_block_events"]
    s.insert("kv_block_events", rows, COLUMNS["kv_block_events"][:n])  # what an ingester of then wrote
    assert restarts(s, "pod-r") == [(naive(0), 0, 0)]  # what the store held before
    monkeypatch.setattr(sqlfiles, "migrations", lambda: everything[: mine + 1])  # later migrations are not 0025's
    assert s.migrate() == [everything[mine][0]]
    s.command("DELETE FROM schema_migrations WHERE version = {v:String}", {"v": everything[mine][0]})
    s.migrate()  # a crash before the migration was recorded: it runs again
    assert restarts(s, "pod-r") == [(naive(0), 0, 0), (naive(10), 0, 0)]
    assert s.query_rows("SELECT count() FROM kv_block_log WHERE pod = 'pod-r' AND kind = 'restart'") == [(2,)]
