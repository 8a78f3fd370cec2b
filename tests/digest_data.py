"""Two periods of data for the digest tests, written straight into the store (as tests/fixture_data.py does).

The current period is 12:00–12:03 of the fixture's day (tests/clock.py): the shared fixture (tests/fixture_data.py)
plus two tenants; the previous period, 11:57–12:00, is the fixture three minutes earlier, healthier in two places:

- ``cap-4-timestamp-first`` hit (cached 768; its answer is ``unavoidable`` 16): globex's volatile system prompt
  is new in the current period;
- ``acme-c1-t3`` hit on pod-b, where its predecessor ran (cached 768, ``unavoidable`` 32): pod-b's cache affinity
  was (400 + 800 + 832) / (400 + 800 + 832 + 19) = 99.1 % and falls in the current period.

vLLM's hit counters of the previous copy count those two hits (768 more on pod-a, 768 more on pod-b).

Tenants only in the fixture's current period:

- ``umbrella`` (pod-a): four turns of one conversation, each with another raw system prompt and one normalized
  one (a timestamp first): u-1 cold, u-2..u-4 prefix_drift / volatile_system. In the previous period it sent
  four turns with one system prompt: its system-prompt cardinality jumps from 1 to 4 (per request 0.25 → 1).
- ``hooli`` (pod-b): three turns, the second and third 90 s and 60 s after the one before, both
  ``evicted / evicted_before_next_turn`` (480 tokens each).

No vLLM counters cover umbrella and hooli: in the current period the gateway logged more than vLLM counted.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from tests import fixture_data as fx

SHIFT = timedelta(minutes=3)
PREFIX = "prev-"
#: The windows: previous [PREVIOUS, SINCE), current [SINCE, UNTIL).
SINCE, UNTIL = fx.at(0), fx.at(180)
PREVIOUS = SINCE - SHIFT
HEALED = {"cap-4-timestamp-first": (768, [("unavoidable", "", 16)], "pod-a"),
          "acme-c1-t3": (768, [("unavoidable", "", 32)], "pod-b")}

#: (request_id, seconds after 12:00, tenant, pod, prompt, cached, system label, causes, predecessor, gap_ms)
EXTRA: list[tuple[Any, ...]] = [
    ("u-1", 5, "umbrella", "pod-a", 640, 0, "sys-u-1", [("cold", "", 608), ("unavoidable", "", 32)], "", None),
    ("u-2", 45, "umbrella", "pod-a", 640, 0, "sys-u-2",
     [("prefix_drift", "volatile_system", 608), ("unavoidable", "", 32)], "u-1", 40000.0),
    ("u-3", 95, "umbrella", "pod-a", 640, 0, "sys-u-3",
     [("prefix_drift", "volatile_system", 608), ("unavoidable", "", 32)], "u-2", 50000.0),
    ("u-4", 165, "umbrella", "pod-a", 640, 0, "sys-u-4",
     [("prefix_drift", "volatile_system", 608), ("unavoidable", "", 32)], "u-3", 70000.0),
    ("h-1", 10, "hooli", "pod-b", 500, 0, "sys-h", [("cold", "", 480), ("unavoidable", "", 20)], "", None),
    ("h-2", 100, "hooli", "pod-b", 500, 0, "sys-h",
     [("evicted", "evicted_before_next_turn", 480), ("unavoidable", "", 20)], "h-1", 90000.0),
    ("h-3", 160, "hooli", "pod-b", 500, 0, "sys-h",
     [("evicted", "evicted_before_next_turn", 480), ("unavoidable", "", 20)], "h-2", 60000.0),
]
#: umbrella in the previous period: four turns, one system prompt, all but the first hit.
EXTRA_PREVIOUS: list[tuple[Any, ...]] = [
    (f"prev-u-{i}", -175 + 40 * i, "umbrella", "pod-a", 640, 0 if i == 1 else 608, "sys-u",
     [("cold", "", 608), ("unavoidable", "", 32)] if i == 1 else [("unavoidable", "", 32)],
     "" if i == 1 else f"prev-u-{i - 1}", None if i == 1 else 40000.0)
    for i in range(1, 5)
]


def _gateway_row(rid: str, t: float, tenant: str, pod: str, prompt: int, cached: int, system: str) -> tuple:
    values = {
        "request_id": rid, "ts": fx.at(t), "tenant_id": tenant, "conversation_id": f"conv-{tenant}",
        "agent_run_id": "", "model": "tiny", "pod": pod, "endpoint": "chat.completions",
        "routing_policy": "round_robin", "routing_reason": "round_robin", "stream": False, "status": 200,
        "error": "", "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 8, "ttft_ms": 20.0,
        "e2e_ms": 60.0, "queue_wait_ms": None, "tool_latency_ms": None, "system_hash": fx.h(system),
        "system_norm_hash": fx.h(f"{tenant}-norm"), "system_tokens": prompt - 32, "tools_hash": "",
        "tools_canonical_hash": "", "tools_tokens": 0, "retrieval_pack_hash": "", "retrieval_set_hash": "",
        "retrieval_tokens": 0, "history_prefix_hash": fx.h(f"hist-{rid}"), "prev_history_hash": "",
        "history_tokens": 0, "suffix_hash": fx.h(f"suffix-{rid}"), "suffix_tokens": 32,
        "prompt_fingerprint": fx.h(f"fp-{rid}"), "token_count_method": "tokenizer", "system_line_hashes": [],
        "system_line_tokens": [], "suffix_chunk_hashes": [], "suffix_chunk_tokens": [],
    }
    return tuple(values[c] for c in fx.GATEWAY_COLUMNS)


def _answer(rid: str, t: float, tenant: str, pod: str, prompt: int, cached: int, items: list[tuple],
            pred: str, gap: float | None) -> tuple:
    return (rid, fx.at(t), tenant, pod, "tiny", prompt, cached, pred, pod if pred else "",
            "previous_turn" if pred else "", gap, fx.BLOCK_SIZE, [i[0] for i in items], [i[1] for i in items],
            [i[2] for i in items], fx.at(300), 1, 1)


def _extra(rows: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    gateway = [_gateway_row(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows]
    answers = [_answer(r[0], r[1], r[2], r[3], r[4], r[5], r[7], r[8], r[9]) for r in rows]
    return gateway, answers


def _previous_gateway() -> list[tuple]:
    ts, rid, cached = (fx.GATEWAY_COLUMNS.index(c) for c in ("ts", "request_id", "cached_tokens"))
    out = []
    for row in fx.gateway_rows()[: len(fx.REQUESTS)]:  # without the re-delivered duplicate
        r = list(row)
        if r[rid] in HEALED:
            r[cached] = HEALED[r[rid]][0]
        r[rid], r[ts] = PREFIX + r[rid], r[ts] - SHIFT
        out.append(tuple(r))
    return out


def _previous_answers() -> list[tuple]:
    out = []
    for row in fx.attribution_rows():
        r = list(row)
        if r[0] in HEALED:
            cached, items, pred_pod = HEALED[r[0]]
            r[6], r[8] = cached, pred_pod
            r[12], r[13], r[14] = [i[0] for i in items], [i[1] for i in items], [i[2] for i in items]
        r[0], r[1] = PREFIX + r[0], r[1] - SHIFT
        r[7] = PREFIX + r[7] if r[7] else ""
        out.append(tuple(r))
    return out


def _previous_metrics() -> list[tuple]:
    rows = [(r[0] - SHIFT, *r[1:]) for r in fx.metric_rows()]
    for pod in ("pod-a", "pod-b"):  # the two healed hits, counted at the scrape after them (12:01:30 and 12:02:30)
        t = fx.at(90 if pod == "pod-a" else 150) - SHIFT
        rows.append((t, pod, "0", "tiny", "vllm:prefix_cache_hits_total", "", 0.0, 768.0))
    return rows


def load_two_periods(store: Any) -> None:
    """The shared fixture, its healthier copy three minutes earlier, and the umbrella / hooli extras."""
    fx.load_fixture(store)
    gateway, answers = _extra(EXTRA)
    previous_gateway, previous_answers = _extra(EXTRA_PREVIOUS)
    store.insert("gateway_requests", gateway + previous_gateway + _previous_gateway(), fx.GATEWAY_COLUMNS)
    store.insert("request_attribution", answers + previous_answers + _previous_answers(), fx.ATTRIBUTION_COLUMNS)
    store.insert("vllm_metrics", _previous_metrics(), fx.METRIC_COLUMNS)
