"""Source: the gateway fingerprint log (JSONL, ``gateway/gateway_log.v1.schema.json``) → ``GatewayRequest``
events, one per line, and a ``DeadLetter`` for every line that is not a valid record.

:class:`GatewayLogSource` follows the file through rotations from a checkpoint that advances only when the
caller acknowledges (``collector/file_tail.py``) and only ever consumes complete lines (a line still being
written is left for the next poll). Re-reading lines after a restart is safe: a record's ``event_id`` comes
from its ``request_id`` and ``ts``, and a bad line's from the file's key and the line's offset and head
(:func:`file_key`), the same under the rotated file's name, so the store collapses the repeat; two files that
start with the same line have distinct keys, so their bad lines are distinct dead letters. :func:`read_file`
reads a finished file once (``kvscope import gateway-log``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from collector.checkpoint import CheckpointStore
from collector.events import DeadLetter, Envelope, GatewayRequest, envelope
from collector.file_tail import Chunk, FileFollower, Position, start_position
from collector.gateway_record import BadRecord, decode_record, ts_ms

MAX_RAW = 64 * 1024
#: The longest gateway log line read, in bytes without its newline (exclusive): a longer one is dead-lettered by
#: its head, live (GatewayLogSource) and on import (ingest.bulk) alike.
MAX_LINE_BYTES = 8 << 20


def line_event(line: str | bytes, *, pod: str, source_file: str, offset: int, file_key: str | None = None
               ) -> Envelope:
    """One log line → a ``GatewayRequest`` envelope (its record as decoded by
    :func:`collector.gateway_record.decode_record`), or a ``DeadLetter`` envelope with the reason.

    ``source_file`` (the name the line was read under) and ``offset`` (bytes) locate the line; a dead letter's id
    comes from ``file_key`` (default ``source_file``), ``offset`` and the line's head. The live follower passes a
    key that stays the same when the file is renamed or copied (:func:`file_key`), so a line read again after a
    restart from the rotated file, under another name, is the same dead letter."""
    try:
        rec = decode_record(line)
    except BadRecord as exc:
        # the raw line shown beside the reason; U+FFFD here only marks the bytes the reason names
        raw = line if isinstance(line, bytes) else line.encode("utf-8", "replace")
        text = raw.decode("utf-8", "replace")
        dl = DeadLetter(source="gateway_log", reason=str(exc), raw=text[:MAX_RAW], location=f"{source_file}:{offset}")
        return envelope(dl, pod=pod, natural_key=(file_key or source_file, offset, text[:256]),
                        observed_at_ms=int(time.time() * 1000))
    record = msgspec.to_builtins(rec)
    ev = GatewayRequest(record=record, source_file=source_file, line_offset=offset)
    # (request_id, ts): a re-read line keeps its id; a client reusing a request id does not collapse two requests
    return envelope(ev, pod=rec.pod or pod, natural_key=(rec.request_id, record["ts"]), observed_at_ms=ts_ms(rec))


#: What a blank line may hold: JSON's whitespace (RFC 8259 section 2: space, tab, LF, CR). A line of only these is
#: skipped uncounted; any other byte (a vertical tab or form feed, which Python's ``bytes.strip`` would also take for
#: blank) makes it a line to decode, and so a dead letter when it is not a record.
JSON_WHITESPACE = b" \t\n\r"


def read_lines(data: bytes, start_offset: int) -> tuple[list[tuple[int, bytes]], int]:
    """Split ``data`` (read from ``start_offset``) into complete lines: ``([(offset, line)], consumed_bytes)``.

    Bytes after the last newline are not consumed; a carriage return before the newline is dropped; a blank line
    (:data:`JSON_WHITESPACE` only) is left out. Lines stay
    bytes: the record decoder checks their UTF-8 (strictly) and drops a byte order mark.
    """
    out = []
    pos = 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        raw = data[pos:nl]
        if raw.strip(JSON_WHITESPACE):
            out.append((start_offset + pos, raw.rstrip(b"\r")))
        pos = nl + 1
    return out, pos


def file_key(path: str | Path, pos: Position, name: str) -> str:
    """What names one file of the log at ``path`` in its dead letters' ids, whatever it is called now: the log's
    path and the file's key (:attr:`collector.file_tail.Position.key`: its place among the log's files since the
    first one the follower read, which a rename, a copy and a restart from the checkpoint keep, and which differs
    between files that start with the same line or share an inode, e.g. a banner under copytruncate); for that
    first file (``key`` None) its fingerprint (its first line, :func:`collector.file_tail.fingerprint`), as
    earlier versions did; ``name``, the name it was read under, only while it has neither."""
    if pos.key:
        return f"{path}#{pos.key}"
    return f"{path}#{pos.fingerprint}" if pos.fingerprint else name


def checkpoint_key(path: str | Path) -> str:
    """The key of a gateway log's position in the collector's :class:`CheckpointStore`."""
    return f"gateway_log:{path}"


def watch(path: str | Path, checkpoints: CheckpointStore) -> bool:
    """Record that kvscope watches the log at ``path`` from now: when it has no checkpoint yet, checkpoint the
    start of the file the path names (:func:`collector.file_tail.start_position`). Called first thing at
    start-up, before the store opens: a collector killed before its first acknowledgement then still resumes
    from that file, through any rotations since, instead of from whatever file the path names at the next
    start. Returns whether a position was recorded. Raises what :meth:`CheckpointStore.put` raises."""
    if checkpoints.get(checkpoint_key(path)) is not None:
        return False
    pos = start_position(path)
    if pos is None:
        return False
    checkpoints.put(checkpoint_key(path), pos.to_json())
    return True


class GatewayLogSource:
    """Follows the gateway log at ``path`` from its checkpoint (key ``gateway_log:<path>`` in ``checkpoints``)
    through rotations (:class:`collector.file_tail.FileFollower`).

    ``pod`` names the source in dead letters (records carry their own ``pod``); a line longer than
    ``max_bytes`` is dead-lettered by its head and skipped; ``rotate_wait_seconds``: how long a rotated-away
    file must stay idle before it is dropped. OSError other than a missing file propagates from the
    constructor and :meth:`poll` (the caller retries).
    """

    def __init__(self, path: str | Path, checkpoints: CheckpointStore, *, pod: str = "gateway",
                 max_bytes: int = MAX_LINE_BYTES, rotate_wait_seconds: float = 1.0) -> None:
        self.path = Path(path)
        self.pod = pod
        self.key = checkpoint_key(path)
        self._checkpoints = checkpoints
        start = Position.from_json(checkpoints.get(self.key))
        if start is not None and start.at is None and checkpoints.path is not None:
            try:  # a checkpoint of an earlier version: written at the latest when the checkpoint file was
                start = dataclasses.replace(start, at=os.stat(checkpoints.path).st_mtime_ns)
            except OSError:
                pass
        self._follower = FileFollower(path, start, max_bytes=max_bytes, rotate_wait_seconds=rotate_wait_seconds)

    def poll(self) -> tuple[list[Envelope], Callable[[], None] | None]:
        """Envelopes (``GatewayRequest``, or ``DeadLetter`` for bad or too-long lines) of the complete lines
        read since the last poll, all from one file, and the ack that checkpoints the position just after
        them; call it once they are durable downstream, in poll order. ``([], None)`` when nothing changed;
        ``([], ack)`` when only the position moved (a file switch)."""
        chunk = self._follower.read()
        if chunk is None:
            return [], None
        if chunk.long_head is not None:
            events = [self._long_line(chunk)]
        else:
            lines, _ = read_lines(chunk.data, chunk.start)
            key = file_key(self.path, chunk.end, chunk.name)
            events = [line_event(text, pod=self.pod, source_file=chunk.name, offset=off, file_key=key)
                      for off, text in lines]
        value = chunk.end.to_json()
        return events, lambda: self._checkpoints.put(self.key, value)

    def lag_bytes(self) -> int:
        """Bytes written to the log (current and not yet drained rotated files) that are not read yet."""
        return self._follower.lag_bytes()

    def close(self) -> None:
        """Close the open files (idempotent); the checkpoint stays where the last ack put it."""
        self._follower.close()

    def _long_line(self, chunk: Chunk) -> Envelope:
        head = chunk.long_head or b""
        dl = DeadLetter(
            source="gateway_log",
            reason=f"line longer than {self._follower.max_bytes} bytes",
            raw=head[:MAX_RAW].decode("utf-8", "replace"),
            location=f"{chunk.name}:{chunk.start}",
        )
        key = file_key(self.path, chunk.end, chunk.name)
        return envelope(dl, pod=self.pod, natural_key=(key, chunk.start, "long"),
                        observed_at_ms=int(time.time() * 1000))


def read_file(path: str | Path, *, pod: str = "gateway") -> list[Envelope]:
    """All records of a finished log file (``kvscope import gateway-log``); the last line needs no newline."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    lines, _ = read_lines(data, 0)
    return [line_event(text, pod=pod, source_file=str(path), offset=off) for off, text in lines]
