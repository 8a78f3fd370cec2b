"""Source: the gateway fingerprint log (JSONL, ``gateway/gateway_log.v1.schema.json``) → ``GatewayRequest``
events, one per line, and a ``DeadLetter`` for every line that is not a valid record.

:class:`LogTailer` follows a file from a byte offset and only ever consumes complete lines (a line still
being written is left for the next poll). Re-reading a file after a restart is safe: a record's
``event_id`` comes from its ``request_id`` and ``ts``, so the store collapses the repeat.
"""

from __future__ import annotations

import json
import math
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
#: Integer fields and their largest value (the ClickHouse column types of gateway_requests).
INT_FIELDS = {
    "prompt_tokens": 2**32 - 1,
    "cached_tokens": 2**32 - 1,
    "completion_tokens": 2**32 - 1,
    "status": 2**16 - 1,
    "system_tokens": 2**32 - 1,
    "tools_tokens": 2**32 - 1,
    "retrieval_tokens": 2**32 - 1,
    "history_tokens": 2**32 - 1,
    "suffix_tokens": 2**32 - 1,
}
FLOAT_FIELDS = ("ttft_ms", "e2e_ms", "queue_wait_ms", "tool_latency_ms")
STR_FIELDS = (
    "tenant_id",
    "conversation_id",
    "agent_run_id",
    "model",
    "pod",
    "endpoint",
    "routing_policy",
    "routing_reason",
    "error",
)


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
    for key, top in INT_FIELDS.items():
        v = obj.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top):
            raise BadRecord(f"field {key} must be an integer in [0, {top}], got {str(v)[:40]}")
    for key in FLOAT_FIELDS:
        v = obj.get(key)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e15 or not math.isfinite(v)
        ):
            raise BadRecord(f"field {key} must be a finite non-negative number of ms, got {str(v)[:40]}")
    for key in STR_FIELDS:
        v = obj.get(key)
        if v is not None and not isinstance(v, str):
            raise BadRecord(f"field {key} must be a string, got {type(v).__name__}")
    if "stream" in obj and not isinstance(obj["stream"], bool):
        raise BadRecord(f"field stream must be true or false, got {str(obj['stream'])[:40]}")
    if obj["cached_tokens"] > obj["prompt_tokens"]:
        raise BadRecord(f"cached_tokens {obj['cached_tokens']} exceeds prompt_tokens {obj['prompt_tokens']}")
    if not 946684800000 <= parse_ts_ms(obj["ts"]) < 4102444800000:
        raise BadRecord(f"ts {obj['ts']!r} is outside 2000..2100")
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError) as exc:
        raise BadRecord(f"record is not valid UTF-8 text: {exc}") from exc
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
    except (BadRecord, RecursionError, OverflowError, UnicodeError) as exc:
        dl = DeadLetter(source="gateway_log", reason=str(exc), raw=line[:MAX_RAW], location=f"{source_file}:{offset}")
        return envelope(dl, pod=pod, natural_key=(source_file, offset, line[:256]), observed_at_ms=now_ms)
    ev = GatewayRequest(record=rec, source_file=source_file, line_offset=offset)
    # (request_id, ts): a re-read line keeps its id; a client reusing a request id does not collapse two requests
    return envelope(
        ev,
        pod=str(rec.get("pod", pod)),
        natural_key=(rec["request_id"], rec["ts"]),
        observed_at_ms=parse_ts_ms(rec["ts"]),
    )


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
        if not lines and consumed == 0 and len(data) >= self.max_bytes:
            skipped = self._skip_long_line(data)
            return [skipped] if skipped else []
        events = [line_event(text, pod=self.pod, source_file=str(self.path), offset=off) for off, text in lines]
        self.offset += consumed
        return events

    def _skip_long_line(self, head: bytes) -> Envelope | None:
        """A line longer than ``max_bytes``: dead-letter its head and move past its newline; None while the
        line is still being written."""
        start = self.offset
        with open(self.path, "rb") as fh:
            fh.seek(start + len(head))
            pos = start + len(head)
            while chunk := fh.read(1 << 20):
                nl = chunk.find(b"\n")
                if nl >= 0:
                    self.offset = pos + nl + 1
                    break
                pos += len(chunk)
        if self.offset == start:
            return None
        dl = DeadLetter(
            source="gateway_log",
            reason=f"line longer than {self.max_bytes} bytes",
            raw=head[:MAX_RAW].decode("utf-8", "replace"),
            location=f"{self.path}:{start}",
        )
        return envelope(
            dl, pod=self.pod, natural_key=(str(self.path), start, "long"), observed_at_ms=int(time.time() * 1000)
        )


def read_file(path: str | Path, *, pod: str = "gateway") -> list[Envelope]:
    """All records of a finished log file (``kvscope import gateway-log``); the last line needs no newline."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    lines, _ = read_lines(data, 0)
    return [line_event(text, pod=pod, source_file=str(path), offset=off) for off, text in lines]
