"""The gateway log's one contract: :class:`collector.gateway_record.GatewayRecord` and
``gateway/gateway_log.v1.schema.json`` (with the rules its description states in prose) accept and refuse the
same lines, hand-built and generated; the parser never raises anything but a dead letter with a reason; and
each hygiene rule holds on the live path, ``kvscope import`` and the bulk path alike."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collector.events import GatewayRequest, envelope
from collector.gateway_log import line_event, read_file
from collector.gateway_record import TS_PATTERN, BadRecord, decode_record
from gateway.log import SCHEMA_PATH
from ingest.bulk import load_gateway_log
from ingest.rows import rows_for
from kvscope.importer import import_events
from tests.clock import DAY

BOM = b"\xef\xbb\xbf"
H1, H2 = "0123456789abcdef", "fedcba9876543210"
GOOD: dict[str, Any] = {
    "log_version": 1, "request_id": "r-1", "ts": f"{DAY}T12:00:00.123Z", "tenant_id": "acme", "status": 200,
    "prompt_tokens": 762, "cached_tokens": 736, "ttft_ms": 50.0, "e2e_ms": 80.0,
}
FULL: dict[str, Any] = {
    **GOOD, "conversation_id": "c-1", "agent_run_id": "", "model": "tiny", "pod": "pod-0",
    "endpoint": "chat.completions", "routing_policy": "round_robin", "routing_reason": "round_robin", "stream": True,
    "pods_down": ["pod-1"], "continue_final_message": False, "prefill_history_hash": H1,
    "error": "", "completion_tokens": 8, "queue_wait_ms": 1.5, "tool_latency_ms": None, "system_hash": H1,
    "system_norm_hash": H1, "system_tokens": 720, "tools_hash": "", "tools_canonical_hash": "", "tools_tokens": 0,
    "retrieval_pack_hash": "", "retrieval_set_hash": "", "retrieval_tokens": 0, "history_prefix_hash": H2,
    "prev_history_hash": "", "history_tokens": 20, "suffix_hash": H2, "suffix_tokens": 22,
    "prompt_fingerprint": H1, "token_count_method": "tokenizer", "prompt_block_hashes": [H1, H2],
    "prompt_block_size": 32,
    "system_line_hashes": [H1, H2, H1], "system_line_tokens": [5, 0, 7], "suffix_chunk_hashes": [H2],
    "suffix_chunk_tokens": [22],
}

# --- the schema side: the JSON Schema, plus what its description says it cannot express ------------------------

_SCHEMA = json.loads(SCHEMA_PATH.read_text())
# "Integers are JSON integer literals (1, not 1.0)": JSON Schema alone would take 1.0 for an integer.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool)),
)
_Validator.check_schema(_SCHEMA)
VALIDATOR = _Validator(_SCHEMA)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _all_text_is_unicode(value: Any) -> bool:
    """A lone surrogate (``"\\ud800"``) is valid JSON syntax but not Unicode text, so not UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_all_text_is_unicode(k) and _all_text_is_unicode(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_all_text_is_unicode(v) for v in value)
    return True


def _prose_rules(obj: dict[str, Any]) -> bool:
    """The schema description's own words: ts a real date and time in 2000..2100 UTC; cached ≤ prompt."""
    ts = obj["ts"]
    zone = "+00:00" if ts[-1] in "Zz" else ts[-6:]
    try:
        moment = datetime.fromisoformat(f"{ts[:10]}T{ts[11:19]}{zone}")
    except ValueError:
        return False
    if not datetime(2000, 1, 1, tzinfo=UTC) <= moment < datetime(2100, 1, 1, tzinfo=UTC):
        return False
    for hashes, tokens in (("system_line_hashes", "system_line_tokens"),
                           ("suffix_chunk_hashes", "suffix_chunk_tokens")):
        if len(obj.get(hashes, [])) != len(obj.get(tokens, [])):
            return False
    cached = obj["cached_tokens"]
    return cached is None or cached <= obj["prompt_tokens"]


def schema_accepts(line: bytes) -> bool:
    """Whether the schema (and its prose) accepts ``line``: UTF-8 text (a BOM first is ignored) holding one JSON
    value that validates."""
    if line.startswith(BOM):
        line = line[len(BOM):]
    try:
        text = line.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False
    return _all_text_is_unicode(value) and VALIDATOR.is_valid(value) and _prose_rules(value)


def record_accepts(line: bytes) -> bool:
    try:
        decode_record(line)
    except BadRecord as exc:
        assert str(exc), f"empty reason for {line[:200]!r}"
        return False
    return True


@pytest.fixture(autouse=True, scope="module")
def _long_ints() -> Any:
    """Python's json refuses integers of more than 4,300 digits (a CPython limit, not JSON's); msgspec skips
    them in unknown fields. Lift the limit so the schema side judges JSON, not CPython."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(before)


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def without(*fields: str, base: dict[str, Any] = GOOD) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k not in fields}


# (line, accepted?): every rule of the contract, from both sides of its edge
CORPUS: list[tuple[bytes, bool]] = [
    (line(GOOD), True),
    (line(FULL), True),
    (line({**GOOD, "system_line_hashes": [H1] * 256, "system_line_tokens": [1] * 256}), True),
    (line({**GOOD, "system_line_hashes": [H1] * 257, "system_line_tokens": [1] * 257}), False),
    (line({**GOOD, "system_line_hashes": [H1, ""], "system_line_tokens": [1, 2]}), False),
    (line({**GOOD, "system_line_hashes": [H1], "system_line_tokens": []}), False),
    (line({**GOOD, "suffix_chunk_tokens": [2**32]}), False),
    (line({**GOOD, "suffix_chunk_hashes": None}), False),
    (BOM + line(GOOD), True),
    (line({**GOOD, "tenant_id": ""}), True),
    (line({**GOOD, "unknown_field": {"x": [1, 2]}}), True),
    (line({**GOOD, "ts": "2026-11-29T12:00:00+05:30"}), True),
    (line({**GOOD, "ts": "2026-11-29t12:00:00.123456789z"}), True),
    (line({**GOOD, "ts": "2000-01-01T00:00:00Z"}), True),
    (line({**GOOD, "ts": "2099-12-31T23:59:59.999Z"}), True),
    (line({**GOOD, "cached_tokens": 762}), True),
    (line({**GOOD, "error": "x" * 5_000_000}), True),  # capped, not refused
    (line({**GOOD, "request_id": "r" * 512}), True),
    (line({**GOOD, "status": 65535, "prompt_tokens": 2**32 - 1}), True),
    (line({**GOOD, "queue_wait_ms": None, "tool_latency_ms": 0}), True),
    (line({**GOOD, "ttft_ms": 0, "e2e_ms": 999999999999999.9}), True),
    (line({**GOOD, "error": "caf\u00e9 \U0001f600"}), True),
    (line({**GOOD, "prompt_block_hashes": [], "prompt_block_size": 0}), True),
    (line({**GOOD, "prompt_block_hashes": []}), True),
    (line({**GOOD, "prompt_block_size": 16}), True),                         # a prompt shorter than one block
    (line({**GOOD, "prompt_block_hashes": [H1] * 65_536, "prompt_block_size": 1}), True),
    # refused
    (b"", False),
    (b"{not json", False),
    (b"[1, 2]", False),
    (b"null", False),
    (BOM + BOM + line(GOOD), False),
    (line(GOOD)[:-1] + b', "model": "a\xffb"}', False),                    # invalid UTF-8 in a string
    (line(GOOD)[:-1] + b', "model": "\xed\xa0\x80"}', False),              # UTF-8-encoded surrogate
    (line(GOOD)[:-1] + b', "model": "\\ud800"}', False),                   # lone surrogate escape
    (line(GOOD)[:-1] + b', "ttft_ms": NaN}', False),
    (line({**GOOD, "log_version": 2}), False),
    (line({**GOOD, "log_version": "1"}), False),
    (line({**GOOD, "log_version": 1.0}), False),
    (line({**GOOD, "log_version": True}), False),
    *[(line(without(f)), False) for f in GOOD],
    (line({**GOOD, "request_id": ""}), False),
    (line({**GOOD, "request_id": "r" * 513}), False),
    (line({**GOOD, "tenant_id": None}), False),
    (line({**GOOD, "tenant_id": "t" * 513}), False),
    (line({**GOOD, "model": None}), False),
    (line({**GOOD, "system_hash": {"x": 1}}), False),
    (line({**GOOD, "system_hash": "abc"}), False),
    (line({**GOOD, "system_hash": H1.upper()}), False),
    (line({**GOOD, "prompt_fingerprint": H1 + "\n"}), False),
    (line({**GOOD, "suffix_hash": "\n"}), False),
    (line({**GOOD, "ts": "2026-11-29T12:00:00"}), False),                  # no time zone
    (line({**GOOD, "ts": "2026-11-29 12:00:00Z"}), False),
    (line({**GOOD, "ts": "2026-11-29T12:00:00+0100"}), False),
    (line({**GOOD, "ts": "2026-11-29T12:00:00.1234567891Z"}), False),
    (line({**GOOD, "ts": "2026-11-29T12:00:00Z\n"}), False),
    (line({**GOOD, "ts": "2026-02-30T12:00:00Z"}), False),                 # prose: not a real date
    (line({**GOOD, "ts": "2099-12-31T23:00:00-05:00"}), False),            # prose: 2100 in UTC
    (line({**GOOD, "ts": "1999-12-31T23:59:59Z"}), False),
    (line({**GOOD, "ts": 1795950818}), False),
    (line({**GOOD, "cached_tokens": 763}), False),                         # prose: cached > prompt
    (line({**GOOD, "status": 70000}), False),
    (line({**GOOD, "status": 200.0}), False),
    (line({**GOOD, "prompt_tokens": -1}), False),
    (line({**GOOD, "prompt_tokens": 2**32, "cached_tokens": 0}), False),
    (line({**GOOD, "ttft_ms": -0.5}), False),
    (line({**GOOD, "ttft_ms": 1e15}), False),
    (line({**GOOD, "ttft_ms": 10**400}), False),
    (line({**GOOD, "e2e_ms": None}), False),
    (line({**GOOD, "stream": "false"}), False),
    (line({**GOOD, "stream": None}), False),
    (line({**GOOD, "pod": {"name": "x"}}), False),
    (line({**GOOD, "error": None}), False),
    (line({**GOOD, "prompt_block_hashes": [H1]}), False),                    # a chain needs its block size
    (line({**GOOD, "prompt_block_hashes": [H1], "prompt_block_size": 0}), False),
    (line({**GOOD, "prompt_block_hashes": [H1] * 65_537, "prompt_block_size": 1}), False),
    (line({**GOOD, "prompt_block_hashes": [H1, ""], "prompt_block_size": 16}), False),
    (line({**GOOD, "prompt_block_hashes": [H1.upper()], "prompt_block_size": 16}), False),
    (line({**GOOD, "prompt_block_hashes": [H1 + "," + H2], "prompt_block_size": 16}), False),
    (line({**GOOD, "prompt_block_hashes": [H1 + "\n"], "prompt_block_size": 16}), False),
    (line({**GOOD, "prompt_block_hashes": [int(H1, 16)], "prompt_block_size": 16}), False),
    (line({**GOOD, "prompt_block_hashes": H1, "prompt_block_size": 16}), False),
    (line({**GOOD, "prompt_block_hashes": None}), False),
    (line({**GOOD, "prompt_block_size": -1}), False),
    (line({**GOOD, "prompt_block_size": 2**32}), False),
    (line({**GOOD, "prompt_block_size": 16.0}), False),
]


@pytest.mark.parametrize(("raw", "accepted"), CORPUS, ids=range(len(CORPUS)))
def test_record_and_schema_agree_on_the_corpus(raw: bytes, accepted: bool) -> None:
    assert record_accepts(raw) is accepted
    assert schema_accepts(raw) is accepted


# --- generated lines ------------------------------------------------------------------------------------------

_NUMBERS = st.one_of(st.integers(-3, 3), st.sampled_from([2**16 - 1, 2**16, 2**32 - 1, 2**32, 10**15, 10**20]),
                     st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0, -0.0, 1e15, 999.5]))
_TEXTS = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", H1, H1.upper(), H1[:15], H1 + "\n", "r" * 512, "r" * 513, "\n",
                     "2026-11-29T12:00:00Z", "2026-11-29T12:00:00", "2026-02-29T00:00:00Z", "2028-02-29T00:00:00Z",
                     "2099-12-31T23:30:00-01:00", "2000-01-01T00:30:00+01:00", "2026-11-29T12:00:00.5+14:00"]),
    st.from_regex(TS_PATTERN, fullmatch=True),
)
_ANY = st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXTS, st.just([]), st.just({"x": 1}))
_VALID: dict[str, st.SearchStrategy[Any]] = {
    "log_version": st.just(1), "ts": st.from_regex(TS_PATTERN, fullmatch=True), "status": st.integers(0, 599),
    "prompt_tokens": st.integers(0, 5000), "cached_tokens": st.integers(0, 5000),
    "ttft_ms": st.floats(0, 1e6), "e2e_ms": st.floats(0, 1e6), "stream": st.booleans(),
    "queue_wait_ms": st.one_of(st.none(), st.floats(0, 1e6)), "tool_latency_ms": st.none(),
    **{k: st.sampled_from(["", H1, H2]) for k in FULL if k.endswith("_hash") or k == "prompt_fingerprint"},
    **{k: st.integers(0, 5000) for k in FULL if k.endswith("_tokens") and k not in ("prompt_tokens", "cached_tokens")},
    "prompt_block_hashes": st.lists(st.sampled_from([H1, H2, H1.upper(), "", H1 + "," + H2]), max_size=3),
    "prompt_block_size": st.sampled_from([0, 1, 32]),
    "pods_down": st.lists(st.sampled_from(["pod-1", "", "r" * 512, "r" * 513, 7]), max_size=3),
    **{k: st.lists(st.sampled_from([H1, H2, H1.upper(), ""]), max_size=3) for k in ("system_line_hashes",
                                                                                    "suffix_chunk_hashes")},
    **{k: st.lists(st.sampled_from([0, 7, 2**32 - 1, 2**32, -1]), max_size=3) for k in ("system_line_tokens",
                                                                                        "suffix_chunk_tokens")},
}


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    """A log object whose fields are each valid, absent or anything (mostly valid), plus unknown fields."""
    out: dict[str, Any] = {}
    for field, value in FULL.items():
        choice = draw(st.integers(0, 19))
        if choice < 16:
            out[field] = draw(_VALID.get(field, st.just(value)))
        elif choice < 18:
            out[field] = draw(_ANY)
        # else: absent
    out.update(draw(st.dictionaries(st.text(max_size=5), _ANY, max_size=2)))
    return out


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(records(), st.booleans())
def test_record_and_schema_agree_on_generated_lines(obj: dict[str, Any], ascii_only: bool) -> None:
    raw = json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert record_accepts(raw) == schema_accepts(raw), raw[:500]


@settings(max_examples=1000, deadline=None, database=None)
@given(st.data())
def test_record_and_schema_agree_on_mutated_bytes(data: st.DataObject) -> None:
    raw = bytearray(line(FULL))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        kind = data.draw(st.sampled_from(["insert", "replace", "delete"]))
        byte = data.draw(st.integers(0, 255))
        if kind == "insert":
            raw.insert(at, byte)
        elif at < len(raw):
            if kind == "replace":
                raw[at] = byte
            else:
                del raw[at]
    assert record_accepts(bytes(raw)) == schema_accepts(bytes(raw)), bytes(raw)


# --- never raises: any bytes, any JSON value → an event or a dead letter with a reason ------------------------

_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)


def _assert_event_or_reason(raw: bytes | str) -> None:
    try:
        decode_record(raw)
    except BadRecord as exc:
        assert str(exc)
    ev = line_event(raw, pod="gw", source_file="g.jsonl", offset=0)
    if ev.schema == "dead_letter":
        assert ev.payload.reason
    else:
        assert ev.schema == "gateway_request"
        assert rows_for(ev)[0][0] == "gateway_requests"  # what the record accepts maps to a row


@settings(max_examples=1500, deadline=None, database=None)
@given(st.binary(max_size=400))
@example(BOM)
@example(b"[" * 100_000)
@example(b'"\\ud800"')
def test_arbitrary_bytes_give_an_event_or_a_dead_letter_with_a_reason(raw: bytes) -> None:
    _assert_event_or_reason(raw)


@settings(max_examples=1000, deadline=None, database=None)
@given(_JSON, st.booleans())
def test_arbitrary_json_values_give_an_event_or_a_dead_letter_with_a_reason(value: Any, as_str: bool) -> None:
    text = json.dumps(value)
    _assert_event_or_reason(text if as_str else text.encode())


@settings(max_examples=500, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(sorted(FULL)), _JSON, max_size=12))
def test_arbitrary_field_values_over_a_good_line_never_raise(overrides: dict[str, Any]) -> None:
    _assert_event_or_reason(line({**GOOD, **overrides}))


# --- each hygiene rule, on the live path, `kvscope import` and the bulk path -----------------------------------


def test_bom_first_line_is_accepted_and_invalid_utf8_is_refused_at_its_byte(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "g.jsonl"
    first = BOM + line({**GOOD, "request_id": "bom"})
    bad = line(GOOD)[:-1] + b', "model": "ab\xffcd"}'
    log.write_bytes(first + b"\n" + bad + b"\n")
    events = read_file(log)
    assert [e.schema for e in events] == ["gateway_request", "dead_letter"]
    # the bad byte: after the good object's text minus its "}", then `, "model": "ab`
    at = len(line(GOOD)) - 1 + len(b', "model": "ab')
    assert events[1].payload.reason == f"not UTF-8 at byte {at}"
    assert events[1].payload.location == f"{log}:{len(first) + 1}"
    assert import_events(store, events) == {"gateway_requests": 1, "dead_letters": 1}
    assert store.query_rows("SELECT request_id, model FROM gateway_requests") == [("bom", "")]
    # no U+FFFD stored anywhere but in the dead letter's copy of the raw line
    assert store.query_rows("SELECT count() FROM gateway_requests WHERE position(model, '\uFFFD') > 0")[0][0] == 0


@pytest.mark.parametrize(("change", "reason"), [
    ({"log_version": 2}, "log_version must be the integer 1, this reader's version (Invalid enum value 2)"),
    ({"log_version": "1"}, "log_version must be the integer 1, this reader's version (Expected `int`, got `str`)"),
    ({"log_version": None}, "missing log_version (this reader knows version 1)"),
    ({"tenant_id": None}, "missing field tenant_id"),
    ({"system_hash": {"x": 1}}, "field system_hash: Expected `str`, got `object`"),
    ({"tools_hash": "12345"}, "field tools_hash: not a hash (16 lowercase hex characters, or '' when the segment "
                              "is absent)"),
    ({"ts": "2026-11-29T12:00:00"}, "field ts: not an RFC 3339 timestamp with a time zone in 2000..2099"),
    ({"prompt_block_hashes": [H1, H2[:15]], "prompt_block_size": 16},
     "field prompt_block_hashes: item 1 is not a hash (16 lowercase hex characters)"),
    ({"prompt_block_hashes": [H1]}, "field prompt_block_hashes: a chain without prompt_block_size (≥ 1)"),
    ({"prompt_block_hashes": [H1] * 65_537, "prompt_block_size": 16},
     "field prompt_block_hashes: Expected `array` of length <= 65536"),
    ({"prompt_block_hashes": [7], "prompt_block_size": 16},
     "field prompt_block_hashes: Expected `str`, got `int`"),
    ({"system_line_hashes": [H1, "abc"], "system_line_tokens": [1, 2]},
     "field system_line_hashes: an entry is not a hash (16 lowercase hex characters)"),
    ({"suffix_chunk_hashes": [H1, H2], "suffix_chunk_tokens": [3]},
     "field suffix_chunk_tokens: 1 entries, suffix_chunk_hashes has 2"),
    ({"suffix_chunk_hashes": [H1] * 65, "suffix_chunk_tokens": [1] * 65},
     "field suffix_chunk_hashes: Expected `array` of length <= 64"),
])
def test_each_refusal_has_its_reason(change: dict[str, Any], reason: str) -> None:
    obj = {**GOOD, **change}
    obj = {k: v for k, v in obj.items() if v is not None}  # None here: the field is absent
    ev = line_event(line(obj), pod="gw", source_file="g.jsonl", offset=0)
    assert ev.schema == "dead_letter" and ev.payload.reason == reason


def test_a_5mb_error_is_stored_capped_with_a_marker_on_every_path(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "g.jsonl"
    reason = "r" * 300
    log.write_text(json.dumps({**GOOD, "error": "e" * 5_000_000, "routing_reason": reason}) + "\n")
    # the marker "…[truncated N chars]" is 19 characters + N's digits, and the value with it fills the cap:
    # error: 1,024 - 26 = 998 kept, 5,000,000 - 998 = 4,999,002 cut; routing_reason: 256 - 21 = 235 kept, 65 cut
    want = ("e" * 998 + "…[truncated 4999002 chars]", "r" * 235 + "…[truncated 65 chars]")
    assert import_events(store, read_file(log)) == {"gateway_requests": 1}
    assert store.query_rows("SELECT error, routing_reason FROM gateway_requests") == [want]
    store.command("TRUNCATE TABLE gateway_requests")
    stats = load_gateway_log(store, log)
    assert (stats.rows, stats.dead_letters) == (1, 0)
    assert store.query_rows("SELECT error, routing_reason FROM gateway_requests") == [want]


def test_live_and_bulk_paths_store_the_same_row(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Canonical ts (an offset and 9 fraction digits → UTC ms, truncated), absent fields as their "none"."""
    log = tmp_path / "g.jsonl"
    log.write_text(json.dumps({**GOOD, "ts": f"{DAY}T13:30:00.123999999+01:30"}) + "\n")
    cols = "request_id, toString(ts), tenant_id, conversation_id, stream, completion_tokens, system_hash, queue_wait_ms"
    import_events(store, read_file(log))
    live = store.query_rows(f"SELECT {cols} FROM gateway_requests")
    store.command("TRUNCATE TABLE gateway_requests")
    load_gateway_log(store, log)
    bulk = store.query_rows(f"SELECT {cols} FROM gateway_requests")
    assert live == bulk == [("r-1", f"{DAY} 12:00:00.123", "acme", "", False, 0, "", None)]


def test_prompt_block_chain_is_stored_as_uint64_on_every_path(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The log's hex chain lands in gateway_requests.prompt_block_hashes as the same 64-bit values (hex read
    big-endian: 0x0123456789abcdef = 81985529216486895, 0xfedcba9876543210 = 18364758544493064720); a line
    without the fields (an older gateway) stores [] and 0."""
    log = tmp_path / "g.jsonl"
    log.write_text(json.dumps({**GOOD, "prompt_block_hashes": [H1, H2], "prompt_block_size": 32}) + "\n"
                   + json.dumps({**GOOD, "request_id": "old"}) + "\n")
    want = [("old", [], 0), ("r-1", [81985529216486895, 18364758544493064720], 32)]
    sql = "SELECT request_id, prompt_block_hashes, prompt_block_size FROM gateway_requests ORDER BY request_id"
    assert import_events(store, read_file(log)) == {"gateway_requests": 2}
    assert store.query_rows(sql) == want
    store.command("TRUNCATE TABLE gateway_requests")
    stats = load_gateway_log(store, log)
    assert (stats.rows, stats.dead_letters) == (2, 0)
    assert store.query_rows(sql) == want


def test_an_envelope_that_breaks_the_record_is_a_dead_letter_not_coerced(store) -> None:  # type: ignore[no-untyped-def]
    """Another producer's envelope without tenant_id: refused with the record's reason, not stored as ''."""
    bad = envelope(GatewayRequest(record=without("tenant_id")), pod="p", natural_key=("x",), observed_at_ms=1)
    good = envelope(GatewayRequest(record={**GOOD, "request_id": "ok"}), pod="p", natural_key=("ok",),
                    observed_at_ms=1)
    assert import_events(store, [bad, good]) == {"gateway_requests": 1, "dead_letters": 1}
    [(reason,)] = store.query_rows("SELECT reason FROM dead_letters")
    assert "missing field tenant_id" in reason
    assert store.query_rows("SELECT request_id, tenant_id FROM gateway_requests") == [("ok", "acme")]


def test_a_reimport_under_another_spelling_of_the_path_adds_no_dead_letter(store, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "g.jsonl"
    log.write_text(json.dumps(GOOD) + "\n{not json\n")
    assert load_gateway_log(store, log).dead_letters == 1
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    again = load_gateway_log(store, "../g.jsonl")
    assert (again.rows, again.duplicates, again.dead_letters) == (0, 1, 0)
    assert store.query_rows("SELECT location FROM dead_letters") == [(f"{log.resolve()}:{len(json.dumps(GOOD)) + 1}",)]


def test_a_line_too_long_for_the_live_path_is_refused_on_import_too(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The live tail dead-letters a line of MAX_LINE_BYTES or more by its head; import does the same."""
    from collector.gateway_log import MAX_LINE_BYTES

    fits = json.dumps({**GOOD, "request_id": "fits", "pad": ""})
    fits = fits.replace('"pad": ""', '"pad": "' + "x" * (MAX_LINE_BYTES - 1 - len(fits)) + '"')
    long = fits.replace('"fits"', '"long"').replace('"pad": "', '"pad": "x')
    assert (len(fits), len(long)) == (MAX_LINE_BYTES - 1, MAX_LINE_BYTES)
    log = tmp_path / "g.jsonl"
    log.write_text(fits + "\n" + long + "\n")
    stats = load_gateway_log(store, log)
    assert (stats.rows, stats.dead_letters) == (1, 1)
    [(reason, raw_len)] = store.query_rows("SELECT reason, length(raw) FROM dead_letters")
    assert reason == f"line longer than {MAX_LINE_BYTES} bytes" and raw_len <= 64 * 1024
    assert store.query_rows("SELECT request_id FROM gateway_requests") == [("fits",)]


def test_a_gzip_log_is_refused_whole_with_the_reason(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import gzip

    from click.testing import CliRunner

    from kvscope.cli import main

    log = tmp_path / "g.jsonl.gz"
    log.write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode()))
    result = CliRunner().invoke(main, ["import", "gateway-log", str(log), "--data-dir",
                                       store.dsn.removeprefix("chdb://"), "--database", store.database])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "gzip-compressed bytes, not a gateway log: decompress it first (gunzip)" in result.stderr
    assert store.query_rows("SELECT count() FROM dead_letters")[0][0] == 0


def test_docs_field_table_lists_every_field_of_the_contract() -> None:
    """docs/gateway-log.md's Fields table (what a gateway author reads) names every field of the schema and of
    GatewayRecord, and the docs' example lines are accepted: usage_convention and the cache read/creation counts
    were missing from it."""
    from collector.gateway_record import GatewayRecord

    doc = (Path(__file__).parents[1] / "docs" / "gateway-log.md").read_text()
    table = doc[doc.index("## Fields"):doc.index("Other rules:")]
    fields = set(json.loads(SCHEMA_PATH.read_text())["properties"]) | set(GatewayRecord.__struct_fields__)
    segment_counts = {f"{seg}_tokens" for seg in ("system", "tools", "retrieval", "history", "suffix")}
    assert "`*_tokens` of the segments" in table  # how the table names segment_counts
    assert {f for f in fields - segment_counts if f"`{f}`" not in table} == set()
    example = doc[doc.index("```json") + len("```json"):doc.index("```", doc.index("```json") + 7)]
    lines = [ln for ln in example.strip().splitlines() if ln]
    assert len(lines) == 2
    for ln in lines:
        decode_record(ln.encode())  # raises BadRecord if the documented example broke the contract
