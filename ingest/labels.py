"""Workload labels (the ground truth of a labelled workload) → workload_labels, exactly once; read back by the
named query ``attribution_agreement`` (docs/miss-causes.md, "Validating attribution").

A label file is JSON lines, one object per request (demo/workload.py writes them; any test traffic may):

- ``request_id`` (required): the gateway log's request id (the workload's ``X-Request-Id``).
- the intended cause: ``cause`` and ``sub_cause`` in the attribution's vocabulary (``ingest/attribution.py``:
  ``cold``, ``routed_away``, ``evicted``, ``prefix_drift`` with its sub-cause, ...) or ``none`` (nothing avoidable
  should miss); else ``pathology``, the demo workload's word for it, mapped by :data:`PATHOLOGY_CAUSES`.
- ``ts`` (RFC 3339 with a zone; else the gateway's arrival ts of that request in the store), ``tenant_id``
  (else the gateway's), ``scenario`` (else the pathology or the cause), ``run_id`` (else the loader's default).
- ``expected_tokens`` (optional): the expected split of the missed tokens, ``[{"cause": "prefix_drift",
  "sub_cause": "volatile_system", "tokens": 768}, {"cause": "unavoidable", "tokens": 16}]``.

Other fields (the workload's ``turn``, ``status``, ``prompt_tokens`` ...) are ignored. A line that breaks these
rules is a dead letter (source ``workload_labels``) with its reason at ``file:offset``; the rest is written.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from collector.events import DeadLetter, envelope
from collector.gateway_log import MAX_LINE_BYTES
from collector.gateway_record import EARLIEST, LATEST
from ingest import attribution as a
from ingest.bulk import line_chunks
from ingest.dedup import absent_rows
from ingest.retention import Retention, Retentions
from ingest.rows import COLUMNS as ROW_COLUMNS
from ingest.rows import dead_letter_row
from ingest.store import Store
from kvscope.importer import refuse_gzip, source_path

SOURCE = "workload_labels"
#: The intended cause of a request built to miss nothing avoidable (only new content, the last token).
NONE = "none"
#: The demo workload's pathologies (demo/workload.py PATHOLOGIES) as (cause, sub_cause): what attribution
#: should answer for the request's missed tokens, unavoidable ones aside. ``none``: a stable prompt sent
#: again or continued (acme; hooli before its history is cut): anything avoidable that still misses is
#: routing, eviction or first sight, which the workload does not decide.
PATHOLOGY_CAUSES: dict[str, tuple[str, str]] = {
    "none": (NONE, ""),
    "volatile_system": (a.PREFIX_DRIFT, a.VOLATILE_SYSTEM),
    "tools_reordered": (a.PREFIX_DRIFT, a.TOOLS_REORDERED),
    "rag_reordered": (a.PREFIX_DRIFT, a.RAG_REORDERED),
    "history_truncated": (a.PREFIX_DRIFT, a.HISTORY_TRUNCATED),
}
COLUMNS = ("request_id", "ts", "tenant_id", "run_id", "scenario", "cause", "sub_cause", "expected_causes",
           "expected_sub_causes", "expected_tokens", "location")
NAME_MAX_CHARS = 512
MAX_RAW = 64 * 1024
#: Lines parsed and written at a time (`kvscope import labels`): memory is bounded by a chunk, as for the gateway
#: log (ingest/bulk.py).
LINES_PER_CHUNK = 50_000
#: Bytes read at a time: labels are short lines, and what a read holds waits in memory beside the chunk.
READ_BYTES = 256 << 10


class BadLabel(ValueError):
    """A label line that cannot be stored; the message is the dead letter's reason (one sentence)."""


@dataclass
class LabelLoad:
    """What a load did: ``lines`` read, ``rows`` inserted, ``duplicates`` skipped (the store held the request's
    label, or the file repeats it), ``dead_letters`` written (new ones), ``reasons`` (the bad lines' reasons,
    each with its count of lines, in the order first met, re-reads included: a count, not a list, so that a file
    of millions of bad lines holds no string per line), ``end_offset`` (byte offset after the last line loaded:
    where a later load resumes), ``interrupted``: the load was stopped before the end of the file (every line
    counted was loaded whole)."""

    lines: int = 0
    rows: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    end_offset: int = 0
    interrupted: bool = False


def _name(obj: dict[str, Any], key: str, *, required: bool = False) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise BadLabel(f"field {key}: {'missing or ' if required else ''}not a "
                       f"{'non-empty ' if required else ''}string")
    if len(value) > NAME_MAX_CHARS:
        raise BadLabel(f"field {key}: longer than {NAME_MAX_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's \ud800 escapes decode to lone surrogates, which UTF-8 cannot hold
        raise BadLabel(f"field {key}: not valid Unicode (a lone surrogate at character {exc.start})") from exc
    return value


def _ts(obj: dict[str, Any]) -> datetime | None:
    value = obj.get("ts")
    if value is None:
        return None
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00")) if isinstance(value, str) else None
    except ValueError:
        dt = None
    if dt is None or dt.tzinfo is None:
        raise BadLabel("field ts: not an ISO 8601 time with a time zone (e.g. 2026-11-29T12:00:00.123Z)")
    if not EARLIEST <= dt < LATEST:
        raise BadLabel(f"field ts: {value} is outside 2000..2100 (UTC)")
    dt = dt.astimezone(UTC)
    return dt.replace(microsecond=dt.microsecond // 1000 * 1000)


def _intended(obj: dict[str, Any]) -> tuple[str, str]:
    """(cause, sub_cause) the label names, checked against the attribution's vocabulary."""
    if "cause" not in obj:
        pathology = _name(obj, "pathology")
        if pathology not in PATHOLOGY_CAUSES:
            known = ", ".join(PATHOLOGY_CAUSES)
            raise BadLabel(f"no cause, and pathology {pathology!r} is not one kvscope maps ({known}): give cause "
                           "and sub_cause")
        return PATHOLOGY_CAUSES[pathology]
    cause, sub = _name(obj, "cause", required=True), _name(obj, "sub_cause")
    if cause == a.UNAVOIDABLE:
        raise BadLabel("cause unavoidable cannot be intended: agreement compares the dominant cause besides "
                       "unavoidable; a request expected to miss only new content is cause none")
    if cause not in (*a.CAUSES, NONE):
        raise BadLabel(f"cause {cause!r} is not a miss cause ({', '.join((*a.CAUSES, NONE))})")
    if cause == NONE and sub:
        raise BadLabel("cause none takes no sub_cause")
    if cause == a.PREFIX_DRIFT and sub not in a.DRIFT_SUB_CAUSES:
        raise BadLabel(f"prefix_drift needs a sub_cause, one of {', '.join(a.DRIFT_SUB_CAUSES)} (got {sub!r})")
    return cause, sub


def _expected(obj: dict[str, Any]) -> tuple[list[str], list[str], list[int]]:
    """The expected split as sorted parallel arrays, one entry per (cause, sub_cause), zero entries dropped."""
    items = obj.get("expected_tokens")
    if items is None:
        return [], [], []
    if not isinstance(items, list):
        raise BadLabel("field expected_tokens: not a list of {cause, sub_cause, tokens} objects")
    split: dict[tuple[str, str], int] = {}
    for item in items:
        if not isinstance(item, dict):
            raise BadLabel("field expected_tokens: not a list of {cause, sub_cause, tokens} objects")
        cause, sub, tokens = _name(item, "cause", required=True), _name(item, "sub_cause"), item.get("tokens")
        if cause not in a.CAUSES:
            raise BadLabel(f"expected_tokens: {cause!r} is not a miss cause ({', '.join(a.CAUSES)})")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens < 2**32:
            raise BadLabel(f"expected_tokens: tokens of {cause} must be an integer 0..2^32-1")
        split[(cause, sub)] = split.get((cause, sub), 0) + tokens
        if split[(cause, sub)] >= 2**32:
            raise BadLabel(f"expected_tokens: the tokens of {cause}/{sub or '-'} add up past 2^32-1")
    keys = sorted(k for k, v in split.items() if v)
    return [k[0] for k in keys], [k[1] for k in keys], [split[k] for k in keys]


def parse_label(line: bytes | str, *, run_id: str = "") -> dict[str, Any]:
    """One label line → a workload_labels row as a dict of :data:`COLUMNS` (``ts`` None when the line has
    none, ``location`` ""). ``run_id``: for a line without its own. Raises :class:`BadLabel` with the reason."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadLabel(f"not JSON ({exc})") from exc
    except RecursionError:  # arrays or objects nested thousands deep: Python's parser recurses per level
        raise BadLabel("not JSON kvscope reads: nested too deep (a label is a flat object)") from None
    if not isinstance(obj, dict):
        raise BadLabel(f"line is JSON {type(obj).__name__}, not an object")
    cause, sub = _intended(obj)
    causes, subs, tokens = _expected(obj)
    return {
        "request_id": _name(obj, "request_id", required=True), "ts": _ts(obj),
        "tenant_id": _name(obj, "tenant_id"), "run_id": _name(obj, "run_id") or run_id,
        "scenario": _name(obj, "scenario") or _name(obj, "pathology") or cause, "cause": cause,
        "sub_cause": sub, "expected_causes": causes, "expected_sub_causes": subs, "expected_tokens": tokens,
        "location": "",
    }


def _fill_from_gateway(store: Store, rows: list[dict[str, Any]]) -> None:
    """Give rows without ts (or tenant) the gateway's arrival ts (tenant) of the same request_id."""
    ids = sorted({r["request_id"] for r in rows if r["ts"] is None or not r["tenant_id"]})
    if not ids:
        return
    found = {rid: (ts, tenant) for rid, ts, tenant in store.query_rows(
        "SELECT request_id, min(ts), any(tenant_id) FROM gateway_requests WHERE request_id IN {ids:Array(String)} "
        "GROUP BY request_id", {"ids": ids})}
    for r in rows:
        ts, tenant = found.get(r["request_id"], (None, ""))
        if r["ts"] is None and ts is not None:
            r["ts"] = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
        r["tenant_id"] = r["tenant_id"] or tenant


def _dead_letter(path: Path, offset: int, line: bytes, reason: str, now_ms: int) -> tuple[Any, ...]:
    text = line.decode("utf-8", "replace")
    dl = DeadLetter(source=SOURCE, reason=reason, raw=text[:MAX_RAW], location=f"{path}:{offset}")
    return dead_letter_row(envelope(dl, pod="", natural_key=(str(path), offset, text[:256]), observed_at_ms=now_ms),
                           dl)


def load_labels(store: Store, path: str | Path, *, run_id: str = "", start: int = 0,
                partial_last_line: bool = True, lines_per_chunk: int = LINES_PER_CHUNK,
                stop: threading.Event | None = None,
                progress: Callable[[LabelLoad], None] | None = None) -> LabelLoad:
    """Load the label lines of ``path`` from byte ``start`` into workload_labels, each request (request_id, ts)
    once (a label the store holds is skipped, so a file may be loaded again, or tailed; two labelled runs reusing
    ids keep a label each); bad lines become dead letters. A line without ts takes the gateway's arrival ts of its
    request (the earliest request of that id: give ts to label runs that reuse ids), so such lines need the
    gateway log loaded first (else they are dead letters saying so). A label older than workload_labels'
    retention is a dead letter with that reason (:mod:`ingest.retention`: ClickHouse would drop it at insert).
    Returns :class:`LabelLoad`.

    The file is streamed (:func:`ingest.bulk.line_chunks`): ``lines_per_chunk`` lines at a time are parsed and
    written, labels and dead letters, before the next are read, so memory is bounded by the chunk whatever the
    file's size; a line of :data:`~collector.gateway_log.MAX_LINE_BYTES` or more is a dead letter (its rest is
    skipped unread). ``stop``: when it is set (Ctrl-C), the load ends after the chunk it is in, whose rows and
    dead letters are then all written, and the stats say ``interrupted`` (loading the file again loads the rest:
    what is stored is skipped). ``progress``: called with the stats after each full chunk. A pipe
    (``<(zcat labels.gz)``) is read once, from its start. Raises :class:`~kvscope.importer.CompressedFile` for a
    gzip file (nothing written), ``OSError`` and what the store raises (``StoreUnavailable``: load again; nothing
    is written twice)."""
    path = Path(path)
    stats = LabelLoad(end_offset=start)
    with path.open("rb") as fh:
        if start:  # a pipe cannot seek, and is read from its start
            fh.seek(start)
        else:
            refuse_gzip(fh.peek(2)[:2], path, "workload labels (JSON lines)")
        path = source_path(path)  # one spelling per file: dead letters are keyed by it (a re-import adds none)
        retention = Retentions(store).get("workload_labels")
        for chunk, end in line_chunks(fh, lines_per_chunk, start=start, block_bytes=READ_BYTES,
                                      partial_last_line=partial_last_line):
            if chunk and stop is not None and stop.is_set():
                stats.interrupted = True
                break
            if chunk:
                _load_chunk(store, path, chunk, run_id, retention, stats)
            stats.end_offset = end
            if progress is not None and len(chunk) == lines_per_chunk:
                progress(stats)
    return stats


def _load_chunk(store: Store, path: Path, chunk: list[tuple[int, bytes]], run_id: str, retention: Retention | None,
                stats: LabelLoad) -> None:
    """Write one chunk's (offset, line) pairs of ``path``: its labels the store does not hold, and a dead letter
    for each bad line; add what it did to ``stats``."""
    stats.lines += len(chunk)
    good: list[dict[str, Any]] = []
    bad: list[tuple[int, bytes, str]] = []
    for offset, line in chunk:
        try:
            if len(line) >= MAX_LINE_BYTES:  # its head: line_chunks skipped the rest
                raise BadLabel(f"line longer than {MAX_LINE_BYTES} bytes")
            row = parse_label(line, run_id=run_id)
        except BadLabel as exc:
            bad.append((offset, line, str(exc)))
            continue
        good.append({**row, "location": f"{path}:{offset}", "_offset": offset, "_line": line})
    _fill_from_gateway(store, good)
    for r in [r for r in good if r["ts"] is None]:
        bad.append((r["_offset"], r["_line"], "no ts, and the store holds no gateway request with this request_id: "
                                              "import the gateway log first, or give ts"))
        good.remove(r)
    for r in [r for r in good if retention is not None and retention.expired(r["ts"])]:
        bad.append((r["_offset"], r["_line"], retention.reason(r["ts"])))
        good.remove(r)
    rows = [tuple(r[c] for c in COLUMNS) for r in good]
    keep = absent_rows(store, "workload_labels", rows, COLUMNS)
    store.insert("workload_labels", [rows[i] for i in keep], COLUMNS)
    stats.rows += len(keep)
    stats.duplicates += len(rows) - len(keep)
    bad.sort()
    stats.reasons.update(reason for _, _, reason in bad)
    now_ms = int(time.time() * 1000)
    dead = [_dead_letter(path, offset, line, reason, now_ms) for offset, line, reason in bad]
    keep_dead = absent_rows(store, "dead_letters", dead, ROW_COLUMNS["dead_letters"])
    store.insert("dead_letters", [dead[i] for i in keep_dead], ROW_COLUMNS["dead_letters"])
    stats.dead_letters += len(keep_dead)


class LabelTail:
    """Loads a label file as a writer appends to it (the demo's workload): each :meth:`poll` loads the complete
    lines added since the last successful one. Safe to poll from two threads (a lock); a failed poll is
    retried from the same offset by the next (the load writes each request once)."""

    def __init__(self, store: Store, path: str | Path, *, run_id: str = "") -> None:
        self.store = store
        self.path = Path(path)
        self.run_id = run_id
        self.offset = 0
        self.rows = 0
        self._lock = threading.Lock()

    def poll(self, *, final: bool = False) -> LabelLoad | None:
        """Load what was appended (with ``final``, a last line without its newline too); None when the file does
        not exist yet. Raises what :func:`load_labels` raises."""
        with self._lock:
            if not self.path.exists():
                return None
            stats = load_labels(self.store, self.path, run_id=self.run_id, start=self.offset,
                                partial_last_line=final)
            self.offset = stats.end_offset
            self.rows += stats.rows
            return stats
