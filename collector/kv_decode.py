"""Decoding vLLM KV-event messages (ZMQ, pod → collector) into envelopes: the wire format, checked field by field.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ZmqEventPublisher): multipart ``[topic, seq, payload]``,
``seq`` an 8-byte big-endian int, ``payload`` msgpack of ``[ts, [event, ...], dp_rank]``. vLLM 0.32 encodes
each event as a map with ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); older releases
encode tagged arrays ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]``.
Both decode here.

Bad input costs only itself: a message that is not ``[topic, seq, payload]`` with payload ``[ts, [events],
dp_rank]`` is one dead letter; inside a well-formed batch each event is decoded on its own, so a malformed event
or one of a type this kvscope does not read (a newer vLLM's) is a dead letter of its own, while the batch keeps
its other events at their positions (``KvBlockEvent.idx``) and its seq counts as delivered (no false gap).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from collector.events import DeadLetter, Envelope, KvBlockEvent, KvEventBatch, envelope
from collector.msgpack_split import MsgpackSplitError, split_array

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
    extra_keys = raw.get("extra_keys")
    if extra_keys is not None and not isinstance(extra_keys, list):
        raise BadKvMessage(f"extra_keys is {_type_name(extra_keys)}, not a list")
    event = KvBlockEvent(type=kind, block_hashes=hashes, parent_block_hash=None if parent is None else _hash(parent),
                         token_ids=token_ids, block_size=block_size, medium=medium, lora_name=_text(raw, "lora_name"),
                         idx=idx, extra_keys=extra_keys or None)
    return event


def _type_name(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _text(raw: dict[str, Any], key: str) -> str | None:
    """``raw[key]``: a string or None (absent). Raises :class:`BadKvMessage` for anything else."""
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise BadKvMessage(f"{key} is {_type_name(value)}, not a string")
    return value


def _unknown_type(name: str) -> str:
    return (f"unknown KV event type {name[:100]!r} (a newer vLLM may publish it; this kvscope reads "
            f"{', '.join(KV_EVENT_TYPES)})")


MAX_TOPIC_BYTES = 256
"""The longest topic read: the topic names the pod (``pod`` of every row, a metric label, the Kafka key), so a
message whose first frame is longer (not a vLLM topic: another program's one-frame message, say) is a dead letter
under its first 256 bytes."""

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
    except (msgspec.DecodeError, RecursionError) as exc:
        obj = _by_event(payload, exc)
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
        if isinstance(raw, _Undecodable):
            bad.append((idx, f"event is not msgpack: {raw.reason}"[:500], raw.raw))
            continue
        try:
            events.append(decode_event(raw, idx))
        except _UNDECODABLE as exc:
            bad.append((idx, _reason(exc), raw))
    return DecodedBatch(float(ts), events, dp_rank, bad)


@dataclass(frozen=True)
class _Undecodable:
    """An event whose own bytes msgspec refuses (invalid UTF-8 in a string, a malformed ext, a map key that is a
    map, nesting too deep), kept as its ``raw`` msgpack with the decoder's ``reason``."""

    raw: msgspec.Raw
    reason: str


def _by_event(payload: bytes, error: Exception) -> list[Any]:
    """The batch decoded again event by event after the whole payload failed to decode (``error``): the outer
    array and the events list split into their elements' bytes without decoding them
    (:func:`collector.msgpack_split.split_array`: iterative, so an event nested deeper than msgspec's recursion limit
    is split off like any other), each event decoded alone, one that fails an :class:`_Undecodable`; so a bad event
    costs only itself. Raises :class:`BadKvMessage` when the outer array or its ts, events list or rank fails too.
    Only on this failure path: a payload that decodes pays nothing."""
    try:
        parts = split_array(payload)
        if len(parts) < 2:
            raise BadKvMessage("payload is not [ts, [events], dp_rank]")
        raws = split_array(parts[1])
        head = [msgspec.msgpack.decode(parts[0]), None, *(msgspec.msgpack.decode(p) for p in parts[2:3])]
    except (MsgpackSplitError, msgspec.DecodeError, RecursionError) as exc:
        raise BadKvMessage(f"payload is not msgpack: {error}") from exc
    events: list[Any] = []
    for raw in raws:
        try:
            events.append(msgspec.msgpack.decode(raw))
        except (msgspec.DecodeError, RecursionError) as exc:
            events.append(_Undecodable(msgspec.Raw(raw), str(exc)))
    head[1] = events
    return head


def _raw_event(raw: Any) -> str:
    """A bad event as a dead letter's ``raw``: base64 of its msgpack, at most 64 KiB (a note of its type when it
    cannot be encoded again, e.g. nested too deep)."""
    try:
        return base64.b64encode(msgspec.msgpack.encode(raw))[:65536].decode()
    except (RecursionError, TypeError, ValueError, OverflowError):
        return f"unencodable event of type {type(raw).__name__}"


def batch_key(topic: str, seq: int, ts: float, dp_rank: int | None) -> tuple[object, ...]:
    """The natural key of a batch envelope (its event id, with the pod: :func:`collector.events.envelope`): (topic,
    seq, ts), and the rank for a rank other than 0. Each data-parallel rank of a pod publishes its own stream on the
    same topic, so two ranks' batches may share seq and ts; without the rank they would share one id and the
    ingester would drop the second as a redelivery of the first. Rank 0 (or none) keeps the key of the releases
    before the rank was in it, so a batch re-sent across an upgrade still finds the copy stored before it."""
    return (topic, seq, ts) if not dp_rank else (topic, seq, ts, dp_rank)


def message_events(frames: list[bytes], topic_pods: dict[str, str] | None = None) -> list[Envelope]:
    """One multipart ZMQ message → ``[KvEventBatch envelope, DeadLetter envelope per bad event...]``, or
    ``[DeadLetter envelope]`` when the message itself is malformed (not 3 frames, a topic over
    :data:`MAX_TOPIC_BYTES` or not UTF-8, seq not 8 bytes, payload not ``[ts, [events], dp_rank]``).

    The batch keeps the events that decoded with their position in vLLM's batch (``KvBlockEvent.idx``, stored as
    ``kv_block_events.idx``), so its seq still advances and its rows are the same on every re-send. Each bad
    event is its own dead letter: reason ``event <idx> of the batch: <why>``, location ``zmq:<topic>:<dp_rank>:
    seq <seq>:event <idx>``, raw its msgpack in base64, event id from (topic, dp_rank, seq, ts, idx), so a
    re-sent or replayed batch dead-letters it under the same id (stored once). The batch's event id:
    :func:`batch_key`."""
    now_ms = int(time.time() * 1000)
    topic = frames[0][:MAX_TOPIC_BYTES].decode("utf-8", "replace").encode("utf-8", "replace").decode() if frames else ""
    pod = (topic_pods or {}).get(topic, topic or "unknown")
    try:
        if len(frames) != 3:
            raise BadKvMessage(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
        if len(frames[0]) > MAX_TOPIC_BYTES:  # the topic names the pod: it is in every row and label
            raise BadKvMessage(f"topic of {len(frames[0])} bytes (a pod's topic has at most {MAX_TOPIC_BYTES})")
        try:
            frames[0].decode("utf-8")
        except UnicodeDecodeError as exc:  # with U+FFFD for its bad bytes, two such topics would name one pod
            raise BadKvMessage(f"topic is not UTF-8 ({exc.reason} at byte {exc.start}): it names no pod") from exc
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
    out = [envelope(batch, pod=pod, natural_key=batch_key(topic, seq, ts, dp_rank), observed_at_ms=int(ts * 1000),
                    engine=engine)]
    for idx, reason, raw_event in bad:
        dl = DeadLetter(source="kv_events", reason=f"event {idx} of the batch: {reason}", raw=_raw_event(raw_event),
                        location=f"zmq:{topic}:{engine}:seq {seq}:event {idx}")
        out.append(envelope(dl, pod=pod, natural_key=(topic, dp_rank, seq, ts, idx), observed_at_ms=int(ts * 1000),
                            engine=engine))
    return out
