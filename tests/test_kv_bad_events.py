"""One bad event inside a vLLM KV-event batch costs only itself (docs/kv-events.md, "Bad events").

vLLM's own ``ZmqEventPublisher`` sends every batch here: it encodes whatever events it is handed, so a block hash
of -1 or an event type from a newer vLLM reach the collector as the bytes vLLM would put on the wire. The
subscriber decodes them, the in-process queue and the ingester write them to chDB (dedup by event id), whose
materialized views fill kv_block_log.
"""

from __future__ import annotations

import base64
import random
import uuid
from typing import Any

import msgspec
from test_kv_event_gaps import Pub, batches, collect, delta, gap_metrics, gaps, metric, seen, subscriber, tcp, warm_up
from test_kv_residency import ingest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from collector.events import Envelope
from collector.kv_decode import message_events
from collector.kv_replay import fetch_replay
from ingest.store import Store
from kvscope.block_hash import chain_hashes


class BlockPinned(KVCacheEvent):
    """An event type this kvscope does not read, tagged as vLLM tags its own (what a newer vLLM could publish)."""

    block_hashes: list[int]
    medium: str | None = None


def mixed(h: int) -> list[KVCacheEvent]:
    """[0] BlockStored h, h+1 (tokens 0..7, 4 per block); [1] BlockPinned h (unknown type); [2] BlockStored h+2 on
    top of h+1 (tokens 8..11); [3] BlockRemoved of hash -1 (outside 0..2**64-1); [4] BlockRemoved h."""
    return [
        BlockStored(block_hashes=[h, h + 1], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockPinned(block_hashes=[h], medium="GPU"),
        BlockStored(block_hashes=[h + 2], parent_block_hash=h + 1, token_ids=list(range(8, 12)), block_size=4,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[-1], medium="GPU"),
        BlockRemoved(block_hashes=[h], medium="GPU"),
    ]


UNKNOWN = ("unknown KV event type 'BlockPinned' (a newer vLLM may publish it; this kvscope reads BlockStored, "
           "BlockRemoved, AllBlocksCleared)")


def dead_letters(envs: list[Envelope]) -> list[tuple[str, str, Any]]:
    """(location, reason, the event as decoded from the dead letter's raw msgpack) of each KV dead letter."""
    return [(e.payload.location, e.payload.reason, msgspec.msgpack.decode(base64.b64decode(e.payload.raw)))
            for e in envs if e.schema == "dead_letter" and e.payload.source == "kv_events"]


def test_a_mixed_batch_keeps_its_good_events_at_their_index_and_dead_letters_each_bad_one(store: Store) -> None:
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        start, before = len(out), gap_metrics(topic)
        dead_before = metric("kvscope_dead_letters_total", source="kv_events")
        h = random.getrandbits(62)
        seq = pub.send(mixed(h))
        only_bad = pub.send([BlockPinned(block_hashes=[h + 9])])
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        new = out[start:]

        # every seq delivered once, in order: no gap, nothing replayed, no duplicate
        assert [b.seq for b in batches(new, topic)] == [seq, only_bad, last] == [seq, seq + 1, seq + 2]
        assert gaps(out) == [] and delta(before, gap_metrics(topic)) == {}
        mixed_batch, empty_batch, _ = batches(new, topic)
        assert [(e.type, e.idx) for e in mixed_batch.events] == [("BlockStored", 0), ("BlockStored", 2),
                                                                 ("BlockRemoved", 4)]
        assert empty_batch.events == []
        # one dead letter per bad event, right after its batch, with its index and reason
        assert [e.schema for e in new] == ["kv_event_batch", "dead_letter", "dead_letter",
                                           "kv_event_batch", "dead_letter", "kv_event_batch"]
        assert dead_letters(new) == [
            (f"zmq:{topic}:0:seq {seq}:event 1", f"event 1 of the batch: {UNKNOWN}",
             {"type": "BlockPinned", "block_hashes": [h], "medium": "GPU"}),
            (f"zmq:{topic}:0:seq {seq}:event 3", "event 3 of the batch: block hash -1 is outside 0..2**64-1",
             {"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}),
            (f"zmq:{topic}:0:seq {only_bad}:event 0", f"event 0 of the batch: {UNKNOWN}",
             {"type": "BlockPinned", "block_hashes": [h + 9]}),
        ]

        assert ingest(store, new) == {"kv_block_events": 5, "dead_letters": 3}
        assert metric("kvscope_dead_letters_total", source="kv_events") - dead_before == 3
        stored = store.query_rows("SELECT seq, idx, event_type, block_hashes, token_count FROM kv_block_events "
                                  "WHERE pod = {p:String} AND seq <= {s:UInt64} ORDER BY seq, idx",
                                  {"p": topic, "s": only_bad})
        assert stored == [(seq, 0, "BlockStored", [h, h + 1], 8), (seq, 2, "BlockStored", [h + 2], 4),
                          (seq, 4, "BlockRemoved", [h], 0)]
        log = store.query_rows("SELECT idx, pos, kind, block_hash, chain_hash FROM kv_block_log FINAL "
                               "WHERE pod = {p:String} AND seq = {s:UInt64} ORDER BY idx, pos",
                               {"p": topic, "s": seq})
        chain = chain_hashes(range(12), 4)  # the stored blocks chain across events 0 and 2
        assert log == [(0, 0, "stored", h, chain[0]), (0, 1, "stored", h + 1, chain[1]),
                       (2, 0, "stored", h + 2, chain[2]), (4, 0, "removed", h, 0)]
        assert store.query_rows("SELECT removed_by FROM kv_block_residency WHERE pod = {p:String} ORDER BY "
                                "block_hash", {"p": topic})[:3] == [("block_removed",), (None,), (None,)]
        assert sorted(store.query_rows("SELECT location, reason FROM dead_letters WHERE source = 'kv_events'")) == \
            sorted((loc, reason) for loc, reason, _ in dead_letters(new))

        # re-sent (a collector restart before its ack) and re-decoded from vLLM's replay socket: nothing twice
        assert ingest(store, new) == {}
        resent = [sub.chains.envelope(e) for f in fetch_replay(replay, seq, only_bad, 2.0)
                  for e in message_events(f)]
        assert [e.event_id for e in resent] == [e.event_id for e in new[:5]]
        assert ingest(store, resent) == {}
        assert store.query_rows("SELECT count() FROM kv_block_events WHERE pod = {p:String} AND seq <= {s:UInt64}",
                                {"p": topic, "s": only_bad}) == [(3,)]
        assert store.query_rows("SELECT count() FROM dead_letters") == [(3,)]
    finally:
        sub.close()
        pub.close()


def test_a_replayed_batch_dead_letters_its_bad_events_as_the_live_one_would() -> None:
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        start, before = len(out), gap_metrics(topic)
        sub.drop_next(1)
        seq = pub.send(mixed(random.getrandbits(62)))
        collect(sub, out, lambda: len(sub.dropped) == 1)
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        new = out[start:]

        [gap] = gaps(new)
        assert (gap.first_seq, gap.last_seq, gap.replayed_batches, gap.recovered) == (seq, seq, 1, True)
        assert delta(before, gap_metrics(topic)) == {"missed/recovered": 1, "replayed": 1}
        assert [e.schema for e in new] == ["kv_event_gap", "kv_event_batch", "dead_letter", "dead_letter",
                                           "kv_event_batch"]
        live = [sub.chains.envelope(e) for e in message_events(sub.dropped[0])]  # had the message arrived
        assert [e.event_id for e in new[1:4]] == [e.event_id for e in live]
        assert new[1].payload == msgspec.structs.replace(live[0].payload, replayed=True)
        assert [e.idx for e in new[1].payload.events] == [0, 2, 4]
        assert new[2:4] == live[1:]
    finally:
        sub.close()
        pub.close()
