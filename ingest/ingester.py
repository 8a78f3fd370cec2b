"""The ingester: transport messages → rows → ClickHouse, committing the source only after the insert.

At-least-once, visibly (STYLE.md §4): a batch is polled, decoded, mapped and inserted table by table; only
then is the source committed. A store outage (retryable) keeps the batch and backs off; rows the store
refuses (permanent) are isolated by halving the batch and dead-lettered with the reason, then the rest is
written and committed. Re-delivered messages carry the same ``event_id`` and collapse in the
ReplacingMergeTree tables.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from prometheus_client import Counter

from collector.events import ContractError, decode_batch, encode_batch
from collector.publish import Message
from ingest.errors import ContractViolation, RejectedRows, RetryableError
from ingest.rows import COLUMNS, contract_dead_letter, rows_for
from ingest.source import Source
from ingest.store import Store

log = logging.getLogger("kvscope.ingest")

ROWS_WRITTEN = Counter("kvscope_ingest_rows_written", "Rows inserted into ClickHouse", ["table"])
DEAD_LETTERS = Counter("kvscope_dead_letters", "Inputs dead-lettered, by source", ["source"])
INGEST_ERRORS = Counter("kvscope_ingest_errors", "Ingest failures by kind", ["kind"])


def _rows_of(messages: list[Message]) -> dict[str, list[tuple[Any, ...]]]:
    tables: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for m in messages:
        location = f"{m.topic}:{m.partition}:{m.offset}"
        pod = m.key.decode("utf-8", "replace")
        try:
            events = decode_batch(m.value)
        except (ContractError, RecursionError) as exc:
            tables["dead_letters"].append(contract_dead_letter(str(exc)[:1000], location, m.value, pod))
            continue
        for ev in events:
            try:
                table, rows = rows_for(ev)
            except ContractViolation as exc:
                tables["dead_letters"].append(contract_dead_letter(exc.reason, location, encode_batch([ev]), ev.pod))
                continue
            tables[table].extend(rows)
    return tables


def _single_envelopes(message: Message) -> list[Message]:
    """One message per envelope of ``message`` (to find the envelope the store refused)."""
    return [Message(message.topic, message.key, encode_batch([ev]), message.partition, message.offset)
            for ev in decode_batch(message.value)]


class Ingester:
    """Moves messages from a :class:`Source` into a :class:`Store`.

    ``run_once`` handles one polled batch and returns the number of messages handled; ``run`` loops until
    ``stop`` is set. Raises nothing for bad data; a store outage is retried with backoff up to
    ``max_backoff_seconds`` between tries, forever (the batch is never dropped).
    """

    def __init__(self, store: Store, source: Source, *, max_messages: int = 500, poll_timeout_ms: int = 500,
                 max_backoff_seconds: float = 30.0) -> None:
        self.store = store
        self.source = source
        self.max_messages = max_messages
        self.poll_timeout_ms = poll_timeout_ms
        self.max_backoff_seconds = max_backoff_seconds
        self.messages_handled = 0
        self.rows_written: dict[str, int] = defaultdict(int)  # table → rows inserted by this ingester

    def _insert(self, messages: list[Message]) -> None:
        tables = _rows_of(messages)
        for table in sorted(tables, key=lambda t: t == "dead_letters"):
            rows = tables[table]
            self.store.insert(table, rows, COLUMNS[table])
            ROWS_WRITTEN.labels(table).inc(len(rows))
            self.rows_written[table] += len(rows)
            if table == "dead_letters":
                for r in rows:
                    DEAD_LETTERS.labels(r[2]).inc()

    def _insert_isolating(self, messages: list[Message]) -> None:
        try:
            self._insert(messages)
        except RejectedRows as exc:
            if len(messages) > 1:
                mid = len(messages) // 2
                self._insert_isolating(messages[:mid])
                self._insert_isolating(messages[mid:])
                return
            m = messages[0]
            singles = _single_envelopes(m)
            if len(singles) > 1:  # one refused envelope must not take the rest of its message with it
                for single in singles:
                    self._insert_isolating([single])
                return
            INGEST_ERRORS.labels("rejected").inc()
            log.error("store refused a message; dead-lettered. table=%s reason=%s", exc.table, exc)
            row = contract_dead_letter(f"store refused rows for {exc.table}: {exc}",
                                       f"{m.topic}:{m.partition}:{m.offset}", m.value, m.key.decode())
            self.store.insert("dead_letters", [row], COLUMNS["dead_letters"])
            DEAD_LETTERS.labels("ingest").inc()

    def handle(self, messages: list[Message], stop: threading.Event | None = None) -> None:
        """Insert ``messages`` (retrying store outages) and then commit the source."""
        backoff = 0.5
        while True:
            try:
                self._insert_isolating(messages)
                break
            except RetryableError as exc:
                INGEST_ERRORS.labels("store_unavailable").inc()
                log.warning("store unavailable, keeping the batch. retry_in_s=%.1f error=%s", backoff, exc)
                if stop is not None and stop.wait(backoff):
                    raise
                time.sleep(0 if stop is not None else backoff)
                backoff = min(backoff * 2, self.max_backoff_seconds)
        self.source.commit()
        self.messages_handled += len(messages)

    def run_once(self, stop: threading.Event | None = None) -> int:
        messages = self.source.poll(self.poll_timeout_ms, self.max_messages)
        if messages:
            self.handle(messages, stop)
        return len(messages)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once(stop)
            except RetryableError as exc:
                INGEST_ERRORS.labels("source_unavailable").inc()
                log.warning("source unavailable. error=%s", exc)
                stop.wait(1.0)
            except Exception:  # a bug must not stop ingestion for good; the batch is not committed
                INGEST_ERRORS.labels("unexpected").inc()
                log.exception("ingest batch failed unexpectedly; an operator must look (uncommitted, retried)")
                stop.wait(5.0)
