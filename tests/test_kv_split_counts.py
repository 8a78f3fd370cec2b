"""What ``kvscope_collector_kv_batches_split_total`` counts for hostile batches (:func:`collector.publish.batches_split`
over the cuts :func:`collector.publish.plan_messages` makes): a batch of one block too large for a message is a dead
letter, not a batch sent in parts."""

from __future__ import annotations

from collector.events import KvBlockEvent, KvEventBatch, envelope
from collector.publish import SplitBatch, batches_split, plan_messages


def batch(*events: KvBlockEvent) -> object:
    p = KvEventBatch(topic="pod-s", seq=1, batch_ts=1.7e9, dp_rank=0, events=list(events))
    return envelope(p, pod="pod-s", natural_key=("pod-s", 1, 1.7e9), observed_at_ms=1, engine="0")


HUGE = KvBlockEvent(type="BlockStored", block_hashes=[1], block_size=32, medium="G" * 5000, token_count=32, idx=0)
SMALL = KvBlockEvent(type="BlockStored", block_hashes=[2], block_size=32, medium="GPU", token_count=32, idx=1)


def test_a_batch_of_one_block_too_large_alone_is_a_dead_letter_not_a_split() -> None:
    """One block of 5 kB against a 2 kB cap: sent as its dead letter only (oversized), not counted as split."""
    splits: list[SplitBatch] = []
    messages, oversized = plan_messages([batch(HUGE)], max_message_bytes=2000, splits=splits)  # type: ignore[list-item]
    assert [(o.why, o.kind) for o in oversized] == [("setting", "kv_event_batch")]
    assert len(messages) == 1  # the dead letter
    assert batches_split(splits) == {}
    assert "(the batch held nothing else)" in oversized[0].dead_letter.payload.reason  # type: ignore[union-attr]  # no other parts were sent


def test_a_batch_cut_into_a_part_and_a_dead_letter_counts_once() -> None:
    """The huge block dead-lettered, the small one sent in a part of its own: the batch was cut, counted once."""
    splits: list[SplitBatch] = []
    ev = batch(HUGE, SMALL)
    messages, oversized = plan_messages([ev], max_message_bytes=2000, splits=splits)  # type: ignore[list-item]
    assert len(oversized) == 1 and len(messages) == 2
    assert batches_split(splits) == {ev.event_id: "setting"}  # type: ignore[attr-defined]
    assert "(the batch's other blocks and events were, in 1 part)" in oversized[0].dead_letter.payload.reason  # type: ignore[union-attr]


def test_a_part_cut_again_and_again_counts_its_batch_once() -> None:
    """A batch cut by the setting, one part refused by the broker and cut again, a part of that refused and cut again
    (each with its own id): one batch, why=broker; a cut that left nothing but a dead letter adds none."""
    splits = [SplitBatch("p", "b", 10, ("p1", "p2"), "setting"), SplitBatch("p", "p2", 6, ("p21", "p22"), "broker"),
              SplitBatch("p", "p22", 4, ("p221", "p222"), "broker"), SplitBatch("p", "c", 9, (), "setting")]
    assert batches_split(splits) == {"b": "broker"}
