"""The gateway fingerprint log's record, typed (gateway log line → here → GatewayRequest event or dead letter):
the one contract of a log line, used by the tailer, ``kvscope import``, the bulk path and the ingester's row
mapping, so the checks live in one place.

A line is a UTF-8 JSON object described by ``gateway/gateway_log.v1.schema.json``; :class:`GatewayRecord` is
the same contract as a msgspec Struct (a test runs good and bad lines through both and checks they agree).
What the schema cannot say is checked here after decoding and described in the schema's prose: ``ts`` is a
real date and time, in 2000..2100 once converted to UTC, and ``cached_tokens`` ≤ ``prompt_tokens`` when known
and the usage convention is OpenAI's (under "exclusive", ``cached_tokens`` equals ``cache_read_input_tokens``
when both are given, and the inclusive prompt fits a UInt32).

- Strict UTF-8: invalid bytes refuse the line ("not UTF-8 at byte N"), never U+FFFD; a UTF-8 byte order
  mark before the line is dropped (JSON text MAY start with one, RFC 8259 §8.1).
- ``log_version`` must be the integer 1 (what ``gateway/log.py`` writes).
- ``cached_tokens`` is required and may be null: the pod did not report it (unknown, not 0).
- Usage conventions (``usage_convention``; docs/miss-causes.md "Usage conventions"): :func:`inclusive_usage`
  turns a record's counts into the OpenAI-inclusive ones the store holds.
- Required: ``log_version``, ``request_id`` (non-empty), ``ts``, ``tenant_id`` (may be empty: no tenant),
  ``status``, ``prompt_tokens``, ``cached_tokens``, ``ttft_ms``, ``e2e_ms``. Every other field may be absent;
  absent means what the reference gateway writes for "none": '' for text and hashes, 0 for token counts,
  false for ``stream``, null for ``queue_wait_ms`` / ``tool_latency_ms``. A field present with the wrong
  type (null included, except for those two) refuses the line.
- Hashes: 16 lowercase hex characters, or '' when the segment is absent (``gateway/fingerprint.py``).
- Precise mode (``gateway/block_chain.py``): ``prompt_block_hashes`` is a list of at most
  :data:`kvscope.block_hash.MAX_PROMPT_BLOCKS` hashes of 16 lowercase hex characters (never ''), and a non-empty
  list needs ``prompt_block_size`` ≥ 1; [] / 0 = no chain.
- Structure (``system_line_hashes``/``_tokens`` ≤ :data:`MAX_LINES` entries, ``suffix_chunk_hashes``/``_tokens``
  ≤ :data:`MAX_CHUNKS`): every hash 16 lowercase hex characters, and one token count per hash.
- Identifiers and labels: at most :data:`NAME_MAX_CHARS` characters, else the line is refused (they are keys:
  cutting them would merge distinct values). Free text is kept, cut to its cap with a visible marker
  (:data:`TEXT_CAPS`): a 5 MB ``error`` is stored as 1,024 characters, its first 998 and
  ``…[truncated 4999002 chars]``.
- ``ts`` is rewritten in one canonical form, UTC with milliseconds (``2026-11-29T12:00:00.123Z``, fraction
  truncated like ``gateway.log.format_ts``), so every path keys a request by the same (request_id, ts).

Unknown fields are ignored. Decoding is msgspec's (C) plus the checks above, a few µs a line; a refusal is
:class:`BadRecord` whose message is the dead-letter reason.
"""

from __future__ import annotations

import operator
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Annotated, Any, Literal

import msgspec

from kvscope.block_hash import MAX_PROMPT_BLOCKS

U16 = Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
#: Milliseconds: finite, non-negative (JSON has no NaN; msgspec refuses an int too large for a float).
Ms = Annotated[float, msgspec.Meta(ge=0, lt=1e15)]
#: Longest identifier or label (request_id, tenant_id, conversation_id, agent_run_id, model, pod, endpoint,
#: routing_policy, token_count_method), in characters.
NAME_MAX_CHARS = 512
Name = Annotated[str, msgspec.Meta(max_length=NAME_MAX_CHARS)]
#: The schema's pattern for hashes (``(?!\n)$``: Python's ``$``, which jsonschema uses too, also matches
#: before a final newline). :func:`_checked` applies it to all hash fields at once, with one regex over
#: their values joined: as a msgspec ``Meta(pattern=...)`` it ran through Python's re once per field, which
#: tripled the decoding time.
HASH_PATTERN = r"^(?:[0-9a-f]{16})?(?!\n)$"
#: RFC 3339 date-time with a time zone, year 2000..2099, at most 9 fraction digits; the groups are read by
#: :func:`_parse_ts`.
TS_PATTERN = (r"^(20[0-9]{2})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt]([01][0-9]|2[0-3]):([0-5][0-9]):"
              r"([0-5][0-9])(?:\.([0-9]{1,9}))?([Zz]|([+-])([01][0-9]|2[0-3]):([0-5][0-9]))(?!\n)$")
#: The structural arrays (gateway/fingerprint.py): hash list → its token list, and the most entries each may hold.
STRUCTURE_FIELDS = {"system_line_hashes": "system_line_tokens", "suffix_chunk_hashes": "suffix_chunk_tokens"}
MAX_LINES = 256
MAX_CHUNKS = 64
#: The most pods ``pods_down`` may name.
MAX_PODS_DOWN = 256
_HASH_ITEM = re.compile(r"[0-9a-f]{16}")
#: Free-text fields and their caps in characters; a longer value is cut to the cap, the marker included.
TEXT_CAPS = {"error": 1024, "routing_reason": 256}
TRUNCATED_MARKER = "…[truncated {n} chars]"


class GatewayRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the gateway logged it. Token counts in tokens, durations in ms; an absent optional
    field holds its "none" value ('' / 0 / False / None), which is also what the store holds. The fields
    named ``*_hash`` and ``prompt_fingerprint`` follow :data:`HASH_PATTERN` and ``ts`` :data:`TS_PATTERN`
    (checked after decoding, by :func:`decode_record` and :func:`record_from_builtins`)."""

    log_version: Literal[1]
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX_CHARS)]
    ts: str  # TS_PATTERN, checked by _checked
    tenant_id: Name
    status: U16
    prompt_tokens: U32
    cached_tokens: U32 | None  # None: the pod did not report it (unknown, not 0)
    ttft_ms: Ms
    e2e_ms: Ms
    conversation_id: Name = ""
    agent_run_id: Name = ""
    model: Name = ""
    pod: Name = ""
    endpoint: Name = ""
    routing_policy: Name = ""
    routing_reason: str = ""
    pods_down: Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_PODS_DOWN)] = ()
    stream: bool = False
    skip_reading_prefix_cache: bool = False
    continue_final_message: bool = False
    engine_requests: Annotated[int, msgspec.Meta(ge=1, le=2**16 - 1)] = 1
    error: str = ""
    completion_tokens: U32 = 0
    queue_wait_ms: Ms | None = None
    tool_latency_ms: Ms | None = None
    system_hash: str = ""
    system_norm_hash: str = ""
    system_tokens: U32 = 0
    tools_hash: str = ""
    tools_canonical_hash: str = ""
    tools_tokens: U32 = 0
    retrieval_pack_hash: str = ""
    retrieval_set_hash: str = ""
    retrieval_tokens: U32 = 0
    history_prefix_hash: str = ""
    prev_history_hash: str = ""
    prev_suffix_hash: str = ""
    next_history_hash: str = ""
    first_message_hash: str = ""
    prefill_history_hash: str = ""
    history_tokens: U32 = 0
    suffix_hash: str = ""
    suffix_tokens: U32 = 0
    prompt_fingerprint: str = ""
    cache_salt_hash: str = ""
    token_count_method: Name = ""
    usage_convention: Literal["openai", "exclusive"] | None = None
    cache_read_input_tokens: U32 | None = None
    cache_creation_input_tokens: U32 | None = None
    prompt_block_hashes: Annotated[list[str], msgspec.Meta(max_length=MAX_PROMPT_BLOCKS)] = []
    prompt_block_size: U32 = 0
    system_line_hashes: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_LINES)] = ()
    system_line_tokens: Annotated[tuple[U32, ...], msgspec.Meta(max_length=MAX_LINES)] = ()
    suffix_chunk_hashes: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_CHUNKS)] = ()
    suffix_chunk_tokens: Annotated[tuple[U32, ...], msgspec.Meta(max_length=MAX_CHUNKS)] = ()


class BadRecord(ValueError):
    """A log line that is not a usable gateway record; the message is the dead-letter reason."""


_decoder = msgspec.json.Decoder(GatewayRecord)
_MISSING = re.compile(r"Object missing required field `(\w+)`")
_AT = re.compile(r"^(.*?) - at `\$\.(\w+)(?:\[\d+\])?`$")
_TS = re.compile(TS_PATTERN)
_BOM = b"\xef\xbb\xbf"
_HASHES = tuple(f for f in GatewayRecord.__struct_fields__ if f.endswith("_hash") or f == "prompt_fingerprint")
_hashes_of = operator.attrgetter(*_HASHES)
_ONE_HASH = re.compile(r"(?:[0-9a-f]{16})?")
_ALL_HASHES = re.compile(r"(?:[0-9a-f]{16})?" + r",(?:[0-9a-f]{16})?" * (len(_HASHES) - 1))
_CHAIN = re.compile(r"[0-9a-f]{16}(?:,[0-9a-f]{16})*")
#: The times kvscope stores, [EARLIEST, LATEST) UTC: inside ClickHouse's DateTime (1970..2106), which the TTLs
#: and rollups use (``toDateTime(ts)``), with room for a TTL interval.
EARLIEST, LATEST = datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _reason(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if m := _MISSING.search(text):
        field = m.group(1)
        return "missing log_version (this reader knows version 1)" if field == "log_version" else \
            f"missing field {field}"
    if text.startswith("Expected `object`, got"):
        return f"line is JSON {text.split('got `', 1)[1].rstrip('`')}, not an object"
    if m := _AT.match(text):
        detail, field = m.group(1), m.group(2)
        if field == "log_version":
            return f"log_version must be the integer 1, this reader's version ({detail})"
        return f"field {field}: {detail}"
    return text


def _parse_ts(ts: str) -> datetime:
    """``ts`` → aware datetime, fraction truncated to µs. Raises :class:`BadRecord` when it does not match
    :data:`TS_PATTERN`, is not a real date and time (2026-02-30) or is outside 2000..2100 UTC."""
    m = _TS.match(ts)
    if m is None:
        raise BadRecord("field ts: not an RFC 3339 timestamp with a time zone in 2000..2099")
    year, month, day, hour, minute, second, frac, _, sign, off_h, off_m = m.groups()
    tz = UTC
    if sign:
        offset = timedelta(hours=int(off_h), minutes=int(off_m))
        tz = timezone(-offset if sign == "-" else offset)
    try:
        dt = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                      int((frac or "0")[:6].ljust(6, "0")), tzinfo=tz)
    except ValueError as exc:
        raise BadRecord(f"ts {ts} is not a real date and time ({exc})") from exc
    if not EARLIEST <= dt < LATEST:
        raise BadRecord(f"ts {ts} is outside 2000..2100 (UTC)")
    return dt


def _cap(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and the marker, ``limit`` characters in all
    (so a capped value passes the cap again unchanged)."""
    if len(text) <= limit:
        return text
    digits = 1
    while True:  # the marker's length depends on the count it names
        keep = limit - len(TRUNCATED_MARKER.format(n=0)) - digits + 1
        cut = len(text) - keep
        if len(str(cut)) == digits:
            return text[:keep] + TRUNCATED_MARKER.format(n=cut)
        digits += 1


def _checked(rec: GatewayRecord) -> GatewayRecord:
    """The checks the Struct's types do not make; returns the record with ts canonical, free text capped and
    ``pods_down`` sorted without repeats (it is a set of pods: a gateway that lists them in another order, or twice,
    logs the same record, so two copies of a line differing only there are one request, not a conflict)."""
    hashes = _hashes_of(rec)
    if not _ALL_HASHES.fullmatch(",".join(hashes)):  # one regex over all of them: ~0.5 µs, not 10 × 1 µs
        field = next(f for f, v in zip(_HASHES, hashes, strict=True) if not _ONE_HASH.fullmatch(v))
        raise BadRecord(f"field {field}: not a hash (16 lowercase hex characters, or '' when the segment is "
                        "absent)")
    _check_chain(rec)
    if rec.system_line_hashes or rec.system_line_tokens or rec.suffix_chunk_hashes or rec.suffix_chunk_tokens:
        _check_structure(rec)
    ts = _canonical_ts(rec.ts)
    if rec.usage_convention == "exclusive":
        if None not in (rec.cached_tokens, rec.cache_read_input_tokens) and \
                rec.cached_tokens != rec.cache_read_input_tokens:
            raise BadRecord(f"exclusive usage: cached_tokens {rec.cached_tokens} differs from "
                            f"cache_read_input_tokens {rec.cache_read_input_tokens}")
        if record_usage(rec)[0] > 2**32 - 1:
            raise BadRecord("exclusive usage: input + cache read + cache creation tokens exceed 2^32 - 1")
    elif rec.cached_tokens is not None and rec.cached_tokens > rec.prompt_tokens:
        raise BadRecord(f"cached_tokens {rec.cached_tokens} exceeds prompt_tokens {rec.prompt_tokens}")
    changes: dict[str, Any] = {}
    if ts is not rec.ts:
        changes["ts"] = ts
    if len(rec.error) > TEXT_CAPS["error"]:
        changes["error"] = _cap(rec.error, TEXT_CAPS["error"])
    if len(rec.routing_reason) > TEXT_CAPS["routing_reason"]:
        changes["routing_reason"] = _cap(rec.routing_reason, TEXT_CAPS["routing_reason"])
    if rec.pods_down and any(a >= b for a, b in zip(rec.pods_down, rec.pods_down[1:], strict=False)):
        changes["pods_down"] = tuple(sorted(set(rec.pods_down)))  # a set: two copies differing in order are one
    return msgspec.structs.replace(rec, **changes) if changes else rec


def _check_chain(rec: GatewayRecord) -> None:
    """``prompt_block_hashes``: each 16 lowercase hex characters (one regex over them joined; the length check
    makes a comma inside an item fail), and a block size when there are any. Raises :class:`BadRecord`."""
    chain = rec.prompt_block_hashes
    if not chain:
        return
    joined = ",".join(chain)
    if len(joined) != 17 * len(chain) - 1 or not _CHAIN.fullmatch(joined):
        at = next(i for i, h in enumerate(chain) if len(h) != 16 or not _CHAIN.fullmatch(h))
        raise BadRecord(f"field prompt_block_hashes: item {at} is not a hash (16 lowercase hex characters)")
    if rec.prompt_block_size == 0:
        raise BadRecord("field prompt_block_hashes: a chain without prompt_block_size (≥ 1)")
def _check_structure(rec: GatewayRecord) -> None:
    """Each structural hash is 16 lowercase hex characters and each hash list has exactly one token count per
    entry; raises :class:`BadRecord`."""
    for hashes_field, tokens_field in STRUCTURE_FIELDS.items():
        hashes, tokens = getattr(rec, hashes_field), getattr(rec, tokens_field)
        if not all(_HASH_ITEM.fullmatch(h) for h in hashes):
            raise BadRecord(f"field {hashes_field}: an entry is not a hash (16 lowercase hex characters)")
        if len(hashes) != len(tokens):
            raise BadRecord(f"field {tokens_field}: {len(tokens)} entries, {hashes_field} has {len(hashes)}")


def _canonical_ts(ts: str) -> str:
    """``ts`` in the stored form (UTC, ms, ``Z``); ``ts`` itself when it already is (what gateways write)."""
    if len(ts) == 24 and ts[10] == "T" and ts[19] == "." and ts[23] == "Z" and _TS.match(ts):
        try:  # the fast path: fromisoformat is C, and the form leaves nothing to convert
            dt = datetime.fromisoformat(ts)
        except ValueError:
            _parse_ts(ts)  # raises with the reason
            raise
        if not EARLIEST <= dt < LATEST:
            raise BadRecord(f"ts {ts} is outside 2000..2100 (UTC)")
        return ts
    dt = _parse_ts(ts).astimezone(UTC)
    return (f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}T{dt.hour:02d}:{dt.minute:02d}:{dt.second:02d}."
            f"{dt.microsecond // 1000:03d}Z")


def decode_record(line: bytes | str) -> GatewayRecord:
    """One log line (without its newline) → :class:`GatewayRecord`. Raises :class:`BadRecord` with the reason:
    not UTF-8 (at byte N), not JSON, not an object, a missing or mistyped field, log_version not 1, a ts that
    is not RFC 3339 with a time zone or outside 2000..2100, cached > prompt."""
    if isinstance(line, str):
        try:
            line = line.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRecord(f"not UTF-8: a lone surrogate at character {exc.start}") from exc
    if line.startswith(_BOM):
        line = line[len(_BOM):]
    try:  # the whole line: msgspec skips unknown fields' keys and values without checking them
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise BadRecord(f"not UTF-8 at byte {bad.start}") from None
    try:
        rec = _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise BadRecord(_reason(exc)) from exc
    except msgspec.DecodeError as exc:
        raise BadRecord(f"not JSON: {exc}") from exc
    except (RecursionError, OverflowError, ValueError) as exc:  # defensive: msgspec raises the two above
        raise BadRecord(f"not JSON: {type(exc).__name__}: {exc}") from exc
    return _checked(rec)


def record_from_builtins(obj: Any) -> GatewayRecord:
    """A record already decoded into Python values (an envelope's ``GatewayRequest.record``, which any
    producer may have built) → :class:`GatewayRecord`, with the same checks as :func:`decode_record`.
    Raises :class:`BadRecord`."""
    try:
        return _checked(msgspec.convert(obj, GatewayRecord))
    except msgspec.ValidationError as exc:
        raise BadRecord(_reason(exc)) from exc


def inclusive_usage(prompt_tokens: int, cached_tokens: int | None, usage_convention: str | None = None,
                    cache_read_input_tokens: int | None = None,
                    cache_creation_input_tokens: int | None = None) -> tuple[int, int | None]:
    """(prompt tokens, cached tokens or None = not reported) in the OpenAI-inclusive convention, the one the
    store holds, from a record's fields of the same names (docs/miss-causes.md, "Usage conventions").

    "openai" (or None): as logged. "exclusive" (Anthropic-style): prompt = input (``prompt_tokens``) + cache read
    + cache creation, cached = cache read, where cache read = ``cache_read_input_tokens``, else
    ``cached_tokens``; an unknown cache read gives prompt = input + cache creation and cached None."""
    if usage_convention != "exclusive":
        return prompt_tokens, cached_tokens
    read = cache_read_input_tokens if cache_read_input_tokens is not None else cached_tokens
    return prompt_tokens + (read or 0) + (cache_creation_input_tokens or 0), read


def record_usage(rec: GatewayRecord) -> tuple[int, int | None]:
    """:func:`inclusive_usage` of a decoded record; the cached count None (not reported) for

    - a request that read no prefix cache (``skip_reading_prefix_cache``: vLLM counts it in neither
      ``prefix_cache_queries`` nor ``prefix_cache_hits``, so its 0 is no hit count, and the hit rate leaves it out
      as vLLM's does). A hit the pod reported for such a line (cached > 0) proves vLLM read the cache: the count
      is kept, the flag was wrong;
    - a request vLLM ran as several engine requests (``engine_requests`` > 1: ``n`` > 1 or several prompts): its
      reported count is one sequence's, not the prompt's (``gateway.fingerprint.engine_requests``)."""
    prompt, cached = inclusive_usage(rec.prompt_tokens, rec.cached_tokens, rec.usage_convention,
                                     rec.cache_read_input_tokens, rec.cache_creation_input_tokens)
    if rec.engine_requests > 1:
        return prompt, None
    return prompt, None if rec.skip_reading_prefix_cache and not cached else cached


def ts_ms(rec: GatewayRecord) -> int:
    """The ts of a checked record (canonical: UTC, milliseconds) as unix milliseconds (exact: no float
    rounding)."""
    return (datetime.fromisoformat(rec.ts) - _EPOCH) // timedelta(milliseconds=1)
