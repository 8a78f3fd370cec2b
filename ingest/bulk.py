"""Bulk load of a finished gateway log (``kvscope import gateway-log``): file → typed records → Arrow columns →
gateway_requests, streamed in chunks so memory stays bounded by the chunk, whatever the file's size.

The same contract as the live path (one decoder: :func:`collector.gateway_record.decode_record`; a bad line is a
dead letter with its reason, at ``file:offset``) and the same exactly-once rule (rows whose (request_id, ts) the
store holds are dropped, so a re-import writes nothing), without envelopes: the live path's per-event
envelopes exist for Kafka. Python validates each line and re-encodes the record (msgspec, C: canonical ts,
capped free text, absent fields filled), so ClickHouse stores what the record decided, not the raw line;
ClickHouse parses that JSON into a Memory stage table and moves the rows into gateway_requests minus what it
holds, in one INSERT SELECT (``make bench`` prints the rate beside the store's own insert rate).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

import msgspec

from collector.events import DeadLetter, envelope
from collector.gateway_log import JSON_WHITESPACE, MAX_LINE_BYTES, MAX_RAW, line_event
from collector.gateway_record import BadRecord, decode_record
from ingest.dedup import absent_rows, conflict_reason
from ingest.errors import RejectedRows, TooManyPartitions
from ingest.retention import Retention, Retentions
from ingest.rows import COLUMNS, GATEWAY_HASH_LISTS, dead_letter_row
from ingest.store import Store
from kvscope.importer import CompressedFile, ingest_events, refuse_gzip, source_path


@dataclass
class LoadStats:
    """What a load did: ``lines`` read, ``rows`` inserted into gateway_requests, ``duplicates`` dropped (the
    store held them, or an earlier line of the file, with the same values), ``conflicts`` not loaded because
    the store holds their (request_id, ts) with other values (one dead letter each, the stored row kept),
    ``expired`` not loaded because they are older than gateway_requests' retention (:mod:`ingest.retention`;
    one dead letter per chunk names them), ``dead_letters`` written, ``interrupted``: the load was stopped before
    the end of the file (every line counted was loaded whole)."""

    lines: int = 0
    rows: int = 0
    duplicates: int = 0
    conflicts: int = 0
    expired: int = 0
    dead_letters: int = 0
    interrupted: bool = False


def line_chunks(fh: BinaryIO, lines_per_chunk: int, *, start: int = 0, max_line: int = MAX_LINE_BYTES,
                block_bytes: int = 16 << 20, partial_last_line: bool = True,
                ) -> Iterator[tuple[list[tuple[int, bytes]], int]]:
    """(chunk, end) pairs over the open file ``fh``, read once from where it stands (so a pipe works too) in
    blocks of ``block_bytes``: ``chunk`` is the (byte offset, line) of up to ``lines_per_chunk`` non-blank lines
    (offsets count from ``start``, the file offset ``fh`` stands at; a line's ``\\r\\n`` end is cut), ``end`` the
    offset after the last line the chunk holds, blank lines before it included: where a later read resumes. The
    last pair comes at the end of the file, its chunk possibly empty, its ``end`` past every line read. The last
    line needs no newline; with ``partial_last_line`` False such a line is left unread (a writer may be in the
    middle of it) and the last ``end`` stops before it. A line longer than ``max_line`` bytes comes as its first
    ``max_line`` bytes (the caller dead-letters it as too long) and the rest of it is skipped unread: memory stays
    bounded by the block, the chunk and ``max_line`` whatever the file holds (a file of gigabytes without a
    newline was read whole into memory)."""
    chunk: list[tuple[int, bytes]] = []
    ends: list[int] = []  # the offset after each line of chunk
    base = start  # file offset of the line being read (rest)
    rest = b""  # the line being read: at most its first max_line bytes
    dropped = 0  # bytes of that line after its first max_line, skipped
    read = start  # file offset after the bytes read
    while True:
        block = fh.read(block_bytes)
        read += len(block)
        if dropped and block:  # inside an overlong line: skip to its end
            nl = block.find(b"\n")
            if nl < 0:
                dropped += len(block)
                continue
            dropped += nl
            block = block[nl:]
        data = rest + block
        lines = data.split(b"\n")
        rest = lines.pop() if block or not partial_last_line else b""
        offset = base
        for k, line in enumerate(lines):
            if dropped and k == 0:  # the head of an overlong line, as read (it must stay too long)
                chunk.append((offset, line))
                offset += dropped
                dropped = 0
                ends.append(offset + len(line) + 1)
            elif line.strip(JSON_WHITESPACE):
                chunk.append((offset, line.rstrip(b"\r")))
                ends.append(offset + len(line) + 1)
            offset += len(line) + 1
        base = offset
        if len(rest) > max_line:
            dropped, rest = len(rest) - max_line, rest[:max_line]
        while len(chunk) >= lines_per_chunk:
            yield chunk[:lines_per_chunk], min(ends[lines_per_chunk - 1], read)
            chunk, ends = chunk[lines_per_chunk:], ends[lines_per_chunk:]
        if not block:
            break
    yield chunk, min(base, read)  # a last line without its newline ends at the end of the file


def _chunks(fh: BinaryIO, lines_per_chunk: int, max_line: int = MAX_LINE_BYTES) -> Iterator[list[tuple[int, bytes]]]:
    """The non-empty chunks of :func:`line_chunks` from the start of ``fh``, without their end offsets."""
    for chunk, _ in line_chunks(fh, lines_per_chunk, max_line=max_line):
        if chunk:
            yield chunk


_encode = msgspec.json.Encoder().encode

_JSON_SETTINGS = {"input_format_skip_unknown_fields": 1, "date_time_input_format": "best_effort",
                  "input_format_null_as_default": 1}


#: The SELECT expressions that normalize a line's counts to the OpenAI-inclusive convention (the store's):
#: collector.gateway_record.inclusive_usage in SQL, over the usage fields staged beside the table's columns.
_EXCLUSIVE = "ifNull(usage_convention, '') = 'exclusive'"
_CACHE_READ = "coalesce(cache_read_input_tokens, cached_tokens)"
_CACHED = f"if({_EXCLUSIVE}, {_CACHE_READ}, cached_tokens)"
_NORMALIZED = {
    "prompt_tokens": f"if({_EXCLUSIVE}, toUInt32(toUInt64(prompt_tokens) + ifNull({_CACHE_READ}, 0) "
                     f"+ ifNull(cache_creation_input_tokens, 0)), prompt_tokens)",
    # a request that read no prefix cache has no hit count (record_usage): stored NULL, not reported, unless the pod
    # reported a hit (then it read the cache); nor has one vLLM ran as several engine requests (one sequence's count)
    "cached_tokens": f"if(engine_requests > 1 OR (skip_reading_prefix_cache AND ifNull({_CACHED}, 0) = 0), NULL, "
                     f"{_CACHED})",
    # the structural hashes arrive as 16 hex characters (staged as strings) and are stored as UInt64
    **{c: f"arrayMap(x -> reinterpretAsUInt64(reverse(unhex(x))), {c})" for c in GATEWAY_HASH_LISTS},
}


#: The columns a conflict is judged on: every column the line sets (ingest.dedup: the live path compares the same).
_CONTENT = [c for c in COLUMNS["gateway_requests"] if c not in ("request_id", "ts")]


@dataclass(frozen=True)
class _Chunk:
    """What :meth:`_JsonStage.insert_absent` did with a chunk's lines: ``inserted`` (rows), ``expired`` (the
    request ids of the lines older than the retention, in order) and ``conflicts`` (the identity (:func:`_key`)
    of each line the store holds with other values → the columns that differ)."""

    inserted: int
    expired: list[str]
    conflicts: dict[str, tuple[str, ...]]


class _JsonStage:
    """A Memory table with gateway_requests' columns (and the usage fields) that ClickHouse fills from the
    validated lines' JSON (its parser, not Python's, builds the columns), then moves into gateway_requests
    minus what it holds, token counts normalized (:data:`_NORMALIZED`); a line whose (request_id, ts) is stored
    with other values is a conflict (found in ClickHouse too)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.name = f"load_{uuid.uuid4().hex}"
        cols = ", ".join(COLUMNS["gateway_requests"])
        store.command(f"CREATE TABLE {self.name} ENGINE = Memory AS SELECT {cols} FROM gateway_requests WHERE 0")
        store.command(f"ALTER TABLE {self.name} ADD COLUMN usage_convention Nullable(String), "
                      "ADD COLUMN cache_read_input_tokens Nullable(UInt32), "
                      "ADD COLUMN cache_creation_input_tokens Nullable(UInt32), "
                      + ", ".join(f"MODIFY COLUMN {c} Array(String)" for c in GATEWAY_HASH_LISTS))

    def insert_absent(self, lines: list[bytes], retention: Retention | None) -> _Chunk:
        """Insert the rows of ``lines`` (records encoded as JSON, one per (request_id, ts)) that the store does not
        hold and that are not older than ``retention`` (:mod:`ingest.retention`). A line whose (request_id, ts)
        the store holds with other values in any column the line sets is a conflict (:data:`_CONTENT`, compared
        in ClickHouse, NULL equal to NULL), looked for only when some line was not inserted. Raises
        :class:`~ingest.errors.RejectedRows` when ClickHouse refuses a line the decoder accepted (the caller then
        loads that chunk line by line), or what the store raises."""
        cols = ", ".join(COLUMNS["gateway_requests"])
        exprs = ", ".join(f"{_NORMALIZED[c]} AS {c}" if c in _NORMALIZED else c for c in COLUMNS["gateway_requests"])
        self.store.command(f"TRUNCATE TABLE {self.name}")
        self.store.insert_raw(self.name, b"\n".join(lines), "JSONEachRow", _JSON_SETTINGS)
        expired: list[str] = []
        live, params = "1", {}
        if retention is not None:  # as Retention.expired: the TTL's whole seconds at or before the cutoff
            live, params = "toDateTime(ts) > {cutoff:DateTime('UTC')}", {"cutoff": retention.cutoff}
            expired = [str(r[0]) for r in self.store.query_rows(
                f"SELECT request_id FROM {self.name} WHERE NOT ({live}) ORDER BY ts, request_id", params)]
        in_range = f"ts >= (SELECT min(ts) FROM {self.name}) AND ts <= (SELECT max(ts) FROM {self.name})"
        before = self.store.query_rows("SELECT count() FROM gateway_requests")[0][0]
        self.store.command(
            f"INSERT INTO gateway_requests ({cols}) SELECT {exprs} FROM {self.name} WHERE {live} "
            f"AND (request_id, ts) NOT IN (SELECT request_id, ts FROM gateway_requests WHERE {in_range}) "
            "LIMIT 1 BY request_id, ts", params)
        inserted = self.store.query_rows("SELECT count() FROM gateway_requests")[0][0] - before
        conflicts: dict[str, tuple[str, ...]] = {}
        if inserted < len(lines) - len(expired):  # some line was a copy: of what is stored, or not?
            differ = ", ".join(f"if(isNotDistinctFrom(s.{c}, g.{c}), '', '{c}')" for c in _CONTENT)
            stored = (f"SELECT request_id, ts, {', '.join(_CONTENT)} FROM gateway_requests WHERE {in_range} "
                      f"AND (request_id, ts) IN (SELECT request_id, ts FROM {self.name})")
            conflicts = {_key(int(r[1]), str(r[0])): tuple(r[2]) for r in self.store.query_rows(
                "SELECT request_id, toUnixTimestamp64Milli(ts), argMin(differ, length(differ)) AS d FROM ("
                f"SELECT s.request_id AS request_id, s.ts AS ts, arrayFilter(x -> x != '', [{differ}]) AS differ "
                f"FROM (SELECT {exprs} FROM {self.name} WHERE {live}) AS s INNER JOIN ({stored}) AS g "
                "ON s.request_id = g.request_id AND s.ts = g.ts) GROUP BY request_id, ts HAVING length(d) > 0",
                params)}
        return _Chunk(inserted, expired, conflicts)

    def drop(self) -> None:
        self.store.command(f"DROP TABLE IF EXISTS {self.name}")


def _expired_letter(path: Path, chunk: list[tuple[int, bytes]], expired: list[str], retention: Retention | None,
                    pod: str, now_ms: int) -> tuple:
    """The dead letter of a chunk's lines older than the retention: where the chunk lies, how many, the
    reason, and their request ids (one per line, capped)."""
    first, last = chunk[0][0], chunk[-1][0]
    reason = retention.reason_for_many(len(expired)) if retention else f"{len(expired)} rows older than the retention"
    raw = "\n".join(expired)[:MAX_RAW]
    dl = DeadLetter(source="gateway_log", reason=reason, raw=raw, location=f"{path}:{first}-{last}")
    ev = envelope(dl, pod=pod, natural_key=(str(path), first, last, "expired"), observed_at_ms=now_ms)
    return dead_letter_row(ev, dl)


def _conflict_letter(path: Path, offset: int, line: bytes, differ: tuple[str, ...], pod: str, now_ms: int) -> tuple:
    """The dead letter of a line whose (request_id, ts) the store holds with other values (``differ``: the
    columns): its place, the reason (:func:`ingest.dedup.conflict_reason`) and the line; keyed by its place and
    text (a re-import adds none)."""
    text = line[:MAX_RAW].decode("utf-8", "replace")
    dl = DeadLetter(source="gateway_log", reason=conflict_reason("gateway_requests", differ), raw=text,
                    location=f"{path}:{offset}")
    ev = envelope(dl, pod=pod, natural_key=(str(path), offset, text[:256], "conflict"), observed_at_ms=now_ms)
    return dead_letter_row(ev, dl)


def _key(ts_ms: int, request_id: str) -> str:
    """A line's identity as one string: its ts in the record's canonical form (UTC, milliseconds, 24 characters:
    :func:`collector.gateway_record.decode_record`) followed by its request_id."""
    at = datetime.fromtimestamp(ts_ms // 1000, UTC)
    return f"{at:%Y-%m-%dT%H:%M:%S}.{ts_ms % 1000:03d}Z{request_id}"


def _rounds(keys: list[str]) -> list[list[int] | None]:
    """The chunk's lines (``keys``: their :func:`_key`) in rounds, each with one line per (request_id, ts), so
    that of the lines sharing one the first in the file is stored (and each later one judged against it): round
    k holds the indexes of the (k+1)-th line of each identity, in order. ``[None]`` (every line, one round) when
    no identity repeats."""
    if len(set(keys)) == len(keys):
        return [None]
    rounds: list[list[int] | None] = []
    nth: dict[str, int] = {}
    for i, key in enumerate(keys):
        n = nth[key] = nth.get(key, -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)  # type: ignore[union-attr]
    return rounds


class CompressedLog(CompressedFile):
    """A gateway log file that is gzip-compressed (rotated logs often are): refused whole, nothing written."""


def load_gateway_log(store: Store, path: str | Path, *, pod: str = "gateway", lines_per_chunk: int = 50_000,
                     stop: threading.Event | None = None,
                     progress: Callable[[LoadStats], None] | None = None) -> LoadStats:
    """Load a finished gateway log (a file, or a pipe: ``<(zcat log.gz)``, read once) into ``store``; returns
    :class:`LoadStats`. ``stop``: when it is set (Ctrl-C), the load ends after the chunk it is in, whose rows and
    dead letters are then all written, and the stats say ``interrupted`` (loading the file again loads the rest:
    what is stored is skipped). ``progress``: called with the stats after each full chunk of ``lines_per_chunk``
    lines. Raises :class:`CompressedLog` for a gzip file (nothing written), what the store raises
    (``StoreUnavailable``: the load may be repeated; rows already loaded are skipped) and ``OSError``. The stage
    table is dropped whatever happens."""
    path = Path(path)
    with path.open("rb") as fh:
        head = fh.peek(2)[:2]
        path = source_path(path)  # one spelling per file: dead letters are keyed by it (a re-import adds none)
        try:
            refuse_gzip(head, path, "a gateway log")
        except CompressedFile as exc:
            raise CompressedLog(str(exc)) from None
        return _load(store, fh, path, pod, lines_per_chunk, stop, progress)


def _load(store: Store, fh: BinaryIO, path: Path, pod: str, lines_per_chunk: int, stop: threading.Event | None,
          progress: Callable[[LoadStats], None] | None) -> LoadStats:
    """:func:`load_gateway_log` of the open file ``fh`` (keyed by ``path``)."""
    stats = LoadStats()
    json_stage = _JsonStage(store)
    retentions = Retentions(store)
    now_ms = int(time.time() * 1000)
    try:
        for chunk in _chunks(fh, lines_per_chunk):
            if stop is not None and stop.is_set():
                stats.interrupted = True
                break
            good: list[bytes] = []
            keys: list[str] = []  # each good line's identity (_key): strings, not records (less for the GC to walk)
            at: list[int] = []  # each good line's index in the chunk
            dead = []
            for j, (offset, line) in enumerate(chunk):
                try:
                    if len(line) >= MAX_LINE_BYTES:  # as the live path: GatewayLogSource's reason, by its head
                        raise BadRecord(f"line longer than {MAX_LINE_BYTES} bytes")
                    rec = decode_record(line)
                    good.append(_encode(rec))
                    keys.append(rec.ts + rec.request_id)
                    at.append(j)
                except BadRecord as exc:
                    text = line[:MAX_RAW].decode("utf-8", "replace")
                    dl = DeadLetter(source="gateway_log", reason=str(exc), raw=text[:MAX_RAW],
                                    location=f"{path}:{offset}")
                    ev = envelope(dl, pod=pod, natural_key=(str(path), offset, text[:256]), observed_at_ms=now_ms)
                    dead.append(dead_letter_row(ev, dl))
            stats.lines += len(chunk)
            if good:
                rows, conflicts, expired, letters = 0, 0, [], []
                try:
                    for turn in _rounds(keys):  # the first line of each identity, then the second, ...
                        idx = range(len(good)) if turn is None else turn
                        done = json_stage.insert_absent(good if turn is None else [good[i] for i in idx],
                                                        retentions.get("gateway_requests"))
                        rows, conflicts = rows + done.inserted, conflicts + len(done.conflicts)
                        expired += done.expired
                        letters += [_conflict_letter(path, *chunk[at[i]], done.conflicts[keys[i]], pod, now_ms)
                                    for i in idx if keys[i] in done.conflicts]
                except (RejectedRows, TooManyPartitions):  # ClickHouse refused a line the decoder accepted, or
                    # the chunk spans more partitions than the server lets this user write at once: this chunk
                    # through the live path (rows in halves until they fit; a refused or conflicting row becomes
                    # a dead letter with its reason; the rows of a round already inserted are copies there)
                    events = [line_event(line, pod=pod, source_file=str(path), offset=off) for off, line in chunk]
                    ingester = ingest_events(store, [e for e in events if e.schema == "gateway_request"])
                    rows += ingester.rows_written.get("gateway_requests", 0)
                    conflicts, expired, letters = ingester.rows_conflicting.get("gateway_requests", 0), [], []
                    stats.dead_letters += ingester.rows_written.get("dead_letters", 0)
                stats.rows += rows
                stats.conflicts += conflicts
                stats.duplicates += len(good) - len(expired) - rows - conflicts
                dead += letters
                if expired:  # one dead letter per chunk: its count, reason and request ids
                    stats.expired += len(expired)
                    dead.append(_expired_letter(path, chunk, expired, retentions.get("gateway_requests"), pod,
                                                now_ms))
            if dead:
                keep = absent_rows(store, "dead_letters", dead, COLUMNS["dead_letters"])
                store.insert("dead_letters", [dead[i] for i in keep], COLUMNS["dead_letters"])
                stats.dead_letters += len(keep)
            if progress is not None and len(chunk) == lines_per_chunk:
                progress(stats)
    finally:
        json_stage.drop()
    return stats
