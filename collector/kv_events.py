"""Source: vLLM KV-cache events over ZMQ (``--kv-events-config`` publisher "zmq") → ``KvEventBatch`` events.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ZmqEventPublisher): multipart ``[topic, seq, payload]``,
``seq`` an 8-byte big-endian int, ``payload`` msgpack of ``[ts, [event, ...], dp_rank]``. vLLM 0.32 encodes
each event as a map with ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); older releases
encode tagged arrays ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]``.
Both decode here. When the pod's endpoint has a concrete host, vLLM *connects* to it, so the collector
*binds* one SUB socket that every pod publishes to; the topic names the pod (the demo sets topic = pod name,
and ``topic_pods`` maps other topics).

Gaps: ``seq`` counts batches per publisher (one per pod and data-parallel rank, from 0 at each vLLM start), so
:class:`KvEventSubscriber` tracks each stream (topic, dp_rank). A seq past the last one + 1 is a gap
(``missed``; ``collector_restart`` for the first batch after a start, compared with the checkpoint); a seq at
or below the last one is a duplicate when its batch is not newer (batch_ts) and its seq was delivered with that
batch_ts, a dead letter when that seq was delivered with another batch or when the batch is newer by less than
:data:`MIN_RESTART_SECONDS` (two vLLM processes on one topic), else a restarted vLLM (``publisher_restart``, a gap
when its first seq seen is not 0). Gaps are fetched back from the pod's replay
socket (``collector/kv_replay.py``) and reported as ``KvEventGap`` events either way.

Bad input costs only itself: a message that is not ``[topic, seq, payload]`` with payload ``[ts, [events],
dp_rank]`` is one dead letter; inside a well-formed batch each event is decoded on its own, so a malformed event
or one of a type this kvscope does not read (a newer vLLM's) is a dead letter of its own, while the batch keeps
its other events at their positions (``KvBlockEvent.idx``) and its seq counts as delivered (no false gap).

Token ids: each delivered batch's ``BlockStored`` token ids are turned into kvscope chain hashes and a token
count (``collector/kv_chains.py``) in delivery order (replayed batches before the batch that revealed the gap),
so the ids themselves are not published.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import zmq

from collector.checkpoint import CheckpointStore
from collector.events import DeadLetter, Envelope, KvBlockEvent, KvEventBatch, KvEventGap, envelope
from collector.kv_chains import BlockChains
from collector.kv_replay import (
    BATCHES_LOST,
    BATCHES_REPLAYED,
    CONFLICTS,
    DUPLICATES,
    GAPS,
    ReplayClient,
    rank_endpoint,
)

log = logging.getLogger("kvscope.collector")

_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
KV_EVENT_TYPES = tuple(_ARRAY_FIELDS)
"""The vLLM KV event types kvscope reads; any other is dead-lettered (:func:`decode_event`)."""


class BadKvMessage(ValueError):
    """A ZMQ message that is not a vLLM KV-event batch, or one event of a batch that is not a KV event this
    kvscope reads; the exception's message is the dead-letter reason."""


_UNDECODABLE = (BadKvMessage, RecursionError, ValueError, TypeError, OverflowError)


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, BadKvMessage) else f"undecodable KV events: {exc!r}"[:500]


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 2**64:
            raise BadKvMessage(f"block hash {value} is outside 0..2**64-1")
        return value
    if isinstance(value, bytes | bytearray):  # raw digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): low 64 bits
        if len(value) < 8:  # vLLM's digests are 32 (sha256) or 16 (xxhash) bytes: a shorter one is no block hash
            raise BadKvMessage(f"block hash of {len(value)} bytes (a vLLM block digest has 16 or 32)")
        return int.from_bytes(bytes(value)[-8:], "big")
    raise BadKvMessage(f"block hash of type {type(value).__name__}")


def decode_event(raw: Any, idx: int | None = None) -> KvBlockEvent:
    """One event (map or tagged array form) → :class:`KvBlockEvent` with ``idx`` (its position in vLLM's batch).

    Raises :class:`BadKvMessage` when it is not one of the event types in :data:`KV_EVENT_TYPES` (an unknown
    ``type`` says so: a newer vLLM may publish types this kvscope does not read) or a field is malformed."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        fields = _ARRAY_FIELDS.get(raw[0])
        if fields is None:
            raise BadKvMessage(_unknown_type(raw[0]))
        raw = {"type": raw[0], **dict(zip(fields, raw[1:], strict=False))}
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise BadKvMessage(f"not a KV event: {str(raw)[:200]}")
    kind = raw["type"]
    if kind not in _ARRAY_FIELDS:
        raise BadKvMessage(_unknown_type(kind))
    if kind == "AllBlocksCleared":  # vLLM's has no fields: any other key is not read
        return KvBlockEvent(type=kind, idx=idx)
    if not isinstance(raw.get("block_hashes"), list):
        raise BadKvMessage(f"{kind} has no block_hashes list (got {_type_name(raw.get('block_hashes'))})")
    hashes = [_hash(h) for h in raw["block_hashes"]]
    medium = _text(raw, "medium")
    if kind == "BlockRemoved":  # fields of a BlockStored on it are not read
        return KvBlockEvent(type=kind, block_hashes=hashes, medium=medium, idx=idx)
    parent, token_ids, block_size = raw.get("parent_block_hash"), raw.get("token_ids"), raw.get("block_size")
    token_ids = [] if token_ids is None else token_ids  # no token ids: chain hashes unknown
    block_size = 0 if block_size is None else block_size  # 0 = unknown
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise BadKvMessage("token_ids is not a list of integers")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 <= block_size < 2**31:
        raise BadKvMessage(f"block_size {str(block_size)[:40]} is not a token count")
    lora_id = raw.get("lora_id")
    if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)):
        raise BadKvMessage(f"lora_id is {_type_name(lora_id)}, not an integer")
    event = KvBlockEvent(type=kind, block_hashes=hashes, parent_block_hash=None if parent is None else _hash(parent),
                         token_ids=token_ids, block_size=block_size, medium=medium, lora_name=_text(raw, "lora_name"),
                         idx=idx)
    if _has_extra_keys(raw):  # vLLM's hash is not the tokens' alone: kvscope's chain hash would name other blocks
        return msgspec.structs.replace(event, token_ids=[], token_count=len(token_ids),
                                       chain_hashes=[0] * len(event.block_hashes))
    return event


def _type_name(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _text(raw: dict[str, Any], key: str) -> str | None:
    """``raw[key]``: a string or None (absent). Raises :class:`BadKvMessage` for anything else."""
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise BadKvMessage(f"{key} is {_type_name(value)}, not a string")
    return value


def _has_extra_keys(raw: dict[str, Any]) -> bool:
    """True when a BlockStored's block hashes cover more than its token ids: a LoRA adapter (``lora_name``, or
    the deprecated ``lora_id``) or any per-block ``extra_keys`` entry (multimodal inputs, a ``cache_salt``,
    prompt embeddings), which vLLM adds to the hashed tuple (``vllm/v1/core/kv_cache_utils.py``
    ``generate_block_hash_extra_keys``). Raises :class:`BadKvMessage` when ``extra_keys`` is not a list."""
    extra = raw.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise BadKvMessage(f"extra_keys is {type(extra).__name__}, not a list")
    return raw.get("lora_name") is not None or raw.get("lora_id") is not None or any(k is not None for k in extra or [])


def _unknown_type(name: str) -> str:
    return (f"unknown KV event type {name[:100]!r} (a newer vLLM may publish it; this kvscope reads "
            f"{', '.join(KV_EVENT_TYPES)})")


MAX_TOPIC_BYTES = 256
"""The longest topic read: the topic names the pod (``pod`` of every row, a metric label, the Kafka key), so a
message whose first frame is longer (not a vLLM topic: another program's one-frame message, say) is a dead letter
under its first 256 bytes."""

MIN_RESTART_SECONDS = 2.0
"""A seq that goes back is a vLLM restart only when its batch is at least this much newer than the stream's last
one: a restart loads the model before the scheduler creates its publisher (``vllm/v1/core/sched/scheduler.py``),
which takes longer. Sooner, two vLLM processes publish on one topic, and the batch is dead-lettered."""

RECENT_SEQS = 1024
"""Seqs per stream whose batch_ts the subscriber keeps, to tell a duplicate from another batch under that seq."""

MAX_AHEAD_SECONDS = 3600
"""How far past the collector's clock a batch's ts (the pod's ``time.time()``) may be. vLLM stamps every batch
with its wall clock, and kvscope orders a pod's events by it: a BlockRemoved stamped in 2099 would keep its
block resident until 2099 (``kv_block_residency``), so a batch from further ahead is a dead letter."""


class DecodedBatch(NamedTuple):
    """A decoded batch payload: ``ts`` (float unix seconds, vLLM's batch time), ``events`` (the events that
    decoded, in batch order, each with its ``idx`` in the batch), ``dp_rank`` (int | None), ``bad`` (one
    ``(idx, reason, raw event as decoded from msgpack)`` per event that did not, in batch order)."""

    ts: float
    events: list[KvBlockEvent]
    dp_rank: int | None
    bad: list[tuple[int, str, Any]]


def decode_batch_payload(payload: bytes) -> DecodedBatch:
    """msgpack ``[ts, [events], dp_rank]`` → :class:`DecodedBatch`, event by event: a malformed or unknown event
    costs only itself (it goes to ``bad`` with its reason). Raises :class:`BadKvMessage` when the payload itself
    is not such an array (not msgpack, no events list, ts not a unix time in 2000..2100 or more than
    :data:`MAX_AHEAD_SECONDS` past this host's clock, dp_rank neither absent, None nor an integer 0..65535: vLLM's
    rank, whose replay port is the configured one + rank)."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadKvMessage(f"payload is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise BadKvMessage("payload is not [ts, [events], dp_rank]")
    ts = obj[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not 946684800 <= ts < 4102444800:
        raise BadKvMessage(f"batch ts {str(ts)[:40]} is not a unix time in 2000..2100")
    if ts > time.time() + MAX_AHEAD_SECONDS:
        raise BadKvMessage(f"batch ts {ts} is {ts - time.time():.0f} s ahead of the collector's clock (the pod's clock "
                           f"is wrong; at most {MAX_AHEAD_SECONDS} s ahead is read)")
    dp_rank = obj[2] if len(obj) > 2 else None
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not 0 <= dp_rank < 2**16):
        raise BadKvMessage(f"data_parallel_rank {str(dp_rank)[:40]!r} is not a rank (an integer 0..65535)")
    events: list[KvBlockEvent] = []
    bad: list[tuple[int, str, Any]] = []
    for idx, raw in enumerate(obj[1]):
        try:
            events.append(decode_event(raw, idx))
        except _UNDECODABLE as exc:
            bad.append((idx, _reason(exc), raw))
    return DecodedBatch(float(ts), events, dp_rank, bad)


def _raw_event(raw: Any) -> str:
    """A bad event as a dead letter's ``raw``: base64 of its msgpack, at most 64 KiB (a note of its type when it
    cannot be encoded again, e.g. nested too deep)."""
    try:
        return base64.b64encode(msgspec.msgpack.encode(raw))[:65536].decode()
    except (RecursionError, TypeError, ValueError, OverflowError):
        return f"unencodable event of type {type(raw).__name__}"


def message_events(frames: list[bytes], topic_pods: dict[str, str] | None = None) -> list[Envelope]:
    """One multipart ZMQ message → ``[KvEventBatch envelope, DeadLetter envelope per bad event...]``, or
    ``[DeadLetter envelope]`` when the message itself is malformed (not 3 frames, a topic over
    :data:`MAX_TOPIC_BYTES`, seq not 8 bytes, payload not ``[ts, [events], dp_rank]``).

    The batch keeps the events that decoded with their position in vLLM's batch (``KvBlockEvent.idx``, stored as
    ``kv_block_events.idx``), so its seq still advances and its rows are the same on every re-send. Each bad
    event is its own dead letter: reason ``event <idx> of the batch: <why>``, location ``zmq:<topic>:<dp_rank>:
    seq <seq>:event <idx>``, raw its msgpack in base64, event id from (topic, dp_rank, seq, ts, idx), so a
    re-sent or replayed batch dead-letters it under the same id (stored once)."""
    now_ms = int(time.time() * 1000)
    topic = frames[0][:MAX_TOPIC_BYTES].decode("utf-8", "replace").encode("utf-8", "replace").decode() if frames else ""
    pod = (topic_pods or {}).get(topic, topic or "unknown")
    try:
        if len(frames) != 3:
            raise BadKvMessage(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
        if len(frames[0]) > MAX_TOPIC_BYTES:  # the topic names the pod: it is in every row and label
            raise BadKvMessage(f"topic of {len(frames[0])} bytes (a pod's topic has at most {MAX_TOPIC_BYTES})")
        if len(frames[1]) != 8:
            raise BadKvMessage(f"seq frame has {len(frames[1])} bytes, expected 8")
        seq = int.from_bytes(frames[1], "big")
        ts, events, dp_rank, bad = decode_batch_payload(frames[2])
    except _UNDECODABLE as exc:
        raw = base64.b64encode(b"".join(frames))[:65536].decode()
        dl = DeadLetter(source="kv_events", reason=_reason(exc), raw=raw, location=f"zmq:{topic}")
        return [envelope(dl, pod=pod, natural_key=(topic, raw[:512]), observed_at_ms=now_ms)]
    engine = "" if dp_rank is None else str(dp_rank)
    batch = KvEventBatch(topic=topic, seq=seq, batch_ts=ts, dp_rank=dp_rank, events=events)
    out = [envelope(batch, pod=pod, natural_key=(topic, seq, ts), observed_at_ms=int(ts * 1000), engine=engine)]
    for idx, reason, raw_event in bad:
        dl = DeadLetter(source="kv_events", reason=f"event {idx} of the batch: {reason}", raw=_raw_event(raw_event),
                        location=f"zmq:{topic}:{engine}:seq {seq}:event {idx}")
        out.append(envelope(dl, pod=pod, natural_key=(topic, dp_rank, seq, ts, idx), observed_at_ms=int(ts * 1000),
                            engine=engine))
    return out


def checkpoint_key(topic: str, dp_rank: int | None) -> str:
    """CheckpointStore key of one KV-event stream: ``kv_events:<topic>:<dp_rank>`` (dp_rank None → empty)."""
    return f"kv_events:{topic}:{'' if dp_rank is None else dp_rank}"


@dataclass
class _Stream:
    """Where one stream (topic, dp_rank) is: last ``seq`` delivered and its ``batch_ts`` (None when restored from
    a checkpoint without one); ``restored`` = the state came from the checkpoint, no batch seen since."""

    seq: int
    batch_ts: float | None
    restored: bool = False


class KvEventSubscriber:
    """A SUB socket bound at ``endpoint`` (e.g. ``tcp://127.0.0.1:5557``) receiving from every pod, tracking each
    stream's sequence numbers and fetching what it missed from vLLM's replay socket (``collector/kv_replay.py``).

    A stream is one vLLM publisher: (topic, dp_rank). ``topic_pods`` maps topics to pod names (default: the topic
    is the pod). ``replay_endpoints`` maps pod name → the replay endpoint of its dp rank 0 (rank r: port + r);
    pods without one have their gaps reported as lost. ``checkpoints``: where :meth:`poll`'s ack stores each
    stream's last delivered position (``{"seq": int, "batch_ts": float}``, key :func:`checkpoint_key`); a new
    subscriber compares each stream's first batch with it. ``replay_timeout_seconds`` bounds the time spent per
    gap; a replay endpoint that failed is not asked again for ``replay_backoff_seconds``, doubling per failure in
    a row up to 60 s (:class:`collector.kv_replay.ReplayClient`): its gaps meanwhile are lost at once.
    ``dp_ranks``: data-parallel ranks per pod; vLLM offsets a rank's endpoint by its rank even when it connects
    (``ZmqEventPublisher.offset_endpoint_port``), so the socket binds ``endpoint`` and the next ``dp_ranks - 1``
    ports (:func:`collector.kv_replay.rank_endpoint`). Raises ``zmq.ZMQError`` when one cannot be bound (e.g.
    already bound by another socket).
    """

    def __init__(self, endpoint: str, topic_pods: dict[str, str] | None = None, max_messages: int = 1000,
                 *, checkpoints: CheckpointStore | None = None, replay_endpoints: dict[str, str] | None = None,
                 replay_timeout_seconds: float = 2.0, replay_backoff_seconds: float = 5.0,
                 dp_ranks: int = 1) -> None:
        self.endpoint = endpoint
        self.topic_pods = topic_pods or {}
        self.max_messages = max_messages
        self.checkpoints = checkpoints
        self.replay_endpoints = dict(replay_endpoints or {})
        self.replay_timeout_seconds = replay_timeout_seconds
        self.dropped: list[list[bytes]] = []  # frames discarded by the drop_next test hook
        self._drop_left = 0
        self._drop_topic: bytes | None = None
        self._streams: dict[tuple[str, int | None], _Stream] = {}
        self._delivered: dict[tuple[str, int | None], dict[int, float]] = {}  # stream → seq → batch_ts, recent
        self._polls = 0
        self._acked: dict[tuple[str, int | None], int] = {}  # stream → number of the last poll acked
        self._ack_lock = threading.Lock()
        self._replay = ReplayClient(self.replay_endpoints, lambda frames: message_events(frames, self.topic_pods),
                                    backoff_seconds=replay_backoff_seconds)
        self.chains = BlockChains()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            for rank in range(dp_ranks):  # vLLM's rank r connects to (or binds) the configured port + r
                self._sock.bind(rank_endpoint(endpoint, rank))
        except (zmq.ZMQError, ValueError):
            self._sock.close(linger=0)
            raise

    def drop_next(self, n: int, topic: str | None = None) -> None:
        """TEST HOOK (never used by the collector): discard the next ``n`` messages received, only those of
        ``topic`` when given, as if the network had lost them; their frames go to :attr:`dropped`."""
        self._drop_left = n
        self._drop_topic = None if topic is None else topic.encode()

    def poll(self, timeout_ms: int = 200) -> tuple[list[Envelope], Callable[[], None] | None]:
        """Wait up to ``timeout_ms`` for messages, then take up to ``max_messages`` waiting ones.

        Returns (envelopes, ack). Envelopes in arrival order: ``KvEventBatch`` (duplicates left out), each
        followed by a ``DeadLetter`` per event of it that did not decode (:func:`message_events`), a
        ``DeadLetter`` for an undecodable message, and before a batch that reveals a gap the ``KvEventGap`` and
        the replayed batches (``replayed=True``, ascending seq, with their dead letters); BlockStored events
        carry ``token_count`` and ``chain_hashes`` instead of their token ids (:attr:`chains`). ``ack()``
        (thread safe, call it once the envelopes are durable downstream) checkpoints each stream delivered
        here; None when there is nothing to ack. Bad input and replay failures never raise (they become dead
        letters and lost gaps).
        """
        out: list[Envelope] = []
        touched: set[tuple[str, int | None]] = set()
        if self._sock.poll(timeout_ms):
            for _ in range(self.max_messages):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if self._drop_left > 0 and (self._drop_topic is None or frames[:1] == [self._drop_topic]):
                    self._drop_left -= 1
                    self.dropped.append(frames)
                    continue
                envs = message_events(frames, self.topic_pods)
                try:
                    admitted = self._admit(envs, touched, frames)
                except Exception:  # a bug in gap tracking must not lose the batch or stop the loop
                    log.exception("KV-event gap tracking failed; batch delivered as is. pod=%s", envs[0].pod)
                    admitted = envs
                out.extend(self._hashed(admitted))
        return out, self._ack_for(touched)

    def _hashed(self, envs: list[Envelope]) -> list[Envelope]:
        """``envs`` with BlockStored token ids turned into chain hashes; a failure leaves an envelope as is
        (its token ids are then published and counted by the ingester, its chain hashes unknown)."""
        out = []
        for env in envs:
            try:
                out.append(self.chains.envelope(env))
            except Exception:  # noqa: BLE001 - hashing must never cost the batch
                log.exception("KV-event chain hashing failed; batch delivered with its token ids. pod=%s", env.pod)
                out.append(env)
        return out

    def close(self) -> None:
        self._sock.close(linger=0)

    def _admit(self, envs: list[Envelope], touched: set[tuple[str, int | None]],
               frames: list[bytes]) -> list[Envelope]:
        """The envelopes one received message (``frames``) yields (``envs``: :func:`message_events`' answer): []
        for a duplicate batch, [gap, replayed..., *envs] after a gap, one dead letter for a batch under a seq
        that the stream delivered with another batch among its last :data:`RECENT_SEQS` (a duplicate is the
        same batch: vLLM re-sends only through replay, the same bytes), else ``envs``."""
        env = envs[0]
        b = env.payload
        if not isinstance(b, KvEventBatch):
            return envs
        key = (b.topic, b.dp_rank)
        st = self._streams.get(key) or self._restore(key)
        out: list[Envelope] = []
        if st is None or b.seq == st.seq + 1:
            pass
        elif b.seq > st.seq + 1:
            out = self._recover(env.pod, b, st.seq + 1, "collector_restart" if st.restored else "missed",
                                st if st.batch_ts is not None else None)
        elif st.batch_ts is not None and b.batch_ts <= st.batch_ts:  # an older batch of the same publisher
            delivered_ts = self._delivered.get(key, {}).get(b.seq)
            if delivered_ts is not None and delivered_ts != b.batch_ts:
                return [self._conflict(env, frames, f"seq {b.seq} was already delivered with another batch (ts "
                                                    f"{delivered_ts}, this one {b.batch_ts})")]
            DUPLICATES.labels(env.pod).inc()
            return []
        elif st.batch_ts is not None and b.batch_ts - st.batch_ts < MIN_RESTART_SECONDS:  # too soon for a restart
            return [self._conflict(env, frames, f"seq went back from {st.seq} to {b.seq} "
                                                f"{b.batch_ts - st.batch_ts:.3f} s after the stream's last batch")]
        else:  # seq went back and the batch is newer: vLLM restarted (and we missed its first batches if seq > 0)
            self._delivered.pop(key, None)
            if b.seq > 0:
                out = self._recover(env.pod, b, 0, "publisher_restart", None)
        self._streams[key] = _Stream(b.seq, b.batch_ts)
        touched.add(key)
        out.extend(envs)
        delivered = self._delivered.setdefault(key, {})
        for p in (e.payload for e in out):
            if isinstance(p, KvEventBatch):
                delivered.pop(p.seq, None)
                delivered[p.seq] = p.batch_ts
        while len(delivered) > RECENT_SEQS:
            del delivered[next(iter(delivered))]
        return out

    def _conflict(self, env: Envelope, frames: list[bytes], what: str) -> Envelope:
        """The dead letter of a batch that cannot be the stream's next (``what`` says why): under a seq the stream
        already delivered with another batch, or a seq that went back too soon for a vLLM restart."""
        b = env.payload
        assert isinstance(b, KvEventBatch)
        CONFLICTS.labels(env.pod).inc()
        log.warning("KV-event batch that cannot follow its stream; dead-lettered. pod=%s topic=%s dp_rank=%s seq=%d "
                    "why=%s", env.pod, b.topic, b.dp_rank, b.seq, what)
        reason = (f"{what}: two vLLM processes publish on topic {b.topic[:100]!r} (each needs its own), or one "
                  f"restarted with its clock behind; not read")
        dl = DeadLetter(source="kv_events", reason=reason, raw=base64.b64encode(b"".join(frames))[:65536].decode(),
                        location=f"zmq:{b.topic}:{env.engine}:seq {b.seq}")
        return envelope(dl, pod=env.pod, natural_key=(b.topic, b.dp_rank, b.seq, b.batch_ts, "conflict"),
                        observed_at_ms=env.observed_at_ms, engine=env.engine)

    def _restore(self, key: tuple[str, int | None]) -> _Stream | None:
        value = self.checkpoints.get(checkpoint_key(*key)) if self.checkpoints is not None else None
        if isinstance(value, dict):
            ts = value.get("batch_ts")
            ts = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
            value = value.get("seq")
        else:
            ts = None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return _Stream(value, ts, restored=True)
        return None

    def _recover(self, pod: str, b: KvEventBatch, first: int, reason: str, verify: _Stream | None) -> list[Envelope]:
        """Replay ``first..b.seq-1`` of ``b``'s stream; → [KvEventGap envelope, replayed batches (each followed by
        the dead letters of its bad events) and the dead letter of each replayed message that does not decode,
        in seq order...]. Only decoded batches count as replayed.

        ``verify`` (the stream's last position, with its batch_ts): also fetch the last delivered batch; if vLLM
        now holds a different batch under that seq, vLLM restarted unseen (e.g. while the collector was down) and
        its seq already passed ours, so the gap is the new publisher's [0, b.seq-1] (``publisher_restart``).
        Replay takes at most ``replay_timeout_seconds`` in all; failures leave the gap lost, never raise."""
        now_ms = int(time.time() * 1000)
        deadline = time.monotonic() + self.replay_timeout_seconds
        last = b.seq - 1
        got = self._replay.batches(pod, b.topic, b.dp_rank, first - 1 if verify else first, last, deadline)
        previous = got.get(first - 1, [None])[0]
        if verify is not None and previous is not None and (not isinstance(previous.payload, KvEventBatch)
                                                            or previous.payload.batch_ts != verify.batch_ts):
            reason, first = "publisher_restart", 0
            got = self._replay.batches(pod, b.topic, b.dp_rank, 0, last, deadline)
        seqs = [s for s in sorted(got) if s >= first]
        missing, n = last - first + 1, sum(isinstance(got[s][0].payload, KvEventBatch) for s in seqs)
        outcome = "recovered" if n == missing else "partial" if n else "lost"
        GAPS.labels(pod, reason, outcome).inc()
        BATCHES_REPLAYED.labels(pod).inc(n)
        BATCHES_LOST.labels(pod).inc(missing - n)
        log.log(logging.INFO if n == missing else logging.WARNING,
                "KV-event gap. pod=%s topic=%s dp_rank=%s seqs=%d..%d reason=%s replayed=%d/%d",
                pod, b.topic, b.dp_rank, first, last, reason, n, missing)
        gap = KvEventGap(topic=b.topic, dp_rank=b.dp_rank, first_seq=first, last_seq=last, detected_at_ms=now_ms,
                         reason=reason, replayed_batches=n, recovered=n == missing)
        gap_env = envelope(gap, pod=pod, natural_key=(b.topic, b.dp_rank, first, last), observed_at_ms=now_ms,
                           engine="" if b.dp_rank is None else str(b.dp_rank))
        return [gap_env, *(e for s in seqs for e in got[s])]

    def _ack_for(self, touched: set[tuple[str, int | None]]) -> Callable[[], None] | None:
        if not touched or self.checkpoints is None:
            return None
        self._polls += 1
        poll_no, store = self._polls, self.checkpoints
        positions = {key: {"seq": self._streams[key].seq, "batch_ts": self._streams[key].batch_ts} for key in touched}

        def ack() -> None:
            with self._ack_lock:  # a late ack of an earlier poll must not move a checkpoint back
                for key, position in positions.items():
                    if self._acked.get(key, 0) < poll_no:
                        self._acked[key] = poll_no
                        store.put(checkpoint_key(*key), position)

        return ack
