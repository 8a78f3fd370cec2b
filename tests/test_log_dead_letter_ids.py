"""A gateway-log line's dead letter id (collector/gateway_log.py ``file_key``) on real files through the real
follower (collector/file_tail.py), restarted from its checkpoint file: every file of the log starts with the same
line (a banner, a blank line), so the first line cannot tell the files apart. Each bad line of each file must keep
its own dead letter id (the store keeps one dead letter per id: two files' lines under one id is a loss), and a line
read again after a restart (its ack lost) must repeat the id it had (no double count)."""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from collector.checkpoint import CheckpointStore
from collector.gateway_log import GatewayLogSource
from tests.test_log_tail import WAIT, source, write
from tests.test_log_tail_identity import BLANK, HEADER

GARBAGE = b"{not a record\n"


def new_log(path: Path, first: bytes, numbers: range) -> None:
    """``path`` anew: ``first``, then one bad line (the same bytes in every file, at the same offset), then
    records ``numbers``."""
    path.write_bytes(first + GARBAGE)
    write(path, numbers)


def poll_ids(src: GatewayLogSource, ack: bool = True, rounds: int = 200) -> list[str]:
    """Poll (and ack, unless told not to) until nothing is left: the dead letters' event ids, in read order."""
    out: list[str] = []
    quiet = 0
    while quiet < 20 and rounds:
        rounds -= 1
        events, done = src.poll()
        out += [e.event_id for e in events if e.schema == "dead_letter"]
        if done is not None and ack:
            done()
        if events or done is not None:
            quiet = 0
        else:
            quiet += 1
            time.sleep(WAIT / 4)
    return out


def rotate(path: Path, how: str, to: Path) -> None:
    if how == "rename":
        os.rename(path, to)
    else:
        shutil.copyfile(path, to)
        os.truncate(path, 0)


@pytest.mark.parametrize("how", ["rename", "copytruncate"])
@pytest.mark.parametrize("first", [BLANK, HEADER], ids=["blank", "header"])
def test_each_bad_line_of_each_file_keeps_its_own_dead_letter(tmp_path: Path, first: bytes, how: str) -> None:
    """Three files, each its first line then the same bad line at the same offset, rotated live: keyed by the first
    line's fingerprint, the three bad lines (and the three banners) were one dead letter each kind."""
    path = tmp_path / "gw.jsonl"
    new_log(path, first, range(0, 3))
    src = source(path)
    got = poll_ids(src)
    for n, numbers in enumerate((range(3, 6), range(6, 9)), start=1):
        rotate(path, how, tmp_path / f"gw.jsonl.{n}")
        new_log(path, first, numbers)
        got += poll_ids(src)
    src.close()
    per_file = 2 if first == HEADER else 1
    assert len(got) == 3 * per_file
    assert len(set(got)) == 3 * per_file, f"{len(set(got))} distinct dead letter ids of {len(got)}"


@pytest.mark.parametrize("how", ["rename", "copytruncate"])
@pytest.mark.parametrize("first", [BLANK, HEADER], ids=["blank", "header"])
def test_a_restart_repeats_the_ids_of_the_lines_read_again(tmp_path: Path, first: bytes, how: str) -> None:
    """The collector reads file A (acked) and file B (its acks lost), stops; B is rotated and C written while it is
    down. The restarted collector reads B again: each of B's dead letters repeats its id, and C's are new."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, first, range(0, 3))  # A
    src = source(path, CheckpointStore(ckpt))
    a = poll_ids(src)
    rotate(path, how, tmp_path / "gw.jsonl.1")
    new_log(path, first, range(3, 6))  # B
    b = poll_ids(src, ack=False)
    src.close()
    rotate(path, how, tmp_path / "gw.jsonl.0")  # sorts oldest by time, not by name
    new_log(path, first, range(6, 9))  # C
    src = source(path, CheckpointStore(ckpt))
    again = poll_ids(src)
    src.close()
    per_file = 2 if first == HEADER else 1
    assert len(a) == len(b) == per_file and len(set(a + b)) == 2 * per_file
    assert Counter(again[:per_file]) == Counter(b), "B read again gave other ids: its dead letters count twice"
    assert len(set(again)) == 2 * per_file and not set(again[per_file:]) & set(a + b)
