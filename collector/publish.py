"""The collector's sink: publishes envelopes to Kafka (distributed) or to an in-process queue (embedded).

Envelopes are grouped per (kind, pod) and each group goes out as one message (``encode_batch``) on topic
``kvscope.<kind>.v1`` keyed by pod, so one pod's events stay ordered in one partition.
Only this module sees kafka-python exceptions; they become :class:`PublishError`.
"""

from __future__ import annotations

import queue
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from collector.events import Envelope, encode_batch, topic_for, topics


class PublishError(Exception):
    """The broker did not take the messages (retryable: the caller keeps the events)."""


@dataclass(frozen=True)
class Message:
    """One transport message: ``topic``, ``key`` (pod, bytes), ``value`` (encoded batch), and where it came
    from once consumed (``partition``, ``offset``; -1 for the in-process queue)."""

    topic: str
    key: bytes
    value: bytes
    partition: int = -1
    offset: int = -1


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


class Publisher(Protocol):
    def publish(self, events: list[Envelope]) -> None: ...
    def close(self) -> None: ...


class QueuePublisher:
    """Embedded mode: messages go to a ``queue.Queue`` that :class:`ingest.source.QueueSource` drains."""

    def __init__(self, q: queue.Queue[Message]) -> None:
        self.queue = q

    def publish(self, events: list[Envelope]) -> None:
        for m in to_messages(events):
            self.queue.put(m)

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

    def publish(self, events: list[Envelope]) -> None:
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
