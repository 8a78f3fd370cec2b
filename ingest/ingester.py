"""The ingester: transport messages → rows → ClickHouse, committing the source only after the insert.

At-least-once delivery, exactly-once rows (docs/reliability.md):
- A polled batch is decoded and mapped to rows per table; each table's rows are checked against the store
  (:mod:`ingest.dedup`: what it already holds is dropped) and inserted; only then are the batch's own offsets
  committed (explicit per-partition offsets, never the consumer's position).
- Any failure that may pass (the store or broker away, a timeout, a memory limit, an unexpected exception,
  which is a bug but must not lose data) keeps the batch: the source is rewound to it and the batch is
  retried with exponential backoff and jitter, and counted. The dedup check makes a retry of a half-landed
  batch insert only what is missing. While the store is away (it does not answer ``SELECT 1``) or the error is
  one of load (a timeout, a memory limit, too many parts or queries: :data:`TRANSIENT_CODES`) the batch is
  retried forever. A batch that fails otherwise ``max_poison_attempts`` times in a row while the store answers
  (an error the data causes that the store does not report as a data error, a bug on one envelope) would block
  its partition forever: it is then written envelope by envelope, and each envelope that still fails so is a
  dead letter with the error (``kvscope_ingest_errors_total{kind="poison"}``); the rest lands and the batch is
  committed.
- Only data errors (:data:`ingest.store.DATA_ERROR_CODES`, values the client cannot serialise) are permanent:
  the refused table's rows are halved until the refused row is alone; it goes to ``dead_letters`` with the
  store's reason, and everything else of the batch lands. Tables that already landed are not re-inserted.
- The dead letters the ingester makes for an envelope (it maps to no row, its rows are older than the
  retention, the store refuses one as data) take their ids from what they hold, never from the message's
  partition and offset: a collector's re-send of the envelope lands at another offset and must add none.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Gauge

from collector.events import BadEnvelope, ContractError, Envelope, decode_batch, decode_parts, encode_batch
from collector.gateway_record import LATEST
from collector.publish import Message
from ingest.dedup import IDENTITY, check_rows, conflict_reason
from ingest.errors import ContractViolation, RejectedRows, RetryableError
from ingest.kv_pieces import trim_kv_rows
from ingest.retention import Retentions
from ingest.rows import COLUMNS, contract_dead_letter, rows_for
from ingest.source import Source
from ingest.store import Store, error_code

#: ClickHouse error codes of load or of the schema, not of the data: a failure with one of these is retried
#: forever, never counted towards dead-lettering a batch (timeouts 159, 209, 210; too many simultaneous queries
#: 202; memory limit 241, 242; too many parts 252; system error 425; a table, database or column missing during a
#: migration 60, 81, 16, 47). Source: ClickHouse src/Common/ErrorCodes.cpp.
TRANSIENT_CODES = frozenset({16, 47, 60, 81, 159, 202, 209, 210, 241, 242, 252, 425})

log = logging.getLogger("kvscope.ingest")

ROWS_WRITTEN = Counter("kvscope_ingest_rows_written", "Rows inserted into ClickHouse", ["table"])
ROWS_DUPLICATE = Counter("kvscope_ingest_rows_duplicate", "Rows dropped because the store already held them "
                         "(redelivery, a collector re-send, a re-import)", ["table"])
DEAD_LETTERS = Counter("kvscope_dead_letters", "Inputs dead-lettered, by source", ["source"])
INGEST_ERRORS = Counter("kvscope_ingest_errors", "Ingest failures by kind", ["kind"])
ROWS_CONFLICTING = Counter("kvscope_ingest_rows_conflicting", "Rows not inserted because the store (or an earlier "
                           "row of the batch) holds their identity with other values; dead-lettered", ["table"])
ROWS_EXPIRED = Counter("kvscope_ingest_rows_expired", "Rows not inserted because they are already older than their "
                       "table's retention (ClickHouse would drop them at insert); dead-lettered", ["table"])
RETRIES = Counter("kvscope_ingest_retries", "Batches retried after a failure that may pass, by reason", ["reason"])
BATCH_BACKOFF = Gauge("kvscope_ingest_backoff_seconds", "Current wait before retrying the held batch (0 = none)")


@dataclass(frozen=True)
class Origin:
    """Where a row came from: the message's location and pod (for its dead letter), and ``group``, the
    envelope's number within the batch (rows of one envelope land or are skipped together)."""

    location: str
    pod: str
    group: int


def _rows_of(messages: list[Message]) -> dict[str, list[tuple[tuple[Any, ...], Origin]]]:
    """Rows per table, each with its origin; undecodable messages and unmappable envelopes become
    dead-letter rows here (contract violations are permanent)."""
    tables: dict[str, list[tuple[tuple[Any, ...], Origin]]] = defaultdict(list)
    group = 0
    for m in messages:
        location = f"{m.topic}:{m.partition}:{m.offset}"
        pod = m.key.decode("utf-8", "replace")
        try:
            events: list[Envelope] = decode_batch(m.value)
        except (ContractError, RecursionError) as exc:
            try:  # one bad envelope costs only itself
                parts = decode_parts(m.value)
            except (ContractError, RecursionError):
                group += 1
                origin = Origin(location, pod, group)
                tables["dead_letters"].append((contract_dead_letter(str(exc)[:1000], location, m.value, pod),
                                               origin))
                continue
            events = []
            for part in parts:
                if isinstance(part, BadEnvelope):
                    group += 1
                    key = f"contract:{m.topic}:{part.raw.decode('utf-8', 'replace')}"  # a re-send repeats it
                    tables["dead_letters"].append((contract_dead_letter(
                        part.reason[:1000], f"{location}:envelope {part.index}", part.raw, pod, natural_key=key),
                        Origin(location, pod, group)))
                else:
                    events.append(part)
        for ev in events:
            group += 1
            origin = Origin(f"{location}:{ev.event_id}", ev.pod, group)
            try:
                mapped = rows_for(ev)
            except ContractViolation as exc:
                raw = encode_batch([ev])
                key = f"contract:{m.topic}:{raw.decode('utf-8', 'replace')}"  # not the offset: a re-send repeats it
                tables["dead_letters"].append((contract_dead_letter(exc.reason, location, raw, ev.pod,
                                                                    natural_key=key), origin))
                continue
            for table, rows in mapped:
                tables[table].extend((r, origin) for r in rows)
    return tables


def backoff_seconds(attempt: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Exponential backoff with full-range jitter: ``min(cap, base·2^attempt)`` × U(0.5, 1.5) seconds."""
    return min(cap, base * (2 ** min(attempt, 16))) * random.uniform(0.5, 1.5)


class Ingester:
    """Moves messages from a :class:`Source` into a :class:`Store`.

    ``handle(messages)`` writes one batch (retrying until it lands or ``stop`` is set) and commits it;
    ``run_once`` polls and handles one batch; ``run`` loops until ``stop`` is set. Bad data never raises.
    ``rows_written`` counts rows this ingester inserted, per table; ``rows_conflicting`` the rows it
    dead-lettered because the store held their identity with other values (:func:`ingest.dedup.check_rows`).
    ``max_poison_attempts`` (at least 1): failures in a row, while the store answers and not of load, after which a
    batch is written envelope by envelope and the failing envelopes dead-lettered (:meth:`handle`); ``poisoned``
    counts the envelopes this ingester dead-lettered so. Raises ValueError for ``max_poison_attempts`` below 1.
    """

    def __init__(self, store: Store, source: Source, *, max_messages: int = 500, poll_timeout_ms: int = 500,
                 max_backoff_seconds: float = 30.0, max_poison_attempts: int = 8) -> None:
        self.store = store
        self.source = source
        self.max_messages = max_messages
        self.poll_timeout_ms = poll_timeout_ms
        self.max_backoff_seconds = max_backoff_seconds
        if max_poison_attempts < 1:
            raise ValueError(f"max_poison_attempts must be at least 1, got {max_poison_attempts}")
        self.max_poison_attempts = max_poison_attempts
        self.poisoned = 0  # envelopes (or messages) dead-lettered after failing while the store answered
        self.messages_handled = 0
        self.rows_written: dict[str, int] = defaultdict(int)
        self.rows_conflicting: dict[str, int] = defaultdict(int)
        self.retentions = Retentions(store)

    # -- writing one table ------------------------------------------------------------------------------
    def _write(self, table: str, rows: list[tuple[tuple[Any, ...], Origin]]) -> None:
        """Insert the rows the store does not hold yet; isolate and dead-letter rows it refuses as data."""
        columns = COLUMNS[table]
        rows = self._set_aside_expired(table, rows)
        verdict = check_rows(self.store, table, [r for r, _ in rows], columns, [o.group for _, o in rows])
        if len(verdict.keep) + len(verdict.conflicts) < len(rows):
            ROWS_DUPLICATE.labels(table).inc(len(rows) - len(verdict.keep) - len(verdict.conflicts))
        if verdict.conflicts:
            self._dead_letter_conflicts(table, rows, verdict.conflicts)
        todo = [rows[i] for i in verdict.keep]
        if table == "kv_block_events":  # blocks already held under other part ids (another message size limit)
            trimmed = trim_kv_rows(self.store, [r for r, _ in todo], columns, [o.group for _, o in todo])
            dropped = len(todo) - len({i for i, _ in trimmed})
            if dropped:
                ROWS_DUPLICATE.labels(table).inc(dropped)
            todo = [(row, todo[i][1]) for i, row in trimmed]
        self._insert_isolating(table, todo)

    def _insert_isolating(self, table: str, todo: list[tuple[tuple[Any, ...], Origin]]) -> None:
        """Insert ``todo`` (rows the store did not hold); when the store refuses them as data, insert each half
        on its own until the refused rows are alone, and dead-letter those. The halves are not checked against
        the store again: rows of one envelope share its identity (a KV batch's events, a scrape's samples), so
        once one half landed the other would read as already stored and be lost. A refused insert wrote
        nothing, so no row can land twice."""
        if not todo:
            return
        try:
            self.store.insert(table, [r for r, _ in todo], COLUMNS[table])
        except RejectedRows as exc:
            if len(todo) == 1:
                self._dead_letter_refused(table, todo[0], exc)
                return
            mid = len(todo) // 2
            self._insert_isolating(table, todo[:mid])
            self._insert_isolating(table, todo[mid:])
            return
        ROWS_WRITTEN.labels(table).inc(len(todo))
        self.rows_written[table] += len(todo)
        if table == "dead_letters":
            for row, _ in todo:
                DEAD_LETTERS.labels(row[2]).inc()

    def _set_aside_expired(self, table: str, rows: list[tuple[tuple[Any, ...], Origin]]
                           ) -> list[tuple[tuple[Any, ...], Origin]]:
        """``rows`` minus those already older than ``table``'s retention (:mod:`ingest.retention`), which become
        one dead letter per envelope, with the reason and the rows as JSON lines. Dead letters themselves are
        never set aside: an old one (a collector's, observed long ago) or one stamped at or after
        :data:`collector.gateway_record.LATEST` is stamped with the time it is stored."""
        retention = self.retentions.get(table)
        if retention is None or retention.column not in COLUMNS[table]:
            return rows
        at = COLUMNS[table].index(retention.column)
        keep, expired = self.retentions.split(table, [r for r, _ in rows], lambda r: r[at])
        if table == "dead_letters":  # also those stamped past what DateTime holds (their TTL would wrap)
            now, restamp = datetime.now(UTC), set(expired) | {i for i, (r, _) in enumerate(rows) if r[at] >= LATEST}
            return [((*r[:at], now, *r[at + 1:]) if i in restamp else r, o) for i, (r, o) in enumerate(rows)]
        if not expired:
            return rows
        ROWS_EXPIRED.labels(table).inc(len(expired))
        by_origin: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
        origins: dict[int, Origin] = {}
        for i in expired:
            row, origin = rows[i]
            by_origin[origin.group].append(row)
            origins[origin.group] = origin
        log.warning("rows older than the retention of %s set aside as dead letters: %d", table, len(expired))
        for group, group_rows in by_origin.items():
            origin = origins[group]
            raw = "\n".join(json.dumps(dict(zip(COLUMNS[table], r, strict=False)), default=str, ensure_ascii=False)
                            for r in group_rows)
            reason = retention.reason(group_rows[0][at]) + (f" ({len(group_rows)} rows)" if len(group_rows) > 1
                                                             else "")
            self._write("dead_letters", [(contract_dead_letter(reason, origin.location, raw, origin.pod,
                                                               natural_key=f"expired:{table}:{raw}"), origin)])
        return [rows[i] for i in keep]

    def _dead_letter_conflicts(self, table: str, rows: list[tuple[tuple[Any, ...], Origin]],
                               conflicts: dict[int, tuple[str, ...]]) -> None:
        """One dead letter per envelope whose rows conflict with the stored ones (:func:`ingest.dedup.check_rows`):
        the reason names its identity and the columns that differ, ``raw`` holds its rows as JSON lines. Its id
        comes from the table and the rows, not from where they were read, so the same conflicting line (or
        scrape) read again adds no second dead letter."""
        ROWS_CONFLICTING.labels(table).inc(len(conflicts))
        self.rows_conflicting[table] += len(conflicts)
        by_origin: dict[int, list[int]] = defaultdict(list)
        for i in conflicts:
            by_origin[rows[i][1].group].append(i)
        letters = []
        for members in by_origin.values():
            origin = rows[members[0]][1]
            values = [dict(zip(COLUMNS[table], rows[i][0], strict=False)) for i in members]
            raw = "\n".join(json.dumps(v, default=str, ensure_ascii=False) for v in values)
            reason = conflict_reason(table, conflicts[members[0]])
            key = ", ".join(f"{c}={values[0][c]}" for c in IDENTITY[table].columns)
            log.error("%s; dead-lettered. %s rows=%d location=%s", reason, key, len(members), origin.location)
            letters.append((contract_dead_letter(reason, origin.location, raw, origin.pod,
                                                 natural_key=f"conflict:{table}:{raw}"), origin))
        self._write("dead_letters", letters)

    def _dead_letter_refused(self, table: str, item: tuple[tuple[Any, ...], Origin], exc: RejectedRows) -> None:
        row, origin = item
        INGEST_ERRORS.labels("rejected").inc()
        log.error("store refused a row; dead-lettered. table=%s location=%s reason=%s", table, origin.location, exc)
        raw = json.dumps(dict(zip(COLUMNS[table], row, strict=False)), default=str, ensure_ascii=False)
        dead = contract_dead_letter(f"store refused a row of {table}: {exc}"[:2000], origin.location, raw,
                                    origin.pod, natural_key=f"refused:{table}:{raw}")
        if table != "dead_letters":
            self._write("dead_letters", [(dead, origin)])
            return
        # A dead letter the store refuses: one plain ASCII attempt, then it is lost, loudly (never a loop).
        ascii_row = tuple(v.encode("ascii", "replace").decode() if isinstance(v, str) else v for v in dead)
        try:
            self.store.insert("dead_letters", [ascii_row], COLUMNS["dead_letters"])
        except RejectedRows:
            INGEST_ERRORS.labels("dead_letter_lost").inc()
            log.error("store refused a dead letter twice; it is lost. location=%s", origin.location)

    def write_batch(self, messages: list[Message]) -> None:
        """Write every row of ``messages`` (data tables first, dead letters last). Raises any failure that
        may pass; the caller keeps the batch."""
        tables = _rows_of(messages)
        for table in sorted(tables, key=lambda t: (t == "dead_letters", t)):
            self._write(table, tables[table])

    # -- one batch, retried until it lands -----------------------------------------------------------------
    def handle(self, messages: list[Message], stop: threading.Event | None = None) -> bool:
        """Write ``messages`` and commit them; True once committed.

        Retries every write failure that may pass with backoff and jitter, holding the batch: forever while the
        store does not answer or the error is one of load (:data:`TRANSIENT_CODES`); after
        ``max_poison_attempts`` other failures in a row while the store answers, the batch is written envelope by
        envelope and each one that still fails is a dead letter (:meth:`_write_isolating`). Returns False
        with nothing committed when ``stop`` is set first (the source is rewound), or when the commit itself
        fails (e.g. a rebalance took the partitions away: the next owner redelivers the batch, and the dedup
        check keeps the rows this one already wrote from counting twice).
        """
        attempt = poison = 0
        while True:
            try:
                if poison >= self.max_poison_attempts:
                    self._write_isolating(messages)
                else:
                    self.write_batch(messages)
                break
            except Exception as exc:  # noqa: BLE001 - every failure keeps the batch; only data errors are final
                if self._data_caused(exc):
                    poison += 1
                else:
                    poison = 0  # the store is away or loaded: not the batch's fault
                reason = type(exc).__name__
                RETRIES.labels(reason).inc()
                wait = backoff_seconds(attempt, cap=self.max_backoff_seconds)
                BATCH_BACKOFF.set(wait)
                if isinstance(exc, RetryableError):
                    log.warning("batch kept for retry. reason=%s retry_in_s=%.1f error=%s", reason, wait, exc)
                else:
                    log.exception("batch failed unexpectedly; kept for retry (an operator must look). "
                                  "retry_in_s=%.1f", wait)
                attempt += 1
                if stop is None:
                    time.sleep(wait)
                elif stop.wait(wait):
                    self._rewind(messages)
                    return False
        BATCH_BACKOFF.set(0)
        try:
            self.source.commit(messages)
        except RetryableError as exc:
            INGEST_ERRORS.labels("commit_failed").inc()
            log.warning("commit failed; the batch will be redelivered (its rows are deduplicated). error=%s", exc)
            self._rewind(messages)
            return False
        self.messages_handled += len(messages)
        return True

    def _data_caused(self, exc: Exception) -> bool:
        """Whether a failed write may be the batch's own doing: the store answers ``SELECT 1`` now, and the error
        is not one of load (:data:`TRANSIENT_CODES`)."""
        if error_code(exc) in TRANSIENT_CODES:
            return False
        try:
            return self.store.query_rows("SELECT 1") == [(1,)]
        except Exception:  # noqa: BLE001 - the store is away: the failure may pass
            return False

    def _write_isolating(self, messages: list[Message]) -> None:
        """Write ``messages`` one envelope at a time (a message that does not decode as a whole, one message); an
        envelope whose write fails while the store answers (and not with an error of load) becomes a dead letter
        with the error, keyed by its bytes (a redelivery repeats it). Raises when the store is away or loaded, or
        when every one of several envelopes fails (not one envelope's doing: the caller retries the batch; what
        landed is not written again)."""
        failed: list[tuple[Message, Exception]] = []
        total = 0
        for m in messages:
            try:
                parts: list[bytes] = [encode_batch([ev]) for ev in decode_batch(m.value)]
            except (ContractError, RecursionError):
                parts = [m.value]  # its bad envelopes are dead letters of _rows_of already
            for value in parts:
                total += 1
                one = Message(m.topic, m.key, value, m.partition, m.offset)
                try:
                    self.write_batch([one])
                except Exception as exc:  # noqa: BLE001 - classified below; what is not the data's is raised
                    if not self._data_caused(exc):
                        raise
                    failed.append((one, exc))
        if total > 1 and len(failed) == total:
            raise failed[-1][1]
        for one, exc in failed:
            self._dead_letter_poison(one, exc)

    def _dead_letter_poison(self, m: Message, exc: Exception) -> None:
        location = f"{m.topic}:{m.partition}:{m.offset}"
        pod = m.key.decode("utf-8", "replace")
        INGEST_ERRORS.labels("poison").inc()
        self.poisoned += 1
        log.error("an envelope failed %d times while the store answered; dead-lettered so its partition goes on. "
                  "location=%s error=%s", self.max_poison_attempts, location, exc)
        reason = (f"write failed {self.max_poison_attempts} times while the store answered (not an error of load); "
                  f"dead-lettered: {type(exc).__name__}: {exc}")[:2000]
        text = m.value.decode("utf-8", "replace")
        dead = contract_dead_letter(reason, location, m.value, pod, natural_key=f"poison:{m.topic}:{text}")
        try:
            self._write("dead_letters", [(dead, Origin(location, pod, 0))])
        except Exception as exc2:  # noqa: BLE001 - the store may refuse the envelope's bytes there too
            if not self._data_caused(exc2):
                raise
            # without the envelope's bytes (the id stays theirs); then it is lost, loudly (never a loop)
            try:
                self._write("dead_letters", [(dead[:6] + ("",), Origin(location, pod, 0))])
            except Exception as exc3:  # noqa: BLE001
                if not self._data_caused(exc3):
                    raise
                INGEST_ERRORS.labels("dead_letter_lost").inc()
                log.error("store refused a poison envelope's dead letter twice; it is lost. location=%s", location)

    def _rewind(self, messages: list[Message]) -> None:
        try:
            self.source.rewind(messages)
        except RetryableError as exc:  # e.g. the partitions were revoked: their next owner redelivers
            log.warning("rewind failed; the batch comes back from the committed offsets. error=%s", exc)

    def run_once(self, stop: threading.Event | None = None) -> int:
        """Poll one batch and handle it; returns the number of messages polled."""
        messages = self.source.poll(self.poll_timeout_ms, self.max_messages)
        if messages:
            self.handle(messages, stop)
        return len(messages)

    def run(self, stop: threading.Event) -> None:
        """Poll and handle batches until ``stop`` is set. A poll failure (broker away) backs off and retries."""
        attempt = 0
        while not stop.is_set():
            try:
                self.run_once(stop)
                attempt = 0
            except Exception as exc:  # noqa: BLE001 - the source failed to poll; nothing was taken
                INGEST_ERRORS.labels("source_unavailable").inc()
                wait = backoff_seconds(attempt, cap=self.max_backoff_seconds)
                log.warning("source unavailable. retry_in_s=%.1f error=%s", wait, exc)
                attempt += 1
                stop.wait(wait)

