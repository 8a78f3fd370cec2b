"""KV-event batch envelopes no collector makes, from any producer on the topic, through the real ingester into chDB:
the ingester re-checks every field later code reads (as it re-checks gateway records and gap reports), so a seq, ts
or rank out of range is one dead letter with its reason, an event of an unknown type or with a value no column holds
is a dead letter of its own, and the rest of the Kafka batch lands; and two data-parallel ranks of one pod are two
streams whose batches never share an event id. Each test failed before its fix."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
from test_kv_residency import at, ingest

from collector.events import (
    Envelope,
    KvBlockEvent,
    KvEventBatch,
    KvEventGap,
    SeriesSample,
    VllmScrape,
    envelope,
    make_event_id,
)
from collector.gateway_log import line_event
from collector.kv_decode import message_events
from collector.publish import to_messages
from ingest.ingester import Ingester
from ingest.store import Store
from kvscope.importer import _NoSource

T = at(1).timestamp()


def stored_event(hashes: list[int], **fields: Any) -> KvBlockEvent:
    return KvBlockEvent(**{"type": "BlockStored", "block_hashes": hashes, "block_size": 16,
                           "token_count": 16 * len(hashes), "medium": "GPU", **fields})


def batch(pod: str, seq: int, events: list[KvBlockEvent], ts: float = T, dp_rank: Any = 0) -> Envelope:
    """A batch envelope as any producer on the topic may send it."""
    b = KvEventBatch(topic=pod, seq=seq, batch_ts=ts, dp_rank=dp_rank, events=events)
    return envelope(b, pod=pod, natural_key=(pod, seq, ts, dp_rank), observed_at_ms=int(T * 1000))


def gateway_line(request_id: str) -> Envelope:
    rec = {"log_version": 1, "request_id": request_id, "ts": at(1).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
           "tenant_id": "acme", "status": 200, "prompt_tokens": 10, "cached_tokens": 5, "ttft_ms": 1.0,
           "e2e_ms": 2.0}
    return line_event(msgspec.json.encode(rec), pod="gateway", source_file="/tmp/gw", offset=0)


def reasons(store: Store, pod: str) -> list[str]:
    return sorted(r for (r,) in store.query_rows("SELECT reason FROM dead_letters WHERE pod = {p:String}", {"p": pod}))


def kv(store: Store, pod: str) -> list[tuple[Any, ...]]:
    return store.query_rows("SELECT engine, seq, idx, event_type, block_hashes FROM kv_block_events "
                            "WHERE pod = {p:String} ORDER BY engine, seq, idx", {"p": pod})


def handle_once(store: Store, envs: list[Envelope]) -> tuple[bool, dict[str, int]]:
    """One Kafka batch through the ingester's ``handle`` (what it does with a polled batch), stopped after 10 s: a
    batch it keeps retrying returns False instead of hanging the test."""
    ing = Ingester(store, _NoSource(), max_backoff_seconds=0.5)
    stop = threading.Event()
    timer = threading.Timer(10.0, stop.set)
    timer.start()
    try:
        return ing.handle(to_messages(envs), stop), dict(ing.rows_written)
    finally:
        timer.cancel()


@pytest.mark.parametrize("seq", [-1, 2**64])
def test_a_seq_no_uint64_holds_is_a_dead_letter_not_a_batch_retried_forever(store: Store, seq: int) -> None:
    """seq -1 (or 2^64) reached the block-level dedup query as an Array(UInt64) parameter, which fails; the ingester
    took that for a failure that may pass and retried the Kafka batch forever, so nothing after it landed. Now the
    envelope is a dead letter with its reason, the batch's other envelopes land, and it is committed."""
    envs = [gateway_line("ok-1"), batch("pod-g", 3, [stored_event([8])]), batch("pod-s", seq, [stored_event([7])])]
    committed, written = handle_once(store, envs)
    assert committed
    assert written == {"gateway_requests": 1, "kv_block_events": 1, "dead_letters": 1}
    assert kv(store, "pod-g") == [("0", 3, 0, "BlockStored", [8])] and kv(store, "pod-s") == []
    [reason] = reasons(store, "pod-s")
    assert f"seq {seq} is outside 0..2**64-1" in reason
    assert handle_once(store, envs) == (True, {})  # sent again: nothing more


@pytest.mark.parametrize(("ts", "rank", "why"), [
    (5e9, 0, "batch_ts 5000000000.0 is outside 2000..2100 (UTC)"),  # 2128: toDateTime wrapped it to 1992
    (-1e9, 0, "batch_ts -1000000000.0 is outside 2000..2100 (UTC)"),  # 1938
    (0.0, 0, "batch_ts 0.0 is outside 2000..2100 (UTC)"),  # 1970
    (1e300, 0, "batch_ts 1e+300 is outside 2000..2100 (UTC)"),  # past what a datetime holds
    (T, -1, "dp_rank -1 is not a data-parallel rank"),
    (T, 2**16, "dp_rank 65536 is not a data-parallel rank"),
])
def test_a_batch_ts_or_rank_no_collector_makes_is_a_dead_letter(store: Store, ts: float, rank: int, why: str) -> None:
    """The collector's decoder refuses these (collector/kv_decode.py); an envelope of another producer carrying them
    was stored as it was. Now it is one dead letter (source ingest) with its reason, and the good batch beside it
    lands."""
    envs = [batch("pod-g", 1, [stored_event([1])]), batch("pod-x", 1, [stored_event([2])], ts=ts, dp_rank=rank)]
    assert ingest(store, envs) == {"kv_block_events": 1, "dead_letters": 1}
    assert kv(store, "pod-x") == []
    [reason] = reasons(store, "pod-x")
    assert reason.startswith("kv_event_batch ") and why in reason
    assert store.query_rows("SELECT source FROM dead_letters WHERE pod = 'pod-x'") == [("ingest",)]
    assert ingest(store, envs) == {}


def test_an_event_no_collector_makes_is_a_dead_letter_of_its_own_and_its_batch_lands(store: Store) -> None:
    """An unknown event type (stored as it was: no reader takes it for a store or a removal), a hash, idx, token
    count or block size no column holds: each event one dead letter with its reason, the batch's good events land
    at their index. Two bad events at one place (idx and first_pos, which only another producer sends) are two dead
    letters, not one."""
    events = [stored_event([10], idx=0), KvBlockEvent(type="Bogus", block_hashes=[11], idx=1),
              stored_event([-1], idx=2), stored_event([12], parent_block_hash=-5, idx=3),
              stored_event([13], idx=-1), stored_event([14], idx=5, token_count=2**32),
              stored_event([15], idx=6, block_size=-1), stored_event([16], idx=7, chain_hashes=[2**64]),
              stored_event([17], idx=8), KvBlockEvent(type="Bogus", block_hashes=[18], idx=1)]
    envs = [batch("pod-e", 1, events)]
    assert ingest(store, envs) == {"kv_block_events": 2, "dead_letters": 8}
    assert kv(store, "pod-e") == [("0", 1, 0, "BlockStored", [10]), ("0", 1, 8, "BlockStored", [17])]
    unknown = "unknown KV event type 'Bogus' (this kvscope reads BlockStored, BlockRemoved, AllBlocksCleared)"
    assert reasons(store, "pod-e") == sorted([
        f"event 1 of the batch: {unknown}",
        "event 2 of the batch: block_hashes holds -1, outside 0..2**64-1",
        "event 3 of the batch: parent_block_hash -5 is outside 0..2**64-1",
        "event -1 of the batch: idx -1 is not a position in a vLLM batch (0..4294967295)",
        "event 5 of the batch: token_count 4294967296 is not a token count (0..4294967295)",
        "event 6 of the batch: block_size -1 is not a token count (0..2147483647)",
        "event 7 of the batch: chain_hashes holds 18446744073709551616, outside 0..2**64-1",
        f"event 1 of the batch: {unknown}",
    ])
    assert ingest(store, envs) == {}


@pytest.mark.parametrize(("detected_ms", "rank", "why"), [
    (int(T * 1000), -1, "dp_rank -1 is not a data-parallel rank"),
    (16725225600000, 0, "detected_at_ms 16725225600000 is not a unix time (ms) in 2000..2100 (UTC)"),  # 2500
    (0, 0, "detected_at_ms 0 is not a unix time (ms) in 2000..2100 (UTC)"),
])
def test_a_gap_report_of_no_rank_or_time_is_a_dead_letter(store: Store, detected_ms: int, rank: int, why: str) -> None:
    """A gap report (the other KV envelope) naming rank -1 (no stream), or detected in 2500 or 1970 (stored as it
    was), is one dead letter with its reason, and the batch beside it lands."""
    gap = KvEventGap(topic="pod-q", dp_rank=rank, first_seq=2, last_seq=3, detected_at_ms=detected_ms,
                     reason="missed", prev_batch_ts=T - 1, next_batch_ts=T)
    envs = [batch("pod-g", 1, [stored_event([1])]),
            envelope(gap, pod="pod-q", natural_key=("pod-q", rank, 2, 3), observed_at_ms=int(T * 1000))]
    assert ingest(store, envs) == {"kv_block_events": 1, "dead_letters": 1}
    assert store.query_rows("SELECT count() FROM kv_event_gaps") == [(0,)]
    [reason] = reasons(store, "pod-q")
    assert reason.startswith("kv_event_gap ") and why in reason


def frames(topic: str, seq: int, ts: float, rank: int | None, hashes: list[int]) -> list[bytes]:
    """One vLLM KV-event message of data-parallel rank ``rank`` (None: a payload without a rank)."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
             "token_ids": list(range(16 * len(hashes))), "block_size": 16, "lora_id": None, "medium": "GPU"}
    payload = msgspec.msgpack.encode([ts, [event, {"type": "Bogus"}]] + ([] if rank is None else [rank]))
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def test_two_ranks_of_one_pod_publishing_one_seq_at_one_ts_are_two_batches(store: Store) -> None:
    """Ranks 0 and 1 of a pod publish on one topic, each its own stream: their batches may share seq and ts. Keyed
    by (topic, seq, ts) they shared one event id and the ingester dropped rank 1's as a redelivery of rank 0's, its
    blocks lost without a dead letter. Each is stored (and each bad event's dead letter), and each re-send of
    either adds nothing."""
    envs = [e for rank in (0, 1, 2) for e in message_events(frames("pod-r", 5, T, rank, [100 + rank]))]
    assert len({e.event_id for e in envs}) == len(envs) == 6
    assert ingest(store, envs) == {"kv_block_events": 3, "dead_letters": 3}
    assert kv(store, "pod-r") == [("0", 5, 0, "BlockStored", [100]), ("1", 5, 0, "BlockStored", [101]),
                                  ("2", 5, 0, "BlockStored", [102])]
    again = [e for rank in (1, 0, 2) for e in message_events(frames("pod-r", 5, T, rank, [100 + rank]))]
    assert ingest(store, again) == {}


def test_rank_0_and_a_payload_without_a_rank_keep_the_event_id_of_earlier_releases() -> None:
    """A batch of rank 0 (or without a rank) re-sent after an upgrade must find the copy stored before it: its id
    is the one earlier releases gave it (pinned: (topic, seq, ts) under the pod)."""
    before = "be0f237cd15092897cc1e32ddec48acf"  # what kvscope before the rank was in the key made of it
    for rank in (0, None):
        [ev, _] = message_events(frames("pod-a", 5, 1764417600.5, rank, [111]))
        assert ev.event_id == before == make_event_id("kv_event_batch", "pod-a", "pod-a", 5, 1764417600.5)
    [one, _] = message_events(frames("pod-a", 5, 1764417600.5, 1, [111]))
    assert one.event_id != before


@pytest.mark.parametrize(("scraped_ms", "why"), [
    (16725225600000, "scraped_at_ms 16725225600.0 is outside 2000..2100 (UTC)"),  # 2500
    (0, "scraped_at_ms 0.0 is outside 2000..2100 (UTC)"),  # 1970
])
def test_a_scrape_stamped_outside_2000_to_2100_is_a_dead_letter(store: Store, scraped_ms: int, why: str) -> None:
    """A vLLM scrape envelope (any producer) stamped in 2500 or 1970 was stored as it was; it is one dead letter with
    its reason now, and the KV batch beside it lands."""
    scrape = VllmScrape(target="http://p:8000/metrics", scraped_at_ms=scraped_ms, previous_scraped_at_ms=0,
                        duration_ms=1.0, samples=[SeriesSample("vllm:num_requests_running", "0", "tiny", "", 1.0, 0.0)],
                        cache_config={})
    envs = [batch("pod-g", 1, [stored_event([1])]),
            envelope(scrape, pod="pod-s", natural_key=("pod-s", scraped_ms), observed_at_ms=int(T * 1000))]
    assert ingest(store, envs) == {"kv_block_events": 1, "dead_letters": 1}
    assert store.query_rows("SELECT count() FROM vllm_metrics WHERE pod = 'pod-s'") == [(0,)]
    [reason] = reasons(store, "pod-s")
    assert why in reason


def gap_envelope(pod: str, reason: Any, first: int = 2) -> Envelope:
    gap = KvEventGap(topic=pod, dp_rank=0, first_seq=first, last_seq=first + 1, detected_at_ms=int(T * 1000),
                     reason=reason, prev_batch_ts=T - 1, next_batch_ts=T)
    return envelope(gap, pod=pod, natural_key=(pod, 0, first, first + 1), observed_at_ms=int(T * 1000))


@pytest.mark.parametrize("reason", ["bogus", "", "Missed", "missed ", 5, None, ["missed"]])
def test_a_gap_report_of_an_unknown_reason_is_a_dead_letter_and_the_rest_lands(store: Store, reason: Any) -> None:
    """A gap report's reason was stored as it was: a reason no collector makes ("bogus", a misspelt "Missed") read in
    ``kv_gaps`` and the cache-reset views as neither a miss nor a restart. It is one dead letter with its reason now
    (a non-string one fails the envelope's decode, also a dead letter); the batch and the gap reports of the three
    known reasons beside it land, and a re-send adds nothing."""
    envs = [batch("pod-g", 1, [stored_event([1])]), gap_envelope("pod-q", reason),
            *(gap_envelope("pod-k", known, first) for first, known in
              ((2, "missed"), (10, "collector_restart"), (20, "publisher_restart")))]
    assert ingest(store, envs) == {"kv_block_events": 1, "kv_event_gaps": 3, "dead_letters": 1}
    assert store.query_rows("SELECT reason FROM kv_event_gaps ORDER BY first_seq") == [
        ("missed",), ("collector_restart",), ("publisher_restart",)]
    [why] = reasons(store, "pod-q")
    assert "gap reason" in why or "reason" in why and "Expected `str`" in why, why
    assert ingest(store, envs) == {}
