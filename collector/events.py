"""The event contract: what the collector publishes and the ingester consumes (collector → Kafka → ingest).

Every event is an :class:`Envelope` around one payload kind. Envelopes travel in batches: one Kafka message
(or one in-process queue item) carries ``list[Envelope]`` encoded as JSON by :func:`encode_batch`, because
kafka-python tops out at ~10k messages/s here (docs/environment.md) while one scrape or
one KV-event batch already holds hundreds of facts.

Rules:
- ``event_id`` is derived from the source's natural key (:func:`make_event_id`), so a re-send after a crash
  carries the same id and the store deduplicates on it.
- Topics are ``kvscope.<kind>.v<major>``, keyed by pod.
- Within a major version only optional fields with defaults are added; decoders ignore unknown fields;
  an unknown ``schema`` or ``schema_version`` is a contract violation (dead-lettered by the ingester).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec

SCHEMA_VERSION = 1


class SeriesSample(msgspec.Struct, frozen=True, array_like=True):
    """One kept series of a vLLM ``/metrics`` scrape (the allowlist: collector/vllm_metrics.py ``KEEP``).

    Fields: ``name`` (str, the exposed sample name, e.g. ``vllm:prefix_cache_hits_total`` or
    ``vllm:time_to_first_token_seconds_bucket``), ``engine`` (str, vLLM's DP engine label, "" if absent),
    ``model_name`` (str, "" if absent), ``label`` (str, the one label that tells the series of a family apart:
    ``le`` of a histogram bucket, ``finished_reason``, ``source``; "" if none), ``value`` (float, the value as
    exposed: cumulative for counters, current for gauges; unit of the metric: tokens, seconds, requests,
    fraction), ``increase`` (float, counters: how much the series grew since the collector's previous sample
    of it, restart-aware: after a restart, the new value; gauges: 0). Encoded as an array (compact on the
    wire: a scrape carries ~100 of them).
    """

    name: str
    engine: str
    model_name: str
    label: str
    value: float
    increase: float = 0.0


class VllmScrape(msgspec.Struct, frozen=True, tag="vllm_scrape"):
    """One successful scrape of one pod's ``/metrics``, reduced to the series kvscope reads, with the
    counter increases the collector computed from its previous sample (held in memory and checkpointed).

    Fields: ``target`` (str, the URL scraped), ``scraped_at_ms`` (int, unix ms when the response arrived),
    ``previous_scraped_at_ms`` (int, unix ms of the sample the increases are taken from; on a pod's first scrape,
    the pod's watch start when a series born after it was counted from 0, else 0: a baseline), ``duration_ms``
    (float, round trip), ``samples`` (list[SeriesSample]: every kept gauge, and every kept counter whose increase
    is not 0), ``cache_config`` (dict engine → the labels of its ``vllm:cache_config_info``: block_size,
    num_gpu_blocks, kv_cache_memory_bytes, ...; present on the collector's first scrape of the pod and whenever
    they change, {} otherwise), ``restarts`` (list[str]: each engine whose counters restarted since the previous
    scrape).
    Natural key: (pod, scraped_at_ms): a re-sent scrape keeps its id and is stored once.
    """

    target: str
    scraped_at_ms: int
    previous_scraped_at_ms: int
    duration_ms: float
    samples: list[SeriesSample]
    cache_config: dict[str, dict[str, str]] = {}
    restarts: list[str] = []


class GatewayRequest(msgspec.Struct, frozen=True, tag="gateway_request"):
    """One line of the gateway fingerprint log (schema: ``gateway/gateway_log.v1.schema.json``).

    ``record`` is the log object as written by the gateway (request_id, ts, tenant_id, segment hashes and
    token counts, prompt/cached/completion tokens, ttft_ms, ...); ``source_file`` and ``line_offset`` say
    where it was read (bytes offset of the line's start), for dead letters and checkpoints.
    Natural key: (``record["request_id"]``, ``record["ts"]``).
    """

    record: dict[str, Any]
    source_file: str = ""
    line_offset: int = -1


class KvBlockEvent(msgspec.Struct, frozen=True):
    """One vLLM KV-cache event (``vllm/distributed/kv_events.py``: BlockStored, BlockRemoved, AllBlocksCleared).

    Fields: ``type`` (``BlockStored`` | ``BlockRemoved`` | ``AllBlocksCleared``), ``block_hashes``
    (list[int], low 64 bits of each block hash as vLLM publishes them with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), ``parent_block_hash`` (int | None), ``token_ids``
    (list[int], BlockStored only; the collector empties it once it has hashed them, see
    ``collector/kv_chains.py``), ``block_size`` (int tokens, BlockStored only), ``medium``
    (``GPU``/``CPU``/... or None), ``lora_name`` (str | None), ``token_count`` (int tokens the event covered,
    None = not counted yet: then ``len(token_ids)``), ``chain_hashes`` (list[int], BlockStored: kvscope's chain
    hash of each block, parallel to ``block_hashes``, 0 = unknown; :func:`kvscope.block_hash.chain_hashes`;
    empty when the producer did not compute them), ``idx`` (int, the event's position in vLLM's batch, from 0,
    which a batch keeps when events before it were dead-lettered; None = its position in ``events``, as an
    older collector published it), ``extra_keys`` (BlockStored as vLLM published it: per block None or the
    untagged keys, LoRA name, ``(mm_identifier, offset)`` pairs, the cache_salt string, prompt-embeds digests;
    read only to compute ``chain_hashes`` and emptied with the token ids, so a salt never leaves the collector),
    ``first_pos`` (int, the position of its first block in vLLM's event: 0, unless the event is a piece of one
    cut between blocks to fit a Kafka message, ``collector/kv_split.py``; kv_block_log's ``pos``).
    """

    type: str
    block_hashes: list[int] = []
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    token_count: int | None = None
    chain_hashes: list[int] = []
    idx: int | None = None
    extra_keys: list[Any] | None = None
    first_pos: int = 0


class KvEventBatch(msgspec.Struct, frozen=True, tag="kv_event_batch"):
    """One ZMQ message of vLLM KV events from one pod: ``[ts, [events...], dp_rank]`` decoded.

    Fields: ``topic`` (str, the ZMQ topic), ``seq`` (int, vLLM's per-publisher sequence number),
    ``batch_ts`` (float, unix seconds set by vLLM), ``dp_rank`` (int | None, data-parallel rank = engine),
    ``events`` (list[KvBlockEvent]: the events that decoded, each with its ``idx`` in vLLM's batch; each one
    that did not is a separate ``DeadLetter``), ``replayed`` (bool, fetched from vLLM's replay socket),
    ``continued`` (bool: a part of a batch too large for one Kafka message other than its first,
    ``collector/kv_split.py``; such a part does not mark a vLLM start). Natural key: (pod, topic, seq, batch_ts);
    a part's: the batch's id and the range of events and blocks it holds.
    """

    topic: str
    seq: int
    batch_ts: float
    dp_rank: int | None
    events: list[KvBlockEvent]
    replayed: bool = False
    continued: bool = False


#: The reasons a gap report may give (:class:`KvEventGap`), the only ones a collector makes; the ingester
#: dead-letters a report with any other (ingest/rows.py ``kv_gap_row``): the ``kv_gaps`` view and the cache-reset
#: reads (sql/migrations/0017, 0022, 0030) tell a restart from a miss by this value.
GAP_REASONS = ("missed", "collector_restart", "publisher_restart")


class KvEventGap(msgspec.Struct, frozen=True, tag="kv_event_gap"):
    """A run of vLLM KV-event batches (sequence numbers) of one pod and engine that the collector did not
    receive live, and what became of it.

    Fields: ``topic`` (str, the ZMQ topic), ``dp_rank`` (int | None, the engine), ``first_seq`` and
    ``last_seq`` (int, the missing sequence numbers, inclusive), ``detected_at_ms`` (int, unix ms),
    ``reason`` (``missed`` = a later seq arrived first; ``collector_restart`` = the checkpointed seq and the
    first seq after a restart are apart; ``publisher_restart`` = vLLM restarted and its first batch seen was
    not seq 0), ``replayed_batches`` (int, batches recovered from vLLM's replay socket), ``recovered``
    (bool, every missing batch was replayed), ``prev_batch_ts`` (float | None, unix seconds: vLLM's ts of the
    stream's last batch the collector delivered before the gap, None when unknown, e.g. restored from a checkpoint
    written without it) and ``next_batch_ts`` (float | None: the ts of the batch that revealed the gap; None from
    a collector older than these fields). The missing batches were published between the two, so a reader can
    tell which of them the store already holds (the ``kv_gaps`` view, sql/migrations/0030). Natural key: (pod,
    topic, dp_rank, first_seq, last_seq).
    """

    topic: str
    dp_rank: int | None
    first_seq: int
    last_seq: int
    detected_at_ms: int
    reason: str
    replayed_batches: int = 0
    recovered: bool = False
    prev_batch_ts: float | None = None
    next_batch_ts: float | None = None


class DeadLetter(msgspec.Struct, frozen=True, tag="dead_letter"):
    """Input the collector could not turn into an event, kept with its reason so nothing is silently lost.

    Fields: ``source`` (``vllm_metrics`` | ``gateway_log`` | ``kv_events`` | ``ingest`` | ``workload_labels``),
    ``reason`` (one sentence), ``raw`` (str, the offending input, truncated to 64 KiB), ``location`` (str: file:offset,
    URL, or topic:seq). Natural key: (source, location, raw).
    """

    source: str
    reason: str
    raw: str
    location: str = ""


Payload = VllmScrape | GatewayRequest | KvEventBatch | KvEventGap | DeadLetter

KINDS: dict[str, type] = {
    "vllm_scrape": VllmScrape,
    "gateway_request": GatewayRequest,
    "kv_event_batch": KvEventBatch,
    "kv_event_gap": KvEventGap,
    "dead_letter": DeadLetter,
}


class Envelope(msgspec.Struct, frozen=True):
    """What every event shares.

    Fields: ``schema`` (kind name, one of :data:`KINDS`), ``schema_version`` (int major), ``event_id``
    (str, 32 hex chars, deterministic: :func:`make_event_id`), ``pod`` (str, source pod name), ``engine``
    (str, vLLM DP engine index or ``""``), ``observed_at_ms`` (int, unix ms when the source observed it),
    ``payload`` (one of the kinds above, tagged by ``schema``).
    """

    schema: str
    schema_version: int
    event_id: str
    pod: str
    engine: str
    observed_at_ms: int
    payload: Payload


def make_event_id(kind: str, *natural_key: object) -> str:
    """Deterministic event id: first 128 bits of SHA-256 over the kind and the natural key, as 32 hex chars."""
    h = hashlib.sha256(kind.encode())
    for part in natural_key:
        h.update(b"\x1f")
        h.update(str(part).encode())
    return h.hexdigest()[:32]


def topic_for(kind: str, namespace: str = "kvscope") -> str:
    """Kafka topic of an event kind: ``<namespace>.<kind>.v<major>`` (namespace ``kvscope`` by default)."""
    return f"{namespace}.{kind}.v{SCHEMA_VERSION}"


def topics(namespace: str = "kvscope") -> list[str]:
    """Every topic of the contract under ``namespace``."""
    return [topic_for(k, namespace) for k in KINDS]


def envelope(payload: Payload, *, pod: str, natural_key: tuple[object, ...], observed_at_ms: int,
             engine: str = "") -> Envelope:
    """Wrap a payload; the kind comes from the payload's tag and the id from ``natural_key``."""
    kind = type(payload).__struct_config__.tag
    assert isinstance(kind, str)
    return Envelope(schema=kind, schema_version=SCHEMA_VERSION, event_id=make_event_id(kind, pod, *natural_key),
                    pod=pod, engine=engine, observed_at_ms=observed_at_ms, payload=payload)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(list[Envelope])


class ContractError(ValueError):
    """A message that does not decode as a batch of known envelopes (unknown kind or version, bad field)."""


def encode_batch(events: list[Envelope]) -> bytes:
    """Encode envelopes as one JSON array (the value of one Kafka message)."""
    return _encoder.encode(events)


def encode_event(event: Envelope) -> bytes:
    """Encode one envelope as JSON: an element of :func:`encode_batch`'s array, which is exactly
    ``b"[" + b",".join(encode_event(e) for e in events) + b"]"`` (so a batch's size is known before it is built)."""
    return _encoder.encode(event)


_parts_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_envelope_decoder = msgspec.json.Decoder(Envelope)


@dataclass(frozen=True)
class BadEnvelope:
    """One element of a message's array that is not a valid envelope: its ``index`` in the array, its ``raw`` JSON
    bytes and the ``reason`` (what the decoder said)."""

    index: int
    raw: bytes
    reason: str


def decode_parts(data: bytes) -> list[Envelope | BadEnvelope]:
    """Decode one Kafka message value envelope by envelope (after :func:`decode_batch` refused it whole): each
    element of the JSON array is an :class:`Envelope` or, when it is not a valid one, a :class:`BadEnvelope`, so
    one bad envelope (another producer's, a value the encoder wrote as ``null``) costs only itself. Raises
    :class:`ContractError` when the bytes are not a JSON array at all."""
    try:
        parts = _parts_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ContractError(f"not a batch of kvscope envelopes: {exc}") from exc
    out: list[Envelope | BadEnvelope] = []
    for i, raw in enumerate(parts):
        try:
            ev = _envelope_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            out.append(BadEnvelope(i, bytes(raw), f"envelope {i} of the message is not a kvscope envelope: {exc}"))
            continue
        if ev.schema_version != SCHEMA_VERSION:
            out.append(BadEnvelope(i, bytes(raw), f"unsupported schema_version {ev.schema_version} for {ev.schema}"))
            continue
        out.append(ev)
    return out


def decode_batch(data: bytes) -> list[Envelope]:
    """Decode one Kafka message value.

    Raises :class:`ContractError` when the bytes are not a JSON array of envelopes of known kinds, or an
    envelope has a ``schema_version`` other than :data:`SCHEMA_VERSION`. Unknown fields are ignored.
    """
    try:
        events = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ContractError(f"not a batch of kvscope envelopes: {exc}") from exc
    for ev in events:
        if ev.schema_version != SCHEMA_VERSION:
            raise ContractError(f"unsupported schema_version {ev.schema_version} for {ev.schema}")
    return events
