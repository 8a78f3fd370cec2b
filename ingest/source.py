"""Where the ingester reads from: a Kafka consumer group (distributed) or the in-process queue (embedded).

Both give batches of :class:`collector.publish.Message` and a ``commit()`` that the ingester calls only after
ClickHouse confirmed the insert (STYLE.md §4). Only this module sees kafka-python exceptions.
"""

from __future__ import annotations

import queue
from typing import Protocol

from collector.events import topics as contract_topics
from collector.publish import Message
from ingest.errors import RetryableError


class SourceUnavailable(RetryableError):
    """The broker could not be reached or the commit failed."""


class Source(Protocol):
    def poll(self, timeout_ms: int = 500, max_messages: int = 500) -> list[Message]: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


class QueueSource:
    """Embedded mode: drains the queue the :class:`collector.publish.QueuePublisher` fills. ``commit`` is a
    no-op: the queue lives and dies with the process."""

    def __init__(self, q: queue.Queue[Message]) -> None:
        self.queue = q

    def poll(self, timeout_ms: int = 500, max_messages: int = 500) -> list[Message]:
        out: list[Message] = []
        try:
            out.append(self.queue.get(timeout=timeout_ms / 1000))
        except queue.Empty:
            return out
        while len(out) < max_messages:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return out

    def commit(self) -> None:
        pass

    def close(self) -> None:
        pass


class KafkaSource:
    """A member of consumer group ``group_id`` on every kvscope topic, manual commits only.

    Session/heartbeat timeouts are short (6 s / 2 s) so a group forms quickly (tansu waits half the session
    timeout on the first join; ../shared/reference/environment.md).
    """

    def __init__(self, bootstrap: str, group_id: str, *, namespace: str = "kvscope",
                 session_timeout_ms: int = 6000) -> None:
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError

        self._kafka_error = KafkaError
        try:
            self._consumer = KafkaConsumer(
                *contract_topics(namespace), bootstrap_servers=bootstrap, group_id=group_id,
                enable_auto_commit=False, auto_offset_reset="earliest",
                session_timeout_ms=session_timeout_ms, heartbeat_interval_ms=session_timeout_ms // 3,
                max_partition_fetch_bytes=16 << 20, fetch_max_bytes=64 << 20,
            )
        except KafkaError as exc:
            raise SourceUnavailable(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc

    def poll(self, timeout_ms: int = 500, max_messages: int = 500) -> list[Message]:
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_messages)
        except self._kafka_error as exc:
            raise SourceUnavailable(f"poll failed: {exc!r}") from exc
        return [Message(r.topic, r.key or b"", r.value, r.partition, r.offset)
                for records in batches.values() for r in records]

    def assignment(self) -> set:
        return set(self._consumer.assignment())

    def commit(self) -> None:
        try:
            self._consumer.commit()
        except self._kafka_error as exc:
            raise SourceUnavailable(f"commit failed: {exc!r}") from exc

    def close(self) -> None:
        self._consumer.close(autocommit=False)
