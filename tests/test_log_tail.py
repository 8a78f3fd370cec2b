"""The gateway log follower (collector/file_tail.py, collector/gateway_log.py GatewayLogSource) on real files
written by the gateway's own writer (gateway/log.py): every test checks the exact multiset of request ids
received across polls, acking after each poll as the publisher does (no loss, no duplicate)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from collector.checkpoint import CheckpointStore
from collector.gateway_log import GatewayLogSource, watch
from gateway.log import REQUIRED_FIELDS, GatewayLogWriter, format_ts

WAIT = 0.1  # rotate_wait_seconds of the sources under test


def record(i: int, **extra: object) -> dict[str, object]:
    """A schema-complete gateway record with request id ``r-<i>``."""
    rec: dict[str, object] = {k: None for k in REQUIRED_FIELDS if k != "log_version"}
    rec.update(request_id=f"r-{i}", ts=format_ts(1_800_000_000 + i / 1000), stream=False, prompt_tokens=64,
               cached_tokens=32, status=200, tenant_id="acme", pod="pod-0", ttft_ms=1.0, e2e_ms=2.0)
    rec.update(extra)
    return rec


def ids(*ranges: range) -> Counter[str]:
    return Counter(f"r-{i}" for r in ranges for i in r)


def metric(name: str, path: Path, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"path": str(path), **labels}) or 0.0


class Sink:
    """Plays the collector loop: publishes (keeps) what a poll returns, then calls its ack (unless told not
    to). ``got`` counts request ids; ``dead`` keeps dead letters."""

    def __init__(self) -> None:
        self.got: Counter[str] = Counter()
        self.dead: list[str] = []
        self.top = -1  # highest request number received

    def poll(self, src: GatewayLogSource, ack: bool = True) -> bool:
        events, done = src.poll()
        for ev in events:
            if ev.schema == "gateway_request":
                rid = ev.payload.record["request_id"]
                self.got[rid] += 1
                self.top = max(self.top, int(rid[2:]))
            else:
                self.dead.append(ev.payload.reason)
        if done is not None and ack:
            done()
        return bool(events) or done is not None

    def drain(self, src: GatewayLogSource, quiet: float = 4 * WAIT, timeout: float = 30.0) -> None:
        """Poll until nothing changed for ``quiet`` seconds and nothing is left unread."""
        t_end = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < t_end:
            if self.poll(src):
                last = time.monotonic()
            elif time.monotonic() - last > quiet and src.lag_bytes() == 0:
                return
            else:
                time.sleep(0.002)
        raise AssertionError(f"log not drained within {timeout}s; lag {src.lag_bytes()} bytes")


class Writer(threading.Thread):
    """The gateway's writer in a thread: ``n`` records, ``delay`` seconds apart. Holding ``pause`` stops it
    between two lines; ``written`` counts lines whose write(2) returned."""

    def __init__(self, path: Path, n: int, delay: float = 0.0005) -> None:
        super().__init__(daemon=True)
        self.log = GatewayLogWriter(path)
        self.n, self.delay = n, delay
        self.pause = threading.Lock()
        self.written = 0

    def run(self) -> None:
        for i in range(self.n):
            with self.pause:
                self.log.write(record(i))
                self.written = i + 1
            time.sleep(self.delay)
        self.log.close()


def write(path: Path, numbers: range) -> None:
    w = GatewayLogWriter(path)
    for i in numbers:
        w.write(record(i))
    w.close()


def source(path: Path, ckpt: CheckpointStore | None = None, max_bytes: int = 8 << 20) -> GatewayLogSource:
    return GatewayLogSource(path, ckpt or CheckpointStore(None), max_bytes=max_bytes, rotate_wait_seconds=WAIT)


# -- steady state ---------------------------------------------------------------------------------------------


def test_lines_appended_over_time_arrive_once_and_a_partial_line_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    src, sink = source(path), Sink()
    assert src.poll() == ([], None)  # no file yet
    writer = Writer(path, 500)
    writer.start()
    while writer.is_alive():
        sink.poll(src)
    sink.drain(src)
    assert sink.got == ids(range(500))

    line = GatewayLogWriter(path).write(record(500)).encode() + b"\n"
    path.write_bytes(path.read_bytes()[: -len(line)] + line[:40])  # the last line half written
    sink.poll(src)
    assert src.lag_bytes() == 40 == metric("kvscope_collector_log_lag_bytes", path)
    sink.poll(src)
    assert sink.got == ids(range(500))
    with open(path, "ab") as fh:
        fh.write(line[40:])
    sink.drain(src)
    assert sink.got == ids(range(501)) and not sink.dead


def test_a_line_longer_than_max_bytes_is_dead_lettered_and_the_next_line_arrives(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    w = GatewayLogWriter(path)
    w.write(record(0))
    w.write(record(1, error="x" * 5000))
    w.write(record(2))
    src, sink = source(path, max_bytes=1024), Sink()
    sink.drain(src)
    assert sink.got == ids(range(1), range(2, 3))
    assert sink.dead == ["line longer than 1024 bytes"]


# -- rotation under a running writer ---------------------------------------------------------------------------


def follow_with_rotations(path: Path, rotate: Callable[[int, Writer], int], n: int = 4000, every: int = 600) -> Sink:
    """A writer writes ``n`` lines; every ``every`` lines ``rotate(k)`` runs and returns how many lines had
    been written when only the new file could receive more; the next rotation waits until a line from after
    that point has arrived (the follower reached the new file)."""
    src, sink = source(path), Sink()
    writer = Writer(path, n)
    writer.start()
    k, after = 0, -1
    while writer.is_alive():
        sink.poll(src)
        if writer.written >= (k + 1) * every and sink.top >= after and writer.written < n - every // 2:
            k += 1
            after = rotate(k, writer)
    writer.join()
    sink.drain(src)
    assert k >= 5, f"only {k} rotations happened"
    return sink


def test_rename_rotation_under_a_continuous_writer(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"

    def rotate(k: int, writer: Writer) -> int:
        os.rename(path, tmp_path / f"gw.jsonl.{k}")
        return writer.written + 1  # the line in flight may still land in the old file

    sink = follow_with_rotations(path, rotate)
    assert sink.got == ids(range(4000))
    assert metric("kvscope_collector_log_rotations_total", path, kind="rename") >= 5
    assert metric("kvscope_collector_log_bytes_lost_total", path, reason="truncate") == 0


def test_copytruncate_under_a_concurrent_writer(tmp_path: Path) -> None:
    """logrotate's copytruncate loses what the writer appends between its copy and its truncate; the writer
    is paused exactly then, so every line is in the copy or in the truncated file."""
    path = tmp_path / "gw.jsonl"

    def rotate(k: int, writer: Writer) -> int:
        with writer.pause:
            shutil.copyfile(path, tmp_path / f"gw.jsonl.{k}")
            os.truncate(path, 0)
            return writer.written

    sink = follow_with_rotations(path, rotate)
    assert sink.got == ids(range(4000))
    assert metric("kvscope_collector_log_rotations_total", path, kind="copytruncate") >= 5
    assert metric("kvscope_collector_log_bytes_lost_total", path, reason="copytruncate") == 0


def test_a_line_written_to_the_old_file_after_the_rename_is_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    write(path, range(3))
    src, sink = source(path), Sink()
    sink.poll(src)
    os.rename(path, tmp_path / "gw.jsonl.1")
    sink.poll(src)  # sees the rename
    write(path, range(3, 5))  # the new file
    late = GatewayLogWriter(tmp_path / "gw.jsonl.1")  # the gateway's write in flight during the rename
    late.write(record(5))
    sink.drain(src)
    assert sink.got == ids(range(6))


def test_the_unterminated_last_line_of_a_rotated_file_is_read_once_it_stays_idle(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    write(path, range(2))
    line = GatewayLogWriter(path).write(record(2)).encode()
    path.write_bytes(path.read_bytes()[:-1])  # no newline after the last line
    src, sink = source(path), Sink()
    sink.poll(src)
    assert sink.got == ids(range(2))
    os.rename(path, tmp_path / "gw.jsonl-20261130")
    write(path, range(3, 5))
    sink.drain(src)
    assert sink.got == ids(range(5)) and line.endswith(b"}")


def test_copytruncate_again_before_the_previous_copy_is_drained(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    src, sink = GatewayLogSource(path, CheckpointStore(None), rotate_wait_seconds=1.0), Sink()
    write(path, range(5))
    sink.poll(src)
    write(path, range(5, 8))  # unread when the first copy is taken
    shutil.copyfile(path, tmp_path / "gw.jsonl.1")
    os.truncate(path, 0)
    write(path, range(8, 12))
    sink.poll(src)
    sink.poll(src)  # still draining gw.jsonl.1 (idle wait 1 s)
    assert sink.got == ids(range(8))
    shutil.copyfile(path, tmp_path / "gw.jsonl.2")  # the file not read yet is copied and truncated
    os.truncate(path, 0)
    write(path, range(12, 14))
    sink.drain(src, quiet=1.5)
    assert sink.got == ids(range(14))
    assert metric("kvscope_collector_log_rotations_total", path, kind="copytruncate") == 2


# -- truncation and deletion -----------------------------------------------------------------------------------


def test_plain_truncation_reads_from_the_start_and_counts_the_bytes_it_saw_lost(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    write(path, range(5))
    src, sink = source(path), Sink()
    sink.drain(src)
    write(path, range(5, 8))  # never seen: truncated before the next poll
    os.truncate(path, 0)
    write(path, range(8, 20))  # the new content outgrows the old offset: only the fingerprint tells
    sink.drain(src)
    assert sink.got == ids(range(5), range(8, 20))
    assert metric("kvscope_collector_log_rotations_total", path, kind="truncate") == 1

    with open(path, "ab") as fh:
        fh.write(b'{"request_id": "half')  # seen, not consumed (no newline), then truncated away
    sink.poll(src)
    os.truncate(path, 0)
    write(path, range(20, 22))
    sink.drain(src)
    assert sink.got == ids(range(5), range(8, 22))
    assert metric("kvscope_collector_log_bytes_lost_total", path, reason="truncate") == len('{"request_id": "half')


def test_a_deleted_file_is_drained_then_the_path_is_read_again_when_it_reappears(tmp_path: Path) -> None:
    path = tmp_path / "gw.jsonl"
    w = GatewayLogWriter(path)
    for i in range(5):
        w.write(record(i))
    src, sink = source(path), Sink()
    sink.poll(src)
    for i in range(5, 10):
        w.write(record(i))  # only in the file about to be deleted
    path.unlink()
    for i in range(10, 15):
        w.write(record(i))  # the writer recreates the path
    sink.drain(src)
    assert sink.got == ids(range(15))

    for i in range(15, 18):
        w.write(record(i))
    path.unlink()
    sink.drain(src)  # nothing at the path for a while
    assert sink.got == ids(range(18))
    for i in range(18, 20):
        w.write(record(i))
    sink.drain(src)
    assert sink.got == ids(range(20))
    assert metric("kvscope_collector_log_rotations_total", path, kind="deleted") == 2


# -- restarts --------------------------------------------------------------------------------------------------


def test_a_restart_resumes_at_the_last_acked_poll_and_repeats_only_unacked_lines(tmp_path: Path) -> None:
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "state" / "checkpoints.json"
    write(path, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.poll(src)  # acked
    write(path, range(10, 20))
    sink.poll(src, ack=False)  # published, never acknowledged (the collector died)
    write(path, range(20, 25))
    src.close()
    sink.drain(source(path, CheckpointStore(ckpt)))
    assert sink.got == ids(range(25)) + ids(range(10, 20))


def rotate(rotation: str, path: Path) -> None:
    """Rotate ``path`` to ``<path>.1`` by ``rotation``: "copytruncate" (copy, then truncate in place) or "rename"."""
    if rotation == "copytruncate":
        shutil.copyfile(path, path.with_name(path.name + ".1"))
        os.truncate(path, 0)
    else:
        os.rename(path, path.with_name(path.name + ".1"))


@pytest.mark.parametrize("rotation", ["copytruncate", "rename"])
def test_a_file_switch_is_not_checkpointed_before_the_lines_queued_ahead_of_it(rotation: str,
                                                                               tmp_path: Path) -> None:
    """Embedded mode (the in-process queue): a poll that only moves the position (the switch to the rotated
    copy or to the new file) must not checkpoint it while lines read before it are still queued, or a crash
    then loses them (seen: 1,306 lines of a copytruncated file under SIGKILLs)."""
    from collector.publish import MemoryQueue, QueuePublisher
    from ingest.source import QueueSource

    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    write(path, range(10))
    queue = MemoryQueue()
    publisher, consumer = QueuePublisher(queue), QueueSource(queue)
    assert watch(path, CheckpointStore(ckpt))  # as `kvscope up` does first thing
    src = source(path, CheckpointStore(ckpt))
    events, ack = src.poll()
    assert len(events) == 10 and ack is not None
    publisher.publish(events, ack)  # queued; the ingester has not stored them yet
    rotate(rotation, path)
    write(path, range(10, 12))
    moves = 0
    t_end = time.monotonic() + 10
    while moves == 0 or src.lag_bytes():  # until the follower left the old file
        assert time.monotonic() < t_end, "the follower never switched files"
        events, ack = src.poll()
        if ack is not None and not events:
            moves += 1
            publisher.publish([], ack)
        elif events:
            break  # lines of the new file: the switch happened before them
        time.sleep(0.01)
    src.close()
    # the collector dies here: a new one starts from the checkpoint and must read the 10 queued lines again
    sink = Sink()
    sink.drain(source(path, CheckpointStore(ckpt)))
    assert sink.got == ids(range(12)), f"lost: {sorted(set(ids(range(12))) - set(sink.got))}"
    # once the ingester commits, the position moves past them (ack-only markers are never handed to it)
    polled = consumer.poll(timeout_ms=100)
    assert [m.topic for m in polled] and all(m.value for m in polled)
    consumer.commit(polled)
    assert consumer.poll(timeout_ms=10) == [] and queue.empty()
    again = Sink()
    again.drain(source(path, CheckpointStore(ckpt)))
    assert again.got == ids(range(10, 12))


def test_ack_only_markers_run_in_queue_order() -> None:
    """The in-process queue runs each acknowledgement once everything queued before it is committed, in order;
    a marker with nothing before it runs at the next poll."""
    from collector.publish import MemoryQueue, QueuePublisher
    from ingest.source import QueueSource

    queue, ran = MemoryQueue(), []
    publisher, consumer = QueuePublisher(queue), QueueSource(queue)
    publisher.publish([], lambda: ran.append("first"))
    assert ran == [] and consumer.poll(timeout_ms=10) == [] and ran == ["first"]
    from collector.gateway_log import line_event

    ev = line_event(GatewayLogWriter.encode(record(1)).rstrip("\n"), pod="gw", source_file="f", offset=0)
    publisher.publish([ev], lambda: ran.append("data"))
    publisher.publish([], lambda: ran.append("after data"))
    publisher.publish([ev], lambda: ran.append("data 2"))
    polled = consumer.poll(timeout_ms=10)
    assert len(polled) == 2 and ran == ["first"]
    consumer.commit(polled[:1])
    assert ran == ["first", "data", "after data"]
    consumer.commit(consumer.poll(timeout_ms=10))
    assert ran == ["first", "data", "after data", "data 2"] and queue.empty()


@pytest.mark.parametrize("rotation", ["rename", "copytruncate"])
def test_a_bad_line_read_again_from_the_rotated_file_after_a_crash_is_one_dead_letter(rotation: str, store,
                                                                                     tmp_path: Path) -> None:
    """A bad line and a too-long line stored (dead-lettered) by the ingester, then the collector killed before
    the acknowledgement checkpointed them; the log rotates; the restarted collector reads them again from the
    rotated file, under its other name. They must stay one dead letter each (their ids used to name the file
    they were read under: the rotated name made new ones, counted twice), as the good lines stay one row each."""
    from collector.publish import MemoryQueue, QueuePublisher
    from ingest.ingester import Ingester
    from ingest.source import QueueSource

    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    w = GatewayLogWriter(path)
    w.write(record(0))
    w.close()
    with open(path, "ab") as fh:
        fh.write(b'{"request_id": "broken\n')  # not a record: a dead letter
        fh.write(GatewayLogWriter.encode(record(1, error="x" * 5000)).encode() + b"\n")  # longer than max_bytes
    write(path, range(2, 4))
    assert watch(path, CheckpointStore(ckpt))

    def run(src: GatewayLogSource, commit: bool) -> None:
        """Publish every poll to a fresh in-process queue and store it; ``commit=False``: the process dies
        after the insert, before the commit that runs the acks (the checkpoint does not move)."""
        queue = MemoryQueue()
        publisher, consumer = QueuePublisher(queue), QueueSource(queue)
        ingester = Ingester(store, consumer)
        t_quiet, t_end = time.monotonic() + 5 * WAIT, time.monotonic() + 10
        while src.lag_bytes() or time.monotonic() < t_quiet:  # past the rotated file's idle wait
            assert time.monotonic() < t_end, "log not drained"
            events, ack = src.poll()
            if events or ack:
                publisher.publish(events, ack)
            time.sleep(0.01)
        while polled := consumer.poll(timeout_ms=10):
            if commit:
                ingester.handle(polled)
            else:
                ingester.write_batch(polled)
                break
        src.close()

    run(source(path, CheckpointStore(ckpt), max_bytes=2048), commit=False)
    rotate(rotation, path)
    write(path, range(4, 6))
    run(source(path, CheckpointStore(ckpt), max_bytes=2048), commit=True)

    assert store.query_rows("SELECT count(), uniqExact(request_id) FROM gateway_requests") == [(5, 5)]
    dead = store.query_rows("SELECT reason, count() FROM dead_letters GROUP BY reason ORDER BY reason")
    assert [n for _, n in dead] == [1, 1], dead


def down_then_rotated(tmp_path: Path, rotate: Callable[[Path], object]) -> tuple[Path, Sink]:
    """10 lines read and acked, 5 written unread, the collector stops, ``rotate()`` runs, 5 more lines are
    written to the path, a new collector starts from the checkpoint file."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    w = GatewayLogWriter(path)
    for i in range(10):
        w.write(record(i))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    for i in range(10, 15):
        w.write(record(i))
    src.close()
    rotate(path)
    for i in range(15, 20):
        w.write(record(i))
    sink.drain(source(path, CheckpointStore(ckpt)))
    return path, sink


def test_a_restart_after_a_rename_rotation_while_down_drains_the_rotated_file_first(tmp_path: Path) -> None:
    path, sink = down_then_rotated(tmp_path, lambda p: os.rename(p, tmp_path / "gw.jsonl.1"))
    assert sink.got == ids(range(20))
    assert metric("kvscope_collector_log_rotations_total", path, kind="resumed_rotated") == 1


def test_a_restart_after_a_copytruncate_while_down_drains_the_copy_first(tmp_path: Path) -> None:
    path, sink = down_then_rotated(tmp_path, copytruncate_to(tmp_path / "gw.jsonl-20261130"))
    assert sink.got == ids(range(20))
    assert metric("kvscope_collector_log_rotations_total", path, kind="resumed_rotated") == 1


def copytruncate_to(copy: Path) -> Callable[[Path], None]:
    def rotate(p: Path) -> None:
        shutil.copyfile(p, copy)
        os.truncate(p, 0)

    return rotate


@pytest.mark.parametrize("second", ["rename", "copytruncate"])
def test_a_checkpoint_two_rotations_behind_reads_every_file_written_since(tmp_path: Path, second: str) -> None:
    """The checkpoint is in file A; A is renamed away, B is written and rotated away too (renamed, or copied
    and truncated), C is written: all of A's unacked tail, all of B and all of C arrive, each line once. (Seen
    under load: acknowledgements slower than rotations left the checkpoint two files behind and B was lost.)
    An older rotation, written before A, is not read again."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    write(tmp_path / "gw.jsonl.9", range(100, 105))
    os.utime(tmp_path / "gw.jsonl.9", ns=(1_000_000_000, 1_000_000_000))  # rotated long ago
    write(path, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    write(path, range(10, 15))
    sink.poll(src, ack=False)  # read, never acknowledged
    src.close()
    os.rename(path, tmp_path / "gw.jsonl.1")  # A
    write(path, range(15, 20))  # B
    if second == "rename":
        os.rename(path, tmp_path / "gw.jsonl.2")
    else:
        copytruncate_to(tmp_path / "gw.jsonl.2")(path)
    write(path, range(20, 25))  # C (or B again, truncated)
    sink.drain(source(path, CheckpointStore(ckpt)))
    assert sink.got == ids(range(25)) + ids(range(10, 15))  # 10..14 twice: read once unacked, then again
    assert max(sink.got.values()) <= 2 and not sink.dead


@pytest.mark.parametrize("watched", [True, False])
def test_a_collector_killed_before_its_first_ack_resumes_from_where_it_started_watching(
    tmp_path: Path, watched: bool
) -> None:
    """kvscope checkpoints the start of the log when it starts (before its store opens). Killed before its first
    acknowledgement, with the log rotated twice since (rename, then copytruncate), the next start still reads
    every line; without that first checkpoint it would read only the file the path names then."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    write(path, range(10))
    if watched:
        assert watch(path, CheckpointStore(ckpt)) and not watch(path, CheckpointStore(ckpt))  # only the first time
    os.rename(path, tmp_path / "gw.jsonl.1")
    write(path, range(10, 15))
    copytruncate_to(tmp_path / "gw.jsonl.2")(path)
    write(path, range(15, 20))
    sink = Sink()
    sink.drain(source(path, CheckpointStore(ckpt)))
    assert sink.got == (ids(range(20)) if watched else ids(range(15, 20)))


def test_a_restart_whose_checkpointed_file_is_gone_says_so_and_reads_the_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvscope.collector"):
        path, sink = down_then_rotated(tmp_path, lambda p: p.unlink())
    assert sink.got == ids(range(10), range(15, 20))  # 10..14 were only in the deleted file
    assert metric("kvscope_collector_log_resume_misses_total", path) == 1
    [rec] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "may be lost" in rec.getMessage() and str(path) in rec.getMessage()
