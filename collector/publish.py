"""The collector's sink: publishes envelopes to Kafka (distributed) or to an in-process queue (embedded).

Envelopes are grouped per (kind, pod), in order, and each group goes out as messages (``encode_batch``) on topic
``kvscope.<kind>.v1`` keyed by pod, so one pod's events stay ordered in one partition. For Kafka a message's
value is capped in bytes (``KVSCOPE_KAFKA_MAX_MESSAGE_BYTES``, under the broker's ``message.max.bytes``): a
KV-event batch that alone encodes larger is sent in parts that each fit (``collector/kv_split.py``), any other
envelope that large is sent as a dead letter instead, and a message the broker still refuses as too large is
split, down to dead-lettering the one envelope (or the one block of a KV event) it cannot take
(docs/reliability.md, "Message size").
Only this module sees kafka-python exceptions; they become :class:`PublishError`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from prometheus_client import Counter

from collector.events import (
    DeadLetter,
    Envelope,
    GatewayRequest,
    KvEventBatch,
    VllmScrape,
    decode_batch,
    encode_batch,
    encode_event,
    envelope,
    topic_for,
    topics,
)
from collector.kv_split import split_batch, units

#: Default cap (bytes) of one Kafka message's value, the encoded JSON batch before compression:
#: ``KVSCOPE_KAFKA_MAX_MESSAGE_BYTES``. Apache Kafka refuses a record batch larger than the broker's
#: ``message.max.bytes`` / the topic's ``max.message.bytes`` (default 1,048,588 bytes; source:
#: https://kafka.apache.org/documentation/#brokerconfigs_message.max.bytes); 900,000 leaves room for the key
#: and the record framing even when a broker takes the value uncompressed.
DEFAULT_MAX_MESSAGE_BYTES = 900_000
#: The smallest cap the setting accepts: a dead letter (reason, location, the head of the refused event) fits.
MIN_MAX_MESSAGE_BYTES = 16_384
#: What the producer's ``max_request_size`` allows beyond the value cap: the key (pod name), record and batch
#: headers. kafka-python refuses a record larger than ``max_request_size`` before sending it.
REQUEST_OVERHEAD_BYTES = 64 << 10
#: A dead letter keeps at most this much of the head of the event it stands for (``DeadLetter.raw``).
MAX_RAW = 64 * 1024

OVERSIZED = Counter("kvscope_collector_oversized_events", "Envelopes not sent to Kafka as data because they alone "
                    "encode larger than a message may be (why=setting: over KVSCOPE_KAFKA_MAX_MESSAGE_BYTES; "
                    "why=broker: refused by the broker as too large); each was sent as a dead letter instead. "
                    "kind=kv_event_batch: one block of a KV event (or an event without blocks) that alone does not "
                    "fit; the rest of its batch was sent in parts", ["kind", "why"])
KV_SPLITS = Counter("kvscope_collector_kv_batches_split", "KV-event batches too large for one Kafka message, sent in "
                    "parts that each fit: each batch once per publish that sends it in parts, however often its "
                    "parts are cut again (why=broker: the broker refused the batch or one of its parts as too "
                    "large; why=setting: only KVSCOPE_KAFKA_MAX_MESSAGE_BYTES split it)", ["why"])

#: The dead-letter ``source`` of each kind the collector publishes (a dead letter keeps its own source).
SOURCE_OF_KIND = {"vllm_scrape": "vllm_metrics", "gateway_request": "gateway_log", "kv_event_batch": "kv_events",
                  "kv_event_gap": "kv_events"}


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

    @classmethod
    def ack_only(cls, on_commit: Callable[[], None]) -> Message:
        """In-process queue only: no data, just ``on_commit``, to run once every message queued before it is
        committed (a source's position moved without lines, e.g. a log file switch)."""
        return cls("", b"", b"", on_commit=on_commit)

    @property
    def is_ack_only(self) -> bool:
        """True for a :meth:`ack_only` marker (the ingester never sees one)."""
        return not self.topic


@dataclass(frozen=True)
class Oversized:
    """An envelope sent as a dead letter instead of as data: its ``kind``, ``pod`` and ``event_id``, its
    encoded ``size`` (bytes), ``why`` (``setting``: over the cap; ``broker``: the broker refused it as too
    large) and ``dead_letter``, the envelope sent in its place. For a KV-event batch it is one part holding
    the one block (or event without blocks) that alone does not fit; the batch's other parts, if any, were sent."""

    kind: str
    pod: str
    event_id: str
    size: int
    why: str
    dead_letter: Envelope


@dataclass(frozen=True)
class SplitBatch:
    """One cut of a KV-event batch envelope into parts (:func:`collector.kv_split.split_batch`): its ``pod`` and
    ``event_id`` (the envelope cut: the batch, or one of its parts cut again), its encoded ``size`` (bytes), the
    ``part_ids`` (event ids of the parts it became, in order) and ``why`` it was cut (``setting`` or ``broker``,
    as :class:`Oversized`). A batch whose parts are cut again has one record per cut: :func:`batches_split`
    says which batches were split, once each."""

    pod: str
    event_id: str
    size: int
    part_ids: tuple[str, ...]
    why: str

    @property
    def parts(self) -> int:
        """How many parts this cut made."""
        return len(self.part_ids)


def batches_split(splits: list[SplitBatch]) -> dict[str, str]:
    """The KV-event batches that ``splits`` (the cuts of one publish, in the order made) sent in parts: the
    batch's event id → ``why``, one entry per batch however many times its parts were cut again (a part's cut is
    the batch's: the part's id leads back to it through the cut that made it). ``why`` is ``broker`` when the
    broker refused the batch or any of its parts as too large (its parts were then cut to the broker's limit,
    below the setting), else ``setting``. A batch whose cut made no part (its one block, or event without blocks,
    too large alone: sent only as its dead letter, counted in ``kvscope_collector_oversized_events_total``) was
    not sent in parts and is not listed. This is what ``kvscope_collector_kv_batches_split_total{why}`` counts,
    per publish."""
    root: dict[str, str] = {}  # a part's event id → the batch's
    out: dict[str, str] = {}
    for s in splits:
        if not s.part_ids:
            continue
        batch = root.get(s.event_id, s.event_id)
        for pid in s.part_ids:
            root[pid] = batch
        out[batch] = "broker" if s.why == "broker" or out.get(batch) == "broker" else "setting"
    return out


def _location(ev: Envelope) -> str:
    """Where an event was read, as its kind's dead letters say it (file:offset, URL, zmq:topic:seq)."""
    p = ev.payload
    if isinstance(p, GatewayRequest):
        return f"{p.source_file}:{p.line_offset}"
    if isinstance(p, VllmScrape):
        return p.target
    if isinstance(p, KvEventBatch):
        if len(p.events) == 1 and p.events[0].idx is not None:
            e = p.events[0]  # e.g. the one piece of a split batch that does not fit
            return f"zmq:{p.topic}:{p.seq}:event {e.idx}" + (f":block {e.first_pos}" if e.block_hashes else "")
        return f"zmq:{p.topic}:{p.seq}"
    if isinstance(p, DeadLetter):
        return p.location
    return ""


def oversized_dead_letter(ev: Envelope, reason: str, max_message_bytes: int) -> Envelope:
    """The dead letter that stands for envelope ``ev`` (not itself a dead letter), which cannot travel as one
    Kafka message: ``reason`` (one sentence, naming its size), ``raw`` the head of ``ev``'s JSON (at most
    :data:`MAX_RAW` and a quarter of ``max_message_bytes``, so the dead letter itself fits), ``location`` where
    ``ev`` was read, ``source`` the source of its kind. Its id derives from ``ev``'s, so a re-sent copy is stored
    once."""
    source = SOURCE_OF_KIND.get(ev.schema, ev.schema)
    head = encode_event(ev)[: min(MAX_RAW, max_message_bytes // 4)].decode("utf-8", "ignore")
    while True:
        dl = DeadLetter(source=source, reason=reason, raw=head, location=_location(ev))
        out = envelope(dl, pod=ev.pod, engine=ev.engine, observed_at_ms=ev.observed_at_ms,
                       natural_key=("too_large", ev.event_id))
        if not head or len(encode_event(out)) + 2 <= max_message_bytes:
            return out
        head = head[: len(head) // 2]


def cut_dead_letter(ev: Envelope, raw_chars: int) -> Envelope:
    """Dead letter ``ev`` with its ``raw`` cut to its first ``raw_chars`` characters (id, reason and location
    kept: it is the same dead letter, showing less of its input), to fit a Kafka message."""
    assert isinstance(ev.payload, DeadLetter)
    return msgspec.structs.replace(ev, payload=msgspec.structs.replace(ev.payload, raw=ev.payload.raw[:raw_chars]))


def plan_messages(events: list[Envelope], *, max_events_per_message: int = 2000, namespace: str = "kvscope",
                  max_message_bytes: int | None = None,
                  splits: list[SplitBatch] | None = None) -> tuple[list[Message], list[Oversized]]:
    """Group envelopes into messages per (kind, pod), in order, at most ``max_events_per_message`` each and, when
    ``max_message_bytes`` is set, at most that many bytes of value each (the encoded JSON array, exactly as
    :func:`collector.events.encode_batch` writes it).

    A KV-event batch that alone encodes larger than ``max_message_bytes`` is sent in parts that each fit, in its
    place (:func:`split_kv_batch`; recorded in ``splits`` when given); a single block of it that alone does not
    fit, and any other envelope that alone does not, is replaced by a dead letter (:func:`oversized_dead_letter`,
    on the ``dead_letter`` topic under its pod) naming its size and the setting; those are returned as
    :class:`Oversized` (``why="setting"``) beside the messages, which carry their dead letters. A dead letter
    larger than the cap is sent with its ``raw`` cut to fit (:func:`cut_dead_letter`). ``max_message_bytes=None``:
    no byte cap (the in-process queue, imports)."""
    groups: dict[tuple[str, str], list[Envelope]] = {}
    for ev in events:
        groups.setdefault((ev.schema, ev.pod), []).append(ev)
    out: list[Message] = []
    oversized: list[Oversized] = []
    splits = [] if splits is None else splits
    data = [k for k in groups if k[0] != "dead_letter"]
    for kind, pod in data:
        out += _group_messages(kind, pod, groups, max_events_per_message, namespace, max_message_bytes, oversized,
                               splits)
    # then the dead letters, with those standing for the oversized envelopes just met
    for kind, pod in [k for k in groups if k[0] == "dead_letter"]:
        out += _group_messages(kind, pod, groups, max_events_per_message, namespace, max_message_bytes, oversized,
                               splits)
    return out, oversized


def _group_messages(kind: str, pod: str, groups: dict[tuple[str, str], list[Envelope]], max_events_per_message: int,
                    namespace: str, max_message_bytes: int | None, oversized: list[Oversized],
                    splits: list[SplitBatch]) -> list[Message]:
    """The messages of one (kind, pod) group of :func:`plan_messages`: one encode per chunk of
    ``max_events_per_message`` that fits the cap; a chunk that does not is encoded event by event
    (:func:`_fitted`) and packed by bytes (:func:`_pack`)."""
    topic, key, evs = topic_for(kind, namespace), pod.encode(), groups[(kind, pod)]
    out = []
    for i in range(0, len(evs), max_events_per_message):
        chunk = evs[i : i + max_events_per_message]
        value = encode_batch(chunk)
        if max_message_bytes is None or len(value) <= max_message_bytes:  # the common case
            out.append(Message(topic, key, value))
            continue
        parts = [enc for ev in chunk for enc in _fitted(ev, max_message_bytes, groups, oversized, splits)]
        out.extend(Message(topic, key, v) for v in _pack(parts, max_message_bytes))
    return out


def _fitted(ev: Envelope, max_message_bytes: int, groups: dict[tuple[str, str], list[Envelope]],
            oversized: list[Oversized], splits: list[SplitBatch]) -> list[bytes]:
    """``[ev encoded]``, when it fits a message alone; a dead letter with its ``raw`` cut until it does; a KV-event
    batch's parts (:func:`split_kv_batch`, recorded in ``splits``), each encoded; else []: the dead letter standing
    for ``ev`` (or for each block of a KV batch that alone does not fit) is appended to ``groups`` (its pod's dead
    letters) and recorded in ``oversized``."""
    enc = encode_event(ev)
    if isinstance(ev.payload, DeadLetter):  # already a dead letter: show less of its input
        while len(enc) + 2 > max_message_bytes and isinstance(ev.payload, DeadLetter) and ev.payload.raw:
            ev = cut_dead_letter(ev, len(ev.payload.raw) // 2)
            enc = encode_event(ev)
        return [enc]
    if len(enc) + 2 <= max_message_bytes:
        return [enc]
    if isinstance(ev.payload, KvEventBatch):
        parts, too_large = split_kv_batch(ev, max_message_bytes, len(enc) + 2, splits)
        for o in too_large:
            oversized.append(o)
            groups.setdefault((o.dead_letter.schema, o.dead_letter.pod), []).append(o.dead_letter)
        return [encode_event(p) for p in parts]
    reason = (f"{ev.schema} event of {len(enc) + 2} bytes encoded is larger than a Kafka message may be "
              f"(KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={max_message_bytes}); not sent as data. Raise the setting "
              "(and the broker's message.max.bytes / the topic's max.message.bytes) to carry events this large")
    dl = oversized_dead_letter(ev, reason, max_message_bytes)
    oversized.append(Oversized(ev.schema, ev.pod, ev.event_id, len(enc) + 2, "setting", dl))
    groups.setdefault((dl.schema, dl.pod), []).append(dl)
    return []


def split_kv_batch(ev: Envelope, max_message_bytes: int, size: int,
                   splits: list[SplitBatch]) -> tuple[list[Envelope], list[Oversized]]:
    """KV-event batch envelope ``ev`` (``size`` bytes encoded as a message, over ``max_message_bytes``, which is
    ``KVSCOPE_KAFKA_MAX_MESSAGE_BYTES``) cut into parts of at most ``max_message_bytes`` each
    (:func:`collector.kv_split.split_batch`): → (the parts, in order; an :class:`Oversized` (``why="setting"``)
    with its dead letter per single block, or event without blocks, that alone does not fit). The split is
    appended to ``splits``. Raises ValueError for a cap that leaves no room for an event."""
    cut = split_batch(ev, max_message_bytes)
    splits.append(SplitBatch(ev.pod, ev.event_id, size, tuple(p.event_id for p in cut.parts), "setting"))
    oversized = []
    for alone, alone_size in cut.too_large:
        b = alone.payload
        assert isinstance(b, KvEventBatch)
        e = b.events[0]
        what = (f"block {e.first_pos} of KV event {e.idx} ({e.type}) of batch seq {b.seq}" if e.block_hashes
                else f"KV event {e.idx} ({e.type}, no blocks) of batch seq {b.seq}")
        rest = (f"the batch's other blocks and events were, in {len(cut.parts)} part"
                f"{'' if len(cut.parts) == 1 else 's'}" if cut.parts else "the batch held nothing else")
        reason = (f"{what} alone encodes {alone_size} bytes, larger than a Kafka message may be "
                  f"(KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={max_message_bytes}); not sent as data ({rest}). Raise the "
                  "setting (and the broker's message.max.bytes / the topic's max.message.bytes) to carry blocks "
                  "this large")
        dl = oversized_dead_letter(alone, reason, max_message_bytes)
        oversized.append(Oversized(ev.schema, ev.pod, alone.event_id, alone_size, "setting", dl))
    return cut.parts, oversized


def _pack(parts: list[bytes], max_message_bytes: int) -> list[bytes]:
    """Encoded envelopes, in order, packed greedily into JSON arrays of at most ``max_message_bytes`` each (one
    larger element, which only a dead letter with nothing left to cut can be, is an array of its own)."""
    out = []
    start, size = 0, 2  # the array's brackets
    for i, part in enumerate(parts):
        grown = size + len(part) + (1 if i > start else 0)  # a comma before every element but the first
        if i > start and grown > max_message_bytes:
            out.append(b"[" + b",".join(parts[start:i]) + b"]")
            start, grown = i, 2 + len(part)
        size = grown
    if parts:
        out.append(b"[" + b",".join(parts[start:]) + b"]")
    return out


def to_messages(events: list[Envelope], max_events_per_message: int = 2000, namespace: str = "kvscope",
                max_message_bytes: int | None = None) -> list[Message]:
    """The messages of :func:`plan_messages` (envelopes grouped per (kind, pod) in order, at most
    ``max_events_per_message`` and ``max_message_bytes`` of value each; an envelope larger than the cap is
    sent as a dead letter)."""
    return plan_messages(events, max_events_per_message=max_events_per_message, namespace=namespace,
                         max_message_bytes=max_message_bytes)[0]


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
    committed by then). With nothing to send, ``on_ack`` is queued alone (:meth:`Message.ack_only`) and
    runs once everything published before it is committed: run at once, it would checkpoint a position
    past lines still in the queue, and a crash then would lose them. Raises :class:`PublishError` when the
    queue stays full for ``put_timeout_seconds``."""

    def __init__(self, q: MemoryQueue, put_timeout_seconds: float = 1.0) -> None:
        self.queue = q
        self.put_timeout_seconds = put_timeout_seconds

    def publish(self, events: list[Envelope], on_ack: Ack | None = None) -> None:
        messages = to_messages(events)
        if on_ack is not None and messages:
            last = messages[-1]
            messages[-1] = Message(last.topic, last.key, last.value, on_commit=on_ack)
        elif on_ack is not None:
            messages = [Message.ack_only(on_ack)]
        if messages and not self.queue.put_all(messages, self.put_timeout_seconds):
            raise PublishError(f"in-process queue full ({self.queue.bytes_used} of {self.queue.max_bytes} bytes)")

    def close(self) -> None:
        pass


class KafkaPublisher:
    """Distributed mode: kafka-python producer with ``acks="all"``; :meth:`publish` returns once the broker
    acknowledged every message (so the collector may then advance its own checkpoints).

    ``max_message_bytes`` caps each message's value (:func:`plan_messages`; ``KVSCOPE_KAFKA_MAX_MESSAGE_BYTES``,
    at least :data:`MIN_MAX_MESSAGE_BYTES`); the producer's ``max_request_size`` is that plus
    :data:`REQUEST_OVERHEAD_BYTES` unless given (a lower one stands for a broker whose limit is below the
    setting: the producer then refuses records with the error such a broker returns). A message refused as too
    large (``MessageSizeTooLargeError``, ``RecordListTooLargeError``) is split in halves and re-sent until it
    fits; a lone KV-event batch refused is cut in parts of half its size (down to dead-lettering the one block
    that does not fit), any other lone envelope refused is sent as a dead letter naming the setting to lower. Raises
    :class:`PublishError` when the broker cannot be reached or refuses a message for any other reason (the
    caller retries), or ValueError for a cap below the minimum.
    """

    def __init__(
        self, bootstrap: str, *, namespace: str = "kvscope", create_topics: bool = True, partitions: int = 3,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_request_size: int | None = None,
    ) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError

        if max_message_bytes < MIN_MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes={max_message_bytes}: expected at least {MIN_MAX_MESSAGE_BYTES}")
        self._kafka_error = KafkaError
        self._too_large = (MessageSizeTooLargeError, RecordListTooLargeError)
        self.namespace = namespace
        self.max_message_bytes = max_message_bytes
        try:
            if create_topics:
                ensure_topics(bootstrap, topics(namespace), partitions)
            self._producer = KafkaProducer(
                bootstrap_servers=bootstrap,
                acks="all",
                linger_ms=20,
                compression_type="gzip",
                max_request_size=max_request_size or max_message_bytes + REQUEST_OVERHEAD_BYTES,
                retries=5,
            )
        except KafkaError as exc:
            raise PublishError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc

    def publish(self, events: list[Envelope], on_ack: Ack | None = None) -> None:
        """Send every envelope (:func:`plan_messages`), wait for the broker's acknowledgement, count the
        envelopes sent as dead letters (``kvscope_collector_oversized_events_total{kind,why}``) and the KV-event
        batches sent in parts (``kvscope_collector_kv_batches_split_total{why}``: each batch once,
        :func:`batches_split`), then call ``on_ack``. Raises
        :class:`PublishError` (nothing counted, ``on_ack`` not called; the caller re-sends everything and the
        store drops what already landed)."""
        splits: list[SplitBatch] = []
        messages, oversized = plan_messages(events, namespace=self.namespace, max_message_bytes=self.max_message_bytes,
                                            splits=splits)
        try:
            while messages:
                refused = self._send(messages)
                messages = []
                for m, exc in refused:
                    parts = decode_batch(m.value)
                    if len(parts) > 1:
                        half = len(parts) // 2
                        messages += to_messages(parts[:half], namespace=self.namespace,
                                                max_message_bytes=self.max_message_bytes)
                        messages += to_messages(parts[half:], namespace=self.namespace,
                                                max_message_bytes=self.max_message_bytes)
                        continue
                    messages += self._refused_alone(parts[0], m, exc, oversized, splits)
        except self._kafka_error as exc:
            raise PublishError(f"Kafka refused a batch: {exc!r}") from exc
        for o in oversized:
            OVERSIZED.labels(o.kind, o.why).inc()
        for why in batches_split(splits).values():
            KV_SPLITS.labels(why).inc()
        if on_ack is not None:
            on_ack()

    def _send(self, messages: list[Message]) -> list[tuple[Message, Exception]]:
        """Send ``messages`` and wait for every acknowledgement; return those refused as too large (by
        kafka-python's own ``max_request_size`` check or by the broker), in order. Raises KafkaError for
        anything else."""
        refused: list[tuple[Message, Exception]] = []
        futures = []
        for m in messages:
            try:
                futures.append((m, self._producer.send(m.topic, key=m.key, value=m.value)))
            except self._too_large as exc:
                refused.append((m, exc))
        self._producer.flush()
        for m, f in futures:
            try:
                f.get(timeout=30)
            except self._too_large as exc:
                refused.append((m, exc))
        order = {id(m): i for i, m in enumerate(messages)}
        return sorted(refused, key=lambda r: order[id(r[0])])

    def _refused_alone(self, ev: Envelope, m: Message, exc: Exception, oversized: list[Oversized],
                       splits: list[SplitBatch]) -> list[Message]:
        """What to send for ``ev``, alone in message ``m`` that Kafka refused as too large: a KV-event batch of
        more than one block or event in parts of at most half its size, a block larger than that in a part of its
        own (:func:`collector.kv_split.split_batch`, recorded in ``splits``; a part refused again is cut again);
        any other envelope, or a KV batch of one block, the dead letter standing for it (recorded in
        ``oversized``); a dead letter, itself with half its ``raw``. Raises ``exc`` for a dead letter with no
        ``raw`` left (the broker takes no message that small)."""
        if isinstance(ev.payload, DeadLetter):
            if not ev.payload.raw:
                raise exc
            return to_messages([cut_dead_letter(ev, len(ev.payload.raw) // 2)], namespace=self.namespace)
        size = len(m.value)
        if isinstance(ev.payload, KvEventBatch) and units(ev.payload) > 1:
            try:  # a piece larger than half is tried alone: the broker's limit is not known
                parts = split_batch(ev, size // 2, keep_too_large=True).parts
            except ValueError:  # half of it leaves no room for an event: dead-lettered whole, below
                pass
            else:
                splits.append(SplitBatch(ev.pod, ev.event_id, size, tuple(p.event_id for p in parts), "broker"))
                return [Message(m.topic, m.key, encode_batch([p])) for p in parts]  # each part alone
        reason = (f"{ev.schema} event of {size} bytes encoded was refused by Kafka as too large "
                  f"({type(exc).__name__}): the broker's message.max.bytes or the topic's max.message.bytes is "
                  f"lower than KVSCOPE_KAFKA_MAX_MESSAGE_BYTES={self.max_message_bytes}; lower the setting below "
                  "the broker's limit (or raise the broker's)")
        dl = oversized_dead_letter(ev, reason, min(self.max_message_bytes, max(1024, size // 2)))
        oversized.append(Oversized(ev.schema, ev.pod, ev.event_id, size, "broker", dl))
        return to_messages([dl], namespace=self.namespace)

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
