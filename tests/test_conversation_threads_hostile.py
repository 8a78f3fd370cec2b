"""The thread rules (tests/test_conversation_threads.py) must not take a conversation's own next turn for another
thread's: a hostile review of key 10, ``attribution.other_thread`` and ``engine_requests`` found these four, each
a regression of the first version of those rules against the answers before them (a trimmed turn whose system
prompt changed read `cold`, a volatile system prompt lost its previous turn, a sliding window whose first message
repeats took a turn two back, ``n`` = "2.0" was one sequence). Every row is fingerprinted from a real chat body by
the reference gateway (tests/test_conversation_threads.py ``row``); the store job is checked on the first."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.fingerprint import engine_requests
from ingest import attribution as a
from tests.test_conversation_threads import A1, A2, SYS, U1, U2, U3, row, store_causes, u

B = 16
#: The user's custom instructions / memory, which the client appends to the system prompt from turn 3 on.
S_MEMORY = {"role": "system", "content": SYS["content"]
            + "\nMemory: the user runs the nightly backup as svc-backup in eu-west."}
SUMMARY = u("Summary of the conversation so far: the nightly backup fails with AccessDenied; the role still has "
            "BackupWriter, now at policy version v3; the user pinned v2 and the job ran.")


def judged(rows: list[dict[str, Any]]) -> dict[str, a.Verdict]:
    index = a.PredecessorIndex(rows)
    return {r["request_id"]: a.judge(r, index.find(r), B) for r in rows}


def causes(v: a.Verdict) -> dict[tuple[str, str], int]:
    return dict(zip(zip(v.causes, v.sub_causes, strict=True), v.missed_tokens, strict=True))


def compacted_traffic(window: bool) -> list[dict[str, Any]]:
    """A chat on pod-a whose client, at turn 3, both adds a memory line to the system prompt and trims the history
    (a sliding window keeping the last exchange, or a compaction summary): turn 3's first message and system
    prompt both differ from turn 2's. Turn 3 misses everything (pod-a evicted turn 2)."""
    t3 = [S_MEMORY, U2, A2, U3] if window else [S_MEMORY, SUMMARY, A2, U3]
    return [row("t1", [SYS, U1], at=0, conv="chat-9", pod="pod-a"),
            row("t2", [SYS, U1, A1, U2], at=60, conv="chat-9", pod="pod-a"),
            row("t3", t3, at=120, conv="chat-9", pod="pod-a", cached=0)]


@pytest.mark.parametrize("window", [True, False], ids=["sliding_window", "compaction"])
def test_a_trimmed_turn_with_a_changed_system_prompt_is_still_the_next_turn(window: bool) -> None:
    """Turn 3's first message and system prompt both differ from turn 2's, but it has a history: a thread's next
    turn, not a new thread (other_thread applies to a thread's first turn only). The first version dropped turn 2,
    so turn 3's whole system prompt, which turn 2 had computed on this very pod, read `cold`. Right: previous_turn
    t2, evicted / evicted_before_next_turn over the unchanged system blocks, prefix_drift / system_changed from the
    changed line on."""
    v = judged(compacted_traffic(window))["t3"]
    assert v.predecessor_request_id == "t2", (v.predecessor_request_id, causes(v))
    assert ("cold", "") not in causes(v), causes(v)
    assert ("prefix_drift", "system_changed") in causes(v), causes(v)


@pytest.mark.parametrize("traffic", ["sliding_window", "compaction", "repeating_window"])
def test_the_store_job_agrees(store, traffic: str) -> None:  # type: ignore[no-untyped-def]
    """The store job (_confirm_threads) takes the same predecessors and gives the same causes as the reference."""
    rows = repeating_window() if traffic == "repeating_window" else compacted_traffic(traffic == "sliding_window")
    expected = {rid: (v.predecessor_request_id, causes(v)) for rid, v in judged(rows).items()}
    got = store_causes(store, rows)
    preds = dict(store.query_rows("SELECT request_id, predecessor_request_id FROM request_attribution FINAL"))
    assert {rid: (preds[rid], got.get(rid, {})) for rid in expected} == expected
    last = rows[-1]["request_id"]
    assert ("cold", "") not in got[last] and expected[last][0] == ("t4" if traffic == "repeating_window" else "t2")


def volatile(minute: int) -> dict[str, str]:
    return {"role": "system", "content": SYS["content"] + f"\nCurrent date and time: 2026-12-06 10:{minute:02d}:01"}


def test_a_volatile_system_prompt_with_a_sliding_window_keeps_its_previous_turn() -> None:
    """A client that stamps the time into its system prompt (system_hash differs every turn) and keeps a sliding
    window of the history (first_message_hash differs once the window slides): the previous turn stays the
    previous turn (the first version dropped it, found it again on a variant key as a look-alike, and lost the
    sub-cause evicted_before_next_turn)."""
    rows = [row("t1", [volatile(0), U1], at=0, conv="chat-9", pod="pod-a"),
            row("t2", [volatile(1), U1, A1, U2], at=60, conv="chat-9", pod="pod-a"),
            row("t3", [volatile(2), U2, A2, U3], at=120, conv="chat-9", pod="pod-a", cached=0)]
    v = judged(rows)["t3"]
    assert v.predecessor_request_id == "t2"
    assert v.predecessor_kind == "previous_turn", (v.predecessor_kind, causes(v))
    assert ("evicted", "evicted_before_next_turn") in causes(v), causes(v)


@pytest.mark.parametrize("n", ["2.0", "3.00"])
def test_n_as_a_decimal_string_is_several_sequences(n: str) -> None:
    """engine_requests reads n as pydantic reads an int in lax mode: pydantic (vLLM's request models) reads "2.0"
    as 2, so vLLM runs two sequences and the cached count is one child's (the first version's int("2.0") failed
    and read one sequence)."""
    from pydantic import BaseModel

    class Req(BaseModel):
        n: int | None = 1

    assert Req(n=n).n > 1
    assert engine_requests({"model": "m", "messages": [u("hi")], "n": n}, "chat.completions") == Req(n=n).n


def test_a_sliding_window_whose_first_message_repeats_keeps_the_latest_turn() -> None:
    """An agent loop nudged with "Continue." under a sliding window (the last exchange plus the new message): the
    window's first message alternates between "Continue." and a task message, so key 10 (conversation_id,
    first_message_hash) finds t3, two turns back on pod-b, before the conversation key's t4, the turn just served on
    pod-a. t5 continues neither (the window slid), so the conversation's latest, t4, is its previous turn
    (attribution.thread_first): pod-a evicted it, evicted_before_next_turn (the first version: routed_away
    against t3)."""
    v = judged(repeating_window())["t5"]
    assert v.predecessor_request_id == "t4", (v.predecessor_request_id, causes(v))
    assert ("evicted", "evicted_before_next_turn") in causes(v), causes(v)


def repeating_window() -> list[dict[str, Any]]:
    """t1-t5 of the agent loop above: t1-t3 on pod-b, t4 and t5 on pod-a (t5 cached 0)."""
    cont = u("Continue.")
    answers = [{"role": "assistant", "content": f"Step {i}: " + "analysis " * 30} for i in range(4)]
    tasks = [u(f"Now check log file {i}: " + "entry " * 20) for i in range(3)]
    return [row("t1", [SYS, tasks[0]], at=0, conv="c", pod="pod-b"),
            row("t2", [SYS, tasks[0], answers[0], cont], at=10, conv="c", pod="pod-b"),
            row("t3", [SYS, cont, answers[1], tasks[1]], at=20, conv="c", pod="pod-b"),
            row("t4", [SYS, tasks[1], answers[2], cont], at=30, conv="c", pod="pod-a"),
            row("t5", [SYS, cont, answers[3], tasks[2]], at=40, conv="c", pod="pod-a", cached=0)]


def retried_under_one_id() -> list[dict[str, Any]]:
    """t1 on pod-a, the client's retry of it under the same request id 5 s later on pod-b (both served: the gateway
    logs each attempt), then t2 on pod-b, which evicted them (cached 0)."""
    return [row("t1", [SYS, U1], at=0, conv="c-retry", pod="pod-a"),
            row("t1", [SYS, U1], at=5, conv="c-retry", pod="pod-b"),
            row("t2", [SYS, U1, A1, U2], at=60, conv="c-retry", pod="pod-b", cached=0)]


def test_a_retry_under_the_same_request_id_is_a_predecessor_of_its_own(store) -> None:  # type: ignore[no-untyped-def]
    """A request's identity is (request_id, ts), as the store keeps it (docs/miss-causes.md): the reference's index
    kept only the first row of an id, so t2's previous turn was the first attempt on pod-a (`routed_away`) where
    the store job took the retry on t2's own pod (`evicted`). Found by a hostile hunt."""
    rows = retried_under_one_id()
    expected = {("evicted", "evicted_before_next_turn"): rows[0]["prompt_tokens"] // B * B,
                ("unavoidable", ""): rows[2]["prompt_tokens"] - rows[0]["prompt_tokens"] // B * B}
    verdict = a.judge(rows[2], a.PredecessorIndex(rows).find(rows[2]), B)
    assert (verdict.predecessor_pod, verdict.predecessor_kind) == ("pod-b", "previous_turn"), verdict
    assert store_causes(store, rows)["t2"] == expected
    assert {(r.cause, r.sub_cause): r.tokens for r in a.attribute(rows, default_block_size=B)
            if r.request_id == "t2"} == expected


def test_a_row_given_twice_is_answered_once() -> None:
    """The reference answers each (request_id, ts) once, as the store does: a row given twice (a redelivered copy)
    no longer doubles its missed tokens."""
    (t1,) = retried_under_one_id()[:1]
    rows = a.attribute([t1, dict(t1)], default_block_size=B)
    assert sum(r.tokens for r in rows) == t1["prompt_tokens"] - t1["cached_tokens"]

