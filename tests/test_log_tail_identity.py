"""A log file's identity when every file of the log starts with the same line (a blank line, a header, a banner):
the follower (collector/file_tail.py through collector/gateway_log.py GatewayLogSource) on real files, restarted
from its checkpoint file, must tell a rotated-away file from its successor and a truncated-and-rewritten file from
the one it read, by the bytes it read (the head) and the inode, not by the first line alone. Each test checks the
exact multiset of request ids received (no loss, no duplicate), acking after each poll as the publisher does."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from collector.checkpoint import CheckpointStore
from collector.gateway_log import checkpoint_key, watch
from tests.test_log_tail import Sink, ids, metric, source, write

BLANK = b"\n"
HEADER = b"# kvscope gateway log, format 1\n"  # not a record: one dead letter per file it starts
FIRST_LINES = pytest.mark.parametrize("first", [BLANK, HEADER], ids=["blank", "header"])


def new_log(path: Path, first: bytes, numbers: range) -> None:
    """Create ``path`` (replacing what is there) with ``first`` as its first line, then records ``numbers``."""
    path.write_bytes(first)
    write(path, numbers)


def headers(first: bytes, files: int) -> list[str]:
    """The dead letters ``files`` files starting with ``first`` give (a blank line gives none)."""
    return ["line is not JSON"] * files if first == HEADER else []


def dead_kinds(sink: Sink) -> list[str]:
    return ["line is not JSON" if "JSON" in reason else reason for reason in sink.dead]


def restart(path: Path, ckpt: Path, sink: Sink) -> None:
    sink.drain(source(path, CheckpointStore(ckpt)))


# -- restarts --------------------------------------------------------------------------------------------------


@FIRST_LINES
def test_a_rename_rotation_while_down_is_told_apart_from_its_successor_with_the_same_first_line(
    tmp_path: Path, first: bytes
) -> None:
    """The reviewer's loss: the new file starts with the same line and grows past the checkpoint's offset; the
    restarted collector took it for the checkpointed file, resumed in it mid-line (a bogus dead letter) and never
    read the rotated file's unread tail (10..14) nor the new file's first lines."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, first, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    write(path, range(10, 15))  # unread when the collector stops
    src.close()
    os.rename(path, tmp_path / "gw.jsonl.1")
    new_log(path, first, range(15, 45))
    restart(path, ckpt, sink)
    assert sink.got == ids(range(45)), f"lost: {sorted(set(ids(range(45))) - set(sink.got))}"
    assert dead_kinds(sink) == headers(first, 2)
    assert metric("kvscope_collector_log_rotations_total", path, kind="resumed_rotated") == 1
    assert metric("kvscope_collector_log_resume_misses_total", path) == 0


@FIRST_LINES
def test_a_checkpoint_that_read_only_the_shared_first_line_finds_the_rotated_file_by_its_inode(
    tmp_path: Path, first: bytes
) -> None:
    """Only the first line was read (and acked) before the collector stopped: the bytes read cannot tell the two
    files apart, the inode does."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    path.write_bytes(first)
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    assert json.loads(ckpt.read_text())[checkpoint_key(path)]["offset"] == len(first)
    write(path, range(5))
    src.close()
    os.rename(path, tmp_path / "gw.jsonl.1")
    new_log(path, first, range(5, 10))
    restart(path, ckpt, sink)
    assert sink.got == ids(range(10))
    assert dead_kinds(sink) == headers(first, 2)


def test_a_collector_killed_before_its_first_ack_finds_the_watched_file_by_its_inode(tmp_path: Path) -> None:
    """``watch`` checkpoints offset 0 of a file starting with a blank line; the log rotates (rename) before the
    first acknowledgement and the new file starts with a blank line too."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, BLANK, range(5))
    assert watch(path, CheckpointStore(ckpt))
    os.rename(path, tmp_path / "gw.jsonl.1")
    new_log(path, BLANK, range(5, 10))
    sink = Sink()
    restart(path, ckpt, sink)
    assert sink.got == ids(range(10)) and not sink.dead
    assert metric("kvscope_collector_log_resume_misses_total", path) == 0


def test_a_watched_file_deleted_while_down_and_replaced_by_one_with_the_same_first_line_is_a_resume_miss(
    tmp_path: Path,
) -> None:
    """``watch`` checkpoints offset 0 of a file starting with a blank line; it is deleted (not rotated) and a new
    one starting with a blank line takes the path: nothing but the first line matches, so the new file is read
    and the restart counted as a resume miss (the deleted file's lines are gone)."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, BLANK, range(5))
    assert watch(path, CheckpointStore(ckpt))
    new_log(tmp_path / "next", BLANK, range(5, 10))
    os.replace(tmp_path / "next", path)  # the old file deleted (a new inode: both existed at once)
    sink = Sink()
    restart(path, ckpt, sink)
    assert sink.got == ids(range(5, 10)) and not sink.dead
    assert metric("kvscope_collector_log_resume_misses_total", path) == 1


@pytest.mark.parametrize("second", ["rename", "copytruncate"])
def test_a_checkpoint_two_rotations_behind_reads_every_file_when_all_start_with_a_blank_line(
    tmp_path: Path, second: str
) -> None:
    """A (checkpointed) renamed away, B written and rotated away, C written, all starting with a blank line: B is
    not taken for a copy of A (they share only their first line), so it is read."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, BLANK, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    write(path, range(10, 15))
    src.close()
    os.rename(path, tmp_path / "gw.jsonl.1")  # A
    new_log(path, BLANK, range(15, 20))  # B
    if second == "rename":
        os.rename(path, tmp_path / "gw.jsonl.2")
    else:
        shutil.copyfile(path, tmp_path / "gw.jsonl.2")
        os.truncate(path, 0)
    new_log(path, BLANK, range(20, 25))  # C
    restart(path, ckpt, sink)
    assert sink.got == ids(range(25)) and not sink.dead


@FIRST_LINES
def test_a_copytruncate_while_down_rewritten_with_the_same_first_line_drains_the_copy(
    tmp_path: Path, first: bytes
) -> None:
    """The checkpointed file keeps its inode but was copied, truncated and written again from the same first line
    past the checkpoint's offset: the bytes read tell it is not the file read, the copy holds them."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, first, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    write(path, range(10, 15))
    src.close()
    shutil.copyfile(path, tmp_path / "gw.jsonl-20261207")
    os.truncate(path, 0)
    new_log(path, first, range(15, 45))
    restart(path, ckpt, sink)
    assert sink.got == ids(range(45)), f"lost: {sorted(set(ids(range(45))) - set(sink.got))}"
    assert dead_kinds(sink) == headers(first, 2)
    assert metric("kvscope_collector_log_rotations_total", path, kind="resumed_rotated") == 1


# -- a running follower ----------------------------------------------------------------------------------------


@FIRST_LINES
def test_a_truncation_rewritten_past_the_offset_with_the_same_first_line_is_seen(tmp_path: Path,
                                                                                  first: bytes) -> None:
    path = tmp_path / "gw.jsonl"
    new_log(path, first, range(5))
    src, sink = source(path), Sink()
    sink.drain(src)
    write(path, range(5, 8))  # never seen: truncated before the next poll
    os.truncate(path, 0)
    new_log(path, first, range(8, 20))  # past the old offset, same first line: only the bytes read tell
    sink.drain(src)
    assert sink.got == ids(range(5), range(8, 20)), f"lost: {sorted(set(ids(range(8, 20))) - set(sink.got))}"
    assert dead_kinds(sink) == headers(first, 2)  # no line read from the middle
    assert metric("kvscope_collector_log_rotations_total", path, kind="truncate") == 1


@FIRST_LINES
@pytest.mark.parametrize("rewritten", ["past_offset", "short"])
def test_copytruncate_with_the_same_first_line_reads_the_tail_from_the_right_copy(
    tmp_path: Path, first: bytes, rewritten: str
) -> None:
    """An older, larger rotated file starting with the same line lies beside the log; the log is copied and
    truncated between two polls and written again from the same first line (past the old offset, or not): the
    unread tail comes from the new copy, not from the older file and not from the rewritten file's middle."""
    path = tmp_path / "gw.jsonl"
    new_log(tmp_path / "gw.jsonl.0", first, range(100, 200))  # an older rotation, larger than the log
    os.utime(tmp_path / "gw.jsonl.0", ns=(1_000_000_000, 1_000_000_000))
    new_log(path, first, range(5))
    src, sink = source(path), Sink()
    sink.drain(src)
    write(path, range(5, 8))  # unread when the copy is taken
    shutil.copyfile(path, tmp_path / "gw.jsonl.1")
    os.truncate(path, 0)
    new_log(path, first, range(8, 20) if rewritten == "past_offset" else range(8, 9))
    sink.drain(src)
    end = 20 if rewritten == "past_offset" else 9
    assert sink.got == ids(range(end)), f"lost: {sorted(set(ids(range(end))) - set(sink.got))}"
    assert dead_kinds(sink) == headers(first, 2)
    assert metric("kvscope_collector_log_rotations_total", path, kind="copytruncate") == 1
    assert metric("kvscope_collector_log_bytes_lost_total", path, reason="copytruncate") == 0


# -- upgrade from a checkpoint written before heads were kept --------------------------------------------------


def old_checkpoint(ckpt: Path, path: Path, offset: int, ino: int | None = None) -> None:
    """Write the checkpoint an earlier kvscope wrote after reading ``offset`` bytes of ``path`` (fingerprint of
    the first line, offset, dev, ino, file; no head)."""
    data = path.read_bytes()
    st = os.stat(path)
    fp = hashlib.sha256(data[: data.index(b"\n") + 1]).hexdigest()[:32]
    value = {"fingerprint": fp, "offset": offset, "dev": st.st_dev, "ino": st.st_ino if ino is None else ino,
             "file": str(path)}
    ckpt.write_text(json.dumps({checkpoint_key(path): value}))


@FIRST_LINES
def test_an_old_checkpoint_resumes_exactly_where_it_was_and_is_rewritten_with_a_head(tmp_path: Path,
                                                                                      first: bytes) -> None:
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, first, range(10))
    old_checkpoint(ckpt, path, path.stat().st_size)  # everything so far read and acked by the old version
    write(path, range(10, 15))
    sink = Sink()
    restart(path, ckpt, sink)
    assert sink.got == ids(range(10, 15)) and not sink.dead  # nothing lost, nothing read again
    value = json.loads(ckpt.read_text())[checkpoint_key(path)]
    size = path.stat().st_size
    assert value["offset"] == size and value["head_len"] == min(size, 4096) and value["head"]


@FIRST_LINES
def test_an_old_checkpoint_after_a_rotation_while_down_finds_the_rotated_file_by_its_inode(
    tmp_path: Path, first: bytes
) -> None:
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, first, range(10))
    old_checkpoint(ckpt, path, path.stat().st_size)
    write(path, range(10, 15))
    os.rename(path, tmp_path / "gw.jsonl.1")
    new_log(path, first, range(15, 45))
    sink = Sink()
    restart(path, ckpt, sink)
    assert sink.got == ids(range(10, 45)), f"lost: {sorted(set(ids(range(10, 45))) - set(sink.got))}"
    assert dead_kinds(sink) == headers(first, 1)  # the new file's; the rotated one's was read before


def test_an_old_checkpoint_found_by_its_first_line_alone_resumes_there_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No file has the checkpoint's inode (the log was copied to another disk): as before the upgrade, the file
    the path names with the same first line is taken at the offset (nothing read again); since only the first
    line says so, it is counted as a resume miss and logged."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, BLANK, range(10))
    old_checkpoint(ckpt, path, path.stat().st_size, ino=1)
    write(path, range(10, 15))
    sink = Sink()
    with caplog.at_level(logging.WARNING, logger="kvscope.collector"):
        restart(path, ckpt, sink)
    assert sink.got == ids(range(10, 15)) and not sink.dead
    assert any("found by its first line only" in r.getMessage() for r in caplog.records)
    assert metric("kvscope_collector_log_resume_misses_total", path) == 1


# -- a checkpoint of an empty file (nothing read: no bytes to know it by) -------------------------------------


def empty_checkpoint(path: Path, ckpt: Path, how: str, sink: Sink) -> None:
    """Leave a checkpoint at offset 0 of the empty file ``path`` names (no fingerprint, no head bytes): ``caught_up``
    (the collector read 0..9, the log was copytruncated to gw.jsonl.1 and the collector caught up and stopped) or
    ``watched`` (``watch`` on a freshly created log, killed before its first ack)."""
    path.touch()
    if how == "caught_up":
        src = source(path, CheckpointStore(ckpt))
        write(path, range(10))
        sink.drain(src)
        shutil.copyfile(path, tmp := path.with_name("gw.jsonl.1"))
        os.truncate(path, 0)
        sink.drain(src)
        src.close()
        assert sink.got == ids(range(10)) and tmp.exists()
    else:
        assert watch(path, CheckpointStore(ckpt))
    value = json.loads(ckpt.read_text())[checkpoint_key(path)]
    assert value["offset"] == 0 and value["fingerprint"] is None and value["head_len"] == 0
    time.sleep(0.05)  # the checkpoint is older than what follows (file times are coarse)


@FIRST_LINES
@pytest.mark.parametrize("how", ["caught_up", "watched"])
def test_a_copytruncate_while_down_after_a_checkpoint_of_an_empty_file_reads_the_copy_first(
    tmp_path: Path, first: bytes, how: str
) -> None:
    """The checkpointed file keeps its inode, so it was taken by inode alone and read from 0: the copy's lines
    (written after the checkpoint, nothing to know them by but the copy's time) were never read."""
    path, ckpt, sink = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json", Sink()
    empty_checkpoint(path, ckpt, how, sink)
    if how == "caught_up":
        os.rename(tmp_path / "gw.jsonl.1", tmp_path / "gw.jsonl.2")  # the earlier copy moves on (mtime kept)
    new_log(path, first, range(10, 20))
    shutil.copy2(path, tmp_path / "gw.jsonl.1")  # cp -p: the copy keeps the file's time
    os.truncate(path, 0)
    write(path, range(20, 25))
    restart(path, ckpt, sink)
    want = ids(range(25)) if how == "caught_up" else ids(range(10, 25))
    assert sink.got == want, f"lost: {sorted(set(want) - set(sink.got))}"
    assert dead_kinds(sink) == headers(first, 1)
    assert metric("kvscope_collector_log_rotations_total", path, kind="resumed_rotated") == 1


def test_an_earlier_versions_checkpoint_of_an_empty_file_is_dated_by_the_checkpoint_file(tmp_path: Path) -> None:
    """No ``at`` in the checkpoint: the checkpoint file's modification time stands for it."""
    path, ckpt, sink = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json", Sink()
    empty_checkpoint(path, ckpt, "watched", sink)
    data = json.loads(ckpt.read_text())
    data[checkpoint_key(path)].pop("at", None)
    ckpt.write_text(json.dumps(data))
    past = time.time_ns() - 10**9
    os.utime(ckpt, ns=(past, past))
    write(path, range(10))
    shutil.copyfile(path, tmp_path / "gw.jsonl.1")
    os.truncate(path, 0)
    write(path, range(10, 15))
    restart(path, ckpt, sink)
    assert sink.got == ids(range(15))


@pytest.mark.parametrize("how", ["caught_up", "watched"])
def test_after_a_checkpoint_of_an_empty_file_older_or_compressed_rotations_are_not_read_again(
    tmp_path: Path, how: str
) -> None:
    """Controls: a rename chain of the earlier copy (.1 → .2, times kept), a rotation compressed after the
    checkpoint (delaycompress; logrotate gives it the original's times), an unrelated older rotation and the live
    file simply written: nothing read twice, nothing of before the checkpoint read."""
    path, ckpt, sink = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json", Sink()
    new_log(tmp_path / "gw.jsonl-20250101", BLANK, range(100, 110))  # unrelated, older
    os.utime(tmp_path / "gw.jsonl-20250101", ns=(1_000_000_000, 1_000_000_000))
    empty_checkpoint(path, ckpt, how, sink)
    if how == "caught_up":
        os.rename(tmp_path / "gw.jsonl.1", tmp_path / "gw.jsonl.2")
        two, gz = tmp_path / "gw.jsonl.2", tmp_path / "gw.jsonl.3.gz"  # compressed now, as logrotate does:
        gz.write_bytes(gzip.compress(two.read_bytes()))
        os.utime(gz, ns=(two.stat().st_atime_ns, two.stat().st_mtime_ns))  # with the original's times
    write(path, range(10, 15))
    restart(path, ckpt, sink)
    want = ids(range(15)) if how == "caught_up" else ids(range(10, 15))
    assert sink.got == want and not sink.dead
    assert metric("kvscope_collector_log_rotations_total", path, kind="resumed_rotated") == 0


def test_after_a_checkpoint_of_an_empty_file_a_rename_rotation_while_down_is_read_once(tmp_path: Path) -> None:
    path, ckpt, sink = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json", Sink()
    empty_checkpoint(path, ckpt, "caught_up", sink)
    write(path, range(10, 15))
    os.rename(tmp_path / "gw.jsonl.1", tmp_path / "gw.jsonl.2")
    os.rename(path, tmp_path / "gw.jsonl.1")
    write(path, range(15, 20))
    restart(path, ckpt, sink)
    assert sink.got == ids(range(20)) and not sink.dead


# -- a running follower: the copy is never a file already queued -----------------------------------------------


def test_a_copytruncate_while_a_renamed_file_is_drained_does_not_take_that_file_for_the_copy(tmp_path: Path) -> None:
    """All files start with the same header; A (renamed to gw.jsonl.1) is still being drained and got the writer's
    late last line, so it is the newest file holding the bytes read of the live file; then the live file is
    copied (cp -p: the copy keeps its time) and truncated. The copy was A: A read twice, the real copy lost."""
    path = tmp_path / "gw.jsonl"
    new_log(path, HEADER, range(19))
    src, sink = source(path, max_bytes=600), Sink()
    sink.poll(src)  # a bit of A
    os.rename(path, tmp_path / "gw.jsonl.1")
    new_log(path, HEADER, range(20, 25))
    time.sleep(0.02)
    sink.poll(src)  # notices the new file, keeps draining A
    sink.poll(src)
    write(tmp_path / "gw.jsonl.1", range(19, 20))  # the late line: A is now the newest
    time.sleep(0.02)
    shutil.copy2(path, tmp_path / "gw.jsonl.2")
    os.truncate(path, 0)
    sink.drain(src)
    assert sink.got == ids(range(25)), f"lost: {sorted(set(ids(range(25))) - set(sink.got))}"
    assert dead_kinds(sink) == headers(HEADER, 2)
    assert metric("kvscope_collector_log_rotations_total", path, kind="copytruncate") == 1
