"""Row mapping: one envelope → rows of one table (ingest's half of the event contract).

Each table's columns are listed once here (:data:`COLUMNS`); a contract test checks that every table has
the columns written. Timestamps are written as timezone-aware UTC datetimes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import msgspec

from collector.events import (
    GAP_REASONS,
    DeadLetter,
    Envelope,
    GatewayRequest,
    KvBlockEvent,
    KvEventBatch,
    KvEventGap,
    VllmScrape,
    make_event_id,
)
from collector.gateway_record import EARLIEST, LATEST, record_from_builtins, record_usage, ts_ms
from collector.kv_decode import KV_EVENT_TYPES
from ingest.errors import ContractViolation

GATEWAY_STR = ("conversation_id", "agent_run_id", "model", "pod", "endpoint", "routing_policy", "routing_reason",
               "error", "system_hash", "system_norm_hash", "tools_hash", "tools_canonical_hash",
               "retrieval_pack_hash", "retrieval_set_hash", "history_prefix_hash", "prev_history_hash",
               "prev_suffix_hash", "next_history_hash", "first_message_hash", "prefill_history_hash", "suffix_hash",
               "prompt_fingerprint", "token_count_method", "cache_salt_hash")
GATEWAY_INT = ("status", "completion_tokens", "system_tokens", "tools_tokens", "retrieval_tokens",
               "history_tokens", "suffix_tokens")

#: The hash arrays, stored as UInt64 (the log's hex): the block chain (sql/migrations/0018) and the structural
#: arrays (0020, whose token counts are UInt32).
GATEWAY_HASH_LISTS = ("prompt_block_hashes", "system_line_hashes", "suffix_chunk_hashes")
GATEWAY_INT_LISTS = ("system_line_tokens", "suffix_chunk_tokens")

COLUMNS: dict[str, tuple[str, ...]] = {
    "gateway_requests": ("request_id", "ts", "tenant_id", *GATEWAY_STR, "pods_down", "stream",
                         "skip_reading_prefix_cache", "continue_final_message", "engine_requests",
                         *GATEWAY_INT, "prompt_tokens",
                         "cached_tokens", "ttft_ms", "e2e_ms", "queue_wait_ms", "tool_latency_ms",
                         *GATEWAY_HASH_LISTS, "prompt_block_size", *GATEWAY_INT_LISTS),
    "vllm_metrics": ("ts", "pod", "engine", "model_name", "name", "label", "value", "increase"),
    "vllm_cache_config": ("ts", "pod", "engine", "labels"),
    "kv_block_events": ("event_id", "ts", "pod", "engine", "seq", "idx", "event_type", "block_hashes",
                        "parent_block_hash", "token_count", "block_size", "medium", "chain_hashes", "first_pos",
                        "continued"),
    "kv_event_gaps": ("event_id", "detected_at", "pod", "engine", "first_seq", "last_seq", "reason",
                      "replayed_batches", "recovered", "prev_batch_ts", "next_batch_ts"),
    "dead_letters": ("event_id", "ts", "source", "pod", "reason", "location", "raw"),
}


def _dt(ms: int | float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def gateway_row(ev: Envelope, p: GatewayRequest) -> tuple[Any, ...]:
    """The ``gateway_requests`` row of a record: its fields as :class:`collector.gateway_record.GatewayRecord`
    holds them (absent fields already hold their "none" value). The record is read through that contract
    again because an envelope may come from any producer; raises ``BadRecord`` (a ContractViolation in
    :func:`rows_for`) when it breaks it. Token counts are stored OpenAI-inclusive
    (:func:`collector.gateway_record.inclusive_usage`); ``cached_tokens`` None when not reported;
    ``prompt_block_hashes`` and the structural hashes as UInt64 (the log's 16 hex characters as an unsigned int)."""
    rec = record_from_builtins(p.record)
    prompt, cached = record_usage(rec)
    return (rec.request_id, _dt(ts_ms(rec)), rec.tenant_id, *(getattr(rec, k) for k in GATEWAY_STR),
            list(rec.pods_down), rec.stream, rec.skip_reading_prefix_cache, rec.continue_final_message,
            rec.engine_requests,
            *(getattr(rec, k) for k in GATEWAY_INT), prompt, cached,
            rec.ttft_ms, rec.e2e_ms, rec.queue_wait_ms, rec.tool_latency_ms,
            *([int(x, 16) for x in getattr(rec, k)] for k in GATEWAY_HASH_LISTS), rec.prompt_block_size,
            *(list(getattr(rec, k)) for k in GATEWAY_INT_LISTS))


def scrape_ts(p: VllmScrape) -> datetime:
    """A scrape's time (``scraped_at_ms``, unix ms) as stored; raises ValueError when it is not a time in
    2000..2100 UTC (the range of the gateway records, KV batches and gap reports: :func:`_batch_ts`), since
    an envelope may come from any producer (a scrape stamped in 2500 was stored, past what ``toDateTime``, which
    the TTLs and rollups use, can hold)."""
    ms = p.scraped_at_ms
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
        raise ValueError(f"scraped_at_ms {str(ms)[:40]} is not a unix time (ms)")
    dt = _batch_ts("scraped_at_ms", ms / 1000)
    assert dt is not None
    return dt


def metric_rows(ev: Envelope, p: VllmScrape) -> list[tuple[Any, ...]]:
    """``vllm_metrics`` rows of a scrape, one per sample; raises ValueError on a time :func:`scrape_ts` refuses."""
    ts = scrape_ts(p)
    return [(ts, ev.pod, x.engine, x.model_name, x.name, x.label, x.value, x.increase) for x in p.samples]


def cache_config_rows(ev: Envelope, p: VllmScrape) -> list[tuple[Any, ...]]:
    """``vllm_cache_config`` rows of a scrape, one per engine; raises ValueError as :func:`metric_rows`."""
    ts = scrape_ts(p)
    return [(ts, ev.pod, engine, labels) for engine, labels in sorted(p.cache_config.items())]


def kv_rows(ev: Envelope, p: KvEventBatch) -> list[tuple[Any, ...]]:
    """One ``kv_block_events`` row per event of the batch. ``idx``: the event's position in vLLM's batch
    (``KvBlockEvent.idx``), else in ``events`` (an older collector); ``token_count``: the collector's count,
    else the token ids carried (an older collector); ``chain_hashes``: one per block hash when the collector
    computed them, else [] (unknown; collector/kv_chains.py); ``first_pos``: where the event's first block was
    in vLLM's event (a piece of one cut between blocks, collector/kv_split.py); ``continued``: 1 for a part of a
    split batch other than its first (it marks no vLLM start, sql/migrations/0029).

    Raises ValueError (a ContractViolation in :func:`rows_for`) for a batch no collector makes
    (:func:`kv_batch_problem`); an event no collector makes is left out (:func:`kv_event_problem`: it is a dead
    letter of its own, :func:`kv_dead_letter_rows`)."""
    ts = _kv_batch_ts(p)
    engine = "" if p.dp_rank is None else str(p.dp_rank)
    return [(ev.event_id, ts, ev.pod, engine, p.seq, i if e.idx is None else e.idx, e.type, e.block_hashes,
             e.parent_block_hash, len(e.token_ids) if e.token_count is None else e.token_count, e.block_size,
             e.medium or "", e.chain_hashes if len(e.chain_hashes) == len(e.block_hashes) else [], e.first_pos,
             int(p.continued))
            for i, e in enumerate(p.events) if kv_event_problem(e) is None]


#: kv_block_log's ``pos`` (a block's position in its vLLM event, ``first_pos`` + its place in the row) is UInt32.
MAX_POS = 2**32 - 1

#: kv_block_events' seq, idx, token_count and block hashes are UInt64, UInt32, UInt32 and UInt64 (sql/migrations/0003).
MAX_SEQ = 2**64 - 1
MAX_UINT32 = 2**32 - 1
MAX_HASH = 2**64 - 1
#: A data-parallel rank as the collector reads it (collector/kv_decode.py: vLLM's replay port is the configured one +
#: rank).
MAX_DP_RANK = 2**16 - 1
#: A block's tokens as the collector reads them (collector/kv_decode.py).
MAX_BLOCK_SIZE = 2**31 - 1


def _count(value: Any, top: int) -> bool:
    """Whether ``value`` is an integer (not a bool) in 0..``top``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= top


def kv_batch_problem(p: KvEventBatch) -> str | None:
    """Why batch ``p`` is none a collector makes, or None: a ``seq`` outside 0..2^64-1 (vLLM's is an unsigned 64-bit
    count: a query that looks the batch up as UInt64 would fail, and fail again on every retry), a ``batch_ts`` that
    is not a finite unix time in 2000..2100 UTC (the gateway records' and gap reports' range: DateTime, which the TTLs
    and rollups read, ends in 2106 and wraps), a ``dp_rank`` neither None nor 0..65535 (collector/kv_decode.py)."""
    if not _count(p.seq, MAX_SEQ):
        return f"seq {str(p.seq)[:40]} is outside 0..2**64-1 (vLLM's seq is an unsigned 64-bit count)"
    try:
        _batch_ts("batch_ts", p.batch_ts)
    except ValueError as exc:
        return str(exc)
    if p.dp_rank is not None and not _count(p.dp_rank, MAX_DP_RANK):
        return f"dp_rank {str(p.dp_rank)[:40]} is not a data-parallel rank (an integer 0..{MAX_DP_RANK}, or none)"
    return None


def _kv_batch_ts(p: KvEventBatch) -> datetime:
    """Batch ``p``'s ts as stored (milliseconds, UTC); raises ValueError for a batch :func:`kv_batch_problem`
    refuses."""
    problem = kv_batch_problem(p)
    if problem is not None:
        raise ValueError(problem)
    return _dt(p.batch_ts * 1000)


def _hashes_problem(name: str, hashes: list[int]) -> str | None:
    """Why ``hashes`` (ints: msgspec decoded them as ``list[int]``) hold no UInt64, or None: one min and max in C
    per event (every block of every KV event passes here), the offending value looked for only when they fail."""
    if not hashes or (min(hashes) >= 0 and max(hashes) <= MAX_HASH):
        return None
    bad = next(h for h in hashes if not _count(h, MAX_HASH))
    return f"{name} holds {str(bad)[:40]}, outside 0..2**64-1"


def kv_event_problem(e: KvBlockEvent) -> str | None:
    """Why event ``e`` cannot be stored, or None when it can: a type kvscope does not read (not one of
    :data:`collector.kv_decode.KV_EVENT_TYPES`: readers would take it for neither a store nor a removal), a block,
    parent or chain hash outside 0..2^64-1, an ``idx``, ``token_count`` or ``block_size`` that is no count its
    column holds, or blocks that cannot be placed in kv_block_log (a position past :data:`MAX_POS` would wrap to 0
    and land on another block's)."""
    if e.type not in KV_EVENT_TYPES:
        return (f"unknown KV event type {str(e.type)[:100]!r} (this kvscope reads {', '.join(KV_EVENT_TYPES)})")
    problem = _hashes_problem("block_hashes", e.block_hashes) or _hashes_problem("chain_hashes", e.chain_hashes)
    if problem is not None:
        return problem
    if e.parent_block_hash is not None and not _count(e.parent_block_hash, MAX_HASH):
        return f"parent_block_hash {str(e.parent_block_hash)[:40]} is outside 0..2**64-1"
    if e.idx is not None and not _count(e.idx, MAX_UINT32):
        return f"idx {str(e.idx)[:40]} is not a position in a vLLM batch (0..{MAX_UINT32})"
    if e.token_count is not None and not _count(e.token_count, MAX_UINT32):
        return f"token_count {str(e.token_count)[:40]} is not a token count (0..{MAX_UINT32})"
    if not _count(e.block_size, MAX_BLOCK_SIZE):
        return f"block_size {str(e.block_size)[:40]} is not a token count (0..{MAX_BLOCK_SIZE})"
    if e.first_pos < 0 or e.first_pos + max(len(e.block_hashes), 1) - 1 > MAX_POS:
        return (f"first_pos {e.first_pos} with {len(e.block_hashes)} blocks puts a block outside the positions "
                f"0..{MAX_POS} of a vLLM event")
    return None


def kv_dead_letter_rows(ev: Envelope, p: KvEventBatch) -> list[tuple[Any, ...]]:
    """A ``dead_letters`` row for each event of the batch that :func:`kv_rows` leaves out (:func:`kv_event_problem`),
    with the reason; its id from the envelope's and the event's place (idx, first_pos; and, for a later event of the
    envelope at the same place, which only a producer other than kvscope's collector sends, how many came before it),
    so a re-send of the envelope adds none and no two bad events share one. Raises ValueError for a batch
    :func:`kv_batch_problem` refuses (the whole envelope is then one dead letter)."""
    ts = _kv_batch_ts(p)
    engine = "" if p.dp_rank is None else str(p.dp_rank)
    out = []
    seen: dict[tuple[Any, Any], int] = defaultdict(int)
    for i, e in enumerate(p.events):
        reason = kv_event_problem(e)
        if reason is None:
            continue
        idx = i if e.idx is None else e.idx
        nth = seen[(idx, e.first_pos)]
        seen[(idx, e.first_pos)] += 1
        key = (ev.event_id, idx, e.first_pos) if nth == 0 else (ev.event_id, idx, e.first_pos, "copy", nth)
        out.append((make_event_id("dead_letter", "ingest", *key), ts,
                    "ingest", ev.pod, f"event {str(idx)[:40]} of the batch: {reason}",
                    f"{p.topic}:{engine}:seq {p.seq}:event {str(idx)[:40]}", msgspec.json.encode(e).decode()[:65536]))
    return out


#: The last seq a gap can end at. The ``kv_gaps`` view counts a gap's batches as ``last_seq - first_seq + 1``,
#: which ClickHouse computes as Int64 (UInt64 minus UInt64), so a run of 2^63 batches or more would read as a
#: negative count; and the batch that reveals a gap follows it (``last_seq + 1``).
MAX_GAP_SEQ = 2**63 - 2


EARLIEST_MS, LATEST_MS = int(EARLIEST.timestamp() * 1000), int(LATEST.timestamp() * 1000)


def _batch_ts(name: str, seconds: float | None) -> datetime | None:
    """A gap report's batch ts (unix seconds) as stored, None when unknown; raises ValueError when it is not a
    finite time within [EARLIEST, LATEST) (collector/gateway_record.py: 2000..2100 UTC)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ValueError(f"{name} {str(seconds)[:40]} is not a time")
    if not EARLIEST.timestamp() <= seconds < LATEST.timestamp():  # before _dt: far off, a datetime overflows
        raise ValueError(f"{name} {seconds} is outside 2000..2100 (UTC)")
    dt = _dt(seconds * 1000)
    if not EARLIEST <= dt < LATEST:
        raise ValueError(f"{name} {dt.isoformat()} is outside 2000..2100 (UTC)")
    return dt


def kv_gap_row(ev: Envelope, p: KvEventGap) -> tuple[Any, ...]:
    """The ``kv_event_gaps`` row of a gap report; ``prev_batch_ts``/``next_batch_ts`` as the batches' own ts are
    stored (:func:`kv_rows`: milliseconds, UTC), None when the collector did not know them.

    Raises ValueError (a ContractViolation in :func:`rows_for`: the report is dead-lettered with the reason) for a
    report no collector makes, which the ``kv_gaps`` view (sql/migrations/0030) would read as a negative or
    wrapped-around count, or as a window that holds none of its batches: ``last_seq`` before ``first_seq``, a seq
    outside ``0 .. MAX_GAP_SEQ``, ``replayed_batches`` outside ``0 .. last_seq - first_seq + 1``, a batch ts or
    ``detected_at_ms`` that is not a finite time in 2000..2100 UTC, ``prev_batch_ts`` after ``next_batch_ts``, a
    ``dp_rank`` neither None nor 0..65535 (as :func:`kv_batch_problem`), a ``reason`` that is not one of
    :data:`collector.events.GAP_REASONS` (an unknown string, or not a string: the views tell restarts from misses
    by it)."""
    if not isinstance(p.reason, str) or p.reason not in GAP_REASONS:
        raise ValueError(f"reason {str(p.reason)[:40]!r} is not a gap reason (one of {', '.join(GAP_REASONS)})")
    if not 0 <= p.first_seq <= p.last_seq <= MAX_GAP_SEQ:
        raise ValueError(f"seqs {p.first_seq}..{p.last_seq} are not a run within 0..{MAX_GAP_SEQ}")
    if not 0 <= p.replayed_batches <= p.last_seq - p.first_seq + 1:
        raise ValueError(f"replayed_batches {p.replayed_batches} is not within 0..{p.last_seq - p.first_seq + 1} "
                         "(the gap's batches)")
    if p.dp_rank is not None and not _count(p.dp_rank, MAX_DP_RANK):
        raise ValueError(f"dp_rank {str(p.dp_rank)[:40]} is not a data-parallel rank (an integer 0..{MAX_DP_RANK}, "
                         "or none)")
    if not _count(p.detected_at_ms - EARLIEST_MS, LATEST_MS - EARLIEST_MS - 1):
        raise ValueError(f"detected_at_ms {str(p.detected_at_ms)[:40]} is not a unix time (ms) in 2000..2100 (UTC)")
    prev, nxt = _batch_ts("prev_batch_ts", p.prev_batch_ts), _batch_ts("next_batch_ts", p.next_batch_ts)
    if prev is not None and nxt is not None and prev > nxt:
        raise ValueError(f"prev_batch_ts {prev.isoformat()} is after next_batch_ts {nxt.isoformat()}")
    return (ev.event_id, _dt(p.detected_at_ms), ev.pod, "" if p.dp_rank is None else str(p.dp_rank), p.first_seq,
            p.last_seq, p.reason, p.replayed_batches, p.recovered, prev, nxt)


def dead_letter_row(ev: Envelope, p: DeadLetter) -> tuple[Any, ...]:
    return (ev.event_id, _dt(ev.observed_at_ms), p.source, ev.pod, p.reason, p.location, p.raw)


def rows_for(ev: Envelope) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """``[(table, rows), ...]`` for one envelope. Raises :class:`ContractViolation` if the payload cannot be
    mapped."""
    p = ev.payload
    try:
        if isinstance(p, GatewayRequest):
            return [("gateway_requests", [gateway_row(ev, p)])]
        if isinstance(p, VllmScrape):
            return [("vllm_metrics", metric_rows(ev, p)), ("vllm_cache_config", cache_config_rows(ev, p))]
        if isinstance(p, KvEventBatch):
            rows, dead = kv_rows(ev, p), kv_dead_letter_rows(ev, p)  # a batch no collector makes raises
            return [("kv_block_events", rows)] + ([("dead_letters", dead)] if dead else [])
        if isinstance(p, KvEventGap):
            return [("kv_event_gaps", [kv_gap_row(ev, p)])]
        if isinstance(p, DeadLetter):
            return [("dead_letters", [dead_letter_row(ev, p)])]
    except Exception as exc:  # one envelope's bad values must cost only that envelope
        raise ContractViolation(f"{ev.schema} {ev.event_id}: cannot map to a row: {exc!r}"[:1000]) from exc
    raise ContractViolation(f"no row mapping for kind {ev.schema}")


def contract_dead_letter(reason: str, location: str, raw: bytes | str, pod: str = "",
                         natural_key: str | None = None) -> tuple[Any, ...]:
    """A ``dead_letters`` row for a message the ingester could not decode, the store refused, or that conflicts
    with a stored row. Its ``event_id`` comes from ``location`` and the start of ``raw``, or from ``natural_key``
    when given (a dead letter that must be stored once wherever its input was read from)."""
    from collector.events import make_event_id

    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    now = datetime.now(UTC)
    ident = make_event_id("dead_letter", "ingest", location, text[:512]) if natural_key is None else \
        make_event_id("dead_letter", "ingest", natural_key)
    return (ident, now, "ingest", pod, reason, location, text[:65536])
