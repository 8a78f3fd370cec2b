"""A hand-built agent-TTL scenario (gateway_requests, request_attribution, vllm_metrics, vllm_cache_config rows
written straight into the store) for the ttl_* named queries and the Agent TTL page. Model ``tiny``, block size 32.

    run-1  agentco agent run, pod-a   r1-t0 640 tokens, then next turns after waits of
           0.5 s (r1-t1, 700, survived), 3 s (r1-t2, 760, survived), 2 min (r1-t3, 800: 736 evicted)
    run-2  agentco agent run, pod-b   r2-t0 960, then 10 s (r2-t1, 1000: 960 evicted),
           12 s (r2-t2, 1040: not_reported, whether it survived is unknown)
    conv-1 chatco conversation, pod-a c1-t0 320, then 20 s (c1-t1, 400, survived; an older answer said evicted,
           cancelled), 20 s (c1-t2, 480, served by pod-b: routed_away)

Prefill: pod-a Δ0.5 s over Δ10,000 prompt tokens, no hits: 5e-5 s/token; pod-b Δ0.2 s over Δ4,000 prompt
tokens of which Δ2,000 hit: 1e-4 s/token. Bytes per token: pod-a's vllm:cache_config_info says
1,073,741,824 / 1,048,576 = 1,024; pod-b's has no kv_cache_memory_bytes (bytes per token from the setting).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from tests.clock import T0  # 12:00 UTC two days ago: inside the tables' retention whenever the suite runs

BLOCK = 32
POD_A_SECONDS_PER_TOKEN = 0.5 / 10_000
POD_B_SECONDS_PER_TOKEN = 0.2 / 2_000

# (request_id, seconds after T0, tenant, conversation, agent_run, pod, prompt, cached,
#  predecessor, predecessor_pod, gap_ms, [(cause, sub_cause, tokens)])
TURNS: list[tuple[Any, ...]] = [
    ("r1-t0", 0, "agentco", "", "run-1", "pod-a", 640, 0, "", "", None, [("cold", "", 608), ("unavoidable", "", 32)]),
    ("c1-t0", 5, "chatco", "conv-1", "", "pod-a", 320, 0, "", "", None, [("cold", "", 288), ("unavoidable", "", 32)]),
    ("r1-t1", 10, "agentco", "", "run-1", "pod-a", 700, 608, "r1-t0", "pod-a", 500.0, [("unavoidable", "", 92)]),
    ("r1-t2", 20, "agentco", "", "run-1", "pod-a", 760, 672, "r1-t1", "pod-a", 3000.0, [("unavoidable", "", 88)]),
    ("r2-t0", 30, "agentco", "", "run-2", "pod-b", 960, 0, "", "", None, [("cold", "", 928), ("unavoidable", "", 32)]),
    ("c1-t1", 40, "chatco", "conv-1", "", "pod-a", 400, 320, "c1-t0", "pod-a", 20000.0, [("unavoidable", "", 80)]),
    ("r2-t1", 45, "agentco", "", "run-2", "pod-b", 1000, 0, "r2-t0", "pod-b", 10000.0,
     [("evicted", "evicted_before_next_turn", 960), ("unavoidable", "", 40)]),
    ("r2-t2", 60, "agentco", "", "run-2", "pod-b", 1040, 0, "r2-t1", "pod-b", 12000.0,
     [("not_reported", "", 1040)]),
    ("c1-t2", 70, "chatco", "conv-1", "", "pod-b", 480, 0, "c1-t1", "pod-a", 20000.0,
     [("routed_away", "", 384), ("unavoidable", "", 96)]),
    ("r1-t3", 200, "agentco", "", "run-1", "pod-a", 800, 0, "r1-t2", "pod-a", 120000.0,
     [("evicted", "evicted_before_next_turn", 736), ("unavoidable", "", 64)]),
]
#: c1-t1's first answer (version 1), replaced: written, then cancelled with sign -1 before the current version 2.
STALE = ("c1-t1", [("evicted", "evicted_before_next_turn", 320), ("unavoidable", "", 80)])

GATEWAY_COLUMNS = ["request_id", "ts", "tenant_id", "conversation_id", "agent_run_id", "model", "pod", "status",
                   "prompt_tokens", "cached_tokens", "e2e_ms"]
ATTRIBUTION_COLUMNS = ["request_id", "ts", "tenant_id", "pod", "model", "prompt_tokens", "cached_tokens",
                       "predecessor_request_id", "predecessor_pod", "predecessor_kind", "gap_ms", "block_size",
                       "causes", "sub_causes", "missed_tokens", "attributed_at", "sign", "version"]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _answer(turn: tuple[Any, ...], items: list[tuple[str, str, int]], sign: int, version: int) -> tuple[Any, ...]:
    rid, t, tenant, _, _, pod, prompt, cached, pred, pred_pod, gap, _ = turn
    return (rid, at(t), tenant, pod, "tiny", prompt, cached, pred, pred_pod, "previous_turn" if pred else "", gap,
            BLOCK, [i[0] for i in items], [i[1] for i in items], [i[2] for i in items], at(300), sign, version)


def load(store: Any) -> None:
    """Insert the scenario into ``store`` (a migrated :class:`ingest.store.Store`)."""
    store.insert("gateway_requests", [(r[0], at(r[1]), r[2], r[3], r[4], "tiny", r[5], 200, r[6], r[7], 0.0)
                                      for r in TURNS], GATEWAY_COLUMNS)
    rows = []
    for turn in TURNS:
        if turn[0] == STALE[0]:
            rows += [_answer(turn, STALE[1], 1, 1), _answer(turn, STALE[1], -1, 1), _answer(turn, turn[11], 1, 2)]
        else:
            rows.append(_answer(turn, turn[11], 1, 1))
    store.insert("request_attribution", rows, ATTRIBUTION_COLUMNS)
    metrics = [("pod-a", "vllm:request_prefill_time_seconds_sum", 0.5), ("pod-a", "vllm:prompt_tokens_total", 10_000),
               ("pod-b", "vllm:request_prefill_time_seconds_sum", 0.2), ("pod-b", "vllm:prompt_tokens_total", 4_000),
               ("pod-b", "vllm:prefix_cache_hits_total", 2_000)]
    store.insert("vllm_metrics", [(at(90), pod, "0", "tiny", name, "", float(v), float(v)) for pod, name, v in metrics],
                 ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"])
    full = {"block_size": str(BLOCK), "kv_cache_memory_bytes": "1073741824", "kv_cache_size_tokens": "1048576",
            "num_gpu_blocks": "32768"}
    store.insert("vllm_cache_config", [(at(0), "pod-a", "0", full), (at(0), "pod-b", "0", {"block_size": str(BLOCK)})],
                 ["ts", "pod", "engine", "labels"])
