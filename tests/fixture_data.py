"""A small, realistic data set written straight into the store"s tables, for the named-query and dashboard
tests (no collector, no Kafka): three tenants on two vLLM pods (block size 32) over three minutes, from 12:00 UTC
two days before the run (tests/clock.py: a fixed date would fall out of the tables' 30-day retention).

The numbers come from the real vLLM 0.32.0 CPU capture (tests/samples) where they
can: pod-a"s counters are the captured ones (9,818 queried / 4,064 hit, then 12,909 / 5,472) and the five
requests between those two scrapes are the five captured chat responses (762/0, 762/736, 764/672, 784/0,
19/0 prompt/cached tokens), so Δqueries = Σprompt_tokens = 3,091 and Δhits = Σcached_tokens = 1,408 exactly.
pod-b restarts between its first two scrapes (its counters drop from 5,000/2,000 to 800/288).

Every expected value in the tests is derived by hand from the constants below; the timeline:

    12:00:30  scrape pod-a (9818/4064), pod-b (5000/2000)       first samples: no delta
    12:00:40  cap-1-cold            acme    pod-a  762/0
    12:00:50  cap-2-warm            acme    pod-a  762/736
    12:01:00  cap-3-tools-reordered globex  pod-a  764/672
    12:01:10  cap-4-timestamp-first globex  pod-a  784/0
    12:01:15  initech-c1-t1         initech pod-b  400/0     (pod-b restarted)
    12:01:20  cap-5-below-one-block initech pod-a  19/0
    12:01:25  initech-c1-t2         initech pod-b  400/288
    12:01:30  scrape pod-a (12909/5472), pod-b (800/288: reset)  Δ 3091/1408 + 800/288
    12:02:00  acme-c1-t3            acme    pod-b  800/0     (routed away from pod-a)
    12:02:10  acme-c1-t4            acme    pod-b  832/768
    12:02:15  initech-oneshot-2     initech pod-b  19/0
    12:02:20  globex-run1-s3        globex  pod-a  800/768
    12:02:25  acme-c1-err           acme    pod-a  status 400, 0 tokens (not served)
    12:02:30  scrape pod-a (13709/6240), pod-b (2451/1056)        Δ 800/768 + 1651/768
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta
from typing import Any

from tests.clock import DAY, T0

BLOCK_SIZE = 32
PODS = ("pod-a", "pod-b")
TENANTS = ("acme", "globex", "initech")


def at(seconds: float) -> datetime:
    """Fixture time: ``seconds`` after T0, 12:00:00 UTC two days before the run (tests/clock.py)."""
    return T0 + timedelta(seconds=seconds)


def h(label: str) -> str:
    """A realistic segment hash (16 hex chars) for a readable label; "" stays ""."""
    return hashlib.sha256(label.encode()).hexdigest()[:16] if label else ""


# --- gateway_requests ---------------------------------------------------------------------------------------
# (request_id, t, tenant, conversation, agent_run, pod, status, prompt, cached, completion, ttft_ms,
#  queue_wait_ms, tool_latency_ms, system, system_norm, tools, tools_canonical, rag, rag_set, history,
#  suffix_tokens, fingerprint)
# fmt: off
REQUESTS: list[tuple[Any, ...]] = [
    ("cap-1-cold", 40, "acme", "conv-acme-1", "", "pod-a", 200, 762, 0, 8, 70.0, 2.0, None,
     "sys-acme", "sys-acme", "", "", "", "", "", 26, "fp-acme-A"),
    ("cap-2-warm", 50, "acme", "conv-acme-1", "", "pod-a", 200, 762, 736, 8, 15.0, 1.0, None,
     "sys-acme", "sys-acme", "", "", "", "", "", 26, "fp-acme-A"),
    ("cap-3-tools-reordered", 60, "globex", "", "run-globex-1", "pod-a", 200, 764, 672, 8, 30.0, 0.5, None,
     "sys-globex", "sys-globex-n", "tools-globex-reordered", "tools-globex-c", "", "", "", 28, "fp-globex-1"),
    ("cap-4-timestamp-first", 70, "globex", "", "run-globex-1", "pod-a", 200, 784, 0, 8, 50.0, 0.8, 1500.0,
     "sys-globex-ts", "sys-globex-n", "tools-globex", "tools-globex-c", "", "", "", 16, "fp-globex-2"),
    ("initech-c1-t1", 75, "initech", "conv-initech-1", "", "pod-b", 200, 400, 0, 8, 40.0, None, None,
     "sys-initech", "sys-initech", "", "", "rag-initech-1", "ragset-initech", "", 16, "fp-initech-1"),
    ("cap-5-below-one-block", 80, "initech", "", "", "pod-a", 200, 19, 0, 8, 12.0, 0.2, None,
     "", "", "", "", "", "", "", 19, "fp-empty"),
    ("initech-c1-t2", 85, "initech", "conv-initech-1", "", "pod-b", 200, 400, 288, 8, 22.0, 0.3, None,
     "sys-initech", "sys-initech", "", "", "rag-initech-2", "ragset-initech", "hist-i-2", 112,
     "fp-initech-2"),
    ("acme-c1-t3", 120, "acme", "conv-acme-1", "", "pod-b", 200, 800, 0, 16, 52.0, 0.4, None,
     "sys-acme", "sys-acme", "", "", "", "", "hist-a-3", 32, "fp-acme-3"),
    ("acme-c1-t4", 130, "acme", "conv-acme-1", "", "pod-b", 200, 832, 768, 16, 20.0, 0.6, None,
     "sys-acme", "sys-acme", "", "", "", "", "hist-a-4", 64, "fp-acme-4"),
    ("initech-oneshot-2", 135, "initech", "", "", "pod-b", 200, 19, 0, 8, 9.0, 0.1, None,
     "", "", "", "", "", "", "", 19, "fp-empty"),
    ("globex-run1-s3", 140, "globex", "", "run-globex-1", "pod-a", 200, 800, 768, 16, 17.0, 0.7, 60000.0,
     "sys-globex", "sys-globex-n", "tools-globex", "tools-globex-c", "", "", "hist-g-3", 32, "fp-globex-3"),
    ("acme-c1-err", 145, "acme", "conv-acme-1", "", "pod-a", 400, 0, 0, 0, 3.0, None, None,
     "sys-acme", "sys-acme", "", "", "", "", "hist-a-5", 40, "fp-acme-5"),
]
# fmt: on
#: A re-delivered log line (same request_id and ts): the load drops it as the ingester does.
DUPLICATED_REQUEST = "cap-2-warm"

GATEWAY_COLUMNS = """
    request_id ts tenant_id conversation_id agent_run_id model pod endpoint routing_policy
    routing_reason stream status error prompt_tokens cached_tokens completion_tokens ttft_ms e2e_ms
    queue_wait_ms tool_latency_ms system_hash system_norm_hash system_tokens tools_hash tools_canonical_hash
    tools_tokens retrieval_pack_hash retrieval_set_hash retrieval_tokens history_prefix_hash prev_history_hash
    history_tokens suffix_hash suffix_tokens prompt_fingerprint token_count_method system_line_hashes
    system_line_tokens suffix_chunk_hashes suffix_chunk_tokens
""".split()

# Structure (sql/migrations/0020) where the gateway logged it: rid → (system lines [(label, tokens)], message
# chunks [(label, tokens)]); the hashes are h(label) as UInt64. globex's system prompt has 4 lines whose first
# carries the timestamp: cap-3 20 + 400 + 100 + 216 = 736 tokens, cap-4 52 + 400 + 100 + 216 = 768 (its
# system_tokens). acme-c1-t4's message puts a new document before the one acme-c1-t3's had and then its question:
# known tokens 20 < half of 24 + 20, so no rag drift (attributed unavoidable, as below).
GLOBEX_LINES = [("globex-l2", 400), ("globex-l3", 100), ("globex-l4", 216)]
STRUCTURE: dict[str, tuple[list[tuple[str, int]], list[tuple[str, int]]]] = {
    "cap-3-tools-reordered": ([("globex-l1-ts-12:01:00", 20), *GLOBEX_LINES], []),
    "cap-4-timestamp-first": ([("globex-l1-ts-12:01:10", 52), *GLOBEX_LINES], []),
    "acme-c1-t3": ([], [("doc-x", 20), ("question-3", 12)]),
    "acme-c1-t4": ([], [("doc-y", 24), ("doc-x", 20), ("question-4", 20)]),
}


def h64(label: str) -> int:
    """:func:`h` as the store keeps line and chunk hashes: the 16 hex characters as a UInt64."""
    return int(h(label), 16)


def _structure(rid: str) -> tuple[list[int], list[int], list[int], list[int]]:
    lines, chunks = STRUCTURE.get(rid, ([], []))
    return ([h64(x) for x, _ in lines], [n for _, n in lines], [h64(x) for x, _ in chunks], [n for _, n in chunks])


def gateway_rows() -> list[tuple[Any, ...]]:
    rows = []
    for (rid, t, tenant, conv, run, pod, status, prompt, cached, completion, ttft, queue, tool, system,
         system_norm, tools, tools_c, rag, rag_set, history, suffix, fp) in REQUESTS:  # fmt: skip
        prefix = max(prompt - suffix, 0)
        error = "maximum context length exceeded" if status >= 400 else ""
        rows.append((
            rid, at(t), tenant, conv, run, "tiny", pod, "chat.completions",
            "round_robin", "round_robin", False, status, error, prompt, cached, completion, ttft, ttft + 40.0,
            queue, tool, h(system), h(system_norm), prefix if system else 0, h(tools), h(tools_c),
            40 if tools else 0, h(rag), h(rag_set), 120 if rag else 0, h(history), "", 60 if history else 0,
            h("suffix:" + rid), suffix, h(fp), "tokenizer", *_structure(rid),
        ))  # fmt: skip
    rows += [r for r in rows if r[0] == DUPLICATED_REQUEST]
    return rows


# --- miss_attribution ---------------------------------------------------------------------------------------
# (request_id, cause, sub_cause, tokens, predecessor_request_id, predecessor_pod, gap_ms). The tokens of a
# request sum to prompt - cached. Predecessor kinds are in PREDECESSOR_KIND: cap-3-tools-reordered and
# initech-oneshot-2 found theirs by prompt fingerprint (cap-3's in another tenant), the rest are previous turns.
# fmt: off
ATTRIBUTION: list[tuple[Any, ...]] = [
    ("cap-1-cold", "cold", "", 736, "", "", None),
    ("cap-1-cold", "unavoidable", "", 26, "", "", None),
    ("cap-2-warm", "unavoidable", "", 26, "cap-1-cold", "pod-a", 9930.0),
    ("cap-3-tools-reordered", "prefix_drift", "tools_reordered", 64, "cap-2-warm", "pod-a", 9985.0),
    ("cap-3-tools-reordered", "unavoidable", "", 28, "cap-2-warm", "pod-a", 9985.0),
    ("cap-4-timestamp-first", "prefix_drift", "volatile_system", 768, "cap-3-tools-reordered", "pod-a",
     1500.0),
    ("cap-4-timestamp-first", "unavoidable", "", 16, "cap-3-tools-reordered", "pod-a", 1500.0),
    ("initech-c1-t1", "cold", "", 384, "", "", None),
    ("initech-c1-t1", "unavoidable", "", 16, "", "", None),
    ("cap-5-below-one-block", "below_block", "", 19, "", "", None),
    ("initech-c1-t2", "unavoidable", "", 112, "initech-c1-t1", "pod-b", 9920.0),
    ("acme-c1-t3", "routed_away", "", 768, "cap-2-warm", "pod-a", 69985.0),
    ("acme-c1-t3", "unavoidable", "", 32, "cap-2-warm", "pod-a", 69985.0),
    ("acme-c1-t4", "unavoidable", "", 64, "acme-c1-t3", "pod-b", 9908.0),
    ("initech-oneshot-2", "below_block", "", 19, "cap-5-below-one-block", "pod-a", 54948.0),
    ("globex-run1-s3", "unavoidable", "", 32, "cap-4-timestamp-first", "pod-a", 60000.0),
]
# fmt: on
#: An older answer for cap-1-cold, replaced later (a late predecessor): written as version 1, then cancelled
#: (sign -1) with the current answer as version 2; readers weighting by sign must see only the current one.
STALE_ATTRIBUTION = ("cap-1-cold", "cold", "", 700, "", "", None)

ATTRIBUTION_COLUMNS = [
    "request_id", "ts", "tenant_id", "pod", "model", "prompt_tokens", "cached_tokens", "predecessor_request_id",
    "predecessor_pod", "predecessor_kind", "gap_ms", "block_size", "causes", "sub_causes", "missed_tokens",
    "attributed_at", "sign", "version",
]  # fmt: skip


PREDECESSOR_KIND = {"cap-3-tools-reordered": "fingerprint", "initech-oneshot-2": "fingerprint"}


def _answer(items: list[tuple[Any, ...]], sign: int, version: int, t: float) -> tuple[Any, ...]:
    req = {r[0]: r for r in REQUESTS}[items[0][0]]
    rid = items[0][0]
    pred, pred_pod, gap = items[0][4:7]
    kind = PREDECESSOR_KIND.get(rid, "previous_turn") if pred else ""
    return (rid, at(req[1]), req[2], req[5], "tiny", req[7], req[8], pred, pred_pod, kind, gap, BLOCK_SIZE,
            [i[1] for i in items], [i[2] for i in items], [i[3] for i in items], at(t), sign, version)


def attribution_rows() -> list[tuple[Any, ...]]:
    """request_attribution rows: one answer per request (version 1), and cap-1-cold's stale answer cancelled."""
    by_request: dict[str, list[tuple[Any, ...]]] = {}
    for item in ATTRIBUTION:
        by_request.setdefault(item[0], []).append(item)
    stale = [STALE_ATTRIBUTION]
    rows = [_answer(stale, 1, 1, 200), _answer(stale, -1, 1, 300)]
    for rid, items in by_request.items():
        rows.append(_answer(items, 1, 2 if rid == STALE_ATTRIBUTION[0] else 1, 300))
    return rows


# --- vllm_metrics ------------------------------------------------------------------------------------------
SCRAPES = (30, 90, 150)  # 12:00:30, 12:01:30, 12:02:30
# Per pod, per scrape: (queries, hits, prompt_tokens, generation_tokens, kv_cache_usage_perc).
# fmt: off
COUNTERS: dict[str, list[tuple[float, float, float, float, float]]] = {
    "pod-a": [(9818, 4064, 9818, 98, 0.0),
              (12909, 5472, 12909, 138, 0.0),
              (13709, 6240, 13709, 154, 0.25)],
    "pod-b": [(5000, 2000, 5000, 100, 0.5),
              (800, 288, 800, 16, 0.0),       # restarted at ~12:01:00: counters reset
              (2451, 1056, 2451, 56, 0.1)],
}
# pod-a's vllm:time_to_first_token_seconds_bucket and vllm:request_queue_time_seconds_bucket at the first two
# scrapes: the real capture's values (metrics_1 → metrics_2: 12 → 17 requests).
TTFT_LE = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0",
           "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf"]
TTFT_COUNTS = [[0, 0, 0, 5, 7, 10, 11] + [12] * 16, [0, 0, 0, 7, 10, 14, 16] + [17] * 16]
QUEUE_LE = ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0",
            "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"]
QUEUE_COUNTS = [[12] * 22, [17] * 22]
# pod-a's vllm:e2e_request_latency_seconds_bucket and vllm:inter_token_latency_seconds_bucket at the first two
# scrapes, from the same capture: 5 requests, all ≤ 0.3 s; 35 token gaps, 34 ≤ 10 ms and 1 in (10, 25] ms.
E2E_LE = ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
          "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"]
E2E_COUNTS = [[12] * 22, [17] * 22]
ITL_LE = ["0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5", "5.0",
          "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"]
ITL_COUNTS = [[86] * 20, [120] + [121] * 19]
# vllm:num_requests_running and vllm:num_requests_waiting per pod at each scrape (gauges: sent every scrape).
RUNNING = {"pod-a": (0, 2, 1), "pod-b": (1, 0, 0)}
WAITING = {"pod-a": (0, 1, 0), "pod-b": (0, 0, 0)}
# pod-a's vllm:request_prefill_time_seconds_sum: the capture's two values, then 3.2 ms more for the 32 tokens it
# computed by the third scrape; pod-b exposes none (it takes the fleet's rate). Over the window pod-a computed
# (13709 - 9818) - (6240 - 4064) = 1715 tokens in 0.139662678 s: PREFILL_SECONDS_PER_TOKEN.
PREFILL_SECONDS_SUM = (0.34782353299988245, 0.4842862109996986, 0.4874862109996986)
PREFILL_SECONDS_PER_TOKEN = (PREFILL_SECONDS_SUM[2] - PREFILL_SECONDS_SUM[0]) / 1715
CACHE_CONFIG_LABELS = {
    "block_size": str(BLOCK_SIZE), "cache_dtype": "auto", "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.92", "kv_cache_memory_bytes": "1073741824",
    "kv_cache_size_tokens": "1048576", "num_gpu_blocks": "32768", "prefix_caching_hash_algo": "sha256",
}
# fmt: on

METRIC_COLUMNS = ["ts", "pod", "engine", "model_name", "name", "label", "value", "increase"]
CONFIG_COLUMNS = ["ts", "pod", "engine", "labels"]


def metric_rows() -> list[tuple[Any, ...]]:
    """vllm_metrics rows as the collector sends them: gauges at every scrape; a counter only when it moved,
    with its increase since the previous scrape (a drop is a restart: the increase is the new value)."""
    rows: list[tuple[Any, ...]] = []
    previous: dict[tuple[str, str, str], float] = {}

    def add(pod: str, t: float, name: str, value: float, label: str = "", counter: bool = True) -> None:
        key = (pod, name, label)
        before = previous.get(key)
        previous[key] = value
        if not counter:
            rows.append((at(t), pod, "0", "tiny", name, label, float(value), 0.0))
            return
        if before is None:
            return  # the collector's first sample of a series is its baseline
        increase = value - before if value >= before else value
        if increase:
            rows.append((at(t), pod, "0", "tiny", name, label, float(value), float(increase)))

    for pod, series in COUNTERS.items():
        for t, (queries, hits, prompt, gen, usage) in zip(SCRAPES, series, strict=True):
            add(pod, t, "vllm:prefix_cache_queries_total", queries)
            add(pod, t, "vllm:prefix_cache_hits_total", hits)
            add(pod, t, "vllm:prompt_tokens_total", prompt)
            add(pod, t, "vllm:generation_tokens_total", gen)
            add(pod, t, "vllm:kv_cache_usage_perc", usage, counter=False)
        for t, running, waiting in zip(SCRAPES, RUNNING[pod], WAITING[pod], strict=True):
            add(pod, t, "vllm:num_requests_running", running, counter=False)
            add(pod, t, "vllm:num_requests_waiting", waiting, counter=False)
    histograms = (("vllm:time_to_first_token_seconds_bucket", TTFT_LE, TTFT_COUNTS),
                  ("vllm:request_queue_time_seconds_bucket", QUEUE_LE, QUEUE_COUNTS),
                  ("vllm:e2e_request_latency_seconds_bucket", E2E_LE, E2E_COUNTS),
                  ("vllm:inter_token_latency_seconds_bucket", ITL_LE, ITL_COUNTS))
    for name, les, counts in histograms:
        for t, per_le in zip(SCRAPES[:2], counts, strict=True):
            for le, n in zip(les, per_le, strict=True):
                add("pod-a", t, name, n, le)
    for t, seconds in zip(SCRAPES, PREFILL_SECONDS_SUM, strict=True):
        add("pod-a", t, "vllm:request_prefill_time_seconds_sum", seconds)
    return rows


def config_rows() -> list[tuple[Any, ...]]:
    """vllm_cache_config: each pod's cache_config_info labels, sent with its first scrape."""
    return [(at(SCRAPES[0]), pod, "0", CACHE_CONFIG_LABELS) for pod in PODS]


# --- dead_letters -------------------------------------------------------------------------------------------
DEAD_LETTER_COLUMNS = ["event_id", "ts", "source", "pod", "reason", "location", "raw"]


def dead_letter_rows() -> list[tuple[Any, ...]]:
    bad_line = 'vllm:prefix_cache_hits_total{engine="0" 12'
    url, reason = "http://pod-a:8000/metrics", "malformed exposition line"
    return [
        (h("dl1"), at(60), "vllm_metrics", "pod-a", reason, url, bad_line),
        (h("dl2"), at(120), "vllm_metrics", "pod-a", reason, url, bad_line + "3"),
        (h("dl3"), at(90), "gateway_log", "", "missing required field request_id", "/var/log/gw.jsonl:4096",
         f'{{"ts": "{DAY}T12:01:30.000Z"}}'),
    ]  # fmt: skip


# --- alert_state --------------------------------------------------------------------------------------------
ALERT_COLUMNS = ["rule", "kind", "severity", "state", "value", "threshold", "message", "evidence", "evaluated_at",
                 "changed_at"]


def alert_rows() -> list[tuple[Any, ...]]:
    """Three evaluations: prefix_drift_share ok, then firing for globex; vllm_scrape_silent ok throughout."""
    drift = '{"tenant": "globex", "cause": "prefix_drift", "sub_cause": "volatile_system"}'
    return [
        ("prefix_drift_share", "cause_share", "warning", "ok", 0.0, 50.0, "no tenant above 50 %", "{}", at(60),
         at(60)),
        ("prefix_drift_share", "cause_share", "warning", "firing", 94.0, 50.0,
         "globex: 94 % of its missed tokens are prefix_drift / volatile_system", drift, at(120), at(120)),
        ("vllm_scrape_silent", "source_silent", "critical", "ok", 30.0, 120.0, "every pod scraped", "{}", at(120),
         at(0)),
    ]


# --- workload_labels ----------------------------------------------------------------------------------------
# (request_id, t, run_id, scenario, cause, sub_cause, expected split [(cause, sub_cause, tokens)]): the ground
# truth of a labelled run, with its disagreements chosen (attributed as in ATTRIBUTION above):
#   acme-c1-t3     labelled none, attributed routed_away (routing, which the workload does not decide)
#   initech-c1-t2  labelled rag_reordered, attributed none (a drift attribution missed)
#   globex-run1-s3 labelled history_truncated, attributed none
#   cap-1-cold     right cause, wrong expected split (unavoidable 30, not 26)
#   acme-c1-err    not served (status 400), ghost-1 never reached the gateway: both left out
#   cap-5-below-one-block has no label.
# fmt: off
LABELS: list[tuple[Any, ...]] = [
    ("cap-1-cold", 40, "run-a", "none", "cold", "", [("cold", "", 736), ("unavoidable", "", 30)]),
    ("cap-2-warm", 50, "run-a", "none", "none", "", []),
    ("cap-3-tools-reordered", 60, "run-a", "tools_reordered", "prefix_drift", "tools_reordered",
     [("prefix_drift", "tools_reordered", 64), ("unavoidable", "", 28)]),
    ("cap-4-timestamp-first", 70, "run-a", "volatile_system", "prefix_drift", "volatile_system",
     [("prefix_drift", "volatile_system", 768), ("unavoidable", "", 16)]),
    ("initech-c1-t1", 75, "run-b", "rag_reordered", "cold", "", []),
    ("initech-c1-t2", 85, "run-b", "rag_reordered", "prefix_drift", "rag_reordered", []),
    ("ghost-1", 100, "run-a", "none", "none", "", []),
    ("acme-c1-t3", 120, "run-a", "none", "none", "", []),
    ("acme-c1-t4", 130, "run-a", "none", "none", "", []),
    ("initech-oneshot-2", 135, "run-b", "none", "below_block", "", [("below_block", "", 19)]),
    ("globex-run1-s3", 140, "run-a", "history_truncated", "prefix_drift", "history_truncated", []),
    ("acme-c1-err", 145, "run-a", "none", "none", "", []),
]
# fmt: on
LABEL_COLUMNS = ["request_id", "ts", "tenant_id", "run_id", "scenario", "cause", "sub_cause", "expected_causes",
                 "expected_sub_causes", "expected_tokens", "location"]


def label_rows() -> list[tuple[Any, ...]]:
    """workload_labels rows (tenant from REQUESTS; ghost-1 is acme's)."""
    tenants = {r[0]: r[2] for r in REQUESTS}
    return [(rid, at(t), tenants.get(rid, "acme"), run, scenario, cause, sub, [e[0] for e in split],
             [e[1] for e in split], [e[2] for e in split], f"labels.jsonl:{i}")
            for i, (rid, t, run, scenario, cause, sub, split) in enumerate(LABELS)]  # fmt: skip


def load_fixture(store: Any) -> None:
    """Insert the fixture into ``store`` (a migrated :class:`ingest.store.Store`)."""
    from ingest.dedup import absent_rows

    rows = gateway_rows()
    store.insert("gateway_requests", [rows[i] for i in absent_rows(store, "gateway_requests", rows, GATEWAY_COLUMNS)],
                 GATEWAY_COLUMNS)
    store.insert("request_attribution", attribution_rows(), ATTRIBUTION_COLUMNS)
    store.insert("vllm_metrics", metric_rows(), METRIC_COLUMNS)
    store.insert("vllm_cache_config", config_rows(), CONFIG_COLUMNS)
    store.insert("dead_letters", dead_letter_rows(), DEAD_LETTER_COLUMNS)
    store.insert("alert_state", alert_rows(), ALERT_COLUMNS)
    store.insert("workload_labels", label_rows(), LABEL_COLUMNS)
