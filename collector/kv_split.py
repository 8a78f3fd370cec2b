"""Splitting a vLLM KV-event batch too large for one Kafka message into parts that each fit (collector/publish.py).

A batch (:class:`collector.events.KvEventBatch`, one ZMQ message of vLLM's) becomes several envelopes of the same
pod, engine, topic, seq, ts and dp_rank, its events in order: cut between events, and a ``BlockStored`` or
``BlockRemoved`` whose blocks alone do not fit cut between blocks. Every row the ingester writes for the parts is
the row the whole batch would have given (kv_block_events → kv_block_log, sql/migrations/0017, 0029):

- an event keeps its ``idx`` (its position in vLLM's batch);
- a piece of an event cut by blocks keeps ``idx`` and says where its first block was in vLLM's event
  (``KvBlockEvent.first_pos``: kv_block_log's ``pos`` of each block is ``first_pos`` + its place in the piece);
  a BlockStored piece's ``parent_block_hash`` is the block before it in the event (the event's parent for the
  first piece), as kv_block_log chains a block to the one before it; ``chain_hashes``, ``token_ids`` and
  ``extra_keys`` are cut with the blocks, ``token_count`` in proportion (the pieces add up to the event's);
- every part but the first is ``continued`` (``KvEventBatch.continued``): only the first marks a vLLM start
  (the restart row of a seq-0 batch, once per batch);
- a part's event id comes from the batch's (or the part's being split again) and the range of events and blocks
  it holds, so a re-send or a replay of the batch, split again the same way, stores each part once; split
  another way (another limit), its parts have other ids, and the ingester stores only the blocks not yet held
  (ingest/kv_pieces.py).

A single block that alone does not fit (hostile input: a block of a million tokens) cannot be cut further; it is
returned on its own (``too_large``) for the caller to dead-letter, and every other block and event is sent.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from collector.events import Envelope, KvBlockEvent, KvEventBatch, encode_event, envelope

_encode = msgspec.json.Encoder().encode


class Unit(NamedTuple):
    """One piece that cannot be cut between parts: a whole event, or the run of blocks of an event that fits."""

    event: KvBlockEvent
    size: int  # bytes of the event's JSON inside a part


class Split(NamedTuple):
    """What :func:`split_batch` made: ``parts`` (envelopes that each encode within the limit, in the batch's order)
    and ``too_large`` (one envelope per single block, or event without blocks, that alone does not fit: each
    ``(envelope of a one-event part, its encoded size in bytes as a message)``)."""

    parts: list[Envelope]
    too_large: list[tuple[Envelope, int]]


def piece(e: KvBlockEvent, a: int, b: int) -> KvBlockEvent:
    """Blocks ``a..b-1`` of event ``e`` (``0 <= a < b <= len(e.block_hashes)``) as an event of their own: same
    ``type``, ``idx``, ``medium``, ``block_size``, ``lora_name``; ``first_pos`` moved by ``a``; a BlockStored's
    parent the block before ``a`` (``e``'s parent when ``a`` is 0; other types keep theirs); per-block lists
    (``chain_hashes``, ``extra_keys``) cut when parallel to the blocks (else ``chain_hashes`` [] = unknown,
    ``extra_keys`` None); ``token_ids`` and the token count cut in proportion, ``floor(T·b/n) − floor(T·a/n)`` of
    the event's ``T`` tokens (exactly ``(b − a) · block_size`` when ``T`` is ``n`` full blocks), so the pieces of
    an event add up to it."""
    n = len(e.block_hashes)
    if a == 0 and b == n:
        return e
    total = len(e.token_ids) if e.token_count is None else e.token_count
    lo, hi = total * a // n, total * b // n
    tokens = e.token_ids[len(e.token_ids) * a // n: len(e.token_ids) * b // n] if e.token_ids else []
    return msgspec.structs.replace(
        e, block_hashes=e.block_hashes[a:b],
        parent_block_hash=e.parent_block_hash if a == 0 or e.type != "BlockStored" else e.block_hashes[a - 1],
        token_ids=tokens, token_count=None if e.token_count is None else hi - lo,
        chain_hashes=e.chain_hashes[a:b] if len(e.chain_hashes) == n else [],
        extra_keys=e.extra_keys[a:b] if e.extra_keys is not None and len(e.extra_keys) == n else None,
        first_pos=e.first_pos + a)


def _pieces(e: KvBlockEvent, room: int) -> list[Unit]:
    """Event ``e`` cut between blocks into runs that each encode within ``room`` bytes, as long as possible (a
    binary search per run: an event's JSON grows with its blocks); a block that alone does not fit is a unit of
    its own, larger than ``room``."""
    n = len(e.block_hashes)
    if n <= 1:
        return [Unit(e, len(_encode(e)))]
    out: list[Unit] = []
    a = 0
    while a < n:
        lo, hi = a + 1, n  # the answer: the largest b in [lo, hi] that fits, or lo when none does
        first = _encode(piece(e, a, lo))
        if len(first) > room:
            out.append(Unit(piece(e, a, lo), len(first)))
            a = lo
            continue
        best, best_size = lo, len(first)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            size = len(_encode(piece(e, a, mid)))
            if size <= room:
                lo, best, best_size = mid, mid, size
            else:
                hi = mid - 1
        out.append(Unit(piece(e, a, best), best_size))
        a = best
    return out


def _part(ev: Envelope, events: list[KvBlockEvent], continued: bool) -> Envelope:
    """The envelope of one part of batch envelope ``ev``: ``events`` (in order, each with its ``idx``); event id
    from ``ev``'s and the range held, (first idx, first block pos, last idx, end block pos)."""
    p = ev.payload
    assert isinstance(p, KvEventBatch)
    first, last = events[0], events[-1]
    key = ("part", ev.event_id, first.idx, first.first_pos, last.idx, last.first_pos + len(last.block_hashes))
    batch = msgspec.structs.replace(p, events=events, continued=continued)
    return envelope(batch, pod=ev.pod, natural_key=key, observed_at_ms=ev.observed_at_ms, engine=ev.engine)


def units(p: KvEventBatch) -> int:
    """How many pieces batch ``p`` can be cut into at most: one per block of each event, one per event without
    blocks."""
    return sum(max(1, len(e.block_hashes)) for e in p.events)


def split_batch(ev: Envelope, max_message_bytes: int, *, keep_too_large: bool = False) -> Split:
    """Cut KV-event batch envelope ``ev`` (payload :class:`KvEventBatch`) into parts whose encoding, as a message
    (``[envelope]``), is at most ``max_message_bytes`` bytes each (module doc); greedy, in order: a part is cut
    where its next event (or run of blocks) would not fit. An event without ``idx`` (an older producer's) gets its
    position in ``events``. The first part keeps ``ev``'s ``continued``; the others are continued.
    ``keep_too_large``: a block that alone does not fit is a part of its own among ``parts`` (for a caller that
    tries it against a limit it only guesses: the broker's), not in ``too_large``. Raises ValueError when ``ev``
    is not a KV-event batch, or when ``max_message_bytes`` leaves no room for an event."""
    p = ev.payload
    if not isinstance(p, KvEventBatch):
        raise ValueError(f"{ev.schema} envelope: only a kv_event_batch is split")
    # an empty part's size + the brackets of the message around it
    base = len(encode_event(_part_shell(ev))) + 2
    room = max_message_bytes - base
    if room <= 0:
        raise ValueError(f"max_message_bytes={max_message_bytes} leaves no room for an event (a part alone is {base})")
    pieces: list[Unit] = []
    for i, e in enumerate(p.events):
        e = e if e.idx is not None else msgspec.structs.replace(e, idx=i)
        size = len(_encode(e))
        pieces.extend([Unit(e, size)] if size <= room else _pieces(e, room))
    parts: list[Envelope] = []
    too_large: list[tuple[Envelope, int]] = []
    current: list[KvBlockEvent] = []
    used = 0

    def flush() -> None:
        nonlocal current, used
        if current:
            parts.append(_part(ev, current, p.continued or bool(parts)))
        current, used = [], 0

    for u in pieces:
        if u.size > room:
            flush()
            alone = _part(ev, [u.event], p.continued or bool(parts))
            if keep_too_large:
                parts.append(alone)
            else:
                too_large.append((alone, len(encode_event(alone)) + 2))
            continue
        grown = used + u.size + (1 if current else 0)  # a comma before every event but the first
        if current and grown > room:
            flush()
            grown = u.size
        current.append(u.event)
        used = grown
    flush()
    return Split(parts, too_large)


def _part_shell(ev: Envelope) -> Envelope:
    """A part of ``ev`` with no events and ``continued`` false (the longer shell: ``false`` vs ``true``), whose
    encoding is at least every part's but its events (event ids have one length)."""
    p = ev.payload
    assert isinstance(p, KvEventBatch)
    return msgspec.structs.replace(ev, payload=msgspec.structs.replace(p, events=[], continued=False))
