"""logrotate's ``compress`` + ``delaycompress`` with two or more rotations while the collector is down: the file the
checkpoint is in (and files after it) were compressed (``.1`` → ``.2.gz``) before the restart. The follower
(collector/file_tail.py through collector/gateway_log.py GatewayLogSource) on real files, restarted from its
checkpoint file, reads the gzip'd (bz2, xz) rotated files, so no line is lost; a rotated file in a compression it
cannot read (zstd, lz4, zip), or a corrupt one, that may hold unread lines is counted and named in a warning."""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from collector.checkpoint import CheckpointStore
from collector.gateway_log import watch
from tests.test_log_tail import Sink, ids, metric, source, write
from tests.test_log_tail_identity import BLANK, HEADER, dead_kinds, headers, new_log

OPENERS: dict[str, Callable[..., object]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def compress(src: Path, dst: Path) -> None:
    """What logrotate does to a ``.1`` at the next rotation (delaycompress): ``dst`` compressed, the original's
    times kept (logrotate sets them on the compressed file), the original removed."""
    st = os.stat(src)
    with open(src, "rb") as fin, OPENERS[dst.suffix](dst, "wb") as fout:  # type: ignore[operator]
        shutil.copyfileobj(fin, fout)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.unlink(src)


def rotate(path: Path, how: str, suffix: str, generations: int) -> None:
    """One logrotate run with ``rotate N``, ``compress``, ``delaycompress``: .k.gz → .k+1.gz, .1 → .2.gz, the log
    → .1 (rename, or copy and truncate)."""
    d = path.parent
    for k in range(generations, 1, -1):
        if (d / f"{path.name}.{k}{suffix}").exists():
            os.rename(d / f"{path.name}.{k}{suffix}", d / f"{path.name}.{k + 1}{suffix}")
    if (d / f"{path.name}.1").exists():
        compress(d / f"{path.name}.1", d / f"{path.name}.2{suffix}")
    if how == "rename":
        os.rename(path, d / f"{path.name}.1")
    else:
        shutil.copyfile(path, d / f"{path.name}.1")
        os.truncate(path, 0)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
@pytest.mark.parametrize("how", ["rename", "copytruncate"])
@pytest.mark.parametrize("rotations", [2, 3])
def test_rotated_files_compressed_while_down_are_read(tmp_path: Path, how: str, rotations: int, suffix: str) -> None:
    """The checkpoint is in A (0..9 acked, 10..14 unread); ``rotations`` rotations while down, each followed by 5
    new records: A (and B with three) were compressed before the restart. Every line arrives once."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, HEADER, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    write(path, range(10, 15))
    src.close()
    n = 15
    for _ in range(rotations):
        rotate(path, how, suffix, rotations)
        path.write_bytes(HEADER)  # a new file, or the truncated one written again, from its banner
        write(path, range(n, n + 5))
        n += 5
    assert list(tmp_path.glob(f"gw.jsonl.*{suffix}")), "the reproduction compressed nothing"
    sink.drain(source(path, CheckpointStore(ckpt)))
    assert sink.got == ids(range(n)), f"lost: {sorted(set(ids(range(n))) - set(sink.got), key=lambda r: int(r[2:]))}"
    assert dead_kinds(sink) == headers(HEADER, rotations + 1)
    assert metric("kvscope_collector_log_resume_misses_total", path) == 0


@pytest.mark.parametrize("first", [BLANK, HEADER], ids=["blank", "header"])
def test_a_checkpoint_that_read_nothing_reads_the_copies_compressed_since(tmp_path: Path, first: bytes) -> None:
    """``watch`` checkpoints offset 0 of the live file (nothing read); two copytruncate rotations with
    delaycompress while down: the first copy is now ``.2.gz``. It is read (by its time), then ``.1``, then the
    file."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, first, range(0))
    assert watch(path, CheckpointStore(ckpt))
    sink, n = Sink(), 0
    for _ in range(2):
        write(path, range(n, n + 5))
        n += 5
        rotate(path, "copytruncate", ".gz", 2)
        path.write_bytes(first)
    write(path, range(n, n + 5))
    n += 5
    sink.drain(source(path, CheckpointStore(ckpt)))
    assert sink.got == ids(range(n)), f"lost: {sorted(set(ids(range(n))) - set(sink.got), key=lambda r: int(r[2:]))}"
    assert dead_kinds(sink) == headers(first, 3)


@pytest.mark.parametrize("kind", ["zst", "corrupt"])
def test_a_rotated_file_that_cannot_be_read_is_counted_and_named(tmp_path: Path, kind: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The checkpointed file was compressed while down in a format the collector does not read (zstd), or its gzip
    is cut short: its unread lines cannot be read. The restart counts the file as unread, names it in a warning,
    and still reads the rotated file after it and the current file."""
    path, ckpt = tmp_path / "gw.jsonl", tmp_path / "checkpoints.json"
    new_log(path, HEADER, range(10))
    src, sink = source(path, CheckpointStore(ckpt)), Sink()
    sink.drain(src)
    write(path, range(10, 15))
    src.close()
    rotate(path, "rename", ".gz", 2)
    path.write_bytes(HEADER)
    write(path, range(15, 20))
    rotate(path, "rename", ".gz", 2)
    path.write_bytes(HEADER)
    write(path, range(20, 25))
    gz = tmp_path / "gw.jsonl.2.gz"
    st = os.stat(gz)
    if kind == "zst":  # another compressor: the same bytes under a name this collector does not decompress
        gz.rename(bad := tmp_path / "gw.jsonl.2.zst")
    else:
        os.truncate(gz, st.st_size // 2)
        bad = gz
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.WARNING, logger="kvscope.collector"):
        sink.drain(source(path, CheckpointStore(ckpt)))
    # 0..9 from the first run; of the unreadable file's unread 10..14, what decompresses (a gzip cut short); then
    # the rotated file after it and the current file
    assert set(sink.got) >= set(ids(range(10), range(15, 25))) and max(sink.got.values()) == 1
    assert set(sink.got) <= set(ids(range(25)))
    assert metric("kvscope_collector_log_files_unread_total", path, reason="unsupported_compression"
                  if kind == "zst" else "corrupt") == 1
    assert any(str(bad) in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
