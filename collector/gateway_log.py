"""Source: the gateway fingerprint log (JSONL, ``gateway/gateway_log.v1.schema.json``) → ``GatewayRequest``
events, one per line, and a ``DeadLetter`` for every line that is not a valid record.

:class:`GatewayLogSource` follows the file through rotations from a checkpoint that advances only when the
caller acknowledges (``collector/file_tail.py``) and only ever consumes complete lines (a line still being
written is left for the next poll). Re-reading lines after a restart is safe: a record's ``event_id`` comes
from its ``request_id`` and ``ts``, so the store collapses the repeat. :func:`read_file` reads a finished file
once (``kvscope import gateway-log``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from collector.checkpoint import CheckpointStore
from collector.events import DeadLetter, Envelope, GatewayRequest, envelope
from collector.file_tail import Chunk, FileFollower, Position

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


class GatewayLogSource:
    """Follows the gateway log at ``path`` from its checkpoint (key ``gateway_log:<path>`` in ``checkpoints``)
    through rotations (:class:`collector.file_tail.FileFollower`).

    ``pod`` names the source in dead letters (records carry their own ``pod``); a line longer than
    ``max_bytes`` is dead-lettered by its head and skipped; ``rotate_wait_seconds``: how long a rotated-away
    file must stay idle before it is dropped. OSError other than a missing file propagates from the
    constructor and :meth:`poll` (the caller retries).
    """

    def __init__(self, path: str | Path, checkpoints: CheckpointStore, *, pod: str = "gateway",
                 max_bytes: int = 8 << 20, rotate_wait_seconds: float = 1.0) -> None:
        self.path = Path(path)
        self.pod = pod
        self.key = f"gateway_log:{path}"
        self._checkpoints = checkpoints
        start = Position.from_json(checkpoints.get(self.key))
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
            events = [line_event(text, pod=self.pod, source_file=chunk.name, offset=off) for off, text in lines]
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
        return envelope(
            dl, pod=self.pod, natural_key=(chunk.name, chunk.start, "long"), observed_at_ms=int(time.time() * 1000)
        )


def read_file(path: str | Path, *, pod: str = "gateway") -> list[Envelope]:
    """All records of a finished log file (``kvscope import gateway-log``); the last line needs no newline."""
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    lines, _ = read_lines(data, 0)
    return [line_event(text, pod=pod, source_file=str(path), offset=off) for off, text in lines]
