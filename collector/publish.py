"""The collector's sink: publishes envelopes to Kafka (distributed) or to an in-process queue (embedded).

Envelopes are grouped per (kind, pod) and each group goes out as one message (``encode_batch``) on topic
``kvscope.<kind>.v1`` keyed by pod, so one pod's events stay ordered in one partition.
Only this module sees kafka-python exceptions; they become :class:`PublishError`.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from collector.events import Envelope, encode_batch, topic_for, topics


class PublishError(Exception):
    """The broker did not take the messages (retryable: the caller keeps the events)."""


@dataclass(frozen=True)
class Message:
    """One transport message: ``topic``, ``key`` (pod, bytes), ``value`` (encoded batch), and where it came
    from once consumed (``partition``, ``offset``; -1 for the in-process queue). ``on_commit`` (in-process
    queue only): called once the ingester committed this message, i.e. its rows are in the store."""

    topic: str
    key: bytes
    value: bytes
    partition: int = -1
    offset: int = -1
    on_commit: Callable[[], None] | None = field(default=None, compare=False, repr=False)


def to_messages(
    events: list[Envelope], max_events_per_message: int = 2000, namespace: str = "kvscope"
) -> list[Message]:
    """Group envelopes into messages per (kind, pod), at most ``max_events_per_message`` each."""
    groups: dict[tuple[str, str], list[Envelope]] = defaultdict(list)
    for ev in events:
        groups[(ev.schema, ev.pod)].append(ev)
    out = []
    for (kind, pod), evs in groups.items():
        for i in range(0, len(evs), max_events_per_message):
            out.append(
                Message(topic_for(kind, namespace), pod.encode(), encode_batch(evs[i : i + max_events_per_message]))
            )
    return out


Ack = Callable[[], None]


class Publisher(Protocol):
    """Where the collector's envelopes go. ``publish`` either takes every envelope or raises
    :class:`PublishError` (the caller keeps them and retries); ``on_ack`` is called once they are durable
    downstream (so the source may advance its checkpoint)."""

    def publish(self, events: list[Envelope], on_ack: Ack | None = None) -> None: ...
    def close(self) -> None: ...


class MemoryQueue:
    """The embedded mode's transport: a FIFO of :class:`Message` bounded by bytes (``max_bytes`` of encoded
    values), so a slow store holds back the collector instead of growing memory without bound.

    Bytes are released when the consumer *commits* (not when it takes), so messages in flight count too. One
    publish larger than ``max_bytes`` is still admitted when the queue is empty (it could never fit).
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: deque[Message] = deque()
        self._bytes = 0
        self._cond = threading.Condition()

    @property
    def bytes_used(self) -> int:
        """Bytes of queued and in-flight (taken, not yet committed) messages."""
        return self._bytes

    def put_all(self, messages: list[Message], timeout: float) -> bool:
        """Append every message, or none: False when there was no room within ``timeout`` seconds."""
        size = sum(len(m.value) for m in messages)
        with self._cond:
            if not self._cond.wait_for(lambda: self._bytes == 0 or self._bytes + size <= self.max_bytes, timeout):
                return False
            self._items.extend(messages)
            self._bytes += size
            self._cond.notify_all()
            return True

    def take(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` from the head, waiting up to ``timeout`` seconds for the first."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items), timeout)
            out = []
            while self._items and len(out) < max_messages:
                out.append(self._items.popleft())
            return out

    def release(self, messages: list[Message]) -> None:
        """The consumer committed ``messages``: their bytes are free again."""
        with self._cond:
            self._bytes -= sum(len(m.value) for m in messages)
            self._cond.notify_all()

    def empty(self) -> bool:
        """True when nothing is queued or in flight."""
        with self._cond:
            return self._bytes == 0 and not self._items


class QueuePublisher:
    """Embedded mode: messages go to a :class:`MemoryQueue` that :class:`ingest.source.QueueSource` drains;
    ``on_ack`` rides on the last message and runs when the ingester commits it (FIFO: the earlier ones are
    committed by then). Raises :class:`PublishError` when the queue stays full for ``put_timeout_seconds``."""

    def __init__(self, q: MemoryQueue, put_timeout_seconds: float = 1.0) -> None:
        self.queue = q
        self.put_timeout_seconds = put_timeout_seconds

    def publish(self, events: list[Envelope], on_ack: Ack | None = None) -> None:
        messages = to_messages(events)
        if not messages:
            if on_ack:
                on_ack()
            return
        if on_ack is not None:
            last = messages[-1]
            messages[-1] = Message(last.topic, last.key, last.value, on_commit=on_ack)
        if not self.queue.put_all(messages, self.put_timeout_seconds):
            raise PublishError(f"in-process queue full ({self.queue.bytes_used} of {self.queue.max_bytes} bytes)")

    def close(self) -> None:
        pass


class KafkaPublisher:
    """Distributed mode: kafka-python producer with ``acks="all"``; :meth:`publish` returns once the broker
    acknowledged every message (so the collector may then advance its own checkpoints).

    Raises :class:`PublishError` when the broker cannot be reached or refuses a message.
    """

    def __init__(
        self, bootstrap: str, *, namespace: str = "kvscope", create_topics: bool = True, partitions: int = 3
    ) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        self._kafka_error = KafkaError
        self.namespace = namespace
        try:
            if create_topics:
                ensure_topics(bootstrap, topics(namespace), partitions)
            self._producer = KafkaProducer(
                bootstrap_servers=bootstrap,
                acks="all",
                linger_ms=20,
                compression_type="gzip",
                max_request_size=16 << 20,
                retries=5,
            )
        except KafkaError as exc:
            raise PublishError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc

    def publish(self, events: list[Envelope], on_ack: Ack | None = None) -> None:
        try:
            futures = [
                self._producer.send(m.topic, key=m.key, value=m.value)
                for m in to_messages(events, namespace=self.namespace)
            ]
            self._producer.flush()
            for f in futures:
                f.get(timeout=30)
        except self._kafka_error as exc:
            raise PublishError(f"Kafka refused a batch: {exc!r}") from exc
        if on_ack is not None:
            on_ack()

    def close(self) -> None:
        self._producer.close(timeout=10)


def ensure_topics(bootstrap: str, topics: list[str], partitions: int = 3) -> None:
    """Create missing topics (replication 1 unless the broker defaults otherwise). Raises KafkaError."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="kvscope-admin")
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
