"""Where the ingester reads from: a Kafka consumer group (distributed) or the in-process queue (embedded).

Both hand out batches of :class:`collector.publish.Message`. ``commit(batch)`` is called only after the
store confirmed the batch's rows and commits exactly that batch; ``rewind(batch)`` makes the
next poll deliver the batch again (the ingester could not write it). Only this module sees kafka-python
exceptions.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

from prometheus_client import Gauge

from collector.events import topics as contract_topics
from collector.publish import MemoryQueue, Message
from ingest.errors import RetryableError

CONSUMER_LAG = Gauge("kvscope_ingest_consumer_lag_messages", "Messages in the partition not yet committed by "
                     "this ingester (Kafka high watermark - committed offset)", ["topic", "partition"])
QUEUE_BYTES = Gauge("kvscope_ingest_queue_bytes", "Bytes in the in-process queue, in flight included (embedded)")


class SourceUnavailable(RetryableError):
    """The broker could not be reached, or a commit or seek failed."""


class Source(Protocol):
    def poll(self, timeout_ms: int = 500, max_messages: int = 500) -> list[Message]: ...
    def commit(self, messages: list[Message]) -> None: ...
    def rewind(self, messages: list[Message]) -> None: ...
    def close(self) -> None: ...


class QueueSource:
    """Embedded mode: drains the :class:`~collector.publish.MemoryQueue` the collector fills.

    A polled batch stays *in flight* until committed: until then every poll returns the same batch again, so
    a batch the ingester could not write is never dropped. ``commit`` frees the queue's bytes and runs each
    message's ``on_commit`` (the collector's checkpoint advances: its rows are in the store), in queue order.
    Acknowledgement-only markers (:meth:`collector.publish.Message.ack_only`) are never returned: each runs
    once every message queued before it is committed.
    """

    def __init__(self, q: MemoryQueue) -> None:
        self.queue = q
        self._inflight: list[Message] = []

    def poll(self, timeout_ms: int = 500, max_messages: int = 500) -> list[Message]:
        if not self._inflight:
            self._inflight = self.queue.take(max_messages, timeout_ms / 1000)
        self._settle(0)  # markers with nothing uncommitted before them
        QUEUE_BYTES.set(self.queue.bytes_used)
        return [m for m in self._inflight if not m.is_ack_only]

    def commit(self, messages: list[Message]) -> None:
        self._settle(len(messages))
        QUEUE_BYTES.set(self.queue.bytes_used)

    def _settle(self, n: int) -> None:
        """Commit the first ``n`` data messages in flight and every marker before or right after them."""
        done: list[Message] = []
        while self._inflight and (n > 0 or self._inflight[0].is_ack_only):
            m = self._inflight.pop(0)
            n -= not m.is_ack_only
            done.append(m)
        for m in done:
            if m.on_commit is not None:
                m.on_commit()
        if done:
            self.queue.release(done)

    def rewind(self, messages: list[Message]) -> None:
        pass  # still in flight: the next poll returns them

    def close(self) -> None:
        pass


class KafkaSource:
    """A member of consumer group ``group_id`` on every kvscope topic, committing explicit offsets only.

    Session/heartbeat timeouts are short (6 s / 2 s) so a group forms quickly (the test broker waits half the
    session timeout on the first join). Raises :class:`SourceUnavailable` when the broker cannot be reached.
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

    def assignment(self) -> set[Any]:
        return set(self._consumer.assignment())

    @staticmethod
    def _by_partition(messages: list[Message]) -> dict[tuple[str, int], list[int]]:
        out: dict[tuple[str, int], list[int]] = defaultdict(list)
        for m in messages:
            out[(m.topic, m.partition)].append(m.offset)
        return out

    def commit(self, messages: list[Message]) -> None:
        """Commit, per partition, the offset after the last message of ``messages`` (what was written)."""
        from kafka.structs import OffsetAndMetadata, TopicPartition

        offsets = {TopicPartition(t, p): OffsetAndMetadata(max(offs) + 1, "", -1)
                   for (t, p), offs in self._by_partition(messages).items()}
        if not offsets:
            return
        try:
            self._consumer.commit(offsets)
        except self._kafka_error as exc:
            raise SourceUnavailable(f"commit failed: {exc!r}") from exc
        for tp, om in offsets.items():
            high = self._consumer.highwater(tp)
            if high is not None:
                CONSUMER_LAG.labels(tp.topic, str(tp.partition)).set(max(0, high - om.offset))

    def rewind(self, messages: list[Message]) -> None:
        """Seek each partition of ``messages`` back to its first message, so the next poll redelivers them."""
        from kafka.structs import TopicPartition

        try:
            for (t, p), offs in self._by_partition(messages).items():
                tp = TopicPartition(t, p)
                if tp in self._consumer.assignment():
                    self._consumer.seek(tp, min(offs))
        except (self._kafka_error, AssertionError, ValueError) as exc:
            raise SourceUnavailable(f"seek failed: {exc!r}") from exc

    def close(self) -> None:
        self._consumer.close(autocommit=False)
