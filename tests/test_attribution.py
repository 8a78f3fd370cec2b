"""Unit tests of miss-cause attribution (ingest/attribution.py): one case per cause and sub-cause, built by
hand with the numbers of real vLLM 0.32 captures (block size 32; tests/samples:
a 762-token prompt cold = 0 cached, repeated = 736 cached; tool keys reordered after the system prompt = 672
cached of 764; a timestamp first = 0 cached of 784; a 19-token prompt = never cached)."""

from __future__ import annotations

import hashlib
import random
from datetime import timedelta
from typing import Any

import pytest

from ingest import attribution as a
from tests.clock import T0

BLOCK = {"pod-a": 32, "pod-b": 32}


def h(*parts: str) -> str:
    """Like the gateway: first 64 bits of SHA-256 over the parts joined by U+001F; "" for absent."""
    if not any(parts):
        return ""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def req(rid: str, *, at: float = 0.0, tenant: str = "acme", conv: str = "", run: str = "",
        model: str = "tiny", pod: str = "pod-a", prompt: int = 762, cached: int | None = 0, e2e_ms: float = 400.0,
        status: int = 200,
        system: str = "You are the support agent of Acme.", system_norm: str | None = None,
        system_tokens: int = 720, tools: str = "", tools_canonical: str | None = None, tools_tokens: int = 0,
        rag: str = "", rag_set: str | None = None, rag_tokens: int = 0, history: str = "",
        prev_history: str = "", history_tokens: int = 0, suffix: str = "q1", suffix_tokens: int = 22,
        prev_suffix: str = "", next_history: str = "", first_message: str = "", lines: list[str] | None = None,
        line_tokens: list[int] | None = None, chunks: list[str] | None = None, chunk_tokens: list[int] | None = None,
        down: list[str] | None = None, prefill_history: str = "", continue_final: bool = False) -> dict[str, Any]:
    """A gateway_requests row; texts stand for segment contents (hashed here), variants default to the raw.
    ``lines``/``chunks``: the system prompt's lines and the suffix's chunks (texts, hashed here) with their
    token counts (default: none, as an older gateway logs); ``prev_suffix``: the previous turn's final message as
    this request carries it (default: not logged, as an older gateway); ``next_history``: this request's history
    and final message as one history (default: not logged); ``first_message``: the thread's first message (default:
    not logged); ``down``: the pods the gateway found down as it routed the request (default: none);
    ``prefill_history``: the history before this request's last run of assistant messages (default: not logged);
    ``continue_final``: vLLM continued this request's final assistant message (a prefill)."""
    sh, th, rh, hh = h(system), h(tools), h(rag), h(history)
    return {
        "request_id": rid, "ts": T0 + timedelta(seconds=at), "tenant_id": tenant, "conversation_id": conv,
        "agent_run_id": run, "model": model, "pod": pod, "status": status, "prompt_tokens": prompt,
        "cached_tokens": cached, "e2e_ms": e2e_ms,
        "system_hash": sh, "system_norm_hash": h(system if system_norm is None else system_norm),
        "system_tokens": system_tokens,
        "tools_hash": th, "tools_canonical_hash": h(tools if tools_canonical is None else tools_canonical),
        "tools_tokens": tools_tokens,
        "retrieval_pack_hash": rh, "retrieval_set_hash": h(rag if rag_set is None else rag_set),
        "retrieval_tokens": rag_tokens,
        "history_prefix_hash": hh, "prev_history_hash": h(prev_history), "prev_suffix_hash": h(prev_suffix),
        "next_history_hash": h(next_history), "first_message_hash": h(first_message), "history_tokens": history_tokens,
        "suffix_hash": h(suffix), "suffix_tokens": suffix_tokens,
        "prompt_fingerprint": h(sh, th, rh, hh) if any((sh, th, rh, hh)) else "",
        "system_line_hashes": [h(x) or "0" * 16 for x in lines or []], "system_line_tokens": list(line_tokens or []),
        "suffix_chunk_hashes": [h(x) or "0" * 16 for x in chunks or []],
        "suffix_chunk_tokens": list(chunk_tokens or []), "pods_down": list(down or []),
        "prefill_history_hash": h(prefill_history), "continue_final_message": continue_final,
    }


def run(*requests: dict[str, Any], **kw: Any) -> list[a.MissRow]:
    return a.attribute(list(requests), block_size_by_pod=kw.pop("block_size_by_pod", BLOCK), **kw)


def split(rows: list[a.MissRow], rid: str) -> list[tuple[str, str, int]]:
    return [(r.cause, r.sub_cause, r.tokens) for r in rows if r.request_id == rid]


def missed(r: dict[str, Any]) -> int:
    """Tokens the causes must sum to: prompt − cached, or the whole prompt when cached was not reported."""
    return r["prompt_tokens"] - (r["cached_tokens"] or 0)


def check_sum(rows: list[a.MissRow], r: dict[str, Any]) -> None:
    assert sum(t for *_, t in split(rows, r["request_id"])) == missed(r)


# -- one test per cause --------------------------------------------------------------------------------------
def test_cold_first_request():
    # cap-1-cold: 762 tokens, 0 cached; system 720 + suffix 22 scale to a stable prefix of 739 tokens.
    r = req("cap-1-cold")
    rows = run(r)
    assert split(rows, "cap-1-cold") == [("cold", "", 736), ("unavoidable", "", 26)]
    assert rows[0].predecessor_request_id == "" and rows[0].gap_ms is None and rows[0].block_size == 32
    check_sum(rows, r)


def test_fully_hit_request_has_only_unavoidable_tail():
    # cap-2-warm: the same 762-token request again, same pod: 736 cached (last partial block + last token).
    cold, warm = req("cap-1-cold"), req("cap-2-warm", at=5, cached=736)
    rows = run(cold, warm)
    assert split(rows, "cap-2-warm") == [("unavoidable", "", 26)]
    assert rows[-1].predecessor_request_id == "cap-1-cold"
    assert rows[-1].gap_ms == pytest.approx(5000 - 400)
    check_sum(rows, warm)


def turn2(rid: str, pod: str, cached: int, at: float = 3.0) -> dict[str, Any]:
    """Turn 2 of conversation c1: history = turn 1's message and the reply; turn 1 had no history."""
    return req(rid, at=at, conv="c1", pod=pod, prompt=830, cached=cached, history="q1|reply1",
               prev_history="", history_tokens=50, suffix="q2", suffix_tokens=20)


def test_conversation_turn_on_another_pod_is_routed_away():
    t1, t2 = req("t1", conv="c1"), turn2("t2", pod="pod-b", cached=0)
    rows = run(t1, t2)
    # S = turn 1's whole prompt (762) → R = 736 reusable; the rest is turn 1's partial block + the new turn.
    assert split(rows, "t2") == [("routed_away", "", 736), ("unavoidable", "", 94)]
    row = rows[-1]
    assert (row.predecessor_request_id, row.predecessor_pod) == ("t1", "pod-a")
    assert row.gap_ms == pytest.approx(3000 - 400)
    check_sum(rows, t2)


def test_same_pod_cache_lost_is_evicted_before_next_turn_with_gap():
    # The agent waited 45 s on a tool; LRU evicted the chain's tail: only the first 320 tokens still hit.
    t1 = req("t1", conv="c1", e2e_ms=1500.0)
    t2 = turn2("t2", pod="pod-a", cached=320, at=46.5)
    rows = run(t1, t2)
    assert split(rows, "t2") == [("evicted", "evicted_before_next_turn", 416), ("unavoidable", "", 94)]
    assert rows[-1].gap_ms == pytest.approx(45_000)
    check_sum(rows, t2)


def test_a_hit_ending_within_one_block_of_the_estimate_is_the_edge_not_eviction():
    # Seen on real vLLM: segment boundaries are scaled estimates, so the hit can stop one block short of R
    # (704 of R = 736) with nothing evicted; that block is the edge of sharing, not a lost prefix.
    t1 = req("t1", conv="c1")
    t2 = turn2("t2", pod="pod-a", cached=704)
    rows = run(t1, t2)
    assert split(rows, "t2") == [("unavoidable", "", 830 - 704)]
    check_sum(rows, t2)
    # two blocks short is a lost prefix again
    rows = run(t1, turn2("t3", pod="pod-a", cached=672))
    assert split(rows, "t3")[0] == ("evicted", "evicted_before_next_turn", 64)


def test_an_identical_repeat_one_block_short_lost_that_block_not_the_edge():
    """r2 repeats r1's 762-token prompt token for token on r1's pod (every segment and the suffix equal): S is
    exact (762), not a scaled boundary, so a hit of 704 of L = 736 means vLLM's LRU took the tail block (it frees
    a request's last block first): [704, 736) evicted 32, unavoidable 26. Before: the one-block edge tolerance
    read it as the edge of sharing, all 58 unavoidable, which precise mode contradicted on real vLLM. A request
    whose suffix differs keeps the tolerance (its boundary is an estimate)."""
    r1, r2 = req("r1"), req("r2", at=600, cached=704)
    assert split(run(r1, r2), "r2") == [("evicted", "", 32), ("unavoidable", "", 26)]
    other = req("r3", at=600, cached=704, suffix="q2")
    assert split(run(r1, other), "r3") == [("unavoidable", "", 58)]


def test_evicted_without_previous_turn_has_no_flag():
    r1, r2 = req("r1"), req("r2", at=600, suffix="q2")
    rows = run(r1, r2)
    assert split(rows, "r2") == [("evicted", "", 736), ("unavoidable", "", 26)]


def test_agent_run_is_a_previous_turn_too():
    t1 = req("s1", run="run-7")
    t2 = req("s2", at=2, run="run-7", pod="pod-b", prompt=830, history="q1|call", history_tokens=50,
             suffix="tool-result", suffix_tokens=20)
    rows = run(t1, t2)
    assert split(rows, "s2") == [("routed_away", "", 736), ("unavoidable", "", 94)]


def test_timestamp_first_system_prompt_is_volatile_system():
    # cap-4-timestamp-first: 784 tokens, 0 cached; single-turn requests never repeat a fingerprint, the
    # predecessor is found by the normalized system hash.
    base = "You are the support agent of Acme."
    r1 = req("r1", system=f"[2026-11-29T12:00:00Z] {base}", system_norm=f"[<ts>] {base}", system_tokens=740,
             prompt=784, suffix_tokens=20)
    r2 = req("r2", at=60, system=f"[2026-11-29T12:01:00Z] {base}", system_norm=f"[<ts>] {base}",
             system_tokens=740, prompt=784, suffix="q2", suffix_tokens=20)
    rows = run(r1, r2)
    assert split(rows, "r2") == [("prefix_drift", "volatile_system", 736), ("unavoidable", "", 48)]
    assert rows[-1].predecessor_request_id == "r1"
    check_sum(rows, r2)


def test_timestamp_first_in_a_continued_conversation_drifts_over_the_previous_turn():
    base = "You are the support agent of Acme."
    t1 = req("t1", conv="c1", system=f"[12:00:00] {base}", system_norm=f"[<ts>] {base}")
    t2 = req("t2", at=3, conv="c1", system=f"[12:00:03] {base}", system_norm=f"[<ts>] {base}", prompt=830,
             history="q1|reply1", history_tokens=50, suffix="q2", suffix_tokens=20)
    rows = run(t1, t2)
    # Without the timestamp, turn 1's whole prompt (762 tokens → 736 in full blocks) would have hit.
    assert split(rows, "t2") == [("prefix_drift", "volatile_system", 736), ("unavoidable", "", 94)]
    assert rows[-1].predecessor_request_id == "t1"


def test_changed_system_prompt_is_system_changed():
    tools = '[{"name": "lookup", "parameters": {"type": "object"}}]'
    r1 = req("r1", system="Policy v1", system_tokens=400, tools=tools, tools_tokens=300, prompt=740,
             suffix_tokens=20)
    r2 = req("r2", at=60, system="Policy v2", system_tokens=400, tools=tools, tools_tokens=300, prompt=740,
             suffix="q2", suffix_tokens=20)
    rows = run(r1, r2)  # found through the canonical tools hash; the stable prefix ends at 719
    assert split(rows, "r2") == [("prefix_drift", "system_changed", 704), ("unavoidable", "", 36)]
    check_sum(rows, r2)


def test_reordered_tool_keys_are_tools_reordered():
    # cap-3-tools-reordered: 764 tokens, 672 cached (the system prompt's blocks and then some).
    a_json = '[{"name": "lookup", "description": "Find an order", "parameters": {}}]'
    b_json = '[{"description": "Find an order", "name": "lookup", "parameters": {}}]'
    kw = dict(system_tokens=600, tools_tokens=140, tools_canonical="canonical-lookup", prompt=764,
              suffix_tokens=20)
    r1 = req("cap-2", tools=a_json, **kw)
    r2 = req("cap-3", at=1, tools=b_json, cached=672, **kw)
    rows = run(r1, r2)
    assert split(rows, "cap-3") == [("prefix_drift", "tools_reordered", 64), ("unavoidable", "", 28)]
    check_sum(rows, r2)


def test_changed_tools_are_tools_changed():
    kw = dict(system_tokens=600, tools_tokens=140, prompt=764, suffix_tokens=20)
    r1 = req("r1", tools='[{"name": "lookup"}]', **kw)
    r2 = req("r2", at=1, tools='[{"name": "lookup"}, {"name": "refund"}]', cached=576, suffix="q2", **kw)
    rows = run(r1, r2)
    assert split(rows, "r2") == [("prefix_drift", "tools_changed", 160), ("unavoidable", "", 28)]
    check_sum(rows, r2)


@pytest.mark.parametrize("added", ["rag", "tools"])
def test_a_segment_the_predecessor_did_not_have_is_new_content_not_drift(added):
    """Found on a real pod: the predecessor was system + question (643 tokens); the next request added documents
    (a second system message) or tools before the same question: vLLM reported (1074, 608). All 448 tokens after the
    hit were a drift, more than the predecessor's whole prompt held. What the addition displaced is at most the rest
    of the predecessor's prompt: the drift ends at its last full block (640), the added segment is unavoidable."""
    kw = dict(conv="c-add", system_tokens=600, suffix_tokens=22)
    r1 = req("a1", prompt=643, **kw)
    r2 = req("a2", at=10, prompt=1074, cached=608, **{added: "a new document", f"{added}_tokens": 430}, **kw)
    rows = run(r1, r2)
    sub = "rag_changed" if added == "rag" else "tools_changed"
    assert split(rows, "a2") == [("prefix_drift", sub, 32), ("unavoidable", "", 1074 - 640)]
    check_sum(rows, r2)


def test_empty_variant_hashes_name_a_change_not_a_reordering():
    kw = dict(system_tokens=600, tools_tokens=140, prompt=764, suffix_tokens=20)
    r1 = req("r1", tools="A", tools_canonical="", **kw)
    r2 = req("r2", at=1, tools="B", tools_canonical="", cached=576, **kw)
    assert split(run(r1, r2), "r2")[0] == ("prefix_drift", "tools_changed", 160)


@pytest.mark.parametrize(("rag_set_2", "sub"),
                         [("docs{1,2,3}", "rag_reordered"), ("docs{1,2,4}", "rag_changed")])
def test_retrieval_pack_reordered_or_changed(rag_set_2, sub):
    kw = dict(system_tokens=300, rag_tokens=1200, prompt=1560, suffix_tokens=30)
    r1 = req("r1", rag="doc1|doc2|doc3", rag_set="docs{1,2,3}", **kw)
    r2 = req("r2", at=30, rag="doc3|doc1|doc2", rag_set=rag_set_2, cached=288, suffix="q2", **kw)
    rows = run(r1, r2)
    # the system prompt ends at 305: its 9 full blocks (288) hit; the pack's blocks would have hit up to 1504.
    assert split(rows, "r2") == [("prefix_drift", sub, 1216), ("unavoidable", "", 56)]
    check_sum(rows, r2)


def test_truncated_history_is_history_truncated():
    t2 = req("t2", conv="c2", system_tokens=500, prompt=880, history="m1|m2|m3", prev_history="m1",
             history_tokens=300, suffix="m4", suffix_tokens=40)
    # Turn 3 drops m1 (a sliding window): its prev_history (m2|m3) is not turn 2's history (m1|m2|m3).
    t3 = req("t3", at=20, conv="c2", system_tokens=500, prompt=1180, cached=512, history="m2|m3|m4|m5",
             prev_history="m2|m3", history_tokens=600, suffix="m6", suffix_tokens=50)
    rows = run(t2, t3)
    assert split(rows, "t3") == [("prefix_drift", "history_truncated", 608), ("unavoidable", "", 60)]
    check_sum(rows, t3)


@pytest.mark.parametrize(("carried", "expected"), [
    ("U1 edited", [("prefix_drift", "history_changed", 832), ("unavoidable", "", 46)]),
    ("U1", [("evicted", "evicted_before_next_turn", 832), ("unavoidable", "", 46)]),
    ("", [("evicted", "evicted_before_next_turn", 832), ("unavoidable", "", 46)]),
], ids=["edited", "kept", "not-logged"])
def test_an_edited_previous_message_is_history_changed(carried: str, expected: list) -> None:
    """A client that edited (redacted) the message its previous turn sent, on a real vLLM pod (block 32): turn 1 =
    system + U1 (1234 tokens, 0 cached); turn 2 = system + U1' + the reply + a new question (1262, 384 cached:
    the system prompt and the edit's unchanged opening). prev_history_hash matches (the history before U1 is
    empty both times), so only prev_suffix_hash tells the edit: from where U1 started (its offset in turn 1,
    364) to turn 1's last full block (1216) the prefix drifted, `history_changed`, not evicted (the pod evicted
    nothing). Kept as sent, or not logged (an older gateway), the history continued as before."""
    kw = dict(conv="c-edit", system_tokens=360)
    t1 = req("t1", prompt=1234, suffix="U1", suffix_tokens=860, **kw)
    t2 = req("t2", at=10, prompt=1262, cached=384, history="U1 edited|A1", history_tokens=870, prev_suffix=carried,
             suffix="U2", suffix_tokens=6, **kw)
    rows = run(t1, t2)
    assert split(rows, "t2") == expected
    check_sum(rows, t2)


def test_a_previous_turn_logged_without_segments_proves_no_edit() -> None:
    """Turn 1 was logged with the empty fingerprint (truncate_prompt_tokens, or a body the gateway could not read:
    every hash ""); turn 2 re-sends its message as it was. prev_history_hash "" equals turn 1's history hash "",
    but with no suffix_hash to compare, nothing says the message was edited (found by a hostile hunt: 896 tokens
    of `history_changed`): the history reads as continued, as for a line without prev_suffix_hash."""
    t1 = req("t1", conv="c", prompt=900, system="", system_tokens=0, suffix="", suffix_tokens=0)
    t2 = req("t2", at=10, conv="c", prompt=1000, cached=0, system="", system_tokens=0, history="U1|A1",
             history_tokens=900, prev_suffix="U1", suffix="U2", suffix_tokens=60)
    rows = run(t1, t2)
    assert not any(sub == "history_changed" for _, sub, _ in split(rows, "t2"))
    check_sum(rows, t2)


def test_an_edit_behind_a_system_change_keeps_the_history_before_it_reusable() -> None:
    """Turn 2 changed the system prompt, re-sent turn 1's history H0 (4000 tokens) as it was and edited turn 1's
    final message. Had the system prompt stayed, H0 would have hit: the drift reaches where the edited message
    started (turn 1's suffix offset, 4888; its last full block 4864), not the history's start (416: H0 was
    `unavoidable`, found by a hostile hunt). Unedited, it reaches turn 1's whole prompt (4992)."""
    t1 = req("t1", conv="c", prompt=5000, system="S", system_tokens=400, history="H0", history_tokens=4000,
             suffix="U1", suffix_tokens=100)
    kw = dict(at=3, conv="c", prompt=5600, cached=0, system="S2", system_norm="S2n", system_tokens=400,
              prev_history="H0", history_tokens=4600, suffix="U2", suffix_tokens=100)
    edited = req("t2", history="H0|U1 edited|A1", prev_suffix="U1 edited", **kw)
    rows = run(t1, edited)
    assert split(rows, "t2") == [("prefix_drift", "system_changed", 4864), ("unavoidable", "", 736)]
    kept = req("t2", history="H0|U1|A1", prev_suffix="U1", **kw)
    assert split(run(t1, kept), "t2") == [("prefix_drift", "system_changed", 4992), ("unavoidable", "", 608)]


@pytest.mark.parametrize(("logged", "expected"), [
    (True, [("routed_away", "", 1216), ("unavoidable", "", 46)]),
    (False, [("routed_away", "", 352), ("prefix_drift", "history_truncated", 864), ("unavoidable", "", 46)]),
])
def test_a_message_sent_before_the_reply_continues_the_conversation(logged: bool, expected: list) -> None:
    """Turn 2 re-sends turn 1's messages as they were and adds a message with no reply between (the user wrote again
    before the reply came; user-only turns). prev_history_hash assumes a reply between the turns, so it names a
    history turn 1 did not have; turn 1's next_history_hash (its history and final message as one history) equals
    turn 2's history_prefix_hash: the conversation continued, and turn 1's whole prompt (1234 tokens, 1216 in full
    blocks of 32) was reusable on pod-a, where turn 1 ran: `routed_away` for turn 2 on pod-b, not a truncated
    history. A log without the field reads as before."""
    kw = dict(conv="c-noreply", system_tokens=360)
    t1 = req("t1", prompt=1234, history="U0|A0", history_tokens=400, suffix="U1", suffix_tokens=460,
             next_history="U0|A0|U1" if logged else "", **kw)
    t2 = req("t2", at=10, pod="pod-b", prompt=1262, history="U0|A0|U1", history_tokens=860, prev_history="",
             prev_suffix="U0", suffix="U2", suffix_tokens=28, **kw)
    rows = run(t1, t2)
    assert split(rows, "t2") == expected
    check_sum(rows, t2)


def prefill_turns(logged: bool = True) -> list[dict[str, Any]]:
    """Turn 1 is an assistant prefill (its final message "A1pre" of role assistant, continue_final_message) on pod-a;
    turn 2 carries it completed ("A1") and a new user message, on pod-b. ``logged``: the gateway logged
    continue_final_message and prefill_history_hash."""
    kw = dict(conv="c-prefill", system_tokens=360)
    return [req("t1", prompt=1234, history="U0|A0|U1", history_tokens=800, suffix="A1pre", suffix_tokens=60,
                next_history="U0|A0|U1|A1pre", continue_final=logged, **kw),
            req("t2", at=10, pod="pod-b", prompt=1290, history="U0|A0|U1|A1", history_tokens=890, prev_history="U0|A0",
                prev_suffix="U1", prefill_history="U0|A0|U1" if logged else "", suffix="U2", suffix_tokens=28, **kw)]


@pytest.mark.parametrize("logged", [True, False])
def test_an_assistant_prefill_the_reply_completed_continues_the_conversation(logged: bool) -> None:
    """Turn 2 carries turn 1's prefill completed by its reply: turn 1's whole prompt (1234 tokens, 1216 in full
    blocks of 32; the prefill's tokens begin the completed message) was reusable on pod-a: `routed_away` for turn 2
    on pod-b. prev_history_hash drops the user message before the reply (a reply, it assumes, answered it) and
    next_history_hash names the prefill as sent, so neither tells; prefill_history_hash does. A log without the
    fields reads a truncated history, as before."""
    rows = run(*prefill_turns(logged))
    if logged:
        assert split(rows, "t2") == [("routed_away", "", 1216), ("unavoidable", "", 74)]
    else:
        assert ("prefix_drift", "history_truncated") in {(c, s) for c, s, _ in split(rows, "t2")}
    check_sum(rows, prefill_turns(logged)[1])
    plain = prefill_turns()
    plain[0]["continue_final_message"] = False  # the same hashes after a plain reply prove nothing
    assert ("prefix_drift", "history_truncated") in {(c, s) for c, s, _ in split(run(*plain), "t2")}


def rewind_turns() -> list[dict[str, Any]]:
    """Three turns of one conversation on pod-a, block 32: t1 = system (400) + U1; t2 = system + [U1, A1] (300) + U2
    (50); t3 = system + [U1, A1, U2, A2] (600) + U3."""
    kw = dict(conv="c", system="sys", system_tokens=400)
    return [req("t1", at=0, prompt=510, suffix="U1", suffix_tokens=100, **kw),
            req("t2", at=10, prompt=765, history="U1|A1", history_tokens=300, prev_suffix="U1", suffix="U2",
                suffix_tokens=50, **kw),
            req("t3", at=20, prompt=1055, history="U1|A1|U2|A2", history_tokens=600, prev_history="U1|A1",
                prev_suffix="U2", suffix="U3", suffix_tokens=40, **kw)]


@pytest.mark.parametrize(("suffix", "expected"), [
    ("U2", [("routed_away", "", 736), ("unavoidable", "", 29)]),
    ("U2 edited", [("routed_away", "", 704), ("unavoidable", "", 61)]),
])
def test_going_back_one_turn_is_no_drift(suffix: str, expected: list[tuple[str, str, int]]) -> None:
    """A chat UI's regenerate of an earlier reply (turn 2 re-sent as it was) or edit of an earlier message (turn 2
    with its question edited), after turn 3, on pod-b. Its previous turn is turn 3 (the conversation's latest),
    whose prompt holds turn 2's history, and its question too when re-sent: its history is turn 3's
    prev_history_hash. Found on real pods by a hostile hunt: it read `history_truncated` from the history's start,
    though nothing was cut. Regenerated: the whole prompt (765, 736 in full blocks) was on pod-a; edited: up to
    its history's end (700 raw of 750 segment tokens: 714, 704 in full blocks), the edited question new."""
    back = req("t2b", at=30, pod="pod-b", prompt=765, history="U1|A1", history_tokens=300, prev_suffix="U1",
               suffix=suffix, suffix_tokens=50, conv="c", system="sys", system_tokens=400)
    rows = run(*rewind_turns(), back)
    assert {r.predecessor_request_id for r in rows if r.request_id == "t2b"} == {"t3"}
    assert split(rows, "t2b") == expected
    check_sum(rows, back)


def subagent_turns(logged: bool = True, conv: str = "") -> list[dict[str, Any]]:
    """Two parallel sub-agents of run R (same system prompt, tasks A and B): A1 at 0 s, B1 at 1 s, A2 at 5 s (task
    A, its tool call and result) on pod-b. ``logged``: the gateway logged first_message_hash; ``conv``: the
    session's conversation_id, carried by every request."""
    kw = dict(run="R", conv=conv, system="You are an explore sub-agent.", system_tokens=400)
    first = (lambda task: task) if logged else (lambda task: "")
    return [req("A1", at=0, prompt=700, suffix="task A", suffix_tokens=290, first_message=first("task A"), **kw),
            req("B1", at=1, prompt=700, suffix="task B", suffix_tokens=290, first_message=first("task B"), **kw),
            req("A2", at=5, pod="pod-b", prompt=1000, history="task A|call", history_tokens=400, prev_history="",
                prev_suffix="task A", suffix="result", suffix_tokens=190, first_message=first("task A"), **kw)]


@pytest.mark.parametrize("conv", ["", "session-1"])
def test_parallel_subagents_each_continue_their_own_thread(conv: str) -> None:
    """A2's previous turn is A1, found on the run's thread key (first_message_hash), not B1, the run's latest request
    (another thread: its different final message read as an edit, `history_changed`, found by a hostile hunt), also
    when every request carries the session's conversation_id (the thread key ranks first: a second hunt). A1's
    whole prompt (700, 672 in full blocks of 32) sat on pod-a: `routed_away`. A log without the field finds B1 as
    before: its task B reads as an edit of task A."""
    rows = run(*subagent_turns(conv=conv))
    assert {r.predecessor_request_id for r in rows if r.request_id == "A2"} == {"A1"}
    assert split(rows, "A2") == [("routed_away", "", 672), ("unavoidable", "", 328)]
    old = run(*subagent_turns(logged=False, conv=conv))
    assert {r.predecessor_request_id for r in old if r.request_id == "A2"} == {"B1"}
    assert ("prefix_drift", "history_changed") in {(c, s) for c, s, _ in split(old, "A2")}


def test_prompt_shorter_than_a_block_is_below_block():
    # cap-5-below-one-block: a 19-token prompt is never cached, even when repeated.
    r1 = req("r1", system="Be brief.", system_tokens=5, prompt=19, suffix="hi", suffix_tokens=10)
    r2 = req("r2", at=1, system="Be brief.", system_tokens=5, prompt=19, suffix="hi", suffix_tokens=10)
    rows = run(r1, r2)
    assert split(rows, "r2") == [("below_block", "", 18), ("unavoidable", "", 1)]


def test_shared_part_shorter_than_a_block_is_below_block():
    r1 = req("r1", system="Be brief.", system_tokens=20, prompt=300, suffix="long q", suffix_tokens=260)
    r2 = req("r2", at=1, system="Be brief.", system_tokens=20, prompt=300, suffix="other", suffix_tokens=260)
    rows = run(r1, r2)
    assert split(rows, "r2") == [("below_block", "", 21), ("unavoidable", "", 279)]
    check_sum(rows, r2)


# -- unknown: numbers the model cannot explain ---------------------------------------------------------------
def test_more_cached_than_vllm_can_hit_is_unknown():
    r = req("r", cached=750)  # > floor(761 / 32) * 32 = 736: the block size or the counts are wrong
    assert split(run(r), "r") == [("unknown", "", 12)]


def test_partial_hit_without_any_predecessor_is_cold_after_the_hit():
    # a common opening hit (e.g. the chat template's first block); nothing seen before held the rest
    r = req("r", cached=32)
    assert split(run(r), "r") == [("cold", "", 704), ("unavoidable", "", 26)]


def test_no_segment_counts_is_unknown_except_the_tail():
    r = req("r", prompt=100, system_tokens=0, suffix_tokens=0)
    assert split(run(r), "r") == [("unknown", "", 96), ("unavoidable", "", 4)]


def test_whole_prompt_as_suffix_is_unavoidable():
    # /v1/completions without a prefix split: the whole prompt is the suffix
    r = req("r", system="", system_tokens=0, prompt=300, suffix_tokens=290)
    assert split(run(r), "r") == [("unavoidable", "", 300)]


@pytest.mark.parametrize("over", [dict(status=502), dict(cached=762), dict(cached=800), dict(prompt=0)])
def test_no_rows_for_failed_or_fully_served_requests(over):
    assert run(req("r", **over)) == []


# -- predecessor rules ---------------------------------------------------------------------------------------
def pred_of(rows: list[a.MissRow], rid: str) -> str:
    return next(r.predecessor_request_id for r in rows if r.request_id == rid)


def test_previous_turn_wins_over_a_later_fingerprint_match():
    t1 = req("t1", conv="c1")
    other = req("other", at=1, tenant="globex", pod="pod-b")  # same fingerprint, another tenant, later
    t2 = turn2("t2", pod="pod-b", cached=0, at=2)
    assert pred_of(run(t1, other, t2), "t2") == "t1"


def test_fingerprint_predecessor_may_be_another_tenant():
    r1, r2 = req("r1", tenant="globex", pod="pod-b"), req("r2", at=1, suffix="q2")
    rows = run(r1, r2)
    assert pred_of(rows, "r2") == "r1"
    assert split(rows, "r2") == [("routed_away", "", 736), ("unavoidable", "", 26)]


def test_variant_predecessor_stays_within_the_tenant():
    r1 = req("r1", tenant="globex", system="[t1] hello", system_norm="[<ts>] hello")
    r2 = req("r2", at=1, system="[t2] hello", system_norm="[<ts>] hello")
    assert split(run(r1, r2), "r2")[0][0] == "cold"


def test_horizon_and_strictly_earlier():
    r1, same_ts, r3 = req("r1"), req("same", suffix="q2"), req("r3", at=7200, suffix="q3")
    rows = run(r1, same_ts, r3)
    assert pred_of(rows, "same") == ""  # the same ts is not strictly earlier
    rows = run(r1, r3, lookback_seconds=0)  # no lookback: beyond the horizon is nothing
    assert pred_of(rows, "r3") == ""
    assert pred_of(run(r1, r3, horizon_seconds=7200), "r3") == "r1"
    assert pred_of(run(r1, r3), "r3") == "r1"  # found in the lookback (see the beyond_horizon tests)


def test_failed_and_other_model_requests_are_not_predecessors():
    t1 = req("t1", conv="c1")
    failed = req("failed", at=1, conv="c1", status=502, prompt=0)
    other_model = req("m", at=1.5, conv="c1", model="big")
    t2 = turn2("t2", pod="pod-b", cached=0, at=3)
    assert pred_of(run(t1, failed, other_model, t2), "t2") == "t1"


def test_window_requests_are_predecessors_but_not_attributed():
    t1, t2 = req("t1", conv="c1"), turn2("t2", pod="pod-b", cached=0)
    rows = a.attribute([t2], [t1], block_size_by_pod=BLOCK)
    assert {r.request_id for r in rows} == {"t2"} and pred_of(rows, "t2") == "t1"


def test_unknown_pod_falls_back_to_default_block_size():
    rows = a.attribute([req("r", pod="pod-z", prompt=100, system_tokens=70, suffix_tokens=20)],
                       block_size_by_pod=BLOCK)
    # stable prefix 77 → 4 blocks of vLLM's default 16 = 64 cold
    assert [(r.cause, r.tokens, r.block_size) for r in rows] == [("cold", 64, 16), ("unavoidable", 36, 16)]


# -- the token split on its own ------------------------------------------------------------------------------
def test_split_zones_are_counted_from_cached_tokens_on():
    shared = a.SharedPrefix(603, "tools_reordered", 603, 764)
    out = a.split_missed_tokens(prompt_tokens=764, cached_tokens=0, block_size=32, stable_prefix_tokens=743,
                                shared=shared, reuse_cause=("routed_away", ""))
    # reusable [0, 576), the change broke the block holding 603, drift up to 736, tail 28
    assert out == [("routed_away", "", 576), ("prefix_drift", "tools_reordered", 160),
                   ("unavoidable", "", 28)]


# -- invariants ----------------------------------------------------------------------------------------------
def random_requests(n: int, seed: int) -> list[dict[str, Any]]:
    """Random traffic over every field the rules read (segments present or not, equal or not, variants, two
    tenants, three pods, failures, cached beyond what can hit or not reported), ts in whole milliseconds."""
    rnd = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = rnd.randint(0, 3000)
        seg = [rnd.choice([0, rnd.randint(1, 900)]) for _ in range(5)]
        reqs.append(req(
            f"r{i:04d}", at=round(rnd.uniform(0, 5000), 3), tenant=rnd.choice("ab"),
            conv=rnd.choice(["", "c1", "c2"]), run=rnd.choice(["", "x"]), pod=rnd.choice(["pod-a", "pod-b", "pod-c"]),
            prompt=prompt, cached=rnd.choice([0, None, rnd.randint(0, prompt + 50)]),
            status=rnd.choice([200, 200, 200, 500]),
            system=rnd.choice(["", "s1", "s2"]), system_norm=rnd.choice([None, "n"]), system_tokens=seg[0],
            tools=rnd.choice(["", "t1", "t2"]), tools_canonical=rnd.choice([None, "tc"]), tools_tokens=seg[1],
            rag=rnd.choice(["", "r1", "r2"]), rag_set=rnd.choice([None, "rs"]), rag_tokens=seg[2],
            history=rnd.choice(["", "h1", "h2"]), prev_history=rnd.choice(["", "h1"]), history_tokens=seg[3],
            prev_suffix=rnd.choice(["", "x1", "x2"]),
            suffix=rnd.choice(["", "x1", "x2"]), suffix_tokens=seg[4],
            **random_structure(rnd),
        ))
    salts = random.Random(seed + 3000)  # a stream of its own: the fields above stay as they were drawn
    for r in reqs:
        r["cache_salt_hash"] = salts.choice(["", "", "", "5a17000000000001", "5a17000000000002"])
    outages = random.Random(seed + 4000)  # the pods found down as each request was routed, a stream of its own too
    for r in reqs:
        r["pods_down"] = outages.choice([[], [], [], ["pod-a"], ["pod-b"], ["pod-a", "pod-c"], ["pod-b", "pod-c"]])
    prefills = random.Random(seed + 5000)  # assistant prefills and the histories that carry them completed
    for r in reqs:
        r["continue_final_message"] = prefills.random() < 0.2
        r["prefill_history_hash"] = h(prefills.choice(["", "", "h1", "h2"]))
    threads = random.Random(seed + 6000)  # first messages: the thread keys (9 with a run id, 10 with a conversation)
    for r in reqs:
        r["first_message_hash"] = h(threads.choice(["", "m1", "m2", "m3"]))
    return reqs


def random_structure(rnd: random.Random) -> dict[str, Any]:
    """System lines (none, or 2–5 lines of which some vary) and suffix chunks (none, or 1–5 chunks drawn from a
    few documents and questions, in any order), with random token counts."""
    lines: list[str] = []
    if rnd.random() < 0.6:
        lines = [f"l{i}" for i in range(rnd.randint(2, 5))]
        for _ in range(rnd.choice([0, 1, 1, 2])):
            lines[rnd.randrange(len(lines))] = rnd.choice(["v1", "v2", "v3"])
    chunks = rnd.sample(["A", "B", "C", "D", "Q1", "Q2"], rnd.randint(1, 5)) if rnd.random() < 0.6 else []
    return dict(lines=lines, line_tokens=[rnd.randint(0, 80) for _ in lines],
                chunks=chunks, chunk_tokens=[rnd.randint(0, 200) for _ in chunks])


def test_random_traffic_sums_exactly_and_is_deterministic():
    rnd = random.Random(7)
    reqs = random_requests(400, seed=7)
    sizes = {"pod-a": 32, "pod-b": 16}
    rows = a.attribute(reqs, block_size_by_pod=sizes)
    shuffled = reqs[:]
    rnd.shuffle(shuffled)
    assert a.attribute(shuffled, block_size_by_pod=sizes) == rows
    by_rid = {q["request_id"]: q for q in reqs}
    by_id: dict[str, int] = {}
    for r in rows:
        assert r.tokens > 0
        assert r.cause in a.CAUSES
        if r.cause == "prefix_drift":
            assert r.sub_cause in a.DRIFT_SUB_CAUSES
        elif r.cause == "evicted":
            assert r.sub_cause in ("", "evicted_before_next_turn")
        elif r.cause == "routed_away":
            assert r.sub_cause in ("", "pod_down")
            assert (r.sub_cause == "pod_down") == (r.predecessor_pod in by_rid[r.request_id]["pods_down"])
        else:
            assert r.sub_cause == ""
        by_id[r.request_id] = by_id.get(r.request_id, 0) + r.tokens
    for q in reqs:
        if a.is_attributable(q):
            assert by_id[q["request_id"]] == missed(q)
        else:
            assert q["request_id"] not in by_id
    keys = [(r.request_id, r.cause, r.sub_cause) for r in rows]
    assert len(keys) == len(set(keys))


def test_a_request_that_read_no_prefix_cache_names_why() -> None:
    """A request that asked for prompt logprobs (vLLM read no prefix cache: the contract stores its cached count as
    not reported) repeats turn 1 on its pod: all 762 tokens are `not_reported / skip_reading_prefix_cache`, not
    `evicted` on a pod that evicted nothing."""
    t1 = req("t1", conv="c")
    t2 = {**req("t2", at=10, conv="c", cached=None), "skip_reading_prefix_cache": True}
    assert split(run(t1, t2), "t2") == [("not_reported", "skip_reading_prefix_cache", 762)]


def test_a_cached_count_not_reported_is_one_not_reported_cause_not_invented_misses():
    """Turn 2 repeats turn 1's 762-token prompt on the same pod; its pod did not report cached tokens. By hand:
    one cause, not_reported, for all 762 prompt tokens (not 736 `evicted` + 26 `unavoidable`, what cached = 0
    gave); the predecessor is kept. Turn 3 (cached 736 reported) still finds turn 2 as its predecessor."""
    t1 = req("t1", at=0, conv="c", cached=0)
    t2 = req("t2", at=10, conv="c", cached=None)
    t3 = req("t3", at=20, conv="c", cached=704)
    rows = a.attribute([t1, t2, t3], block_size_by_pod={"pod-a": 32})
    by_req = {}
    for r in rows:
        by_req.setdefault(r.request_id, []).append((r.cause, r.sub_cause, r.tokens, r.predecessor_request_id))
    assert by_req["t2"] == [("not_reported", "", 762, "t1")]
    # t3: hit 704 of L = floor(761/32)*32 = 736; t3 repeats t2's prompt token for token, so the boundary is exact
    # (no edge of sharing): [704, 736) was lost, evicted 32, unavoidable 26; its predecessor is t2
    assert by_req["t3"] == [("evicted", "evicted_before_next_turn", 32, "t2"), ("unavoidable", "", 26, "t2")]
    verdict = a.judge(t2, a.Predecessor(t1, a.PREVIOUS_TURN), 32)
    assert verdict.cached_tokens is None and verdict.missed_tokens == (762,)
    before = a.judge({**t2, "cached_tokens": 0}, a.Predecessor(t1, a.PREVIOUS_TURN), 32)
    assert before.causes == ("evicted", "unavoidable") and before.missed_tokens == (736, 26)
