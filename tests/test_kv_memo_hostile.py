"""Hostile histories for precise mode's memo (ingest/kv_evidence.py ``KvMemo``, ingest/kv_tracks.py ``summarize``)
on real chDB, KV events fed the production way (ZMQ frames → collector → queue → ingester → kv_block_log): each
case runs the attribution job in small chunks with the memo (every block hash kept from its first row, or from the
default count) and without it (no hash ever hot), and the answers must be identical. Each story is told in its
test; the cases are the ones a memo carried from chunk to chunk could get wrong: a chunk that reads nothing new,
resets and restarts at a cut's millisecond, requests in the cut's millisecond, removals of copies stored before
the evidence (also after a cut, taking the count below what was summarized), several engines and media, a pod that
hashes its blocks its own way beside pods with vLLM's default hashing, and a lookback that passes the memo's rows."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY
from test_attribution_job import insert_requests
from test_attribution_precise import answers, at, gw, tokens
from test_kv_residency import collect, ingest

from ingest import attribution_job, kv_evidence
from ingest.store import Store
from kvscope.block_hash import chain_hashes

B = 32
N = 6


def frames(pod: str, seq: int, t: float, *events: dict[str, Any], rank: int | None = 0) -> list[bytes]:
    """One vLLM KV-event message of ``pod``'s engine ``rank`` (None: no data-parallel rank) at ``t`` s."""
    return [pod.encode(), seq.to_bytes(8, "big"), msgspec.msgpack.encode([at(t).timestamp(), list(events), rank])]


def store_event(toks: list[int], names: list[int], medium: str = "GPU") -> dict[str, Any]:
    """BlockStored of the full blocks of ``toks`` under the vLLM hashes ``names`` (as many as blocks)."""
    return {"type": "BlockStored", "block_hashes": names, "parent_block_hash": None,
            "token_ids": toks[: len(names) * B], "block_size": B, "lora_id": None, "medium": medium}


def remove_event(names: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": names, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}


def request(rid: str, scenario: int, t: float, pod: str, prompt_ids: list[int], **fields: Any) -> dict[str, Any]:
    """A gateway_requests row that missed its whole prompt (N blocks and 20 tokens) unless ``fields`` say."""
    row = gw(rid, scenario, t=t, pod=pod, prompt_ids=prompt_ids + tokens(scenario, 20, 50), b=B, prompt=N * B + 20,
             tenant=f"t-{rid}", system_tokens=N * B, suffix=rid, suffix_tokens=20)
    return {**row, **fields}


def serving(scenario: int, pod: str, t: float = 0.1) -> dict[str, Any]:
    """A request without a chain that makes ``pod`` a pod of model m<scenario> (its holdings count elsewhere)."""
    return gw(f"serving-{pod}", scenario, t=t, pod=pod, prompt_ids=None, b=B, prompt=50, tenant=f"s-{pod}",
              system=pod, system_tokens=40, suffix_tokens=10)


def _rows_read() -> float:
    return REGISTRY.get_sample_value("kvscope_attribution_kv_log_rows_read_total") or 0.0


def both_ways(store: Store, monkeypatch: pytest.MonkeyPatch, hot: int = 1, chunk_size: int = 8, **job: Any
              ) -> tuple[dict, dict]:
    """(answers with the memo, every hash kept once it has ``hot`` rows; answers without it), the job run in
    chunks of ``chunk_size`` arrivals each time from scratch. The memo must have saved some reading (else the case
    did not test it)."""
    got, read = [], []
    for min_rows in (hot, 10**9):
        monkeypatch.setattr(kv_evidence, "MEMO_MIN_ROWS", min_rows)
        for table in ("request_attribution", "attribution_watermark"):
            store.command(f"TRUNCATE TABLE {table}")
        before = _rows_read()
        attribution_job.run_attribution(store, settle_seconds=0, default_block_size=B, chunk_size=chunk_size, **job)
        read.append(_rows_read() - before)
        got.append(answers(store))
    assert read[0] < read[1], read
    return got[0], got[1]


def test_a_chunk_that_reads_no_row_after_the_cut_still_sees_the_kept_blocks(store: Store,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod q-a stored and evicted a prompt's blocks five times in its first 5 s and then kept them (each block hash
    has 10 rows: hot at the default count); pod q-b, which logs KV events of its own, serves that prompt in two
    chunks of 8, at 10 s and at 20 s: every one is routed_away (q-a held it). Nothing was logged for those blocks
    after the first chunk, so the second chunk's read (from the cut on) finds no row at all: the kept stand-ins are
    all its evidence, and must not be dropped with the empty read."""
    scenario = 80
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    msgs = [frames("q-b", 1, 0.5, store_event(tokens(scenario, B, 9), chain_hashes(tokens(scenario, B, 9), B)))]
    for k in range(5):
        msgs += [frames("q-a", 2 * k + 1, 1 + k * 0.5, store_event(prompt, names)),
                 frames("q-a", 2 * k + 2, 1.25 + k * 0.5, remove_event(names))]
    msgs.append(frames("q-a", 11, 4.5, store_event(prompt, names)))
    ingest(store, collect(msgs))
    insert_requests(store, [serving(scenario, "q-a"), *(
        request(f"q{i}", scenario, (10 if i < 8 else 20) + i * 0.01, "q-b", prompt) for i in range(16))])
    with_memo, without = both_ways(store, monkeypatch, hot=kv_evidence.MEMO_MIN_ROWS)
    assert {v[0][0][:2] for k, v in without.items() if k != "serving-q-a"} == {("routed_away", "")}, without
    assert with_memo == without


def _churn(pod: str, prompt: list[int], names: list[int], start: float, times: int, seq: int = 0,
           rank: int | None = 0, medium: str = "GPU") -> list[list[bytes]]:
    """``pod`` storing and evicting ``prompt`` ``times`` times from ``start`` (every 0.25 s), ending stored: each
    block hash gets 2·times + 1 rows (hot)."""
    msgs = []
    for k in range(times):
        msgs += [frames(pod, seq + 2 * k + 1, start + k * 0.5, store_event(prompt, names, medium), rank=rank),
                 frames(pod, seq + 2 * k + 2, start + k * 0.5 + 0.25, remove_event(names, medium), rank=rank)]
    msgs.append(frames(pod, seq + 2 * times + 1, start + times * 0.5, store_event(prompt, names, medium), rank=rank))
    return msgs


def test_resets_and_restarts_at_a_cut_and_between_chunks_on_several_engines_and_media(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod c-a's engine 0 (GPU) and engine 1 (CPU) and pod c-b each churned the prompt's blocks (hot); the first
    chunk's last arrival is at 10.000 s, where c-a's engine 0 clears its cache (AllBlocksCleared at the cut's
    millisecond: not yet happened for that chunk, happened for the next one's later arrivals); the next chunk
    starts with requests in that same millisecond; c-b restarts (a batch with seq 0, storing another prompt)
    between the second and third chunks and engine 1 of c-a evicts its CPU copies then. Requests on every pod and
    on c-x (no copies): resident, reset, evicted and routed_away, the same with and without the memo."""
    scenario = 81
    prompt, other = tokens(scenario, N * B), tokens(scenario, N * B, 7)
    names, other_names = chain_hashes(prompt, B), chain_hashes(other, B)
    msgs = (_churn("c-a", prompt, names, 1, 4) + _churn("c-a", prompt, names, 1.1, 4, rank=1, medium="CPU")
            + _churn("c-b", prompt, names, 1.2, 4)
            + [frames("c-x", 1, 0.5, store_event(other, other_names)),
               frames("c-a", 20, 10.0, CLEARED),
               frames("c-b", 0, 15.0, store_event(other, other_names)),
               frames("c-a", 20, 15.0, remove_event(names[2:], "CPU"), rank=1)])
    ingest(store, collect(msgs))
    pods = ["c-a", "c-b", "c-x"]
    times = [9.3 + 0.1 * i for i in range(7)] + [10.0] * 5 + [10.5, 12, 14, 14.5, 15.0, 15.0, 16, 18, 19, 20, 30]
    rows = [serving(scenario, p) for p in pods] + [
        request(f"c{i}", scenario, t, pods[i % 3], prompt, cached=B * (i % 2)) for i, t in enumerate(times)]
    insert_requests(store, rows)
    with_memo, without = both_ways(store, monkeypatch)
    causes = {c for causes, *_ in without.values() for c, _, _ in causes}
    assert {"evicted", "routed_away"} <= causes, without
    assert with_memo == without
