"""Source: the gateway fingerprint log (JSONL, ``gateway/gateway_log.v1.schema.json``) → ``GatewayRequest``
events, one per line, and a ``DeadLetter`` for every line that is not a valid record.

:class:`LogTailer` follows a file from a byte offset and only ever consumes complete lines (a line still
being written is left for the next poll). Re-reading a file after a restart is safe: a record's
``event_id`` comes from its ``request_id`` and ``ts``, so the store collapses the repeat.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from collector.events import DeadLetter, Envelope, GatewayRequest, envelope

MAX_RAW = 64 * 1024

#: Fields the ingester needs with their JSON types; the rest of the schema is optional on read.
REQUIRED: dict[str, type | tuple[type, ...]] = {
    "request_id": str,
    "ts": str,
    "prompt_tokens": int,
    "cached_tokens": int,
}
INT_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "status", "system_tokens", "tools_tokens",
              "retrieval_tokens", "history_tokens", "suffix_tokens")


class BadRecord(ValueError):
    """A log line that is not a usable gateway record; the message is the dead-letter reason."""


def parse_ts_ms(ts: str) -> int:
    """RFC 3339 timestamp (``2026-11-29T12:00:00.123Z``) → unix ms. Raises :class:`BadRecord`."""
    try:
        dt = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError as exc:
        raise BadRecord(f"ts {ts!r} is not an RFC 3339 timestamp") from exc
    if dt.tzinfo is None:
        raise BadRecord(f"ts {ts!r} has no time zone")
    return int(dt.timestamp() * 1000)


def validate_record(obj: Any) -> dict[str, Any]:
    """Check one decoded line; returns it unchanged. Raises :class:`BadRecord` with the reason."""
    if not isinstance(obj, dict):
        raise BadRecord(f"line is JSON {type(obj).__name__}, not an object")
    for key, typ in REQUIRED.items():
        if key not in obj:
            raise BadRecord(f"missing field {key}")
        if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
            raise BadRecord(f"field {key} is {type(obj[key]).__name__}, expected {typ.__name__}")  # type: ignore[union-attr]
    if not obj["request_id"]:
        raise BadRecord("empty request_id")
    for key in INT_FIELDS:
        v = obj.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise BadRecord(f"field {key} must be a non-negative integer, got {v!r}")
    if obj["cached_tokens"] > obj["prompt_tokens"]:
        raise BadRecord(f"cached_tokens {obj['cached_tokens']} exceeds prompt_tokens {obj['prompt_tokens']}")
    parse_ts_ms(obj["ts"])
    return obj


def line_event(line: str, *, pod: str, source_file: str, offset: int) -> Envelope:
    """One log line → a ``GatewayRequest`` envelope, or a ``DeadLetter`` envelope with the reason."""
    now_ms = int(time.time() * 1000)
    try:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadRecord(f"not JSON: {exc.msg} at column {exc.colno}") from exc
        rec = validate_record(obj)
    except BadRecord as exc:
        dl = DeadLetter(source="gateway_log", reason=str(exc), raw=line[:MAX_RAW], location=f"{source_file}:{offset}")
        return envelope(dl, pod=pod, natural_key=(source_file, offset, line[:256]), observed_at_ms=now_ms)
    ev = GatewayRequest(record=rec, source_file=source_file, line_offset=offset)
    # (request_id, ts): a re-read line keeps its id; a client reusing a request id does not collapse two requests
    return envelope(ev, pod=str(rec.get("pod", pod)), natural_key=(rec["request_id"], rec["ts"]),
                    observed_at_ms=parse_ts_ms(rec["ts"]))


def read_lines(data: bytes, start_offset: int) -> tuple[list[tuple[int, str]], int]:
    """Split ``data`` (read from ``start_offset``) into complete lines: ``([(offset, text)], consumed_bytes)``.

    Bytes after the last newline are not consumed. Invalid UTF-8 is replaced (and then fails JSON parsing).
    """
    out = []
    pos = 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        raw = data[pos:nl]
        if raw.strip():
            out.append((start_offset + pos, raw.decode("utf-8", errors="replace")))
        pos = nl + 1
    return out, pos


class LogTailer:
    """Follows one JSONL file. ``poll()`` returns the envelopes of the complete lines written since last time.

    A file that shrinks (truncated or replaced) is read again from the start. ``pod`` names the source in
    dead letters (the gateway); records carry their own ``pod``.
    """

    def __init__(self, path: str | Path, *, pod: str = "gateway", offset: int = 0, max_bytes: int = 8 << 20):
        self.path = Path(path)
        self.pod = pod
        self.offset = offset
        self.max_bytes = max_bytes
        self._inode: int | None = None

    def poll(self) -> list[Envelope]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self.offset):
            self.offset = 0
        self._inode = st.st_ino
        if st.st_size <= self.offset:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read(self.max_bytes)
        lines, consumed = read_lines(data, self.offset)
        self.offset += consumed
        return [line_event(text, pod=self.pod, source_file=str(self.path), offset=off) for off, text in lines]


def read_file(path: str | Path, *, pod: str = "gateway") -> list[Envelope]:
    """All records of a finished log file (``kvscope import gateway-log``); the last line needs no newline."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    lines, _ = read_lines(data, 0)
    return [line_event(text, pod=pod, source_file=str(path), offset=off) for off, text in lines]
