"""The gateway fingerprint log's record, typed (gateway log line → here → GatewayRequest event or dead letter):
one decoder for the tailer, ``kvscope import`` and the bulk path, so the checks live in one place.

A line is a JSON object (``gateway/gateway_log.v1.schema.json``); :class:`GatewayRecord` lists what kvscope
reads, with the column types' ranges (UInt16 status, UInt32 token counts, non-negative finite ms). Decoding
is msgspec's (C, ~1 µs a line): unknown fields are ignored, a field of the wrong type or out of range is
refused with the field's name. Required: ``request_id`` (non-empty), ``ts`` (RFC 3339 with a time zone, in
2000..2100), ``prompt_tokens``, ``cached_tokens`` (null = the pod did not report it; ≤ prompt_tokens when known
and the usage convention is OpenAI's). Usage conventions (``usage_convention``; docs/miss-causes.md "Usage
conventions"): :func:`inclusive_usage` turns a record's counts into OpenAI-inclusive ones.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

import msgspec

U16 = Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
#: Milliseconds: finite, non-negative (JSON has no NaN; msgspec refuses an int too large for a float).
Ms = Annotated[float, msgspec.Meta(ge=0, lt=1e15)]
_EARLIEST, _LATEST = datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC)


class GatewayRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the gateway logged it. Token counts in tokens, durations in ms; optional fields default
    to None (unknown) and are stored as ''/0 where the column has no NULL (``cached_tokens`` stays NULL).

    ``usage_convention``: how the token counts are meant (None = "openai"): "openai" = ``prompt_tokens``
    includes the cached ones (vLLM, OpenAI); "exclusive" = Anthropic-style, ``prompt_tokens`` holds only the
    uncached input (``input_tokens``), the cache reads are in ``cache_read_input_tokens`` (else
    ``cached_tokens``) and the tokens written to the cache in ``cache_creation_input_tokens``."""

    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    ts: datetime
    prompt_tokens: U32
    cached_tokens: U32 | None
    tenant_id: str | None = None
    conversation_id: str | None = None
    agent_run_id: str | None = None
    model: str | None = None
    pod: str | None = None
    endpoint: str | None = None
    routing_policy: str | None = None
    routing_reason: str | None = None
    stream: bool | None = None
    status: U16 | None = None
    error: str | None = None
    completion_tokens: U32 | None = None
    ttft_ms: Ms | None = None
    e2e_ms: Ms | None = None
    queue_wait_ms: Ms | None = None
    tool_latency_ms: Ms | None = None
    system_hash: str | None = None
    system_norm_hash: str | None = None
    system_tokens: U32 | None = None
    tools_hash: str | None = None
    tools_canonical_hash: str | None = None
    tools_tokens: U32 | None = None
    retrieval_pack_hash: str | None = None
    retrieval_set_hash: str | None = None
    retrieval_tokens: U32 | None = None
    history_prefix_hash: str | None = None
    prev_history_hash: str | None = None
    history_tokens: U32 | None = None
    suffix_hash: str | None = None
    suffix_tokens: U32 | None = None
    prompt_fingerprint: str | None = None
    token_count_method: str | None = None
    usage_convention: Literal["openai", "exclusive"] | None = None
    cache_read_input_tokens: U32 | None = None
    cache_creation_input_tokens: U32 | None = None


class BadRecord(ValueError):
    """A log line that is not a usable gateway record; the message is the dead-letter reason."""


_decoder = msgspec.json.Decoder(GatewayRecord)
_MISSING = re.compile(r"Object missing required field `(\w+)`")
_AT = re.compile(r"^(.*?) - at `\$\.(\w+)`$")


def _reason(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if m := _MISSING.search(text):
        return f"missing field {m.group(1)}"
    if text.startswith("Expected `object`, got"):
        return f"line is JSON {text.split('got `', 1)[1].rstrip('`')}, not an object"
    if m := _AT.match(text):
        return f"field {m.group(2)}: {m.group(1)}"
    return text


def decode_record(line: bytes | str) -> GatewayRecord:
    """One log line → :class:`GatewayRecord`. Raises :class:`BadRecord` with the reason (not JSON, not an
    object, a missing or mistyped field, ts without a time zone or outside 2000..2100, cached > prompt)."""
    try:
        rec = _decoder.decode(line)
    except msgspec.ValidationError as exc:
        if "`$.ts`" in str(exc) or "datetime" in str(exc):
            raise BadRecord(f"ts is not an RFC 3339 timestamp ({exc})") from exc
        raise BadRecord(_reason(exc)) from exc
    except msgspec.DecodeError as exc:
        raise BadRecord(f"not JSON: {exc}") from exc
    if rec.ts.tzinfo is None:
        raise BadRecord(f"ts {rec.ts.isoformat()} has no time zone")
    if not _EARLIEST <= rec.ts < _LATEST:
        raise BadRecord(f"ts {rec.ts.isoformat()} is outside 2000..2100")
    if rec.usage_convention == "exclusive":
        if None not in (rec.cached_tokens, rec.cache_read_input_tokens) and \
                rec.cached_tokens != rec.cache_read_input_tokens:
            raise BadRecord(f"exclusive usage: cached_tokens {rec.cached_tokens} differs from "
                            f"cache_read_input_tokens {rec.cache_read_input_tokens}")
        if record_usage(rec)[0] > 2**32 - 1:
            raise BadRecord("exclusive usage: input + cache read + cache creation tokens exceed 2^32 - 1")
    elif rec.cached_tokens is not None and rec.cached_tokens > rec.prompt_tokens:
        raise BadRecord(f"cached_tokens {rec.cached_tokens} exceeds prompt_tokens {rec.prompt_tokens}")
    return rec


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
    """:func:`inclusive_usage` of a decoded record."""
    return inclusive_usage(rec.prompt_tokens, rec.cached_tokens, rec.usage_convention,
                           rec.cache_read_input_tokens, rec.cache_creation_input_tokens)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ts_ms(rec: GatewayRecord) -> int:
    """The record's ts as unix milliseconds (truncated, exact: no float rounding)."""
    return (rec.ts - _EPOCH) // timedelta(milliseconds=1)
