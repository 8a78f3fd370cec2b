"""Writer of the gateway fingerprint log: one JSON object per line (gateway → collector/gateway_log tailer).

Format: `gateway/gateway_log.v1.schema.json`. Each line is encoded first and then written with a single
`write(2)` on a file opened with O_APPEND, under a lock, so concurrent requests never interleave and a
tailer sees at most one partial line, the one being written. If the file is rotated away (moved or
deleted, e.g. by logrotate), the next line reopens the path.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

LOG_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("gateway_log.v1.schema.json")
REQUIRED_FIELDS: frozenset[str] = frozenset(json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))["required"])


def format_ts(epoch_seconds: float) -> str:
    """RFC 3339 UTC with milliseconds and a Z, e.g. "2026-11-29T12:00:00.123Z" (ms truncated, not rounded)."""
    moment = datetime.fromtimestamp(epoch_seconds, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class GatewayLogWriter:
    """Appends log lines to `path` (created with its parent directory if missing).

    `write(fields)` adds `log_version` and checks that every required field of the schema is present
    (ValueError otherwise; the types are the caller's job and a test validates them against the schema).
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

    def write(self, fields: Mapping[str, Any]) -> str:
        """Append one line for `fields` and return it (without the newline)."""
        record = {"log_version": LOG_VERSION, **fields}
        missing = REQUIRED_FIELDS - record.keys()
        if missing:
            raise ValueError(f"gateway log record lacks required fields: {sorted(missing)}")
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        data = (line + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise ValueError("gateway log writer is closed")
            self._reopen_if_rotated()
            view = memoryview(data)
            while view:  # a regular file takes the whole line in one write; loop for the rare short write
                written = os.write(self._fd, view)
                view = view[written:]
        return line

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
