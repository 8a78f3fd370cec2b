"""Generated fleet history for the benchmark, built column-wise (numpy/Arrow: 10^7 requests in seconds, where
the record-by-record generator in demo/history.py would take minutes): gateway requests and vLLM metric rows
shaped like a real fleet's.

Requests: ``tenants`` tenants (a quarter drift: a timestamp on top of the system prompt), chat conversations of
~4 turns whose history grows, ``pods`` pods with 80 % of turns staying on the previous turn's pod, 2 % failures;
cached tokens follow from that. vLLM: per pod and scrape every kept series of the collector's allowlist, with
its increase (counters) or value (gauges).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

BLOCK = 32


def _hashes(*parts: np.ndarray) -> pa.Array:
    """A string hash per row of the combined integer parts (what a gateway writes: opaque ids)."""
    h = np.zeros(len(parts[0]), dtype=np.uint64)
    for p in parts:
        h = (h ^ p.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(29)
    return pa.array(h).cast(pa.string())


def gateway_table(n: int, *, seed: int = 0, tenants: int = 200, pods: int = 5, end: datetime | None = None,
                  rate_per_second: float = 500.0, id_prefix: str = "b") -> pa.Table:
    """``n`` gateway_requests rows (Arrow, the table's column names) arriving at ``rate_per_second`` and
    ending at ``end`` (default: now), in arrival order."""
    rng = np.random.default_rng(seed)
    end = end or datetime.now(UTC)
    span_ms = int(n / rate_per_second * 1000)
    start_ms = int(end.timestamp() * 1000) - span_ms
    ts_ms = np.sort(rng.integers(0, max(span_ms, 1), n)) + start_ms
    conv = rng.integers(0, max(n // 4, 1), n)
    order = np.lexsort((ts_ms, conv))  # turns of a conversation, in time order
    turn = np.zeros(n, dtype=np.int64)
    same = np.r_[False, conv[order][1:] == conv[order][:-1]]
    idx = np.arange(n)
    first_of_run = np.where(~same, idx, 0)
    np.maximum.accumulate(first_of_run, out=first_of_run)
    turn[order] = idx - first_of_run
    tenant = conv % tenants
    drifting = tenant % 4 == 0
    sys_tokens = (np.random.default_rng(seed + 1).integers(300, 2000, tenants))[tenant]
    suffix = rng.integers(10, 200, n)
    history = turn * 150
    prompt = sys_tokens + history + suffix + 8
    base_pod = conv % pods
    moved = (turn > 0) & (rng.random(n) < 0.2)
    pod = np.where(moved, rng.integers(0, pods, n), base_pod)
    failed = rng.random(n) < 0.02
    stay = (turn > 0) & ~moved & ~drifting
    prev_prompt = sys_tokens + np.maximum(turn - 1, 0) * 150 + 100
    cached = np.where(stay, np.minimum(prev_prompt, prompt - 1) // BLOCK * BLOCK,
                      np.where(~drifting & (rng.random(n) < 0.5),
                               np.minimum(sys_tokens, prompt - 1) // BLOCK * BLOCK, 0))
    prompt = np.where(failed, 0, prompt)
    cached = np.where(failed, 0, cached)
    system_hash = _hashes(tenant, np.where(drifting, ts_ms, 0))
    hist_hash = _hashes(conv, turn)
    empty = pa.array([""] * n, type=pa.string())
    history_hash = pa.array(np.where(turn > 0, np.asarray(hist_hash.to_numpy(zero_copy_only=False)), ""))
    prev_hash = pa.array(np.where(turn > 1, np.asarray(_hashes(conv, turn - 1).to_numpy(zero_copy_only=False)), ""))
    # each turn's final message, and the previous turn's as a later turn carries it (prev_suffix_hash, as the
    # gateway logs it): predecessor key 12 finds a turn's previous turn by them
    suffix_hash = np.asarray(_hashes(np.arange(n) + 7).to_numpy(zero_copy_only=False))
    previous = np.full(n, -1, dtype=np.int64)
    previous[order[1:]] = np.where(same[1:], order[:-1], -1)
    prev_suffix = pa.array(np.where(previous >= 0, suffix_hash[np.maximum(previous, 0)], ""))
    ts = pa.array(ts_ms, type=pa.timestamp("ms", tz="UTC"))
    return pa.table({
        "request_id": pa.array(np.char.add(f"{id_prefix}-", np.arange(n).astype(str))),
        "ts": ts, "tenant_id": pa.array(np.char.add("tenant-", tenant.astype(str))),
        "conversation_id": pa.array(np.char.add("c-", conv.astype(str))), "agent_run_id": empty,
        # the conversation's first message, as the gateway logs it: predecessor keys 10 and 17 are on it
        "first_message_hash": _hashes(conv, np.full(n, -1, dtype=np.int64)),
        "model": pa.array(["tiny"] * n), "pod": pa.array(np.char.add("pod-", pod.astype(str))),
        "endpoint": pa.array(["chat.completions"] * n), "routing_policy": pa.array(["prefix_affinity"] * n),
        "routing_reason": pa.array(np.where(moved, "moved: load", "affinity")),
        "stream": pa.array(np.zeros(n, dtype=bool)), "status": pa.array(np.where(failed, 503, 200), type=pa.uint16()),
        "error": pa.array(np.where(failed, "overloaded", "")),
        "prompt_tokens": pa.array(prompt, type=pa.uint32()), "cached_tokens": pa.array(cached, type=pa.uint32()),
        "completion_tokens": pa.array(np.where(failed, 0, rng.integers(5, 300, n)), type=pa.uint32()),
        "ttft_ms": pa.array(rng.gamma(2.0, 60.0, n)), "e2e_ms": pa.array(rng.gamma(2.0, 600.0, n)),
        "queue_wait_ms": pa.array(rng.gamma(1.0, 5.0, n)), "tool_latency_ms": pa.nulls(n, pa.float64()),
        "system_hash": system_hash, "system_norm_hash": _hashes(tenant, np.zeros(n, dtype=np.int64)),
        "system_tokens": pa.array(sys_tokens, type=pa.uint32()), "tools_hash": empty, "tools_canonical_hash": empty,
        "tools_tokens": pa.array(np.zeros(n), type=pa.uint32()), "retrieval_pack_hash": empty,
        "retrieval_set_hash": empty, "retrieval_tokens": pa.array(np.zeros(n), type=pa.uint32()),
        "history_prefix_hash": history_hash, "prev_history_hash": prev_hash,
        "history_tokens": pa.array(history, type=pa.uint32()), "suffix_hash": pa.array(suffix_hash),
        "prev_suffix_hash": prev_suffix, "next_history_hash": _hashes(np.arange(n) + 13),
        "suffix_tokens": pa.array(suffix, type=pa.uint32()),
        "prompt_fingerprint": _hashes(np.asarray(system_hash.cast(pa.uint64())), turn),
        "token_count_method": pa.array(["tokenizer"] * n),
    })


#: (name, label values, kind) of the series a vLLM 0.32 pod exposes that the collector keeps (one engine).
_BUCKETS = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5",
            "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf"]
SERIES = ([(f"vllm:{c}_total", [""], "counter") for c in (
    "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "num_preemptions")]
          + [("vllm:request_success_total", ["stop", "length", "abort"], "counter")]
          + [(f"vllm:{h}_bucket", _BUCKETS, "counter") for h in (
              "time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds",
              "inter_token_latency_seconds", "request_prefill_time_seconds")]
          + [(f"vllm:{h}_{s}", [""], "counter") for h in (
              "time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds",
              "inter_token_latency_seconds", "request_prefill_time_seconds") for s in ("sum", "count")]
          + [(f"vllm:{g}", [""], "gauge") for g in ("num_requests_running", "num_requests_waiting",
                                                     "kv_cache_usage_perc")])


def vllm_table(pods: int, *, seconds: int, interval_seconds: float = 5.0, busy: float = 0.7, seed: int = 0,
               end: datetime | None = None) -> pa.Table:
    """vllm_metrics rows for ``pods`` pods scraped every ``interval_seconds`` over ``seconds``: every gauge,
    and each counter series when it moved (it moves with probability ``busy`` per scrape: a fleet at load;
    the collector sends no row for a counter that did not)."""
    rng = np.random.default_rng(seed)
    end = end or datetime.now(UTC)
    scrapes = int(seconds / interval_seconds)
    t0 = int((end - timedelta(seconds=seconds)).timestamp() * 1000)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("ts", "pod", "name", "label", "value", "increase")}
    ts = t0 + (np.arange(scrapes) * interval_seconds * 1000).astype(np.int64)
    for p in range(pods):
        for name, labels, kind in SERIES:
            for label in labels:
                moved = np.ones(scrapes, dtype=bool) if kind == "gauge" else rng.random(scrapes) < busy
                inc = np.where(moved, rng.integers(1, 500, scrapes), 0) if kind == "counter" else np.zeros(scrapes)
                value = np.cumsum(inc) if kind == "counter" else rng.random(scrapes)
                keep = moved
                k = int(keep.sum())
                cols["ts"].append(ts[keep])
                cols["pod"].append(np.full(k, f"pod-{p}"))
                cols["name"].append(np.full(k, name))
                cols["label"].append(np.full(k, label))
                cols["value"].append(value[keep].astype(np.float64))
                cols["increase"].append(inc[keep].astype(np.float64))
    n = sum(len(a) for a in cols["ts"])
    return pa.table({
        "ts": pa.array(np.concatenate(cols["ts"]), type=pa.timestamp("ms", tz="UTC")),
        "pod": pa.array(np.concatenate(cols["pod"])), "engine": pa.array(["0"] * n),
        "model_name": pa.array(["tiny"] * n), "name": pa.array(np.concatenate(cols["name"])),
        "label": pa.array(np.concatenate(cols["label"])), "value": pa.array(np.concatenate(cols["value"])),
        "increase": pa.array(np.concatenate(cols["increase"])),
    })
