"""Writer of the gateway fingerprint log: one JSON object per line (gateway → collector/gateway_log tailer).

Format: `gateway/gateway_log.v1.schema.json`. Lines are encoded first and then written with a single
`write(2)` of whole lines on a file opened with O_APPEND, under a lock, so concurrent requests never
interleave and a tailer sees at most one partial line, the last of the write in progress. If the file is
rotated away (moved or deleted, e.g. by logrotate), the next write reopens the path.

`GatewayLogWriter.write` writes on the caller's thread; `BackgroundLogWriter.submit` (what the gateway
uses) only enqueues, and a writer thread encodes and writes the queued records in batches.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import Counter

LOG_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("gateway_log.v1.schema.json")
REQUIRED_FIELDS: frozenset[str] = frozenset(json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))["required"])
RECORDS_DROPPED = Counter(
    "kvscope_gateway_log_records_dropped_total",
    "Fingerprint log records not written, by reason (queue_full: the writer thread fell behind by a whole "
    "queue; unencodable: not JSON-serializable; write_failed: the file system refused the batch)",
    ["reason"],
)
log = logging.getLogger("kvscope.gateway.log")
# json.dumps(record, ensure_ascii=False, separators=(",", ":")) without building an encoder per line
_encode_line = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


# (datetime of a whole second, its "%Y-%m-%dT%H:%M:%S." text): the last second formatted, replaced whole (a
# tuple, so a thread never sees one second's datetime with another's text)
_ts_second: tuple[datetime | None, str] = (None, "")


def format_ts(epoch_seconds: float) -> str:
    """RFC 3339 UTC with milliseconds and a Z, e.g. "2026-11-29T12:00:00.123Z" (ms truncated, not rounded)."""
    global _ts_second
    moment = datetime.fromtimestamp(epoch_seconds, tz=UTC)
    micro = moment.microsecond
    second = moment.replace(microsecond=0) if micro else moment
    memo = _ts_second  # requests arrive many per second: strftime (~2 µs) once per second
    if memo[0] != second:
        memo = _ts_second = (second, second.strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{memo[1]}{micro // 1000:03d}Z"


class GatewayLogWriter:
    """Appends log lines to `path` (created with its parent directory if missing).

    `write(fields)` adds `log_version` and checks that every required field of the schema is present
    (ValueError otherwise; the types are the caller's job and a test validates them against the schema;
    the whole contract, what readers refuse and cap, is docs/gateway-log.md).
    OSError from the file system propagates. Thread safe; `close()` is idempotent.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        st = os.fstat(self._fd)
        self._inode = (st.st_dev, st.st_ino)

    def _reopen_if_rotated(self) -> None:
        try:
            st = os.stat(self.path)
            rotated = (st.st_dev, st.st_ino) != self._inode
        except FileNotFoundError:
            rotated = True
        if rotated:
            if self._fd is not None:
                os.close(self._fd)
            self._open()

    @staticmethod
    def encode(fields: Mapping[str, Any]) -> str:
        """The line for `fields` (without the newline): `log_version` added, required fields checked
        (ValueError), compact JSON in UTF-8 (TypeError for values JSON cannot hold)."""
        record = {"log_version": LOG_VERSION, **fields}
        missing = REQUIRED_FIELDS - record.keys()
        if missing:
            raise ValueError(f"gateway log record lacks required fields: {sorted(missing)}")
        return _encode_line(record)

    def append(self, data: bytes) -> None:
        """Append `data` (whole lines, each ending in a newline) with one `write(2)`; reopens the path
        first if the file was rotated away. ValueError once closed."""
        with self._lock:
            if self._fd is None:
                raise ValueError("gateway log writer is closed")
            self._reopen_if_rotated()
            view = memoryview(data)
            while view:  # a regular file takes the whole batch in one write; loop for the rare short write
                written = os.write(self._fd, view)
                view = view[written:]

    def write(self, fields: Mapping[str, Any]) -> str:
        """Append one line for `fields` and return it (without the newline)."""
        line = self.encode(fields)
        self.append((line + "\n").encode("utf-8"))
        return line

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class BackgroundLogWriter:
    """The gateway's log writer: `submit(fields)` enqueues a record and returns at once; a daemon thread
    encodes the queued records and appends them in batches (one `write(2)` of whole lines per batch, via a
    `GatewayLogWriter`, so O_APPEND and rotation handling are the same).

    `submit` checks the required fields at once (ValueError) and never blocks: when `max_queue` records
    are already waiting, the record is dropped, counted in `kvscope_gateway_log_records_dropped_total
    {reason="queue_full"}` and logged (at most once a second). The thread waits `linger_seconds` after
    the first record of a batch so that a busy gateway writes fewer, larger batches; a batch holds at most
    `max_batch_bytes` of lines. `flush()` waits until everything submitted so far is written; `close()`
    flushes, stops the thread and closes the file (idempotent). Records submitted after `close()` are
    written synchronously. `written` and `dropped` count records since creation. Thread safe.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        max_queue: int = 20_000,
        linger_seconds: float = 0.002,
        max_batch_bytes: int = 1 << 20,
    ) -> None:
        self._writer = GatewayLogWriter(path)
        self.path = self._writer.path
        self.max_queue = max_queue
        self.linger_seconds = linger_seconds
        self.max_batch_bytes = max_batch_bytes
        self._queue: collections.deque[Mapping[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._submitted = 0
        self._done = 0  # records written or dropped by the thread
        self._closing = False
        self._closed = False
        self._last_drop_log = 0.0
        self.written = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvscope-gateway-log", daemon=True)
        self._thread.start()

    def submit(self, fields: Mapping[str, Any]) -> bool:
        """Queue one record; False when it was dropped because the queue is full."""
        missing = REQUIRED_FIELDS - fields.keys() - {"log_version"}
        if missing:
            raise ValueError(f"gateway log record lacks required fields: {sorted(missing)}")
        with self._lock:
            late = self._closing
            full = not late and len(self._queue) >= self.max_queue
            if not late and not full:
                self._queue.append(fields)
                self._submitted += 1
        if late:
            self._write_late(fields)
            return True
        if full:
            self._drop("queue_full", 1)
            return False
        if not self._wake.is_set():
            self._wake.set()
        return True

    def write(self, fields: Mapping[str, Any]) -> None:
        """Alias of `submit` (the GatewayLogWriter name), for callers that do not care about drops."""
        self.submit(fields)

    def _drop(self, reason: str, count: int) -> None:
        self.dropped += count
        RECORDS_DROPPED.labels(reason).inc(count)
        now = time.monotonic()
        if now - self._last_drop_log >= 1.0:
            self._last_drop_log = now
            log.error(
                "fingerprint log records dropped. reason=%s count=%d dropped_total=%d path=%s",
                reason, count, self.dropped, self.path,
            )

    def _write_late(self, fields: Mapping[str, Any]) -> None:
        late = GatewayLogWriter(self.path)
        try:
            late.write(fields)
        finally:
            late.close()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self.linger_seconds and not self._closing:
                time.sleep(self.linger_seconds)
            self._wake.clear()
            while self._queue:
                try:
                    self._write_batch()
                except Exception:  # keep the thread alive whatever happens to one batch
                    log.exception("fingerprint log writer: unexpected error")
            if self._closing and not self._queue:
                return

    def _write_batch(self) -> None:
        parts: list[bytes] = []
        size = taken = 0
        queue = self._queue
        while queue and size < self.max_batch_bytes:
            fields = queue.popleft()
            taken += 1
            try:
                data = (GatewayLogWriter.encode(fields) + "\n").encode("utf-8")
            except (TypeError, ValueError):
                log.exception("fingerprint log record not encodable; dropped")
                self._drop("unencodable", 1)
                continue
            parts.append(data)
            size += len(data)
        try:
            if parts:
                self._writer.append(b"".join(parts))
                self.written += len(parts)
        except OSError:
            log.exception("fingerprint log batch not written. lines=%d path=%s", len(parts), self.path)
            self._drop("write_failed", len(parts))
        with self._idle:
            self._done += taken
            self._idle.notify_all()

    def flush(self, timeout_seconds: float | None = None) -> bool:
        """Wait until every record submitted before this call is written (or dropped); False on timeout."""
        target = self._submitted
        self._wake.set()
        with self._idle:
            return self._idle.wait_for(lambda: self._done >= target or not self._thread.is_alive(), timeout_seconds)

    def close(self, timeout_seconds: float = 30.0) -> None:
        """Write what is queued, stop the thread and close the file."""
        if self._closed:
            return
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout_seconds)
        if self._thread.is_alive():
            log.error("fingerprint log writer did not drain in %.0f s. queued=%d", timeout_seconds, len(self._queue))
        self._closed = True
        self._writer.close()
