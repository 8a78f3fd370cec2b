"""Reading KV-event gaps: ``kv_gaps`` (sql/migrations/0030) counts as lost only the batches the store does not hold,
and reads one gap reported twice as one record.

The crash tests run vLLM's own ``ZmqEventPublisher`` over real ZMQ to the collector's subscriber, the in-process
queue and the ingester into real chDB; a crash between store and checkpoint is a subscriber whose envelopes were
stored and whose ack never ran (the collector's process died before it). The view tests write what a collector
publishes for vLLM's wire messages.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from test_kv_event_gaps import (
    Pub,
    batches,
    collect,
    delta,
    gap_metrics,
    gaps,
    publish_until,
    seen,
    subscriber,
    tcp,
    warm_up,
)
from test_kv_residency import at, frames, ingest, naive, residency, restarts, stored
from test_kv_residency import collect as decode

from collector.checkpoint import CheckpointStore
from collector.events import Envelope, KvEventGap, envelope
from collector.kv_events import KvEventSubscriber, checkpoint_key
from ingest.store import Store


def kv_gaps(store: Store, pod: str) -> list[dict[str, Any]]:
    cols = ("first_seq", "last_seq", "batches", "stored_batches", "lost_batches", "recovered", "reason", "reasons",
            "reports")
    rows = store.query_rows(f"SELECT {', '.join(cols)} FROM kv_gaps WHERE pod = {{p:String}} ORDER BY first_seq",
                            {"p": pod})
    return [dict(zip(cols, r, strict=True)) for r in rows]


def reported(store: Store, pod: str) -> list[tuple[int, int, int, bool]]:
    """The raw reports: (first_seq, last_seq, missing_batches - replayed_batches, recovered)."""
    return store.query_rows("SELECT first_seq, last_seq, missing_batches - replayed_batches, recovered FROM "
                            "kv_event_gaps FINAL WHERE pod = {p:String} ORDER BY detected_at", {"p": pod})


def stored_seqs(store: Store, pod: str) -> set[int]:
    return {s for (s,) in store.query_rows("SELECT DISTINCT seq FROM kv_block_events WHERE pod = {p:String}",
                                           {"p": pod})}


def poll_unacked(sub: KvEventSubscriber, out: list[Envelope], topic: str, seq: int) -> None:
    """Poll into ``out`` until ``seq`` arrived, never acking (the ack would have run after the store)."""
    while not seen(out, topic, seq)():
        out.extend(sub.poll(50)[0])


def test_a_crash_between_store_and_checkpoint_counts_no_stored_batch_as_lost(store: Store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The collector stores 3 batches and dies before its checkpoint; vLLM publishes on while it is down (no
    replay socket: whatever it does not receive is lost). The restarted collector reports a collector_restart gap
    from its checkpoint, which holds the 3 stored batches: the report counts them lost (the collector cannot know
    what the store holds), kv_gaps counts exactly the batches that are missing from the store."""
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    path = tmp_path / "checkpoints.json"
    sub = subscriber(endpoint, checkpoints=CheckpointStore(path))
    pub = Pub(endpoint, topic)
    try:
        out = warm_up(sub, pub, topic)  # acked
        ingest(store, out)
        acked = batches(out, topic)[-1].seq
        crashed: list[Envelope] = []
        poll_unacked(sub, crashed, topic, pub.publish(3)[-1])
        ingest(store, crashed)  # stored; the ack never runs
        sub.close()
        assert CheckpointStore(path).get(checkpoint_key(topic, 0))["seq"] == acked
        pub.publish(4)  # while down: nobody bound, or queued for the next subscriber and then dropped below

        before = gap_metrics(topic)
        sub = subscriber(endpoint, checkpoints=CheckpointStore(path))
        sub.drop_next(4)  # what ZMQ queued for the reconnect (at most those 4) is not delivered either: lost
        out2: list[Envelope] = []
        publish_until(sub, pub, out2, lambda: bool(batches(out2, topic)))
        collect(sub, out2, seen(out2, topic, pub.count - 1))
        ingest(store, out2)

        [gap] = gaps(out2)
        assert (gap.reason, gap.first_seq, gap.recovered) == ("collector_restart", acked + 1, False)
        missing = set(range(gap.first_seq, gap.last_seq + 1)) - stored_seqs(store, topic)
        assert len(missing) == gap.last_seq - gap.first_seq + 1 - 3 >= 4  # the 3 stored ones are not missing
        # the report (and this collector's metric) counts what it did not receive; the store's reading does not
        assert reported(store, topic) == [(gap.first_seq, gap.last_seq, gap.last_seq - gap.first_seq + 1, False)]
        assert delta(before, gap_metrics(topic))["lost"] == gap.last_seq - gap.first_seq + 1
        assert kv_gaps(store, topic) == [{
            "first_seq": gap.first_seq, "last_seq": gap.last_seq, "batches": gap.last_seq - gap.first_seq + 1,
            "stored_batches": 3, "lost_batches": len(missing), "recovered": False, "reason": "collector_restart",
            "reasons": ["collector_restart"], "reports": 1}]
    finally:
        sub.close()
        pub.close()


def test_a_gap_lost_live_and_recovered_after_a_restart_reads_as_one_recovered_gap(store: Store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The collector misses 3 batches and cannot replay them (lost, stored as such), then dies before its
    checkpoint. Restarted (with vLLM's replay socket now reachable) it reports the run again from its checkpoint,
    replayed: two reports of one gap, first lost, then recovered. kv_gaps reads one gap, recovered."""
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    path = tmp_path / "checkpoints.json"
    sub = subscriber(endpoint, checkpoints=CheckpointStore(path))  # no replay endpoint yet
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        ingest(store, out)
        acked = batches(out, topic)[-1].seq
        sub.drop_next(3)
        pub.publish(3)
        crashed: list[Envelope] = []
        poll_unacked(sub, crashed, topic, pub.publish(1)[0])
        [lost] = gaps(crashed)
        assert (lost.reason, lost.first_seq, lost.last_seq, lost.recovered) == ("missed", acked + 1, acked + 3, False)
        ingest(store, crashed)
        sub.close()

        sub = subscriber(endpoint, checkpoints=CheckpointStore(path), replay_endpoints={topic: replay})
        out2: list[Envelope] = []
        publish_until(sub, pub, out2, lambda: bool(batches(out2, topic)))
        collect(sub, out2, seen(out2, topic, pub.count - 1))
        ingest(store, out2)
        [again] = gaps(out2)
        assert (again.reason, again.first_seq, again.recovered) == ("collector_restart", acked + 1, True)
        assert stored_seqs(store, topic) >= set(range(acked + 1, pub.count))

        assert [r[3] for r in reported(store, topic)] == [False, True]  # two reports, one lost
        assert kv_gaps(store, topic) == [{
            "first_seq": acked + 1, "last_seq": again.last_seq, "batches": again.last_seq - acked,
            "stored_batches": again.last_seq - acked, "lost_batches": 0, "recovered": True, "reason": "missed",
            "reasons": ["collector_restart", "missed"], "reports": 2}]
        extent = {r["table"]: r["rows"] for r in store.named("data_extent", {}).to_dicts()}
        assert extent["kv_event_gaps"] == 1
    finally:
        sub.close()
        pub.close()


def gap_env(pod: str, first: int, last: int, detected: float, reason: str, replayed: int, prev: float | None,
            nxt: float | None) -> Envelope:
    gap = KvEventGap(topic=pod, dp_rank=0, first_seq=first, last_seq=last, detected_at_ms=int(at(detected).timestamp()
                     * 1000), reason=reason, replayed_batches=replayed, recovered=replayed == last - first + 1,
                     prev_batch_ts=None if prev is None else at(prev).timestamp(),
                     next_batch_ts=None if nxt is None else at(nxt).timestamp())
    return envelope(gap, pod=pod, natural_key=(pod, 0, first, last), observed_at_ms=gap.detected_at_ms, engine="0")


@pytest.mark.parametrize("order", ["lost_first", "recovered_first"])
def test_one_run_reported_lost_and_recovered_reads_as_one_recovered_gap(store: Store, order: str) -> None:
    """The same run (same pod, engine and seqs) reported twice with other outcomes: the replayed batches are
    stored, so it is recovered whichever report the store kept (the ingester keeps the first of one event id)."""
    msgs = [frames("pod-r", s, s, stored([400 + s])) for s in range(6)]
    lost, got = (gap_env("pod-r", 2, 3, t, "missed", n, 1, 4) for t, n in ((4.1, 0), (9.0, 2)))
    ingest(store, decode(msgs) + ([lost, got] if order == "lost_first" else [got, lost]))
    assert [(g["first_seq"], g["last_seq"], g["lost_batches"], g["recovered"], g["reports"])
            for g in kv_gaps(store, "pod-r")] == [(2, 3, 0, True, 1)]


def test_gaps_apart_stay_apart_and_a_lost_batch_is_counted_exactly(store: Store) -> None:
    """Two runs missed on one stream (seqs 2..3 lost; 6 replayed) and, on another pod, the same seqs stored by
    another vLLM process before a restart: each gap is its own record and counts only what its own window lacks."""
    msgs = [frames("pod-g", s, s, stored([100 + s])) for s in (0, 1, 4, 5, 6, 7)]
    envs = decode(msgs) + [gap_env("pod-g", 2, 3, 4.1, "missed", 0, 1, 4),
                           gap_env("pod-g", 6, 6, 7.1, "missed", 1, 5, 7)]
    # pod-h: a vLLM process published 0..5; the restarted one's 0..2 were missed and not replayed
    old = [frames("pod-h", s, s, stored([200 + s])) for s in range(6)]
    envs += decode(old + [frames("pod-h", 3, 20, stored([300]))])
    envs.append(gap_env("pod-h", 0, 2, 20.1, "publisher_restart", 0, 5, 20))
    ingest(store, envs)
    assert [(g["first_seq"], g["last_seq"], g["stored_batches"], g["lost_batches"], g["recovered"])
            for g in kv_gaps(store, "pod-g")] == [(2, 3, 0, 2, False), (6, 6, 1, 0, True)]
    assert [(g["first_seq"], g["last_seq"], g["stored_batches"], g["lost_batches"]) for g in kv_gaps(store, "pod-h")] \
        == [(0, 2, 0, 3)]
    assert restarts(store, "pod-h") == [(naive(0), 0, 0), (naive(20), 3, 0)]  # the new process's first stored batch
    extent = {r["table"]: r["rows"] for r in store.named("data_extent", {}).to_dicts()}
    assert extent["kv_event_gaps"] == 3


def test_a_restart_gap_whose_batches_were_stored_marks_no_second_restart(store: Store) -> None:
    """vLLM restarted (its seq 0 at 4 s); the collector stored the new process's batches 0..2 and died before its
    checkpoint (still the old process's seq 0 at 0 s); restarted, it sees seq 3 and reports a publisher_restart gap
    0..2, lost (no replay). The restart was marked from seq 0; the blocks stored at 4.5 and 5 s stay resident, where
    the report alone marked a second restart at seq 3 that ended them."""
    msgs = [frames("pod-s", 0, 0, stored([1])), frames("pod-s", 0, 4, stored([5], 500)),
            frames("pod-s", 1, 4.5, stored([6], 532, parent=5)), frames("pod-s", 2, 5, stored([7], 564, parent=6)),
            frames("pod-s", 3, 6, stored([8], 596, parent=7))]
    envs = decode(msgs) + [gap_env("pod-s", 0, 2, 6.1, "publisher_restart", 0, 0, 6)]
    ingest(store, envs)
    assert [(g["stored_batches"], g["lost_batches"], g["recovered"]) for g in kv_gaps(store, "pod-s")] == [
        (3, 0, True)]
    assert restarts(store, "pod-s") == [(naive(0), 0, 0), (naive(4), 0, 0)]
    got = [(h, r.replace(tzinfo=None) if r else None, by) for h, _, _, r, by, _, _ in residency(store, "pod-s")]
    assert got == [(1, naive(4), "pod_restart"), (5, None, None), (6, None, None), (7, None, None), (8, None, None)]


def test_a_gap_of_a_huge_seq_jump_is_read_without_listing_its_seqs(store: Store) -> None:
    """A publisher whose seq jumps by 10^12 (hostile, or a bug) leaves a gap of 10^12 batches: the view counts the
    batches the store holds in it without listing every seq (which would stop kv_cache_resets, and with it every
    precise-mode run) and still counts the batch it holds; a small gap beside it is counted exactly."""
    msgs = [frames("pod-j", s, s, stored([700 + s])) for s in (0, 1, 3, 5)]  # 5: stored, inside the long gap
    msgs.append(frames("pod-j", 10**12, 10, stored([800])))
    envs = decode(msgs) + [gap_env("pod-j", 2, 2, 3.1, "missed", 0, 1, 3),
                           gap_env("pod-j", 4, 10**12 - 1, 10.1, "missed", 0, 3, 10)]
    ingest(store, envs)
    assert [(g["first_seq"], g["last_seq"], g["stored_batches"], g["lost_batches"]) for g in kv_gaps(store, "pod-j")] \
        == [(2, 2, 0, 1), (4, 10**12 - 1, 1, 10**12 - 5)]
    assert restarts(store, "pod-j") == [(naive(0), 0, 0)]
