"""Where each collector source is, persisted (sources → here → resume after a restart).

A checkpoint says how far a source's input is *acknowledged downstream* (Kafka acked the messages in the
distributed mode; the store confirmed the insert in the embedded mode), never how far it was merely read:
a source advances its checkpoint from the publisher's ``on_ack`` callback. After a crash a source resumes
from its checkpoint and re-sends what followed; the ingester drops what the store already holds, so the
re-send counts once (docs/reliability.md).

The file is one JSON object ``{key: value}`` (``key`` names the source, e.g. ``gateway_log:/var/log/gw.jsonl``
or ``kv_events:pod-0:0``; ``value`` is the source's own JSON-able position). Every :meth:`CheckpointStore.put`
rewrites it atomically: write a temporary file, ``fsync``, ``rename`` over the old one, ``fsync`` the
directory, so a crash at any instant leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("kvscope.collector")


class CheckpointError(RuntimeError):
    """The checkpoint file exists but cannot be read as JSON (the message names the file)."""


class CheckpointStore:
    """Positions of every source of one collector, in ``path`` (None keeps them in memory only, for
    ``kvscope import`` and tests). Thread safe: sources put from their own threads and from ack callbacks.

    Raises :class:`CheckpointError` at construction when ``path`` holds something that is not a JSON object
    (a collector must not silently start over and re-send weeks of logs); ``OSError`` when it cannot write.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path).expanduser() if path else None
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"checkpoint file {self.path} is unreadable: {exc}; move it away to "
                                      "start over (sources then re-read from their beginning)") from exc
            if not isinstance(data, dict):
                raise CheckpointError(f"checkpoint file {self.path} holds {type(data).__name__}, not an object")
            self._data = data

    def get(self, key: str) -> Any:
        """The position stored under ``key``, or None."""
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (JSON-able) under ``key`` and persist the whole file before returning."""
        with self._lock:
            if self._data.get(key) == value:
                return
            self._data[key] = value
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps(self._data, sort_keys=True, separators=(",", ":")).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
