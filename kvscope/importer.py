"""Direct loading of events into the store without a transport (``kvscope import ...``), with the live
path's isolation: a refused envelope is dead-lettered with its reason and the rest is written."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from collector.events import DeadLetter, Envelope
from collector.gateway_record import EARLIEST, LATEST
from collector.publish import Message, to_messages
from collector.vllm_metrics import DEFAULT_LIMITS, MAX_RAW, LabelLimits, dead_letter_event, scrape_events
from ingest.ingester import Ingester
from ingest.retention import Retentions
from ingest.store import Store

#: The first two bytes of a gzip file (RFC 1952, 2.3.1).
GZIP_MAGIC = b"\x1f\x8b"


class CompressedFile(ValueError):
    """A file to import that is gzip-compressed (rotated logs often are): refused whole, nothing written."""


def source_path(path: str | Path) -> Path:
    """The one spelling of an imported file that its dead letters are keyed by (so a re-import adds none), as text
    the store can hold: the path resolved, symbolic links followed; a pipe given as a path (``<(zcat log.gz)``,
    /dev/stdin) resolves to no file (``/proc/PID/fd/pipe:[N]``), so it is kept as given, made absolute. Bytes of
    the name that are not UTF-8 are written ``\\xff`` (:func:`utf8_text`): a name is bytes on Linux, and such a
    name failed every insert of the file's dead letters. A key, not a path to open."""
    path = Path(path)
    resolved = path.resolve()
    return Path(utf8_text(str(resolved if resolved.exists() else Path(os.path.abspath(path)))))


def utf8_text(name: str) -> str:
    """``name`` (a file name or argument, whose bytes that are not UTF-8 Python holds as lone surrogates) as valid
    UTF-8 text, those bytes written ``\\xff``."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def refuse_gzip(head: bytes, path: Path, what: str) -> None:
    """Raise :class:`CompressedFile` (one line naming ``path`` and ``what`` the file should be) when ``head``, the
    file's first bytes, are gzip's."""
    if head[:2] == GZIP_MAGIC:
        raise CompressedFile(f"{path}: gzip-compressed bytes, not {what}: decompress it first (gunzip), or "
                             "import <(zcat FILE)")


class _NoSource:
    """The ingester's source when the messages are handed to it directly: nothing to poll or commit."""

    def poll(self, timeout_ms: int = 0, max_messages: int = 0) -> list[Message]:
        return []

    def commit(self, messages: list[Message]) -> None:
        pass

    def rewind(self, messages: list[Message]) -> None:
        pass

    def close(self) -> None:
        pass


def ingest_events(store: Store, events: list[Envelope]) -> Ingester:
    """Insert envelopes as the ingester would; returns the ingester (its ``rows_written`` and
    ``rows_conflicting`` per table tell what it did)."""
    ingester = Ingester(store, _NoSource())
    ingester.handle(to_messages(events))
    return ingester


def import_events(store: Store, events: list[Envelope]) -> dict[str, int]:
    """Insert envelopes as the ingester would; returns the rows actually written per table."""
    return dict(ingest_events(store, events).rows_written)


@dataclass(frozen=True)
class MetricsImport:
    """What ``kvscope import metrics`` loaded: ``series`` (rows written to vllm_metrics), ``configs`` (rows
    written to vllm_cache_config), ``reasons`` (the reason of each dead letter, in order)."""

    series: int
    configs: int
    reasons: list[str]

    @property
    def loaded(self) -> bool:
        """Whether anything but dead letters was written."""
        return self.series + self.configs > 0


def import_metrics(store: Store, pod: str, path: Path, raw: bytes, at_ms: int,
                   limits: LabelLimits = DEFAULT_LIMITS) -> MetricsImport:
    """Load one ``/metrics`` body (``raw``, the file's bytes) as a scrape of ``pod`` at ``at_ms`` (unix ms).

    A lone snapshot is a baseline (:func:`collector.vllm_metrics.scrape_events`: gauges and the cache config;
    counters need a previous scrape). Refused whole, as one dead letter with its reason: gzip bytes, bytes
    that are not UTF-8 (a UTF-8 BOM is dropped), an ``at_ms`` outside 2000..2100 UTC or older than
    vllm_metrics' retention (ClickHouse would drop the rows at insert; :mod:`ingest.retention`), and a second
    scrape of ``pod`` at ``at_ms`` when the store holds one (the first is kept: one scrape per pod and
    instant, so a query's "latest value" has one answer). Every other bad input is dead-lettered as the live
    collector does, a sample over ``limits`` too (:class:`collector.vllm_metrics.LabelLimits`). Raises what
    :meth:`Store.query_rows` raises.
    """
    url = f"file://{source_path(path)}"
    problem, body = "", ""
    if raw[:2] == GZIP_MAGIC:
        problem = "gzip-compressed bytes, not Prometheus text: decompress the file first (gunzip)"
    else:
        try:
            body = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            problem = f"not UTF-8 text ({exc.reason} at byte {exc.start}): a /metrics body is UTF-8"
    retention = Retentions(store).get("vllm_metrics")
    at = datetime.fromtimestamp(at_ms / 1000, UTC)
    if not problem and not EARLIEST <= at < LATEST:
        problem = (f"scrape time {at.isoformat()} is outside {EARLIEST.year}..{LATEST.year} (UTC), the times kvscope "
                   "stores (ClickHouse's DateTime, which the retention and the rollups use, ends in 2106)")
    if not problem and retention is not None and retention.expired(at):
        problem = retention.reason(at)
    if not problem and _scrape_stored(store, pod, at_ms):
        problem = (f"the store already holds a scrape of pod {pod!r} at this time: a second scrape of one pod at "
                   "one instant is refused (the first is kept); give another --at")
    if problem:
        text = raw[:MAX_RAW].decode("utf-8", "backslashreplace")
        events = [dead_letter_event(pod, url, at_ms, text, problem)]
    else:
        events = scrape_events(pod, url, body, at_ms, 0.0, limits=limits)
    written = import_events(store, events)
    reasons = [e.payload.reason for e in events if isinstance(e.payload, DeadLetter)]
    return MetricsImport(written.get("vllm_metrics", 0), written.get("vllm_cache_config", 0), reasons)


def _scrape_stored(store: Store, pod: str, at_ms: int) -> bool:
    ts = datetime.fromtimestamp(at_ms / 1000, UTC)
    rows = store.query_rows(
        "SELECT 1 FROM vllm_metrics WHERE pod = {pod:String} AND ts = {ts:DateTime64(3, 'UTC')} LIMIT 1 "
        "UNION ALL SELECT 1 FROM vllm_cache_config WHERE pod = {pod:String} AND ts = {ts:DateTime64(3, 'UTC')} "
        "LIMIT 1", {"pod": pod, "ts": ts})
    return bool(rows)
