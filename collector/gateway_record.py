"""The gateway fingerprint log's record, typed (gateway log line → here → GatewayRequest event or dead letter):
one decoder for the tailer, ``kvscope import`` and the bulk path, so the checks live in one place.

A line is a JSON object (``gateway/gateway_log.v1.schema.json``); :class:`GatewayRecord` lists what kvscope
reads, with the column types' ranges (UInt16 status, UInt32 token counts, non-negative finite ms). Decoding
is msgspec's (C, ~1 µs a line): unknown fields are ignored, a field of the wrong type or out of range is
refused with the field's name. Required: ``request_id`` (non-empty), ``ts`` (RFC 3339 with a time zone, in
2000..2100), ``prompt_tokens``, ``cached_tokens`` (≤ prompt_tokens).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import msgspec

U16 = Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
#: Milliseconds: finite, non-negative (JSON has no NaN; msgspec refuses an int too large for a float).
Ms = Annotated[float, msgspec.Meta(ge=0, lt=1e15)]
_EARLIEST, _LATEST = datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC)


class GatewayRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the gateway logged it. Token counts in tokens, durations in ms; optional fields default
    to None (unknown) and are stored as ''/0 where the column has no NULL."""

    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    ts: datetime
    prompt_tokens: U32
    cached_tokens: U32
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
    if rec.cached_tokens > rec.prompt_tokens:
        raise BadRecord(f"cached_tokens {rec.cached_tokens} exceeds prompt_tokens {rec.prompt_tokens}")
    return rec


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ts_ms(rec: GatewayRecord) -> int:
    """The record's ts as unix milliseconds (truncated, exact: no float rounding)."""
    return (rec.ts - _EPOCH) // timedelta(milliseconds=1)
