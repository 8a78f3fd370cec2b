"""Follows one append-only log file across rotations from a durable position (sources → file_tail → events).

:class:`FileFollower` hands out byte ranges of complete lines (:class:`Chunk`), each with the :class:`Position`
just after it; the caller persists that position only once the lines are durable downstream, and a new
follower resumes from it. A file is identified by ``(st_dev, st_ino)`` while it is open, and across restarts
and copies by its content: its *fingerprint*, a hash of its first line (see :func:`fingerprint`), as Vector's
file source does, and its *head*, a hash of the bytes already read from it, up to :data:`HEAD_BYTES` (see
:class:`Position`). The head tells apart files that share their first line (each starts with a blank line, a
header, a banner): the bytes after it are other records. Where the content read so far cannot tell two files
apart (only such a shared first line was read), the one with the checkpoint's inode is the checkpointed file.
Handled, without losing a line:

- rename-and-create rotation: the old file stays open and is drained until it has been idle (no growth)
  for ``rotate_wait_seconds``, since a writer may append one last line after the rename; then the new file
  is read from 0;
- copytruncate: the unread tail is read from the sibling copy holding what we read (fingerprint and head);
  with no copy it is a plain truncation and the bytes known to be skipped are counted. Truncation is seen by
  size, or by the first line or the head changing (a file truncated and rewritten past our offset between two
  reads, even with the same first line);
- deletion: the open (unlinked) file is drained, then the path is read from 0 when it reappears;
- a restart after rotations: the checkpointed file is found among the siblings by fingerprint and head (the
  inode first), drained, then every sibling written after it (the rotations since the checkpoint, however
  many) is read whole, oldest first, before the current file;
- a restart from a checkpoint that read nothing (offset 0: an empty file caught up on, or just watched) whose file
  is still the current one (its inode): nothing read can find a copy of it, so its time does (``at``, when the
  position was taken): the rotated siblings modified since (a copytruncate while down; renames keep times) are
  read whole, oldest first, before the current file;
- a copytruncate while a rotated file is still being drained: the copy is never a file already being read;
- compressed rotated files (logrotate's ``compress``, ``delaycompress`` with two or more rotations while down):
  ``.gz``, ``.bz2`` and ``.xz`` siblings are read decompressed (into an anonymous temporary file) wherever an
  uncompressed one would be: found as the checkpointed file by their decompressed first bytes, or read whole as
  files written since (dated by their modification time, which logrotate copies from the original). One in a
  format not read here (zstd, lz4, zip) that may hold unread lines, or one cut short (its complete lines before the
  cut are read), is counted in ``kvscope_collector_log_files_unread_total`` and named in a warning.

Each file gets a :attr:`Position.key` (:func:`next_key`) naming it among the log's files for its lines' ids.

A checkpoint written before heads were kept (no ``head`` key) is found by fingerprint and inode as before: a
file with its inode is preferred to one that only shares its first line. The current file taken by its first
line alone, without the checkpoint's inode (an earlier version's checkpoint, or one that had read no more than
the first line), is counted as a resume miss and logged as a warning: it may be another file.

Not handled: a file created and rotated away again between two reads of a running follower is not seen (nor
counted in the file keys); a compressed file stamped with the time it was compressed, not the original's, is read
again as a file written since the checkpoint; files whose first :data:`HEAD_BYTES` bytes are equal are told apart
only by inode; a file copied and then truncated *and rewritten with the same first bytes* while the collector
was down, when the checkpoint covered only those bytes, is taken for the checkpointed file (its inode): the
copy's lines after them are not read. A checkpoint that read nothing finds a copy only by time: a copy taken
without new lines since the checkpoint keeps an older time (``cp -p``) and is not read; a line written to a
rotated file after it was drained and dropped makes that file newer, and it is read again.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import logging
import lzma
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

log = logging.getLogger("kvscope.collector")

#: The fingerprint covers the first line, or this many bytes of it when it is longer.
FINGERPRINT_BYTES = 4096
#: A position's head covers the bytes read of its file, or this many of them (from offset 0) when more were read.
HEAD_BYTES = 4096
#: Rotated files with these suffixes are compressed (logrotate's ``compress``) and read decompressed: at a restart,
#: the checkpointed file and the files after it may have been compressed while the collector was down.
_DECOMPRESS: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
#: Rotated files with these suffixes are compressed in a format this collector does not read: one that may hold
#: unread lines (modified since) is counted (``kvscope_collector_log_files_unread_total``) and named in a warning.
_UNREADABLE = (".zst", ".lz4", ".zip", ".Z", ".lzo")
_COMPRESSED = (*_DECOMPRESS, *_UNREADABLE)
#: What fails when a compressed file is cut short or is not in its suffix's format.
_DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError, ValueError)
_SCAN = 1 << 20
#: File modification times come from the kernel's coarse clock, up to a tick (4-10 ms) behind ``time.time_ns``.
_CLOCK_SLACK_NS = 20_000_000

LAG_BYTES = Gauge("kvscope_collector_log_lag_bytes", "Bytes written to the log not yet read", ["path"])
ROTATIONS = Counter("kvscope_collector_log_rotations_total", "Rotations of a followed log file seen, by kind "
                    "(rename, copytruncate, truncate, deleted, resumed_rotated)", ["path", "kind"])
BYTES_LOST = Counter("kvscope_collector_log_bytes_lost_total", "Bytes known to be skipped unread, by reason",
                     ["path", "reason"])
FILES_UNREAD = Counter("kvscope_collector_log_files_unread_total", "Rotated files of the log that may hold unread "
                       "lines but could not be read, by reason (unsupported_compression, corrupt)", ["path", "reason"])
RESUME_MISSES = Counter("kvscope_collector_log_resume_misses_total", "Restarts whose checkpointed file was "
                        "found nowhere, or by its first line alone (its unread tail may be lost)", ["path"])


def fingerprint(head: bytes) -> str | None:
    """Fingerprint of a file from its first bytes (``head``, read from offset 0): 32 hex chars of SHA-256
    over the first line including its newline, or over the first :data:`FINGERPRINT_BYTES` bytes when the
    line is longer. None while the first line is incomplete and shorter than that."""
    nl = head.find(b"\n", 0, FINGERPRINT_BYTES)
    if nl >= 0:
        body = head[: nl + 1]
    elif len(head) >= FINGERPRINT_BYTES:
        body = head[:FINGERPRINT_BYTES]
    else:
        return None
    return hashlib.sha256(body).hexdigest()[:32]


def next_key(prev: str | None, prev_fp: str | None) -> str:
    """The :attr:`Position.key` of the file of the log that follows (rotation, truncation) the file keyed ``prev``
    (None: the first file of the chain, known by its fingerprint ``prev_fp``, None while it has no complete first
    line): 32 hex chars of SHA-256 of the predecessor's identity. Deterministic, so a follower restarted from a
    checkpoint that reads the same files in the same order gives each the key it had before."""
    base = prev if prev is not None else f"fp:{prev_fp}"
    return hashlib.sha256(f"{base}/next".encode()).hexdigest()[:32]


def head_digest(head: bytes) -> str:
    """Digest of a file's head (``head``: its first bytes, from offset 0, at most :data:`HEAD_BYTES`): 32 hex
    chars of SHA-256. The head of a :class:`Position`."""
    return hashlib.sha256(head).hexdigest()[:32]


@dataclass(frozen=True)
class Position:
    """Where a follower stands: ``offset`` bytes (of complete lines) read of the file with ``fingerprint``
    (None while its first line is incomplete) and identity ``dev``/``ino``; ``head`` is :func:`head_digest` of
    the file's first ``head_len`` bytes, ``head_len = min(offset, HEAD_BYTES)`` (bytes already read, so they
    do not change while the file is only appended to): it tells the file apart from another with the same
    first line. ``head`` is None in a checkpoint written before heads were kept (then ``head_len`` is 0).
    ``file`` is informational (the name it was read under). ``at`` is the wall-clock time (ns since the epoch) the
    position was taken, at or before its acknowledgement: a file of the log modified after it holds lines
    written after it (None: unknown, a checkpoint of an earlier version). ``key`` names the file among the files of
    the log for its lines' ids (dead letters): None for the file a follower started in without a checkpoint (and
    for an earlier version's checkpoint), which is then named by its fingerprint; each file after it (a rotation,
    a truncation: the next generation) gets :func:`next_key` of its predecessor's, a copy keeps its original's.
    Files that start with the same bytes (a banner, a blank line) and have the same inode (copytruncate) still
    get distinct keys, and a line read again after a restart (from the checkpointed file, renamed or copied, or a
    file after it) gets the key it had. :data:`START` means "the start of whatever file the path names"."""

    fingerprint: str | None
    offset: int
    dev: int = 0
    ino: int = 0
    file: str = field(default="", compare=False)
    head: str | None = None
    head_len: int = 0
    at: int | None = field(default=None, compare=False)
    key: str | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "offset": self.offset, "dev": self.dev, "ino": self.ino,
                "file": self.file, "head": self.head, "head_len": self.head_len, "at": self.at,
                "key": self.key}

    @classmethod
    def from_json(cls, value: Any) -> Position | None:
        """The position stored by :meth:`to_json` (with or without ``head``/``head_len``: a checkpoint of an
        earlier version has neither); None (with a warning) for anything else. A ``head`` that does not fit its
        offset is dropped with a warning (the position is then found as an earlier version's)."""
        if value is None:
            return None
        try:
            fp = value["fingerprint"]
            head = value.get("head")
            at = value.get("at")
            key = value.get("key")
            pos = cls(fp if fp is None else str(fp), int(value["offset"]), int(value.get("dev", 0)),
                      int(value.get("ino", 0)), str(value.get("file", "")), None if head is None else str(head),
                      int(value.get("head_len", 0)) if head is not None else 0, None if at is None else int(at),
                      None if key is None else str(key))
        except (TypeError, KeyError, ValueError, AttributeError):
            log.warning("log checkpoint is not a position; reading the file from the start. value=%.200r", value)
            return None
        if pos.offset < 0:
            return None
        if pos.head is not None and pos.head_len != min(pos.offset, HEAD_BYTES):
            log.warning("log checkpoint's head does not fit its offset; finding the file by its first line and "
                        "inode only. value=%.200r", value)
            pos = cls(pos.fingerprint, pos.offset, pos.dev, pos.ino, pos.file, at=pos.at, key=pos.key)
        return pos


START = Position(None, 0)


def start_position(path: str | Path) -> Position | None:
    """The position "nothing read yet" of the file ``path`` names now: offset 0, its fingerprint (None while its
    first line is incomplete), identity and an empty head (nothing read: the inode tells it apart from a file
    with the same first line). None when no regular file is there. A follower started from it
    later finds that file again, renamed or copied, and reads every file written after it (:class:`FileFollower`).
    """
    f = FileFollower._open(Path(path))
    if f is None:
        return None
    try:
        return f.position()
    finally:
        f.close()


@dataclass(frozen=True)
class Chunk:
    """What one read produced, all from one file (``name``): ``data`` holds whole lines, each ending in
    ``\\n``, starting at byte ``start``; or ``long_head`` is the first ``max_bytes`` bytes of a line longer
    than that, which was skipped; or neither (the position moved without lines: a file switch). ``end`` is
    the position just after them. A final unterminated line of a finished file gets its ``\\n`` added."""

    name: str
    start: int
    data: bytes
    long_head: bytes | None
    end: Position


def inflate(path: Path, opener: Callable[..., Any], out: Any, limit: int | None = None) -> Exception | None:
    """Decompress the file ``path`` (``opener``: gzip.open, bz2.open or lzma.open) into the binary file ``out``, up
    to ``limit`` bytes (None: all). Returns None, or the error that stopped it (a file cut short, another format:
    OSError, EOFError, lzma.LZMAError, ValueError) after writing every byte that decompressed before it."""
    try:
        with opener(path, "rb") as src:
            left = limit
            while left is None or left > 0:
                block = src.read1(1 << 16 if left is None else min(1 << 16, left))
                if not block:
                    return None
                out.write(block)
                if left is not None:
                    left -= len(block)
    except _DECOMPRESS_ERRORS as exc:
        return exc
    return None


class _File:
    """One open file: read position ``offset``, ``fp`` once known, ``head`` = the bytes read from offset 0 (at
    most :data:`HEAD_BYTES`), ``seen`` = largest size observed, ``detached`` once the path no longer names it
    (drain, then drop)."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "rb", buffering=0)  # kept open across reads (an unlinked file stays readable)
        st = os.fstat(self.fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            self.fh.close()
            raise IsADirectoryError(f"{path} is not a regular file")
        self.name = str(path)
        self.ident = (st.st_dev, st.st_ino)
        self.offset = 0
        self.fp: str | None = None
        self.head = b""
        self.seen = st.st_size
        self.idle_since = time.monotonic()
        self.detached = False
        self.key: str | None = None  # Position.key: None = the first file of the chain, named by its fingerprint
        self.mtime_ns = st.st_mtime_ns  # of the file as found (a compressed one: the compressed file's)
        self.compressed = False
        self.error: str | None = None  # a compressed file that did not decompress to its end: why

    @classmethod
    def decompressed(cls, path: Path, opener: Callable[..., Any]) -> _File:
        """The compressed file ``path`` (``opener``: gzip.open, bz2.open, lzma.open), decompressed into an anonymous
        temporary file: named ``path``, with ``path``'s identity and modification time (logrotate gives a file it
        compresses the original's times). Raises OSError, EOFError, lzma.LZMAError or ValueError when it does not
        decompress (cut short, another format)."""
        st = os.stat(path)
        tmp = tempfile.TemporaryFile()
        try:
            error = inflate(path, opener, tmp)
            tmp.flush()
            if error is not None:  # cut short: keep its complete lines, drop the partial last one
                size = tmp.seek(0, os.SEEK_END)
                tail = os.pread(tmp.fileno(), min(size, _SCAN), max(0, size - _SCAN))
                nl = tail.rfind(b"\n")
                os.ftruncate(tmp.fileno(), 0 if nl < 0 else size - len(tail) + nl + 1)
        except BaseException:
            tmp.close()
            raise
        f = cls.__new__(cls)
        f.fh, f.name, f.ident = tmp, str(path), (st.st_dev, st.st_ino)
        f.offset, f.fp, f.head, f.seen = 0, None, b"", f.size()
        f.idle_since, f.detached, f.key, f.mtime_ns, f.compressed = 0.0, True, None, st.st_mtime_ns, True
        f.error = None if error is None else f"{type(error).__name__}: {error}"
        return f

    def succeed(self, prev: _File) -> None:
        """Key this file as the one after ``prev`` in the log (:func:`next_key`)."""
        self.key = next_key(prev.key, prev.fp or (prev.current_fp() if prev.key is None else None))

    def size(self) -> int:
        return os.fstat(self.fh.fileno()).st_size

    def pread(self, n: int, at: int) -> bytes:
        return os.pread(self.fh.fileno(), n, at)

    def current_fp(self) -> str | None:
        return fingerprint(self.pread(FINGERPRINT_BYTES, 0))

    def resume_at(self, pos: Position) -> None:
        """Stand at ``pos`` (which this file holds): its offset, fingerprint and key, and the head read back."""
        self.offset, self.fp, self.key = pos.offset, pos.fingerprint, pos.key
        self.head = self.pread(min(pos.offset, HEAD_BYTES), 0)

    def advance(self, raw: bytes, consumed: int) -> None:
        """Move ``consumed`` bytes on from ``offset``, ``raw`` being the bytes read there (maybe fewer)."""
        need = min(self.offset + consumed, HEAD_BYTES) - len(self.head)
        if need > 0:  # len(head) == offset here
            part = raw[:need]
            if len(part) < need:
                part += self.pread(need - len(part), self.offset + len(part))
            self.head += part
        self.offset += consumed

    def still_holds_head(self, first: bytes) -> bool:
        """Whether ``first`` (the file's first bytes now, at least :data:`HEAD_BYTES` of them when there are)
        starts with the bytes read."""
        return first[: len(self.head)] == self.head

    def note(self, size: int) -> None:
        """Record the size seen now; growth (or any change) restarts the idle clock."""
        if size != self.seen:
            self.seen = size
            self.idle_since = time.monotonic()

    def position(self) -> Position:
        if self.fp is None and self.offset == 0:
            self.fp = self.current_fp()
        return Position(self.fp, self.offset, *self.ident, file=self.name, head=head_digest(self.head),
                        head_len=len(self.head), at=time.time_ns(), key=self.key)

    def close(self) -> None:
        self.fh.close()


class FileFollower:
    """Follows ``path`` from ``start`` (a :class:`Position` from a checkpoint; None = from the beginning).

    :meth:`read` returns the next :class:`Chunk` (at most ``max_bytes`` of lines, or one too-long line) or
    None when nothing changed. OSError other than a missing file (e.g. permission denied) propagates from
    the constructor and :meth:`read`; the caller may retry. Not thread safe: one thread reads.
    """

    def __init__(self, path: str | Path, start: Position | None, *, max_bytes: int = 8 << 20,
                 rotate_wait_seconds: float = 1.0) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.path = Path(path)
        self.label = str(path)
        self.max_bytes = max_bytes
        self.rotate_wait = rotate_wait_seconds
        self._files: list[_File] = []  # read in order; only the last may be live (named by the path)
        self._issued = start or START
        #: (key, fingerprint) of the file a file appearing with none queued follows (None: it is the first)
        self._gone: tuple[str | None, str | None] | None = None
        self._resume(start)

    # -- public ---------------------------------------------------------------------------------------

    def read(self) -> Chunk | None:
        """The next lines (or the next position change), or None."""
        self._observe_path()
        live = self._live()
        if live is not None and self._files[0] is not live:
            self._check_live(live)  # a file we have not reached yet may be copytruncated too
        chunk = self._read_head() if self._files else None
        if chunk is None:
            chunk = self._moved()
        LAG_BYTES.labels(self.label).set(self.lag_bytes())
        return chunk

    def lag_bytes(self) -> int:
        """Bytes of the followed files not yet read (the gauge ``kvscope_collector_log_lag_bytes``)."""
        lag = sum(max(0, f.size() - f.offset) for f in self._files)
        if self._live() is None:
            try:
                lag += os.stat(self.path).st_size
            except FileNotFoundError:
                pass
        return lag

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()

    # -- start ----------------------------------------------------------------------------------------

    def _resume(self, pos: Position | None) -> None:
        cur = self._open(self.path)
        if pos is None or pos == START:
            self._files = [cur] if cur else []
            return
        self._gone = (pos.key, pos.fingerprint)  # a file appearing later follows the checkpointed one
        ident = (pos.dev, pos.ino)
        cur_holds = cur is not None and self._holds(cur, pos)
        if cur is not None and cur_holds and cur.ident == ident:
            cur.resume_at(pos)
            newer = (self._written_since(pos.at - _CLOCK_SLACK_NS, {cur.ident})
                     if pos.offset == 0 and pos.at is not None else [])
            if newer:
                # nothing of the file was read: a copy of it (copytruncate while down) has no bytes read to be
                # found by, only its time; lines written after the checkpoint are in it, read before the file
                ROTATIONS.labels(self.label, "resumed_rotated").inc()
                log.warning("log was copied (copytruncate) while the collector was down and nothing of it had "
                            "been read; reading the files written since the checkpoint first. path=%s then=%s",
                            self.label, [f.name for f in newer])
            if newer:  # the checkpointed generation is the oldest copy: the files after it follow it
                newer[0].key = pos.key
                self._chain([*newer, cur])
            self._files = [*newer, cur]
            return
        old = self._find_sibling(pos, exclude={cur.ident} if cur else set())
        if cur is not None and cur_holds and (old is None or old.ident != ident):
            # only the content says so: the inode changed (a restore, a remount), or the content read so far
            # cannot tell (another sibling shares it, without the inode either): the path is the likelier
            if old is not None:
                old.close()
            nl = cur.pread(FINGERPRINT_BYTES, 0).find(b"\n")
            if pos.head is None or pos.offset <= nl + 1:  # nothing but the first line tells: maybe another file
                RESUME_MISSES.labels(self.label).inc()
                log.warning("checkpointed log file found by its first line only, not by its inode; resuming in the "
                            "current file at the offset: if it is another file, lines of the checkpointed one may be "
                            "lost. path=%s offset=%d inode=%d now=%d last_name=%s earlier_version=%s",
                            self.label, pos.offset, pos.ino, cur.ident[1], pos.file, pos.head is None)
            cur.resume_at(pos)
            self._files = [cur]
            return
        newer: list[_File] = []
        if old is not None:
            old.resume_at(pos)
            old.detached = True
            newer = self._newer_siblings(old, exclude=cur.ident if cur else None)
            ROTATIONS.labels(self.label, "resumed_rotated").inc()
            log.info("log was rotated while the collector was down; draining the rotated file first. path=%s "
                     "rotated=%s offset=%d then=%s", self.label, old.name, pos.offset, [f.name for f in newer])
        else:
            RESUME_MISSES.labels(self.label).inc()
            # the rotated files written since the checkpoint (a file that cannot be read among them is counted)
            newer = (self._written_since(pos.at - _CLOCK_SLACK_NS, {cur.ident if cur else None})
                     if pos.at is not None else [])
            log.error("checkpointed log file not found; lines after its checkpoint may be lost, reading the rotated "
                      "files written since the checkpoint, then the current file from the start. path=%s "
                      "fingerprint=%s offset=%d inode=%d last_name=%s then=%s", self.label, pos.fingerprint,
                      pos.offset, pos.ino, pos.file, [f.name for f in newer])
            first = newer[0] if newer else cur
            if first is not None:
                first.key = next_key(pos.key, pos.fingerprint)  # a file after the checkpointed one
        self._files = [f for f in (old, *newer, cur) if f is not None]
        self._chain(self._files)

    @staticmethod
    def _chain(files: list[_File]) -> None:
        """Key each of ``files`` (in the log's order) after the one before it (:meth:`_File.succeed`)."""
        for prev, f in zip(files, files[1:], strict=False):
            f.succeed(prev)

    @staticmethod
    def _holds(f: _File, pos: Position) -> bool:
        """Whether ``f`` holds what ``pos`` read: at least ``pos.offset`` bytes, the same fingerprint and the
        same head (its first ``pos.head_len`` bytes); while it had neither fingerprint nor head bytes (nothing
        read, first line incomplete), the same inode. Files sharing what was read all hold it: the caller
        prefers the one with ``pos``'s inode."""
        if f.size() < pos.offset:
            return False
        if pos.fingerprint and f.current_fp() != pos.fingerprint:
            return False
        if pos.head is not None and pos.head_len > 0:
            return head_digest(f.pread(pos.head_len, 0)) == pos.head
        return bool(pos.fingerprint) or f.ident == (pos.dev, pos.ino)

    def _find_sibling(self, pos: Position, exclude: set[tuple[int, int]]) -> _File | None:
        """The file beside the log (name starting with the log's name) that holds ``pos`` (see
        :meth:`_holds`), other than the files ``exclude`` names (identities); the same inode as ``pos`` first,
        then the last modified (a copy just taken, not an older rotation that shares the bytes read), then the
        largest."""
        found: list[_File] = []
        for entry in self._siblings():
            try:
                f = self._open_sibling(entry, probe=pos)
            except OSError:  # unreadable: not ours to follow
                continue
            if f is not None and f.ident not in exclude and self._holds(f, pos):
                found.append(f)
            elif f is not None:
                f.close()
        found.sort(key=lambda f: (f.ident == (pos.dev, pos.ino), not f.compressed, f.mtime_ns, f.size()),
                   reverse=True)
        for f in found[1:]:
            f.close()
        return found[0] if found else None

    def _newer_siblings(self, old: _File, exclude: tuple[int, int] | None) -> list[_File]:
        """The rotated files written after ``old`` (the checkpointed file, found rotated away), oldest first:
        siblings modified at or after ``old``'s last write, other than ``old``, ``exclude`` (the current file),
        copies of ``old`` (:meth:`_copy_of`) and compressed files. When the checkpoint lags the rotations
        (acknowledgements are slower than rotations, or several rotations happened while the collector was
        down), their lines were never acknowledged: each is read whole, after ``old`` and before the current
        file. Rename keeps a file's modification time and a copy gets the copy's time, so both sort after
        ``old``; older rotations sort before it and are not read again."""
        return self._written_since(old.mtime_ns, {old.ident, exclude}, old)

    def _written_since(self, since: int, exclude: set[tuple[int, int] | None], old: _File | None = None
                       ) -> list[_File]:
        """Siblings modified at or after ``since`` (ns), other than ``exclude`` and copies of ``old``, detached at
        offset 0, oldest first (see :meth:`_newer_siblings`). Compressed ones (:data:`_DECOMPRESS`) are read
        decompressed, unless an uncompressed sibling holds the same (logrotate compressing it right now); one that
        cannot be read is counted and named in a warning (:meth:`_open_sibling`)."""
        found: list[tuple[int, str, _File]] = []
        for entry in self._siblings():
            try:
                f = self._open_sibling(entry, since=since)
            except OSError:
                continue
            if f is None:
                continue
            if f.ident in exclude or f.mtime_ns < since or (old is not None and self._copy_of(f, old)):
                f.close()
                continue
            f.detached = True
            found.append((f.mtime_ns, f.name, f))
        plain = [f for _, _, f in found if not f.compressed]
        for t in list(found):
            if t[2].compressed and any(self._copy_of(t[2], g) for g in plain):
                found.remove(t)
                t[2].close()
        found.sort(key=lambda t: (t[0], t[1]))
        return [f for _, _, f in found]

    def _open_sibling(self, entry: os.DirEntry[str], *, probe: Position | None = None, since: int | None = None
                      ) -> _File | None:
        """The sibling ``entry`` opened (a compressed one decompressed), or None: not a regular file; or compressed
        and modified before ``since`` (ns), or its first bytes not what ``probe`` read (checked before it is
        decompressed whole); or compressed in a format this collector does not read, or corrupt: then, when it may
        hold lines not read yet (``since`` given and it was modified since), counted in
        ``kvscope_collector_log_files_unread_total`` and named in a warning. Raises OSError (unreadable)."""
        if not entry.is_file():
            return None
        path = Path(entry.path)
        if not entry.name.endswith(_COMPRESSED):
            return self._open(path)
        mtime = entry.stat().st_mtime_ns
        if since is not None and mtime < since:
            return None
        suffix = next(s for s in _COMPRESSED if entry.name.endswith(s))
        opener = _DECOMPRESS.get(suffix)
        if opener is None:
            if since is not None:
                self._unread(path, "unsupported_compression", f"{suffix} files are not read")
            return None
        if probe is not None:  # its first bytes first: most rotated files are not the one looked for
            buf = io.BytesIO()
            inflate(path, opener, buf, max(FINGERPRINT_BYTES, HEAD_BYTES))
            first = buf.getvalue()
            if probe.fingerprint and fingerprint(first) != probe.fingerprint:
                return None
            if probe.head is not None and probe.head_len > 0 and head_digest(first[: probe.head_len]) != probe.head:
                return None
        f = _File.decompressed(path, opener)
        if f.error is not None:
            self._unread(path, "corrupt", f"it decompresses to {f.size()} bytes of complete lines, then {f.error}")
            if f.size() == 0:  # nothing to read (not in its suffix's format at all)
                f.close()
                return None
        return f

    def _unread(self, path: Path, reason: str, why: str) -> None:
        """Count (``kvscope_collector_log_files_unread_total``) and name in a warning a rotated file that may hold
        lines not read yet but cannot be read."""
        FILES_UNREAD.labels(self.label, reason).inc()
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        log.warning("rotated log file may hold unread lines but cannot be read; its lines are lost. path=%s file=%s "
                    "compressed_bytes=%d reason=%s: %s", self.label, path, size, reason, why)

    @staticmethod
    def _copy_of(f: _File, old: _File) -> bool:
        """Whether ``f`` is a copy of ``old`` (taken before ``old`` stopped growing): not larger, and the same
        first bytes (up to :data:`HEAD_BYTES`, or ``f``'s size). Another file that only shares the first line
        differs in the bytes after it, or (when ``old`` holds no more than that line) is larger."""
        size = f.size()
        if size == 0 or size > old.size():
            return False
        n = min(size, HEAD_BYTES)
        return f.pread(n, 0) == old.pread(n, 0)

    def _siblings(self) -> list[os.DirEntry[str]]:
        """Directory entries beside the log whose names start with the log's name (not the log itself)."""
        try:
            entries = list(os.scandir(self.path.parent))
        except FileNotFoundError:
            return []
        return [e for e in entries if e.name != self.path.name and e.name.startswith(self.path.name)]

    @staticmethod
    def _open(path: Path) -> _File | None:
        """Open a regular file; None when it does not exist (or is not a regular file)."""
        try:
            return _File(path)
        except (FileNotFoundError, IsADirectoryError):
            return None

    # -- rotation -------------------------------------------------------------------------------------

    def _live(self) -> _File | None:
        return self._files[-1] if self._files and not self._files[-1].detached else None

    def _observe_path(self) -> None:
        """Notice the path naming another file (rename, delete + create) or none (rename, delete)."""
        live = self._live()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if live is not None:
                self._detach(live)
            return
        ident = (st.st_dev, st.st_ino)
        if any(f.ident == ident for f in self._files):
            return
        new = self._open(self.path)
        if new is None or any(f.ident == new.ident for f in self._files):
            if new is not None:
                new.close()
            return
        if live is not None:
            self._detach(live)
        if self._files:
            new.succeed(self._files[-1])
        elif self._gone is not None:  # every file read so far is drained and dropped (or the checkpointed one)
            new.key = next_key(*self._gone)
        self._files.append(new)

    def _detach(self, f: _File) -> None:
        kind = "deleted" if os.fstat(f.fh.fileno()).st_nlink == 0 else "rename"
        f.detached = True
        f.idle_since = time.monotonic()
        f.note(f.size())
        ROTATIONS.labels(self.label, kind).inc()
        log.info("log file rotated; draining the old file before reading the new one. path=%s kind=%s "
                 "offset=%d size=%d", self.label, kind, f.offset, f.seen)

    def _check_live(self, f: _File) -> bool:
        """True (after handling it) when the live file no longer holds what we read: it shrank (below our
        offset or below a size seen before), or its first line or the bytes read from offset 0 (up to
        :data:`HEAD_BYTES`) changed (copytruncate or truncation, even if it has grown since, even with the
        same first line)."""
        size = f.size()
        first = f.pread(max(FINGERPRINT_BYTES, HEAD_BYTES), 0)
        if (size < max(f.offset, f.seen) or (f.fp is not None and fingerprint(first) != f.fp)
                or not f.still_holds_head(first)):
            self._truncated(f, size)
            return True
        if f.fp is None and f.offset == 0:
            f.fp = f.current_fp()
        f.note(size)
        return False

    def _truncated(self, f: _File, size_now: int) -> None:
        """Read the unread tail from the copy holding what we read (fingerprint and head), if there is one; then
        the file from 0."""
        held = Position(f.fp, f.offset, *f.ident, head=head_digest(f.head), head_len=len(f.head))
        # never a file already queued (a rotated file still being drained may share the bytes read and be newer)
        copy = self._find_sibling(held, exclude={g.ident for g in self._files}) if f.fp else None
        if copy is not None:
            kind, lost = "copytruncate", max(0, f.seen - max(copy.size(), f.offset))
            copy.offset, copy.fp, copy.head, copy.detached, copy.key = f.offset, f.fp, f.head, True, f.key
            self._files.insert(self._files.index(f), copy)
        else:
            kind, lost = "truncate", max(0, f.seen - f.offset)
        ROTATIONS.labels(self.label, kind).inc()
        if lost:
            BYTES_LOST.labels(self.label, kind).inc(lost)
        (log.warning if lost else log.info)(
            "log file truncated; reading the rest from the copy if any, then the file from the start. path=%s "
            "kind=%s offset=%d copy=%s lost_bytes=%d", self.label, kind, f.offset, copy.name if copy else None, lost)
        f.key = next_key(f.key, f.fp)  # the file's next generation
        f.offset, f.fp, f.head, f.seen = 0, None, b"", size_now

    # -- reading --------------------------------------------------------------------------------------

    def _read_head(self) -> Chunk | None:
        """Lines from the first file; for the live file they count only if it still holds what we read."""
        f = self._files[0]
        size = f.size()
        if f.detached:
            f.note(size)
        got = self._take(f, size)
        if not f.detached and self._check_live(f):
            return None  # the file changed under the read: discard it, the copy (if any) comes next
        if got is None:
            return self._finish(f)
        data, consumed, long_head, raw = got
        start = f.offset
        if start == 0 and f.fp is None:
            f.fp = f.current_fp()
        f.advance(raw, consumed)
        return self._issue(Chunk(f.name, start, data, long_head, f.position()))

    def _take(self, f: _File, size: int) -> tuple[bytes, int, bytes | None, bytes] | None:
        """``(lines, bytes consumed, long line head, bytes read)`` available at ``f.offset``, without moving it."""
        if size <= f.offset:
            return None
        raw = f.pread(self.max_bytes, f.offset)
        if f.offset == 0 and f.fp is None:
            f.fp = fingerprint(raw)
        nl = raw.rfind(b"\n")
        if nl >= 0:
            return raw[: nl + 1], nl + 1, None, raw
        final = f.detached and time.monotonic() - f.idle_since >= self.rotate_wait
        if len(raw) >= self.max_bytes:
            end = self._line_end(f, f.offset + len(raw))
            if end is None and final:
                end = f.size()
            return None if end is None else (b"", end - f.offset, raw, raw)
        if final and raw:
            return raw + b"\n", len(raw), None, raw  # the last line of a file that will not grow again
        return None

    @staticmethod
    def _line_end(f: _File, pos: int) -> int | None:
        """Offset just after the next newline at or after ``pos``; None when there is none yet."""
        while chunk := f.pread(_SCAN, pos):
            nl = chunk.find(b"\n")
            if nl >= 0:
                return pos + nl + 1
            pos += len(chunk)
        return None

    def _finish(self, f: _File) -> Chunk | None:
        """Drop a detached file once it is drained and has been idle for ``rotate_wait_seconds``."""
        if not f.detached or f.offset < f.seen or time.monotonic() - f.idle_since < self.rotate_wait:
            return None
        gone = self._files.pop(0)
        if not self._files:  # the next file to appear follows it
            self._gone = (gone.key, gone.fp or (gone.current_fp() if gone.key is None else None))
        gone.close()
        return self._moved()

    def _moved(self) -> Chunk | None:
        """A chunk without lines when the position changed (file switch, truncation), else None."""
        head = self._files[0] if self._files else None
        pos = head.position() if head else START
        if pos == self._issued:
            return None
        return self._issue(Chunk(head.name if head else self.label, pos.offset, b"", None, pos))

    def _issue(self, chunk: Chunk) -> Chunk:
        self._issued = chunk.end
        return chunk
