"""Hostile but plausible vLLM KV-event input, through the real path: vLLM's own ``ZmqEventPublisher``
(vllm/distributed/kv_events.py) publishes each batch to the collector's bound SUB socket (it encodes whatever it
is handed, so a malformed field reaches the collector as the bytes vLLM would put on the wire), the in-process
queue and the ingester write what the collector made of it to chDB. Each test failed before its fix.
"""

from __future__ import annotations

import hashlib
import random
import time
import uuid
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_port
from test_kv_bad_events import dead_letters
from test_kv_event_gaps import (
    Pub,
    batches,
    collect,
    delta,
    gap_metrics,
    gaps,
    idle,
    seen,
    subscriber,
    tcp,
    warm_up,
)
from test_kv_residency import ingest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch

from collector.events import Envelope
from collector.kv_decode import message_events
from ingest.store import Store
from kvscope.block_hash import block_digests, chain_hashes, external, salt_keys
from kvscope.config import ConfigError, build_config


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, **extra: object) -> BlockStored:
    """A BlockStored of 4-token blocks as vLLM builds it (``vllm/v1/core/block_pool.py``)."""
    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
                       **fields)  # type: ignore[arg-type]


def send(pub: Pub, sub, out: list[Envelope], *batch_events: list[KVCacheEvent]) -> list[Envelope]:  # type: ignore[no-untyped-def]
    """Publish each list of events as one vLLM batch; → what the collector published for them."""
    start, seqs = len(out), [pub.send(list(events)) for events in batch_events]
    collect(sub, out, seen(out, pub.topic, seqs[-1]))
    return out[start:]


def link(topic: str):  # type: ignore[no-untyped-def]
    """A subscriber and vLLM's publisher for ``topic`` with the link up; → (sub, pub, out)."""
    endpoint, replay = tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    pub.topic, pub.endpoint = topic, endpoint  # type: ignore[attr-defined]
    return sub, pub, warm_up(sub, pub, topic)


def log_chains(store: Store, pod: str, hashes: list[int]) -> dict[int, int]:
    rows = store.query_rows("SELECT block_hash, chain_hash FROM kv_block_log FINAL WHERE pod = {p:String} AND "
                            "kind = 'stored' AND has({h:Array(UInt64)}, block_hash)", {"p": pod, "h": hashes})
    return dict(rows)


def test_blocks_whose_vllm_hash_kvscope_cannot_reproduce_get_no_chain_hash(store: Store) -> None:
    """A multimodal input is hashed into vLLM's block hash with the tokens (``extra_keys``), and a null or
    masked-out block (hybrid models) has its tokens published but no hash: the chain hash kvscope would compute
    from the token ids alone names other blocks (the same tokens without the image, or tokens shifted by a skipped
    block), so precise attribution would credit a pod with blocks it never held. Such blocks, and blocks stored on
    top of them, get chain hash 0 (unknown). A cache_salt kvscope keys in as vLLM does: the salted blocks, and
    those on top of them, get the salted chain. A LoRA adapter's blocks chain from the adapter's root, as the
    gateway chains a prompt the adapter served (vLLM also hashes the adapter's path, which no event carries):
    docs/kv-events.md."""
    topic = f"pod-{uuid.uuid4().hex[:8]}"
    sub, pub, out = link(topic)
    try:
        h = random.getrandbits(60)
        toks = list(range(100, 108))
        new = send(pub, sub, out,
                   [stored([h, h + 1], toks, lora_name="adapter-a", lora_id=1)],           # LoRA
                   [stored([h + 2, h + 3], toks, extra_keys=[("tenant-salt",), None])],    # cache_salt, first block
                   [stored([h + 4], list(range(108, 112)), parent=h + 3)],                 # on top of the salted one
                   [stored([h + 5], toks)],                                                # 2 blocks of tokens, 1 hash
                   [stored([h + 6, h + 7], toks)],                                         # plain: known
                   [stored([h + 8], list(range(108, 112)), parent=h + 7)])                 # on top of a plain one
        assert [e.schema for e in new] == ["kv_event_batch"] * 6
        assert ingest(store, new)["kv_block_events"] == 6
        plain = chain_hashes(toks, 4)
        top = external(block_digests(range(108, 112), 4, block_digests(toks, 4)[-1])[0])
        salted = chain_hashes(toks, 4, cache_salt="tenant-salt")
        salted_top = external(block_digests(range(108, 112), 4, block_digests(
            toks, 4, extra_keys=[salt_keys("tenant-salt"), None])[-1])[0])
        assert salted != plain and salted_top != top
        adapter = chain_hashes(toks, 4, lora_name="adapter-a")
        assert not set(adapter) & set(plain)
        assert log_chains(store, topic, [h + i for i in range(9)]) == {
            h: adapter[0], h + 1: adapter[1], h + 2: salted[0], h + 3: salted[1], h + 4: salted_top, h + 5: 0,
            h + 6: plain[0], h + 7: plain[1], h + 8: top}
        assert store.query_rows("SELECT block_hashes, token_count FROM kv_block_events WHERE pod = {p:String} AND "
                                "has(block_hashes, {h:UInt64})", {"p": topic, "h": h}) == [([h, h + 1], 8)]
    finally:
        sub.close()
        pub.close()


class ClearedWithFields(KVCacheEvent, tag="AllBlocksCleared"):
    """An AllBlocksCleared carrying fields vLLM's has not (block hashes, a medium, nested garbage)."""

    block_hashes: list[int]
    medium: str
    nested: Any


class RemovedWithStoreFields(KVCacheEvent, tag="BlockRemoved"):
    """A BlockRemoved carrying a BlockStored's fields (token ids, block size, parent)."""

    block_hashes: list[int]
    medium: str
    token_ids: list[int]
    block_size: int
    parent_block_hash: int


def test_each_event_type_reads_only_its_own_fields_and_requires_its_block_hashes(store: Store) -> None:
    """A BlockStored or BlockRemoved without a block_hashes list, a block hash of fewer than 8 bytes, a block size
    or LoRA id of the wrong type are dead letters with their reason (they were stored as an event of no blocks,
    a block hash 0, a block size 0); fields an event type does not have are not read (an AllBlocksCleared kept
    the block hashes it carried, a BlockRemoved counted the token ids it carried)."""
    topic = f"pod-{uuid.uuid4().hex[:8]}"
    sub, pub, out = link(topic)
    try:
        h, digest = random.getrandbits(60), hashlib.sha256(b"block").digest()
        events: list[KVCacheEvent] = [
            BlockRemoved(block_hashes=None, medium="GPU"),  # type: ignore[arg-type]
            stored([b""], list(range(4))),  # type: ignore[list-item]
            BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(4)), block_size=False,
                        lora_id=None, medium="GPU", lora_name=None),
            ClearedWithFields(block_hashes=[h], medium="GPU", nested=[[[{"a": [1]}]]]),
            RemovedWithStoreFields(block_hashes=[h], medium="GPU", token_ids=list(range(8)), block_size=4,
                                   parent_block_hash=h - 1),
            stored([h + 1], list(range(4)), lora_id="adapter-a"),
            stored([digest], list(range(4))),  # type: ignore[list-item]
        ]
        [batch, *dead] = send(pub, sub, out, events)
        seq = batch.payload.seq
        assert [(e.type, e.idx, e.block_hashes, e.medium) for e in batch.payload.events] == [
            ("AllBlocksCleared", 3, [], None), ("BlockRemoved", 4, [h], "GPU"),
            ("BlockStored", 6, [int.from_bytes(digest[-8:], "big")], "GPU")]
        assert [(loc, reason) for loc, reason, _ in dead_letters(dead)] == [
            (f"zmq:{topic}:0:seq {seq}:event 0", "event 0 of the batch: BlockRemoved has no block_hashes list (got "
                                                 "nothing)"),
            (f"zmq:{topic}:0:seq {seq}:event 1", "event 1 of the batch: block hash of 0 bytes (a vLLM block digest "
                                                 "has 16 or 32)"),
            (f"zmq:{topic}:0:seq {seq}:event 2", "event 2 of the batch: block_size False is not a token count"),
            (f"zmq:{topic}:0:seq {seq}:event 5", "event 5 of the batch: lora_id is str, not an integer"),
        ]
        assert ingest(store, [batch, *dead]) == {"kv_block_events": 3, "dead_letters": 4}
        assert store.query_rows("SELECT idx, event_type, block_hashes, parent_block_hash, token_count, block_size, "
                                "medium FROM kv_block_events WHERE pod = {p:String} AND seq = {s:UInt64} ORDER BY idx",
                                {"p": topic, "s": seq}) == [
            (3, "AllBlocksCleared", [], None, 0, 0, ""), (4, "BlockRemoved", [h], None, 0, 0, "GPU"),
            (6, "BlockStored", [int.from_bytes(digest[-8:], "big")], None, 4, 4, "GPU")]
    finally:
        sub.close()
        pub.close()


def test_a_batch_whose_data_parallel_rank_is_not_a_rank_is_a_dead_letter(store: Store) -> None:
    """vLLM's publisher fills in its own rank only when the batch has none: a rank of "1", 1.0 or -1 reaches
    the collector as sent. It was read as no rank (engine "", another stream than the pod's rank 0) or as engine
    "-1" (and its replay asked at port - 1); the message is now one dead letter with its reason, and the good
    batch after it is delivered on the pod's own stream, the bad seq reported as a gap."""
    topic = f"pod-{uuid.uuid4().hex[:8]}"
    sub, pub, out = link(topic)
    try:
        start, h = len(out), random.getrandbits(60)
        for rank in ("1", 1.0, -1):
            pub.vllm.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[h], medium="GPU")],
                                          data_parallel_rank=rank))  # type: ignore[arg-type]
            pub.count += 1
        good = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, good))
        new = out[start:]
        dead = {e.event_id: e.payload for e in new if e.schema == "dead_letter"}  # live, then again from the replay
        assert [(d.location, d.reason) for d in dead.values()] == [
            (f"zmq:{topic}", f"data_parallel_rank {r!r} is not a rank (an integer 0..65535)")
            for r in ("1", "1.0", "-1")]
        assert [b.seq for b in batches(new, topic)] == [good]
        [gap] = gaps(new)
        assert (gap.first_seq, gap.last_seq, gap.replayed_batches) == (good - 3, good - 1, 0)
        assert ingest(store, new)["dead_letters"] == 3
        assert store.query_rows("SELECT DISTINCT engine FROM kv_block_events WHERE pod = {p:String}",
                                {"p": topic}) == [("0",)]
    finally:
        sub.close()
        pub.close()


def test_a_missed_message_that_does_not_decode_is_dead_lettered_from_the_replay() -> None:
    """A message the collector missed live and that does not decode (here a batch ts that is not a time) comes
    back in vLLM's replay answer: it was skipped with a log line only, so it was neither listed nor counted; it
    is now the dead letter the live message would have made (same id), and it does not count as a replayed
    batch (the gap is not recovered)."""
    topic = f"pod-{uuid.uuid4().hex[:8]}"
    sub, pub, out = link(topic)
    try:
        start = len(out)
        sub.drop_next(1)
        bad_batch = KVEventBatch(ts="yesterday", events=[BlockRemoved(block_hashes=[5], medium="GPU")])  # type: ignore[arg-type]
        pub.vllm.publish(bad_batch)
        bad = pub.count
        pub.count += 1
        collect(sub, out, lambda: len(sub.dropped) == 1)
        good = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, good))
        new = out[start:]
        [live] = message_events(sub.dropped[0])
        assert [e.schema for e in new] == ["kv_event_gap", "dead_letter", "kv_event_batch"]
        assert (new[1].event_id, new[1].payload) == (live.event_id, live.payload)
        assert live.payload.reason == "batch ts yesterday is not a unix time in 2000..2100"
        [gap] = gaps(new)
        assert (gap.first_seq, gap.last_seq, gap.replayed_batches, gap.recovered) == (bad, bad, 0, False)
    finally:
        sub.close()
        pub.close()


def test_a_replay_socket_that_never_answers_is_not_asked_at_every_gap() -> None:
    """A replay endpoint that takes requests and never answers (a stuck publisher thread, a port taken by
    something else) held the subscriber's loop, and with it every pod's live events, for the whole replay
    timeout at every gap. After a failure it is now left alone for a backoff (the gaps meanwhile are lost at
    once and counted as replay failures) and asked again after it."""
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes replay requests, answers none
    silent.bind(replay)
    sub = subscriber(endpoint, replay_endpoints={topic: replay}, replay_timeout_seconds=0.3,
                     replay_backoff_seconds=1.0)
    pub = Pub(endpoint, topic)
    pub.topic = topic  # type: ignore[attr-defined]
    requests: list[list[bytes]] = []

    def gap() -> None:
        n = len(sub.dropped)
        sub.drop_next(1)
        pub.publish(1)
        collect(sub, out, lambda: len(sub.dropped) > n)
        collect(sub, out, seen(out, topic, pub.publish(1)[0]))
        while silent.poll(100):
            requests.append(silent.recv_multipart())

    try:
        out = warm_up(sub, pub, topic)
        before = gap_metrics(topic)
        for _ in range(3):
            gap()
        assert len(requests) == 1 and [g.recovered for g in gaps(out)] == [False] * 3
        assert delta(before, gap_metrics(topic)) == {"missed/lost": 3, "lost": 3, "replay_failures": 3}
        time.sleep(1.1)  # the backoff is over: asked again
        gap()
        assert len(requests) == 2
    finally:
        sub.close()
        pub.close()
        silent.close(linger=0)


def test_a_batch_from_a_pod_clock_far_ahead_is_a_dead_letter(store: Store) -> None:
    """vLLM stamps each batch with the pod's wall clock. A batch stamped years or days ahead (a pod clock gone
    wrong) was stored at that time: its BlockRemoved kept the block resident until then. It is now one dead
    letter with its reason; a batch within the allowed skew is read."""
    topic = f"pod-{uuid.uuid4().hex[:8]}"
    sub, pub, out = link(topic)
    try:
        start, h = len(out), random.getrandbits(60)
        for seconds in (10 * 365 * 86400, 2 * 86400, 60):
            events: list[KVCacheEvent] = [BlockRemoved(block_hashes=[h], medium="GPU")]
            pub.vllm.publish(KVEventBatch(ts=time.time() + seconds, events=events))
            pub.count += 1
        good = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, good))
        new = out[start:]
        dead = {e.event_id: e.payload.reason for e in new if e.schema == "dead_letter"}  # live, then replayed
        assert len(dead) == 2 and all("s ahead of the collector's clock" in r for r in dead.values())
        assert [b.seq for b in batches(new, topic)] == [good - 1, good]
        assert ingest(store, new) == {"kv_block_events": 3, "dead_letters": 2, "kv_event_gaps": 1}
        assert store.query_rows("SELECT count() FROM kv_block_events WHERE pod = {p:String} AND ts > now64() + "
                                "INTERVAL 1 HOUR", {"p": topic}) == [(0,)]
    finally:
        sub.close()
        pub.close()


def test_another_batch_under_a_delivered_seq_is_a_dead_letter_not_a_duplicate(store: Store) -> None:
    """Two vLLM processes publishing on one topic (a fleet configured with one topic for all pods), the second
    one's clock a few seconds behind: its batches repeat seqs the first already delivered, with other content
    and an older ts. They were dropped as duplicates (counted as such, their events lost without a trace); a
    duplicate is the same batch (vLLM re-sends only through replay, the same bytes), so each is now a dead letter
    saying why, and the first publisher's stream goes on undisturbed."""
    topic = f"pod-{uuid.uuid4().hex[:8]}"
    sub, pub, out = link(topic)
    other = Pub(pub.endpoint, topic)  # the second vLLM, connecting to the same collector socket
    try:
        collect(sub, out, seen(out, topic, pub.publish(40)[-1]))
        delivered = {b.seq for b in batches(out, topic)}
        start, before = len(out), gap_metrics(topic)
        behind = time.time() - 5
        while other.count < pub.count and len([e for e in out[start:] if e.schema == "dead_letter"]) < 3:
            other.vllm.publish(KVEventBatch(ts=behind + other.count / 1000,
                                            events=[BlockRemoved(block_hashes=[other.count], medium="GPU")]))
            other.count += 1
            idle(sub, out, 0.05)  # the second PUB gets the subscription only while the SUB is used
        idle(sub, out, 0.2)
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        new = out[start:]
        dead = [e.payload for e in new if e.schema == "dead_letter"]
        assert dead, "no dead letter for the second publisher's batches"
        seqs = [int(d.location.rsplit(" ", 1)[1]) for d in dead]
        assert set(seqs) <= delivered and len(set(seqs)) == len(seqs)
        assert all(d.reason.startswith(f"seq {s} was already delivered with another batch") for s, d in
                   zip(seqs, dead, strict=True))
        assert [b.seq for b in batches(new, topic)] == [last]
        assert set(delta(before, gap_metrics(topic))) <= {"duplicates"}  # only seqs the first never delivered
        assert ingest(store, new)["dead_letters"] == len(dead)
    finally:
        sub.close()
        pub.close()
        other.close()


def consecutive_ports() -> int:
    """A free port whose next port is free too (vLLM's rank 1 uses port + 1)."""
    while True:
        port = free_port()
        probe = zmq.Context.instance().socket(zmq.SUB)
        try:
            probe.bind(f"tcp://127.0.0.1:{port + 1}")
            return port
        except zmq.ZMQError:
            continue
        finally:
            probe.close(linger=0)


def test_every_data_parallel_rank_of_a_pod_reaches_the_collector() -> None:
    """vLLM offsets the kv-events endpoint by the rank even when it connects (``offset_endpoint_port``): with
    ``--data-parallel-size 2`` and the collector's address as endpoint, rank 1 connects to the collector's port
    + 1, where nothing listened, so rank 1's events were never received (and, never seen, never reported as a
    gap). The collector now binds one port per rank (``KVSCOPE_KV_EVENTS_DP_RANKS``)."""
    topic, port = f"pod-{uuid.uuid4().hex[:8]}", consecutive_ports()
    endpoint = f"tcp://127.0.0.1:{port}"
    sub = subscriber(endpoint, dp_ranks=2)
    rank0, rank1 = Pub(endpoint, topic, dp_rank=0), Pub(endpoint, topic, dp_rank=1)  # the same configured endpoint
    try:
        out = warm_up(sub, rank0, topic)
        out += warm_up(sub, rank1, topic, dp_rank=1)
        assert {e.engine for e in out if e.schema == "kv_event_batch"} == {"0", "1"}
        assert rank1.vllm._endpoint == f"tcp://127.0.0.1:{port + 1}"  # where vLLM's rank 1 sent them
    finally:
        sub.close()
        rank0.close()
        rank1.close()


def test_the_number_of_data_parallel_ranks_is_checked_at_start() -> None:
    assert build_config(environ={"KVSCOPE_KV_EVENTS_DP_RANKS": "4"}).kv_events_dp_ranks == 4
    for bad in ("0", "257"):
        with pytest.raises(ConfigError, match="KVSCOPE_KV_EVENTS_DP_RANKS"):
            build_config(environ={"KVSCOPE_KV_EVENTS_DP_RANKS": bad})


def test_a_first_frame_too_long_for_a_topic_names_no_pod(store: Store) -> None:
    """The topic names the pod: the ``pod`` of every row, a metric label, the Kafka key. A one-frame message of
    100 kB from another program on the collector's port, or a 3-frame batch under a 1 kB topic, made that frame
    the pod's name. Both are now dead letters filed under the frame's first 256 bytes."""
    endpoint = tcp()
    sub = subscriber(endpoint)
    plain = zmq.Context.instance().socket(zmq.PUB)  # another program speaking ZMQ to the collector's port
    plain.connect(endpoint)
    out: list[Envelope] = []
    try:
        long_topic = b"t" * 1000
        payload = msgspec.msgpack.encode([time.time(), [{"type": "AllBlocksCleared"}], 0])
        while len(out) < 2:  # a connecting PUB drops what it sends before the subscription reaches it
            plain.send_multipart([b"x" * 100_000])
            plain.send_multipart([long_topic, (1).to_bytes(8, "big"), payload])
            out.extend(sub.poll(100)[0])
        assert {e.schema for e in out} == {"dead_letter"} and max(len(e.pod) for e in out) <= 256
        assert {e.payload.reason for e in out} == {"expected 3 frames [topic, seq, payload], got 1",
                                                   "topic of 1000 bytes (a pod's topic has at most 256)"}
        assert ingest(store, out)["dead_letters"] >= 2
        assert store.query_rows("SELECT max(length(pod)), max(length(location)) FROM dead_letters") == [(256, 260)]
    finally:
        sub.close()
        plain.close(linger=0)


def test_two_vllm_processes_on_one_topic_are_dead_lettered_not_taken_for_restarts() -> None:
    """vLLM's default topic is "" and a fleet may well share one: two processes then publish on one stream. Each
    time it switched from one to the other the seq went back (taken for a vLLM restart: a publisher_restart gap
    and a replay of everything since seq 0) or jumped ahead (a missed gap of the other's seqs, counted lost):
    20 batches made 20 false gaps and 280 batches counted lost. A seq that goes back within
    MIN_RESTART_SECONDS of the stream's last batch cannot be a restart (vLLM loads the model before it creates
    its publisher): it is now a dead letter naming the cause, so after one gap the stream follows one process
    and the other's batches are dead letters."""
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    sub = subscriber(endpoint, replay_timeout_seconds=0.2)
    first, second = Pub(endpoint, topic), Pub(endpoint, topic)
    try:
        out = warm_up(sub, first, topic)
        for _ in range(30):  # the second has published longer: its seq is ahead
            second.publish(1)
            idle(sub, out, 0.02)
        start = len(out)
        for _ in range(10):
            first.publish(1)
            idle(sub, out, 0.05)
            second.publish(1)
            idle(sub, out, 0.05)
        idle(sub, out, 0.5)
        new = out[start:]
        assert len(gaps(new)) <= 1 and not [g for g in gaps(new) if g.reason == "publisher_restart"]
        dead = [e.payload for e in new if e.schema == "dead_letter"]
        assert len(dead) >= 9 and all("two vLLM processes publish on topic" in d.reason for d in dead)
        assert len(batches(new, topic)) + len(dead) == 20
    finally:
        sub.close()
        first.close()
        second.close()
