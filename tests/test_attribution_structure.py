"""Structural signals (issue 9): a system prompt line that changes on every request in a form no regex mask
knows, drift in the middle of a system prompt, and retrieved documents inside the user message reordered or
replaced, each with exact token counts derived by hand at B = 64, answered by the real attribution job on chDB
(gateway_requests → request_attribution) and by the in-memory reference alike. Negative controls: unrelated new
user messages stay unavoidable; a system prompt that really changed stays system_changed.

Segment token counts sum to prompt_tokens, so positions are exact (no scaling); L = floor((P − 1)/64)·64."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_attribution import h, req, split
from test_attribution_job import attributed, insert_requests, run

from gateway.normalize import mask_volatile
from ingest import attribution as a
from tests.clock import DAY

B = 64
LINE = 40  # tokens of every system line below
BASE_LINES = [f"Policy rule {i}: answer within the scope of the product." for i in range(8)]


def to_store(r: dict[str, Any]) -> dict[str, Any]:
    """A req() row as gateway_requests holds it: structural hashes as UInt64, an ingested_at the job picks up."""
    out = {**r, "ingested_at": datetime.now(UTC) - timedelta(minutes=1)}  # within the job's window, whenever run
    for key in (a.LINE_HASHES, a.CHUNK_HASHES):
        out[key] = [int(x, 16) for x in r[key]]
    return out


def both(store, *requests: dict[str, Any]) -> dict[str, list[tuple[str, str, int]]]:
    """Per request: the job's answer (chDB) after checking it equals the reference's."""
    insert_requests(store, [to_store(r) for r in requests])
    run(store, default_block_size=B)
    got = attributed(store)
    reference = a.attribute(list(requests), default_block_size=B)
    out = {}
    for r in requests:
        rid = r["request_id"]
        job = sorted((c, s, t) for i, c, s, t, *_ in got if i == rid)
        assert job == sorted(split(reference, rid)), rid
        out[rid] = split(reference, rid)  # prompt order
    return out


def system_request(rid: str, lines: list[str], *, at: float, cached: int = 0, **kw: Any) -> dict[str, Any]:
    """8 system lines of 40 tokens (320) and a 40-token question: P = 360, L = 320. The normalized hash is the
    real mask over the text, so a form the masks miss leaves it different."""
    text = "\n".join(lines)
    args: dict[str, Any] = dict(at=at, cached=cached, system=text, system_norm=mask_volatile(text), system_tokens=320,
                                prompt=360, suffix=f"q-{rid}", suffix_tokens=40, lines=lines,
                                line_tokens=[LINE] * len(lines))
    args.update(kw)
    return req(rid, **args)


def with_line(i: int, value: str, lines: list[str] = BASE_LINES) -> list[str]:
    return [value if j == i else line for j, line in enumerate(lines)]


# -- volatile content the masks do not know --------------------------------------------------------------------
@pytest.mark.parametrize("form", ["trace: 7f3a91c2e0b4{}", "ticket #A-{}-ZZ"])
def test_an_unknown_volatile_line_is_volatile_system_at_that_line_not_cold(store, form):
    """Line 2 (tokens 80..120) carries a value that changes per request, in a form the regexes miss (the
    normalized hash differs too). r1 has no predecessor: its 320-token system prompt is cold. r2 and r3 find the
    previous request by the unchanged half of the lines; pod-a still held the first block (lines 0–1 are equal,
    cached 64): the drift runs from the changed line to the end of the system prompt, [64, 320) = 256 tokens
    volatile_system (its partial block [64, 80) included, the change broke it), the question 40 unavoidable.
    Before: cold 256 + unavoidable 40 (no predecessor found)."""
    values = [form.format(n) for n in (11, 19, 23)]
    assert len({mask_volatile(v) for v in values}) == 3  # no mask knows the form
    r1, r2, r3 = (system_request(f"r{i + 1}", with_line(2, v), at=5.0 * i, cached=64 if i else 0)
                  for i, v in enumerate(values))
    got = both(store, r1, r2, r3)
    assert got["r1"] == [("cold", "", 320), ("unavoidable", "", 40)]
    assert got["r2"] == got["r3"] == [("prefix_drift", "volatile_system", 256), ("unavoidable", "", 40)]
    kinds = dict(store.query_rows("SELECT request_id, predecessor_request_id FROM request_attribution FINAL"))
    assert (kinds["r2"], kinds["r3"]) == ("r1", "r2")


def test_the_volatile_line_lower_down_leaves_the_lines_before_it_to_the_reusable_cause(store):
    """The changing line is line 6 (tokens 240..280); r2 ran on pod-b (nothing cached): [0, 192) routed_away (the
    full blocks before the change), [192, 320) volatile_system 128, the question unavoidable 40."""
    r1 = system_request("r1", with_line(6, "ref: Zq-0091"), at=0)
    r2 = system_request("r2", with_line(6, "ref: Kx-7314"), at=5, pod="pod-b")
    assert both(store, r1, r2)["r2"] == [("routed_away", "", 192), ("prefix_drift", "volatile_system", 128),
                                         ("unavoidable", "", 40)]


def test_drift_in_the_middle_of_the_system_prompt_is_placed_at_its_line(store):
    """Turn 2 of a conversation rewrote lines 5–7 (3 of 8: more than the quarter a volatile change may touch):
    system_changed, placed at line 5 (200 tokens), not at token 0. Turn 2 = system 320 + turn 1's question and
    reply 60 + a new question 40 = 420; pod-a hit the blocks before the change (192). Turn 1's whole prompt
    (360) would have been reusable: [192, 320) system_changed 128, [320, 420) unavoidable 100."""
    t1 = system_request("t1", BASE_LINES, at=0, conv="c1")
    changed = BASE_LINES[:5] + ["Rewritten rule A.", "Rewritten rule B.", "Rewritten rule C."]
    t2 = system_request("t2", changed, at=5, conv="c1", cached=192, prompt=420, history="q-t1|reply",
                        prev_history="", history_tokens=60)
    assert both(store, t1, t2)["t2"] == [("prefix_drift", "system_changed", 128), ("unavoidable", "", 100)]


def test_a_system_prompt_that_really_changed_stays_system_changed(store):
    """Negative controls. In a conversation, 7 of 8 lines rewritten from line 0: system_changed from token 0,
    as before (320 + 100 unavoidable). Another request of the tenant whose last 4 lines changed shares the
    first half of the lines (a band key matches) but 4 > 2 lines differ: no predecessor, cold."""
    t1 = system_request("t1", BASE_LINES, at=0, conv="c1")
    rewritten = [f"New rule {i}." for i in range(7)] + BASE_LINES[7:]
    t2 = system_request("t2", rewritten, at=5, conv="c1", prompt=420, history="q-t1|reply", history_tokens=60)
    half = BASE_LINES[:4] + [f"Other rule {i}." for i in range(4)]
    other = system_request("o1", half, at=10)
    got = both(store, t1, t2, other)
    assert got["t2"] == [("prefix_drift", "system_changed", 320), ("unavoidable", "", 100)]
    assert got["o1"] == [("cold", "", 320), ("unavoidable", "", 40)]


# -- retrieval documents inside the user message ---------------------------------------------------------------
def rag_request(rid: str, chunks: list[str], chunk_tokens: list[int], *, at: float, cached: int = 0,
                **kw: Any) -> dict[str, Any]:
    """A 128-token system prompt (2 lines: no band keys) and a user message of chunks: P = 128 + Σ chunks."""
    suffix = sum(chunk_tokens)
    return req(rid, at=at, cached=cached, system="Answer from the documents.", system_tokens=128,
               prompt=128 + suffix, suffix="|".join(chunks), suffix_tokens=suffix, chunks=chunks,
               chunk_tokens=chunk_tokens, lines=["Answer from the", "documents."], line_tokens=[64, 64], **kw)


DOCS = {"A": 100, "B": 100, "C": 100, "D": 100, "E": 150, "G": 150}


def docs(*names: str, question: str = "Q", q_tokens: int = 20) -> tuple[list[str], list[int]]:
    return [*names, question], [*(DOCS[n] for n in names), q_tokens]


def test_documents_reordered_inside_the_user_message_are_rag_reordered(store):
    """r1: docs A, B, C and a question; r2: A, C, B and another question (P = 448, L = 384). A is the common
    prefix (shared to 228; pod-a hit 192); C and B were in r1's message: [192, 384) rag_reordered 192; the
    question and the last partial block [384, 448) unavoidable 64. Before: all 256 missed were unavoidable."""
    r1 = rag_request("r1", *docs("A", "B", "C", question="Q1"), at=0)
    r2 = rag_request("r2", *docs("A", "C", "B", question="Q2"), at=5, cached=192)
    assert both(store, r1, r2)["r2"] == [("prefix_drift", "rag_reordered", 192), ("unavoidable", "", 64)]


def test_a_document_replaced_inside_the_user_message_is_rag_changed(store):
    """r2: D, B, C (A replaced by D, B and C stayed): no common chunk prefix (shared = the system prompt, 128,
    hit); B and C known, D new but in between: [128, 384) rag_changed 256, the rest unavoidable 64."""
    r1 = rag_request("r1", *docs("A", "B", "C", question="Q1"), at=0)
    r2 = rag_request("r2", *docs("D", "B", "C", question="Q2"), at=5, cached=128)
    assert both(store, r1, r2)["r2"] == [("prefix_drift", "rag_changed", 256), ("unavoidable", "", 64)]


def test_new_documents_after_the_shared_ones_and_the_question_stay_unavoidable(store):
    """r2: A, B, D: A and B are the common prefix (shared to 328: pod-a hit 320); D is new content after
    them, nothing known follows it: no drift; [320, 448) unavoidable 128."""
    r1 = rag_request("r1", *docs("A", "B", "C", question="Q1"), at=0)
    r2 = rag_request("r2", *docs("A", "B", "D", question="Q2"), at=5, cached=320)
    assert both(store, r1, r2)["r2"] == [("unavoidable", "", 128)]


CONTROLS = {  # name: (chunks, chunk tokens, missed tokens, all unavoidable)
    "a plain question": (["Q2"], [40], 40),
    "two new paragraphs and a question": (*docs("E", "G", question="Q3"), 320),
    "new paragraphs repeating one document": (*docs("E", "G", "A", question="Q4"), 420),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_unrelated_new_user_messages_stay_unavoidable(store, control):
    """Negative controls, each after r1 (A, B, C, Q1) on the same pod with the system prompt hit (128): a plain
    question (one chunk, P = 168); two new paragraphs and a question (P = 448); new paragraphs that repeat one of
    r1's documents among them (E 150, G 150, then A 100: the known share, 100 of 400, is under half: a repeat by
    chance, not moved context; P = 548). All their missed tokens are unavoidable."""
    chunks, tokens, missed = CONTROLS[control]
    r1 = rag_request("r1", *docs("A", "B", "C", question="Q1"), at=0)
    assert both(store, r1, rag_request("n1", chunks, tokens, at=5, cached=128))["n1"] == [("unavoidable", "", missed)]


def test_the_reference_helpers_on_hand_made_lists():
    """suffix_chunk_drift and the line rule on lists, by hand."""
    r1 = {a.CHUNK_HASHES: [h("A"), h("B"), h("C"), h("Q")], a.CHUNK_TOKENS: [20, 20, 20, 5]}
    r2 = {a.CHUNK_HASHES: [h("A"), h("C"), h("B"), h("Q")], a.CHUNK_TOKENS: [20, 20, 20, 5]}
    assert a.suffix_chunk_drift(r2, r1) == (20, "rag_reordered", 60)
    r3 = {a.CHUNK_HASHES: [h("A"), h("C"), h("Q")], a.CHUNK_TOKENS: [20, 20, 5]}  # B dropped: changed
    assert a.suffix_chunk_drift(r3, r1) == (20, "rag_changed", 40)
    # a separator (8 tokens) the only known chunk: under a block, no document moved (new content)
    framed = {a.CHUNK_HASHES: [h("A"), h("-"), h("B"), h("Q")], a.CHUNK_TOKENS: [20, 8, 20, 5]}
    other = {a.CHUNK_HASHES: [h("A"), h("N"), h("-"), h("R")], a.CHUNK_TOKENS: [20, 6, 8, 5]}
    assert a.suffix_chunk_drift(other, framed) == (20, "", 20)
    lines = {a.LINE_HASHES: list("abcdefgh"), a.LINE_TOKENS: [1] * 8}
    two = {a.LINE_HASHES: list("abXdefYh"), a.LINE_TOKENS: [1] * 8}
    three = {a.LINE_HASHES: list("abXdeZYh"), a.LINE_TOKENS: [1] * 8}
    assert (a.lines_volatile(two, lines), a.lines_volatile(three, lines)) == (True, False)
    assert (a.lines_match(lines, lines), a.lines_volatile(lines, lines)) == (True, False)


def test_the_stored_band_keys_follow_the_lines(store, tmp_path):
    """Log lines through `kvscope import gateway-log` (the bulk path): hashes stored as UInt64; the
    MATERIALIZED band keys (migration 0020) of two prompts that differ in line 1 share the tail key only, of a
    prompt that differs in lines 1 and 6 share none, and a 2-line prompt has none."""
    import json

    from ingest.bulk import load_gateway_log

    lines = [h(x) for x in BASE_LINES]

    def line(rid: str, hashes: list[str]) -> str:
        return json.dumps({"log_version": 1, "request_id": rid, "ts": f"{DAY}T12:00:00.000Z", "tenant_id": "acme",
                           "model": "tiny", "status": 200, "prompt_tokens": 10, "cached_tokens": 0, "ttft_ms": 1.0,
                           "e2e_ms": 2.0, "system_line_hashes": hashes, "system_line_tokens": [1] * len(hashes)})

    path = tmp_path / "gw.jsonl"
    path.write_text("\n".join([line("base", lines), line("one", with_line(1, h("x"), lines)),
                               line("two", with_line(6, h("y"), with_line(1, h("x"), lines))),
                               line("short", lines[:2])]) + "\n")
    assert load_gateway_log(store, path).rows == 4
    stored = dict(store.query_rows("SELECT request_id, system_line_hashes FROM gateway_requests"))
    assert stored["base"] == [int(x, 16) for x in lines]
    keys = {rid: {k["kind"]: k["key"] for k in ks} for rid, ks in store.query_rows(
        "SELECT request_id, predecessor_keys FROM gateway_requests")}
    assert set(keys["base"]) == {7, 8} and keys["short"] == {}
    assert (keys["one"][7] != keys["base"][7], keys["one"][8] == keys["base"][8]) == (True, True)
    assert keys["two"][7] != keys["base"][7] and keys["two"][8] != keys["base"][8]
