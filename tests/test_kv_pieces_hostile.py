"""Hostile KV-event rows on the ingester's path through ingest/kv_pieces.py: an event whose block positions pass
kv_block_log's UInt32 ``pos`` is a dead letter with its reason while the rest of its batch lands, and the store is
read over the incoming rows' own times, not over all that lies between a row of 2000 and one of 2099."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from test_kv_residency import at, ingest

from collector.events import Envelope, KvBlockEvent, KvEventBatch, envelope
from ingest.kv_pieces import trim_kv_rows
from ingest.rows import COLUMNS, kv_rows
from ingest.store import Store


def batch(pod: str, seq: int, ts: float, events: list[KvBlockEvent], part: int = 0) -> Envelope:
    """A KV-event batch (or a part of one: ``part``) of ``pod`` stamped ``ts`` unix seconds, as any producer may send
    it."""
    b = KvEventBatch(topic=pod, seq=seq, batch_ts=ts, dp_rank=0, events=events, continued=part > 0)
    return envelope(b, pod=pod, natural_key=(pod, seq, ts, part), observed_at_ms=int(ts * 1000), engine="0")


def blocks(hashes: list[int], first_pos: int = 0, idx: int = 0) -> KvBlockEvent:
    return KvBlockEvent(type="BlockStored", block_hashes=hashes, block_size=32, medium="GPU",
                        token_count=32 * len(hashes), chain_hashes=[h + 1000 for h in hashes], idx=idx,
                        first_pos=first_pos)


def test_an_event_whose_blocks_pass_the_last_position_is_a_dead_letter_and_its_batch_lands(store: Store) -> None:
    """Blocks at 2^32-2 .. 2^32 (the last wrapped to pos 0 in kv_block_log, onto the block of another piece there)
    and a negative first_pos: each event a dead letter with the reason; the batch's good event and the piece at
    pos 0 land, each block at its own position."""
    t = at(1).timestamp()
    envs = [batch("pod-p", 1, t, [blocks([1, 2, 3], first_pos=2**32 - 2), blocks([7], idx=1),
                                  blocks([8], first_pos=-1, idx=2)]),
            batch("pod-p", 1, t, [blocks([5, 6])], part=1),
            batch("pod-p", 2, t, [blocks([9], first_pos=2**32 - 1)])]  # the last position: fine
    assert ingest(store, envs) == {"kv_block_events": 3, "dead_letters": 2}
    assert store.query_rows("SELECT block_hash, pos FROM kv_block_log FINAL WHERE pod = 'pod-p' AND kind = 'stored' "
                            "ORDER BY block_hash") == [(5, 0), (6, 1), (7, 0), (9, 2**32 - 1)]
    reasons = sorted(r for (r,) in store.query_rows("SELECT reason FROM dead_letters WHERE pod = 'pod-p'"))
    assert reasons == ["event 0 of the batch: first_pos 4294967294 with 3 blocks puts a block outside the positions "
                       "0..4294967295 of a vLLM event",
                       "event 2 of the batch: first_pos -1 with 1 blocks puts a block outside the positions "
                       "0..4294967295 of a vLLM event"]
    assert ingest(store, envs) == {}  # sent again: nothing more


def test_rows_of_far_apart_times_read_only_the_store_near_them(store: Store) -> None:
    """An insert holding a row of 2000 and one of 2099 (hostile batch ts) reads the store near those two times: not
    the 60,000 events of the pod stored between them (the session's read limit below would stop that read). The
    row already stored is still found."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    env = batch("pod-t", 1, base.timestamp(), [blocks([10])])
    one = kv_rows(env, env.payload)[0]  # type: ignore[arg-type]
    c = COLUMNS["kv_block_events"]
    ts_at = c.index("ts")
    rows = [(*one[:ts_at], base + timedelta(milliseconds=i), *one[ts_at + 1:]) for i in range(60_000)]
    store.insert("kv_block_events", rows, c)
    early = (*one[:ts_at], datetime(2000, 1, 1, tzinfo=UTC), *one[ts_at + 1:])
    late = (*one[:ts_at], datetime(2099, 1, 1, tzinfo=UTC), *one[ts_at + 1:])
    held = rows[0]
    store.command("SET max_rows_to_read = 30000")
    try:
        kept = trim_kv_rows(store, [early, held, late], c, [1, 2, 3])
    finally:
        store.command("SET max_rows_to_read = 0")
    assert [i for i, _ in kept] == [0, 2]  # the stored one dropped, the two new ones kept
