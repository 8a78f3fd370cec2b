"""Hostile histories for precise mode's memo (ingest/kv_evidence.py ``KvMemo``, ingest/kv_tracks.py ``summarize``)
on real chDB, KV events fed the production way (ZMQ frames → collector → queue → ingester → kv_block_log): each
case runs the attribution job in small chunks with the memo (every block hash kept from its first row, or from the
default count) and without it (no hash ever hot), and the answers must be identical. Each story is told in its
test; the cases are the ones a memo carried from chunk to chunk could get wrong: a chunk that reads nothing new,
resets and restarts at a cut's millisecond, requests in the cut's millisecond, removals of copies stored before
the evidence (also after a cut, taking the count below what was summarized), several engines and media, a pod that
hashes its blocks its own way beside pods with vLLM's default hashing, and a lookback that passes the memo's rows."""

from __future__ import annotations

import random
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


def request(rid: str, scenario: int, t: float, pod: str, prompt_ids: list[int], cached: int | None = 0,
            **fields: Any) -> dict[str, Any]:
    """A gateway_requests row that missed its whole prompt (N blocks and 20 tokens) but ``cached`` tokens
    (None: not reported) unless ``fields`` (columns) say otherwise."""
    row = gw(rid, scenario, t=t, pod=pod, prompt_ids=prompt_ids + tokens(scenario, 20, 50), b=B, prompt=N * B + 20,
             tenant=f"t-{rid}", system_tokens=N * B, suffix=rid, suffix_tokens=20)
    return {**row, "cached_tokens": cached, **fields}


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



def same_answers_with_evictions_and_routing(store: Store, monkeypatch: pytest.MonkeyPatch,
                                            rows: list[dict[str, Any]]) -> None:
    """Insert ``rows`` and attribute them with and without the memo: the same answers, among which evictions and
    requests routed away (so the history reaches the memo's hard cases)."""
    insert_requests(store, rows)
    with_memo, without = both_ways(store, monkeypatch)
    causes = {c for causes, *_ in without.values() for c, _, _ in causes}
    assert {"evicted", "routed_away"} <= causes, without
    assert with_memo == without

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
    same_answers_with_evictions_and_routing(store, monkeypatch, rows)


def test_removals_after_a_cut_of_copies_stored_before_the_evidence(store: Store,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod r-a churned the prompt (hot) and ends holding one copy of each block by its events; after the first
    chunk's cut it removes blocks 1-5 three times (12 s, 13 s, 16 s): two removals more than it stored, so it held
    copies stored before the evidence began, and every count before the cut is more than the one summarized said
    (the lowest point moves below the one kept, and a departure before the cut is no longer one). Requests on r-a
    and r-b before, between and after those removals. A removal on r-b of blocks it never stored in the window
    (copies stored before the evidence) and rows written twice (batches delivered again) come along."""
    scenario = 82
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    msgs = (_churn("r-a", prompt, names, 1, 4)
            + [frames("r-b", 1, 0.5, remove_event(names[3:])),
               frames("r-b", 2, 0.75, store_event(tokens(scenario, B, 9), chain_hashes(tokens(scenario, B, 9), B))),
               frames("r-a", 20, 12.0, remove_event(names[1:])), frames("r-a", 21, 13.0, remove_event(names[1:])),
               frames("r-a", 22, 16.0, remove_event(names[1:]))])
    ingest(store, collect(msgs))
    ingest(store, collect(msgs[2:5] + msgs[-2:]))  # delivered again: rows written twice
    times = [9.5 + 0.05 * i for i in range(8)] + [10.0, 12.0, 12.0, 13.0, 14, 15, 16.0, 16.0, 17, 20, 21, 30]
    rows = [serving(scenario, p) for p in ("r-a", "r-b")] + [
        request(f"r{i}", scenario, t, ("r-a", "r-b")[i % 2], prompt) for i, t in enumerate(times)]
    same_answers_with_evictions_and_routing(store, monkeypatch, rows)


def test_a_pod_hashing_its_own_way_and_a_short_lookback_in_the_same_run(store: Store,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pods o-a and o-b hash as vLLM does by default; o-a churns the prompt (hot there) from 1 s to 5 s and again
    from 36 s to 40 s, o-b stores it once at 2 s and drops it at 37 s (cold there: the same hashes). Pod o-c
    hashes its own way (vLLM hashes 7 000 000 + j) and holds the prompt from 28 s to 29 s: the chunks whose evidence
    window reaches those rows read the log in two passes, without the memo, and the memo starts again from what
    they read, which the later ones, back to one pass, use. The evidence window is 20 s (lookback and horizon), so it
    passes the first burst's rows within the run: the memo starts again empty there. Requests on all three pods
    from 6 s to 60 s."""
    scenario = 83
    prompt = tokens(scenario, N * B)
    names = chain_hashes(prompt, B)
    own = [7_000_000 + j for j in range(N)]
    msgs = (_churn("o-a", prompt, names, 1, 8) + _churn("o-a", prompt, names, 36, 8, seq=100)
            + [frames("o-b", 1, 2.0, store_event(prompt, names)), frames("o-b", 2, 37.0, remove_event(names[2:])),
               frames("o-c", 1, 0.5, store_event(tokens(scenario, B, 9), [6_999_999])),
               frames("o-c", 2, 28.0, store_event(prompt, own)), frames("o-c", 3, 29.0, remove_event(own[3:]))])
    ingest(store, collect(msgs))
    pods = ["o-a", "o-b", "o-c"]
    rows = [serving(scenario, p) for p in pods] + [
        request(f"o{i}", scenario, 6 + i * 1.125, pods[i % 3], prompt, cached=B * (i % 3 == 1)) for i in range(48)]
    insert_requests(store, rows)
    with_memo, without = both_ways(store, monkeypatch, lookback_seconds=20, horizon_seconds=20)
    causes = {c for causes, *_ in without.values() for c, _, _ in causes}
    assert {"evicted", "routed_away"} <= causes, without
    assert with_memo == without


def _hostile_fleet(store: Store, seed: int, *, mixed: bool, busy: float) -> None:
    """Pods h-a (engines 0 and 1), h-b (no data-parallel rank) and h-c (when ``mixed``: hashing its own way, a
    few events of prompt 2 only, which only requests from 60 s on send: the chunks before read the log in one
    pass, the later ones in two) storing, removing (also blocks they never stored),
    clearing and restarting (a batch with seq 0) the blocks of 3 prompts on GPU and CPU over 100 s, on a 125 ms
    grid so that events, resets and arrivals share milliseconds; ``busy``: the share of the span most events fall
    in (a quiet tail: chunks that read little or nothing new). A tenth of the batches delivered twice. 120
    requests: a quarter in the millisecond of another request, a quarter in that of an event; e2e from 0 to
    900 s (the evidence read past the cut), some failed, some with cached_tokens not reported."""
    rnd = random.Random(seed)
    scenario = 90 + seed
    prompts = {f: tokens(scenario, N * B, f) for f in range(3)}
    chains = {f: chain_hashes(prompts[f], B) for f in range(3)}
    pods = ["h-a", "h-b", "h-c"]
    msgs, again, event_times = [], [], []
    for p, pod in enumerate(pods):
        own = mixed and pod == "h-c"
        for rank in ([0, 1] if pod == "h-a" else [None]):
            seq = 0
            n = 6 if own else 60
            times = sorted(round(rnd.uniform(0, 100 * busy if rnd.random() < 0.9 else 100) * 8) / 8
                           for _ in range(n))
            for t in times:
                f, roll, medium = 2 if own else rnd.randrange(3), rnd.random(), rnd.choice(["GPU", "GPU", "CPU"])
                names = [8_000_000 + p * 10_000 + f * 100 + j for j in range(N)] if own else chains[f]
                if roll < 0.5 or roll >= 0.95:
                    seq = 0 if roll >= 0.95 else seq + 1  # a restart: the publisher starts again at seq 0
                    event = store_event(prompts[f], names[: rnd.randint(1, N)], medium)
                elif roll < 0.9:
                    seq += 1
                    k = rnd.randint(0, N - 1)
                    event = remove_event(names[k:rnd.randint(k + 1, N)], medium)
                else:
                    seq += 1
                    event = CLEARED
                msgs.append(frames(pod, seq, t, event, rank=rank))
                event_times.append(t)
                if rnd.random() < 0.1:
                    again.append(msgs[-1])
    ingest(store, collect(msgs))
    ingest(store, collect(again))
    rows, times = [serving(scenario, p) for p in pods], []
    for i in range(120):
        roll = rnd.random()
        t = (rnd.choice(times) if times and roll < 0.25 else rnd.choice(event_times) if roll < 0.5
             else round(rnd.uniform(2, 100) * 8) / 8)
        times.append(t)
        f = rnd.randrange(3 if t >= 60 or not mixed else 2)
        rows.append(request(f"h{seed}-{i}", scenario, t, rnd.choice(pods), prompts[f],
                            cached=rnd.choice([0, 0, B, 3 * B]) if rnd.random() > 0.05 else None,
                            status=500 if rnd.random() < 0.05 else 200,
                            e2e_ms=rnd.choice([100.0, 100.0, 2000.0, 30000.0, 900000.0, 0.0])))
    insert_requests(store, rows)


@pytest.mark.parametrize(("seed", "mixed", "busy", "job"), [
    (11, True, 0.4, {}),
    (13, False, 0.3, {"lookback_seconds": 40, "horizon_seconds": 20}),
])
def test_hostile_fleets_get_the_same_answers_with_and_without_the_memo(
        store: Store, monkeypatch: pytest.MonkeyPatch, seed: int, mixed: bool, busy: float, job: dict) -> None:
    """Generated hostile histories (:func:`_hostile_fleet`), the job in chunks of 8: identical answers with the
    memo (every hash kept from its first row; in the second case from its third, with a 40 s evidence window
    and at most 40 stand-in rows, so that the memo also starts again for the window and for its size) and
    without it."""
    _hostile_fleet(store, seed, mixed=mixed, busy=busy)
    if not mixed:
        monkeypatch.setattr(kv_evidence, "MEMO_MAX_ROWS", 40)
    with_memo, without = both_ways(store, monkeypatch, hot=1 if mixed else 3, **job)
    judged = [v for v in without.values() if v[1] == "kv_events"]
    assert len(judged) > 80
    causes = {c for causes, *_ in judged for c, _, _ in causes}
    assert {"evicted", "routed_away", "cold"} <= causes, causes
    assert with_memo == without
