"""Follows one append-only log file across rotations from a durable position (sources → file_tail → events).

:class:`FileFollower` hands out byte ranges of complete lines (:class:`Chunk`), each with the :class:`Position`
just after it; the caller persists that position only once the lines are durable downstream, and a new
follower resumes from it. A file is identified by ``(st_dev, st_ino)`` while it is open, and across restarts
and copies by its *fingerprint*: a hash of its first line (see :func:`fingerprint`), as Vector's file source
does. Handled, without losing a line:

- rename-and-create rotation: the old file stays open and is drained until it has been idle (no growth)
  for ``rotate_wait_seconds``, since a writer may append one last line after the rename; then the new file
  is read from 0;
- copytruncate: the unread tail is read from the sibling copy with our fingerprint; with no copy it is a
  plain truncation and the bytes known to be skipped are counted;
- deletion: the open (unlinked) file is drained, then the path is read from 0 when it reappears;
- a restart after rotations: the checkpointed file is found among the siblings by fingerprint, drained, then
  every sibling written after it (the rotations since the checkpoint, however many) is read whole, oldest
  first, before the current file.

Not handled: a file created and rotated away again between two reads of a running follower is not seen;
compressed rotated files are not read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

log = logging.getLogger("kvscope.collector")

#: The fingerprint covers the first line, or this many bytes of it when it is longer.
FINGERPRINT_BYTES = 4096
#: Rotated files with these suffixes are compressed (logrotate's ``compress``) and never read.
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
_SCAN = 1 << 20

LAG_BYTES = Gauge("kvscope_collector_log_lag_bytes", "Bytes written to the log not yet read", ["path"])
ROTATIONS = Counter("kvscope_collector_log_rotations_total", "Rotations of a followed log file seen, by kind "
                    "(rename, copytruncate, truncate, deleted, resumed_rotated)", ["path", "kind"])
BYTES_LOST = Counter("kvscope_collector_log_bytes_lost_total", "Bytes known to be skipped unread, by reason",
                     ["path", "reason"])
RESUME_MISSES = Counter("kvscope_collector_log_resume_misses_total", "Restarts whose checkpointed file was "
                        "found nowhere (its unread tail may be lost)", ["path"])


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


@dataclass(frozen=True)
class Position:
    """Where a follower stands: ``offset`` bytes (of complete lines) read of the file with ``fingerprint``
    (None while its first line is incomplete) and identity ``dev``/``ino``. ``file`` is informational (the
    name it was read under). :data:`START` means "the start of whatever file the path names"."""

    fingerprint: str | None
    offset: int
    dev: int = 0
    ino: int = 0
    file: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "offset": self.offset, "dev": self.dev, "ino": self.ino,
                "file": self.file}

    @classmethod
    def from_json(cls, value: Any) -> Position | None:
        """The position stored by :meth:`to_json`; None (with a warning) for anything else."""
        if value is None:
            return None
        try:
            fp = value["fingerprint"]
            pos = cls(fp if fp is None else str(fp), int(value["offset"]), int(value.get("dev", 0)),
                      int(value.get("ino", 0)), str(value.get("file", "")))
        except (TypeError, KeyError, ValueError):
            log.warning("log checkpoint is not a position; reading the file from the start. value=%.200r", value)
            return None
        return pos if pos.offset >= 0 else None


START = Position(None, 0)


def start_position(path: str | Path) -> Position | None:
    """The position "nothing read yet" of the file ``path`` names now: offset 0, its fingerprint (None while its
    first line is incomplete) and identity. None when no regular file is there. A follower started from it
    later finds that file again, renamed or copied, and reads every file written after it (:class:`FileFollower`).
    """
    f = FileFollower._open(Path(path))
    if f is None:
        return None
    try:
        return Position(f.current_fp(), 0, *f.ident, file=f.name)
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


class _File:
    """One open file: read position ``offset``, ``fp`` once known, ``seen`` = largest size observed,
    ``detached`` once the path no longer names it (drain, then drop)."""

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
        self.seen = st.st_size
        self.idle_since = time.monotonic()
        self.detached = False

    def size(self) -> int:
        return os.fstat(self.fh.fileno()).st_size

    def pread(self, n: int, at: int) -> bytes:
        return os.pread(self.fh.fileno(), n, at)

    def current_fp(self) -> str | None:
        return fingerprint(self.pread(FINGERPRINT_BYTES, 0))

    def note(self, size: int) -> None:
        """Record the size seen now; growth (or any change) restarts the idle clock."""
        if size != self.seen:
            self.seen = size
            self.idle_since = time.monotonic()

    def position(self) -> Position:
        if self.fp is None and self.offset == 0:
            self.fp = self.current_fp()
        return Position(self.fp, self.offset, *self.ident, file=self.name)

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
        if cur is not None and self._holds(cur, pos):
            cur.offset, cur.fp = pos.offset, pos.fingerprint
            self._files = [cur]
            return
        old = self._find_sibling(pos, exclude=cur.ident if cur else None)
        newer: list[_File] = []
        if old is not None:
            old.offset, old.fp, old.detached = pos.offset, pos.fingerprint, True
            newer = self._newer_siblings(old, exclude=cur.ident if cur else None)
            ROTATIONS.labels(self.label, "resumed_rotated").inc()
            log.info("log was rotated while the collector was down; draining the rotated file first. path=%s "
                     "rotated=%s offset=%d then=%s", self.label, old.name, pos.offset, [f.name for f in newer])
        else:
            RESUME_MISSES.labels(self.label).inc()
            log.error("checkpointed log file not found; lines after its checkpoint may be lost, reading the "
                      "current file from the start. path=%s fingerprint=%s offset=%d inode=%d last_name=%s",
                      self.label, pos.fingerprint, pos.offset, pos.ino, pos.file)
        self._files = [f for f in (old, *newer, cur) if f is not None]

    def _holds(self, f: _File, pos: Position) -> bool:
        """Whether ``f`` is the checkpointed file: same fingerprint (or, while it had none, same inode)
        and at least ``pos.offset`` bytes."""
        same = f.current_fp() == pos.fingerprint if pos.fingerprint else f.ident == (pos.dev, pos.ino)
        return same and f.size() >= pos.offset

    def _find_sibling(self, pos: Position, exclude: tuple[int, int] | None) -> _File | None:
        """The file beside the log (name starting with the log's name) that holds ``pos`` (see
        :meth:`_holds`), other than ``exclude``; the same inode as ``pos`` first, then the largest."""
        found: list[_File] = []
        for entry in self._siblings():
            try:
                f = self._open(Path(entry.path)) if entry.is_file() else None
            except OSError:  # unreadable: not ours to follow
                continue
            if f is not None and f.ident != exclude and self._holds(f, pos):
                found.append(f)
            elif f is not None:
                f.close()
        found.sort(key=lambda f: (f.ident == (pos.dev, pos.ino), f.size()), reverse=True)
        for f in found[1:]:
            f.close()
        return found[0] if found else None

    def _newer_siblings(self, old: _File, exclude: tuple[int, int] | None) -> list[_File]:
        """The rotated files written after ``old`` (the checkpointed file, found rotated away), oldest first:
        siblings modified at or after ``old``'s last write, other than ``old``, ``exclude`` (the current file),
        copies of ``old`` (same first line) and compressed files. When the checkpoint lags the rotations
        (acknowledgements are slower than rotations, or several rotations happened while the collector was
        down), their lines were never acknowledged: each is read whole, after ``old`` and before the current
        file. Rename keeps a file's modification time and a copy gets the copy's time, so both sort after
        ``old``; older rotations sort before it and are not read again."""
        since = os.fstat(old.fh.fileno()).st_mtime_ns
        found: list[tuple[int, str, _File]] = []
        for entry in self._siblings():
            if entry.name.endswith(_COMPRESSED):
                continue
            try:
                f = self._open(Path(entry.path)) if entry.is_file() else None
            except OSError:
                continue
            if f is None:
                continue
            mtime = os.fstat(f.fh.fileno()).st_mtime_ns
            if f.ident in (old.ident, exclude) or mtime < since or (old.fp and f.current_fp() == old.fp):
                f.close()
                continue
            f.detached = True
            found.append((mtime, f.name, f))
        found.sort(key=lambda t: (t[0], t[1]))
        return [f for _, _, f in found]

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
        offset or below a size seen before) or its first line changed (copytruncate or truncation, even if
        it has grown since)."""
        size = f.size()
        if size < max(f.offset, f.seen) or (f.fp is not None and f.current_fp() != f.fp):
            self._truncated(f, size)
            return True
        if f.fp is None and f.offset == 0:
            f.fp = f.current_fp()
        f.note(size)
        return False

    def _truncated(self, f: _File, size_now: int) -> None:
        """Read the unread tail from the copy with our fingerprint, if there is one; then the file from 0."""
        copy = self._find_sibling(Position(f.fp, f.offset), exclude=f.ident) if f.fp else None
        if copy is not None:
            kind, lost = "copytruncate", max(0, f.seen - max(copy.size(), f.offset))
            copy.offset, copy.fp, copy.detached = f.offset, f.fp, True
            self._files.insert(self._files.index(f), copy)
        else:
            kind, lost = "truncate", max(0, f.seen - f.offset)
        ROTATIONS.labels(self.label, kind).inc()
        if lost:
            BYTES_LOST.labels(self.label, kind).inc(lost)
        (log.warning if lost else log.info)(
            "log file truncated; reading the rest from the copy if any, then the file from the start. path=%s "
            "kind=%s offset=%d copy=%s lost_bytes=%d", self.label, kind, f.offset, copy.name if copy else None, lost)
        f.offset, f.fp, f.seen = 0, None, size_now

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
        data, consumed, long_head = got
        start = f.offset
        if start == 0 and f.fp is None:
            f.fp = f.current_fp()
        f.offset += consumed
        return self._issue(Chunk(f.name, start, data, long_head, f.position()))

    def _take(self, f: _File, size: int) -> tuple[bytes, int, bytes | None] | None:
        """``(lines, bytes consumed, long line head)`` available at ``f.offset``, without moving it."""
        if size <= f.offset:
            return None
        raw = f.pread(self.max_bytes, f.offset)
        if f.offset == 0 and f.fp is None:
            f.fp = fingerprint(raw)
        nl = raw.rfind(b"\n")
        if nl >= 0:
            return raw[: nl + 1], nl + 1, None
        final = f.detached and time.monotonic() - f.idle_since >= self.rotate_wait
        if len(raw) >= self.max_bytes:
            end = self._line_end(f, f.offset + len(raw))
            if end is None and final:
                end = f.size()
            return None if end is None else (b"", end - f.offset, raw)
        if final and raw:
            return raw + b"\n", len(raw), None  # the last line of a file that will not grow again
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
        self._files.pop(0).close()
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
