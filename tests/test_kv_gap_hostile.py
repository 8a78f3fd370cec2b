"""Hostile and unusual KV-event gap reports: each is read once by ``kv_gaps`` (sql/migrations/0030), or, when no
collector could have made it, dead-lettered with its reason while the rest of its batch lands; the view and
``kv_cache_resets`` never error and count nothing negative, wrapped around or twice."""

from __future__ import annotations

import pytest
from test_kv_gap_reads import kv_gaps
from test_kv_residency import at, frames, ingest, stored
from test_kv_residency import collect as decode

from collector.events import Envelope, KvEventGap, envelope
from ingest.store import Store


def report(pod: str, first: int, last: int, prev: float | None, nxt: float | None, replayed: int = 0,
           reason: str = "missed") -> Envelope:
    """A gap report as any producer may send it: ``prev``/``nxt`` unix seconds as they are (None: unknown)."""
    gap = KvEventGap(topic=pod, dp_rank=0, first_seq=first, last_seq=last, detected_at_ms=int(at(50).timestamp()
                     * 1000), reason=reason, replayed_batches=replayed, recovered=False, prev_batch_ts=prev,
                     next_batch_ts=nxt)
    return envelope(gap, pod=pod, natural_key=(pod, 0, first, last, prev, nxt), observed_at_ms=gap.detected_at_ms,
                    engine="0")


def batches(pod: str) -> list[Envelope]:
    """Batches 0, 1, 2, 4, 5 of ``pod`` at 0, 1, 2, 4, 5 s: seq 3 missing, seq 2 stored."""
    return decode([frames(pod, s, s, stored([100 + s])) for s in (0, 1, 2, 4, 5)])


def t(seconds: float) -> float:
    return at(seconds).timestamp()


@pytest.mark.parametrize(("prev", "nxt"), [(None, None), (None, 4.0), (1.0, None)])
def test_a_report_without_both_batch_ts_is_one_gap_with_the_collectors_account(
        store: Store, prev: float | None, nxt: float | None) -> None:
    """A report of an older collector (no ts), or of one restored from a checkpoint without a ts (only the next
    batch's): one gap, counted as the collector did (stored = replayed), not a second one read over a window from
    1970 (a filter on `lo` beside `assumeNotNull(lo) AS lo` tests the alias, never null)."""
    ingest(store, batches("pod-n") + [report("pod-n", 2, 3, None if prev is None else t(prev),
                                             None if nxt is None else t(nxt), replayed=1)])
    assert [(g["first_seq"], g["last_seq"], g["stored_batches"], g["lost_batches"], g["reports"])
            for g in kv_gaps(store, "pod-n")] == [(2, 3, 1, 1, 1)]


def dead_letters(store: Store, pod: str) -> list[str]:
    return [r for (r,) in store.query_rows("SELECT reason FROM dead_letters WHERE pod = {p:String}", {"p": pod})]


@pytest.mark.parametrize(("first", "last", "prev", "nxt", "replayed", "why"), [
    (5, 3, 1.0, 4.0, 0, "are not a run"),  # batches = -1 (lost -1)
    (0, 2**64 - 1, 1.0, 4.0, 0, "are not a run"),  # batches wrapped to 0: read as recovered
    (2**64 - 5, 2**64 - 1, 1.0, 4.0, 0, "are not a run"),  # no batch can follow 2^64-1 to reveal it
    (3, 2**63 - 1, 2.5, 4.5, 0, "are not a run"),  # 2^63 - 3 batches: read as Int64, negative
    (2, 3, 1.0, 4.0, 3, "replayed_batches 3"),  # more replayed than missing: 0022's first_new_seq wraps
    (2, 3, 4.0, 1.0, 0, "is after next_batch_ts"),  # an empty window: the stored seq 2 read as lost
    (2, 3, -5.0 - at(0).timestamp(), 4.0, 0, "outside 2000..2100"),  # 1969
    (2, 3, 1.0, 10413792000.0 - at(0).timestamp(), 0, "outside 2000..2100"),  # 2300: past DateTime64(3)
])
def test_a_report_no_collector_makes_is_a_dead_letter_with_its_reason(
        store: Store, first: int, last: int, prev: float, nxt: float, replayed: int, why: str) -> None:
    """Seqs not a run (last before first, or up to 2^64-1, whose count wraps), more replayed than missing, a window
    that ends before it starts or lies outside 2000..2100: dead-lettered with the reason, the batch's good envelopes
    land, and kv_gaps and kv_cache_resets read on."""
    written = ingest(store, batches("pod-x") + [report("pod-x", first, last, t(prev), t(nxt), replayed)])
    assert written == {"kv_block_events": 5, "dead_letters": 1}
    [reason] = dead_letters(store, "pod-x")
    assert why in reason
    assert kv_gaps(store, "pod-x") == []
    assert store.query_rows("SELECT count() FROM kv_cache_resets WHERE pod = 'pod-x'") == [(1,)]  # seq 0


def test_a_gap_ending_at_the_largest_seq_accepted_is_counted(store: Store) -> None:
    """The longest run accepted (up to seq 2^63-2): counted without wrapping, the stored batch in its window found."""
    ingest(store, batches("pod-m") + [report("pod-m", 3, 2**63 - 2, t(2.5), t(4.5))])
    assert [(g["batches"], g["stored_batches"], g["lost_batches"]) for g in kv_gaps(store, "pod-m")] == [
        (2**63 - 4, 1, 2**63 - 5)]  # seq 4 stored in the window


def test_overlapping_reports_count_no_seq_twice(store: Store) -> None:
    """Reports 2..3, 5..6 and 1..10 of one stream, windows overlapping (in that order of start): one gap 1..10, its
    seqs lost once (merged in one pass by window start they read as two gaps, 1..10 and 2..3, seqs 2..3 lost
    twice); a report beside them whose window lies apart stays a gap of its own though its seqs are the same."""
    envs = decode([frames("pod-o", s, s, stored([100 + s])) for s in (0, 11, 12)])
    envs += [report("pod-o", 2, 3, t(0.5), t(11)), report("pod-o", 5, 6, t(0.6), t(11)),
             report("pod-o", 1, 10, t(0.7), t(11)), report("pod-o", 2, 3, t(30), t(31))]
    ingest(store, envs)
    assert [(g["first_seq"], g["last_seq"], g["lost_batches"], g["reports"]) for g in kv_gaps(store, "pod-o")] == [
        (1, 10, 10, 3), (2, 3, 2, 1)]


def test_a_gap_within_one_millisecond_finds_its_stored_batch(store: Store) -> None:
    """Batches 2, 3 and 4 stamped in one ms; the collector stored 3 and, restarted from its checkpoint at 2, reports
    3..3 with prev_batch_ts = next_batch_ts: the stored batch is in the window ((prev, next] would be empty)."""
    envs = decode([frames("pod-ms", s, 1.0 if s >= 2 else s * 0.1, stored([100 + s])) for s in range(5)])
    ingest(store, envs + [report("pod-ms", 3, 3, t(1.0), t(1.0), reason="collector_restart")])
    assert [(g["stored_batches"], g["lost_batches"]) for g in kv_gaps(store, "pod-ms")] == [(1, 0)]


def test_precise_attribution_runs_on_beside_hostile_gap_reports(chdb_dir) -> None:  # type: ignore[no-untyped-def]
    """The precise-mode scenarios of tests/test_attribution_precise.py with, on their pods, gap reports of every
    hostile kind above, reports without ts and overlapping ones (all `missed`: they mark no restart): kv_gaps and
    kv_cache_resets read, and every request gets the answer it gets without them."""
    import uuid

    from test_attribution_precise import answers, build

    from ingest import attribution_job

    got = []
    for hostile in (False, True):
        s = Store.open(data_dir=chdb_dir, database=f"t_{uuid.uuid4().hex[:12]}")
        s.migrate()
        build(s, 32)
        if hostile:
            envs = []
            for pod in ("1-a", "2-a", "3-a"):
                envs += [report(pod, 5, 3, t(1), t(4)), report(pod, 0, 2**64 - 1, t(1), t(4)),
                         report(pod, 2, 3, t(4), t(1)), report(pod, 2, 3, t(1) + 1e10, t(4)),
                         report(pod, 2, 3, None, t(4), replayed=1), report(pod, 2, 3, None, None),
                         report(pod, 2, 3, t(0.5), t(11)), report(pod, 5, 6, t(0.6), t(11)),
                         report(pod, 1, 10, t(0.7), t(11))]
            ingest(s, envs)
            assert len(kv_gaps(s, "1-a")) == 3
            s.query_rows("SELECT count() FROM kv_cache_resets")
        attribution_job.run_attribution(s, default_block_size=32)
        got.append(answers(s))
    assert got[0] and got[1] == got[0]
