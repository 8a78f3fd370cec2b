"""Synthetic gateway history (no vLLM needed): realistic fingerprint-log records in arrival order, for the kill
tests and ``make bench``. The demo's real traffic comes from :mod:`demo.workload` through real vLLM pods;
this module only imitates what such a fleet logs, at any volume.

Shape: ``tenants`` tenants, each with a long system prompt (one fingerprint per tenant), chat conversations of
2–6 turns whose history grows turn by turn (``prev_history_hash`` chains them), spread over ``pods`` pods by a
router that keeps a conversation on its pod 80 % of the time; a quarter of the tenants drift (a timestamp at
the top of the system prompt: raw system hash changes per request, the normalized one stays). Cached tokens
follow from that: a turn that stays on the pod of its previous turn and did not drift hits the previous
prompt's full blocks; otherwise it misses. 2 % of requests fail (status 503, no tokens).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

BLOCK = 32


def _h(*parts: object) -> str:
    """64-bit hex hash like the gateway's (SHA-256 of the parts joined by U+001F, first 16 hex chars)."""
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()[:16]


def format_ts(t: datetime) -> str:
    """RFC 3339 UTC with milliseconds and a Z, the log's ``ts`` format."""
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def gateway_records(n: int, *, seed: int = 0, tenants: int = 20, pods: int = 3,
                    start: datetime | None = None, rate_per_second: float = 500.0,
                    id_prefix: str = "req") -> Iterator[dict[str, Any]]:
    """``n`` gateway log records (dicts with every field of the v1 schema), in arrival order.

    ``rate_per_second``: mean arrival rate (exponential gaps), so ``n`` records span ``n / rate`` seconds
    after ``start`` (default 2026-11-29 12:00 UTC). Request ids are ``f"{id_prefix}-{i:09d}"``, i = 0..n-1.
    Deterministic for a given seed.
    """
    rnd = random.Random(seed)
    t = start or datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    drifting = {f"tenant-{k:03d}" for k in range(0, tenants, 4)}
    system_tokens = {f"tenant-{k:03d}": rnd.randint(300, 2000) for k in range(tenants)}
    open_convs: list[dict[str, Any]] = []
    conv_seq = 0
    for i in range(n):
        t += timedelta(seconds=rnd.expovariate(rate_per_second))
        if not open_convs or rnd.random() < 0.3:
            tenant = f"tenant-{rnd.randrange(tenants):03d}"
            conv_seq += 1
            open_convs.append({"tenant": tenant, "id": f"conv-{seed}-{conv_seq}", "turn": 0, "history": 0,
                               "hist_hash": "", "pod": f"pod-{rnd.randrange(pods)}", "turns": rnd.randint(2, 6),
                               "prev_prompt": 0})
        conv = open_convs[rnd.randrange(len(open_convs))]
        yield _record(rnd, conv, i, t, pods, system_tokens[conv["tenant"]], conv["tenant"] in drifting, id_prefix)
        if conv["turn"] >= conv["turns"]:
            open_convs.remove(conv)
        if len(open_convs) > 5000:
            open_convs.pop(0)


def _record(rnd: random.Random, conv: dict[str, Any], i: int, t: datetime, pods: int, sys_tokens: int,
            drifting: bool, id_prefix: str) -> dict[str, Any]:
    tenant = conv["tenant"]
    moved = conv["turn"] > 0 and rnd.random() < 0.2
    pod = f"pod-{rnd.randrange(pods)}" if moved else conv["pod"]
    suffix = rnd.randint(10, 200)
    prompt = sys_tokens + conv["history"] + suffix + 8
    failed = rnd.random() < 0.02
    system_hash = _h("system", tenant, t.isoformat() if drifting else "")
    system_norm = _h("system", tenant, "")
    same_prefix = conv["turn"] > 0 and pod == conv["pod"] and not drifting
    cached = 0
    if failed:
        prompt = cached = 0
    elif same_prefix:
        cached = (min(conv["prev_prompt"], prompt - 1)) // BLOCK * BLOCK
    elif not drifting and rnd.random() < 0.5:
        cached = (min(sys_tokens, prompt - 1)) // BLOCK * BLOCK  # the system prompt alone, from other traffic
    hist_hash = conv["hist_hash"]
    rec = {
        "log_version": 1, "request_id": f"{id_prefix}-{i:09d}", "ts": format_ts(t), "tenant_id": tenant,
        "conversation_id": conv["id"], "agent_run_id": "", "model": "tiny", "pod": pod,
        "endpoint": "chat.completions", "stream": False, "routing_policy": "prefix_affinity",
        "routing_reason": "moved: load" if moved else "affinity", "status": 503 if failed else 200,
        "error": "overloaded" if failed else "", "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": 0 if failed else rnd.randint(5, 300), "ttft_ms": round(rnd.uniform(5, 400), 3),
        "e2e_ms": round(rnd.uniform(50, 4000), 3), "queue_wait_ms": round(rnd.uniform(0, 20), 3),
        "tool_latency_ms": None, "system_hash": system_hash, "system_norm_hash": system_norm,
        "system_tokens": sys_tokens, "tools_hash": "", "tools_canonical_hash": "", "tools_tokens": 0,
        "retrieval_pack_hash": "", "retrieval_set_hash": "", "retrieval_tokens": 0,
        "history_prefix_hash": hist_hash, "prev_history_hash": conv.get("prev_hist_hash", ""),
        "history_tokens": conv["history"], "suffix_hash": _h("suffix", i), "suffix_tokens": suffix,
        "prompt_fingerprint": _h(system_hash, hist_hash), "token_count_method": "tokenizer",
    }
    if not failed:
        conv["turn"] += 1
        conv["pod"] = pod
        conv["prev_prompt"] = prompt
        conv["prev_hist_hash"] = hist_hash
        conv["history"] += suffix + rnd.randint(20, 200)
        conv["hist_hash"] = _h(hist_hash, i)
    return rec


def gateway_lines(n: int, **kwargs: Any) -> Iterator[str]:
    """The records of :func:`gateway_records` as JSON lines (no trailing newline)."""
    for rec in gateway_records(n, **kwargs):
        yield json.dumps(rec, separators=(",", ":"))
