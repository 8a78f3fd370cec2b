"""Every block of a KV event stored once in ``kv_block_events``, however its batch was cut into parts.

A KV-event batch too large for one Kafka message arrives in parts (collector/kv_split.py), and an event with
too many blocks in pieces: rows of one event (pod, engine, ts, seq, idx) that each hold the blocks
``first_pos .. first_pos + len(block_hashes) - 1`` of vLLM's event. Where the cuts fall depends on
``KVSCOPE_KAFKA_MAX_MESSAGE_BYTES`` (and on the broker's limit), so a batch sent again with another limit (a
collector restarted with another setting, replaying from its checkpoint) comes in parts of other ids and other
ranges, which the event-id check (:mod:`ingest.dedup`) does not recognise: the same blocks would be stored twice,
and every reader of ``kv_block_events`` (the named queries' event and block counts, the views that fill
``kv_block_log`` and the restart marks of ``kv_cache_resets``) would count them twice.

So before an insert, :func:`trim_kv_rows` keeps of each incoming row only the blocks its event does not hold yet
(in the store, or in an earlier row of the insert): a row whose blocks are all held is dropped, a row partly held
is cut to the runs of blocks that are not (each a piece as collector/kv_split.py makes them: ``first_pos`` its
first block's position, a ``BlockStored`` piece chained to the block before it, chain hashes cut with the blocks,
the row's tokens shared in proportion). An event without blocks (``AllBlocksCleared``) is held once any row of it
is. A row is nothing new to the store's reader only when its blocks are: the event and block counts, the
``kv_block_log`` rows and the restart mark are each made once, whatever the limits of the first and later sends.

The restart mark of a vLLM start (sql/migrations/0029 ``kv_block_log_starts_mv``) is made from the rows of a seq-0
batch that are not ``continued``; an incoming row of a batch whose start is already marked (the store, or an
earlier envelope of the insert, holds a row of the batch that is not ``continued``) is stored ``continued``, so
the mark is made once, with the medium of the event that first made it.

Not covered, as for :mod:`ingest.dedup`: two ingesters inserting rows of one event at the same instant.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from ingest.dedup import _normal
from ingest.store import Store

#: kv_block_events' columns that identify an event (its rows share them).
EVENT_KEY = ("pod", "engine", "ts", "seq", "idx")


def _uncovered(a: int, b: int, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of ``[a, b)`` that no interval of ``held`` (``[lo, hi)`` pairs) covers, in order."""
    out: list[tuple[int, int]] = []
    at = a
    for lo, hi in sorted(held):
        if hi <= at or lo >= b:
            continue
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
        if at >= b:
            break
    if at < b:
        out.append((at, b))
    return out


def cut_row(row: tuple[Any, ...], columns: Sequence[str], a: int, b: int) -> tuple[Any, ...]:
    """Blocks at positions ``a .. b-1`` of kv_block_events row ``row`` (tuple in ``columns`` order; positions in
    vLLM's event, within the row's ``first_pos .. first_pos + len(block_hashes)``) as a row of their own: its
    ``first_pos`` ``a``; ``block_hashes`` and (when parallel to them) ``chain_hashes`` cut; a ``BlockStored``'s
    ``parent_block_hash`` the block before ``a`` when that is in the row; ``token_count`` the row's shared in
    proportion, ``floor(T·j/n) − floor(T·i/n)`` for the row's ``T`` tokens over its ``n`` blocks (``i``, ``j``:
    ``a``, ``b`` within the row), exactly ``(b − a) · block_size`` for full blocks. Every other column as is."""
    c = {name: i for i, name in enumerate(columns)}
    blocks = row[c["block_hashes"]]
    first, n = row[c["first_pos"]], len(blocks)
    i, j = a - first, b - first
    if i == 0 and j == n:
        return row
    out = list(row)
    out[c["block_hashes"]] = list(blocks[i:j])
    chains = row[c["chain_hashes"]]
    out[c["chain_hashes"]] = list(chains[i:j]) if len(chains) == n else []
    if row[c["event_type"]] == "BlockStored" and i > 0:
        out[c["parent_block_hash"]] = blocks[i - 1]
    tokens = row[c["token_count"]]
    out[c["token_count"]] = tokens * j // n - tokens * i // n
    out[c["first_pos"]] = a
    return tuple(out)


#: Stamps of one insert further apart than this are read as separate ranges (:func:`_spans`).
SPAN_GAP = timedelta(minutes=10)


def _spans(stamps: Sequence[datetime]) -> list[tuple[datetime, datetime]]:
    """Sorted ``stamps`` as ``[(first, last), ...]`` ranges, a new one wherever two stamps are more than
    :data:`SPAN_GAP` apart: the store is read over the rows' own times, never over what lies between a row of 1970
    and one of 2300 (every stored event of their pods)."""
    spans: list[tuple[datetime, datetime]] = []
    for t in stamps:
        if spans and t - spans[-1][1] <= SPAN_GAP:
            spans[-1] = (spans[-1][0], t)
        else:
            spans.append((t, t))
    return spans


def trim_kv_rows(store: Store, rows: Sequence[tuple[Any, ...]], columns: Sequence[str],
                 groups: Sequence[int]) -> list[tuple[int, tuple[Any, ...]]]:
    """The kv_block_events rows to insert of ``rows`` (tuples in ``columns`` order, the kv_block_events columns of
    ingest/rows.py; ``groups``: the envelope each came from), as ``(index of the row in rows, the row to insert)``
    in order: each row cut to the blocks its event holds neither in the store nor in an earlier row of ``rows``
    (module doc; a row may give several, or none), ``continued`` set when its batch's start is already marked.
    One query, bounded by the rows' pods, seqs and times (:func:`_spans`). Raises what :meth:`Store.query_rows` raises
    (StoreUnavailable: retry the batch)."""
    if not rows:
        return []
    c = {name: i for i, name in enumerate(columns)}
    key_of = [tuple(_normal(r[c[k]]) for k in EVENT_KEY) for r in rows]
    spans = _spans(sorted({r[c["ts"]] for r in rows}))
    params: dict[str, Any] = {"pods": sorted({r[c["pod"]] for r in rows}), "seqs": sorted({r[c["seq"]] for r in rows})}
    for k, (lo, hi) in enumerate(spans):
        params[f"lo{k}"], params[f"hi{k}"] = lo, hi
    within = " OR ".join(f"(ts >= {{lo{k}:DateTime64(3, 'UTC')}} AND ts <= {{hi{k}:DateTime64(3, 'UTC')}})"
                         for k in range(len(spans)))
    found = store.query_rows(
        "SELECT pod, engine, ts, seq, idx, first_pos, length(block_hashes), continued FROM kv_block_events "
        f"WHERE pod IN {{pods:Array(String)}} AND seq IN {{seqs:Array(UInt64)}} AND ({within})", params)
    held: dict[tuple[Any, ...], list[tuple[int, int]]] = defaultdict(list)  # event → [first, end) of its rows
    started: dict[tuple[Any, ...], int] = {}  # batch (pod, engine, ts, seq) → the envelope that marked its start
    for pod, engine, ts, seq, idx, first, n, continued in found:
        key = tuple(_normal(v) for v in (pod, engine, ts, seq, idx))
        held[key].append((first, first + n))
        if not continued:
            started[key[:4]] = -1  # the store's
    out: list[tuple[int, tuple[Any, ...]]] = []
    for i, (row, key, group) in enumerate(zip(rows, key_of, groups, strict=True)):
        first, n = row[c["first_pos"]], len(row[c["block_hashes"]])
        if n == 0:
            runs = [] if held.get(key) else [(first, first)]
        else:
            runs = _uncovered(first, first + n, held[key])
        if not runs:
            continue
        if not row[c["continued"]]:
            marker = started.setdefault(key[:4], group)
            if marker != group:  # the batch's start is marked already: by the store, or an earlier envelope
                row = (*row[:c["continued"]], 1, *row[c["continued"] + 1:])
        for a, b in runs:
            out.append((i, row if n == 0 else cut_row(row, columns, a, b)))
            held[key].append((a, b))
    return out
