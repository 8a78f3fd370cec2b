"""Precise mode (docs/miss-causes.md "Precise mode"): requests that logged their prompt's block chain are judged
block by block against the pods' KV events, on real chDB.

KV events go the production way (ZMQ frames → collector decoder and chain hashing → in-process queue →
ingester → kv_block_events → kv_block_log views), as tests/test_kv_residency.py feeds them; gateway_requests
rows carry the chain (kvscope.block_hash.chain_hashes of made-up token ids) as the gateway logs it. Each
scenario has its own model, pods and tokens, so the scenarios share one store per block size without seeing
each other's blocks. Expected tokens are derived by hand from the scenario (B = block size, 8 full blocks).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import pytest
from test_attribution_job import INGESTED, h, insert_requests
from test_kv_residency import CLEARED, collect, frames, ingest, removed

from dashboard import request_detail
from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes
from tests.clock import DAY, T0  # the KV-event frames' clock (test_kv_residency.at)

N = 8  # full blocks of every scenario's stable prefix


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def tokens(scenario: int, n: int, part: int = 0) -> list[int]:
    """``n`` made-up token ids, distinct per (scenario, part)."""
    start = 100_000 * scenario + 10_000 * part
    return list(range(start, start + n))


#: How the scenarios' pods hash their blocks: "own" (vLLM hashes vh0, vh0 + 1, ... that differ from kvscope's chain
#: hashes, so removals are paired with their stores by vLLM hash) or "default" (vLLM's default hashing: the
#: published hashes are the chain hashes, so one read of the log by the wanted hashes finds every row).
HASHING = {"mode": "own"}
_PUBLISHED: dict[int, int] = {}  # vh0 + j → the hash the pod published for that block


def stored(toks: list[int], b: int, vh0: int) -> dict[str, Any]:
    """BlockStored of the full blocks of ``toks`` (block size ``b``), vLLM hashes vh0, vh0 + 1, ... (or, under
    the default hashing, the chain hashes of those blocks; :func:`vllm_removed` names them by vh0 + j either way)."""
    n = len(toks) // b
    names = [vh0 + j for j in range(n)]
    hashes = chain_hashes(toks[: n * b], b) if HASHING["mode"] == "default" else names
    _PUBLISHED.update(zip(names, hashes, strict=True))
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": toks[: n * b], "block_size": b, "lora_id": None, "medium": "GPU"}


def vllm_removed(names: list[int]) -> dict[str, Any]:
    """BlockRemoved of the blocks :func:`stored` named vh0 + j, by the hashes their pod published."""
    return removed([_PUBLISHED[n] for n in names])


def gw(rid: str, scenario: int, *, t: float, pod: str, prompt_ids: list[int] | None, b: int, prompt: int,
       cached: int = 0, conv: str = "", tenant: str = "", system: str = "sys", system_tokens: int = 0,
       rag: str = "", rag_tokens: int = 0, suffix: str = "q1", suffix_tokens: int = 0,
       chain_block_size: int | None = None) -> dict[str, Any]:
    """A gateway_requests row of model m<scenario>; ``prompt_ids``: the token ids whose chain it logged."""
    sh, rh = h(f"{scenario}{system}"), h(f"{scenario}{rag}")
    cb = b if chain_block_size is None else chain_block_size
    return {
        "request_id": rid, "ts": at(t), "tenant_id": tenant or f"t{scenario}", "conversation_id": conv,
        "agent_run_id": "", "model": f"m{scenario}", "pod": pod, "status": 200, "prompt_tokens": prompt,
        "cached_tokens": cached, "e2e_ms": 100.0,
        "system_hash": sh, "system_norm_hash": sh, "system_tokens": system_tokens,
        "tools_hash": "", "tools_canonical_hash": "", "tools_tokens": 0,
        "retrieval_pack_hash": rh if rag else "", "retrieval_set_hash": rh if rag else "",
        "retrieval_tokens": rag_tokens,
        "history_prefix_hash": "", "prev_history_hash": "", "history_tokens": 0,
        "suffix_hash": h(f"{scenario}{suffix}"), "suffix_tokens": suffix_tokens,
        "prompt_fingerprint": h(sh + (rh if rag else "")), "ingested_at": INGESTED,
        "prompt_block_hashes": chain_hashes(prompt_ids, cb) if prompt_ids else [],
        "prompt_block_size": cb if prompt_ids else 0,
    }


def turn(rid: str, scenario: int, b: int, *, t: float, pod: str, prompt_ids: list[int] | None, suffix: str,
         suffix_tokens: int, cached: int = 0, **kw: Any) -> dict[str, Any]:
    """A turn of conversation c<scenario>: system of N·B tokens, then a suffix."""
    return gw(rid, scenario, t=t, pod=pod, prompt_ids=prompt_ids, b=b, prompt=N * b + suffix_tokens, cached=cached,
              conv=f"c{scenario}", system_tokens=N * b, suffix=suffix, suffix_tokens=suffix_tokens, **kw)


def build(store: Store, b: int) -> None:
    """Every scenario's KV events and gateway rows (see each test for its story)."""
    msgs: list[list[bytes]] = []
    rows: list[dict[str, Any]] = []
    sys_ids = {s: tokens(s, N * b) for s in range(1, 14)}

    # 1: routed_away, no fingerprint predecessor: 1-b holds the prefix, the request goes to 1-a.
    msgs += [frames("1-a", 0, 0.5, stored(tokens(1, b, 9), b, 1900)), frames("1-b", 0, 1, stored(sys_ids[1], b, 1000))]
    rows += [gw("s1-other", 1, t=0.2, pod="1-b", prompt_ids=None, b=b, prompt=50, tenant="other", system="x",
                system_tokens=40, suffix_tokens=10),
             gw("s1", 1, t=5, pod="1-a", prompt_ids=sys_ids[1] + tokens(1, 10, 1), b=b, prompt=N * b + 10,
                system_tokens=N * b, suffix_tokens=10)]
    # 2: evicted by BlockRemoved: blocks 5-7 removed at 3 s, 3-4 at 4 s; the next turn hit blocks 0-2.
    msgs += [frames("2-a", 0, 1, stored(sys_ids[2], b, 2000)), frames("2-a", 1, 3, vllm_removed([2005, 2006, 2007])),
             frames("2-a", 2, 4, vllm_removed([2003, 2004]))]
    rows += [turn("p2", 2, b, t=0.5, pod="2-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             turn("s2", 2, b, t=10, pod="2-a", prompt_ids=sys_ids[2] + tokens(2, 20, 1), suffix="q2",
                  suffix_tokens=20, cached=3 * b)]
    # 3: cache reset by AllBlocksCleared at 4 s.
    msgs += [frames("3-a", 0, 1, stored(sys_ids[3], b, 3000)), frames("3-a", 1, 4, CLEARED)]
    rows += [turn("p3", 3, b, t=0.5, pod="3-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             turn("s3", 3, b, t=10, pod="3-a", prompt_ids=sys_ids[3] + tokens(3, 20, 1), suffix="q2",
                  suffix_tokens=20)]
    # 4: cache reset by a vLLM restart at 4 s (its publisher starts again at seq 0).
    msgs += [frames("4-a", 0, 1, stored(sys_ids[4], b, 4000)), frames("4-a", 1, 2, stored(tokens(4, b, 8), b, 4900)),
             frames("4-a", 0, 4, stored(tokens(4, b, 9), b, 4950))]
    rows += [turn("p4", 4, b, t=0.5, pod="4-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             turn("s4", 4, b, t=10, pod="4-a", prompt_ids=sys_ids[4] + tokens(4, 20, 1), suffix="q2",
                  suffix_tokens=20)]
    # 5: LRU took the tail block (7) at 3 s; the next turn hit blocks 0-6.
    msgs += [frames("5-a", 0, 1, stored(sys_ids[5], b, 5000)), frames("5-a", 1, 3, vllm_removed([5007]))]
    rows += [turn("p5", 5, b, t=0.5, pod="5-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             turn("s5", 5, b, t=10, pod="5-a", prompt_ids=sys_ids[5] + tokens(5, 20, 1), suffix="q2",
                  suffix_tokens=20, cached=7 * b)]
    # 6: the system prompt (4 blocks) lives on 6-b, the retrieved document changed; the request goes to 6-a.
    half = N * b // 2
    doc_a, doc_b = tokens(6, half, 2), tokens(6, half, 3)
    msgs += [frames("6-a", 0, 0.5, stored(tokens(6, b, 9), b, 6900)),
             frames("6-b", 0, 1, stored(sys_ids[6][:half] + doc_a, b, 6000))]
    rows += [gw("p6", 6, t=0.5, pod="6-b", prompt_ids=None, b=b, prompt=N * b + 10, system_tokens=half, rag="docA",
                rag_tokens=half, suffix_tokens=10),
             gw("s6", 6, t=10, pod="6-a", prompt_ids=sys_ids[6][:half] + doc_b + tokens(6, 10, 1), b=b,
                prompt=N * b + 10, system_tokens=half, rag="docB", rag_tokens=half, suffix="q2", suffix_tokens=10)]
    # 7: the prefix is resident on 7-a (and on 7-b): a partial hit there is a race, never routed_away; a full hit.
    msgs += [frames("7-a", 0, 1, stored(sys_ids[7], b, 7000)), frames("7-b", 0, 1, stored(sys_ids[7], b, 7100))]
    rows += [turn("p7", 7, b, t=0.5, pod="7-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             gw("s7-full", 7, t=9, pod="7-b", prompt_ids=None, b=b, prompt=30, tenant="other", system="y",
                system_tokens=20, suffix_tokens=10),
             turn("s7", 7, b, t=10, pod="7-a", prompt_ids=sys_ids[7] + tokens(7, 20, 1), suffix="q2",
                  suffix_tokens=20, cached=4 * b),
             turn("s7-hit", 7, b, t=11, pod="7-a", prompt_ids=sys_ids[7] + tokens(7, 20, 2), suffix="q3",
                  suffix_tokens=20, cached=N * b)]
    # 8: 8-a evicted nothing (its events hold other blocks only); the previous turn's blocks were never stored.
    msgs += [frames("8-a", 0, 0.2, stored(tokens(8, b, 9), b, 8900))]
    rows += [turn("p8", 8, b, t=0.5, pod="8-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             turn("s8", 8, b, t=10, pod="8-a", prompt_ids=sys_ids[8] + tokens(8, 20, 1), suffix="q2",
                  suffix_tokens=20)]
    # 9: no precise mode: 9-a sends no KV events; 9-b's request logged its chain at another block size.
    msgs += [frames("9-b", 0, 1, stored(sys_ids[9], b, 9000)),
             frames("9-b", 1, 3, vllm_removed([9000 + j for j in range(N)]))]
    rows += [turn("p9", 9, b, t=0.5, pod="9-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             turn("s9", 9, b, t=10, pod="9-a", prompt_ids=sys_ids[9] + tokens(9, 20, 1), suffix="q2",
                  suffix_tokens=20),
             gw("s9-size", 9, t=11, pod="9-b", prompt_ids=sys_ids[9] + tokens(9, 20, 2), b=b, prompt=N * b + 20,
                tenant="t9b", system_tokens=N * b, suffix_tokens=20, chain_block_size=2 * b)]
    # 10: resident on 10-a at arrival (10 s), evicted at 11 s while the request waited (it ended at 12 s).
    msgs += [frames("10-a", 0, 1, stored(sys_ids[10], b, 10_000)),
             frames("10-a", 1, 11, vllm_removed([10_000 + j for j in range(2, N)]))]
    rows += [turn("p10", 10, b, t=0.5, pod="10-a", prompt_ids=None, suffix="q1", suffix_tokens=5),
             {**turn("s10", 10, b, t=10, pod="10-a", prompt_ids=sys_ids[10] + tokens(10, 20, 1), suffix="q2",
                     suffix_tokens=20, cached=2 * b), "e2e_ms": 2000.0}]
    # 11: the next turn of c11 stayed on 11-a with its document changed; 11-b (another tenant) held the system
    # prompt with that new document: the drifted part lived elsewhere, but the drift caused its miss.
    doc_a, doc_b = tokens(11, half, 2), tokens(11, half, 3)
    msgs += [frames("11-a", 0, 1, stored(tokens(11, N * b)[:half] + doc_a, b, 11_000)),
             frames("11-b", 0, 1, stored(tokens(11, N * b)[:half] + doc_b, b, 11_100))]
    rows += [gw("p11", 11, t=2, pod="11-a", prompt_ids=None, b=b, prompt=N * b + 10, conv="c11", system_tokens=half,
                rag="docA", rag_tokens=half, suffix_tokens=10),
             gw("p11-other", 11, t=2, pod="11-b", prompt_ids=None, b=b, prompt=N * b + 10, tenant="other",
                system_tokens=half, rag="docB", rag_tokens=half, suffix_tokens=10),
             gw("s11", 11, t=10, pod="11-a", prompt_ids=tokens(11, N * b)[:half] + doc_b + tokens(11, 10, 1), b=b,
                prompt=N * b + 10, cached=half, conv="c11", system_tokens=half, rag="docB", rag_tokens=half,
                suffix="q2", suffix_tokens=10)]
    # 12: the prefix lives on 12-b and 12-c; 12-b (the first holder by name, the predecessor's pod) was down as s12
    # was routed to 12-a, 12-c was up: a router could have hit it there (plain routed_away, 12-c named).
    msgs += [frames("12-a", 0, 0.5, stored(tokens(12, b, 9), b, 12_900)),
             frames("12-b", 0, 1, stored(sys_ids[12], b, 12_000)), frames("12-c", 0, 1, stored(sys_ids[12], b, 12_100))]
    rows += [turn("p12", 12, b, t=0.5, pod="12-b", prompt_ids=None, suffix="q1", suffix_tokens=5),
             gw("p12-c", 12, t=0.6, pod="12-c", prompt_ids=None, b=b, prompt=30, tenant="other", system="y",
                system_tokens=20, suffix_tokens=10)]
    # 13: the prefix lives on 13-b only, down as s13 was routed to 13-a: routed_away / pod_down, 13-b named.
    msgs += [frames("13-a", 0, 0.5, stored(tokens(13, b, 9), b, 13_900)),
             frames("13-b", 0, 1, stored(sys_ids[13], b, 13_000))]
    rows += [turn("p13", 13, b, t=0.5, pod="13-b", prompt_ids=None, suffix="q1", suffix_tokens=5)]
    failed_over = [{**turn("s12", 12, b, t=10, pod="12-a", prompt_ids=sys_ids[12] + tokens(12, 20, 1), suffix="q2",
                           suffix_tokens=20), "pods_down": ["12-b"]},
                   {**turn("s13", 13, b, t=10, pod="13-a", prompt_ids=sys_ids[13] + tokens(13, 20, 1), suffix="q2",
                           suffix_tokens=20), "pods_down": ["13-b", "13-z"]}]
    ingest(store, collect(msgs))
    insert_requests(store, rows)
    insert_requests(store, failed_over)


def answers(store: Store) -> dict[str, tuple[Any, ...]]:
    """request_id → (causes as (cause, sub_cause, tokens), evidence, evidence_pod, evidence_removed_at)."""
    rows = store.query_rows("SELECT request_id, causes, sub_causes, missed_tokens, evidence, evidence_pod, "
                            "evidence_removed_at FROM request_attribution FINAL")
    return {r[0]: (list(zip(r[1], r[2], r[3], strict=True)), r[4], r[5],
                   r[6].replace(tzinfo=UTC) if r[6] else None) for r in rows}


@pytest.fixture(scope="module", params=[(32, "own"), (64, "own"), (32, "default")],
                ids=["32", "64", "32-default-hashing"])
def results(request: pytest.FixtureRequest, chdb_dir: Any) -> tuple[int, dict[str, Any], dict[str, Any], dict]:
    """(B, answers with KV evidence, answers of the same store attributed again without it, the named query
    request_detail's evidence for s1 and s2 in each mode: {"precise": ..., "inferred": ...}); pods hash their
    blocks their own way (B = 32, 64) or as vLLM does by default (:data:`HASHING`: the other read of the log)."""
    import uuid

    b, HASHING["mode"] = request.param
    store = Store.open(data_dir=chdb_dir, database=f"t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    try:
        build(store, b)
    finally:
        HASHING["mode"] = "own"
    attribution_job.run_attribution(store, default_block_size=b)
    precise = answers(store)
    details = {"precise": detail(store)}
    store.command("TRUNCATE TABLE request_attribution")
    store.command("TRUNCATE TABLE attribution_watermark")
    attribution_job.run_attribution(store, default_block_size=b, kv_evidence=False)
    inferred = answers(store)
    details["inferred"] = detail(store)
    return b, precise, inferred, details


def detail(store: Store) -> dict[str, tuple[Any, ...]]:
    """request_detail's (evidence, evidence_pod, evidence_removed_at, causes) for s1 and s2, and the page text;
    under "s12 text" and "s13 text" the page's evidence text of those requests."""
    out = {}
    for rid in ("s1", "s2"):
        row = store.named("request_detail", {"request_id": rid}).to_dicts()[0]
        out[rid] = (row["evidence"], row["evidence_pod"], row["evidence_removed_at"], row["causes"],
                    request_detail._precise_text(row))
    for rid in ("s12", "s13"):  # the page's evidence text of the failed-over requests
        rows = store.named("request_detail", {"request_id": rid}).to_dicts()
        out[f"{rid} text"] = request_detail.evidence(rows[0], pl.DataFrame(rows))
    return out


def test_routed_away_names_the_pod_that_held_the_blocks(results) -> None:
    """No earlier request shares s1's prefix (fingerprints: cold), but 1-b held all 8 blocks at arrival."""
    b, precise, inferred, _ = results
    assert precise["s1"] == ([("routed_away", "", N * b), ("unavoidable", "", 10)], "kv_events", "1-b", None)
    assert inferred["s1"] == ([("cold", "", N * b), ("unavoidable", "", 10)], "fingerprints", "", None)


def test_a_holder_found_down_is_pod_down_and_an_up_holder_is_named_first(results) -> None:
    """s13's prefix sat only on 13-b, which the gateway found down: `routed_away / pod_down` in both modes. s12's sat
    on 12-b (down, the predecessor's pod) and 12-c (up): precise mode names 12-c, plain `routed_away` (a router could
    have hit it there); inferred mode knows only the predecessor's pod: `pod_down`."""
    b, precise, inferred, _ = results
    assert precise["s13"] == ([("routed_away", "pod_down", N * b), ("unavoidable", "", 20)], "kv_events", "13-b",
                              None)
    assert inferred["s13"] == ([("routed_away", "pod_down", N * b), ("unavoidable", "", 20)], "inferred", "", None)
    assert precise["s12"] == ([("routed_away", "", N * b), ("unavoidable", "", 20)], "kv_events", "12-c", None)
    assert inferred["s12"] == ([("routed_away", "pod_down", N * b), ("unavoidable", "", 20)], "inferred", "", None)
    said = results[3]
    down13 = "The gateway found **13-b**, **13-z** down when it routed this request"
    assert down13 in said["precise"]["s13 text"] and down13 in said["inferred"]["s13 text"]
    assert "The gateway found" not in said["precise"]["s12 text"]
    assert "The gateway found **12-b** down" in said["inferred"]["s12 text"]


def test_evicted_by_block_removed_with_its_time(results) -> None:
    """s2 hit blocks 0-2; blocks 3-7 left 2-a by BlockRemoved before it arrived, block 3 at 4 s."""
    b, precise, inferred, _ = results
    causes = [("evicted", "evicted_before_next_turn", 5 * b), ("unavoidable", "", 20)]
    assert precise["s2"] == (causes, "kv_events", "2-a", at(4))
    assert inferred["s2"] == (causes, "inferred", "", None)


@pytest.mark.parametrize("rid", ["s3", "s4"])
def test_a_cache_reset_is_not_pressure(results, rid: str) -> None:
    """s3's blocks went with an AllBlocksCleared at 4 s, s4's with a vLLM restart at 4 s: evicted/cache_reset."""
    b, precise, inferred, _ = results
    pod = f"{rid[1]}-a"
    assert precise[rid] == ([("evicted", "cache_reset", N * b), ("unavoidable", "", 20)], "kv_events", pod, at(4))
    assert inferred[rid] == ([("evicted", "evicted_before_next_turn", N * b), ("unavoidable", "", 20)], "inferred",
                             "", None)


def test_a_partial_hit_stops_at_the_exact_block(results) -> None:
    """s5 hit 7 of 8 blocks: the fingerprints take the last one for the edge of sharing (unavoidable); the
    events show it was evicted (the tail block LRU takes first)."""
    b, precise, inferred, _ = results
    assert precise["s5"] == ([("evicted", "evicted_before_next_turn", b), ("unavoidable", "", 20)], "kv_events",
                             "5-a", at(3))
    assert inferred["s5"] == ([("unavoidable", "", b + 20)], "fingerprints", "", None)


def test_two_causes_split_by_position(results) -> None:
    """s6: the 4 system blocks were on 6-b (routed_away), the changed document's 4 blocks nowhere (drift)."""
    b, precise, inferred, _ = results
    half = N * b // 2
    causes = [("routed_away", "", half), ("prefix_drift", "rag_changed", half), ("unavoidable", "", 10)]
    assert precise["s6"] == (causes, "kv_events", "6-b", None)
    assert inferred["s6"] == (causes, "inferred", "", None)


def test_a_hit_that_stayed_on_its_pod_is_never_routed_away(results) -> None:
    """s7's missed blocks 4-7 were resident on 7-a itself (and on 7-b): a race, unknown/resident_at_arrival;
    s7-hit hit everything hittable on 7-a."""
    b, precise, _, _ = results
    assert precise["s7"] == ([("unknown", "resident_at_arrival", 4 * b), ("unavoidable", "", 20)], "kv_events",
                             "7-a", None)
    assert precise["s7-hit"] == ([("unavoidable", "", 20)], "kv_events", "", None)
    for rid in ("p7", "s7", "s7-hit"):  # every request 7-a served, although 7-b held the same blocks
        assert "routed_away" not in [c for c, _, _ in precise[rid][0]], rid


def test_a_drifted_part_held_elsewhere_is_the_drift_not_routed_away(results) -> None:
    """s11 stayed on 11-a, its predecessor's pod, with its document changed; the 4 blocks from the change on were
    resident on 11-b (another tenant sent that document there): prefix_drift, not routed_away, in both modes,
    and no holder named (no block was decided by the KV evidence)."""
    b, precise, inferred, _ = results
    half = N * b // 2
    causes = [("prefix_drift", "rag_changed", half), ("unavoidable", "", 10)]
    assert precise["s11"] == (causes, "kv_events", "", None)
    assert inferred["s11"] == (causes, "fingerprints", "", None)


def test_evicted_while_the_request_waited(results) -> None:
    """s10's blocks 2-7 were resident on its pod at arrival and removed 1 s later, before it ended."""
    b, precise, _, _ = results
    assert precise["s10"] == ([("evicted", "evicted_before_next_turn", 6 * b), ("unavoidable", "", 20)],
                              "kv_events", "10-a", at(11))


def test_a_pod_that_evicted_nothing_never_shows_evicted(results) -> None:
    """s8's previous turn ran on 8-a, whose events never held its blocks: the fingerprints say evicted, the
    events say no pod held them: cold."""
    b, precise, inferred, _ = results
    assert precise["s8"] == ([("cold", "", N * b), ("unavoidable", "", 20)], "kv_events", "", None)
    assert inferred["s8"][0] == [("evicted", "evicted_before_next_turn", N * b), ("unavoidable", "", 20)]
    evicted_pods = {v[2] for v in precise.values() if v[1] == "kv_events" and any(c == "evicted" for c, _, _ in v[0])}
    assert evicted_pods == {"2-a", "3-a", "4-a", "5-a", "10-a"}


def test_without_kv_events_or_with_another_block_size_todays_logic_stays(results) -> None:
    """s9's pod sends no KV events; s9-size logged its chain at 2·B: both are judged by the fingerprints."""
    b, precise, inferred, _ = results
    assert precise["s9"] == ([("evicted", "evicted_before_next_turn", N * b), ("unavoidable", "", 20)], "inferred",
                             "", None)
    # s9-size's latest same-fingerprint predecessor (s9) ran on 9-a: inferred, although 9-b's events show the
    # blocks evicted there (they are not read at another block size)
    assert precise["s9-size"] == inferred["s9-size"] == (
        [("routed_away", "", N * b), ("unavoidable", "", 20)], "inferred", "", None)


def test_request_detail_shows_the_evidence(results) -> None:
    precise, inferred = results[3]["precise"], results[3]["inferred"]
    assert precise["s2"][:4] == ("kv_events", "2-a", at(4), ["evicted", "unavoidable"])
    assert f"**2-a** held the first missed block; it left 2-a at {DAY} 12:00:04 UTC" in precise["s2"][4][0]
    assert precise["s1"][:3] == ("kv_events", "1-b", None)
    assert inferred["s2"] == ("inferred", "", None, ["evicted", "unavoidable"], [])
    assert inferred["s1"][:2] == ("fingerprints", "")


def test_token_accounting_is_exact_in_both_modes(results) -> None:
    _, precise, inferred, _ = results
    assert set(precise) == set(inferred)
    for answers_ in (precise, inferred):
        for rid, (causes, *_rest) in answers_.items():
            assert all(n > 0 for _, _, n in causes), rid
    assert {rid: sum(n for *_, n in v[0]) for rid, v in precise.items()} == {
        rid: sum(n for *_, n in v[0]) for rid, v in inferred.items()}


def test_timeline_counts_copies_and_resets() -> None:
    """kv_evidence.KvTimeline without a store: a hash stored twice stays until its second removal; a removal
    with no store in the events proves a copy before it; a reset ends every copy; other pods are holders only
    among the model's pods."""
    def row(pod: str, vh: int, chain: int, t_ms: int, seq: int, kind: str) -> kv_evidence.BlockRow:
        return (pod, "", "GPU", vh, chain if kind == "stored" else 0, t_ms, seq, 0, 0, kind)

    timeline = kv_evidence.KvTimeline(
        [row("a", 1, 11, 1000, 1, "stored"), row("a", 1, 11, 2000, 2, "stored"), row("a", 1, 11, 3000, 3, "removed"),
         row("a", 1, 11, 4000, 4, "removed"), row("a", 2, 22, 1000, 1, "stored"), row("b", 9, 22, 1500, 1, "stored"),
         row("a", 3, 33, 500, 1, "stored"), row("a", 3, 33, 6000, 7, "removed"), row("a", 3, 33, 7000, 8, "removed")],
        [("a", "", 5000, 5, 0, "cleared")])
    s = timeline.status
    assert s(11, "a", 3500).state == "resident_here"  # one of two copies left
    assert (s(11, "a", 4001).state, s(11, "a", 4001).removed_at) == ("removed_here", datetime.fromtimestamp(4, UTC))
    assert s(11, "a", 4000).state == "resident_here"  # an event at the arrival time has not happened yet
    assert (s(22, "a", 5001).state, s(22, "a", 5001).removed_at) == ("reset_here", datetime.fromtimestamp(5, UTC))
    assert (s(22, "c", 4500).state, s(22, "c", 4500).pod) == ("resident_elsewhere", "a")  # both hold: 'a' first
    assert s(22, "c", 4500, ["b", "c"]).pod == "b"  # a is not a pod of this model
    assert s(22, "c", 5001).pod == "b"  # a's copy went with the reset
    assert s(22, "c", 6000, ["c"]).state == "nowhere"
    # chain 33: stored at 0.5 s, reset at 5 s, then removed twice: a copy was stored again unseen after the reset
    assert s(33, "a", 6500).state == "resident_here"
    assert s(33, "a", 7001).state == "removed_here" and s(33, "a", 5500).state == "resident_here"
    assert s(44, "a", 9000).state == "nowhere"
    # resident at arrival, its last copy gone before the request ended: evicted while it waited
    assert s(11, "a", 3500, end_ms=3999).state == "resident_here"
    assert (s(11, "a", 3500, end_ms=4000).state, s(11, "a", 3500, end_ms=4000).removed_at) == (
        "removed_here", datetime.fromtimestamp(4, UTC))


def test_cli_attributes_with_and_without_kv_evidence(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvscope attribute --once` uses the KV evidence; `--no-kv-evidence` on a store without answers does not."""
    from click.testing import CliRunner

    from kvscope.cli import main

    monkeypatch.setenv("KVSCOPE_DEFAULT_BLOCK_SIZE", "32")
    build(store, 32)
    args = ["--data-dir", store.dsn.removeprefix("chdb://"), "--database", store.database]
    for flag, want in (("--no-kv-evidence", ("inferred", "", None)), ("--kv-evidence", ("kv_events", "2-a", at(4)))):
        store.command("TRUNCATE TABLE request_attribution")
        store.command("TRUNCATE TABLE attribution_watermark")
        result = CliRunner().invoke(main, ["attribute", "--once", flag, *args])
        assert result.exit_code == 0, result.output
        assert answers(store)["s2"][1:] == want


def test_kv_events_that_arrive_late_re_answer_what_they_change(store: Store) -> None:
    """s12 is answered before any KV event is stored (no predecessor: cold); then the events arrive, late (their
    ts long before their ingestion: 12-b held the prefix at s12's arrival): the next run re-answers s12 as
    routed_away to 12-b, and a run after that changes nothing."""
    b = 32
    sys_ids = tokens(12, N * b)
    insert_requests(store, [
        gw("s12-other", 12, t=0.2, pod="12-b", prompt_ids=None, b=b, prompt=50, tenant="other", system="x",
           system_tokens=40, suffix_tokens=10),
        gw("s12", 12, t=5, pod="12-a", prompt_ids=sys_ids + tokens(12, 10, 1), b=b, prompt=N * b + 10,
           system_tokens=N * b, suffix_tokens=10)])
    attribution_job.run_attribution(store, settle_seconds=0, default_block_size=b)
    assert answers(store)["s12"] == ([("cold", "", N * b), ("unavoidable", "", 10)], "fingerprints", "", None)
    ingest(store, collect([frames("12-a", 0, 0.5, stored(tokens(12, b, 9), b, 12_900)),
                           frames("12-b", 0, 1, stored(sys_ids, b, 12_000))]))
    stats = attribution_job.run_attribution(store, settle_seconds=0, default_block_size=b)
    assert answers(store)["s12"] == ([("routed_away", "", N * b), ("unavoidable", "", 10)], "kv_events", "12-b",
                                     None)
    assert (stats.arrivals, stats.changed) == (0, 1)
    assert attribution_job.run_attribution(store, settle_seconds=0, default_block_size=b).changed == 0



def test_blocks_stored_under_one_cache_salt_are_not_resident_for_another(store: Store) -> None:
    """Pod s-a stored a prompt's 8 blocks under cache_salt A (BlockStored extra_keys [(A,), None, ...], as vLLM
    publishes them). The same prompt's chain under salt A matches them (a miss there is a race: unknown /
    resident_at_arrival); under salt B it matches nothing: the conversation's next turn sent with salt B is
    prefix_drift / cache_salt_changed and the same prompt outside the conversation is cold, neither of them
    unknown / resident_at_arrival (what kvscope said when its chains ignored the salt)."""
    b, scenario = 32, 20
    ids = tokens(scenario, N * b)
    salt_a, salt_b = "tenant-a-secret", "tenant-b-secret"
    event = {**stored(ids, b, 20_000), "extra_keys": [[salt_a]] + [None] * (N - 1)}
    ingest(store, collect([frames("s-a", 0, 1, event)]))

    def row(rid: str, salt: str, *, t: float, conv: str = "", tenant: str = "") -> dict[str, Any]:
        r = gw(rid, scenario, t=t, pod="s-a", prompt_ids=None, b=b, prompt=N * b + 20, conv=conv, tenant=tenant,
               system_tokens=N * b, suffix=rid, suffix_tokens=20)
        salt_hash = h("salt" + salt)
        return {**r, "cache_salt_hash": salt_hash, "prompt_fingerprint": h(r["prompt_fingerprint"] + salt_hash),
                "system_norm_hash": h(r["system_norm_hash"] + salt_hash),
                "prompt_block_hashes": chain_hashes(ids + tokens(scenario, 20, 1), b, cache_salt=salt),
                "prompt_block_size": b}

    insert_requests(store, [
        {**row("c-1", salt_a, t=0.5, conv="c20"), "prompt_block_hashes": [], "prompt_block_size": 0},
        row("c-2", salt_b, t=10, conv="c20"),
        row("x-b", salt_b, t=11, tenant="other"),
        row("x-a", salt_a, t=12, tenant="other"),
    ])
    attribution_job.run_attribution(store, default_block_size=b)
    got = answers(store)
    assert got["x-a"][0][0] == ("unknown", "resident_at_arrival", N * b) and got["x-a"][1] == "kv_events"
    assert got["c-2"][0] == [("prefix_drift", "cache_salt_changed", N * b), ("unavoidable", "", 20)]
    assert got["x-b"][0] == [("cold", "", N * b), ("unavoidable", "", 20)]
    assert got["c-2"][1] == got["x-b"][1] == "kv_events"


def test_blocks_of_the_base_model_are_not_resident_for_a_lora_adapter(store: Store) -> None:
    """vLLM keys a LoRA adapter into every block's hash: an adapter never reuses the base model's blocks of the same
    tokens, nor the base model the adapter's. Pod l-a stored a prompt's 8 blocks for the base model (m21): the same
    prompt sent to adapter ad-1 on that pod is cold (its chain is rooted at the adapter, as the collector roots the
    adapter's own BlockStored blocks), not unknown / resident_at_arrival as when chains ignored the adapter. Once
    the pod stored the prompt for ad-1 (lora_name on the event), a later ad-1 request that missed finds them (a
    race: resident_at_arrival), and a base-model request still does not see ad-1's blocks as anything but its own."""
    b, scenario = 32, 21
    ids = tokens(scenario, N * b)
    suffix = tokens(scenario, 20, 1)
    base_event = stored(ids, b, 21_000)
    lora_event = {**stored(ids, b, 22_000), "lora_name": "ad-1", "lora_id": 1, "extra_keys": [["ad-1"]] * N}
    ingest(store, collect([frames("l-a", 0, 1, base_event), frames("l-a", 1, 15, lora_event)]))

    def row(rid: str, model: str, *, t: float) -> dict[str, Any]:
        r = gw(rid, scenario, t=t, pod="l-a", prompt_ids=None, b=b, prompt=N * b + 20, tenant=f"t-{rid}",
               system_tokens=N * b, suffix=rid, suffix_tokens=20)
        lora = None if model == "m21" else model
        return {**r, "model": model, "prompt_block_hashes": chain_hashes(ids + suffix, b, lora_name=lora),
                "prompt_block_size": b}

    insert_requests(store, [row("lora-1", "ad-1", t=10), row("lora-2", "ad-1", t=20), row("base-1", "m21", t=21)])
    attribution_job.run_attribution(store, default_block_size=b)
    got = answers(store)
    assert got["lora-1"][0] == [("cold", "", N * b), ("unavoidable", "", 20)] and got["lora-1"][1] == "kv_events"
    assert got["lora-2"][0][0] == ("unknown", "resident_at_arrival", N * b) and got["lora-2"][1] == "kv_events"
    assert got["base-1"][0][0] == ("unknown", "resident_at_arrival", N * b)  # its own blocks, stored at t=1


def test_the_rows_read_counter_counts_each_chunks_read_of_the_log(store: Store) -> None:
    """kvscope_attribution_kv_log_rows_read_total: every kv_block_log row (stored or removed) of the blocks the
    requests missed, counted once per chunk that reads it: derived here from the store's own rows (pods hashing
    as vLLM does, so a block's chain hash is its vLLM hash), once with one chunk and once with a chunk per
    request, where a block missed by two chunks is read, and counted, twice."""
    from prometheus_client import REGISTRY

    def read() -> float:
        return REGISTRY.get_sample_value("kvscope_attribution_kv_log_rows_read_total") or 0.0

    HASHING["mode"] = "default"
    try:
        build(store, 32)
    finally:
        HASHING["mode"] = "own"
    # s1's prompt again, later and on the same pod: the same missed blocks, in another chunk when chunks are small
    insert_requests(store, [gw("s1-again", 1, t=7, pod="1-a", prompt_ids=tokens(1, N * 32) + tokens(1, 10, 1), b=32,
                               prompt=N * 32 + 10, system_tokens=N * 32, suffix_tokens=10)])
    missed = ("arraySlice(prompt_block_hashes, intDiv(ifNull(cached_tokens, 0), prompt_block_size) + 1, "
              "greatest(0, intDiv(toInt64(prompt_tokens) - 1, prompt_block_size) "
              "- intDiv(ifNull(cached_tokens, 0), prompt_block_size)))")
    rows_of = ("SELECT count() FROM kv_block_log WHERE kind IN ('stored', 'removed') AND block_hash IN "
               f"(SELECT arrayJoin({missed}) FROM gateway_requests WHERE prompt_block_size > 0 {{where}})")
    whole = store.query_rows(rows_of.format(where=""))[0][0]
    per_request = sum(store.query_rows(rows_of.format(where="AND request_id = {r:String}"), {"r": r})[0][0]
                      for (r,) in store.query_rows("SELECT request_id FROM gateway_requests"))
    assert 0 < whole < per_request  # some missed blocks are missed by several requests
    n = store.query_rows("SELECT count() FROM gateway_requests")[0][0]
    before = read()
    attribution_job.run_attribution(store, default_block_size=32, chunk_size=n)
    assert read() - before == whole
    store.command("TRUNCATE TABLE request_attribution")
    store.command("TRUNCATE TABLE attribution_watermark")
    before = read()
    attribution_job.run_attribution(store, default_block_size=32, chunk_size=1)
    assert read() - before == per_request


def test_a_pod_hashing_its_own_way_is_found_beside_pods_with_the_default_hashing(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod oh-d publishes vLLM's default hashes (equal to kvscope's chain hashes), pod oh-o its own: only oh-o is in
    kv_pod_hashing as hashing its own way, so only its stored rows are looked up by chain hash. Both still hold
    evidence: a request on oh-x missing oh-d's prompt is routed_away to oh-d, one missing oh-o's prompt routed_away
    to oh-o."""
    b, scenario = 32, 23
    first, second, other = tokens(scenario, N * b, 1), tokens(scenario, N * b, 2), tokens(scenario, N * b, 3)
    monkeypatch.setitem(HASHING, "mode", "default")
    on_d = frames("oh-d", 1, 1, stored(first, b, 23_000))
    monkeypatch.setitem(HASHING, "mode", "own")
    on_o = frames("oh-o", 1, 1, stored(second, b, 23_100))
    on_x = frames("oh-x", 1, 1, stored(other, b, 23_200))
    ingest(store, collect([on_d, on_o, on_x]))
    assert kv_evidence.own_hashing_pods(store) == ["oh-o", "oh-x"]
    assert store.query_rows("SELECT pod, max(own_hashing) FROM kv_pod_hashing GROUP BY pod ORDER BY pod") == [
        ("oh-d", 0), ("oh-o", 1), ("oh-x", 1)]

    def row(rid: str, ids: list[int], pod: str, t: float) -> dict[str, Any]:
        return gw(rid, scenario, t=t, pod=pod, prompt_ids=ids + tokens(scenario, 20, 9), b=b, prompt=N * b + 20,
                  system=rid, system_tokens=N * b, suffix=rid, suffix_tokens=20, tenant=f"t-{rid}")

    insert_requests(store, [row("d0", first, "oh-d", 0.5), row("o0", second, "oh-o", 0.5),
                            row("x1", first, "oh-x", 10), row("x2", second, "oh-x", 11)])
    attribution_job.run_attribution(store, default_block_size=b)
    got = answers(store)
    assert got["x1"] == ([("routed_away", "", N * b), ("unavoidable", "", 20)], "kv_events", "oh-d", None)
    assert got["x2"] == ([("routed_away", "", N * b), ("unavoidable", "", 20)], "kv_events", "oh-o", None)
