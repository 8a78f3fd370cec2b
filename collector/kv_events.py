"""Source: vLLM KV-cache events over ZMQ (``--kv-events-config`` publisher "zmq") → ``KvEventBatch`` events.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ZmqEventPublisher): multipart ``[topic, seq, payload]``,
``seq`` an 8-byte big-endian int, ``payload`` msgpack of ``[ts, [event, ...], dp_rank]``. vLLM 0.32 encodes
each event as a map with ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); older releases
encode tagged arrays ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]``.
Both decode here. When the pod's endpoint has a concrete host, vLLM *connects* to it, so the collector
*binds* one SUB socket that every pod publishes to; the topic names the pod (the demo sets topic = pod name,
and ``topic_pods`` maps other topics).
"""

from __future__ import annotations

import base64
import time
from typing import Any

import msgspec
import zmq

from collector.events import DeadLetter, Envelope, KvBlockEvent, KvEventBatch, envelope

_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class BadKvMessage(ValueError):
    """A ZMQ message that is not a vLLM KV-event batch; the message is the dead-letter reason."""


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 2**64:
            raise BadKvMessage(f"block hash {value} is outside 0..2**64-1")
        return value
    if isinstance(value, bytes | bytearray):  # raw digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): low 64 bits
        return int.from_bytes(bytes(value)[-8:], "big")
    raise BadKvMessage(f"block hash of type {type(value).__name__}")


def decode_event(raw: Any) -> KvBlockEvent:
    """One event (map or tagged array form) → :class:`KvBlockEvent`. Raises :class:`BadKvMessage`."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        fields = _ARRAY_FIELDS.get(raw[0])
        if fields is None:
            raise BadKvMessage(f"unknown KV event type {raw[0]!r}")
        raw = {"type": raw[0], **dict(zip(fields, raw[1:], strict=False))}
    if not isinstance(raw, dict) or raw.get("type") not in _ARRAY_FIELDS:
        raise BadKvMessage(f"not a KV event: {str(raw)[:200]}")
    parent = raw.get("parent_block_hash")
    token_ids = raw.get("token_ids") or []
    hashes = raw.get("block_hashes") or []
    block_size = raw.get("block_size") or 0
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise BadKvMessage("token_ids is not a list of integers")
    if not isinstance(hashes, list):
        raise BadKvMessage("block_hashes is not a list")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 <= block_size < 2**31:
        raise BadKvMessage(f"block_size {str(block_size)[:40]} is not a token count")
    for key in ("medium", "lora_name"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise BadKvMessage(f"{key} is {type(raw[key]).__name__}, not a string")
    return KvBlockEvent(
        type=raw["type"],
        block_hashes=[_hash(h) for h in hashes],
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=token_ids,
        block_size=block_size,
        medium=raw.get("medium"),
        lora_name=raw.get("lora_name"),
    )


def decode_batch_payload(payload: bytes) -> tuple[float, list[KvBlockEvent], int | None]:
    """msgpack ``[ts, [events], dp_rank]`` → (ts seconds, events, dp_rank). Raises :class:`BadKvMessage`."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadKvMessage(f"payload is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise BadKvMessage("payload is not [ts, [events], dp_rank]")
    ts = obj[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not 946684800 <= ts < 4102444800:
        raise BadKvMessage(f"batch ts {str(ts)[:40]} is not a unix time in 2000..2100")
    dp_rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) and not isinstance(obj[2], bool) else None
    return float(ts), [decode_event(e) for e in obj[1]], dp_rank


def message_event(frames: list[bytes], topic_pods: dict[str, str] | None = None) -> Envelope:
    """One multipart ZMQ message → ``KvEventBatch`` envelope, or ``DeadLetter`` envelope with the reason."""
    now_ms = int(time.time() * 1000)
    topic = frames[0].decode("utf-8", "replace").encode("utf-8", "replace").decode() if frames else ""
    pod = (topic_pods or {}).get(topic, topic or "unknown")
    try:
        if len(frames) != 3:
            raise BadKvMessage(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
        if len(frames[1]) != 8:
            raise BadKvMessage(f"seq frame has {len(frames[1])} bytes, expected 8")
        seq = int.from_bytes(frames[1], "big")
        ts, events, dp_rank = decode_batch_payload(frames[2])
    except (BadKvMessage, RecursionError, ValueError, TypeError, OverflowError) as exc:
        raw = base64.b64encode(b"".join(frames))[:65536].decode()
        reason = str(exc) if isinstance(exc, BadKvMessage) else f"undecodable KV events: {exc!r}"[:500]
        dl = DeadLetter(source="kv_events", reason=reason, raw=raw, location=f"zmq:{topic}")
        return envelope(dl, pod=pod, natural_key=(topic, raw[:512]), observed_at_ms=now_ms)
    batch = KvEventBatch(topic=topic, seq=seq, batch_ts=ts, dp_rank=dp_rank, events=events)
    return envelope(batch, pod=pod, natural_key=(topic, seq, ts), observed_at_ms=int(ts * 1000),
                    engine="" if dp_rank is None else str(dp_rank))


class KvEventSubscriber:
    """A SUB socket bound at ``endpoint`` (e.g. ``tcp://127.0.0.1:5557``) receiving from every pod.

    ``poll(timeout_ms)`` returns the envelopes of the messages waiting (up to ``max_messages``).
    """

    def __init__(self, endpoint: str, topic_pods: dict[str, str] | None = None, max_messages: int = 1000):
        self.endpoint = endpoint
        self.topic_pods = topic_pods or {}
        self.max_messages = max_messages
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.bind(endpoint)

    def poll(self, timeout_ms: int = 200) -> list[Envelope]:
        out: list[Envelope] = []
        if not self._sock.poll(timeout_ms):
            return out
        while len(out) < self.max_messages:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(message_event(frames, self.topic_pods))
        return out

    def close(self) -> None:
        self._sock.close(linger=0)
